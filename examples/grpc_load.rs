//! A small gRPC load tool for the ledger of `examples/proto/ledger.proto`: the servers to
//! compare, and a closed-loop load client. Used by `bench/grpc.sh`.
//!
//! ```text
//! cargo run --release --example grpc_load -- serve bare 127.0.0.1:19101
//! cargo run --release --example grpc_load -- serve layer 127.0.0.1:19102 /tmp/grpc-layer
//! cargo run --release --example grpc_load -- load http://127.0.0.1:19102 8 5
//! ```
//! `serve bare` is the tonic ledger alone; `serve layer` the same behind `FenceLayer` on sled
//! in DIR. `load URL CALLERS SECS` keeps CALLERS unary `Charge` calls in flight (over
//! CALLERS/8 rounded up HTTP/2 connections, at least one), each caller on a job of its own at
//! token 1, for SECS seconds, and prints `calls/s p50_us p99_us errors`.

use std::time::{Duration, Instant};

use fence_sink::{FenceLayer, SledStore};
use fence_suite::ledger::{
    Books,
    proto::{ChargeRequest, ledger_client::LedgerClient, ledger_server::LedgerServer},
};
use tonic::transport::{Channel, Server};

async fn serve(
    kind: &str,
    addr: &str,
    dir: Option<String>,
) -> Result<(), Box<dyn std::error::Error>> {
    let addr = addr.parse()?;
    let ledger = LedgerServer::new(Books::default());
    match kind {
        "bare" => Server::builder().add_service(ledger).serve(addr).await?,
        "layer" => {
            let dir = dir.ok_or("serve layer needs a data directory")?;
            let fence = FenceLayer::new(SledStore::open(&dir)?);
            Server::builder()
                .layer(fence)
                .add_service(ledger)
                .serve(addr)
                .await?;
        }
        other => return Err(format!("unknown server {other:?}: bare or layer").into()),
    }
    Ok(())
}

async fn load(url: String, callers: usize, secs: u64) -> Result<(), Box<dyn std::error::Error>> {
    let mut channels = Vec::new();
    for _ in 0..callers.div_ceil(8).max(1) {
        channels.push(Channel::from_shared(url.clone())?.connect().await?);
    }
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..callers)
        .map(|c| {
            let mut ledger = LedgerClient::new(channels[c % channels.len()].clone());
            tokio::spawn(async move {
                let (mut latencies, mut errors) = (Vec::new(), 0u64);
                let job = format!("load-{c}");
                while Instant::now() < until {
                    let mut request = tonic::Request::new(ChargeRequest {
                        account: job.clone(),
                        amount_cents: 1,
                    });
                    let m = request.metadata_mut();
                    m.insert("x-fencing-job", job.parse().expect("ascii"));
                    m.insert(
                        "x-fencing-token",
                        tonic::metadata::MetadataValue::from_static("1"),
                    );
                    let sent = Instant::now();
                    match ledger.charge(request).await {
                        Ok(_) => latencies.push(sent.elapsed().as_micros() as u64),
                        Err(_) => errors += 1,
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let (mut all, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (l, e) = t.await?;
        all.extend(l);
        errors += e;
    }
    all.sort_unstable();
    let at = |p: f64| {
        all.get(((all.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0)
    };
    println!(
        "{:.0} {} {} {errors}",
        all.len() as f64 / secs as f64,
        at(0.5),
        at(0.99)
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["serve", kind, addr, rest @ ..] => {
            serve(kind, addr, rest.first().map(|d| (*d).to_owned())).await
        }
        ["load", url, callers, secs] => {
            load((*url).to_owned(), callers.parse()?, secs.parse()?).await
        }
        _ => Err("usage: grpc_load serve bare|layer ADDR [DIR] | load URL CALLERS SECS".into()),
    }
}
