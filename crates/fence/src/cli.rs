//! The command line: every command, flag and help text of `fence`.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};
use fence_core::{JobId, Owner, Ttl};
use http::Method;

use crate::duration::parse_duration;

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
pub struct Cli {
    #[command(subcommand)]
    /// What to do.
    pub command: Cmd,
}

#[derive(Subcommand, Debug)]
/// The commands of `fence`.
pub enum Cmd {
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
/// The flags of `fence server`.
pub struct ServerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: SocketAddr,
    /// Where the leases are kept.
    #[command(flatten)]
    pub storage: StorageArgs,
    /// Sign every token with this private key (from `fence keygen`); lease answers then carry
    /// "token": "<generation>.<signature>". The file must not be readable by group or others.
    #[arg(long, value_name = "FILE")]
    pub signing_key: Option<PathBuf>,
    /// Test hook (feature `test-hooks`, never in a shipped binary): shift the server's clock
    /// by this many milliseconds (negative: behind).
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true, default_value_t = 0, allow_negative_numbers = true)]
    pub clock_offset_ms: i64,
}

#[derive(Args, Debug)]
/// The flags of `fence keygen`.
pub struct KeygenCmd {
    /// Directory to write the two key files into (created if missing; existing key files
    /// are never overwritten).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
/// The flags of `fence proxy`.
pub struct ProxyArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7800")]
    pub listen: SocketAddr,
    /// The service to protect, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub upstream: http::Uri,
    /// Where the fence records (highest generation per job, idempotency records) are kept.
    #[command(flatten)]
    pub storage: StorageArgs,
    /// Address of GET /metrics and GET /healthz, apart from the proxied paths.
    #[arg(long, default_value = "127.0.0.1:7801")]
    pub admin_listen: SocketAddr,
    /// Methods that are fenced, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "POST,PUT,PATCH,DELETE")]
    pub fence_methods: Vec<Method>,
    /// Answer 428 to fenced requests without fencing headers (the default).
    #[arg(long, conflicts_with = "allow_missing_token")]
    pub require_token: bool,
    /// Let fenced requests without fencing headers through.
    #[arg(long)]
    pub allow_missing_token: bool,
    /// Ignore Idempotency-Key headers (they are still checked for syntax).
    #[arg(long)]
    pub no_idempotency: bool,
    /// How long completed idempotency records are kept.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    pub idempotency_retention: Duration,
    /// Largest response body stored for replay, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub idempotency_max_body: usize,
    /// How long a newer token waits for older in-flight requests before 503.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// How long a request may take upstream before 504.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub upstream_timeout: Duration,
    /// Require signed tokens valid under this public key (from `fence keygen`); repeat it to
    /// accept several keys during a rotation. Unsigned or forged tokens get 403.
    #[arg(long, value_name = "FILE")]
    pub verify_key: Vec<PathBuf>,
    /// Test hook (feature `test-hooks`, never in a shipped binary): fence nothing, the
    /// fault-injection harness's negative control.
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true)]
    pub unsafe_no_fence: bool,
    /// Send the client's Host header upstream instead of the upstream's authority.
    #[arg(long)]
    pub preserve_host: bool,
    /// Threads serving connections, each with its own upstream connection pool; a
    /// connection stays on one thread. Default: one per CPU core.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub workers: Option<u16>,
}

/// Where a server or proxy keeps its state: sled in `--data-dir`, or PostgreSQL.
#[derive(Args, Debug, Clone)]
pub struct StorageArgs {
    /// Directory of the database (created if missing); not used with --store postgres://.
    #[arg(long, required_unless_present = "store")]
    pub data_dir: Option<PathBuf>,
    /// Keep the state in PostgreSQL instead (postgres://user@host:port/db): several servers
    /// (or proxies) on one database act as one. The default is sled in --data-dir.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// PostgreSQL schema of the tables (with --store).
    #[arg(long, default_value = "fence")]
    pub pg_schema: String,
}

/// Which server and which job a lease call is about.
#[derive(Args, Debug, Clone)]
pub struct ServerUrl {
    /// The lease server.
    #[arg(long, env = "FENCE_SERVER", default_value = "http://127.0.0.1:7700")]
    pub server: String,
    /// The job id (1 to 256 visible ASCII characters).
    #[arg(long)]
    pub job: JobId,
}

#[derive(Args, Debug)]
/// The flags of `fence run`.
pub struct RunCmd {
    /// The server and the job.
    #[command(flatten)]
    pub at: ServerUrl,
    /// The owner to claim as (default: <hostname>-<pid>-<random>).
    #[arg(long)]
    pub owner: Option<Owner>,
    /// Lease duration: 100ms to 24h.
    #[arg(long, default_value = "30s", value_parser = parse_ttl)]
    pub ttl: Ttl,
    /// Keep retrying this long while the job is held by someone else.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub wait: Duration,
    /// Time between SIGTERM and SIGKILL after the lease is lost.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub grace: Duration,
    /// The command to run, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

#[derive(Args, Debug)]
/// The flags of `fence claim`.
pub struct ClaimCmd {
    /// The server and the job.
    #[command(flatten)]
    pub at: ServerUrl,
    /// The owner to claim as (default: <hostname>-<pid>-<random>; it is in the answer).
    #[arg(long)]
    pub owner: Option<Owner>,
    /// Lease duration: 100ms to 24h.
    #[arg(long, default_value = "30s", value_parser = parse_ttl)]
    pub ttl: Ttl,
}

#[derive(Args, Debug)]
/// The flags of `fence renew`.
pub struct RenewCmd {
    /// The lease.
    #[command(flatten)]
    pub lease: FinishCmd,
    /// Lease duration: 100ms to 24h.
    #[arg(long, default_value = "30s", value_parser = parse_ttl)]
    pub ttl: Ttl,
}

#[derive(Args, Debug)]
/// The flags of `fence release` and `fence complete`.
pub struct FinishCmd {
    /// The server and the job.
    #[command(flatten)]
    pub at: ServerUrl,
    /// The owner that holds the lease.
    #[arg(long)]
    pub owner: Owner,
    /// The generation of the lease.
    #[arg(long)]
    pub generation: u64,
}

#[derive(Args, Debug)]
/// The flags of `fence status`.
pub struct StatusCmd {
    /// The server and the job.
    #[command(flatten)]
    pub at: ServerUrl,
}

/// A lease duration: 100ms to 24h, in the syntax of [`parse_duration`].
///
/// # Errors
/// A message naming what is wrong, for clap to print.
pub fn parse_ttl(s: &str) -> Result<Ttl, String> {
    Ttl::new(parse_duration(s)?).map_err(|e| e.to_string())
}
