//! The destination side of fence: a tower layer that rejects stale fencing tokens and
//! replays duplicate `Idempotency-Key`s, so no stale lease holder and no duplicate retry
//! produces an effect.
//!
//! - [`FenceLayer`] / [`Fence`]: per job, a token below the highest accepted gets 409; a
//!   higher one waits for older in-flight requests, is stored durably, then passes; see the
//!   [`fence`] module for an example and the wire contract for every status.
//! - Stores: [`SledStore`] (default, on disk) and [`MemoryStore`] (tests), behind the
//!   [`GenerationStore`] and [`IdempotencyStore`] traits.
//! - [`Fenced`]: what the fence accepted, in the request's extensions.

mod fence;
pub mod idempotency;
mod metrics;
mod store;

#[cfg(feature = "postgres")]
pub use store::postgres;

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;

pub use fence::{
    CacheStats, Fence, FenceLayer, FencePredicate, Fenced, RequestBody, ResponseBody,
    ResponseFuture,
};
pub use idempotency::{Fingerprint, IdempotencyConfig, OutcomeUnknown, StoredResponse};
pub use store::{
    Begin, BoxError, Finish, GenerationStore, IdempotencyStore, MemoryStore, SledStore, StoreError,
    Verdict,
};

/// `error: cause: cause` for one-line logs and problem details.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
