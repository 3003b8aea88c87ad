//! A plain hyper service protected by `FenceLayer`, without any framework.
//!
//! ```text
//! cargo run --example hyper_sink -- 127.0.0.1:3001
//! ```

use std::convert::Infallible;

use bytes::Bytes;
use fence_sink::{FenceLayer, Fenced, MemoryStore, RequestBody};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, body::Incoming, server::conn::http1};
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use tower::{ServiceBuilder, service_fn};

async fn effect(req: Request<RequestBody<Incoming>>) -> Result<Response<Full<Bytes>>, Infallible> {
    let fenced = req.extensions().get::<Fenced>().cloned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3001".into());
    // MemoryStore forgets on restart; use SledStore::open(dir) in production.
    let fence = FenceLayer::new(MemoryStore::new());
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
