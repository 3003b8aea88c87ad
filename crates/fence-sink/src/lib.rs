//! The destination side of fence: a tower layer that rejects stale fencing tokens.
//!
//! It also replays duplicate `Idempotency-Key`s, so neither a stale lease holder nor a
//! duplicate retry produces an effect.
//!
//! - [`FenceLayer`] / [`Fence`]: per job, a token below the highest accepted gets 409; a
//!   higher one waits for older in-flight requests, is stored durably, then passes; see the
//!   [`fence`] module for an example and the wire contract for every status.
//! - Stores: [`SledStore`] (default, on disk) and [`MemoryStore`] (tests), behind the
//!   [`GenerationStore`] and [`IdempotencyStore`] traits.
//! - [`Fenced`]: what the fence accepted, in the request's extensions.
//!
//! The crate's modules stand on each other in floors, nothing importing from above: `store`
//! (and `body`, `budget`, `outcome`, `metrics`, `detach`) at the bottom; `reject`, `gate` and `idempotency` on
//! them; the middleware in `fence` at the top.

mod body;
mod budget;
mod detach;
mod discard;
pub mod fence;
mod gate;
pub mod idempotency;
pub mod metrics;
mod outcome;
pub mod refusals;
mod reject;
mod store;

#[cfg(feature = "postgres")]
pub use store::postgres;

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;

pub use body::{BodyTimeout, FenceBody, RequestBody, ResponseBody};
pub use fence::{
    Fence, FenceLayer, FencePredicate, Fenced, ForgetError, Maintenance, ResponseFuture,
};
pub use fence_storage::BoxError;
pub use gate::{CacheStats, JobFence};
pub use idempotency::IdempotencyConfig;
pub use outcome::{GrpcStatuses, OutcomeUnknown};
pub use refusals::PeerAddr;
pub use reject::is_grpc;
pub use store::{
    Attempt, Begin, DEFAULT_CLOCK_SKEW, DEFAULT_MAX_LEASE_TTL, Fingerprint, Finish,
    GenerationStore, IdempotencyStore, IdleJob, IdlePage, Loaded, MemoryStore, Prior, RunBounds,
    STAMP_AHEAD_MS, SinkSettings, SledStore, StoreError, StoredResponse, Verdict,
};
