//! The command line: every command, flag and help text of `fence`.
//!
//! Every flag of `fence server`, `fence proxy` and `fence run` can also be set by an
//! environment variable `FENCE_<FLAG>` (`--data-dir` is `FENCE_DATA_DIR`); `--help` names it.
// The doc comments below are `--help` text first: placeholders such as `<hostname>` are
// written for the terminal, where backticks would show; rustdoc need not read them as HTML.
#![allow(rustdoc::invalid_html_tags)]

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum, builder::BoolishValueParser};
use fence_core::{JobId, Owner, Ttl, secret::LeaseKey};

pub use crate::duration::{parse_claim_wait, parse_forget_after};
use crate::duration::{parse_duration, parse_timeout};

mod calls;
mod outcomes;
mod proxy;
mod small;
mod tls;
pub use calls::{
    ClaimCmd, FinishCmd, KeepaliveCmd, LeasesCmd, RenewCmd, RevokeCmd, StatusCmd, WatchdogCmd,
};
pub use outcomes::{OnFailure, OnMaxDuration, OnSuccess};
pub use proxy::ProxyArgs;
pub use small::{CompletionsCmd, HealthcheckCmd};
pub use tls::{TlsCmd, TlsInitCmd};

const EXIT_CODES: &str = "\
Exit codes of the lease calls (claim, renew, release, complete, status, leases, revoke):
  0  success; the server's JSON answer is printed on stdout
  3  the lease is held by another owner, lost, or the job is completed
  2  bad usage (also a 400, 401 or 403 from the server: a bad request, a missing or unknown
     secret, a job the secret does not cover, a wrong lease key)
  1  anything else (server unreachable, unknown job for status or revoke, server error,
     and for revoke a --sink push that failed: the revoke itself stands)

The bearer secret comes from --auth-token-file or, without it, from FENCE_AUTH_TOKEN.";

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
    /// Log lines as text (default) or as JSON objects, one a line, for a log shipper.
    /// RUST_LOG sets the level (default: info; errors only for `fence demo`; e.g.
    /// RUST_LOG=fence=debug).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "FENCE_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Cmd,
}

/// How log events are written (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per event: `timestamp`, `level`, `target`, `fields` (with `message`,
    /// and `job` and `generation` on every decision).
    Json,
}

/// The commands of `fence`.
#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run the worked example end to end: a stale worker's late write is rejected.
    ///
    /// Starts a lease server and a fenced sink on loopback ports with stores in a temporary
    /// directory; worker A claims, writes and stalls past its lease; B claims the next
    /// generation and writes; A's delayed write and its completion are rejected. Prints the
    /// timeline and exits 0 only if everything happened as it should. Logs errors only
    /// (not info, as the other commands do) unless RUST_LOG asks for more.
    Demo,
    /// Serve the lease HTTP API (POST /v1/leases/{job}/claim|renew|release|complete|checkpoint|revoke, POST /v1/semaphores/{resource}/claim, GET /v1/leases/{job}, GET /v1/leases; GET /healthz, /readyz, /metrics, /openapi.json).
    ///
    /// Anyone who can reach an open lease server can revoke any job and complete other
    /// workers' jobs: on any address but loopback, give --auth-file (and
    /// --tls-cert/--tls-key), or say --insecure-no-auth.
    ///
    /// SIGINT or SIGTERM stops it: claims waiting then are answered at once (409 with the job
    /// still held, or the lease if it just came free), open requests get up to 30 s, and it
    /// exits 0; a second signal stops it at once, exit 130 or 143 (every answer given was on disk
    /// first).
    Server(ServerArgs),
    /// A fencing reverse proxy in front of any HTTP service.
    ///
    /// Fenced requests (every method but GET, HEAD, OPTIONS and TRACE by default) must carry
    /// X-Fencing-Job and X-Fencing-Token; a token below the highest this proxy has accepted
    /// for the job gets 409 and never reaches the upstream. Duplicate Idempotency-Keys are
    /// replayed. GET /metrics, GET /healthz, GET /readyz (which checks the upstream too) and
    /// GET/POST /v1/fence/{job} (a job's fence; raise it with a signed token) answer on
    /// --admin-listen (127.0.0.1:7801 by default: a second proxy on one host needs another).
    ///
    /// SIGINT or SIGTERM stops it: open requests get up to 30 s, and it exits 0; a second
    /// signal stops it at once, exit 130 or 143 (after a restart, what it passed on is waited
    /// for).
    Proxy(Box<ProxyArgs>),
    /// Claim a job, run a command under the lease, stop it the moment the lease is lost.
    ///
    /// The command runs in a process group of its own with FENCE_JOB, FENCE_TOKEN (the
    /// token when the lease was claimed), FENCE_TOKEN_FILE (a file that always holds the
    /// latest token, emptied once the lease is lost), FENCE_SERVER, FENCE_OWNER and FENCE_CHECKPOINT_FILE (the job's last
    /// checkpoint, empty when none, FENCE_CHECKPOINT_GENERATION naming who saved it; what the
    /// command writes there is saved with the lease for the next run to resume from) in its
    /// environment. The lease is renewed in the background. When it is lost the whole group gets SIGTERM at once, and SIGKILL
    /// after --grace; the same happens if `fence run` itself dies, even by SIGKILL. When the
    /// command exits 0 the job is completed (or released, with --on-success release);
    /// otherwise it is released (or left to expire, with --on-failure expire). SIGINT, SIGTERM and SIGHUP are passed on to the group,
    /// and so are SIGUSR1, SIGUSR2, SIGQUIT and SIGWINCH while the command runs. The
    /// command's group is never the terminal's foreground: a command that reads from the
    /// terminal stops (SIGTTIN); give it its input from a file or </dev/null.
    #[command(after_help = "\
Exit codes of fence run (the command's own codes pass through unchanged: a command that
itself exits 3 or 75 is told apart only by fence run's last line on stderr):
  0     the command exited 0 and the job was completed (or released; completed, not
        released, when a process of its tree then outlived its SIGKILL; left to expire,
        not released, when the lease was lost after the command ended)
  3     the lease could not be obtained within --wait, or the job is completed
  75    the lease was lost while the command ran (the group got SIGTERM, then SIGKILL
        after --grace), or the command exited (whatever its code) after its lease was
        lost, or the server refused the completion or release as lost (also when, the
        lease lost, a process of the command's tree outlived its SIGKILL by 10 s); a
        lost lease is never released
  124   --max-duration ran out: the group was stopped, the job released (or left to
        expire, with --on-max-duration expire, or --on-failure expire without it)
  1     fence itself failed (server unreachable, command not found), or a process of
        the command's tree (the command, the watchdog, what the command left) outlived
        its SIGKILL by 10 s (stuck in uninterruptible sleep; fence run gives up at most
        3 x --grace + 25 s after the command exits or is stopped) with the lease held
        and no job to complete: the job is left to expire, never released
  2     bad usage
  128+N the command was killed by signal N (fence run passes the signal on), or fence
        run got signal N while waiting for the lease (the command never ran)
  other the command's own non-zero exit code; the job was released (left to expire
        with --on-failure expire, as after a signal death, or when the lease was lost
        after the command ended)

Example:
  fence run --server https://leases.internal:7700 --job nightly-report --ttl 30s \\
    --on-success release -- ./report.sh")]
    Run(Box<RunCmd>),
    /// Write an Ed25519 key pair for signed tokens: DIR/fence-signing.pem (PKCS#8, 0600)
    /// and DIR/fence-verify.pem (SPKI).
    ///
    /// Give the private key to `fence server --signing-key` and the public key to every
    /// `fence proxy --verify-key`. A destination that requires signatures cannot be locked out
    /// by a forged huge token. Keys made by `openssl genpkey -algorithm ed25519` work too.
    Keygen(KeygenCmd),
    /// TLS certificates for the listeners in one command: `fence tls init DIR`.
    #[command(subcommand)]
    Tls(TlsCmd),
    /// Claim a job once and print the lease as JSON, with its lease key.
    ///
    /// The printed "lease_key" is the only proof that the lease is yours: pass it to renew,
    /// release and complete (--lease-key, or FENCE_LEASE_KEY), and keep it out of logs.
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
    /// Keep a lease (from `fence claim`) renewed until stdin closes or SIGTERM, SIGINT or
    /// SIGHUP arrives; exit 75 the moment it is lost.
    ///
    /// For a shell script that does its own work under a lease: whatever arrives on stdin is
    /// copied to stdout, so `./work.sh | fence keepalive --lease lease.json` renews while
    /// work.sh runs and ends when it does. The deadline is measured as `fence run`'s: from the
    /// moment each renewal was sent, less a margin (a tenth of the TTL, at least 50 ms), so
    /// 75 comes before the server's expiry. keepalive only renews: when it exits 0 the lease
    /// is still held until its TTL, for the script to complete or release
    /// (`fence complete --lease lease.json`). To have the work stopped at the loss, use
    /// `fence run`.
    #[command(after_help = "\
Exit codes of fence keepalive:
  0   stdin closed or a signal arrived; the lease is still held (until its TTL)
  75  the lease was lost (a renewal refused, or none answered before the local deadline),
      or it was not held any more when keepalive started
  2   bad usage (also a 400, 401 or 403 from the server)
  1   anything else (the server unreachable at start)

Example:
  (umask 077; fence claim --job nightly --ttl 30s > lease.json)
  ./export.sh | fence keepalive --lease lease.json --ttl 30s && fence complete --lease lease.json")]
    Keepalive(KeepaliveCmd),
    /// Take a job's lease away from its holder at once (an operator's; needs a secret whose
    /// auth-file line ends with +revoke) and print the record: free, one generation up. The
    /// holder's next renewal fails. With --sink, the raised generation is also pushed to
    /// each sink's admin listener (a server with --signing-key signs it), so the holder's
    /// writes are refused there from now on, not only after the next holder writes.
    /// Example: `fence revoke --server URL --job j --reason stuck --sink http://127.0.0.1:7801`
    #[command(after_help = EXIT_CODES)]
    Revoke(RevokeCmd),
    /// List leases, one JSON record a line, in job id order (every page of GET /v1/leases).
    ///
    /// With an auth file on the server, only the jobs the secret covers are listed.
    #[command(after_help = EXIT_CODES)]
    Leases(LeasesCmd),
    /// Print the idempotency key of one step of a job, for a third-party API that
    /// deduplicates by key (a payment provider): the same for every holder of every
    /// generation, so a new holder repeating a step a stale holder already sent is
    /// deduplicated by the provider. In a `fence run` command:
    /// `curl -H "Idempotency-Key: $(fence idempotency-key --job "$FENCE_JOB" --step charge)" ...`
    IdempotencyKey(IdempotencyKeyCmd),
    /// Exit 0 when a fence server's or proxy's /healthz answers 200, else 1 (2 for a URL or
    /// file it cannot use): for container and service health checks where curl is not
    /// installed.
    ///
    /// Example: `fence healthcheck --url http://127.0.0.1:7801` (a proxy's admin listener),
    /// `fence healthcheck --url https://localhost:7700 --ca-cert /etc/fence/tls/ca.pem`.
    Healthcheck(HealthcheckCmd),
    /// Print a shell completion script: `fence completions bash > /etc/bash_completion.d/fence`.
    Completions(CompletionsCmd),
    /// Print the manual page (roff): `fence man > fence.1 && man ./fence.1`.
    Man,
    /// Runs the watchdog of `fence run`'s command group (internal).
    #[command(hide = true)]
    Watchdog(WatchdogCmd),
}

/// The flags of `fence idempotency-key`.
#[derive(Args, Debug)]
pub struct IdempotencyKeyCmd {
    /// The job.
    #[arg(long, env = "FENCE_JOB")]
    pub job: JobId,
    /// The step's name within the job, as the worker calls it (`charge`, `email-receipt`).
    #[arg(long)]
    pub step: String,
}

/// Where a listener listens, with TLS or not, and its limits.
#[derive(Args, Debug, Clone)]
pub struct ListenArgs {
    /// Serve HTTPS with this certificate chain (PEM), with --tls-key. One that has expired or
    /// is not valid yet stops the start (exit 2); fewer than 30 days left is warned about.
    /// SIGHUP re-reads both files: new connections get the new pair, and one that does not
    /// load keeps the old pair (with a warning).
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_key",
        env = "FENCE_TLS_CERT"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_cert",
        env = "FENCE_TLS_KEY"
    )]
    pub tls_key: Option<PathBuf>,
    /// How long a new connection has to send its first request head, TLS handshake
    /// included; a connection that sends nothing, or one byte a second, is closed then.
    #[arg(long, allow_hyphen_values = true, default_value = "10s", value_parser = parse_timeout, env = "FENCE_HEADER_TIMEOUT")]
    pub header_timeout: Duration,
    /// How long a kept-alive connection may sit between an answer and the next request head
    /// (an HTTP/2 one: with no stream open, or every answer still going held back by its
    /// client), and how long a write may wait for its client to read before the connection
    /// is closed.
    #[arg(long, allow_hyphen_values = true, default_value = "60s", value_parser = parse_timeout, env = "FENCE_IDLE_TIMEOUT")]
    pub idle_timeout: Duration,
    /// Open connections at most. At the cap, an idle connection of the address that holds
    /// the most is closed (unauthenticated ones first: those that never sent an accepted
    /// secret, or for the proxy a request the fence admitted that the upstream answered with
    /// a success, not a mere X-Fencing-Token header on a GET); when all are answering,
    /// newcomers wait for one to finish. Up to 64 newcomers per accept loop (the proxy runs
    /// one per worker) wait beyond the cap, the address that holds the fewest seated first;
    /// when more come, the newest of the address that holds the most is closed unanswered (a
    /// lone load balancer then sees refused connections: raise the cap). At the proxy, an
    /// HTTP/2 connection's concurrent streams beyond the first take seats too (see
    /// --h2-max-streams). Default: 10,000, or half of what the file limit (ulimit -n)
    /// leaves.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000), env = "FENCE_MAX_CONNECTIONS")]
    pub max_connections: Option<u32>,
    /// Open connections from one IP address at most (an IPv4 client of a dual-stack listener
    /// counts by its IPv4 address): clients behind one NAT address share it. A newcomer beyond takes the place of that address's oldest idle connection, or is
    /// closed at once when all of them are answering. Default: half of --max-connections.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000), env = "FENCE_MAX_CONNECTIONS_PER_PEER")]
    pub max_connections_per_peer: Option<u32>,
    /// Concurrent HTTP/2 streams per connection at most. At the proxy, a connection's
    /// streams in flight beyond the first, gRPC calls aside, each hold one of
    /// --max-connections (they use an upstream connection each) while more than half are
    /// free, else get 503 overloaded; and a connection has at most this many gRPC calls
    /// running upstream, those its client reset included (they run to their end), else
    /// UNAVAILABLE overloaded.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000), env = "FENCE_H2_MAX_STREAMS")]
    pub h2_max_streams: u32,
    /// HTTP/2 keepalive: a ping this often; a peer silent for as long again is closed.
    #[arg(long, allow_hyphen_values = true, default_value = "20s", value_parser = parse_timeout, env = "FENCE_H2_KEEPALIVE")]
    pub h2_keepalive: Duration,
}

/// The flags of `fence server`.
#[derive(Args, Debug)]
pub struct ServerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7700", env = "FENCE_LISTEN")]
    pub listen: SocketAddr,
    /// TLS and connection limits of the listener.
    #[command(flatten)]
    pub listener: ListenArgs,
    /// Where the leases are kept.
    #[command(flatten)]
    pub storage: StorageArgs,
    /// Clients allowed to call /v1/: one a line, `<name> <secret> <job-pattern>...`
    /// (a pattern is a job id or a prefix ending in *), mode 0600. SIGHUP reloads it; a file
    /// that does not parse keeps the clients as they were.
    #[arg(long, value_name = "FILE", env = "FENCE_AUTH_FILE")]
    pub auth_file: Option<PathBuf>,
    /// Listen on an address other than loopback without --auth-file: anyone who can reach it
    /// can then revoke any job, no lease key needed, taking it from its holder (with
    /// --signing-key the answer hands them a signed token that fences the holder at every
    /// sink), claim any job, and renew, release and complete any whose lease key they learn.
    /// (Refused beside --auth-file; checked on the values, so FENCE_INSECURE_NO_AUTH=0 next to
    /// an auth file is no contradiction.)
    #[arg(long, value_parser = BoolishValueParser::new(), env = "FENCE_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,
    /// Listen on an address other than loopback without --tls-cert/--tls-key: lease keys and
    /// bearer secrets then cross the network in clear. Only for a private network you vouch
    /// for; a warning is logged at every start.
    #[arg(long, value_parser = BoolishValueParser::new(), env = "FENCE_INSECURE_NO_TLS")]
    pub insecure_no_tls: bool,
    /// The most claims that may wait at once (claim?wait=), over every client; past it a
    /// waiting claim is 429 too-many-waiters with Retry-After. At most half of
    /// --max-connections, whatever is asked (logged at start): a waiting claim keeps its
    /// connection busy, and busy connections are never closed for newcomers.
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..), env = "FENCE_MAX_WAITING_CLAIMS")]
    pub max_waiting_claims: u32,
    /// The most claims one auth-file client may have waiting at once (on a server without
    /// --auth-file, the claims from one address). At most half of
    /// --max-connections-per-peer, whatever is asked (logged at start).
    #[arg(long, value_name = "N", default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..), env = "FENCE_MAX_WAITING_CLAIMS_PER_CLIENT")]
    pub max_waiting_claims_per_client: u32,
    /// The longest the server holds one waiting claim (1ms to 60s): a claim asking to wait
    /// longer is answered when this much has passed (409 lease-held if still held), as
    /// clients that wait in a loop expect.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_claim_wait, env = "FENCE_MAX_CLAIM_WAIT")]
    pub max_claim_wait: Duration,
    /// Serve GET /metrics without a bearer secret (it needs one with --auth-file).
    #[arg(long, value_parser = BoolishValueParser::new(), env = "FENCE_PUBLIC_METRICS")]
    pub public_metrics: bool,
    /// Sign every token with this private key (PKCS#8 PEM, from `fence keygen` or openssl);
    /// lease answers then carry "token": "<generation>.<expires_at_ms>.<signature>". The file
    /// must not be readable by group or others.
    #[arg(long, value_name = "FILE", env = "FENCE_SIGNING_KEY")]
    pub signing_key: Option<PathBuf>,
    /// The longest lease granted (100ms to 24h): claims and renewals asking more get this,
    /// reported in their ttl_ms. Sinks that forget jobs must know it (their
    /// --max-lease-ttl).
    #[arg(long, allow_hyphen_values = true, value_name = "TTL", default_value = "24h", value_parser = parse_ttl, env = "FENCE_MAX_TTL")]
    pub max_ttl: Ttl,
    /// Lock-delay of claims that name none (0s to 24h): when a lease expires (its holder
    /// stalled or died; not a release, completion or revoke), nobody can claim the job
    /// until this long after the lease's end; a claim meanwhile is 409 lock-delay with the
    /// time left, a waiting claim waits it out. For effects the fence cannot reach; a
    /// weaker protection than the fence. Default: none.
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", value_parser = crate::duration::parse_lock_delay, env = "FENCE_LOCK_DELAY")]
    pub lock_delay: Option<Duration>,
    /// The largest checkpoint a holder may save with its lease (POST .../checkpoint), in
    /// bytes of UTF-8 text (1 to 65536); a larger one is 413 payload-too-large.
    #[arg(long, value_name = "BYTES", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(1..=65536), env = "FENCE_MAX_CHECKPOINT_BYTES")]
    pub max_checkpoint_bytes: u32,
    /// Delete jobs that are free, expired or completed and unchanged for this long (1s to
    /// 10 years), in the background; the store keeps the highest generation it ever forgot,
    /// and a job claimed again starts above it. A forgotten completed job may run again.
    /// Default: never forget.
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", value_parser = parse_forget_after, env = "FENCE_FORGET_AFTER")]
    pub forget_after: Option<Duration>,
    /// Test hook (feature `test-hooks`, never in a shipped binary): shift the server's clock
    /// by this many milliseconds (negative: behind).
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true, default_value_t = 0, allow_negative_numbers = true)]
    pub clock_offset_ms: i64,
}

/// The flags of `fence keygen`.
#[derive(Args, Debug)]
pub struct KeygenCmd {
    /// Directory to write the two key files into (created if missing; existing key files
    /// are never overwritten).
    #[arg(long)]
    pub out: PathBuf,
}

/// Where a server or proxy keeps its state: sled in `--data-dir`, or PostgreSQL.
#[derive(Args, Debug, Clone)]
pub struct StorageArgs {
    /// Directory of the database (created if missing): sled's files and the write-ahead log
    /// in log/ (replayed at start after a crash); not used with --store postgres://.
    #[arg(long, required_unless_present = "store", env = "FENCE_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Keep the state in PostgreSQL instead (postgres://user@host:port/db, with
    /// ?sslmode=verify-full&sslrootcert=FILE for TLS): several servers (or proxies) on one
    /// database act as one. The password may come from PGPASSWORD or a passfile instead of
    /// the URL. The default is sled in --data-dir.
    #[arg(long, value_name = "URL", env = "FENCE_STORE", hide_env_values = true)]
    pub store: Option<String>,
    /// PostgreSQL schema of the tables (with --store).
    #[arg(long, default_value = "fence", env = "FENCE_PG_SCHEMA")]
    pub pg_schema: String,
}

/// How a command reaches the lease server.
#[derive(Args, Debug, Clone)]
pub struct ServerConn {
    /// The lease server: http://host:port or https://host:port; several servers that share
    /// one database separated by commas (http://a:7700,http://b:7700): a call moves to the
    /// next only when no connection could be made to one, never once a request may have
    /// reached it.
    #[arg(long, env = "FENCE_SERVER", default_value = "http://127.0.0.1:7700")]
    pub server: String,
    /// Trust only this CA (PEM, one or more certificates) for an https:// server, instead of
    /// the system's roots.
    #[arg(long, value_name = "FILE", env = "FENCE_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// Read the bearer secret (for a server with --auth-file) from this file; without it,
    /// FENCE_AUTH_TOKEN is used when set.
    #[arg(long, value_name = "FILE", env = "FENCE_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
}

/// Which server and which job a lease call is about.
#[derive(Args, Debug, Clone)]
pub struct ServerUrl {
    /// The lease server.
    #[command(flatten)]
    pub conn: ServerConn,
    /// The job id (1 to 256 visible ASCII characters).
    #[arg(long, env = "FENCE_JOB")]
    pub job: JobId,
}

/// The flags of `fence run`.
#[derive(Args, Debug)]
pub struct RunCmd {
    /// The server and the job.
    #[command(flatten)]
    pub at: ServerUrl,
    /// The owner to claim as (default: <hostname>-<pid>-<random>).
    #[arg(long, env = "FENCE_OWNER")]
    pub owner: Option<Owner>,
    /// Lease duration: 100ms to 24h.
    #[arg(long, allow_hyphen_values = true, default_value = "30s", value_parser = parse_ttl, env = "FENCE_TTL")]
    pub ttl: Ttl,
    /// If the lease expires (this process stalled or died rather than finished), nobody can
    /// claim the job until this long after the lease's end (0s to 24h; default: the
    /// server's --lock-delay).
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", value_parser = crate::duration::parse_lock_delay, env = "FENCE_LOCK_DELAY")]
    pub lock_delay: Option<Duration>,
    /// Renew the lease only while this file's modification time moves (the command touches
    /// it as it makes progress; its path is in FENCE_PROGRESS_FILE): a command that hangs or
    /// live-locks, alive but no longer advancing, loses the lease once --progress-within
    /// passes without a change, and is stopped like on any loss (exit 75). The lease then
    /// expires at the server. Default: renew for as long as the command runs.
    #[arg(long, value_name = "FILE", env = "FENCE_PROGRESS_FILE")]
    pub progress_file: Option<PathBuf>,
    /// With --progress-file: the longest the file may stand still (10ms to 24h).
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", default_value = "60s", value_parser = crate::duration::parse_progress_within, requires = "progress_file", env = "FENCE_PROGRESS_WITHIN")]
    pub progress_within: Duration,
    /// Run as one of at most N holders of the job, a fenced semaphore (1 to 1000): the
    /// job names the resource, and the lease is one of its N slots, whose fencing job
    /// (`<job>#<slot>`) is in FENCE_JOB (the resource in FENCE_RESOURCE). A stale holder of
    /// a slot is refused at a fence proxy once the slot is granted again. N is fixed while
    /// any slot has a holder (or was revoked before its lease would have ended): a run
    /// asking for another N exits 3 at once, --wait or not. On
    /// exit 0 the slot is released (a slot is never completed).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000), env = "FENCE_SLOTS")]
    pub slots: Option<u32>,
    /// Keep retrying this long while the job is held by someone else (with --slots: while
    /// every slot is taken), and while the server cannot be reached or is unavailable. An
    /// answer that asking again cannot change (a secret the server refuses, a request it
    /// calls malformed, a job at its last generation) ends the run at once.
    #[arg(long, allow_hyphen_values = true, default_value = "0s", value_parser = parse_duration, env = "FENCE_WAIT")]
    pub wait: Duration,
    /// Time between SIGTERM and SIGKILL after the lease is lost. When it ran out (rather than
    /// being taken over), the SIGKILL comes sooner if the server could otherwise let another
    /// owner claim the job first: within the safety margin (a tenth of --ttl) plus
    /// --lock-delay.
    #[arg(long, allow_hyphen_values = true, default_value = "5s", value_parser = parse_duration, env = "FENCE_GRACE")]
    pub grace: Duration,
    /// What to do with the job when the command exits 0 [default: complete]. With --slots
    /// the slot is released, and asking to complete it is refused (exit 2).
    #[arg(long, value_enum, env = "FENCE_ON_SUCCESS")]
    pub on_success: Option<OnSuccess>,
    /// What to do with the job when the command fails (exits non-zero or is killed by a
    /// signal) with the lease held: release it (the next run may start at once), or let the
    /// lease expire: nobody can claim it until its end and the lock-delay after it have
    /// passed. Expire when a failed effect may still land (a write that timed out). Also
    /// what --max-duration does, unless --on-max-duration says otherwise.
    #[arg(long, value_enum, default_value = "release", env = "FENCE_ON_FAILURE")]
    pub on_failure: OnFailure,
    /// Stop the command when it has run this long, however well the lease renews (1s to
    /// 365d): SIGTERM to its group, SIGKILL after --grace, exit 124.
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", value_parser = crate::duration::parse_max_duration, env = "FENCE_MAX_DURATION")]
    pub max_duration: Option<Duration>,
    /// What to do with the job when --max-duration stops the command: release it (free for
    /// the next run at once) or let the lease expire (nobody can claim it until the TTL and
    /// the lock-delay have passed, so a command that ignored SIGTERM is long gone) [default:
    /// as --on-failure: a command stopped mid-run has failed, and its effects may still land].
    #[arg(long, value_enum, env = "FENCE_ON_MAX_DURATION")]
    pub on_max_duration: Option<OnMaxDuration>,
    /// The command to run, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// A lease duration: 100ms to 24h, in the syntax of [`parse_duration`].
///
/// # Errors
/// A message naming what is wrong, for clap to print.
pub fn parse_ttl(s: &str) -> Result<Ttl, String> {
    Ttl::new(parse_duration(s)?).map_err(|e| e.to_string())
}

/// The command line, parsed; exits with clap's message (2) when it is wrong. A lease key
/// that does not check is not repeated in the message: clap's own says `invalid value
/// '<the value>'`, and the common mistakes (a key still in its JSON quotes, a quoted line of
/// an env file) are the whole real key, which would land in a CI or container log.
#[must_use]
pub fn parse() -> Cli {
    Cli::try_parse().unwrap_or_else(|e| without_secrets(e).exit())
}

fn without_secrets(e: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let secret = e.kind() == ErrorKind::ValueValidation
        && matches!(
            e.get(ContextKind::InvalidArg),
            Some(ContextValue::String(arg)) if arg.starts_with("--lease-key")
        );
    if !secret {
        return e;
    }
    let cause = std::error::Error::source(&e).map_or_else(String::new, ToString::to_string);
    <Cli as clap::CommandFactory>::command().error(
        ErrorKind::ValueValidation,
        format!("invalid value for '--lease-key' (not repeated: it is a secret): {cause}"),
    )
}

/// A lease key as `fence claim` printed it.
///
/// # Errors
/// A message naming what is wrong (never the key), for clap to print.
pub fn parse_lease_key(s: &str) -> Result<LeaseKey, String> {
    LeaseKey::new(s.trim()).map_err(|e| format!("the lease key {e}"))
}

/// The command line as completions and the manual page show it: every command and flag a
/// user may type, without the hidden ones (`watchdog`, which `fence run` starts itself).
/// clap's generators walk hidden subcommands too and `clap::Command` cannot remove one, so
/// the root is put together again from `Cli`'s own arguments and its visible subcommands.
#[must_use]
pub fn shown_commands() -> clap::Command {
    let full = <Cli as clap::CommandFactory>::command();
    let mut shown = clap::Command::new("fence")
        .version(env!("CARGO_PKG_VERSION"))
        .about(full.get_about().cloned().unwrap_or_default())
        .long_about(full.get_long_about().cloned().unwrap_or_default())
        .after_help(full.get_after_help().cloned().unwrap_or_default())
        .subcommand_required(true);
    for arg in full.get_arguments() {
        shown = shown.arg(arg.clone());
    }
    for sub in full.get_subcommands().filter(|s| !s.is_hide_set()) {
        shown = shown.subcommand(sub.clone());
    }
    shown
}
