//! That a sled store's jobs have been forgotten, and the window every token ended within then.
//!
//! A job forgotten (its record deleted) cannot be told from a new one: a stale token of it
//! is refused only because it has expired (contract section 8), so every later process on
//! the directory must check expiry at least as strictly as the one that forgot. Before its
//! first deletion a store records, in its `format` tree, that it forgets, with the smallest
//! clock skew and the shortest longest lease any process forgot under; a proxy reads it at
//! its start ([`SledStore::recorded_settings`]) and refuses to run without verify keys, or
//! takes the stricter bounds, as on PostgreSQL. A record that cannot be read is an error
//! there and at every deletion, never the defaults, and is never written over.

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use fence_storage::disk::Tree;

use super::SledStore;
use crate::store::{DEFAULT_CLOCK_SKEW, DEFAULT_MAX_LEASE_TTL, SinkSettings, StoreError};

/// The `format` key of the record: clock skew, then the longest lease, ms, 8 bytes
/// big-endian each (a later build may append more). Once written it stays (the
/// directory's jobs were forgotten for good).
const FORGETTING_KEY: &[u8] = b"forgetting";

/// Whether this process has recorded forgetting (read at the open), and the directory.
#[derive(Debug)]
pub(super) struct Forgetting {
    recorded: AtomicBool,
    path: PathBuf,
}

/// Why a record that cannot be read is an error rather than the defaults.
const DAMAGED: &str = "it records that a proxy with --forget-after ran on this data \
    directory, with the smallest clock skew and the shortest longest lease it checked \
    expiry by, which every later proxy on it must check at least as strictly (a stale token \
    of a forgotten job would otherwise pass as a new job's first); read as the defaults, \
    those could be weakened, so it is left as it is and nothing is forgotten or started on \
    the directory until it is restored (from a backup of the directory)";

/// The record in `format`, read (`None`: none was written).
fn read(format: &Tree, path: &Path) -> Result<Option<(Duration, Duration)>, StoreError> {
    let raw = format
        .get(FORGETTING_KEY)
        .map_err(|e| damaged(path, format!("sled could not read it ({e})")))?;
    parse(raw.as_deref(), path)
}

/// The record's value `raw`, decoded, or the error naming it.
fn parse(raw: Option<&[u8]>, path: &Path) -> Result<Option<(Duration, Duration)>, StoreError> {
    raw.map(|v| {
        super::pair::decode(v)
            .ok_or_else(|| damaged(path, format!("it is damaged ({} bytes)", v.len())))
    })
    .transpose()
}

fn damaged(path: &Path, what: String) -> StoreError {
    StoreError::io(format!(
        "the `forgetting` record in the data directory {}: {what}: {DAMAGED}",
        path.display()
    ))
}

impl Forgetting {
    pub(super) fn open(format: &Tree, path: &Path) -> Self {
        Self {
            recorded: AtomicBool::new(matches!(read(format, path), Ok(Some(_)))),
            path: path.to_owned(),
        }
    }
}

impl SledStore {
    /// What the processes that forgot jobs on this directory recorded (`None`: none ever
    /// did): jobs were forgotten, the smallest clock skew and the shortest longest lease
    /// they allowed. A process on the directory must refuse expired tokens at least as
    /// strictly: with verify keys, that skew at most and that lease at most (`fence proxy`
    /// checks it at its start).
    ///
    /// # Errors
    /// When sled cannot read it, or it is damaged (the error names the record).
    pub fn recorded_settings(&self) -> Result<Option<SinkSettings>, StoreError> {
        let recorded = read(&self.format, &self.forgetting.path)?;
        Ok(recorded.map(|(clock_skew, ttl)| SinkSettings {
            forgetting: true,
            clock_skew,
            max_lease_ttl: Some(ttl),
        }))
    }

    /// Records forgetting under `clock_skew` and `max_lease_ttl` (the smaller of these and
    /// what was recorded), on disk before it returns.
    pub(super) async fn record_forgetting(
        &self,
        clock_skew: Duration,
        max_lease_ttl: Duration,
    ) -> Result<(), StoreError> {
        loop {
            let raw = self.format.get(FORGETTING_KEY).map_err(StoreError::io)?;
            // Never over bytes that could not be read: they may hold a stricter window.
            let (skew, ttl) = match parse(raw.as_deref(), &self.forgetting.path)? {
                Some((skew, ttl)) => (skew.min(clock_skew), ttl.min(max_lease_ttl)),
                None => (clock_skew, max_lease_ttl),
            };
            let v = super::pair::encode(skew, ttl);
            if raw.as_deref().and_then(|r| r.get(..16)) == Some(&v[..]) {
                break;
            }
            // Compared and swapped: a concurrent record keeps the smaller of both.
            if self
                .format
                .compare_and_swap(FORGETTING_KEY, raw, Some(&v[..]))
                .map_err(StoreError::io)?
                .is_ok()
            {
                break;
            }
        }
        self.db.commit().await.map_err(StoreError::io)?;
        self.forgetting.recorded.store(true, Ordering::Release);
        Ok(())
    }

    /// Before a deletion: forgetting is on disk (with the defaults, for a caller that
    /// deletes without [`forgetting_within`](crate::GenerationStore::forgetting_within)).
    pub(super) async fn forgetting_recorded(&self) -> Result<(), StoreError> {
        if self.forgetting.recorded.load(Ordering::Acquire) {
            return Ok(());
        }
        self.record_forgetting(DEFAULT_CLOCK_SKEW, DEFAULT_MAX_LEASE_TTL)
            .await
    }
}
