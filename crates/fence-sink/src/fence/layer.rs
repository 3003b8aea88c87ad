//! [`FenceLayer`]: builds the fence's shared state once and wraps services in [`Fence`].

use std::{sync::Arc, time::Duration};

pub use super::shared::FencePredicate;
use http::{Method, request::Parts};
use tower_layer::Layer;

use super::{
    Fence,
    maintenance::{Forgetting, Maintenance},
    shared::{Config, Shared},
    signature::Signatures,
};
use crate::{
    GenerationStore, IdempotencyConfig, IdempotencyStore,
    gate::{CacheStats, Gates, JobFence, Limits, Restart},
    idempotency::clamped,
};
use fence_storage::clock::{Clock, SystemClock};

/// Why [`FenceLayer::forget_after`] refused a setting: forgetting is safe only when every
/// token of an older generation has expired by then (contract section 8).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ForgetError {
    /// No verify keys: an unsigned token carries no expiry the sink can trust.
    #[error(
        "forgetting jobs needs signed tokens: without verify keys a stale token cannot be told from a live one once its job is forgotten"
    )]
    Unsigned,
    /// Shorter than the longest lease plus twice the clock skew.
    #[error(
        "forget-after {after:?} is shorter than the longest lease TTL ({max_ttl:?}) plus twice the clock skew ({skew:?}): a stale token could still be unexpired when its job is forgotten"
    )]
    TooSoon {
        /// The setting refused.
        after: Duration,
        /// The longest TTL the lease server grants.
        max_ttl: Duration,
        /// The allowed clock skew.
        skew: Duration,
    },
}

/// Wraps services in [`Fence`]. Build one layer per store and clone it: every clone shares
/// the in-memory gates, also one whose settings a builder method changed; two layers built
/// separately over one sled or memory store keep two views of each job. Per job, requests
/// with a token below the highest accepted are rejected with 409; a higher token is stored
/// durably as the job's highest at once, then waits for older requests to finish before it
/// passes; duplicate `Idempotency-Key`s are replayed.
///
/// Building a layer starts nothing: call [`spawn_maintenance`](Self::spawn_maintenance) to
/// sweep expired idempotency records in the background.
///
/// ```
/// use fence_sink::{FenceLayer, MemoryStore};
/// use std::time::Duration;
///
/// let layer = FenceLayer::new(MemoryStore::new())
///     .fence_methods([http::Method::POST, http::Method::PUT])
///     .drain_timeout(Duration::from_secs(2))
///     .max_cached_jobs(10_000);
/// # let _ = layer;
/// ```
pub struct FenceLayer<St> {
    pub(super) shared: Arc<Shared<St>>,
}

impl<St> Clone for FenceLayer<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St> std::fmt::Debug for FenceLayer<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let config = &self.shared.config;
        f.debug_struct("FenceLayer")
            .field("methods", &config.methods)
            .field("require_token", &config.require_token)
            .field("idempotency", &config.idempotency)
            .field("limits", &config.limits)
            .finish_non_exhaustive()
    }
}

impl<St: GenerationStore + IdempotencyStore> FenceLayer<St> {
    /// Fences every method but GET, HEAD, OPTIONS and TRACE (so an unknown or extension
    /// method fails closed), requires the fencing headers on them, keeps idempotency records,
    /// caches up to 100,000 jobs, waits up to 5 s for the store and up to 10 s for older
    /// requests to drain before a newer generation passes, gives a fenced body 30 s from
    /// admission, holds a request of unknown outcome in flight for 60 s, and holds at most
    /// 256 MiB of bodies in memory.
    pub fn new(store: St) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// As [`new`](Self::new), for a store shared with other code.
    pub fn from_arc(store: Arc<St>) -> Self {
        let config = Config {
            methods: None,
            predicate: None,
            require_token: true,
            idempotency: Some(IdempotencyConfig::default()),
            run_to_completion: false,
            signatures: None,
            limits: Limits {
                max_cached_jobs: 100_000,
                store_timeout: Duration::from_secs(5),
                drain_timeout: Duration::from_secs(10),
                restart: Restart {
                    longest_request: Duration::from_secs(60),
                    body: Duration::from_secs(30),
                    hold: Duration::from_secs(60),
                    before_service: IdempotencyConfig::default().store_timeout,
                    after_answer: Duration::from_secs(30),
                    heed_recorded: true,
                },
            },
            body_timeout: Duration::from_secs(30),
            unknown_outcome_hold: Duration::from_secs(60),
            unknown_grpc: crate::GrpcStatuses::DEFAULT,
            max_buffered_bytes: 256 << 20,
            clock: Arc::new(SystemClock::new()),
            clock_skew: crate::store::DEFAULT_CLOCK_SKEW,
            max_lease_ttl: crate::store::DEFAULT_MAX_LEASE_TTL,
            forget_after: None,
        };
        Self {
            shared: Arc::new(Shared {
                config,
                gates: Arc::new(Gates::new(store)),
                budget: Arc::default(),
            }),
        }
    }

    /// This layer's own configuration (copied first if a clone shares it).
    fn config(&mut self) -> &mut Config {
        &mut Arc::make_mut(&mut self.shared).config
    }

    /// Fences requests with these methods, in any letter case (`post` too, which an upstream
    /// may read as POST); others pass unfenced (the default fences every method but GET,
    /// HEAD, OPTIONS and TRACE, in exactly those capitals).
    pub fn fence_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        let config = self.config();
        config.methods = Some(methods.into_iter().collect());
        config.predicate = None;
        self
    }

    /// Fences the requests for which `predicate` returns true (methods, paths, anything in
    /// the request head), instead of a method list.
    pub fn fence_when(
        mut self,
        predicate: impl Fn(&Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.config().predicate = Some(Arc::new(predicate));
        self
    }

    /// Lets fenced requests without fencing headers through instead of answering 428.
    pub fn allow_missing_token(mut self) -> Self {
        self.config().require_token = false;
        self
    }

    /// Answers 428 to fenced requests without fencing headers (the default).
    pub fn require_token(mut self) -> Self {
        self.config().require_token = true;
        self
    }

    /// Gives the store this long per call before answering 503 (default 5 s).
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.config().limits.store_timeout = clamped(timeout);
        self
    }

    /// Lets a higher token wait this long for older in-flight requests before answering 503
    /// (default 10 s). Its token is the job's `highest` from the moment it arrived, whether it
    /// waits to the end or not.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.config().limits.drain_timeout = clamped(timeout);
        self
    }

    /// Gives a fenced request's body this long from admission (default 30 s). A buffered
    /// body (with `Idempotency-Key`) that is not in by then is answered 408
    /// `urn:fence:body-timeout` and never reaches the inner service. A streamed body yields
    /// [`BodyTimeout`](crate::BodyTimeout) to the inner service, which has by then seen the
    /// head and part of the body; the client gets 408 unless the service answered with a
    /// success. Either way the request stops holding up newer generations once the service
    /// returns, so one slow client cannot jam a job for longer than this (a gRPC or Connect
    /// streaming call whose stream fails so: this plus the [unknown-outcome hold](Self::unknown_outcome_hold),
    /// since the service may be acting on messages it got whole).
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        let config = self.config();
        config.body_timeout = clamped(timeout);
        // A body streamed to the service may go on until then, after its answer too.
        config.limits.restart.body = config.body_timeout;
        if config.idempotency.is_some() {
            // A keyed call of messages streams its answer up to this after its head.
            config.limits.restart.after_answer = config.body_timeout;
        }
        self
    }

    /// Keeps a request whose response carries [`OutcomeUnknown`](crate::OutcomeUnknown) in
    /// flight this long after its answer (default 60 s; a proxy sets its upstream timeout),
    /// so a newer generation does not pass while the upstream may still act on the old
    /// request. Zero lets it go at once.
    ///
    /// The same hold applies after a restart to what the process before may have left
    /// running: see [`longest_request`](Self::longest_request).
    pub fn unknown_outcome_hold(mut self, hold: Duration) -> Self {
        let hold = clamped(hold);
        let config = self.config();
        config.unknown_outcome_hold = hold;
        config.limits.restart.hold = hold;
        self
    }

    /// The gRPC statuses that leave a call's outcome unknown, like an
    /// [`OutcomeUnknown`](crate::OutcomeUnknown) answer: answered in the head (a
    /// trailers-only answer) or the trailers of a gRPC call, they hold its job for the
    /// [unknown-outcome hold](Self::unknown_outcome_hold), and keep its `Idempotency-Key`
    /// record in flight instead of forgetting it. Default CANCELLED (1) and
    /// DEADLINE_EXCEEDED (4): a gRPC server answers them after dropping the handler of a call
    /// whose deadline ran out, wherever it was, and a write it had sent may still commit.
    /// [`GrpcStatuses::NONE`](crate::GrpcStatuses::NONE) for a service whose handlers never
    /// outlive their answer. gRPC-Web and Connect's streaming calls carry their status in
    /// the body's last message: read from a keyed call's answer (read whole), not from an
    /// unkeyed one's.
    pub fn unknown_outcome_grpc_statuses(mut self, statuses: crate::GrpcStatuses) -> Self {
        self.config().unknown_grpc = statuses;
        self
    }

    /// The longest an admitted request may run before the service gives up on it (default
    /// 60 s; a proxy sets its upstream timeout). After a restart over a durable store, a job
    /// whose last admission by the process before was at `t` (its stamp, written before the
    /// request went on) lets no newer token pass until `min(t + this, the restart) +` the
    /// [unknown-outcome hold](Self::unknown_outcome_hold) (`this` or, when later, the
    /// [body deadline](Self::body_timeout): a body streamed to a service that answered early
    /// may go on until then; with [idempotency](Self::idempotency),
    /// `this` plus its store timeout, a keyed request waiting up to that for its record's
    /// begin before the service has it, plus the [body deadline](Self::body_timeout), a keyed
    /// call of messages being in flight until its answer ends), and no request of its highest
    /// token either while requests of older tokens may still run: the process before may
    /// have left them running, and nobody knows their outcome. Jobs idle for longer wait
    /// for nothing. Zero for both (a service whose effects die with its process) turns the
    /// wait off for what this process admits.
    ///
    /// A durable store that keeps the stamps (sled) also records this, with the hold, before
    /// the first admission ([`GenerationStore::running_within`]), and the next process
    /// waits for the longer of what it recorded and its own: restarted with a shorter
    /// setting, it still waits for what the process before admitted under its longer one
    /// (as does forgetting, see [`forget_after`](Self::forget_after)).
    pub fn longest_request(mut self, longest: Duration) -> Self {
        self.config().limits.restart.longest_request = clamped(longest);
        self
    }

    /// Holds at most this many bytes of bodies in memory at once, over every clone of the
    /// layer (default 256 MiB): buffered idempotent requests, responses captured for
    /// storage, replays. Past it an idempotent request or a replay gets 503
    /// `urn:fence:overloaded` with `Retry-After` and nothing is passed on; a response that
    /// does not fit is passed through unstored (a retry of it gets 409 not-replayable). The
    /// idempotent request bodies of one client (a [`PeerAddr`](crate::PeerAddr) in the
    /// request's extensions, by IP address) hold at most a quarter of it: one client
    /// stalling many bodies cannot starve every other client's keyed requests.
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.config().max_buffered_bytes = bytes;
        self
    }

    /// The bytes of bodies the layer holds in memory now, over every clone.
    pub fn buffered_bytes(&self) -> usize {
        self.shared.budget.used()
    }

    /// The clock a signed token's lease end is compared with (default: the system clock);
    /// tests give a [`ManualClock`](fence_storage::clock::ManualClock).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.config().clock = clock;
        self
    }

    /// How far the lease server's clock may be ahead of this one (default 5 s): with
    /// [`require_signatures`](Self::require_signatures), a token whose lease ended more than
    /// this long ago is 409 `urn:fence:token-expired`.
    pub fn clock_skew(mut self, skew: Duration) -> Self {
        self.config().clock_skew = clamped(skew);
        self
    }

    /// Test hook (feature `test-hooks`): after a restart, wait for nothing the process
    /// before may have left running, whatever the hold and whatever it recorded: the
    /// negative control of the wait [`longest_request`](Self::longest_request) describes.
    #[cfg(feature = "test-hooks")]
    pub fn without_restart_hold(mut self) -> Self {
        self.config().limits.restart = Restart {
            longest_request: Duration::ZERO,
            body: Duration::ZERO,
            hold: Duration::ZERO,
            before_service: Duration::ZERO,
            after_answer: Duration::ZERO,
            heed_recorded: false,
        };
        self
    }

    /// The longest lease the lease server grants (its `--max-ttl`; default 24 h). With
    /// [`require_signatures`](Self::require_signatures), a token whose lease ends later
    /// than now plus this plus the [clock skew](Self::clock_skew) is 403
    /// `urn:fence:token-too-long-lived`: no lease the server grants can end so late, and
    /// forgetting relies on every token ending within that window.
    pub fn max_lease_ttl(mut self, max_ttl: Duration) -> Self {
        self.config().max_lease_ttl = clamped(max_ttl);
        self
    }

    /// Forgets a job with no admitted request for `after`, in memory and in the store, from
    /// [`spawn_maintenance`](Self::spawn_maintenance)'s background task (contract section
    /// 8). Safe only because signed tokens expire: call it after
    /// [`require_signatures`](Self::require_signatures), with `max_ttl` the longest lease the
    /// lease server grants (its `--max-ttl`). A job is never forgotten sooner than the
    /// window in force when [`spawn_maintenance`](Self::spawn_maintenance) starts (`max_ttl`
    /// plus twice the clock skew), and, on a store whose jobs carry restart stamps
    /// ([`GenerationStore::loads_stamps`]: sled), than
    /// [`longest_request`](Self::longest_request) plus the
    /// [unknown-outcome hold](Self::unknown_outcome_hold) after its last admission, or the
    /// longer ones the processes before recorded ([`GenerationStore::ran_within`]): after a
    /// restart, its stamps are all that makes a newer token wait for what the process before
    /// left running.
    ///
    /// # Errors
    /// Without verify keys, or when `after` is shorter than `max_ttl` plus twice the clock
    /// skew (set [`clock_skew`](Self::clock_skew) first).
    pub fn forget_after(mut self, after: Duration, max_ttl: Duration) -> Result<Self, ForgetError> {
        let config = self.config();
        if config.signatures.is_none() {
            return Err(ForgetError::Unsigned);
        }
        let skew = config.clock_skew;
        if after < max_ttl.saturating_add(skew.saturating_mul(2)) {
            return Err(ForgetError::TooSoon {
                after,
                max_ttl,
                skew,
            });
        }
        config.forget_after = Some(after);
        // The window every token must end within (see `max_lease_ttl`).
        config.max_lease_ttl = max_ttl;
        Ok(self)
    }

    /// Keeps at most this many jobs in memory (default 100,000); idle ones beyond are evicted
    /// and reloaded from the store when needed. The cache of verified signatures has the
    /// same bound.
    pub fn max_cached_jobs(mut self, jobs: usize) -> Self {
        self.config().limits.max_cached_jobs = jobs;
        self
    }

    /// Handles `Idempotency-Key` as configured (on by default with [`IdempotencyConfig::default`]).
    pub fn idempotency(mut self, config: IdempotencyConfig) -> Self {
        // A keyed request waits up to the record's begin before the service has it, which
        // a restart must count on top of the longest request (see `longest_request`).
        let settings = self.config();
        settings.limits.restart.before_service = config.store_timeout;
        // A keyed call of messages is in flight until its answer ends, up to the body
        // deadline after its head: a restart must count that too.
        settings.limits.restart.after_answer = settings.body_timeout;
        settings.idempotency = Some(config);
        self
    }

    /// Ignores `Idempotency-Key` (it is still checked for syntax).
    pub fn without_idempotency(mut self) -> Self {
        let settings = self.config();
        settings.limits.restart.before_service = Duration::ZERO;
        settings.limits.restart.after_answer = Duration::ZERO;
        settings.idempotency = None;
        self
    }

    /// Runs each admitted request to completion even when the caller stops waiting (a
    /// client disconnects): a response future dropped unfinished hands the rest of its work
    /// to a task of its own, so the request counts as in flight until its effect can no
    /// longer happen. Use it when the inner service hands the request to something that goes
    /// on without it (a proxy's upstream); an in-process handler whose future is dropped is
    /// cancelled with it and does not need this. Without it, a request with an
    /// `Idempotency-Key` that the service has answered is still finished in a task of its
    /// own (its answer read and its record completed), so a retry is replayed rather than
    /// run again. Needs a tokio runtime where the future is dropped; without one, the
    /// request is cancelled.
    pub fn run_to_completion(mut self) -> Self {
        self.config().run_to_completion = true;
        self
    }

    /// Requires every fenced request to carry a signed token
    /// (`<generation>.<expires_at_ms>.<signature>`, contract section 6) valid for its job
    /// under one of `verifier`'s keys; anything else gets 403 `urn:fence:invalid-signature` before the fence is consulted, so an unverified
    /// token never moves `highest`. Each (job, generation, signature) is verified once; later
    /// requests with the same token are answered from a cache.
    pub fn require_signatures(mut self, verifier: fence_core::signing::TokenVerifier) -> Self {
        self.config().signatures = Some(Arc::new(Signatures::new(verifier)));
        self
    }

    /// Starts the layer's background upkeep on the current tokio runtime: expired idempotency
    /// records are deleted every [`IdempotencyConfig::sweep_every`] (expired records are
    /// ignored on read anyway, so this only reclaims space), and with
    /// [`forget_after`](Self::forget_after) idle jobs are forgotten every eighth of that
    /// time (at most every minute), in batches. It stops when the returned handle is dropped
    /// or [`Maintenance::stop`] is called.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    #[must_use = "dropping the handle stops the upkeep"]
    pub fn spawn_maintenance(&self) -> Maintenance {
        let config = &self.shared.config;
        let sweep = config.idempotency.as_ref().map(|c| c.sweep_every);
        let forget = self.forgets_after().map(|after| Forgetting {
            after,
            clock_skew: config.clock_skew,
            max_lease_ttl: config.max_lease_ttl,
        });
        Maintenance::spawn(&self.shared.gates, sweep, forget)
    }

    /// How long a job must be idle before [`spawn_maintenance`](Self::spawn_maintenance)'s
    /// upkeep forgets it (`None`: never): [`forget_after`](Self::forget_after), stretched to
    /// what forgetting safely needs with the settings in force.
    pub fn forgets_after(&self) -> Option<Duration> {
        let config = &self.shared.config;
        let after = config.forget_after?;
        // Never sooner than the window every admitted token ends within, whatever order the
        // builder's settings came in (`clock_skew` or `max_lease_ttl` set after
        // `forget_after` is not checked there).
        let window = config
            .max_lease_ttl
            .saturating_add(config.clock_skew.saturating_mul(2));
        let after = after.max(window);
        // Nor before what a process before this one may have left running on the job has
        // settled: a job's stamps are all a restarted process knows of it, and a job
        // forgotten (its record deleted) would let a newer token pass at once while an older
        // request of the dead process can still commit where it went.
        // By the bounds the process before recorded too, when they were longer.
        let store = self.shared.gates.store();
        Some(if store.loads_stamps() {
            after.max(
                config
                    .limits
                    .restart
                    .with_recorded(store.ran_within())
                    .settled_after(),
            )
        } else {
            after
        })
    }

    /// The store.
    pub fn store(&self) -> &Arc<St> {
        self.shared.gates.store()
    }

    /// How many jobs the layer holds in memory now.
    pub fn cached_jobs(&self) -> usize {
        self.shared.gates.len()
    }

    /// The job cache's size and how often it answered fenced requests without reading the
    /// store, shared by every clone of this layer.
    pub fn cache_stats(&self) -> CacheStats {
        self.shared.gates.stats()
    }

    /// Admitted requests still running, over every job (walks the cache: for a metric).
    pub fn in_flight(&self) -> usize {
        self.shared.gates.in_flight()
    }

    /// `job`'s highest generation when the layer holds the job in memory; never reads the
    /// store (`None`: not in memory).
    pub fn cached_highest(&self, job: &fence_core::JobId) -> Option<fence_core::Generation> {
        self.shared.gates.cached_highest(job)
    }

    /// `job`'s highest generation and its admitted requests still running, from memory, or
    /// from the store when the job is not cached.
    ///
    /// # Errors
    /// When the store fails.
    pub async fn job(&self, job: &fence_core::JobId) -> Result<JobFence, crate::StoreError> {
        self.shared.gates.peek(job).await
    }
}

impl<S, St> Fence<S, St> {
    /// Wraps `inner` with `layer`'s configuration and state (as `layer.layer(inner)`).
    pub fn new(inner: S, layer: &FenceLayer<St>) -> Self {
        Self::from_shared(inner, layer.shared.clone())
    }
}

impl<S, St> Layer<S> for FenceLayer<St> {
    type Service = Fence<S, St>;

    fn layer(&self, inner: S) -> Fence<S, St> {
        Fence::from_shared(inner, self.shared.clone())
    }
}
