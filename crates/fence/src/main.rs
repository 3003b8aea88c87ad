//! The `fence` command: lease server, fencing proxy, `fence run`, client calls and the demo.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use fence::{duration::parse_duration, run};
use fence_core::{JobId, Owner, lease_api::lease_path};
use fence_lease::{SledLeaseStore, SystemClock, Ttl};
use http::Method;

const EXIT_CODES: &str = "\
Exit codes of the lease calls (claim, renew, release, complete, status):
  0  success; the server's JSON answer is printed on stdout
  3  the lease is held by another owner, lost, or the job is completed
  2  bad usage (also a 400 from the server)
  1  anything else (server unreachable, unknown job for status, server error)";

/// Expiring job leases, fenced all the way to the side effect.
///
/// A worker claims a job and gets a generation (its fencing token); it sends the token with
/// every write; the destination, protected by `fence proxy` or the fence-sink tower layer,
/// rejects tokens older than the newest it has seen.
#[derive(Parser, Debug)]
#[command(
    name = "fence",
    version,
    after_help = "Start here: `fence demo` runs the worked example end to end."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the worked example end to end: a stale worker's late write is rejected.
    ///
    /// Starts a lease server and a fenced sink on loopback ports with stores in a temporary
    /// directory; worker A claims, writes and stalls past its lease; B claims the next
    /// generation and writes; A's delayed write and its completion are rejected. Prints the
    /// timeline and exits 0 only if everything happened as it should.
    Demo,
    /// Serve the lease HTTP API (POST /v1/leases/{job}/claim|renew|release|complete, GET /v1/leases/{job}).
    Server(ServerArgs),
    /// A fencing reverse proxy in front of any HTTP service.
    ///
    /// Fenced requests (POST, PUT, PATCH, DELETE by default) must carry X-Fencing-Job and
    /// X-Fencing-Token; a token below the highest this proxy has accepted for the job gets
    /// 409 and never reaches the upstream. Duplicate Idempotency-Keys are replayed.
    Proxy(Box<ProxyArgs>),
    /// Claim a job, run a command under the lease, stop it the moment the lease is lost.
    ///
    /// The command gets FENCE_JOB, FENCE_TOKEN, FENCE_SERVER and FENCE_OWNER in its
    /// environment. The lease is renewed in the background. When it is lost the command gets
    /// SIGTERM at once, and SIGKILL after --grace. When the command exits 0 the job is
    /// completed; otherwise it is released. SIGINT and SIGTERM are forwarded to the command.
    #[command(after_help = "\
Exit codes:
  the command's code  it exited non-zero; the job was released
  0                   it exited 0 and the job was completed
  3                   the lease could not be obtained within --wait, or the job is completed
  75                  the lease was lost while the command ran (it got SIGTERM, then SIGKILL after --grace)
  1                   fence itself failed (server unreachable, command not found)
  2                   bad usage

Example:
  fence run --server http://127.0.0.1:7700 --job nightly-report --ttl 30s -- ./report.sh")]
    Run(RunCmd),
    /// Write an Ed25519 key pair for signed tokens: DIR/fence-signing.key (private, 0600) and
    /// DIR/fence-verify.pub (public).
    ///
    /// Give the private key to `fence server --signing-key` and the public key to every
    /// `fence proxy --verify-key`. A destination that requires signatures cannot be locked out
    /// by a forged huge token.
    Keygen(KeygenCmd),
    /// Claim a job once and print the lease as JSON.
    #[command(after_help = EXIT_CODES)]
    Claim(ClaimCmd),
    /// Renew a lease once and print it as JSON.
    #[command(after_help = EXIT_CODES)]
    Renew(RenewCmd),
    /// Release a lease (the job can be claimed again) and print the record as JSON.
    #[command(after_help = EXIT_CODES)]
    Release(FinishCmd),
    /// Complete a job (it can never be claimed again) and print the record as JSON.
    #[command(after_help = EXIT_CODES)]
    Complete(FinishCmd),
    /// Print a job's lease record as JSON.
    #[command(after_help = EXIT_CODES)]
    Status(StatusCmd),
}

#[derive(Args, Debug)]
struct ServerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    /// Directory of the lease database (created if missing); not used with --store postgres://.
    #[arg(long, required_unless_present = "store")]
    data_dir: Option<PathBuf>,
    /// Keep the leases in PostgreSQL instead (postgres://user@host:port/db); several servers
    /// on one database act as one lease service. The default is sled in --data-dir.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// PostgreSQL schema of the lease table (with --store).
    #[arg(long, default_value = "fence")]
    pg_schema: String,
    /// Sign every token with this private key (from `fence keygen`); lease answers then carry
    /// "token": "<generation>.<signature>". The file must not be readable by group or others.
    #[arg(long, value_name = "FILE")]
    signing_key: Option<PathBuf>,
    /// Test only: shift the server's clock by this many milliseconds (negative: behind).
    #[arg(long, hide = true, default_value_t = 0, allow_negative_numbers = true)]
    clock_offset_ms: i64,
}

#[derive(Args, Debug)]
struct KeygenCmd {
    /// Directory to write the two key files into (created if missing; existing key files
    /// are never overwritten).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args, Debug)]
struct ProxyArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7800")]
    listen: SocketAddr,
    /// The service to protect, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    upstream: http::Uri,
    /// Directory of the fence records (highest generation per job, idempotency records);
    /// not used with --store postgres://.
    #[arg(long, required_unless_present = "store")]
    data_dir: Option<PathBuf>,
    /// Keep the fence records in PostgreSQL instead (postgres://user@host:port/db); several
    /// proxies on one database enforce one fence. The default is sled in --data-dir.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// PostgreSQL schema of the fence tables (with --store).
    #[arg(long, default_value = "fence")]
    pg_schema: String,
    /// Address of GET /metrics and GET /healthz, apart from the proxied paths.
    #[arg(long, default_value = "127.0.0.1:7801")]
    admin_listen: SocketAddr,
    /// Methods that are fenced, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "POST,PUT,PATCH,DELETE")]
    fence_methods: Vec<Method>,
    /// Answer 428 to fenced requests without fencing headers (the default).
    #[arg(long, conflicts_with = "allow_missing_token")]
    require_token: bool,
    /// Let fenced requests without fencing headers through.
    #[arg(long)]
    allow_missing_token: bool,
    /// Ignore Idempotency-Key headers (they are still checked for syntax).
    #[arg(long)]
    no_idempotency: bool,
    /// How long completed idempotency records are kept.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    idempotency_retention: Duration,
    /// Largest response body stored for replay, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    idempotency_max_body: usize,
    /// How long a newer token waits for older in-flight requests before 503.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    drain_timeout: Duration,
    /// How long a request may take upstream before 504.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    upstream_timeout: Duration,
    /// Require signed tokens valid under this public key (from `fence keygen`); repeat it to
    /// accept several keys during a rotation. Unsigned or forged tokens get 403.
    #[arg(long, value_name = "FILE")]
    verify_key: Vec<PathBuf>,
    /// Test only (the fault-injection harness's negative control): fence nothing.
    #[arg(long, hide = true)]
    unsafe_no_fence: bool,
    /// Send the client's Host header upstream instead of the upstream's authority.
    #[arg(long)]
    preserve_host: bool,
    /// Threads serving connections, each with its own upstream connection pool; a
    /// connection stays on one thread. Default: one per CPU core.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    workers: Option<u16>,
}

#[derive(Args, Debug, Clone)]
struct ServerUrl {
    /// The lease server.
    #[arg(long, env = "FENCE_SERVER", default_value = "http://127.0.0.1:7700")]
    server: String,
    /// The job id (1 to 256 visible ASCII characters).
    #[arg(long)]
    job: JobId,
}

#[derive(Args, Debug)]
struct RunCmd {
    #[command(flatten)]
    at: ServerUrl,
    /// The owner to claim as (default: <hostname>-<pid>-<random>).
    #[arg(long)]
    owner: Option<Owner>,
    /// Lease duration: 100ms to 24h.
    #[arg(long, default_value = "30s", value_parser = parse_ttl)]
    ttl: Ttl,
    /// Keep retrying this long while the job is held by someone else.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    wait: Duration,
    /// Time between SIGTERM and SIGKILL after the lease is lost.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    grace: Duration,
    /// The command to run, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Args, Debug)]
struct ClaimCmd {
    #[command(flatten)]
    at: ServerUrl,
    /// The owner to claim as (default: <hostname>-<pid>-<random>; it is in the answer).
    #[arg(long)]
    owner: Option<Owner>,
    /// Lease duration: 100ms to 24h.
    #[arg(long, default_value = "30s", value_parser = parse_ttl)]
    ttl: Ttl,
}

#[derive(Args, Debug)]
struct RenewCmd {
    #[command(flatten)]
    at: ServerUrl,
    /// The owner that holds the lease.
    #[arg(long)]
    owner: Owner,
    /// The generation of the lease.
    #[arg(long)]
    generation: u64,
    /// Lease duration: 100ms to 24h.
    #[arg(long, default_value = "30s", value_parser = parse_ttl)]
    ttl: Ttl,
}

#[derive(Args, Debug)]
struct FinishCmd {
    #[command(flatten)]
    at: ServerUrl,
    /// The owner that holds the lease.
    #[arg(long)]
    owner: Owner,
    /// The generation of the lease.
    #[arg(long)]
    generation: u64,
}

#[derive(Args, Debug)]
struct StatusCmd {
    #[command(flatten)]
    at: ServerUrl,
}

fn parse_ttl(s: &str) -> Result<Ttl, String> {
    Ttl::new(parse_duration(s)?).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fence: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("fence: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn dispatch(cmd: Cmd) -> anyhow::Result<i32> {
    match cmd {
        Cmd::Demo => fence::demo::run().await,
        Cmd::Keygen(a) => keygen(&a.out).map(|()| 0),
        Cmd::Server(a) => server(a).await.map(|()| 0),
        Cmd::Proxy(a) => proxy(*a).await.map(|()| 0),
        Cmd::Run(a) => {
            run::run(run::RunArgs {
                server: a.at.server,
                job: a.at.job,
                owner: a.owner,
                ttl: a.ttl,
                wait: a.wait,
                grace: a.grace,
                command: a.command,
            })
            .await
        }
        Cmd::Claim(a) => {
            let owner = a.owner.unwrap_or_else(fence_lease::default_owner);
            lease_call(
                &a.at,
                "claim",
                Some(serde_json::json!({ "owner": owner, "ttl_ms": a.ttl.as_millis() })),
            )
            .await
        }
        Cmd::Renew(a) => {
            let body = serde_json::json!({ "owner": a.owner, "generation": a.generation, "ttl_ms": a.ttl.as_millis() });
            lease_call(&a.at, "renew", Some(body)).await
        }
        Cmd::Release(a) => {
            lease_call(
                &a.at,
                "release",
                Some(serde_json::json!({ "owner": a.owner, "generation": a.generation })),
            )
            .await
        }
        Cmd::Complete(a) => {
            lease_call(
                &a.at,
                "complete",
                Some(serde_json::json!({ "owner": a.owner, "generation": a.generation })),
            )
            .await
        }
        Cmd::Status(a) => lease_call(&a.at, "", None).await,
    }
}

async fn lease_call(
    at: &ServerUrl,
    op: &str,
    body: Option<serde_json::Value>,
) -> anyhow::Result<i32> {
    let url = format!(
        "{}{}",
        at.server.trim_end_matches('/'),
        lease_path(&at.job, op)
    );
    let method = if body.is_some() {
        Method::POST
    } else {
        Method::GET
    };
    let (status, answer) =
        fence::http_client::call(method, &url, body, Duration::from_secs(10)).await?;
    println!("{}", String::from_utf8_lossy(&answer).trim_end());
    Ok(match status.as_u16() {
        200 => 0,
        409 | 410 => 3,
        400 => 2,
        _ => 1,
    })
}

fn install_metrics() -> anyhow::Result<metrics_exporter_prometheus::PrometheusHandle> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")
}

async fn shutdown_signal() {
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

fn keygen(out: &std::path::Path) -> anyhow::Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut seed = [0u8; 32];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").context("opening /dev/urandom")?,
        &mut seed,
    )
    .context("reading /dev/urandom")?;
    let signer = fence_core::signing::TokenSigner::from_seed(seed);
    let write = |name: &str, mode: u32, contents: String| -> anyhow::Result<std::path::PathBuf> {
        let path = out.join(name);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .with_context(|| {
                format!(
                    "cannot create {} (an existing key is never overwritten)",
                    path.display()
                )
            })?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()?;
        Ok(path)
    };
    let private = write(
        "fence-signing.key",
        0o600,
        fence_core::signing::private_key_file_contents(&signer),
    )?;
    let public = write(
        "fence-verify.pub",
        0o644,
        signer.verify_key().to_file_contents(),
    )?;
    println!(
        "private key: {} (give it to fence server --signing-key; keep it 0600)",
        private.display()
    );
    println!(
        "public key:  {} (give it to fence proxy --verify-key)",
        public.display()
    );
    Ok(())
}

fn load_verifier(files: &[PathBuf]) -> anyhow::Result<Option<fence_core::signing::TokenVerifier>> {
    if files.is_empty() {
        return Ok(None);
    }
    let keys = files
        .iter()
        .map(|f| fence_core::signing::VerifyKey::from_file(f))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(fence_core::signing::TokenVerifier::new(keys)))
}

/// Serves the lease API over `store`, signing its grants when a signer is given.
async fn serve_leases<S: fence_lease::LeaseStore>(
    listener: tokio::net::TcpListener,
    store: S,
    signer: Option<fence_core::signing::TokenSigner>,
    handle: metrics_exporter_prometheus::PrometheusHandle,
) -> anyhow::Result<()> {
    let router = match signer {
        Some(signer) => fence::server::router(
            Arc::new(fence_lease::SigningLeaseStore::new(store, signer)),
            Some(handle),
        ),
        None => fence::server::router(Arc::new(store), Some(handle)),
    };
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving the lease API")
}

fn postgres_url(store: &str) -> anyhow::Result<&str> {
    if store.starts_with("postgres://") || store.starts_with("postgresql://") {
        Ok(store)
    } else {
        anyhow::bail!(
            "--store {store:?}: expected a postgres:// URL (leave --store out to use sled in --data-dir)"
        )
    }
}

async fn server(a: ServerArgs) -> anyhow::Result<()> {
    // Keys first: a bad key file stops the server before it listens.
    let signer = a
        .signing_key
        .as_deref()
        .map(fence_core::signing::TokenSigner::from_file)
        .transpose()?;
    let handle = install_metrics()?;
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let signing = if signer.is_some() { "on" } else { "off" };
    if let Some(store) = &a.store {
        let url = postgres_url(store)?;
        let table = fence_lease::PgTable::new(&a.pg_schema, "leases")?;
        let pg = fence_lease::PgLeaseStore::connect(url, table)
            .await
            .context("connecting to PostgreSQL")?;
        pg.migrate()
            .await
            .context("creating the lease table in PostgreSQL")?;
        pg.shift_clock_ms(a.clock_offset_ms);
        tracing::info!(listen = %listener.local_addr()?, store = "postgres", signing, "fence server ready");
        serve_leases(listener, pg, signer, handle).await?;
    } else {
        let data_dir = a
            .data_dir
            .context("--data-dir is required without --store")?;
        std::fs::create_dir_all(&data_dir)
            .with_context(|| format!("cannot create --data-dir {}", data_dir.display()))?;
        let clock = Arc::new(SystemClock::with_offset_ms(a.clock_offset_ms));
        let store = SledLeaseStore::open_with_clock(&data_dir, clock)
            .with_context(|| format!("cannot open the lease database in {}", data_dir.display()))?;
        tracing::info!(listen = %listener.local_addr()?, data_dir = %data_dir.display(), signing, "fence server ready");
        serve_leases(listener, store.clone(), signer, handle).await?;
        store.flush().context("flushing the lease database")?;
    }
    tracing::info!("fence server stopped");
    Ok(())
}

async fn proxy(a: ProxyArgs) -> anyhow::Result<()> {
    let verifier = load_verifier(&a.verify_key)?;
    let handle = install_metrics()?;
    let mut config = fence::proxy::ProxyConfig::new(a.upstream.clone());
    config.fence_methods = if a.unsafe_no_fence {
        Vec::new()
    } else {
        a.fence_methods
    };
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
    let (tx, rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let admin_task = tokio::spawn(fence::proxy::serve_admin(
        admin,
        handle,
        stopped(rx.clone()),
    ));
    let signal = tokio::spawn(async move {
        shutdown_signal().await;
        let _ = tx.send(true);
    });
    let local = listener.local_addr()?;
    let ready = |store: &str| tracing::info!(listen = %local, upstream = %a.upstream, store, "fence proxy ready");
    let result = if let Some(store) = &a.store {
        let url = postgres_url(store)?;
        let pg = fence_sink::postgres::PgStore::connect(
            url,
            fence_sink::postgres::PgTables::new(&a.pg_schema, "sink")?,
        )
        .await
        .context("connecting to PostgreSQL")?;
        pg.migrate()
            .await
            .context("creating the fence tables in PostgreSQL")?;
        ready("postgres");
        fence::proxy::serve(listener, pg, config, stopped(rx)).await
    } else {
        let data_dir = a
            .data_dir
            .context("--data-dir is required without --store")?;
        std::fs::create_dir_all(&data_dir)
            .with_context(|| format!("cannot create --data-dir {}", data_dir.display()))?;
        let store = fence_sink::SledStore::open(&data_dir)
            .with_context(|| format!("cannot open the fence database in {}", data_dir.display()))?;
        ready("sled");
        let result = fence::proxy::serve(listener, store.clone(), config, stopped(rx)).await;
        store.flush().context("flushing the fence database")?;
        result
    };
    signal.abort();
    admin_task.abort();
    result
}
