//! A worker calling a gRPC service under a lease: `FencingLayer` on a tonic `Channel` adds
//! `x-fencing-job` and `x-fencing-token` to every call of a generated client, and refuses
//! to send once the lease is lost. Shows the worked example against `grpc_sink`:
//!
//! ```text
//! cargo run --example grpc_sink -- 127.0.0.1:50051 /tmp/grpc-sink-data
//! cargo run --example grpc_worker -- http://127.0.0.1:50051 [http://127.0.0.1:7700]
//! ```
//! With a lease server URL (`fence server`) the leases come from it; without one, from a
//! store in this process. Worker A charges, stalls past its lease; B takes the job over and
//! charges; A's call, delayed in the network with A's token, is answered `ABORTED`.

use std::{sync::Arc, time::Duration};

use fence_lease::{HttpLeaseStore, Lease, LeaseClient, LeaseStore, MemoryLeaseStore, Ttl};
use fence_suite::ledger::proto::{ChargeRequest, ledger_client::LedgerClient};
use tonic::transport::Channel;
use tower::ServiceBuilder;

async fn charge<S: LeaseStore>(
    channel: &Channel,
    lease: &Lease<S>,
    who: &str,
) -> Result<u64, tonic::Status> {
    // The generated client over the channel, stamped with this lease.
    let fenced = ServiceBuilder::new()
        .layer(lease.fencing_layer())
        .service(channel.clone());
    let mut ledger = LedgerClient::new(fenced);
    let request = ChargeRequest {
        account: format!("acct-{who}"),
        amount_cents: 4200,
    };
    Ok(ledger.charge(request).await?.into_inner().entry)
}

async fn run<S: LeaseStore>(store: S, sink: String) -> Result<(), Box<dyn std::error::Error>> {
    let channel = Channel::from_shared(sink)?.connect().await?;
    let store = Arc::new(store);
    let ttl = Ttl::from_millis(1_000)?;
    let job = format!("grpc-invoice-{}", std::process::id()).parse::<fence_core::JobId>()?;
    let a = LeaseClient::from_arc(store.clone())
        .owner("worker-a".parse()?)
        .ttl(ttl);
    let b = LeaseClient::from_arc(store.clone())
        .owner("worker-b".parse()?)
        .ttl(ttl);

    let lease_a = a.claim(job.clone()).await?;
    let token_a = lease_a.token_string().unwrap_or_default();
    println!(
        "A holds {job} at generation {}: entry {}",
        lease_a.generation(),
        charge(&channel, &lease_a, "a").await?
    );
    // A stalls: its keeper cannot renew, the lease runs out, B takes over.
    drop(lease_a);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let lease_b = b.claim(job.clone()).await?;
    println!(
        "B holds {job} at generation {}: entry {}",
        lease_b.generation(),
        charge(&channel, &lease_b, "b").await?
    );

    // A's call, sent with A's token before the stall and delayed in the network.
    let mut raw = LedgerClient::new(channel.clone());
    let mut late = tonic::Request::new(ChargeRequest {
        account: "acct-a".into(),
        amount_cents: 4200,
    });
    late.metadata_mut()
        .insert("x-fencing-job", job.as_str().parse()?);
    late.metadata_mut()
        .insert("x-fencing-token", token_a.parse()?);
    match raw.charge(late).await {
        Ok(reply) => println!(
            "A's late call went through (entry {}): NOT fenced",
            reply.into_inner().entry
        ),
        Err(status) => println!(
            "A's late call: {:?} {:?}, fence-highest {:?}",
            status.code(),
            status.message(),
            status.metadata().get("fence-highest")
        ),
    }
    lease_b.complete().await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let sink = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:50051".into());
    match args.next() {
        Some(server) => run(HttpLeaseStore::new(&server)?, sink).await,
        None => run(MemoryLeaseStore::new(), sink).await,
    }
}
