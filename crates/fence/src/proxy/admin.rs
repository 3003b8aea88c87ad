//! The admin listener: `GET /metrics` and `GET /healthz`, apart from the proxied paths.

use std::{convert::Infallible, future::Future};

use bytes::Bytes;
use fence_core::{Problem, ProblemType};
use http::{
    HeaderValue, Method, Request, Response,
    header::{ALLOW, CONTENT_TYPE},
};
use http_body_util::Full;
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

use super::accept::accept_loop;

/// Serves `GET /metrics` (Prometheus text from `handle`) and `GET /healthz` on a separate admin
/// listener until `shutdown` resolves.
///
/// # Errors
///
/// None at present; the signature leaves room for listener failures.
pub async fn serve_admin(
    listener: TcpListener,
    handle: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    accept_loop(listener, shutdown, move |_| {
        let handle = handle.clone();
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let response = admin(&handle, &req);
            async move { Ok::<_, Infallible>(response) }
        })
    })
    .await;
    Ok(())
}

fn admin(handle: &PrometheusHandle, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let get = matches!(*req.method(), Method::GET | Method::HEAD);
    let text = |content_type: &'static str, body: String| {
        let mut response = Response::new(Full::from(body));
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    };
    match req.uri().path() {
        "/metrics" if get => text("text/plain; version=0.0.4", handle.render()),
        "/healthz" if get => text("text/plain; charset=utf-8", "ok\n".to_owned()),
        "/metrics" | "/healthz" => {
            let p = Problem::new(
                ProblemType::MethodNotAllowed,
                format!(
                    "{} {}: only GET and HEAD are allowed",
                    req.method(),
                    req.uri().path()
                ),
            );
            let mut response = p.to_response::<Full<Bytes>>();
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            response
        }
        path => Problem::new(
            ProblemType::NotFound,
            format!("{path} is not served here; see GET /metrics and GET /healthz"),
        )
        .to_response(),
    }
}
