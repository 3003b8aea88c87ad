//! A count of the bytes the idempotency records hold, kept by the stores that count them.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of idempotency records (each its key plus its encoded value), adjusted at every
/// write and removal: what [`IdempotencyStore::stored_bytes`](super::IdempotencyStore::stored_bytes)
/// reports.
#[derive(Debug, Default)]
pub(crate) struct StoredBytes(AtomicU64);

impl StoredBytes {
    pub(crate) fn new(bytes: u64) -> Self {
        Self(AtomicU64::new(bytes))
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// A record of `old` bytes (`None`: there was none) is now one of `new` (`None`: gone).
    pub(crate) fn replaced(&self, old: Option<usize>, new: Option<usize>) {
        let (old, new) = (as_u64(old), as_u64(new));
        if new >= old {
            self.0.fetch_add(new - old, Ordering::Relaxed);
        } else {
            // Saturating: a count that went wrong must not wrap into "full" for ever.
            let _ = self
                .0
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(old - new))
                });
        }
    }
}

fn as_u64(bytes: Option<usize>) -> u64 {
    bytes.map_or(0, |n| u64::try_from(n).unwrap_or(u64::MAX))
}

/// The bytes one record counts for: its key and its value, or `None` when there is no value.
pub(crate) fn entry_len(key: &[u8], value: Option<&[u8]>) -> Option<usize> {
    value.map(|v| key.len().saturating_add(v.len()))
}
