//! A plain hyper service protected by `FenceLayer`, without any framework.
//!
//! ```text
//! cargo run --example hyper_sink -- 127.0.0.1:3001
//! ```

use std::convert::Infallible;

use bytes::Bytes;
use fence_sink::{BodyTimeout, FenceLayer, Fenced, MemoryStore, RequestBody};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode, body::Incoming, server::conn::http1};
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use tower::{ServiceBuilder, service_fn};

async fn effect(req: Request<RequestBody<Incoming>>) -> Result<Response<Full<Bytes>>, Infallible> {
    let fenced = req.extensions().get::<Fenced>().cloned();
    // A body that failed (cut at the layer's body deadline, or the client went away) is
    // not applied as an empty one: nothing happens, and the answer says so.
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => {
            let status = if timed_out(e.as_ref()) {
                StatusCode::REQUEST_TIMEOUT
            } else {
                StatusCode::BAD_REQUEST
            };
            let mut answer = Response::new(Full::new(Bytes::from(format!(
                "the body did not arrive whole ({e}); nothing was applied\n"
            ))));
            *answer.status_mut() = status;
            return Ok(answer);
        }
    };
    let text = match fenced {
        Some(f) => format!(
            "applied {} bytes for job {} under token {}\n",
            body.len(),
            f.job,
            f.token
        ),
        None => "unfenced request\n".to_owned(),
    };
    Ok(Response::new(Full::new(Bytes::from(text))))
}

/// Whether the body failed at the layer's body deadline (the layer answers the client 408
/// `urn:fence:body-timeout` for it unless the service answered a success).
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(e);
    while let Some(e) = source {
        if e.is::<BodyTimeout>() {
            return true;
        }
        source = e.source();
    }
    false
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3001".into());
    // MemoryStore forgets on restart; use SledStore::open(dir) in production.
    let fence = FenceLayer::new(MemoryStore::new());
    // Sweeps expired idempotency records in the background while the service runs.
    let _maintenance = fence.spawn_maintenance();
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("fenced hyper service on http://{addr}");
    loop {
        let (stream, _) = listener.accept().await?;
        let svc = ServiceBuilder::new()
            .layer(fence.clone())
            .service(service_fn(effect));
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc))
                .await;
        });
    }
}
