//! The long-running commands: `fence server` and `fence proxy`, from flags to listeners.
//!
//! Everything a flag names (keys, certificates, auth file, upstream, data directory) is
//! checked before anything listens; a bad one stops the command with one line and exit 2.

use std::{sync::Arc, time::Duration};

use anyhow::Context as _;
use fence_core::signing::TokenSigner;
use fence_lease::{LeaseStore, SigningLeaseStore};
use tokio::{net::TcpListener, sync::watch};

use crate::{
    Usage,
    auth::Auth,
    backend::Backend,
    cli::{ListenArgs, ProxyArgs, ServerArgs},
    keys::load_verifier,
    listen::{Limits, Listener},
    server::ServerOptions,
};

mod signals;
pub use signals::StopSignals;
use signals::on_hangup;

/// Warns when group or others may read the private key at `path` (named by `flag`). Not
/// refused, as the signing key and the auth file are: a TLS key is often mounted by a
/// platform (a Kubernetes secret, mode 0644 by default) that the operator does not set.
fn warn_if_others_may_read(path: &std::path::Path, flag: &str) {
    if let Some(mode) = crate::open_to_others(path) {
        tracing::warn!(
            file = %path.display(),
            mode = format!("{mode:o}"),
            "{flag}: group or others may read this private key: chmod 600 it"
        );
    }
}

/// The TLS configuration and limits of a listener's flags.
///
/// # Errors
/// When a certificate or key file is unusable.
fn listen_options(
    args: &ListenArgs,
    alpn: &[&[u8]],
) -> anyhow::Result<(Option<Arc<rustls::ServerConfig>>, Limits)> {
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            // Checked for its dates too: one that has ended would fail every handshake.
            let resolver = crate::server_cert::ServerCert::load(cert, key)?;
            let config = fence_storage::tls::server_config_with(resolver.clone(), alpn)
                .map_err(Usage::from_error)?;
            // Once it is usable: a start that fails says one thing.
            warn_if_others_may_read(key, "--tls-key");
            resolver
                .reload_on_sighup()
                .context("installing the SIGHUP handler")?;
            resolver.watch_dates();
            Some(Arc::new(config))
        }
        _ => None,
    };
    let mut limits = Limits {
        header_timeout: args.header_timeout,
        idle_timeout: args.idle_timeout,
        h2_max_streams: args.h2_max_streams,
        h2_keepalive: args.h2_keepalive,
        ..Limits::default()
    };
    if let Some(max) = args.max_connections {
        limits.max_connections = usize::try_from(max).unwrap_or(usize::MAX);
    }
    limits.max_connections_per_peer = match args.max_connections_per_peer {
        Some(max) => usize::try_from(max).unwrap_or(usize::MAX),
        None => limits.max_connections.div_ceil(2),
    };
    Ok((tls, limits))
}

async fn bind(addr: std::net::SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {what} {addr}"))
        .map_err(Usage::from_error)
}

/// `load(path)` when a path was given; its error is a usage error (exit 2).
fn load_if_given<T, E: Into<anyhow::Error>>(
    path: Option<&std::path::Path>,
    load: impl FnOnce(&std::path::Path) -> Result<T, E>,
) -> anyhow::Result<Option<T>> {
    path.map(load).transpose().map_err(Usage::from_error)
}

/// `fence server`.
///
/// # Errors
/// When a key file, the auth file, the certificates, the listen address or the store
/// cannot be used.
pub async fn server(a: ServerArgs) -> anyhow::Result<()> {
    #[cfg(feature = "test-hooks")]
    crate::test_hooks::set_clock_offset_ms(a.clock_offset_ms);
    // Everything the flags name first: a bad file stops the server before it listens.
    let signer = load_if_given(a.signing_key.as_deref(), TokenSigner::from_file)?;
    if a.insecure_no_auth && a.auth_file.is_some() {
        // Checked on the values, not by clap: an on/off variable set to 0 beside an auth file
        // (FENCE_INSECURE_NO_AUTH=0) would count as given.
        return Err(Usage::error(
            "--insecure-no-auth (FENCE_INSECURE_NO_AUTH) and --auth-file (FENCE_AUTH_FILE) say opposite things: give one",
        ));
    }
    let auth = load_if_given(a.auth_file.as_deref(), Auth::load)?;
    if auth.is_none() && !a.listen.ip().is_loopback() {
        if !a.insecure_no_auth {
            return Err(Usage::error(format!(
                "refusing to listen on {} without --auth-file: anyone who can reach it could revoke any job, claim jobs, and complete any job whose lease key leaks; give --auth-file (and --tls-cert/--tls-key), or --insecure-no-auth",
                a.listen
            )));
        }
        tracing::warn!(listen = %a.listen, "--insecure-no-auth: the lease API is open to anyone who can reach it, revokes included");
    }
    let (tls, limits) = listen_options(&a.listener, &[b"h2", b"http/1.1"])?;
    on_hangup(auth.clone(), "--auth-file", tls.is_some())
        .context("installing the SIGHUP handler")?;
    if tls.is_none() && !a.listen.ip().is_loopback() {
        if !a.insecure_no_tls {
            return Err(Usage::error(format!(
                "refusing to listen on {} without TLS: lease keys and bearer secrets would cross the network in clear; give --tls-cert and --tls-key, or --insecure-no-tls for a private network you vouch for",
                a.listen
            )));
        }
        tracing::warn!(listen = %a.listen, "--insecure-no-tls: lease keys and bearer secrets cross the network in clear");
    }
    let backend = Backend::choose(a.storage).map_err(Usage::from_error)?;
    let handle = crate::telemetry::install()?;
    let tcp = bind(a.listen, "--listen").await?;
    let store = backend.lease_store().await?;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let options = ServerOptions {
        metrics: Some(handle),
        auth,
        public_metrics: a.public_metrics,
        max_ttl: Some(a.max_ttl),
        lock_delay: a.lock_delay,
        max_checkpoint_bytes: Some(a.max_checkpoint_bytes as usize),
        // Lowered to half the seats, logged: a waiting claim holds its connection busy.
        waiting: crate::server::WaitLimits {
            total: a.max_waiting_claims as usize,
            per_client: a.max_waiting_claims_per_client as usize,
            longest: a.max_claim_wait,
        }
        .within_seats(limits.max_connections, limits.max_connections_per_peer),
        stopping: Some(stopping),
    };
    let _forgetting = a
        .forget_after
        .map(|after| forget_leases(store.clone(), after));
    let _counting = AbortOnDrop(crate::telemetry::count_leases(store.clone()));
    // The router marks answers to requests with a known secret: those connections are
    // closed for room after the others.
    let listener = Listener::new(tcp, tls.map(tokio_rustls::TlsAcceptor::from), limits);
    let signals = StopSignals::install().context("installing the signal handlers")?;
    tracing::info!(
        listen = %listener.local_addr()?,
        scheme = listener.scheme(),
        store = backend.name(),
        signing = if signer.is_some() { "on" } else { "off" },
        auth = if options.auth.is_some() { "on" } else { "off" },
        "fence server ready"
    );
    match signer {
        Some(signer) => {
            serve_leases(
                listener,
                SigningLeaseStore::new(store.clone(), signer),
                options,
                signals,
                stop,
            )
            .await
        }
        None => serve_leases(listener, store.clone(), options, signals, stop).await,
    }
    final_flush(move || store.flush()).await?;
    tracing::info!("fence server stopped");
    Ok(())
}

/// Forgets idle jobs of `store` in the background, every quarter of `after` (at most every
/// minute), in batches; stops when the returned task is dropped.
fn forget_leases<S: LeaseStore + Clone>(store: S, after: Duration) -> AbortOnDrop {
    let every = (after / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
    AbortOnDrop(tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let mut total = 0;
            loop {
                match store.forget_idle(after, 1_000).await {
                    Ok(n) => {
                        total += n;
                        if n < 1_000 {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %fence_storage::error_chain(&e), "forgetting idle jobs failed");
                        break;
                    }
                }
            }
            if total > 0 {
                tracing::debug!(forgotten = total, "idle jobs forgotten");
            }
        }
    }))
}

/// A background task that ends with its handle.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves the lease API over `store` until SIGINT or SIGTERM (`signals`); says so on `stop`
/// first, for the waiting claims to be answered.
async fn serve_leases<S: LeaseStore>(
    listener: Listener,
    store: S,
    options: ServerOptions,
    signals: StopSignals,
    stop: tokio::sync::watch::Sender<bool>,
) {
    let router = crate::server::router(Arc::new(store), options);
    let shutdown = async move {
        signals.shutdown().await;
        stop.send_replace(true);
    };
    crate::listen::serve(listener, shutdown, move |peer, _| {
        // The peer goes into each request, for the refusal log.
        let with_peer = tower::ServiceBuilder::new()
            .map_request(move |mut req: http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(fence_sink::PeerAddr(peer));
                req
            })
            .service(router.clone());
        hyper_util::service::TowerToHyperService::new(with_peer)
    })
    .await;
}

/// `fence proxy`.
///
/// # Errors
/// When a key file, the certificates, a listen address, the upstream or the store cannot
/// be used.
pub async fn proxy(a: ProxyArgs) -> anyhow::Result<()> {
    let verifier = load_verifier(&a.verify_key).map_err(Usage::from_error)?;
    let (tls, limits) = listen_options(&a.listener, &[b"h2", b"http/1.1"])?;
    let backend = Backend::choose(a.storage).map_err(Usage::from_error)?;
    let mut config = crate::proxy::ProxyConfig::new(a.upstream.clone());
    config.fence_methods = a.fence_methods;
    #[cfg(feature = "test-hooks")]
    if a.unsafe_no_fence {
        config.fence_methods = Some(Vec::new());
    }
    #[cfg(feature = "test-hooks")]
    {
        config.unsafe_no_restart_hold = a.unsafe_no_restart_hold;
    }
    if a.require_token && a.allow_missing_token {
        return Err(Usage::error(
            "--require-token (FENCE_REQUIRE_TOKEN) and --allow-missing-token (FENCE_ALLOW_MISSING_TOKEN) say opposite things: give one",
        ));
    }
    config.require_token = !a.allow_missing_token;
    let hold = a.unknown_outcome_hold.unwrap_or(a.upstream_timeout);
    config.idempotency = (!a.no_idempotency).then(|| {
        fence_sink::IdempotencyConfig::default()
            .retention(a.idempotency_retention)
            .max_response_body(a.idempotency_max_body)
            .max_stored_bytes(a.idempotency_max_stored)
            .scope_headers(a.idempotency_scope_header.clone())
    });
    config.drain_timeout = a.drain_timeout;
    config.upstream_timeout = a.upstream_timeout;
    config.upstream_idle_timeout = a.upstream_idle_timeout;
    config.body_timeout = a.body_timeout;
    config.clock_skew = a.clock_skew;
    config.forget_after = a.forget_after;
    config.max_lease_ttl = a.max_lease_ttl.as_duration();
    config.unknown_outcome_hold = hold;
    config.unknown_outcome_statuses = a.unknown_outcome_status.0.clone();
    config.unknown_outcome_grpc_statuses = a.unknown_outcome_grpc_status;
    config.max_buffered_bytes = usize::try_from(a.max_buffered_bytes).unwrap_or(usize::MAX);
    config.preserve_host = a.preserve_host;
    config.via = !a.no_via;
    config.verifier = verifier;
    config.upstream_ca_cert = a.upstream_ca_cert;
    config.tls = tls.clone();
    config.limits = limits;
    if let Some(workers) = a.workers {
        config.workers = usize::from(workers);
    }
    config.check().map_err(Usage::from_error)?;
    let handle = crate::telemetry::install()?;
    let admin_auth = load_if_given(a.admin_auth_file.as_deref(), Auth::load)?;
    if !a.admin_listen.ip().is_loopback() && (admin_auth.is_none() || tls.is_none()) {
        // Off loopback, only with secrets of its own, and those only over TLS
        // (docs/protocol.md section 10).
        return Err(Usage::error(format!(
            "refusing --admin-listen {}: the admin listener (/metrics, /v1/fence/{{job}}, the revoke push) listens off loopback only with --admin-auth-file and TLS (--tls-cert, --tls-key), so that its secrets never cross the network in clear",
            a.admin_listen
        )));
    }
    on_hangup(admin_auth.clone(), "--admin-auth-file", tls.is_some())
        .context("installing the SIGHUP handler")?;
    let tcp = bind(a.listen, "--listen").await?;
    let admin = bind(a.admin_listen, "--admin-listen").await?;
    if a.clear_running_record {
        backend.clear_running_record()?;
    }
    let store = backend.sink_store().await?;
    match &store {
        crate::backend::SinkBackend::Postgres(pg) => {
            // What the other sinks recorded first: a proxy that may not run on these tables
            // leaves the row as it was.
            let recorded = pg
                .recorded_settings()
                .await
                .context("reading the forgetting settings in PostgreSQL")?;
            if let Some(recorded) = recorded {
                adopt_recorded(&mut config, recorded, ON_TABLES)?;
            }
            // SQL writers on these tables check expiry while this proxy forgets (section 11).
            let recorded = pg
                .announce_forgetting(
                    a.forget_after.is_some(),
                    config.clock_skew,
                    config.max_lease_ttl,
                )
                .await
                .context("recording the forgetting settings in PostgreSQL")?;
            // Another proxy may have recorded forgetting in between.
            adopt_recorded(&mut config, recorded, ON_TABLES)?;
        }
        // What a process before this one on the directory forgot under (section 8).
        crate::backend::SinkBackend::Sled(sled) => {
            let recorded = sled
                .recorded_settings()
                .context("reading the forgetting settings in the data directory")?;
            if let Some(recorded) = recorded {
                let refusal = backend.forgot_here(&recorded);
                adopt_recorded(&mut config, recorded, &refusal)?;
            }
        }
    }
    let (tx, rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let upstream = a.upstream.authority().map(|authority| {
        let port = authority.port_u16().unwrap_or(
            if a.upstream.scheme() == Some(&http::uri::Scheme::HTTPS) {
                443
            } else {
                80
            },
        );
        format!("{}:{port}", authority.host())
    });
    let layer = crate::proxy::build_layer(store.clone(), &config).map_err(Usage::from_error)?;
    if let (Some(_), crate::backend::SinkBackend::Sled(sled)) = (a.forget_after, &store) {
        // Recorded now, not only before the first deletion: a restart without the keys is
        // refused from this start on, whenever that comes.
        fence_sink::GenerationStore::forgetting_within(
            sled,
            config.clock_skew,
            config.max_lease_ttl,
        )
        .await
        .context("recording the forgetting settings in the data directory")?;
    }
    let health =
        crate::proxy::Health::new(Arc::new(store.clone()), upstream).with_fence(layer.clone());
    let admin = Listener::new(admin, tls.map(tokio_rustls::TlsAcceptor::from), limits);
    let admin_addr = admin.local_addr()?;
    let admin_task = tokio::spawn(crate::proxy::serve_admin(
        admin,
        handle,
        health.with_auth(admin_auth),
        stopped(rx.clone()),
    ));
    // Installed here, not in the task: a task spawned may first run after the "ready" line.
    let signals = StopSignals::install().context("installing the signal handlers")?;
    let signal = tokio::spawn(async move {
        signals.shutdown().await;
        let _ = tx.send(true);
    });
    tracing::info!(
        listen = %tcp.local_addr()?,
        admin = %admin_addr,
        upstream = %a.upstream,
        store = backend.name(),
        scheme = if config.tls.is_some() { "https" } else { "http" },
        signatures = if config.verifier.is_some() { "required" } else { "off" },
        idempotency = if config.idempotency.is_some() { "on" } else { "off" },
        "fence proxy ready"
    );
    let result = crate::proxy::serve_with(tcp, layer, config, stopped(rx)).await;
    final_flush(move || store.flush()).await?;
    signal.abort();
    admin_task.abort();
    result
}

/// How long the last flush at shutdown may take (see [`final_flush`]).
const FLUSH_DEADLINE: Duration = Duration::from_secs(10);

/// How long the process may take to end once its last flush began: the flush, then closing
/// the database (the log's writer joined, a last checkpoint) as the runtime drops the tasks
/// that held it. A disk that stops answering after the flush holds the process no longer.
const EXIT_DEADLINE: Duration = Duration::from_secs(20);

/// The last flush at shutdown, given up after [`FLUSH_DEADLINE`]: a disk that stopped
/// answering must not hold the process past its supervisor's patience (systemd's stop
/// timeout would SIGKILL it anyway). Giving up loses nothing acknowledged: every write
/// that was answered is in the write-ahead log, replayed at the next start. The process
/// then exits with status 1 at once, without waiting for the flush's thread.
async fn final_flush(
    flush: impl FnOnce() -> anyhow::Result<()> + Send + 'static,
) -> anyhow::Result<()> {
    after(EXIT_DEADLINE, || {
        tracing::error!(
            deadline = ?EXIT_DEADLINE,
            "closing the database at shutdown did not finish in time; exiting without it: acknowledged writes are in the write-ahead log and are replayed at the next start"
        );
        std::process::exit(1);
    });
    match flush_within(FLUSH_DEADLINE, flush).await {
        Some(result) => result,
        None => {
            tracing::error!(
                deadline = ?FLUSH_DEADLINE,
                "the last flush of the database did not finish in time; exiting without it: acknowledged writes are in the write-ahead log and are replayed at the next start"
            );
            std::process::exit(1);
        }
    }
}

/// Runs `then` on a thread of its own after `deadline`, unless the process ended first (the
/// thread is not joined). Failing to start the thread only loses the deadline.
fn after(deadline: Duration, then: impl FnOnce() + Send + 'static) {
    let started = std::thread::Builder::new()
        .name("fence-exit-deadline".into())
        .spawn(move || {
            std::thread::sleep(deadline);
            then();
        });
    if let Err(e) = started {
        tracing::warn!(error = %e, "cannot start the shutdown deadline's thread; shutting down without it");
    }
}

/// Runs `flush` on a blocking thread: its result, or `None` when `deadline` passed first.
async fn flush_within(
    deadline: Duration,
    flush: impl FnOnce() -> anyhow::Result<()> + Send + 'static,
) -> Option<anyhow::Result<()>> {
    match tokio::time::timeout(deadline, tokio::task::spawn_blocking(flush)).await {
        Ok(Ok(result)) => Some(result),
        Ok(Err(failed)) => Some(Err(anyhow::anyhow!("the last flush failed: {failed}"))),
        Err(_) => None,
    }
}

/// Why a proxy without verify keys may not run where jobs are forgotten, on PostgreSQL
/// tables (on a data directory: `Backend::forgot_here`).
const ON_TABLES: &str = "another sink on these PostgreSQL tables forgets idle jobs \
    (fence.sink_settings records it), so every proxy on them must refuse expired tokens: start \
    this one with --verify-key too (a stale token of a forgotten job would otherwise pass here \
    as a new job's first); tables of its own (--pg-schema) only for another upstream";

/// Takes on what the sinks that forget on the same store recorded (`refusal`: why it needs
/// keys there): while any of them forgets idle jobs (on PostgreSQL, any proxy on the
/// tables; on sled, any proxy before on the directory), this proxy decides for those jobs as
/// well, and a stale token of a forgotten job would pass here as a new job's first unless
/// its expiry is checked as strictly as the forgetting one did. So it needs verify keys then,
/// and takes the smallest clock skew and longest lease recorded.
fn adopt_recorded(
    config: &mut crate::proxy::ProxyConfig,
    recorded: fence_sink::SinkSettings,
    refusal: &str,
) -> anyhow::Result<()> {
    if !recorded.forgetting {
        return Ok(());
    }
    if config.verifier.is_none() {
        return Err(Usage::error(refusal));
    }
    if recorded.clock_skew < config.clock_skew {
        tracing::warn!(own = ?config.clock_skew, recorded = ?recorded.clock_skew, "taking the smaller --clock-skew a sink that forgets on this store recorded");
        config.clock_skew = recorded.clock_skew;
    }
    if let Some(longest) = recorded.max_lease_ttl.filter(|l| *l < config.max_lease_ttl) {
        tracing::warn!(own = ?config.max_lease_ttl, recorded = ?longest, "taking the shorter --max-lease-ttl a sink that forgets on this store recorded");
        config.max_lease_ttl = longest;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What ends the process when closing the database hangs runs at its deadline, not
    /// before, and off the thread that hangs.
    #[test]
    fn the_exit_deadline_runs_at_its_deadline_on_its_own_thread() {
        let (ran, runs) = std::sync::mpsc::channel();
        let began = std::time::Instant::now();
        let deadline = Duration::from_millis(100);
        after(deadline, move || {
            let _ = ran.send((
                began.elapsed(),
                std::thread::current().name().map(String::from),
            ));
        });
        let (at, thread) = runs
            .recv_timeout(Duration::from_secs(20))
            .expect("the deadline's action ran");
        assert!(at >= deadline, "ran after {at:?}");
        assert_eq!(thread.as_deref(), Some("fence-exit-deadline"));
    }

    #[tokio::test]
    async fn a_last_flush_that_hangs_is_given_up_at_its_deadline() {
        let deadline = Duration::from_millis(50);
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let began = std::time::Instant::now();
        let given_up = flush_within(deadline, move || {
            // A disk that does not answer until the test lets it go.
            let _ = hung.recv_timeout(Duration::from_secs(30));
            Ok(())
        })
        .await;
        assert!(given_up.is_none(), "a hung flush was waited for");
        assert!(began.elapsed() < Duration::from_secs(20));
        drop(release);
        // A flush that ends in time is waited for, and its error kept.
        assert!(matches!(
            flush_within(deadline * 100, || Ok(())).await,
            Some(Ok(()))
        ));
        let failed = flush_within(deadline * 100, || Err(anyhow::anyhow!("disk gone"))).await;
        assert_eq!(failed.unwrap().unwrap_err().to_string(), "disk gone");
    }
}
