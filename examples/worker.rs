//! A worker that claims a job, makes fenced HTTP requests while it holds the lease, and
//! stops the moment the lease is lost.
//!
//! ```text
//! cargo run --example worker                       # against a local echo server
//! cargo run --example worker -- http://127.0.0.1:8080/effects
//! ```

use std::time::Duration;

use bytes::Bytes;
use fence_lease::{LeaseClient, SledLeaseStore, Ttl};
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower::{Service, ServiceBuilder, ServiceExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let target = match std::env::args().nth(1) {
        Some(url) => url,
        None => {
            let (addr, mut seen) = fence_suite::spawn_echo_server().await?;
            tokio::spawn(async move {
                while let Some(s) = seen.recv().await {
                    println!("  destination saw job={:?} token={:?}", s.job, s.token);
                }
            });
            format!("http://{addr}/effects")
        }
    };

    // The lease store; in production, a `fence server` shared by all workers. The directory
    // is removed when `dir` is dropped, on every return.
    let dir = tempfile::tempdir()?;
    let store = SledLeaseStore::open(dir.path())?;
    let client = LeaseClient::new(store).ttl(Ttl::from_millis(2_000)?);
    let lease = client.claim("invoice-42".parse()?).await?;
    println!(
        "claimed invoice-42 as {} with generation {}",
        client.owner_id(),
        lease.generation()
    );

    // Every request through `http` carries X-Fencing-Job and X-Fencing-Token, and none is
    // sent once the lease is lost.
    let mut http = ServiceBuilder::new()
        .layer(lease.fencing_layer())
        .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());

    for step in 1..=3 {
        let request =
            http::Request::post(&target).body(Full::new(Bytes::from(format!("step {step}"))))?;
        tokio::select! {
            () = lease.lost() => {
                eprintln!("lease lost: stopping before step {step}");
                return Ok(());
            }
            response = http.ready().await?.call(request) => {
                let status = response?.status();
                println!("step {step}: {status}");
                if !status.is_success() {
                    // A 409: a newer holder exists; a 502 or 504 may still land. Never
                    // complete: the lease, dropped, expires (and lock-delay applies).
                    return Err(format!("step {step} was answered {status}").into());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let record = lease.complete().await?;
    println!(
        "completed: generation {} is {}",
        record.generation,
        record.state.as_str()
    );
    Ok(())
}
