//! That a sled store's jobs have been forgotten, and the window every token ended within then.
//!
//! A job forgotten (its record deleted) cannot be told from a new one: a stale token of it
//! is refused only because it has expired (contract section 8), so every later process on
//! the directory must check expiry at least as strictly as the one that forgot. Before its
//! first deletion a store records, in its `format` tree, that it forgets, with the smallest
//! clock skew and the shortest longest lease any process forgot under; a proxy reads it at
//! its start ([`SledStore::recorded_settings`]) and refuses to run without verify keys, or
//! takes the stricter bounds, as on PostgreSQL.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use fence_storage::disk::Tree;

use super::SledStore;
use crate::store::{DEFAULT_CLOCK_SKEW, DEFAULT_MAX_LEASE_TTL, SinkSettings, StoreError, ms};

/// The `format` key of the record: clock skew, then the longest lease, ms, 8 bytes
/// big-endian each. Once written it stays (the directory's jobs were forgotten for good).
const FORGETTING_KEY: &[u8] = b"forgetting";

/// Whether this process has recorded forgetting (read at the open).
#[derive(Debug)]
pub(super) struct Forgetting(AtomicBool);

fn decode(v: &[u8]) -> Option<(Duration, Duration)> {
    let (skew, ttl) = v.split_first_chunk::<8>()?;
    let ttl = <[u8; 8]>::try_from(ttl).ok()?;
    let millis = |b: [u8; 8]| Duration::from_millis(u64::from_be_bytes(b));
    Some((millis(*skew), millis(ttl)))
}

/// What a record says. One that cannot be read still says that jobs were forgotten, with
/// the default skew and no longest lease: verify keys are needed anyway.
fn settings(v: &[u8]) -> SinkSettings {
    let decoded = decode(v);
    SinkSettings {
        forgetting: true,
        clock_skew: decoded.map_or(DEFAULT_CLOCK_SKEW, |(skew, _)| skew),
        max_lease_ttl: decoded.map(|(_, ttl)| ttl),
    }
}

fn read(format: &Tree) -> Result<Option<SinkSettings>, StoreError> {
    let raw = format.get(FORGETTING_KEY).map_err(StoreError::io)?;
    Ok(raw.as_deref().map(settings))
}

impl Forgetting {
    pub(super) fn open(format: &Tree) -> Self {
        Self(AtomicBool::new(matches!(read(format), Ok(Some(_)))))
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
    /// When sled cannot read it.
    pub fn recorded_settings(&self) -> Result<Option<SinkSettings>, StoreError> {
        read(&self.format)
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
            let (skew, ttl) = match raw.as_deref().map(settings) {
                Some(recorded) => (
                    recorded.clock_skew.min(clock_skew),
                    recorded
                        .max_lease_ttl
                        .map_or(max_lease_ttl, |t| t.min(max_lease_ttl)),
                ),
                None => (clock_skew, max_lease_ttl),
            };
            let mut v = [0u8; 16];
            v[..8].copy_from_slice(&ms(skew).to_be_bytes());
            v[8..].copy_from_slice(&ms(ttl).to_be_bytes());
            if raw.as_deref() == Some(&v[..]) {
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
        self.forgetting.0.store(true, Ordering::Release);
        Ok(())
    }

    /// Before a deletion: forgetting is on disk (with the defaults, for a caller that
    /// deletes without [`forgetting_within`](crate::GenerationStore::forgetting_within)).
    pub(super) async fn forgetting_recorded(&self) -> Result<(), StoreError> {
        if self.forgetting.0.load(Ordering::Acquire) {
            return Ok(());
        }
        self.record_forgetting(DEFAULT_CLOCK_SKEW, DEFAULT_MAX_LEASE_TTL)
            .await
    }
}
