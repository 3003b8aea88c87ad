//! `fence run`: claim a job, run a command under the lease, stop it the moment the lease is lost.
//!
//! The command runs in a process group of its own with a watchdog: a second `fence` process
//! in the same group that reads a pipe from `fence run`. Every signal goes to the whole
//! group, so a command's children stop with it. If `fence run` dies, even by SIGKILL, the
//! pipe closes and the watchdog stops the group: SIGTERM, then SIGKILL after `--grace`.
//! `fence run` also writes the time left until the lease's local deadline into the pipe
//! every 100 ms, so a `fence run` that is frozen (SIGSTOP, swapped out) rather than dead
//! still has its group stopped at the deadline by the watchdog. No `unsafe` is needed (no
//! `pre_exec`, no `PR_SET_PDEATHSIG`).
//!
//! Exit codes: 0 (the command exited 0; the job was completed or released, completed even
//! when a process of its tree then outlived its SIGKILL), 3 (the lease could not be obtained
//! within `--wait`, or the job is completed), 75 (the lease was lost while the command ran,
//! also when a process of its tree then outlived its SIGKILL by 10 s, or the server refused
//! the completion or release as lost), 124
//! (`--max-duration` passed and the command was stopped), 1 (fence itself failed, or with the
//! lease held and no job to complete a process of the command's tree outlived its SIGKILL by
//! 10 s: the job is left to expire, never released; `fence run` gives up at most 3 ×
//! `--grace` + 25 s after the command exits or is stopped), 128+N (the command was killed by
//! signal N, or `fence run` got it while waiting for the lease), otherwise the command's own
//! code (the job was released, or left to expire with `--on-failure expire` or when the
//! lease was lost after the command ended: a lost lease is never released).

use std::{process::Stdio, time::Duration};

use anyhow::Context as _;
use fence_core::JobId;
use fence_lease::{HttpLeaseStore, Lease, LeaseClient, LossReason, Ttl};
use nix::sys::signal::Signal;
use tokio::{
    process::{Child, Command},
    time::Instant,
};

mod checkpoint;
mod claim;
mod finish;
mod group;
mod procs;
mod progress;
mod reaper;
mod signals;
pub(crate) mod token_file;
mod watchdog;
mod words;
use checkpoint::CheckpointFile;
use claim::{claim_slot_within, claim_within};
use finish::{finish, give_back, out_of_time};
use group::{Group, reap_killed};
use signals::Signals;
use token_file::TokenFile;
use watchdog::Stop;
pub use watchdog::watchdog;
use words::ended_how;

use crate::cli::{OnFailure, OnMaxDuration, OnSuccess, ServerConn};

/// Exit code when the lease was lost while the command ran (EX_TEMPFAIL).
pub const EXIT_LOST: i32 = 75;
/// Exit code when the lease could not be obtained.
pub const EXIT_NOT_OBTAINED: i32 = 3;
/// Exit code when `--max-duration` passed and the command was stopped (as `timeout(1)`).
pub const EXIT_MAX_DURATION: i32 = 124;

/// What `fence run` was asked to do.
#[derive(Debug)]
pub struct RunArgs {
    /// How to reach the lease server.
    pub conn: ServerConn,
    /// The job.
    pub job: JobId,
    /// The owner to claim as (default: `<host>-<pid>-<random>`).
    pub owner: Option<fence_core::Owner>,
    /// The lease's TTL.
    pub ttl: Ttl,
    /// The lease's lock-delay (`None`: the server's default).
    pub lock_delay: Option<Duration>,
    /// Renew only while this file's modification time moves, checked against this interval.
    pub progress: Option<(std::path::PathBuf, Duration)>,
    /// Claim a slot of a semaphore of this many slots, `job` being its resource.
    pub slots: Option<u32>,
    /// How long to keep trying while the job is held.
    pub wait: Duration,
    /// Between SIGTERM and SIGKILL after the lease is lost.
    pub grace: Duration,
    /// What to do with the job when the command exits 0 (`None`: complete it, or with
    /// `slots` release the slot; completing a slot is refused).
    pub on_success: Option<OnSuccess>,
    /// What to do with the job when the command fails with the lease held.
    pub on_failure: OnFailure,
    /// Stop the command after this long, and what to do with the job then.
    pub max_duration: Option<(Duration, OnMaxDuration)>,
    /// The command and its arguments.
    pub command: Vec<String>,
}

/// Runs the command under the lease and returns the process exit code.
///
/// # Errors
/// When the server URL is invalid or the command cannot be started.
pub async fn run(args: RunArgs) -> anyhow::Result<i32> {
    // A semaphore's slot is released when the command exits 0, never completed.
    let on_success = match (args.slots, args.on_success) {
        (Some(_), Some(OnSuccess::Complete)) => {
            return Err(crate::Usage::error(
                "--on-success complete (or FENCE_ON_SUCCESS=complete) cannot be used with \
                 --slots (or FENCE_SLOTS): a semaphore's slot is released when the command \
                 exits 0, never completed (leave --on-success out, or give --on-success \
                 release)",
            ));
        }
        (Some(_), _) => OnSuccess::Release,
        (None, on_success) => on_success.unwrap_or(OnSuccess::Complete),
    };
    let mut signals = Signals::install().context("installing signal handlers")?;
    // Orphaned descendants (a grandchild that left the group with setsid, once its parent
    // is gone) become ours rather than init's, so they are found and stopped with the rest.
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::debug!(error = %e, "cannot become the subreaper of the command's tree");
    }
    // Not dumpable: the command, running as the same user, cannot read the lease server's
    // secret (FENCE_AUTH_TOKEN) from /proc/<fence run>/environ, nor ptrace it out.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::debug!(error = %e, "cannot keep this process's memory from the command");
    }
    let reaper = reaper::Reaper::start();
    let store = crate::calls::connect(&args.conn)?;
    let mut client = LeaseClient::new(store).ttl(args.ttl);
    if let Some(delay) = args.lock_delay {
        client = client.lock_delay(delay);
    }
    if let Some((_, within)) = &args.progress {
        client = client.progress_within(*within);
    }
    if let Some(owner) = args.owner.clone() {
        client = client.owner(owner);
    }
    let claim = async {
        match args.slots {
            Some(slots) => claim_slot_within(&client, &args.job, slots, args.wait).await,
            None => claim_within(&client, &args.job, args.wait).await,
        }
    };
    // Ctrl-C (or a service manager's SIGTERM) during a long --wait ends the wait, rather than
    // being held until the claim returns and then handed to a command just started.
    let claimed = tokio::select! {
        claimed = claim => claimed?,
        sig = signals.next() => {
            say!("fence run: {sig} while waiting for the lease; the command was not started");
            return Ok(128 + sig as i32);
        }
    };
    let Some(lease) = claimed else {
        return Ok(EXIT_NOT_OBTAINED);
    };
    let resource = args.slots.map(|_| args.job.clone());
    let job = lease.job().clone();
    // Subscribed before the token is read: a renewal from now on reaches FENCE_TOKEN_FILE.
    let token_updates = lease.tokens();
    let Some(token) = lease.token_string() else {
        say!(
            "fence run: the lease on {job} was lost right after the claim; not running the command"
        );
        return Ok(EXIT_LOST);
    };
    // The token is not a secret, but a signed one is long; the generation says it all.
    say!(
        "fence run: holding {job} as {} at generation {}",
        client.owner_id(),
        lease.generation()
    );
    let resumed = lease.resumed_from();
    let files = TokenFile::new(&token).and_then(|token_file| {
        CheckpointFile::seed(token_file.checkpoint_path(), resumed, lease.checkpointer())
            .context("writing FENCE_CHECKPOINT_FILE")
            .map(|checkpoint| (token_file, checkpoint))
    });
    let (token_file, checkpoint) = match files {
        Ok(files) => files,
        Err(e) => {
            // Give the job back at once instead of leaving it held for the whole ttl.
            give_back(lease, &mut signals).await;
            return Err(e.context("the job was released"));
        }
    };
    let Some((program, rest)) = args.command.split_first() else {
        give_back(lease, &mut signals).await;
        anyhow::bail!("no command given");
    };
    let stop = Stop {
        grace: args.grace,
        lock_delay: args.lock_delay.unwrap_or_default(),
    };
    let mut group = match Group::start(stop, &reaper, &token_file.path()) {
        Ok(group) => group,
        Err(e) => {
            give_back(lease, &mut signals).await;
            return Err(e.context("cannot start the watchdog; the job was released"));
        }
    };
    group.keep_informed(lease.view()).await;
    let mut command = Command::new(program);
    command.env("FENCE_CHECKPOINT_FILE", checkpoint.path());
    match &resource {
        Some(resource) => command.env("FENCE_RESOURCE", resource.as_str()),
        None => command.env_remove("FENCE_RESOURCE"),
    };
    // Removed when this run does not set it: under an outer `fence run`, the outer job's
    // checkpoint generation would read as this job's. (An outer FENCE_PROGRESS_FILE is this
    // run's --progress-file, as every FENCE_<FLAG> is.)
    match resumed {
        Some(resumed) => command.env(
            "FENCE_CHECKPOINT_GENERATION",
            resumed.generation.to_string(),
        ),
        None => command.env_remove("FENCE_CHECKPOINT_GENERATION"),
    };
    let saving = checkpoint.start();
    if let Some((file, within)) = &args.progress {
        command.env("FENCE_PROGRESS_FILE", file);
        progress::watch(file.clone(), lease.view(), *within);
    }
    let spawned = reaper.spawn(
        command
            .args(rest)
            .process_group(group.pgid.as_raw())
            .env("FENCE_JOB", job.as_str())
            .env("FENCE_TOKEN", &token)
            .env("FENCE_TOKEN_FILE", token_file.path())
            .env("FENCE_SERVER", &args.conn.server)
            .env("FENCE_OWNER", client.owner_id().as_str())
            .env_remove("FENCE_AUTH_TOKEN")
            .env_remove("FENCE_LEASE_KEY")
            .stdin(Stdio::inherit())
            .kill_on_drop(true),
    );
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let stopped = group.stop().await;
            let what = if stopped.is_ok() {
                // Give the job back at once instead of leaving it held for the whole ttl.
                give_back(lease, &mut signals).await;
                "the job was released"
            } else {
                drop(lease); // never given back after an unkillable stop; no more renewals
                "the job is left to expire"
            };
            return Err(anyhow::Error::new(e).context(format!("cannot start {program:?}; {what}")));
        }
    };
    let keeper = token_file.keep_current(token_updates);
    let limit = args.max_duration.map(|(d, _)| (Instant::now() + d, d));
    let watched = Watched {
        lease: &lease,
        tokens: &keeper,
    };
    let ended = match supervise(&mut child, &group, watched, &mut signals, stop, limit).await {
        Ok(ended) => ended,
        Err(e) => {
            // Waiting for the command failed: stop what is left of it, and give the job back.
            group.signal(Signal::SIGKILL);
            if group.stop().await.is_err() {
                // Some of it may go on once its sleep ends: never given back then.
                drop(lease); // no more renewals
                return Err(e.context(
                    "the command's group was sent SIGKILL, but some of it had not ended; the \
                     job is left to expire",
                ));
            }
            if args.on_failure == OnFailure::Expire {
                // What the command did before the wait failed is unknown: a failure, as
                // `--on-failure expire` asks, leaves the job to expire.
                drop(lease); // no more renewals, nothing sent
                return Err(e.context(
                    "the command's group was stopped; the job is left to expire (--on-failure expire)",
                ));
            }
            give_back(lease, &mut signals).await;
            return Err(e.context("the command's group was stopped and the job released"));
        }
    };
    // Whether the lease was lost while the command ran, as it ended: what follows (its
    // group's grace, the last checkpoint's retries) can outlast the lease's progress window
    // with nothing left to make progress, and the store still takes a completion then as
    // long as nobody claimed the job.
    let lost_while_running = lease.is_lost();
    if lost_while_running {
        // The command exited as the lease was lost: what is left of its group is signalled
        // next, and must not find the lost lease's token either.
        keeper.empty();
    }
    // The command is gone (or stopped); so must be anything it left running in its group,
    // before its last checkpoint is saved and the lease is given up.
    let stopped = group.stop().await;
    if matches!(ended, Ended::Unkillable) || stopped.is_err() {
        // Something of the group may still be there, to go on once it leaves its sleep (the
        // SIGKILL is pending): no checkpoint is saved, and the job is never given back.
        drop(keeper);
        drop(saving);
        let exited = match ended {
            Ended::Exited(status) => Some(status),
            _ => None,
        };
        return finish::after_unkillable(
            lease,
            exited,
            lost_while_running,
            on_success,
            &mut signals,
        )
        .await;
    }
    // The last checkpoint: a signal ends its retries, and the job is then left to expire,
    // as a signal while the lease is given up would.
    let saved = finish::or_signal_saying(
        &mut signals,
        saving.finish(&lease),
        "while the last checkpoint was retried; it is not saved, and the job is left to expire on its own",
    )
    .await;
    drop(keeper);
    if let Err(sig) = saved {
        drop(lease); // no more renewals
        return Ok(128 + sig as i32);
    }
    let lost = match ended {
        Ended::Exited(status) => Some(status),
        Ended::Lost | Ended::Unkillable => None,
        Ended::OutOfTime => {
            return Ok(out_of_time(lease, args.max_duration, &mut signals).await);
        }
    };
    let status = match lost {
        // Exited after the local deadline: perhaps because the watchdog, acting on that
        // deadline, stopped it first. Its exit code says nothing about its work then, and
        // the lease is not ours to complete.
        Some(status) if lost_while_running => {
            say!(
                "fence run: the command {} after the lease was lost; fence run exits {EXIT_LOST}",
                ended_how(status)
            );
            return Ok(EXIT_LOST);
        }
        Some(status) => status,
        None => return Ok(EXIT_LOST),
    };
    finish(lease, status, (on_success, args.on_failure), &mut signals).await
}

/// How the command's run ended.
enum Ended {
    /// It exited on its own.
    Exited(std::process::ExitStatus),
    /// The lease was lost; it was stopped.
    Lost,
    /// `--max-duration` passed; it was stopped.
    OutOfTime,
    /// It was stopped (the lease lost, or `--max-duration` passed) and had not ended
    /// [`group::KILLED_WITHIN`] after its SIGKILL.
    Unkillable,
}

/// The lease a command runs under, and its `FENCE_TOKEN_FILE`.
struct Watched<'a> {
    lease: &'a Lease<HttpLeaseStore>,
    tokens: &'a token_file::KeptTokenFile,
}

/// Waits for the command, passing signals on to its group, until it exits on its own, the
/// lease is lost or `--max-duration` passes (and then stops the group). On the loss the
/// token file is emptied before the group is signalled: a SIGTERM handler that writes once
/// more must not find the lost lease's token.
async fn supervise(
    child: &mut Child,
    group: &Group,
    Watched { lease, tokens }: Watched<'_>,
    signals: &mut Signals,
    stop: Stop,
    limit: Option<(Instant, Duration)>,
) -> anyhow::Result<Ended> {
    let lost = lease.lost();
    tokio::pin!(lost);
    let out_of_time = async {
        match limit {
            Some((at, _)) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(out_of_time);
    let (ended, why) = loop {
        tokio::select! {
            status = group::wait(child, "command") => return Ok(Ended::Exited(status?)),
            sig = signals.next_to_pass() => group.signal(sig),
            () = &mut lost => {
                tokens.empty();
                let reason = lease.loss_reason().map_or_else(|| "unknown".to_owned(), |r| r.to_string());
                break (Ended::Lost, format!("lease lost ({reason})"));
            }
            () = &mut out_of_time => {
                let d = limit.map(|(_, d)| d).unwrap_or_default();
                break (Ended::OutOfTime, format!("--max-duration {} passed", humantime::format_duration(d)));
            }
        }
    };
    // Run out rather than taken over: the store may still hold the lease, and the command
    // must be gone before it can let anyone else claim the job.
    let expiring = matches!(
        lease.loss_reason(),
        Some(LossReason::DeadlinePassed | LossReason::NoProgress { .. })
    );
    let started = Instant::now();
    let grace = if expiring {
        stop.grace_of_expiring(&lease.view(), started)
    } else {
        stop.grace
    };
    if grace < stop.grace {
        say!(
            "fence run: {why}; sending SIGTERM to the command's group, SIGKILL within {grace:?} \
             (--grace {:?} cut short: the server may let another owner claim the job then)",
            stop.grace
        );
    } else {
        say!("fence run: {why}; sending SIGTERM to the command's group");
    }
    group.signal(Signal::SIGTERM);
    if tokio::time::timeout(grace, group::wait(child, "command"))
        .await
        .is_err()
    {
        say!("fence run: the command did not exit within {grace:?}; sending SIGKILL to its group");
        group.signal(Signal::SIGKILL);
        match reap_killed(child, "command").await {
            Ok(status) => drop(status?),
            Err(group::Unkillable) => return Ok(Ended::Unkillable),
        }
    } else {
        // The rest of the group (one that ignores SIGTERM) has what is left of the same
        // grace, not a new one from the watchdog once its pipe closes.
        let until = started + grace;
        while Instant::now() < until && procs::others_in_group(group.pgid) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if procs::others_in_group(group.pgid) {
            say!(
                "fence run: the command exited, but its group was still running after {grace:?}; \
                 sending SIGKILL to it"
            );
            group.signal(Signal::SIGKILL);
        }
    }
    // What left the group has what is left of the grace.
    group
        .stop_escapees(grace.saturating_sub(started.elapsed()))
        .await;
    Ok(ended)
}
