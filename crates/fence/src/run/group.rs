//! The command's process group, led by the watchdog, and how `fence run` stops it.

use std::{process::Stdio, time::Duration};

use anyhow::Context as _;
use fence_lease::LeaseView;
use nix::{
    sys::signal::{Signal, killpg},
    unistd::Pid,
};
use tokio::{
    process::{Child, ChildStdin, Command},
    time::Instant,
};

use super::{
    procs::{descendants, in_group},
    reaper,
    watchdog::{self, Stop},
};

/// The command's group: a watchdog process leads it and stops the group when `fence run`
/// goes away (its stdin, our pipe, closes) or stops telling it that the lease is alive.
pub(super) struct Group {
    watchdog: Child,
    pipe: Option<ChildStdin>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    /// Tells the heartbeat to end: with a last line `done` while the lease is held.
    done: Option<tokio::sync::oneshot::Sender<()>>,
    /// The lease the group runs under, once the heartbeat tells the watchdog of it.
    lease: Option<LeaseView>,
    pub(super) pgid: Pid,
    stop: Stop,
    /// The watchdog was reaped: the group is gone, and its id may be another's.
    reaped: bool,
}

/// How often `fence run` tells the watchdog the time left on the lease.
const HEARTBEAT: Duration = Duration::from_millis(100);

/// How long a process sent SIGKILL is waited for. One in uninterruptible sleep (a hard NFS
/// mount that hangs, a failing disk) ends only once it leaves it, maybe never: `fence run`
/// stops waiting then, rather than hang with its lease lost.
pub(super) const KILLED_WITHIN: Duration = Duration::from_secs(10);

/// A process that had not ended [`KILLED_WITHIN`] after its SIGKILL.
#[derive(Debug, Clone, Copy)]
pub(super) struct Unkillable;

/// `child.wait()`; with the test hook naming `who` (`command` or `watchdog`), a wait that
/// never ends, as for a process stuck in uninterruptible sleep.
pub(super) async fn wait(
    child: &mut Child,
    who: &str,
) -> std::io::Result<std::process::ExitStatus> {
    #[cfg(feature = "test-hooks")]
    if crate::test_hooks::stuck_after_kill(who) {
        return std::future::pending().await;
    }
    let _ = who;
    child.wait().await
}

/// Waits for `child` (`who`: `command` or `watchdog`), within [`KILLED_WITHIN`]; says so on
/// stderr when it has not ended by then.
pub(super) async fn reap_killed(
    child: &mut Child,
    who: &str,
) -> Result<std::io::Result<std::process::ExitStatus>, Unkillable> {
    let pid = child
        .id()
        .map_or_else(String::new, |pid| format!(" (pid {pid})"));
    tokio::time::timeout(KILLED_WITHIN, wait(child, who))
        .await
        .map_err(|_| {
            say!(
                "fence run: the {who}{pid} had not ended {KILLED_WITHIN:?} after its SIGKILL (a \
             process in uninterruptible sleep: a hung NFS mount, a failing disk?); fence run \
             no longer waits for it"
            );
            Unkillable
        })
}

impl Group {
    pub(super) fn start(
        stop: Stop,
        reaper: &reaper::Reaper,
        token_file: &std::path::Path,
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("finding the fence executable")?;
        let mut watchdog = Command::new(exe);
        let mut watchdog = reaper
            .spawn(
                watchdog
                    .args(["watchdog", "--grace"])
                    .arg(format!("{}ms", stop.grace.as_millis()))
                    .arg("--token-file")
                    .arg(token_file)
                    .process_group(0)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .env("RUST_LOG", "off")
                    // It talks to no server: the command's group (it leads it) must not be
                    // able to read the secrets from its /proc/<pid>/environ.
                    .env_remove("FENCE_AUTH_TOKEN")
                    .env_remove("FENCE_LEASE_KEY")
                    .kill_on_drop(true),
            )
            .context("starting the watchdog")?;
        let pid = watchdog
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .context("the watchdog has no pid")?;
        let pipe = watchdog.stdin.take();
        Ok(Self {
            watchdog,
            pipe,
            heartbeat: None,
            done: None,
            lease: None,
            pgid: Pid::from_raw(pid),
            stop,
            reaped: false,
        })
    }

    /// Tells the watchdog how long the lease has left (one line of milliseconds) now, and
    /// then every [`HEARTBEAT`]. Stops when the lease is lost, leaving the last deadline in
    /// force. At [`stop`](Self::stop) it says `done` if the lease is still held (renewed
    /// until the job is finished, so what is left of the group gets the whole grace); a pipe
    /// closed without it (the lease lost, or `fence run` killed) has the grace cut short.
    pub(super) async fn keep_informed(&mut self, lease: LeaseView) {
        use tokio::io::AsyncWriteExt;
        let Some(mut pipe) = self.pipe.take() else {
            return;
        };
        self.lease = Some(lease.clone());
        // The time left to the deadline, and to the last moment the group may live once
        // the deadline passed (before the store can end the lease).
        let stop = self.stop;
        let tell = move |lease: &LeaseView| {
            let now = Instant::now();
            let left = lease.deadline().saturating_duration_since(now);
            let kill = stop.last_moment(lease).saturating_duration_since(now);
            watchdog::told(left, kill)
        };
        // The first deadline is told before the command starts, so the watchdog has one
        // even if `fence run` freezes at once.
        if pipe.write_all(tell(&lease).as_bytes()).await.is_err() {
            return;
        }
        let (done, mut stopping) = tokio::sync::oneshot::channel::<()>();
        self.done = Some(done);
        self.heartbeat = Some(tokio::spawn(async move {
            let mut said_done = false;
            while !lease.is_lost() {
                // Every 100 ms, and four times before a deadline that is nearer: a short
                // lease's deadline is never stale at the watchdog.
                let left = lease.deadline().saturating_duration_since(Instant::now());
                let pause = (left / 4).clamp(Duration::from_millis(5), HEARTBEAT);
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = &mut stopping, if !said_done => {
                        // Lost meanwhile: the pipe closes without `done`.
                        if lease.is_lost() {
                            return;
                        }
                        // A clean end: the watchdog stops the group, with the whole grace
                        // while the deadlines told here keep coming.
                        said_done = true;
                        if pipe.write_all(b"done\n").await.is_err() {
                            return;
                        }
                    }
                }
                if pipe.write_all(tell(&lease).as_bytes()).await.is_err() {
                    return;
                }
            }
            // Lost: nothing more is told, and the pipe closes without `done`: before the end,
            // only at `stop` (closing it earlier would stop the group, which is `supervise`'s
            // decision once it sees the loss); after `done`, at once, and the watchdog cuts
            // the grace of the group it is stopping.
            if !said_done {
                let _ = stopping.await;
            }
        }));
    }

    pub(super) fn signal(&self, sig: Signal) {
        // The group may be gone already; nothing to do then.
        let _ = killpg(self.pgid, sig);
        // And whatever of the command's tree left the group (setsid, setpgid).
        for pid in self.escapees() {
            let _ = nix::sys::signal::kill(pid, sig);
        }
    }

    /// The descendants of `fence run` outside the command's group (the watchdog leads the
    /// group): processes of the command that left it.
    fn escapees(&self) -> Vec<Pid> {
        descendants(Pid::this())
            .into_iter()
            .filter(|(_, pgrp)| *pgrp != self.pgid)
            .map(|(pid, _)| pid)
            .collect()
    }

    /// Stops the command's processes that left its group: SIGTERM, then SIGKILL once
    /// `grace` has passed with any still there, or sooner once the lease is lost, by its last
    /// moment (see [`Stop::last_moment`]).
    pub(super) async fn stop_escapees(&self, grace: Duration) {
        let escapees = self.escapees();
        if escapees.is_empty() {
            return;
        }
        for pid in escapees {
            let _ = nix::sys::signal::kill(pid, Signal::SIGTERM);
        }
        let granted = Instant::now() + grace;
        let until = || match &self.lease {
            Some(lease) if lease.is_lost() => granted.min(self.stop.last_moment(lease)),
            _ => granted,
        };
        while Instant::now() < until() && !self.escapees().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Again while any is left, up to 10 passes (about a second): one that forked between
        // the listing and its SIGKILL left a child no pass had seen.
        for _ in 0..10 {
            let left = self.escapees();
            if left.is_empty() {
                break;
            }
            for pid in left {
                let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops whatever is left in the group (SIGTERM, SIGKILL after the grace) and waits for
    /// the watchdog to end, then for every other process of the command's tree (in the group
    /// or out of it) to be gone: [`Unkillable`] when any had not, [`KILLED_WITHIN`] after
    /// the SIGKILL (fence run's, or the watchdog's to its group, itself included).
    pub(super) async fn stop(mut self) -> Result<(), Unkillable> {
        self.stop_escapees(self.stop.grace).await;
        drop(self.pipe.take());
        // With a heartbeat (`done` is set with it): `done` if the lease is held, and deadlines
        // on while the watchdog stops the group. Without one, closing the pipe stops the group.
        let heartbeat = self.heartbeat.take();
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
        let limit = self.stop.grace + Duration::from_secs(2);
        let waited = wait(&mut self.watchdog, "watchdog");
        let ended = match tokio::time::timeout(limit, waited).await {
            Ok(_) => Ok(Instant::now() + KILLED_WITHIN),
            Err(_) => {
                self.signal(Signal::SIGKILL);
                let by = Instant::now() + KILLED_WITHIN;
                reap_killed(&mut self.watchdog, "watchdog")
                    .await
                    .map(|_| by)
            }
        };
        if let Some(heartbeat) = heartbeat {
            heartbeat.abort(); // its pipe closes
        }
        // Not reaped, its pid is still its own: the drop sends SIGKILL again.
        self.reaped = ended.is_ok();
        // The watchdog SIGKILLs its group, itself included, so it is reaped even when a
        // process of the group is stuck in uninterruptible sleep (a `cp` to a hung NFS mount
        // the command left behind): that one's write can still land once the sleep ends.
        self.wait_for_the_rest(ended?).await
    }

    /// Once the watchdog is reaped: waits until `by` for the rest of the command's tree (what
    /// is still in its group, and what left it) to be gone, sending it SIGKILL again every
    /// pass; [`Unkillable`], said on stderr, when any is left then. While one process is in
    /// the group its id is nobody else's.
    async fn wait_for_the_rest(&self, by: Instant) -> Result<(), Unkillable> {
        loop {
            let left = self.the_rest();
            #[cfg(feature = "test-hooks")]
            let left = left.with_test_hook();
            if left.is_empty() {
                return Ok(());
            }
            if Instant::now() >= by {
                say!(
                    "fence run: the command's tree had processes left ({}) {KILLED_WITHIN:?} \
                     after their SIGKILL (in uninterruptible sleep: a hung NFS mount, a failing \
                     disk?); fence run no longer waits for them",
                    left.describe()
                );
                return Err(Unkillable);
            }
            for pid in &left.pids {
                let _ = nix::sys::signal::kill(*pid, Signal::SIGKILL);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What is left of the command's tree: the processes of its group but the watchdog, and
    /// those that left it. Without `/proc`, whether the kernel still has a process in the group.
    fn the_rest(&self) -> Left {
        match in_group(self.pgid) {
            Some(mut pids) => {
                pids.extend(self.escapees());
                Left {
                    pids,
                    unnamed: Vec::new(),
                }
            }
            None => Left {
                pids: Vec::new(),
                unnamed: killpg(self.pgid, None)
                    .is_ok()
                    .then(|| format!("in group {}, /proc unreadable", self.pgid))
                    .into_iter()
                    .collect(),
            },
        }
    }
}

/// The processes left of a command's tree.
struct Left {
    /// Sent SIGKILL again at each pass.
    pids: Vec<Pid>,
    /// Known only to be there: not sent anything.
    unnamed: Vec<String>,
}

impl Left {
    fn is_empty(&self) -> bool {
        self.pids.is_empty() && self.unnamed.is_empty()
    }

    /// With the test hook naming `leftover`, one more process, made up.
    #[cfg(feature = "test-hooks")]
    fn with_test_hook(mut self) -> Self {
        if crate::test_hooks::stuck_after_kill("leftover") {
            self.unnamed.push("one the test hook makes up".to_owned());
        }
        self
    }

    fn describe(&self) -> String {
        let pids = self.pids.iter().map(|pid| format!("pid {pid}"));
        pids.chain(self.unnamed.iter().cloned())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Drop for Group {
    /// Any way out that skipped [`stop`](Group::stop) (a panic unwinding, an early return)
    /// still stops the whole group: the watchdog's `kill_on_drop` alone would end only it,
    /// and the command's children would run on with `FENCE_TOKEN` after the lease is gone.
    /// Until the watchdog is reaped its pid, the group's id, is nobody else's.
    fn drop(&mut self) {
        if !self.reaped {
            self.signal(Signal::SIGKILL);
        }
    }
}
