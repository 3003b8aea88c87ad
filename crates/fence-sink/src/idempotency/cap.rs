//! The cap on the bytes stored records hold: a new key past it is refused before it runs.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use fence_core::{JobId, Problem, ProblemType};

use super::IdempotencyConfig;

/// A keyed request between its record's begin and its finish, counted in
/// [`IdempotencyConfig::recording`] until dropped.
pub(crate) struct Recording(Arc<AtomicU64>);

impl Drop for Recording {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why a new key was refused: what the store holds and how many others are recording.
pub(crate) struct Full {
    stored: u64,
    others: u64,
}

/// Counts a request whose record has just begun, if the records leave room for it: the
/// bytes `stored` (`None`: the store does not count) plus the most the other keyed requests
/// running may add must be under the cap. This request's own answer is not counted: the cap
/// is soft by up to one answer per request admitted at once.
pub(crate) fn admit(config: &IdempotencyConfig, stored: Option<u64>) -> Result<Recording, Full> {
    let others = config.recording.fetch_add(1, Ordering::Relaxed);
    let recording = Recording(config.recording.clone());
    let Some(stored) = stored else {
        return Ok(recording);
    };
    let max_answer = u64::try_from(config.max_response_body).unwrap_or(u64::MAX);
    metrics::gauge!("fence_sink_idempotency_stored_bytes").set(stored as f64);
    if stored.saturating_add(others.saturating_mul(max_answer)) < config.max_stored_bytes {
        Ok(recording)
    } else {
        Err(Full { stored, others })
    }
}

/// The 503 `overloaded` a new key gets while the records are full.
pub(crate) fn refused(job: &JobId, config: &IdempotencyConfig, full: &Full) -> Problem {
    let Full { stored, others } = full;
    let (limit, max_answer) = (config.max_stored_bytes, config.max_response_body);
    let detail = format!(
        "job {job}: the idempotency store holds {stored} bytes of its {limit}-byte limit, and {others} other keyed requests running may each store up to {max_answer} bytes more; nothing was passed on, retry once expired records are purged (every {}s)",
        config.sweep_every.as_secs().max(1)
    );
    Problem::new(ProblemType::Overloaded, detail).with_job(job.clone())
}
