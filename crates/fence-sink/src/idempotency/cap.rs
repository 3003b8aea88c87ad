//! The cap on the bytes stored records hold: a new key past it is refused before it runs.

use fence_core::{JobId, Problem, ProblemType};

use super::IdempotencyConfig;

/// Why a new key was refused: what the store holds.
pub(crate) struct Full {
    stored: u64,
}

/// Whether a request whose record has just begun may run: the bytes `stored` (`None`: the
/// store does not count) must be under the cap. The answers of keyed requests running are
/// not counted here; each is checked with [`fits`] when it arrives, and one that no longer
/// fits is not stored. (Until this version each keyed request running counted as a whole
/// `--idempotency-max-body`, and 4,096 slow ones, 64 with a 64 MiB body limit, refused every
/// job's new keys with nothing stored.)
pub(crate) fn admit(config: &IdempotencyConfig, stored: Option<u64>) -> Result<(), Full> {
    match stored {
        Some(stored) if !fits(config, Some(stored)) => Err(Full { stored }),
        _ => Ok(()),
    }
}

/// Whether an answer may still be stored: the bytes `stored` (`None`: the store does not
/// count) are under the cap. Asked again when a request admitted under the cap has its
/// answer: the requests admitted while the records were under it may all finish after it is
/// reached (a review saw 40 slow ones take a 64 KiB cap to 4 MB), so once the records hold
/// the cap an answer is remembered as not replayable, like one too large to store. The cap
/// is then passed by at most the answers stored at the same moment, which the memory budget
/// bounds, as each is held there while it arrives.
pub(crate) fn fits(config: &IdempotencyConfig, stored: Option<u64>) -> bool {
    let Some(stored) = stored else {
        return true;
    };
    metrics::gauge!("fence_sink_idempotency_stored_bytes").set(stored as f64);
    stored < config.max_stored_bytes
}

/// The 503 `overloaded` a new key gets while the records are full.
pub(crate) fn refused(job: &JobId, config: &IdempotencyConfig, full: &Full) -> Problem {
    let Full { stored } = full;
    let limit = config.max_stored_bytes;
    let detail = format!(
        "job {job}: the idempotency store holds {stored} bytes of its {limit}-byte limit; nothing was passed on, retry once expired records are purged (every {}s; a record expires {}s after it was stored)",
        config.sweep_every.as_secs().max(1),
        config.retention.as_secs()
    );
    Problem::new(ProblemType::Overloaded, detail).with_job(job.clone())
}
