//! An axum service protected by `FenceLayer`: stale lease holders get 409, duplicate
//! retries get the stored response, and the handler sees which token the fence accepted.
//!
//! ```text
//! cargo run --example axum_sink -- 127.0.0.1:3000 /tmp/axum-sink-data
//! curl -i -X POST localhost:3000/charges -H 'X-Fencing-Job: invoice-42' -H 'X-Fencing-Token: 8' -d 'amount=10'
//! curl -i -X POST localhost:3000/charges -H 'X-Fencing-Job: invoice-42' -H 'X-Fencing-Token: 7' -d 'amount=10'   # 409
//! ```

use axum::{Extension, Router, routing::post};
use fence_sink::{FenceLayer, Fenced, SledStore};

async fn charge(Extension(fenced): Extension<Fenced>, body: String) -> String {
    // Write fenced.token into your own row too, and the database itself can refuse older ones.
    format!(
        "charged for job {} under token {}: {body}\n",
        fenced.job, fenced.token
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:3000".into());
    // Without a directory, a fresh private one for this run: a fixed path under /tmp would
    // be shared by every run and every user of the host.
    let scratch;
    let dir = match args.next() {
        Some(dir) => dir,
        None => {
            scratch = tempfile::tempdir()?;
            scratch.path().display().to_string()
        }
    };

    let fence = FenceLayer::new(SledStore::open(&dir)?);
    // Sweeps expired idempotency records in the background while the service runs.
    let _maintenance = fence.spawn_maintenance();
    let app = Router::new().route("/charges", post(charge)).layer(fence);

    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("fenced axum service on http://{addr} (fence records in {dir})");
    axum::serve(listener, app).await?;
    Ok(())
}
