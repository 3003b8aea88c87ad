//! The admin listener: metrics, liveness and readiness, apart from the proxied paths.
//!
//! - `GET /metrics`: Prometheus text.
//! - `GET /healthz`: 200 while the fence's store answers, 503 `store-unavailable` when it
//!   does not (the proxy then refuses fenced requests too).
//! - `GET /readyz`: 200 when the store answers and the upstream accepts a connection, 503
//!   otherwise, naming which.

use std::{convert::Infallible, future::Future, pin::Pin, sync::Arc, time::Duration};

use bytes::Bytes;
use fence_core::{JobId, Problem, ProblemType};
use fence_sink::GenerationStore;
use http::{
    HeaderValue, Method, Request, Response, StatusCode,
    header::{ALLOW, CONTENT_TYPE},
};
use http_body_util::Full;
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::listen::Listener;

type Check = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// How the admin listener tells whether the proxy can work: its store answers, its upstream
/// accepts connections.
#[derive(Clone)]
pub struct Health {
    store: Arc<dyn Fn() -> Check + Send + Sync>,
    upstream: Option<String>,
}

/// How long one probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl Health {
    /// Probes `store` by reading a job's highest generation, and `upstream` (`host:port`,
    /// when given) by opening a connection.
    pub fn new<St: GenerationStore>(store: Arc<St>, upstream: Option<String>) -> Self {
        let probe: JobId = "fence-healthz".parse().expect("valid job id");
        let store: Arc<dyn Fn() -> Check + Send + Sync> = Arc::new(move || {
            let (store, probe) = (store.clone(), probe.clone());
            Box::pin(async move {
                match tokio::time::timeout(PROBE_TIMEOUT, store.highest(&probe)).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(format!(
                        "the fence store failed: {}",
                        fence_storage::error_chain(&e)
                    )),
                    Err(_) => Err(format!(
                        "the fence store did not answer within {PROBE_TIMEOUT:?}"
                    )),
                }
            })
        });
        Self { store, upstream }
    }

    async fn upstream(&self) -> Result<(), String> {
        let Some(addr) = &self.upstream else {
            return Ok(());
        };
        match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("the upstream {addr} refuses connections: {e}")),
            Err(_) => Err(format!(
                "the upstream {addr} did not accept a connection within {PROBE_TIMEOUT:?}"
            )),
        }
    }
}

/// Serves the admin paths on `listener` until `shutdown` resolves.
///
/// # Errors
/// None at present; the signature leaves room for listener failures.
pub async fn serve_admin(
    listener: Listener,
    handle: PrometheusHandle,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    crate::listen::serve(listener, shutdown, move |_| {
        let (handle, health) = (handle.clone(), health.clone());
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let (handle, health) = (handle.clone(), health.clone());
            async move { Ok::<_, Infallible>(admin(&handle, &health, &req).await) }
        })
    })
    .await;
    Ok(())
}

async fn admin(
    handle: &PrometheusHandle,
    health: &Health,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    let get = matches!(*req.method(), Method::GET | Method::HEAD);
    let text = |content_type: &'static str, body: String| {
        let mut response = Response::new(Full::from(body));
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    };
    let unavailable = |detail: String| {
        let mut response =
            Problem::new(ProblemType::StoreUnavailable, detail).to_response::<Full<Bytes>>();
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        response
    };
    match req.uri().path() {
        "/metrics" if get => text("text/plain; version=0.0.4", handle.render()),
        "/healthz" if get => match (health.store)().await {
            Ok(()) => text("text/plain; charset=utf-8", "ok\n".to_owned()),
            Err(why) => unavailable(why),
        },
        "/readyz" if get => {
            let store = (health.store)().await;
            match store.and(health.upstream().await) {
                Ok(()) => text("text/plain; charset=utf-8", "ready\n".to_owned()),
                Err(why) => {
                    let mut response = Problem::new(ProblemType::UpstreamUnavailable, why)
                        .to_response::<Full<Bytes>>();
                    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    response
                }
            }
        }
        "/metrics" | "/healthz" | "/readyz" => {
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
            format!("{path} is not served here; see GET /metrics, /healthz and /readyz"),
        )
        .to_response(),
    }
}
