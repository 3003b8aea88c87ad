//! Expiring job leases that carry ownership all the way to the side effect.
//!
//! - [`LeaseStore`]: shared storage of `job, owner, lease_until, generation, state`, one
//!   atomic decision per call, expiry decided on the store's own clock. Backends:
//!   [`SledLeaseStore`] (embedded, durable), [`HttpLeaseStore`] (a `fence server`),
//!   `PgLeaseStore` (feature `postgres`) and [`MemoryLeaseStore`] (tests).
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

mod backoff;
mod client;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
mod key;
mod layer;
mod lease;
mod owner;
mod store;

pub use backoff::Backoff;
pub use client::{ClaimError, LeaseClient};
pub use fence_core::{
    Ttl, TtlError,
    lease_api::LeaseState,
    secret::{LeaseKey, SecretHash},
};
pub use fence_storage::clock::{Clock, ManualClock, SystemClock, TokioClock};
pub use key::new_lease_key;
pub use layer::{FencedBody, Fencing, FencingLayer, LeaseLost, ResponseFuture};
pub use lease::{
    Checkpointer, FinishError, Lease, LeaseView, LossReason, TimingError, TokenUpdates,
};
pub use owner::default_owner;
pub use store::{
    BearerToken, ClaimTerms, Grant, HttpLeaseStore, HttpOptions, LeaseOp, LeaseRecord, LeaseStore,
    ListPage, MemoryLeaseStore, Outcome, Revocation, SigningLeaseStore, SledLeaseStore, SlotClaim,
    StoreError, TokenError, UrlError,
};

#[cfg(feature = "postgres")]
pub use store::{PgLeaseStore, PgTable};

/// `at + d`, or a hundred years after `at` when that is past what an instant can hold: a
/// wait or timeout of `Duration::MAX` is one without end, never a panic.
pub(crate) fn later(at: tokio::time::Instant, d: std::time::Duration) -> tokio::time::Instant {
    const FAR: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);
    at.checked_add(d)
        .or_else(|| at.checked_add(FAR))
        .unwrap_or(at)
}
