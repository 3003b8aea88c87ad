//! `fence run`: claim a job, run a command under the lease, stop it the moment the lease is lost.
//!
//! Exit codes: the command's own code (it exited non-zero; the job is released), 0 (it exited
//! 0 and the job was completed), 3 (the lease could not be obtained within `--wait`, or the
//! job is completed), 75 (the lease was lost while the command ran: it got SIGTERM, then
//! SIGKILL after `--grace`), 1 (fence itself failed: server unreachable, command not found).

use std::{process::Stdio, time::Duration};

use fence_core::JobId;
use fence_lease::{Backoff, ClaimError, FinishError, HttpLeaseStore, Lease, LeaseClient, Ttl};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use tokio::{
    process::{Child, Command},
    signal::unix::{SignalKind, signal},
    time::Instant,
};

/// Exit code when the lease was lost while the command ran (EX_TEMPFAIL).
pub const EXIT_LOST: i32 = 75;
/// Exit code when the lease could not be obtained.
pub const EXIT_NOT_OBTAINED: i32 = 3;

/// What `fence run` was asked to do.
#[derive(Debug)]
pub struct RunArgs {
    /// The lease server.
    pub server: String,
    /// The job.
    pub job: JobId,
    /// The owner to claim as (default: `<host>-<pid>-<random>`).
    pub owner: Option<fence_core::Owner>,
    /// The lease's TTL.
    pub ttl: Ttl,
    /// How long to keep trying while the job is held.
    pub wait: Duration,
    /// Between SIGTERM and SIGKILL after the lease is lost.
    pub grace: Duration,
    /// The command and its arguments.
    pub command: Vec<String>,
}

/// Runs the command under the lease and returns the process exit code.
///
/// # Errors
/// When the server URL is invalid or the command cannot be started.
pub async fn run(args: RunArgs) -> anyhow::Result<i32> {
    let store = HttpLeaseStore::new(&args.server)?;
    let mut client = LeaseClient::new(store).ttl(args.ttl);
    if let Some(owner) = args.owner.clone() {
        client = client.owner(owner);
    }
    let Some(lease) = claim_within(&client, &args.job, args.wait).await? else {
        return Ok(EXIT_NOT_OBTAINED);
    };
    let Some(token) = lease.token_string() else {
        eprintln!(
            "fence run: the lease on {} was lost right after the claim; not running the command",
            args.job
        );
        return Ok(EXIT_LOST);
    };
    eprintln!(
        "fence run: holding {} as {} with token {token}",
        args.job,
        client.owner_id()
    );

    let Some((program, rest)) = args.command.split_first() else {
        let _ = lease.release().await;
        anyhow::bail!("no command given");
    };
    let spawned = Command::new(program)
        .args(rest)
        .env("FENCE_JOB", args.job.as_str())
        .env("FENCE_TOKEN", &token)
        .env("FENCE_SERVER", &args.server)
        .env("FENCE_OWNER", client.owner_id().as_str())
        .stdin(Stdio::inherit())
        .kill_on_drop(true)
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            // Give the job back at once instead of leaving it held for the whole ttl.
            let _ = lease.release().await;
            return Err(anyhow::Error::new(e)
                .context(format!("cannot start {program:?}; the job was released")));
        }
    };
    let pid = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .map(Pid::from_raw);
    supervise(&mut child, pid, lease, args.grace).await
}

async fn claim_within(
    client: &LeaseClient<HttpLeaseStore>,
    job: &JobId,
    wait: Duration,
) -> anyhow::Result<Option<Lease<HttpLeaseStore>>> {
    let give_up = Instant::now() + wait;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let pause = match client.claim(job.clone()).await {
            Ok(lease) => return Ok(Some(lease)),
            Err(ClaimError::Completed { generation, .. }) => {
                eprintln!(
                    "fence run: job {job} is completed (generation {generation}); not running the command"
                );
                return Ok(None);
            }
            Err(ClaimError::Held {
                owner, expires_in, ..
            }) => {
                if Instant::now() >= give_up {
                    eprintln!(
                        "fence run: job {job} is held by {owner} for another {expires_in:?}; gave up after --wait {wait:?}"
                    );
                    return Ok(None);
                }
                expires_in.min(backoff.next_pause())
            }
            Err(e @ ClaimError::Timing(_)) => return Err(e.into()),
            Err(e) => {
                if Instant::now() >= give_up {
                    return Err(anyhow::Error::new(e)
                        .context(format!("could not claim {job} within --wait {wait:?}")));
                }
                eprintln!(
                    "fence run: claim failed, retrying: {}",
                    fence_storage::error_chain(&e)
                );
                backoff.next_pause()
            }
        };
        tokio::time::sleep(
            pause
                .min(give_up.saturating_duration_since(Instant::now()))
                .max(Duration::from_millis(10)),
        )
        .await;
    }
}

fn send(pid: Option<Pid>, sig: Signal) {
    if let Some(pid) = pid {
        // The child may have exited already; nothing to do then.
        let _ = kill(pid, sig);
    }
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

async fn supervise(
    child: &mut Child,
    pid: Option<Pid>,
    lease: Lease<HttpLeaseStore>,
    grace: Duration,
) -> anyhow::Result<i32> {
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let lost = lease.lost();
    tokio::pin!(lost);
    let status = loop {
        tokio::select! {
            status = child.wait() => break status?,
            _ = sigint.recv() => send(pid, Signal::SIGINT),
            _ = sigterm.recv() => send(pid, Signal::SIGTERM),
            _ = sighup.recv() => send(pid, Signal::SIGHUP),
            () = &mut lost => {
                let reason = lease.loss_reason().map_or_else(|| "unknown".to_owned(), |r| r.to_string());
                eprintln!("fence run: lease lost ({reason}); sending SIGTERM to the command");
                send(pid, Signal::SIGTERM);
                if tokio::time::timeout(grace, child.wait()).await.is_err() {
                    eprintln!("fence run: the command did not exit within {grace:?}; sending SIGKILL");
                    send(pid, Signal::SIGKILL);
                    child.wait().await?;
                }
                return Ok(EXIT_LOST);
            }
        }
    };
    let code = exit_code(status);
    let finished = if code == 0 {
        lease.complete().await
    } else {
        lease.release().await
    };
    match finished {
        Ok(record) => {
            eprintln!(
                "fence run: command exited {code}; job is {}",
                record.state.as_str()
            );
            Ok(code)
        }
        Err(FinishError::Lost { owner, generation }) => {
            eprintln!(
                "fence run: command exited {code}, but the lease was lost (now generation {generation}, held by {owner:?})"
            );
            Ok(EXIT_LOST)
        }
        Err(e) => Err(anyhow::Error::new(e).context("finishing the lease failed")),
    }
}
