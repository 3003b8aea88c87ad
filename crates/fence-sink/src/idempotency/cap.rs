//! The cap on the bytes stored records hold, and each job's share once most is used.
//!
//! A new key past either is refused before it runs.

use fence_core::{JobId, Problem, ProblemType};

use super::IdempotencyConfig;

/// A job's share of the cap: a quarter of it, applied once the records hold three quarters.
const SHARE: u64 = 4;

/// What the store holds, as far as it counts: in all, and for the job of the request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    /// The bytes of all records (`None`: the store does not count).
    pub(crate) stored: Option<u64>,
    /// The bytes of the job's records (`None`: the store does not count them per job).
    pub(crate) job: Option<u64>,
}

/// Why a new key was refused: what the store holds.
pub(crate) enum Full {
    /// The records hold the cap.
    Cap { stored: u64 },
    /// They hold three quarters of it or more, and the job its share or more.
    Share { stored: u64, job: u64 },
}

/// Whether a request whose record has just begun may run: see [`fits`]. The answers of
/// keyed requests running are not counted here; each is checked with [`fits`] when it
/// arrives, and one that no longer fits is not stored. (Until an earlier version each keyed request
/// running counted as a whole `--idempotency-max-body`, and 4,096 slow ones, 64 with a
/// 64 MiB body limit, refused every job's new keys with nothing stored.)
pub(crate) fn admit(config: &IdempotencyConfig, held: Held) -> Result<(), Full> {
    fullness(config, held).map_or(Ok(()), Err)
}

/// Whether an answer may still be stored: the records are under the cap and, once they hold
/// three quarters of it, the job's records are under its share (a quarter of the cap), so
/// that one job (one client with one token, or anyone without `--verify-key`'s signatures
/// naming a single job) cannot fill the store: past three quarters it gets no new keys, and
/// the last quarter stays for the jobs under their share. Up to three jobs busy enough to
/// hold a quarter each see the cap at three quarters; four or more equal ones, the cap. Asked again when a request admitted under the cap has its answer: the
/// requests admitted while the records were under it may all finish after it is reached (a
/// review saw 40 slow ones take a 64 KiB cap to 4 MB), so once the records hold the cap an
/// answer is remembered as not replayable, like one too large to store. The cap is then
/// passed by at most the answers stored at the same moment, which the memory budget bounds,
/// as each is held there while it arrives.
pub(crate) fn fits(config: &IdempotencyConfig, held: Held) -> bool {
    fullness(config, held).is_none()
}

fn fullness(config: &IdempotencyConfig, held: Held) -> Option<Full> {
    let stored = held.stored?;
    metrics::gauge!("fence_sink_idempotency_stored_bytes").set(stored as f64);
    let cap = config.max_stored_bytes;
    if stored >= cap {
        return Some(Full::Cap { stored });
    }
    match held.job {
        Some(job) if stored >= cap - cap / SHARE && job >= cap / SHARE => {
            Some(Full::Share { stored, job })
        }
        _ => None,
    }
}

/// The 503 `overloaded` a new key gets while the records are full.
pub(crate) fn refused(job: &JobId, config: &IdempotencyConfig, full: &Full) -> Problem {
    let limit = config.max_stored_bytes;
    let held = match full {
        Full::Cap { stored } => {
            format!("the idempotency store holds {stored} bytes of its {limit}-byte limit")
        }
        Full::Share { stored, job: bytes } => format!(
            "its idempotency records hold {bytes} bytes, its share being {} (a quarter of the {limit}-byte limit) while the store holds {stored} bytes, three quarters of the limit or more",
            limit / SHARE
        ),
    };
    let detail = format!(
        "job {job}: {held}; nothing was passed on, retry once expired records are purged (every {}s; a record expires {}s after it was stored)",
        config.sweep_every.as_secs().max(1),
        config.retention.as_secs()
    );
    Problem::new(ProblemType::Overloaded, detail).with_job(job.clone())
}
