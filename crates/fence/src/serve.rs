//! The long-running commands: `fence server` and `fence proxy`, from flags to a listener.

use std::sync::Arc;

use anyhow::Context as _;
use fence_core::signing::TokenSigner;
use fence_lease::{LeaseStore, SigningLeaseStore};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::watch;

use crate::{
    backend::Backend,
    cli::{ProxyArgs, ServerArgs},
    keys::load_verifier,
};

fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        () = term => {},
    }
    tracing::info!("shutting down: finishing in-flight requests");
}

/// Serves the lease API over `store`, signing its grants when a signer is given.
async fn serve_leases<S: LeaseStore>(
    listener: tokio::net::TcpListener,
    store: S,
    signer: Option<TokenSigner>,
    handle: PrometheusHandle,
) -> anyhow::Result<()> {
    let router = match signer {
        Some(signer) => crate::server::router(
            Arc::new(SigningLeaseStore::new(store, signer)),
            Some(handle),
        ),
        None => crate::server::router(Arc::new(store), Some(handle)),
    };
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving the lease API")
}

/// `fence server`.
///
/// # Errors
/// When a key file, the listen address or the store cannot be used.
pub async fn server(a: ServerArgs) -> anyhow::Result<()> {
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::set_clock_offset_ms(a.clock_offset_ms);
    // Keys first: a bad key file stops the server before it listens.
    let signer = a
        .signing_key
        .as_deref()
        .map(TokenSigner::from_file)
        .transpose()?;
    let backend = Backend::choose(a.storage)?;
    let handle = install_metrics()?;
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let store = backend.lease_store().await?;
    let signing = if signer.is_some() { "on" } else { "off" };
    tracing::info!(listen = %listener.local_addr()?, store = backend.name(), signing, "fence server ready");
    serve_leases(listener, store.clone(), signer, handle).await?;
    store.flush()?;
    tracing::info!("fence server stopped");
    Ok(())
}

/// `fence proxy`.
///
/// # Errors
/// When a key file, a listen address, the upstream or the store cannot be used.
pub async fn proxy(a: ProxyArgs) -> anyhow::Result<()> {
    let verifier = load_verifier(&a.verify_key)?;
    let backend = Backend::choose(a.storage)?;
    let handle = install_metrics()?;
    let mut config = crate::proxy::ProxyConfig::new(a.upstream.clone());
    config.fence_methods = a.fence_methods;
    #[cfg(feature = "test-hooks")]
    if a.unsafe_no_fence {
        config.fence_methods = Vec::new();
    }
    config.require_token = !a.allow_missing_token;
    config.idempotency = (!a.no_idempotency).then(|| {
        fence_sink::IdempotencyConfig::default()
            .retention(a.idempotency_retention)
            .max_response_body(a.idempotency_max_body)
    });
    config.drain_timeout = a.drain_timeout;
    config.upstream_timeout = a.upstream_timeout;
    config.preserve_host = a.preserve_host;
    config.verifier = verifier;
    if let Some(workers) = a.workers {
        config.workers = usize::from(workers);
    }
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let admin = tokio::net::TcpListener::bind(a.admin_listen)
        .await
        .with_context(|| format!("cannot listen on --admin-listen {}", a.admin_listen))?;
    let store = backend.sink_store().await?;
    let (tx, rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let admin_task = tokio::spawn(crate::proxy::serve_admin(
        admin,
        handle,
        stopped(rx.clone()),
    ));
    let signal = tokio::spawn(async move {
        shutdown_signal().await;
        let _ = tx.send(true);
    });
    tracing::info!(listen = %listener.local_addr()?, upstream = %a.upstream, store = backend.name(), "fence proxy ready");
    let result = crate::proxy::serve(listener, store.clone(), config, stopped(rx)).await;
    store.flush()?;
    signal.abort();
    admin_task.abort();
    result
}
