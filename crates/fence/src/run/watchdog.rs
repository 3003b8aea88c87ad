//! `fence watchdog`, which stops `fence run`'s command group when `fence run` dies or freezes.
//!
//! Also the arithmetic of how long a stopping command may take before its SIGKILL.

use std::time::Duration;

use anyhow::Context as _;
use fence_lease::LeaseView;
use nix::sys::signal::{Signal, killpg};
use tokio::{io::AsyncReadExt, time::Instant};

use super::{Signals, procs::others_in_group};

/// How the command is stopped: SIGTERM, then SIGKILL after `grace`, cut short where the
/// store could otherwise let another owner claim the job first.
#[derive(Clone, Copy)]
pub(super) struct Stop {
    pub(super) grace: Duration,
    /// `--lock-delay`: after an expiry, nobody can claim the job for this long.
    pub(super) lock_delay: Duration,
}

impl Stop {
    /// The last moment a command whose lease `lease` ran out (its deadline passed or its
    /// renewals stopped) may live: see [`last_moment_of`]. The lease may still be held at the
    /// store: the next owner cannot claim the job before then, so the command is gone before
    /// anyone else holds it.
    pub(super) fn last_moment(self, lease: &LeaseView) -> Instant {
        last_moment_of(
            lease.earliest_store_expiry() + self.lock_delay,
            lease.deadline(),
        )
    }

    /// The grace left at `now` to such a command: `--grace`, cut to end at its
    /// [`last_moment`](Self::last_moment).
    pub(super) fn grace_of_expiring(self, lease: &LeaseView, now: Instant) -> Duration {
        self.grace
            .min(self.last_moment(lease).saturating_duration_since(now))
    }
}

/// Just before `store_end` (the store's end of the lease, plus any lock-delay), by a quarter
/// of the safety margin (the time between the local `deadline` and `store_end`), at most
/// 100 ms, as slack for the kill to land.
fn last_moment_of(store_end: Instant, deadline: Instant) -> Instant {
    let slack = (store_end.saturating_duration_since(deadline) / 4).min(Duration::from_millis(100));
    store_end.checked_sub(slack).unwrap_or(store_end)
}

/// `fence watchdog`: leads the command's group. It stops the group (SIGTERM, then SIGKILL
/// after `grace` unless the group is empty by then) when its stdin, `fence run`'s pipe,
/// closes, or when the last time left on the lease that `fence run` wrote there runs out
/// (each line: the milliseconds left to the deadline, then to the last moment the group may
/// live). Either way that last moment bounds the grace, unless `fence run` said `done` before
/// closing the pipe (it ends cleanly, the lease held): a pipe closed without it may mean
/// `fence run` was SIGKILLed, and nobody renews the lease then. It ignores the signals sent to
/// the group, so it outlives the SIGTERM it sends.
///
/// # Errors
/// When its signal handlers cannot be installed.
pub async fn watchdog(grace: Duration) -> anyhow::Result<i32> {
    let mut signals = Signals::install().context("installing signal handlers")?;
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 256];
    let mut line = Vec::new();
    let mut deadline: Option<Instant> = None;
    // The last moment the group may live once the deadline passed, as last told.
    let mut kill_by: Option<Instant> = None;
    // `fence run` said `done`: it ends cleanly with the lease held and renewed meanwhile.
    let mut clean = false;
    loop {
        let expiry = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            read = stdin.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    for &b in &buf[..n] {
                        if b == b'\n' {
                            let now = Instant::now();
                            let mut told = std::str::from_utf8(&line).ok().into_iter()
                                .flat_map(str::split_whitespace)
                                .map(|word| word.parse::<u64>().ok().map(|ms| now + Duration::from_millis(ms)));
                            if line == b"done" {
                                clean = true;
                            } else if let Some(Some(at)) = told.next() {
                                deadline = Some(at);
                                kill_by = told.next().flatten();
                            }
                            line.clear();
                        } else if line.len() < 32 {
                            line.push(b);
                        }
                    }
                }
            },
            () = expiry => {
                clean = false;
                break;
            }
            _ = signals.next() => {}
        }
    }
    let pgid = nix::unistd::getpgrp();
    let _ = killpg(pgid, Signal::SIGTERM);
    let mut until = Instant::now() + grace;
    // fence run stopped telling (frozen), or closed the pipe without saying `done` (the lease
    // lost, or fence run killed): nobody may renew the lease from now on, and the group must
    // be gone before the store can let anyone else claim the job, whatever --grace says.
    // After `done` the lease is renewed until the job is finished: the whole grace.
    if !clean && let Some(kill_by) = kill_by {
        until = until.min(kill_by);
    }
    while Instant::now() < until {
        if !others_in_group(pgid) {
            return Ok(0);
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = signals.next() => {}
        }
    }
    // The watchdog is in the group too: this ends it as well.
    let _ = killpg(pgid, Signal::SIGKILL);
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `grace`, cut to end at [`last_moment_of`] (what `Stop::grace_of_expiring` computes).
    fn kill_within(
        grace: Duration,
        store_end: Instant,
        deadline: Instant,
        now: Instant,
    ) -> Duration {
        grace.min(last_moment_of(store_end, deadline).saturating_duration_since(now))
    }

    #[test]
    fn the_kill_lands_before_the_store_can_end_the_lease_whatever_the_grace() {
        let ms = Duration::from_millis;
        let deadline = Instant::now();
        // ttl 30 s: a 3 s margin, 100 ms of slack. At the deadline, --grace 5s is cut to 2.9 s.
        let store_end = deadline + ms(3_000);
        assert_eq!(
            kill_within(ms(5_000), store_end, deadline, deadline),
            ms(2_900)
        );
        // A shorter grace stands.
        assert_eq!(
            kill_within(ms(1_000), store_end, deadline, deadline),
            ms(1_000)
        );
        // Seen 2 s late (a slow loop): what is left of the margin, less the slack.
        assert_eq!(
            kill_within(ms(5_000), store_end, deadline, deadline + ms(2_000)),
            ms(900)
        );
        // ttl 1 s: a 100 ms margin, 25 ms of slack.
        let store_end = deadline + ms(100);
        assert_eq!(kill_within(ms(500), store_end, deadline, deadline), ms(75));
        // Past the store's end: at once.
        assert_eq!(
            kill_within(ms(500), store_end, deadline, deadline + ms(200)),
            ms(0)
        );
        // A lock-delay of 10 s (added to the store's end) leaves the grace alone.
        let store_end = deadline + ms(100) + ms(10_000);
        assert_eq!(
            kill_within(ms(5_000), store_end, deadline, deadline),
            ms(5_000)
        );
    }
}
