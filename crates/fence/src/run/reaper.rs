//! Reaps the orphans `fence run` adopts as the subreaper of the command's tree.
//!
//! As the subreaper, `fence run` becomes the parent of every process of the tree whose own
//! parent ended (a `( helper & )`, `nohup`, `setsid -f`). Each such process that ends stays a
//! zombie until its parent reaps it, and tokio reaps only the children it spawned: a long job
//! that keeps making orphans would fill the process table (a container's `pids.max`) until
//! it could not fork. The reaper waits for every ended child of `fence run` except those it
//! spawned itself (the watchdog and the command), whose ends tokio waits for.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use nix::{
    sys::wait::{WaitPidFlag, waitpid},
    unistd::Pid,
};
use tokio::{
    process::{Child, Command},
    signal::unix::{SignalKind, signal},
    task::JoinHandle,
};

use super::procs::ended_children;

/// The reaper's task, and the pids it leaves alone.
pub(super) struct Reaper {
    ours: Arc<Mutex<Vec<Pid>>>,
    task: Option<JoinHandle<()>>,
}

impl Reaper {
    /// Reaps at every SIGCHLD from now on; does nothing (but spawn) when SIGCHLD cannot be
    /// listened to.
    pub(super) fn start() -> Self {
        let ours = Arc::<Mutex<Vec<Pid>>>::default();
        let task = match signal(SignalKind::child()) {
            Ok(mut ended) => {
                let ours = ours.clone();
                Some(tokio::spawn(async move {
                    while ended.recv().await.is_some() {
                        reap(&lock(&ours));
                    }
                }))
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot listen for SIGCHLD: orphans are not reaped");
                None
            }
        };
        Self { ours, task }
    }

    /// Spawns `command`, its pid kept from the reaper: tokio waits for its end.
    pub(super) fn spawn(&self, command: &mut Command) -> std::io::Result<Child> {
        // Under the lock from before the spawn: a command that ends at once is not reaped
        // before its pid is known.
        let mut ours = lock(&self.ours);
        let child = command.spawn()?;
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            ours.push(Pid::from_raw(pid));
        }
        Ok(child)
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Reaps every ended child but `ours`.
fn reap(ours: &[Pid]) {
    for pid in ended_children() {
        if !ours.contains(&pid) {
            let _ = waitpid(pid, Some(WaitPidFlag::WNOHANG));
        }
    }
}

fn lock(ours: &Mutex<Vec<Pid>>) -> MutexGuard<'_, Vec<Pid>> {
    ours.lock().unwrap_or_else(PoisonError::into_inner)
}
