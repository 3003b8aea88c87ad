//! The flags of the lease calls: claim, renew, release, complete and the rest.
#![allow(rustdoc::invalid_html_tags)]

use std::{path::PathBuf, time::Duration};

use clap::Args;
use fence_core::{JobId, Owner, Ttl, secret::LeaseKey};

use super::{ServerConn, ServerUrl, parse_lease_key, parse_ttl};
use crate::duration::parse_duration;

/// The flags of `fence claim`.
#[derive(Args, Debug)]
pub struct ClaimCmd {
    /// The server and the job.
    #[command(flatten)]
    pub at: ServerUrl,
    /// The owner to claim as (default: <hostname>-<pid>-<random>; it is in the answer).
    #[arg(long)]
    pub owner: Option<Owner>,
    /// Lease duration: 100ms to 24h.
    #[arg(long, allow_hyphen_values = true, default_value = "30s", value_parser = parse_ttl)]
    pub ttl: Ttl,
    /// If this lease expires (rather than being released or completed), nobody can claim
    /// the job until this long after its end (0s to 24h; default: the server's
    /// --lock-delay). For effects no fence can reach.
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", value_parser = crate::duration::parse_lock_delay)]
    pub lock_delay: Option<Duration>,
}

/// The flags of `fence renew`.
#[derive(Args, Debug)]
pub struct RenewCmd {
    /// The lease.
    #[command(flatten)]
    pub lease: FinishCmd,
    /// Lease duration: 100ms to 24h.
    #[arg(long, allow_hyphen_values = true, default_value = "30s", value_parser = parse_ttl)]
    pub ttl: Ttl,
}

/// Which lease `fence renew`, `release`, `complete` and `keepalive` act on: the JSON
/// `fence claim` printed (`--lease`), or its parts one flag each.
#[derive(Args, Debug)]
pub struct FinishCmd {
    /// The lease server.
    #[command(flatten)]
    pub conn: ServerConn,
    /// The lease as `fence claim` printed it (its job, owner, generation and lease_key are
    /// read from it): a file, or - for stdin. Instead of --job, --owner, --generation and
    /// --lease-key, so a script need not take the JSON apart:
    /// `(umask 077; fence claim --job j > lease.json) && fence complete --lease lease.json`.
    /// Keep the file private (the umask above, or chmod 600): the lease key in it is the
    /// proof of the lease, and a file group or others may read is warned of. At most 64 KiB.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["owner", "generation", "lease_key"])]
    pub lease: Option<PathBuf>,
    /// The job id (1 to 256 visible ASCII characters). Without --lease, FENCE_JOB stands in
    /// for it. With --lease, only this flag is checked against the file: FENCE_JOB, which
    /// `fence run` exports for its own job, is not, so a command run under it can finish the
    /// lease of another job from its file.
    #[arg(long)]
    pub job: Option<JobId>,
    /// The owner that holds the lease.
    #[arg(long, required_unless_present = "lease")]
    pub owner: Option<Owner>,
    /// The generation of the lease.
    #[arg(long, required_unless_present = "lease", allow_hyphen_values = true)]
    pub generation: Option<u64>,
    /// The lease key `fence claim` printed. Prefer FENCE_LEASE_KEY: a flag's value shows in
    /// the process list. With --lease, the file's key is used and FENCE_LEASE_KEY is not
    /// read (a key exported for another lease does not stand in the way).
    /// (A key may start with `-`: base64url uses it.)
    #[arg(long, allow_hyphen_values = true, value_parser = parse_lease_key)]
    pub lease_key: Option<LeaseKey>,
}

/// The flags of `fence keepalive`.
#[derive(Args, Debug)]
pub struct KeepaliveCmd {
    /// The lease.
    #[command(flatten)]
    pub lease: FinishCmd,
    /// Lease duration asked for at each renewal: 100ms to 24h.
    #[arg(long, allow_hyphen_values = true, default_value = "30s", value_parser = parse_ttl)]
    pub ttl: Ttl,
    /// Keep the lease's current token in this file (mode 0600, replaced atomically, a
    /// newline after it): read it before each write, since a renewal of a signed lease
    /// signs a new token. Emptied when keepalive exits, the lease lost or not: nothing
    /// renews it after.
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<PathBuf>,
}

/// The flags of `fence revoke`.
#[derive(Args, Debug)]
pub struct RevokeCmd {
    /// The server and the job.
    #[command(flatten)]
    pub at: ServerUrl,
    /// Why, for the server's log.
    #[arg(long)]
    pub reason: Option<String>,
    /// A sink's admin URL (`fence proxy --admin-listen`) to push the new generation to;
    /// repeat for several.
    #[arg(long, value_name = "URL")]
    pub sink: Vec<String>,
    /// Read the bearer secret of the sinks' admin listeners (`fence proxy
    /// --admin-auth-file`) from this file; without it, FENCE_SINK_AUTH_TOKEN is used when
    /// set. The lease server's secret is never sent to a sink.
    #[arg(long, value_name = "FILE", env = "FENCE_SINK_AUTH_TOKEN_FILE")]
    pub sink_auth_token_file: Option<PathBuf>,
    /// Trust only this CA (PEM) for https:// sinks. Default: --ca-cert's, or the system's
    /// roots.
    #[arg(long, value_name = "FILE", env = "FENCE_SINK_CA_CERT")]
    pub sink_ca_cert: Option<PathBuf>,
}

/// The flags of `fence status`.
#[derive(Args, Debug)]
pub struct StatusCmd {
    /// The server and the job.
    #[command(flatten)]
    pub at: ServerUrl,
}

/// The flags of `fence leases`.
#[derive(Args, Debug)]
pub struct LeasesCmd {
    /// The lease server.
    #[command(flatten)]
    pub conn: ServerConn,
    /// Only leases in this state: free, held, expired or completed.
    #[arg(long, value_parser = ["free", "held", "expired", "completed"])]
    pub state: Option<String>,
    /// Only jobs whose id starts with this.
    #[arg(long)]
    pub prefix: Option<String>,
}

/// The flags of `fence watchdog`.
#[derive(Args, Debug)]
pub struct WatchdogCmd {
    /// Between SIGTERM and SIGKILL to the group.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration)]
    pub grace: Duration,
    /// The command's FENCE_TOKEN_FILE, emptied before the group's SIGTERM.
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<std::path::PathBuf>,
}
