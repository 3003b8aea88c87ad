//! The lease server: the HTTP lease API of `docs/protocol.md` section 4 over a lease store.
//!
//! Its clock decides; bodies are validated strictly, field by field, by the typed API of
//! `fence_core::lease_api`. With an auth file, every `/v1/` request needs a bearer secret
//! that covers its job (see [`crate::auth`]).
//!
//! ```
//! use std::sync::Arc;
//! use fence::server::{ServerOptions, router};
//!
//! let app = router(Arc::new(fence_lease::MemoryLeaseStore::new()), ServerOptions::default());
//! # let _ = app;
//! ```

// Handlers answer a refusal as the Problem itself; boxing it would buy nothing.
#![allow(clippy::result_large_err)]

mod answer;
pub use answer::{LEASE_OPS, LEASE_OUTCOMES};
mod guard;
mod handlers;
mod list;
mod semaphore;
mod wait;

use std::sync::Arc;

use axum::{
    Router,
    routing::{get, post},
};
use fence_lease::LeaseStore;
use metrics_exporter_prometheus::PrometheusHandle;

pub use answer::record_body;
pub use wait::WaitLimits;

use crate::auth::Auth;

/// What a lease server serves besides the API itself.
#[derive(Debug, Default, Clone)]
pub struct ServerOptions {
    /// Renders `/metrics`; without it `/metrics` is 404.
    pub metrics: Option<PrometheusHandle>,
    /// The clients allowed to call `/v1/`; without it, anyone who can connect may.
    pub auth: Option<Auth>,
    /// Serve `/metrics` without a bearer secret even with `auth`.
    pub public_metrics: bool,
    /// The longest lease granted: claims and renewals asking more get this (`--max-ttl`).
    pub max_ttl: Option<fence_core::Ttl>,
    /// The lock-delay of a claim that names none (`--lock-delay`; contract section 12).
    pub lock_delay: Option<std::time::Duration>,
    /// The largest checkpoint taken, in bytes of UTF-8 (`--max-checkpoint-bytes`; `None`:
    /// [`DEFAULT_MAX_CHECKPOINT_BYTES`](fence_core::lease_api::DEFAULT_MAX_CHECKPOINT_BYTES)).
    pub max_checkpoint_bytes: Option<usize>,
    /// How many claims may wait (`claim?wait=`) at once, in all and per client.
    pub waiting: WaitLimits,
    /// Turns true when the server begins to stop: claims waiting then are answered at once
    /// (409 `lease-held` with the job still held, or the lease if it just came free), so a
    /// stop does not wait out their waits, and none waits from then on.
    pub stopping: Option<tokio::sync::watch::Receiver<bool>>,
}

struct AppState<S> {
    store: Arc<S>,
    options: ServerOptions,
    waiters: wait::Waiters,
    health: crate::probe::Shared<Result<(), fence_core::problem::Problem>>,
}

/// The lease API as OpenAPI 3.1, served at `/openapi.json` (no secret needed).
pub const OPENAPI: &str = include_str!("../../../../docs/openapi.json");

async fn openapi() -> impl axum::response::IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
}

/// The lease API router over `store`.
pub fn router<S: LeaseStore>(store: Arc<S>, options: ServerOptions) -> Router {
    let waiters = wait::Waiters::new(options.waiting, options.stopping.clone());
    // Fed once the store says it hears other servers (its first `Missed`), not before.
    let changes = store.changes();
    let state = Arc::new(AppState {
        store,
        options,
        waiters,
        health: crate::probe::Shared::default(),
    });
    if let Some(changes) = changes {
        tokio::spawn(wake_on_changes(Arc::downgrade(&state), changes));
    }
    Router::new()
        .route("/v1/leases", get(list::list::<S>))
        .route("/v1/leases/{job}/{action}", post(handlers::act::<S>))
        .route("/v1/leases/{job}", get(handlers::status::<S>))
        .route(
            "/v1/semaphores/{resource}/claim",
            post(semaphore::claim::<S>),
        )
        .route("/healthz", get(handlers::healthz::<S>))
        .route("/readyz", get(handlers::healthz::<S>))
        .route("/metrics", get(handlers::render_metrics::<S>))
        .route("/openapi.json", get(openapi))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            mark_authenticated::<S>,
        ))
        .with_state(state)
}

/// Wakes the claims waiting on jobs that other servers let go, until the router is gone.
async fn wake_on_changes<S>(
    state: std::sync::Weak<AppState<S>>,
    mut changes: tokio::sync::broadcast::Receiver<fence_storage::Notice>,
) {
    use fence_storage::Notice;
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let notice = changes.recv().await;
        let Some(state) = state.upgrade() else { return };
        match notice {
            Ok(Notice::Payload(job)) => {
                if let Ok(job) = job.parse() {
                    state.waiters.changed(&job);
                }
            }
            // Heard from now on, and what was sent before may be lost: everyone looks.
            Ok(Notice::Missed) => {
                state.waiters.set_fed(true);
                state.waiters.changed_all();
            }
            // Deaf until the next `Missed`: everyone looks now, and then as often as
            // without notices.
            Ok(Notice::Lost) => {
                state.waiters.set_fed(false);
                state.waiters.changed_all();
            }
            Err(RecvError::Lagged(_)) => state.waiters.changed_all(),
            Err(RecvError::Closed) => return,
        }
    }
}

/// Marks the answer to a request that carried a secret of the auth file: its connection is
/// then closed for room after those that never did (`crate::listen`).
///
/// It also logs each refusal once (`fence_sink::refusals`: problem type, job, method, path,
/// peer and client, rate-limited per kind and peer), except the lease decisions the
/// handlers log themselves with their owner and generation (held, completed, lost, wrong
/// lease key), under the same rate limit (`answer::answer`).
async fn mark_authenticated<S: LeaseStore>(
    axum::extract::State(app): axum::extract::State<Arc<AppState<S>>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let client = app
        .options
        .auth
        .as_ref()
        .and_then(|auth| auth.name_of(req.headers()));
    let (method, uri) = (req.method().clone(), req.uri().clone());
    let peer = req
        .extensions()
        .get::<fence_sink::PeerAddr>()
        .map(|p| p.0.ip());
    let mut response = next.run(req).await;
    if let Some(problem) = response.extensions().get::<fence_core::Problem>()
        && !matches!(
            problem.kind,
            fence_core::ProblemType::LeaseHeld
                | fence_core::ProblemType::JobCompleted
                | fence_core::ProblemType::LeaseLost
                | fence_core::ProblemType::LeaseKeyMismatch
        )
    {
        fence_sink::refusals::log(problem, &method, uri.path(), peer, client.as_deref());
    }
    if client.is_some() {
        response
            .extensions_mut()
            .insert(crate::listen::Authenticated);
    }
    response
}
