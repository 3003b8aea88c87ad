//! The bounds the processes on a sled store ran with, kept in its `format` tree for the next.
//!
//! A restarted process waits for what the one before may have left running by the bounds
//! that one admitted under ([`RunBounds`]), not by its own: restarted with a shorter upstream
//! timeout or hold, it would otherwise let a newer token pass while an older request of the
//! dead process can still commit upstream. So every process records, durably and before its
//! first admission, the longer of its own bounds and those recorded before it; once what the
//! processes before admitted has settled (their hold after this process's open: each had
//! ended by then), it records its own alone, so a setting made shorter counts from the
//! restart after next.

use std::{
    path::Path,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use fence_storage::disk::{DurableDb, OpenError, Tree};

use crate::store::{RunBounds, StoreError, ms};

/// The `format` key of the bounds: running for, then the hold, ms, 8 bytes big-endian each.
const RUNNING_KEY: &[u8] = b"running";

/// What this process recorded, and what the ones before had.
#[derive(Debug)]
pub(super) struct Running {
    /// What the processes before recorded, read at the open.
    before: RunBounds,
    /// When (the clock's monotonic ms) everything they admitted has settled.
    before_settled_ms: u64,
    /// The record holds this process's bounds alone (or will at its next write).
    lowered: AtomicBool,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The longest bounds this process's layers told.
    told: RunBounds,
    /// What the record holds now.
    recorded: RunBounds,
}

/// The record's bytes (see [`pair`](super::pair)).
fn encode(bounds: RunBounds) -> [u8; 16] {
    super::pair::encode(bounds.running_for, bounds.hold)
}

/// The record read back; `None` when it is damage.
fn decode(v: &[u8]) -> Option<RunBounds> {
    let (running_for, hold) = super::pair::decode(v)?;
    Some(RunBounds::new(running_for, hold))
}

/// Why a record that cannot be read refuses the open, and how to clear it.
const DAMAGED: &str = "it holds how long requests of the processes before this one on the \
    directory may still run at the upstream (their longest request and unknown-outcome hold), \
    and a restart waits by it before a newer token passes; taken as absent, an older \
    request's effect could commit after a newer one's. To clear it: wait until the longest \
    request plus the hold of the process before has passed since it stopped, then start \
    `fence proxy` once with --clear-running-record (or call \
    `SledStore::clear_running_record`)";

impl Running {
    /// Reads what the processes before recorded, at the open (`opened_ms`, the clock's
    /// monotonic reading). None recorded (a directory of a build before this record was
    /// kept) counts as none. A record that cannot be read or decoded refuses the open
    /// (naming `path`), and is left as it is: taken as none, a restart with shorter
    /// timeouts would let newer tokens pass while older requests can still commit.
    pub(super) fn open(format: &Tree, opened_ms: u64, path: &Path) -> Result<Self, OpenError> {
        let damaged = |what: String| OpenError::Record {
            path: path.to_owned(),
            record: "running",
            reason: format!("{what}: {DAMAGED}"),
        };
        let raw = format
            .get(RUNNING_KEY)
            .map_err(|e| damaged(format!("sled could not read it ({e})")))?;
        let before = match raw.as_deref().map(decode) {
            None => RunBounds::default(),
            Some(Some(bounds)) => bounds,
            Some(None) => {
                return Err(damaged(format!(
                    "it is damaged ({} bytes, or a bound above 100 years)",
                    raw.as_deref().map_or(0, <[u8]>::len)
                )));
            }
        };
        Ok(Self {
            before,
            before_settled_ms: opened_ms.saturating_add(ms(before.hold)),
            lowered: AtomicBool::new(before == RunBounds::default()),
            state: Mutex::new(State {
                told: RunBounds::default(),
                recorded: before,
            }),
        })
    }

    /// What the processes before recorded.
    pub(super) fn before(&self) -> RunBounds {
        self.before
    }

    /// Whether what the processes before admitted may still be running at `now_ms`
    /// (monotonic): their unknown-outcome hold has not passed since the open.
    pub(super) fn before_may_run(&self, now_ms: u64) -> bool {
        now_ms < self.before_settled_ms
    }

    /// Whether the record still holds the bounds of the processes before while what they
    /// admitted has settled by `now_ms` (monotonic): it can be lowered to this process's.
    pub(super) fn lower_due(&self, now_ms: u64) -> bool {
        !self.lowered.load(Ordering::Relaxed) && now_ms >= self.before_settled_ms
    }

    /// Takes `bounds` from a layer at `now_ms` (monotonic) and writes what the record must
    /// hold now to `format`: the longest told, and those of the processes before while what
    /// they admitted may still run. Whether it wrote (the caller then commits).
    pub(super) fn record(
        &self,
        format: &Tree,
        bounds: RunBounds,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.told = s.told.max(bounds);
        let settled = now_ms >= self.before_settled_ms;
        let target = if settled {
            s.told
        } else {
            s.told.max(self.before)
        };
        let wrote = target != s.recorded;
        if wrote {
            format
                .insert(RUNNING_KEY, &encode(target)[..])
                .map_err(StoreError::io)?;
            s.recorded = target;
        }
        if settled {
            self.lowered.store(true, Ordering::Relaxed);
        }
        Ok(wrote)
    }
}

/// Removes the `running` record of the data directory `path` (which no process may have
/// open) when it cannot be read or decoded, for a directory that refuses to open because
/// of it; a record that reads is kept (a flag left on clears nothing good). Only safe once
/// the longest request plus the unknown-outcome hold of the process before has passed since
/// it stopped: the next process then waits by its own bounds alone. Whether it removed it.
///
/// # Errors
/// As [`DurableDb::open`], or when the removal cannot be made durable.
pub(super) fn clear_running_record(path: impl AsRef<Path>) -> Result<bool, OpenError> {
    let path = path.as_ref();
    let db = DurableDb::open(path)?;
    let format = db.tree("format")?;
    if let Ok(raw) = format.get(RUNNING_KEY)
        && raw.as_deref().is_none_or(|v| decode(v).is_some())
    {
        return Ok(false);
    }
    let failed = |e: String| OpenError::Record {
        path: path.to_owned(),
        record: "running",
        reason: format!("removing it failed: {e}"),
    };
    format
        .remove(RUNNING_KEY)
        .map_err(|e| failed(e.to_string()))?;
    db.flush_now().map_err(|e| failed(e.to_string()))?;
    Ok(true)
}
