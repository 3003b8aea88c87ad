//! `Idempotency-Key` handling: the first request of a (job, key) runs, duplicates replay it.
//!
//! After the fence admits a request, per (job, key) the first request runs and its response
//! is stored; a duplicate gets the stored response replayed byte for byte with
//! `Idempotent-Replayed: true`.
//!
//! ```
//! use fence_sink::{FenceLayer, IdempotencyConfig, MemoryStore};
//! use std::time::Duration;
//!
//! let layer = FenceLayer::new(MemoryStore::new()).idempotency(
//!     IdempotencyConfig::default()
//!         .retention(Duration::from_secs(3600))
//!         .max_response_body(256 * 1024)
//!         .store_statuses(|s| s.is_success()),
//! );
//! # let _ = layer;
//! ```

mod cap;
mod capture;
mod ended;
mod finish;
mod run;

use std::{fmt, sync::Arc, time::Duration};

use http::StatusCode;

pub(crate) use self::{
    finish::Finishing,
    run::{Keyed, ReadRequest, StreamsOn, attempt_id},
};

/// Which responses are stored for replay.
pub type StatusFilter = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// How `Idempotency-Key` is handled.
#[derive(Clone)]
pub struct IdempotencyConfig {
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) max_stored_bytes: u64,
    pub(crate) retention: Duration,
    pub(crate) in_flight_timeout: Duration,
    pub(crate) store_statuses: StatusFilter,
    pub(crate) sweep_every: Duration,
    pub(crate) store_timeout: Duration,
    pub(crate) scope_headers: Vec<http::HeaderName>,
}

impl Default for IdempotencyConfig {
    /// Request bodies up to 1 MiB fingerprinted, response bodies up to 1 MiB stored, records
    /// kept 24 h, in-flight records given up after 5 minutes, 2xx, 300 to 303 and 4xx stored (5xx
    /// forgotten so a retry runs again, and so are 408, 425 and 429: they say the request
    /// was not acted on and may be sent again later), expired records swept every minute,
    /// new keys refused while the records hold 4 GiB.
    fn default() -> Self {
        Self {
            max_request_body: 1 << 20,
            max_response_body: 1 << 20,
            max_stored_bytes: 4 << 30,
            retention: Duration::from_secs(24 * 3600),
            in_flight_timeout: Duration::from_secs(300),
            store_statuses: Arc::new(stored_by_default),
            sweep_every: Duration::from_secs(60),
            store_timeout: Duration::from_secs(5),
            scope_headers: Vec::new(),
        }
    }
}

pub(crate) use crate::store::clamped;

/// The default filter of [`IdempotencyConfig::store_statuses`]: 2xx, 300 to 303 and 4xx, but
/// for the three 4xx that ask for the same request again (RFC 9110 section 15.5.9, RFC 8470,
/// RFC 6585): replayed, a rate limit's 429 would answer every retry for the whole retention
/// although the step never ran. 300 to 303 are stored: a 303 See Other after a POST (post,
/// redirect, get) says the write was done, and forgotten, every retry ran it again (the
/// redirect is followed with a GET, which is not fenced). Not 307 and 308, which ask for the
/// same request again elsewhere (a client follows them with the same method, body and
/// `Idempotency-Key`: stored, the follow-up to another path would be a key mismatch), nor
/// 304, which answers a conditional read.
fn stored_by_default(status: StatusCode) -> bool {
    let again = [
        StatusCode::REQUEST_TIMEOUT,
        StatusCode::TOO_EARLY,
        StatusCode::TOO_MANY_REQUESTS,
    ];
    status.is_success()
        || (300..=303).contains(&status.as_u16())
        || (status.is_client_error() && !again.contains(&status))
}

impl fmt::Debug for IdempotencyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyConfig")
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field("max_stored_bytes", &self.max_stored_bytes)
            .field("retention", &self.retention)
            .field("in_flight_timeout", &self.in_flight_timeout)
            .field("scope_headers", &self.scope_headers)
            .finish_non_exhaustive()
    }
}

impl IdempotencyConfig {
    /// Reads request bodies up to `bytes` to fingerprint them; a larger one gets 413.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// Stores response bodies up to `bytes`; a larger response is passed through and its
    /// record says it cannot be replayed (a retry gets 409).
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.max_response_body = bytes;
        self
    }

    /// Refuses a new key while the stored records hold `bytes` (default 4 GiB): 503
    /// `overloaded` with `Retry-After` (the [sweep interval](Self::sweep_every)), and the
    /// service is not called; keys already recorded still replay (or get their 409 or 422).
    /// Counted are the records' bytes as the store keeps them. A request admitted under the
    /// cap whose answer comes once the records hold it is remembered as not replayable (a
    /// retry gets 409), so the records pass `bytes` by at most the answers stored at the same
    /// moment, which the memory budget bounds (every answer to store is held there while it
    /// arrives). Once the records hold three quarters of the cap, a job whose own records
    /// hold a quarter of it or more gets no new keys either (checked again as its answers
    /// arrive), for stores that count per job ([`IdempotencyStore::job_stored_bytes`](crate::IdempotencyStore::job_stored_bytes)):
    /// one job cannot fill the store, and the last quarter stays for the others. Without the cap, records are bounded only by retention × rate × answer size
    /// (a day at 50 keyed requests a second answering 1 MiB is 4 TB), and on sled they
    /// share the disk with the generations: a full disk fails every job. Applies to the
    /// stores that count their bytes ([`IdempotencyStore::stored_bytes`](crate::IdempotencyStore::stored_bytes):
    /// memory and sled, not PostgreSQL); `u64::MAX` turns it off.
    pub fn max_stored_bytes(mut self, bytes: u64) -> Self {
        self.max_stored_bytes = bytes;
        self
    }

    /// Keeps completed records this long.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = clamped(retention);
        self
    }

    /// Gives up an in-flight record after this long (a crash mid-request leaves one), so the
    /// key becomes usable again. The layer never gives one up sooner than an attempt can
    /// still act: the [body deadline](crate::FenceLayer::body_timeout) plus the
    /// [longest request](crate::FenceLayer::longest_request) plus the
    /// [store timeout](Self::store_timeout) (the record's begin, which the request waits for
    /// before the service has it) plus the
    /// [unknown-outcome hold](crate::FenceLayer::unknown_outcome_hold), whatever is set here.
    /// That floor takes `longest_request` as the longest a handler really runs: one that may
    /// run longer (or a layer told `longest_request(ZERO)` because its effects die with the
    /// process, whose handlers still run a while) needs a longer timeout set here.
    pub fn in_flight_timeout(mut self, timeout: Duration) -> Self {
        self.in_flight_timeout = clamped(timeout);
        self
    }

    /// Stores the responses whose status passes `filter`; others are forgotten, so a retry
    /// runs again.
    pub fn store_statuses(
        mut self,
        filter: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.store_statuses = Arc::new(filter);
        self
    }

    /// Gives the store this long per call before answering 503 (default 5 s).
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = clamped(timeout);
        self
    }

    /// Makes the values of these request headers part of what makes two requests "the same"
    /// (for a multi-tenant upstream: `authorization`): a stored answer is then replayed only
    /// to a request with the same values, and the same key with other values is 422
    /// `idempotency-key-mismatch` instead of another tenant's answer. Off by default, because
    /// a derived key (`lease.idempotency_key(step)`) must deduplicate across holders that send
    /// other credentials.
    pub fn scope_headers(mut self, names: impl IntoIterator<Item = http::HeaderName>) -> Self {
        self.scope_headers = names.into_iter().collect();
        self
    }

    /// Sweeps expired records this often (see
    /// [`FenceLayer::spawn_maintenance`](crate::FenceLayer::spawn_maintenance)).
    pub fn sweep_every(mut self, every: Duration) -> Self {
        self.sweep_every = clamped(every);
        self
    }
}
