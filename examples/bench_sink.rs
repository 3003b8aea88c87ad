//! A hello-world hyper service for load tests, bare or behind `FenceLayer` on a sled store.
//!
//! ```text
//! cargo run --release --example bench_sink -- bare   127.0.0.1:9001
//! cargo run --release --example bench_sink -- fenced 127.0.0.1:9002 /tmp/bench-sink-data
//! ```
//! Used by `bench/sink_load.sh`.

use std::convert::Infallible;

use bytes::Bytes;
use fence_sink::{FenceLayer, SledStore};
use http_body_util::Full;
use hyper::{Request, Response, server::conn::http1};
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use tower::{ServiceBuilder, service_fn};

async fn hello<B>(_req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"hello\n"))))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, addr) = match args.as_slice() {
        [mode, addr, ..] => (mode.as_str(), addr.as_str()),
        _ => return Err("usage: bench_sink bare|fenced ADDR [DATA_DIR]".into()),
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let fence = match mode {
        "bare" => None,
        "fenced" => {
            let dir = args.get(2).ok_or("fenced mode needs a DATA_DIR")?;
            Some(FenceLayer::new(SledStore::open(dir)?).max_cached_jobs(1_000_000))
        }
        other => return Err(format!("unknown mode {other:?}").into()),
    };
    println!("{mode} on http://{addr}");
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(stream);
        match &fence {
            None => {
                tokio::spawn(async move {
                    http1::Builder::new()
                        .serve_connection(io, hyper::service::service_fn(hello))
                        .await
                });
            }
            Some(layer) => {
                let svc = ServiceBuilder::new()
                    .layer(layer.clone())
                    .service(service_fn(hello));
                tokio::spawn(async move {
                    http1::Builder::new()
                        .serve_connection(io, TowerToHyperService::new(svc))
                        .await
                });
            }
        }
    }
}
