//! [`FenceLayer`]: the configuration of the fence, shared by every service it wraps.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use http::{Method, request::Parts};
use tower_layer::Layer;

use super::{
    Fence,
    gate::{CacheStats, Gates},
};
use crate::{
    GenerationStore, IdempotencyStore,
    idempotency::{IdempotencyConfig, spawn_sweeper},
};

/// Decides which requests are fenced.
pub type FencePredicate = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) predicate: Option<FencePredicate>,
    pub(crate) require_token: bool,
    pub(crate) idempotency: Option<IdempotencyConfig>,
    pub(crate) run_to_completion: bool,
    pub(crate) signatures: Option<Arc<super::signature::Signatures>>,
}

impl Config {
    pub(crate) fn is_fenced(&self, parts: &Parts) -> bool {
        match &self.predicate {
            Some(p) => p(parts),
            None => self.methods.contains(&parts.method),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct GateParams {
    max_cached_jobs: usize,
    store_timeout: Duration,
    drain_timeout: Duration,
}

/// Wraps services in [`Fence`]. Build one layer per store and clone it (every clone, also
/// one whose limits a builder method changed, shares the in-memory gates); two layers built
/// separately over one sled or memory store keep two views of each job. Per job, requests with a token below the highest accepted
/// are rejected with 409, a higher token waits for older requests to finish and is stored
/// durably before it passes, and duplicate `Idempotency-Key`s are replayed.
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
    store: Arc<St>,
    params: GateParams,
    /// Shared by clones: a fenced request clones the layer, so this must be cheap to copy.
    pub(crate) config: Arc<Config>,
    pub(crate) gates: Arc<Gates<St>>,
    sweeper: Arc<OnceLock<()>>,
}

impl<St> Clone for FenceLayer<St> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            params: self.params,
            config: self.config.clone(),
            gates: self.gates.clone(),
            sweeper: self.sweeper.clone(),
        }
    }
}

impl<St> std::fmt::Debug for FenceLayer<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceLayer")
            .field("methods", &self.config.methods)
            .field("require_token", &self.config.require_token)
            .field("idempotency", &self.config.idempotency)
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl<St: GenerationStore + IdempotencyStore> FenceLayer<St> {
    /// Fences POST, PUT, PATCH and DELETE, requires the fencing headers on them, keeps
    /// idempotency records, caches up to 100,000 jobs, waits up to 5 s for the store and up
    /// to 10 s for older requests to drain before a bump.
    pub fn new(store: St) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// As [`new`](Self::new), for a store shared with other code.
    pub fn from_arc(store: Arc<St>) -> Self {
        let params = GateParams {
            max_cached_jobs: 100_000,
            store_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(10),
        };
        let gates = Arc::new(Gates::new(store.clone()));
        let config = Arc::new(Config {
            methods: vec![Method::POST, Method::PUT, Method::PATCH, Method::DELETE],
            predicate: None,
            require_token: true,
            idempotency: Some(IdempotencyConfig::default()),
            run_to_completion: false,
            signatures: None,
        });
        Self {
            store,
            params,
            config,
            gates,
            sweeper: Arc::default(),
        }
    }

    fn with_params(mut self, f: impl FnOnce(&mut GateParams)) -> Self {
        // Only this layer's limits change; the gates stay shared with every clone, so two
        // routes of one service never keep two views of a job.
        f(&mut self.params);
        self
    }

    pub(crate) fn limits(&self) -> super::gate::Limits {
        super::gate::Limits {
            capacity: self.params.max_cached_jobs,
            store_timeout: self.params.store_timeout,
            drain_timeout: self.params.drain_timeout,
        }
    }

    /// Fences requests with these methods (default: POST, PUT, PATCH, DELETE); others pass unfenced.
    pub fn fence_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        Arc::make_mut(&mut self.config).methods = methods.into_iter().collect();
        Arc::make_mut(&mut self.config).predicate = None;
        self
    }

    /// Fences the requests for which `predicate` returns true (methods, paths, anything in
    /// the request head), instead of a method list.
    pub fn fence_when(
        mut self,
        predicate: impl Fn(&Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.config).predicate = Some(Arc::new(predicate));
        self
    }

    /// Lets fenced requests without fencing headers through instead of answering 428.
    pub fn allow_missing_token(mut self) -> Self {
        Arc::make_mut(&mut self.config).require_token = false;
        self
    }

    /// Answers 428 to fenced requests without fencing headers (the default).
    pub fn require_token(mut self) -> Self {
        Arc::make_mut(&mut self.config).require_token = true;
        self
    }

    /// Gives the store this long per call before answering 503 (default 5 s).
    pub fn store_timeout(self, timeout: Duration) -> Self {
        self.with_params(|p| p.store_timeout = timeout)
    }

    /// Lets a higher token wait this long for older in-flight requests before answering 503
    /// (default 10 s).
    pub fn drain_timeout(self, timeout: Duration) -> Self {
        self.with_params(|p| p.drain_timeout = timeout)
    }

    /// Keeps at most this many jobs in memory (default 100,000); idle ones beyond are evicted
    /// and reloaded from the store when needed.
    pub fn max_cached_jobs(self, jobs: usize) -> Self {
        self.with_params(|p| p.max_cached_jobs = jobs)
    }

    /// Handles `Idempotency-Key` as configured (on by default with [`IdempotencyConfig::default`]).
    pub fn idempotency(mut self, config: IdempotencyConfig) -> Self {
        Arc::make_mut(&mut self.config).idempotency = Some(config);
        self
    }

    /// Runs each admitted request to completion even when the caller stops waiting (a
    /// client disconnects): a response future dropped unfinished hands the rest of its work
    /// to a task of its own, so the request counts as in flight until its effect can no
    /// longer happen. Use it when the inner service hands the request to something that goes
    /// on without it (a proxy's upstream); an in-process handler whose future is dropped is
    /// cancelled with it and does not need this. Needs a tokio runtime where the future is
    /// dropped; without one, the request is cancelled.
    pub fn run_to_completion(mut self) -> Self {
        Arc::make_mut(&mut self.config).run_to_completion = true;
        self
    }

    /// Requires every fenced request to carry a signed token (`<generation>.<signature>`,
    /// contract section 6) valid for its job under one of `verifier`'s keys; anything else
    /// gets 403 `urn:fence:invalid-signature` before the fence is consulted, so an unverified
    /// token never moves `highest`. Each (job, generation, signature) is verified once; later
    /// requests with the same token are answered from a cache.
    pub fn require_signatures(mut self, verifier: fence_core::signing::TokenVerifier) -> Self {
        Arc::make_mut(&mut self.config).signatures = Some(Arc::new(
            super::signature::Signatures::new(verifier, self.params.max_cached_jobs),
        ));
        self
    }

    /// Ignores `Idempotency-Key` (it is still checked for syntax).
    pub fn without_idempotency(mut self) -> Self {
        Arc::make_mut(&mut self.config).idempotency = None;
        self
    }

    /// The store.
    pub fn store(&self) -> &Arc<St> {
        &self.store
    }

    /// How many jobs the layer holds in memory now.
    pub fn cached_jobs(&self) -> usize {
        self.gates.len()
    }

    /// The job cache's size and how often it answered fenced requests without reading the
    /// store, shared by every clone of this layer.
    pub fn cache_stats(&self) -> CacheStats {
        self.gates.stats()
    }
}

impl<S, St: GenerationStore + IdempotencyStore> Layer<S> for FenceLayer<St> {
    type Service = Fence<S, St>;

    fn layer(&self, inner: S) -> Fence<S, St> {
        if let Some(cfg) = &self.config.idempotency {
            // Once per layer (axum applies a layer to every route), and only inside a runtime;
            // expired records are also ignored on read, so the sweeper only reclaims space.
            if tokio::runtime::Handle::try_current().is_ok() {
                self.sweeper
                    .get_or_init(|| spawn_sweeper(&self.store, cfg.sweep_every));
            }
        }
        Fence::new(inner, self.clone())
    }
}
