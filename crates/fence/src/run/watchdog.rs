//! `fence watchdog`, which stops `fence run`'s command group when `fence run` dies or freezes.
//!
//! Also the arithmetic of how long a stopping command may take before its SIGKILL.

use std::time::Duration;

use anyhow::Context as _;
use fence_lease::LeaseView;
use nix::sys::signal::{Signal, killpg};
use tokio::{io::AsyncReadExt, time::Instant};

use super::{procs::others_in_group, signals::Signals};

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

/// The line that tells the watchdog the time `left` to the lease's local deadline and to the
/// last moment `kill` the group may live, in milliseconds. The deadline is rounded up: a
/// command the watchdog stops at it must find the lease lost when `fence run` looks, or its
/// exit would be taken for the command's own and the lease finished (a CI run saw a release
/// tried against a stopped server, exit 1 for 75). The last moment is rounded down, to stay
/// before the store can end the lease.
pub(super) fn told(left: Duration, kill: Duration) -> String {
    format!(
        "{} {}\n",
        left.as_nanos().div_ceil(1_000_000),
        kill.as_millis()
    )
}

/// Just before `store_end` (the store's end of the lease, plus any lock-delay), by slack for
/// the kill to land and for this host's clock running slower than the store's: a quarter of
/// the time from the local `deadline` to `store_end` (the safety margin, plus any
/// lock-delay), at most 100 ms or a fiftieth of that time when that is more. The margin is a
/// tenth of the TTL, so a fiftieth of it is 2,000 ppm of the time the store counts: a 1 h
/// lease is killed 7.2 s before the store can end it, not 100 ms (which a clock 50 ppm slow
/// would eat); a lock-delay the store counts too widens it.
fn last_moment_of(store_end: Instant, deadline: Instant) -> Instant {
    let gap = store_end.saturating_duration_since(deadline);
    let slack = (gap / 4).min((gap / 50).max(Duration::from_millis(100)));
    store_end.checked_sub(slack).unwrap_or(store_end)
}

/// `fence watchdog`: leads the command's group. It stops the group (SIGTERM, then SIGKILL
/// after `grace` unless the group is empty by then) when its stdin, `fence run`'s pipe,
/// closes, or when the last time left on the lease that `fence run` wrote there runs out
/// (each line: the milliseconds left to the deadline, then to the last moment the group may
/// live), or when `fence run` says `done` (a clean end). That last moment bounds the grace
/// unless, after `done`, `fence run` keeps telling deadlines that have not passed (the lease
/// is renewed until the job is finished): a pipe closed, or deadlines no longer told, may mean
/// `fence run` was killed or its lease lost, and nobody renews the lease then. It ignores the
/// signals sent to the group, so it outlives the SIGTERM it sends.
///
/// # Errors
/// When its signal handlers cannot be installed.
pub async fn watchdog(
    grace: Duration,
    token_file: Option<std::path::PathBuf>,
) -> anyhow::Result<i32> {
    let mut signals = Signals::install().context("installing signal handlers")?;
    // A stop sent to the command's group (`kill -TSTP -PGID`, a terminal's Ctrl-Z, a
    // background read or write) must not stop the watchdog with it, or nothing would be left
    // to stop the group at the deadline: these are handled, and so never stop it (SIGSTOP
    // cannot be; handled rather than ignored, as `unsafe` is not used here).
    let _stops = [Signal::SIGTSTP, Signal::SIGTTIN, Signal::SIGTTOU].map(|sig| {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::from_raw(sig as i32))
    });
    let mut pipe = Pipe::default();
    // Until the pipe closes, the deadline passes, or fence run says `done`.
    loop {
        let expiry = until_or_never(pipe.told.deadline);
        tokio::select! {
            () = pipe.read() => if !pipe.open || pipe.told.done { break },
            () = expiry => break,
            _ = signals.next() => {}
        }
    }
    // At the deadline, or with fence run gone, the command's token file is emptied first: a
    // SIGTERM handler that writes once more, reading the file as the docs say, must not find
    // a token whose lease may be lost (`fence run`, which also empties it, races this
    // process at the deadline, and a frozen or killed `fence run` empties nothing). Not after
    // `done`: fence run is alive then, renewing until the job is finished, and keeps the
    // file (emptied by it on a loss); emptied here, it would read as lost while the lease
    // holds.
    if !pipe.told.done
        && let Some(path) = &token_file
    {
        let _ = super::token_file::write_bytes(path, b"");
    }
    let pgid = nix::unistd::getpgrp();
    let _ = killpg(pgid, Signal::SIGTERM);
    let until = Instant::now() + grace;
    loop {
        // After `done`, while fence run keeps telling deadlines that have not passed, the
        // lease is renewed until the job is finished: the whole grace. Otherwise (fence run
        // frozen, killed, or its lease lost) nobody renews it, and the group must be gone
        // before the store can let anyone else claim the job, whatever --grace says.
        let told = &pipe.told;
        let renewed = told.done && pipe.open && told.deadline.is_some_and(|at| Instant::now() < at);
        let end = match told.kill_by {
            Some(kill_by) if !renewed => until.min(kill_by),
            _ => until,
        };
        if Instant::now() >= end {
            break;
        }
        if !others_in_group(pgid) {
            return Ok(0);
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
            () = pipe.read(), if pipe.open => {}
            _ = signals.next() => {}
        }
    }
    // The watchdog is in the group too: this ends it as well.
    let _ = killpg(pgid, Signal::SIGKILL);
    Ok(0)
}

async fn until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What `fence run` last told the watchdog.
#[derive(Default)]
struct Told {
    /// The lease's local deadline.
    deadline: Option<Instant>,
    /// The last moment the group may live once the deadline passed.
    kill_by: Option<Instant>,
    /// `fence run` is ending cleanly, the lease held (and renewed while it keeps telling).
    done: bool,
}

/// `fence run`'s pipe (the watchdog's stdin): one line per heartbeat, `left_ms kill_ms`, or
/// `done`.
struct Pipe {
    stdin: tokio::io::Stdin,
    buf: [u8; 256],
    line: Vec<u8>,
    open: bool,
    told: Told,
}

impl Default for Pipe {
    fn default() -> Self {
        Self {
            stdin: tokio::io::stdin(),
            buf: [0; 256],
            line: Vec::new(),
            open: true,
            told: Told::default(),
        }
    }
}

impl Pipe {
    /// Reads what is there (waiting for it), taking each whole line; closed at its end.
    async fn read(&mut self) {
        let n = match self.stdin.read(&mut self.buf).await {
            Ok(0) | Err(_) => {
                self.open = false;
                return;
            }
            Ok(n) => n,
        };
        for i in 0..n {
            let b = self.buf[i];
            if b != b'\n' {
                if self.line.len() < 32 {
                    self.line.push(b);
                }
                continue;
            }
            let now = Instant::now();
            if self.line == b"done" {
                self.told.done = true;
            } else {
                let mut told = std::str::from_utf8(&self.line)
                    .ok()
                    .into_iter()
                    .flat_map(str::split_whitespace)
                    .map(|word| {
                        word.parse::<u64>()
                            .ok()
                            .map(|ms| now + Duration::from_millis(ms))
                    });
                if let Some(Some(at)) = told.next() {
                    self.told.deadline = Some(at);
                    self.told.kill_by = told.next().flatten();
                }
            }
            self.line.clear();
        }
    }
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
    fn the_deadline_is_told_no_earlier_and_the_last_moment_no_later_than_they_are() {
        let us = Duration::from_micros;
        assert_eq!(told(us(1_500), us(2_500)), "2 2\n");
        assert_eq!(told(us(1_000), us(2_999)), "1 2\n");
        assert_eq!(told(us(1), us(999)), "1 0\n");
        assert_eq!(told(Duration::ZERO, Duration::ZERO), "0 0\n");
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
        // ttl 1 h: a 360 s margin, 7.2 s of slack (2,000 ppm of the hour), not 100 ms, which
        // a clock 50 ppm slower than the store's would use up.
        let store_end = deadline + ms(360_000);
        assert_eq!(
            kill_within(ms(600_000), store_end, deadline, deadline),
            ms(352_800)
        );
        // A lock-delay of 10 s (added to the store's end) leaves the grace alone.
        let store_end = deadline + ms(100) + ms(10_000);
        assert_eq!(
            kill_within(ms(5_000), store_end, deadline, deadline),
            ms(5_000)
        );
    }
}
