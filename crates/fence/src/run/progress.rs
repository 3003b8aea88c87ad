//! `fence run --progress-file F`: the lease is renewed only while F's modification time moves.

use std::{
    path::PathBuf,
    time::{Duration, SystemTime},
};

use fence_lease::LeaseView;
use tokio::task::JoinHandle;

/// Watches `path` every quarter of `within` (at most every second, at least every 10 ms) and
/// reports progress on `lease` each time the file's modification time changed since the last
/// look. The grant counts as the first report; a file that is missing, or whose time stands
/// still, reports nothing, so the keeper stops renewing once `within` has passed (the client
/// was built with `progress_within(within)`). Ends with the lease.
pub(super) fn watch(path: PathBuf, lease: LeaseView, within: Duration) -> JoinHandle<()> {
    let every = (within / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    tokio::spawn(async move {
        let modified = |path: &PathBuf| -> Option<SystemTime> {
            std::fs::metadata(path).and_then(|m| m.modified()).ok()
        };
        let mut seen = modified(&path);
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                () = lease.lost() => return,
                _ = tick.tick() => {}
            }
            let now = modified(&path);
            if now.is_some() && now != seen {
                lease.progress();
                seen = now;
            }
        }
    })
}
