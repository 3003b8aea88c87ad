//! Expiring job leases that carry ownership all the way to the side effect.
//!
//! - [`LeaseStore`]: shared storage of `job, owner, lease_until, generation, state`, one
//!   atomic verb per decision, expiry decided on the store's own clock. Backends:
//!   [`SledLeaseStore`] (embedded, durable) and [`MemoryLeaseStore`] (tests).
//! - [`LeaseClient`] and [`Lease`]: claim, renew in the background, and learn the moment the
//!   lease can no longer be trusted.
//! - [`FencingLayer`]: a tower layer that stamps `X-Fencing-Job` and `X-Fencing-Token` on
//!   outgoing requests and refuses to send once the lease is lost.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fence_lease::{LeaseClient, SledLeaseStore};
//!
//! let dir = tempfile::tempdir()?;
//! let client = LeaseClient::new(SledLeaseStore::open(dir.path())?);
//! let lease = client.claim("job-1".parse()?).await?;
//! println!("holding generation {}", lease.generation());
//! lease.complete().await?;
//! # Ok(()) }
//! ```

mod client;
mod clock;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
mod layer;
mod owner;
mod store;
mod ttl;

pub use client::{ClaimError, FinishError, Lease, LeaseClient, LeaseView, LossReason};
pub use clock::{Clock, ManualClock, SystemClock, TokioClock};
pub use layer::{Fencing, FencingLayer, LeaseLost, ResponseFuture};
pub use owner::default_owner;
pub use store::{
    BoxError, ClaimOutcome, FinishOutcome, Grant, HttpLeaseStore, LeaseRecord, LeaseState,
    LeaseStore, MemoryLeaseStore, RenewOutcome, SigningLeaseStore, SledLeaseStore, StoreError,
};
pub use ttl::{Ttl, TtlError};

#[cfg(feature = "postgres")]
pub use store::{PgLeaseStore, PgTable};
