//! A worker against a shared `fence server`: the lease client over HTTP(S) with a bearer
//! secret, renewing in the background, its write fenced, and stopping the moment the lease
//! is lost. The README's "Using the lease client from Rust" is the part between the
//! `README` markers, word for word (a test checks that).
//!
//! ```text
//! fence server --listen 127.0.0.1:7700 --data-dir fence-data/leases &
//! fence proxy --listen 127.0.0.1:7800 --upstream http://127.0.0.1:8080 --data-dir fence-data/proxy &
//! cargo run --example http_worker -- http://127.0.0.1:7700 http://127.0.0.1:7800/charges
//! ```

use bytes::Bytes;
use fence_lease::{BearerToken, HttpLeaseStore, HttpOptions, LeaseClient, LeaseLost, Ttl};
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower::{Service, ServiceBuilder, ServiceExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let server = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:7700".into());
    let target = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:7800/charges".into());

    // README: begin
    // One `fence server` shared by every worker (a local store would be seen by no one else).
    let options = HttpOptions {
        ca_cert: std::env::var_os("FENCE_CA_CERT").map(Into::into),
        bearer: std::env::var("FENCE_AUTH_TOKEN")
            .ok()
            .map(BearerToken::new)
            .transpose()?,
        ..HttpOptions::default()
    };
    let client = LeaseClient::new(HttpLeaseStore::with_options(&server, options)?)
        .ttl(Ttl::from_millis(30_000)?);
    let lease = client.claim("invoice-42".parse()?).await?;

    // Every request carries X-Fencing-Job / X-Fencing-Token; none is sent once the lease is lost.
    let mut http = ServiceBuilder::new()
        .layer(lease.fencing_layer())
        .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());

    let charge = http::Request::post(&target).body(Full::new(Bytes::from("amount=10")))?;
    // The layer cuts the call at the loss: the error says whether the charge had left.
    match http.ready().await?.call(charge).await {
        Ok(response) if response.status().is_success() => {
            println!("charged: {}", response.status());
            lease.complete().await?; // only once the charge succeeded
        }
        // 409: a newer holder exists; a 502 or 504 may still land. Never complete: the lease,
        // dropped, expires at the server, and its lock-delay applies.
        Ok(response) => return Err(format!("the charge was answered {}", response.status()).into()),
        Err(e) => match e.downcast_ref::<LeaseLost>() {
            Some(lost) if lost.in_flight => {
                eprintln!("lease lost with the charge on its way: its outcome is unknown")
            }
            Some(_) => eprintln!("lease lost: the charge was not sent"),
            None => return Err(e),
        },
    }
    // README: end
    Ok(())
}
