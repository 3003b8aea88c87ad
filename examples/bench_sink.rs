//! A hello-world hyper service for load tests, bare or behind `FenceLayer` on a sled store.
//!
//! ```text
//! cargo run --release --example bench_sink -- bare   127.0.0.1:9001
//! cargo run --release --example bench_sink -- fenced 127.0.0.1:9002 /tmp/bench-sink-data
//! cargo run --release --example bench_sink -- seed   /tmp/bench-sink-data 1000000
//! cargo run --release --example bench_sink -- proxy  127.0.0.1:9003 127.0.0.1:9001
//! ```
//! `proxy` is the least a hyper reverse proxy does (hyper-util's pooled client, no fence, no
//! header rewriting, no task per request): the floor `fence proxy` is built on, measured beside
//! it and nginx.
//! `fenced` caches up to `CACHE` jobs (environment, default 1,000,000) and answers
//! `GET /_stats` with `cached_jobs hits misses rss_bytes`. `seed` stores generation 1 for the
//! jobs `s-0` .. `s-<N-1>` the way `SledStore` keeps them (in bulk, then one flush), for the
//! scale runs. Used by `bench/sink_load.sh` and `bench/sink_scale.sh`.

use std::convert::Infallible;

use bytes::Bytes;
use fence_sink::{FenceLayer, SledStore};
use http_body_util::{Either, Full};
use hyper::{Request, Response, StatusCode, body::Incoming, server::conn::http1};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioIo},
    service::TowerToHyperService,
};
use tower::{Layer, ServiceExt, service_fn};

async fn hello<B>(_req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"hello\n"))))
}

/// Stores generation 1 for jobs `s-0` .. `s-<jobs-1>` the way `SledStore` keeps them.
fn seed(dir: &str, jobs: u64) -> Result<(), Box<dyn std::error::Error>> {
    let db = fence_storage::disk::DurableDb::open(dir)?;
    let tree = db.tree("generations")?;
    let started = std::time::Instant::now();
    for i in 0..jobs {
        tree.insert(format!("s-{i}").as_bytes(), &1u64.to_be_bytes())?;
        if (i + 1) % 100_000 == 0 {
            db.flush_now()?;
            eprint!("\rseeded {} of {jobs} jobs", i + 1);
        }
    }
    db.flush_now()?;
    eprintln!(" in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, addr) = match args.as_slice() {
        [mode, addr, ..] => (mode.as_str(), addr.as_str()),
        _ => {
            return Err("usage: bench_sink bare|fenced ADDR [DATA_DIR] | seed DATA_DIR JOBS | proxy ADDR UPSTREAM".into());
        }
    };
    if mode == "seed" {
        let jobs = args.get(2).ok_or("seed needs a job count")?.parse()?;
        return seed(addr, jobs);
    }
    if mode == "proxy" {
        let upstream = args.get(2).ok_or("proxy needs an UPSTREAM address")?;
        return proxy(addr, upstream).await;
    }
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let fence = match mode {
        "bare" => None,
        "fenced" => {
            let dir = args.get(2).ok_or("fenced mode needs a DATA_DIR")?;
            let cache = std::env::var("CACHE").map_or(Ok(1_000_000), |c| c.parse())?;
            Some(FenceLayer::new(SledStore::open(dir)?).max_cached_jobs(cache))
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
                let fenced = layer.layer(service_fn(hello));
                let layer = layer.clone();
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let (fenced, layer) = (fenced.clone(), layer.clone());
                    async move {
                        if req.uri().path() == "/_stats" {
                            let s = layer.cache_stats();
                            let line = format!(
                                "{} {} {} {}\n",
                                s.cached_jobs,
                                s.hits,
                                s.misses,
                                fence_suite::resident_bytes().unwrap_or(0)
                            );
                            return Ok(Response::new(Either::Right(Full::new(Bytes::from(line)))));
                        }
                        Ok::<_, Infallible>(fenced.oneshot(req).await?.map(Either::Left))
                    }
                });
                tokio::spawn(async move {
                    http1::Builder::new()
                        .serve_connection(io, TowerToHyperService::new(svc))
                        .await
                });
            }
        }
    }
}

/// Forwards every request to `upstream` through hyper-util's pooled client, nothing more.
async fn proxy(addr: &str, upstream: &str) -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build(connector);
    let base: std::sync::Arc<str> = format!("http://{upstream}").into();
    println!("proxy on http://{addr} to {base}");
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (client, base) = (client.clone(), base.clone());
        let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
                match format!("{base}{target}").parse() {
                    Ok(uri) => *req.uri_mut() = uri,
                    Err(_) => return Ok(status(StatusCode::BAD_REQUEST)),
                }
                Ok::<_, Infallible>(match client.request(req).await {
                    Ok(response) => response.map(Either::Left),
                    Err(_) => status(StatusCode::BAD_GATEWAY),
                })
            }
        });
        tokio::spawn(async move {
            http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
        });
    }
}

fn status(code: StatusCode) -> Response<Either<Incoming, Full<Bytes>>> {
    let mut response = Response::new(Either::Right(Full::new(Bytes::new())));
    *response.status_mut() = code;
    response
}
