//! What every store that decides semaphore claims in Rust shares (contract section 15): the
//! checks of a claim, and the resource's slot records out of a scan by prefix.

use fence_core::{
    JobId,
    lease_api::{MAX_SLOTS, SLOT_SEPARATOR, check_resource, slot_of},
};

use super::{StoreError, rules::Stored};

/// Refuses a semaphore claim no store decides: a resource that cannot name a semaphore, or
/// a number of slots out of 1 to [`MAX_SLOTS`].
pub(crate) fn check_slot_claim(resource: &JobId, slots: u32) -> Result<(), StoreError> {
    check_resource(resource).map_err(|e| StoreError::Protocol(e.to_string()))?;
    if (1..=MAX_SLOTS).contains(&slots) {
        Ok(())
    } else {
        Err(StoreError::Protocol(format!(
            "a semaphore has 1 to {MAX_SLOTS} slots, got {slots}"
        )))
    }
}

/// The job id every slot of `resource` starts with, which sorts before all of them.
pub(crate) fn slot_prefix(resource: &JobId) -> JobId {
    format!("{resource}{SLOT_SEPARATOR}")
        .parse()
        .expect("a resource and '#' make a valid job id")
}

/// The slot records among `(job, record)` pairs read by the prefix of `resource`'s slots:
/// those whose job id is a slot of it (other job ids holding `#`, from before `#` was
/// reserved, are left out), decoded.
pub(crate) fn slot_records<'a>(
    items: impl Iterator<Item = Result<(JobId, Stored), StoreError>> + 'a,
) -> Result<Vec<(u32, Stored)>, StoreError> {
    let mut out = Vec::new();
    for item in items {
        let (job, stored) = item?;
        if let Some((_, slot)) = slot_of(&job) {
            out.push((slot, stored));
        }
    }
    Ok(out)
}
