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

use std::sync::{
    Mutex,
    atomic::{AtomicBool, Ordering},
};

use fence_storage::disk::Tree;

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

fn encode(bounds: RunBounds) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&ms(bounds.running_for).to_be_bytes());
    v[8..].copy_from_slice(&ms(bounds.hold).to_be_bytes());
    v
}

fn decode(v: &[u8]) -> Option<RunBounds> {
    let (running_for, hold) = v.split_first_chunk::<8>()?;
    let hold = <[u8; 8]>::try_from(hold).ok()?;
    let millis = |b: [u8; 8]| std::time::Duration::from_millis(u64::from_be_bytes(b));
    Some(RunBounds::new(millis(*running_for), millis(hold)))
}

impl Running {
    /// Reads what the processes before recorded, at the open (`opened_ms`, the clock's
    /// monotonic reading). A record that cannot be read counts as none, with a warning, as
    /// in a directory of a build before this record was kept: taken as the longest there is,
    /// it would keep every job busy at the crash from its newer tokens for good.
    pub(super) fn open(format: &Tree, opened_ms: u64) -> Self {
        let raw = format.get(RUNNING_KEY).ok().flatten();
        let before = match raw.as_deref().map(decode) {
            None => RunBounds::default(),
            Some(Some(bounds)) => bounds,
            Some(None) => {
                tracing::warn!(
                    "the record of how long the process before let requests run is damaged: after this restart, newer tokens wait by this process's timeouts alone"
                );
                RunBounds::default()
            }
        };
        Self {
            before,
            before_settled_ms: opened_ms.saturating_add(ms(before.hold)),
            lowered: AtomicBool::new(before == RunBounds::default()),
            state: Mutex::new(State {
                told: RunBounds::default(),
                recorded: before,
            }),
        }
    }

    /// What the processes before recorded.
    pub(super) fn before(&self) -> RunBounds {
        self.before
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
