//! The processes of a command's tree, read from Linux's `/proc`.

use nix::unistd::Pid;

/// A process: its pid, its parent's and its process group, and whether it has ended (a
/// zombie, waiting for its parent to reap it).
struct Process {
    pid: i32,
    ppid: i32,
    pgrp: i32,
    ended: bool,
}

/// Every live process (not a zombie) as `/proc` shows it now; `None` when `/proc` cannot be
/// read.
fn processes() -> Option<Vec<Process>> {
    let mut all = every_process()?;
    all.retain(|p| !p.ended);
    Some(all)
}

/// The children of this process that have ended and wait to be reaped.
pub(super) fn ended_children() -> Vec<Pid> {
    let me = Pid::this().as_raw();
    every_process()
        .unwrap_or_default()
        .iter()
        .filter(|p| p.ended && p.ppid == me)
        .map(|p| Pid::from_raw(p.pid))
        .collect()
}

/// Every process as `/proc` shows it now, zombies too; `None` when `/proc` cannot be read.
fn every_process() -> Option<Vec<Process>> {
    let entries = std::fs::read_dir("/proc").ok()?;
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // After the command name in parentheses: state, ppid, pgrp.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("Z");
        let ppid = fields.next().and_then(|f| f.parse::<i32>().ok());
        let pgrp = fields.next().and_then(|f| f.parse::<i32>().ok());
        if let (Some(ppid), Some(pgrp)) = (ppid, pgrp) {
            let ended = state == "Z" || state == "X";
            out.push(Process {
                pid,
                ppid,
                pgrp,
                ended,
            });
        }
    }
    Some(out)
}

/// Every live descendant of `root` with its process group: children, their children, and
/// so on.
pub(super) fn descendants(root: Pid) -> Vec<(Pid, Pid)> {
    let all = processes().unwrap_or_default();
    let mut found: Vec<(Pid, Pid)> = Vec::new();
    let mut frontier = vec![root.as_raw()];
    while let Some(parent) = frontier.pop() {
        for p in all.iter().filter(|p| p.ppid == parent) {
            if !found.iter().any(|(pid, _)| pid.as_raw() == p.pid) {
                found.push((Pid::from_raw(p.pid), Pid::from_raw(p.pgrp)));
                frontier.push(p.pid);
            }
        }
    }
    found
}

/// Whether a live process other than its leader (the watchdog, which leads the command's
/// group) is in process group `pgid`.
pub(super) fn others_in_group(pgid: Pid) -> bool {
    // Cannot tell: assume so, and let the grace run out.
    in_group(pgid).is_none_or(|others| !others.is_empty())
}

/// The live processes of process group `pgid` other than its leader (the watchdog);
/// `None` when `/proc` cannot be read.
pub(super) fn in_group(pgid: Pid) -> Option<Vec<Pid>> {
    let all = processes()?;
    Some(
        all.iter()
            .filter(|p| p.pid != pgid.as_raw() && p.pgrp == pgid.as_raw())
            .map(|p| Pid::from_raw(p.pid))
            .collect(),
    )
}
