//! A tonic gRPC service protected by `FenceLayer`: a stale lease holder's call is answered
//! `ABORTED` with the `fence-highest` metadata and never reaches the ledger; a retried call
//! with the same `idempotency-key` gets the stored answer, trailers included.
//!
//! ```text
//! cargo run --example grpc_sink -- 127.0.0.1:50051 /tmp/grpc-sink-data
//! cargo run --example grpc_worker -- http://127.0.0.1:50051   # in another terminal
//! ```
//! The service is `examples/proto/ledger.proto`; `fence proxy` in front of any gRPC server
//! does the same without code (contract section 9).

use fence_sink::{FenceLayer, SledStore};
use fence_suite::ledger::{Books, proto::ledger_server::LedgerServer};
use tonic::transport::Server;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:50051".into());
    let dir = args.next().unwrap_or_else(|| {
        std::env::temp_dir()
            .join("fence-grpc-sink")
            .display()
            .to_string()
    });

    let fence = FenceLayer::new(SledStore::open(&dir)?);
    // Sweeps expired idempotency records in the background while the service runs.
    let _maintenance = fence.spawn_maintenance();
    println!("fenced gRPC ledger on {addr} (fence records in {dir})");
    Server::builder()
        .layer(fence)
        .add_service(LedgerServer::new(Books::default()))
        .serve(addr.parse()?)
        .await?;
    Ok(())
}
