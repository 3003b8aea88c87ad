//! The fencing reverse proxy: `docs/protocol.md` section 3 in front of any HTTP service (`fence proxy`).
//!
//! Every request passes through a [`FenceLayer`] (stale tokens get 409, missing ones 428, …)
//! and, when admitted, is streamed to the upstream over a kept-alive HTTP/1.1 connection;
//! the answer is streamed back. Hop-by-hop headers are dropped in both directions, the client's
//! address is appended to `X-Forwarded-For`, and the fencing headers are forwarded so the
//! upstream can record the token it acted under.
//!
//! A client that goes away does not cut an admitted request short: each request runs in a
//! task of its own until the upstream answered (or its connection closed), so a newer token
//! never reaches the upstream while an older request may still take effect there
//! (`docs/protocol.md`, "in flight").
//!
//! The proxy runs [`ProxyConfig::workers`] threads (one per core by default), each with a
//! single-threaded runtime, its own upstream connection pool and its own accept loop on the
//! shared listening socket. A connection, its requests and their upstream calls stay on one
//! thread: no work is handed between cores on the way through, which is what a reverse
//! proxy spends most of its time on otherwise. The fence itself (the highest generation per
//! job, the gates that order a bump after older requests) is one, shared by every thread.
//!
//! [`serve`] does not run `fence proxy`'s start check of the store's forgetting record
//! (`docs/protocol.md` section 8): on a `SledStore` or `PgStore` where a sink that forgets
//! ran, read `recorded_settings` first, and give the config verify keys and at most the
//! recorded clock skew and longest lease, or a stale token of a forgotten job passes as a
//! new job's first.
//!
//! ```no_run
//! # async fn run() -> anyhow::Result<()> {
//! use fence::proxy::{ProxyConfig, serve};
//!
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8081").await?;
//! let store = fence_sink::SledStore::open("/var/lib/fence-proxy")?;
//! let config = ProxyConfig::new("http://127.0.0.1:8080".parse()?);
//! serve(listener, store, config, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(()) }
//! ```

mod admin;
mod config;
mod conns;
mod failure;
mod headers;
mod metrics;
mod streams;
mod upstream;
mod worker;

use std::{future::Future, sync::Arc};

use anyhow::Context as _;
use fence_sink::{FenceLayer, GenerationStore, IdempotencyStore};
use tokio::{
    net::TcpListener,
    sync::{mpsc, watch},
};

pub use self::{
    admin::{Health, serve_admin},
    config::ProxyConfig,
    metrics::UPSTREAM_OUTCOMES,
};
use self::{config::Target, upstream::UpstreamBody, worker::Worker};
pub use crate::listen::SHUTDOWN_GRACE;

/// The body of every answer of the proxy.
type ProxyBody = fence_sink::ResponseBody<UpstreamBody>;

/// Serves the proxy on `listener` until `shutdown` resolves, then stops accepting and finishes
/// in-flight requests (graceful, bounded by [`SHUTDOWN_GRACE`]). The store's forgetting
/// record is not checked here (see the module's documentation).
///
/// A worker that panics ends the whole process at once with status 70
/// ([`std::process::exit`]), its requests in flight still counted: a graceful stop would let
/// the other workers admit a newer token beside them. Run it under a supervisor.
///
/// # Errors
///
/// When `config.upstream` is not an `http(s)://host[:port][/path]` URI (no other scheme,
/// no query, no user info), or its TLS cannot be set up.
pub async fn serve<St>(
    listener: TcpListener,
    layer_store: St,
    config: ProxyConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()>
where
    St: GenerationStore + IdempotencyStore,
{
    let layer = build_layer(layer_store, &config)?;
    serve_with(listener, layer, config, shutdown).await
}

/// The fence of a proxy with `config` over `layer_store`, for [`serve_with`]; a clone of it
/// sees the same jobs (the admin listener reads them).
///
/// # Errors
/// When the forgetting settings are refused (see [`FenceLayer::forget_after`]).
pub fn build_layer<St>(layer_store: St, config: &ProxyConfig) -> anyhow::Result<FenceLayer<St>>
where
    St: GenerationStore + IdempotencyStore,
{
    let mut layer = FenceLayer::new(layer_store).store_timeout(config.store_timeout);
    if let Some(methods) = &config.fence_methods {
        layer = layer.fence_methods(methods.iter().cloned());
    }
    let mut layer = layer
        // A client that goes away must not cancel an admitted request before the upstream
        // answered: the fence counts it in flight until then (`docs/protocol.md` section 3, "in flight").
        .run_to_completion()
        .drain_timeout(config.drain_timeout)
        .body_timeout(config.body_timeout)
        .unknown_outcome_hold(config.unknown_outcome_hold)
        .unknown_outcome_grpc_statuses(config.unknown_outcome_grpc_statuses)
        // After a restart: what the process before passed on may run this long upstream:
        // until its answer's head (the upstream timeout) or, for a body the upstream goes on
        // reading after answering, until the body deadline, whichever is later.
        .longest_request(config.upstream_timeout.max(config.body_timeout))
        .max_buffered_bytes(config.max_buffered_bytes)
        .clock_skew(config.clock_skew)
        .max_lease_ttl(config.max_lease_ttl);
    layer = if config.require_token {
        layer.require_token()
    } else {
        layer.allow_missing_token()
    };
    layer = match config.idempotency.clone() {
        Some(idempotency) => layer.idempotency(idempotency.store_timeout(config.store_timeout)),
        None => layer.without_idempotency(),
    };
    if let Some(verifier) = config.verifier.clone() {
        layer = layer.require_signatures(verifier);
    }
    if let Some(after) = config.forget_after {
        layer = layer.forget_after(after, config.max_lease_ttl)?;
    }
    #[cfg(feature = "test-hooks")]
    if config.unsafe_no_restart_hold {
        layer = layer.without_restart_hold();
    }
    Ok(layer)
}

/// [`serve`] with a fence built by [`build_layer`].
///
/// # Errors
/// As [`serve`].
pub async fn serve_with<St>(
    listener: TcpListener,
    layer: FenceLayer<St>,
    config: ProxyConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()>
where
    St: GenerationStore + IdempotencyStore,
{
    let target = Arc::new(
        Target::parse(&config.upstream, config.upstream_ca_cert.as_deref())?
            .with_unknown_outcome(&config.unknown_outcome_statuses),
    );
    // Expired idempotency records are swept off the store while the proxy runs, and idle
    // jobs forgotten if asked.
    let _maintenance = layer.spawn_maintenance();
    if let (Some(asked), Some(window)) = (config.forget_after, layer.forgets_after()) {
        tracing::info!(
            forget_after = ?asked,
            forgets_after = ?window,
            "idle jobs are forgotten after this window: at least --forget-after and the token \
             window, and on --data-dir what a request may run after a restart (the later of \
             the upstream and body timeouts; with idempotency plus the store and body \
             timeouts) plus the unknown-outcome hold"
        );
    }

    let listen = listener
        .local_addr()
        .context("reading the proxy's listen address")?;
    // Every worker accepts on its own copy of the listening socket (one socket, several
    // descriptors): the kernel hands each new connection to one of them.
    let listener = listener
        .into_std()
        .context("taking the listening socket off the runtime")?;
    let workers = config.workers.max(1);
    // One connection limit for the whole proxy, whichever worker accepts.
    let slots = crate::listen::Slots::new(
        config.limits.max_connections,
        config.limits.max_connections_per_peer,
    );
    let tls = config.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    let (stop, stopped) = watch::channel(false);
    let (ended, mut ends) = mpsc::unbounded_channel::<anyhow::Result<()>>();
    let serving = worker::Serving::count();
    for n in 0..workers {
        let started = listener
            .try_clone()
            .context("sharing the listening socket with a worker")
            .and_then(|listener| {
                let worker = Worker {
                    listener,
                    tls: tls.clone(),
                    limits: config.limits,
                    slots: slots.clone(),
                    layer: layer.clone(),
                    target: target.clone(),
                    timeout: config.upstream_timeout,
                    idle_timeout: config.upstream_idle_timeout,
                    preserve_host: config.preserve_host,
                    via: config.via,
                    stopped: stopped.clone(),
                    serving: worker::Serving::join(&serving),
                };
                let report = ended.clone();
                std::thread::Builder::new()
                    .name(format!("fence-proxy-{n}"))
                    .spawn(move || {
                        let result =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run()))
                                .unwrap_or_else(|_| {
                                    Err(anyhow::anyhow!("a proxy worker panicked"))
                                });
                        let _ = report.send(result);
                    })
                    .context("starting a proxy worker thread")
            });
        if let Err(e) = started {
            // Stop the workers already running before giving up.
            let _ = stop.send(true);
            drop(ended);
            while ends.recv().await.is_some() {}
            return Err(e);
        }
    }
    drop((listener, ended));
    tracing::info!(%listen, upstream = %target.display, workers, "fencing proxy started");

    // Run until shutdown is asked for, or until a worker ends on its own (it failed).
    let mut result = tokio::select! {
        () = shutdown => Ok(()),
        Some(early) = ends.recv() => {
            early.and_then(|()| Err(anyhow::anyhow!("a proxy worker stopped unexpectedly")))
        }
    };
    let _ = stop.send(true);
    while let Some(end) = ends.recv().await {
        if result.is_ok() {
            result = end;
        }
    }
    tracing::info!("fencing proxy stopped");
    result
}
