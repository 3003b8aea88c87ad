//! How `fence run` gives up the lease it held, and what a signal meanwhile does.
//!
//! Completed or released after the command (or left to expire after its failure, with
//! `--on-failure expire`), released or left to expire at `--max-duration`, given back after
//! a failure of its own.
//!
//! A release or completion is retried while the server fails to answer (up to a minute, see
//! [`Lease::complete`]); SIGINT, SIGTERM or SIGHUP meanwhile ends the wait (after its first
//! two seconds), and the lease is left to expire on its own.

use std::time::Duration;

use fence_lease::{FinishError, HttpLeaseStore, Lease};
use nix::sys::signal::Signal;

use super::{EXIT_LOST, EXIT_MAX_DURATION, signals::Signals, words::ended_how};
use crate::cli::{OnFailure, OnMaxDuration, OnSuccess};

/// How long giving up the lease goes on before a signal ends it: a signal already pending
/// (sent to the command and to `fence run` together, or during the grace) must not skip the
/// first attempts, which usually succeed at once.
const SIGNALS_AFTER: Duration = Duration::from_secs(2);

/// `finishing`, or, from [`SIGNALS_AFTER`] on, the signal that came first (and `fence run`
/// says so).
async fn or_signal<T>(
    signals: &mut Signals,
    finishing: impl Future<Output = T>,
) -> Result<T, Signal> {
    or_signal_saying(
        signals,
        finishing,
        "while giving up the lease; it is left to expire on its own",
    )
    .await
}

/// [`or_signal`], with `what` said after the signal's name.
pub(super) async fn or_signal_saying<T>(
    signals: &mut Signals,
    finishing: impl Future<Output = T>,
    what: &str,
) -> Result<T, Signal> {
    let signalled = async {
        tokio::time::sleep(SIGNALS_AFTER).await;
        signals.next().await
    };
    tokio::select! {
        finished = finishing => Ok(finished),
        sig = signalled => {
            say!("fence run: {sig} {what}");
            Err(sig)
        }
    }
}

/// Releases the job after a failure of `fence run`'s own, rather than leaving it held for its
/// whole TTL; a failure of the release, or a signal meanwhile, leaves it to expire.
pub(super) async fn give_back(lease: Lease<HttpLeaseStore>, signals: &mut Signals) {
    let _ = or_signal(signals, lease.release()).await;
}

/// The command was stopped at `--max-duration`: the job is released, or left to expire.
pub(super) async fn out_of_time(
    lease: Lease<HttpLeaseStore>,
    max: Option<(Duration, OnMaxDuration)>,
    signals: &mut Signals,
) -> i32 {
    match max.map(|(_, on)| on) {
        Some(OnMaxDuration::Expire) => {
            drop(lease); // no more renewals
            say!("fence run: the job is left to expire, at most one TTL after its last renewal");
        }
        _ => match or_signal(signals, lease.release()).await {
            Ok(Ok(record)) => say!("fence run: the job is {}", record.state),
            Ok(Err(FinishError::LostLocally(reason))) => say!(
                "fence run: the lease was lost ({reason}); the job is left to expire, not released"
            ),
            Ok(Err(e)) => say!(
                "fence run: releasing the job failed ({}); it expires on its own",
                fence_storage::error_chain(&e)
            ),
            Err(sig) => return 128 + sig as i32,
        },
    }
    EXIT_MAX_DURATION
}

/// Something of the command's tree outlived its SIGKILL (in uninterruptible sleep) and may
/// go on once its sleep ends: the job is never given back, or its next holder would start
/// beside it. A command that exited 0 with `--on-success complete` still has its job
/// completed, the lease held (nobody can claim a completed job; left to expire, another
/// worker would run it again). Otherwise the job is left to expire: exit 75 if the lease was
/// lost, 1 if not.
pub(super) async fn after_unkillable(
    lease: Lease<HttpLeaseStore>,
    exited: Option<std::process::ExitStatus>,
    lost_while_running: bool,
    on_success: OnSuccess,
    signals: &mut Signals,
) -> anyhow::Result<i32> {
    let succeeded = exited.filter(std::process::ExitStatus::success);
    match succeeded {
        Some(status) if !lost_while_running && on_success == OnSuccess::Complete => {
            say!("fence run: the command exited 0: its job is completed all the same");
            // Exit code 0 and `Complete`: `finish` completes, it never releases.
            finish(
                lease,
                status,
                (OnSuccess::Complete, OnFailure::Release),
                signals,
            )
            .await
        }
        _ if lost_while_running || lease.is_lost() => {
            drop(lease); // no more renewals
            say!("fence run: the lease was lost; fence run exits {EXIT_LOST}");
            Ok(EXIT_LOST)
        }
        _ => {
            drop(lease); // no more renewals
            say!("fence run: the job is left to expire; fence run exits 1");
            Ok(1)
        }
    }
}

/// Completes or releases the job after the command exited with `status`, or, after a
/// failure with `--on-failure expire`, leaves it to expire.
pub(super) async fn finish(
    lease: Lease<HttpLeaseStore>,
    status: std::process::ExitStatus,
    (on_success, on_failure): (OnSuccess, OnFailure),
    signals: &mut Signals,
) -> anyhow::Result<i32> {
    let code = exit_code(status);
    if code != 0 && on_failure == OnFailure::Expire {
        drop(lease); // no more renewals, nothing sent
        say!(
            "fence run: the command {}; the job is left to expire (--on-failure expire): nobody can claim it until its lease ends and its lock-delay has passed",
            ended_how(status)
        );
        return Ok(code);
    }
    let finishing = async {
        if code == 0 && on_success == OnSuccess::Complete {
            lease.complete().await
        } else {
            lease.release().await
        }
    };
    let finished = match or_signal(signals, finishing).await {
        Ok(finished) => finished,
        Err(sig) => return Ok(128 + sig as i32),
    };
    match finished {
        Ok(record) => {
            say!(
                "fence run: the command {}; the job is {}",
                ended_how(status),
                record.state
            );
            Ok(code)
        }
        Err(FinishError::Lost { owner, generation }) => {
            let holder = owner.map_or_else(|| "nobody".to_owned(), |o| o.to_string());
            say!(
                "fence run: the command {}, but the lease was lost (now generation {generation}, held by {holder}); fence run exits {EXIT_LOST}",
                ended_how(status)
            );
            Ok(EXIT_LOST)
        }
        // Lost here since the command ended (what was left of its group, or its last
        // checkpoint's retries, outlasted the lease): not released (a release then would skip
        // the lock-delay), left to expire. The command ran its whole course under the lease,
        // so its own code is the answer, as after a release: 75 would ask for a rerun of work
        // that succeeded.
        Err(FinishError::LostLocally(reason)) => {
            say!(
                "fence run: the command {}, and the lease was lost since ({reason}); the job is left to expire, not released",
                ended_how(status)
            );
            Ok(code)
        }
        Err(e) => Err(anyhow::Error::new(e).context("finishing the lease failed")),
    }
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}
