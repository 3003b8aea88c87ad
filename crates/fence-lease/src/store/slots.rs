//! What every store that decides semaphore claims in Rust shares (contract section 15).
//!
//! The checks of a claim, the resource's slot records out of a scan by prefix, and the rule.

use fence_core::{
    Generation, JobId, Owner,
    lease_api::{LeaseState, MAX_SLOTS, SLOT_SEPARATOR, check_resource, slot_job, slot_of},
    secret::LeaseKey,
};

use super::{
    ClaimTerms, Outcome, SlotClaim, StoreError,
    rules::{self, Stored},
};

/// Refuses a semaphore claim no store decides: a resource that cannot name a semaphore, or
/// a number of slots out of 1 to [`MAX_SLOTS`].
pub(crate) fn check_slot_claim(resource: &JobId, slots: u32) -> Result<(), StoreError> {
    // Refused as the server refuses them (400): asking again cannot change the answer.
    let refused = |detail: String| StoreError::Refused {
        status: 400,
        detail,
    };
    check_resource(resource).map_err(|e| refused(format!("resource: {e}")))?;
    if (1..=MAX_SLOTS).contains(&slots) {
        Ok(())
    } else {
        Err(refused(format!(
            "a semaphore has 1 to {MAX_SLOTS} slots, got {slots}"
        )))
    }
}

/// [`check_slot_claim`]'s refusal, saying that nothing was sent (the HTTP store).
pub(crate) fn refused_before_sending(e: StoreError) -> StoreError {
    match e {
        StoreError::Refused { status, detail } => StoreError::Refused {
            status,
            detail: format!("{detail} (refused before sending)"),
        },
        e => e,
    }
}

/// The job id every slot of `resource` starts with, which sorts before all of them.
pub(crate) fn slot_prefix(resource: &JobId) -> JobId {
    format!("{resource}{SLOT_SEPARATOR}")
        .parse()
        .expect("a resource and '#' make a valid job id")
}

/// The slot records among `(job, record)` pairs read by the prefix of `resource`'s slots:
/// those whose job id is a slot of it (`resource#k`, k from 1 to 1,000 without leading
/// zeros), decoded; other job ids under the prefix (from before `#` was reserved) are left
/// out. A plain job of a slot's name from then keeps its record (its `slots` is 0).
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

/// A semaphore claim (contract section 15) decided on `records`, every record of the
/// resource's slots as read under the caller's lock on the resource (slot number, record;
/// any order, slots past `slots` included). Returns the slot to write with its new record,
/// or none, and the answer. The caller writes the record only if the slot's record is still
/// the one it read (else it decides again).
pub(crate) fn decide_slot(
    resource: &JobId,
    records: &[(u32, Stored)],
    floor: Generation,
    (owner, key): (&Owner, &LeaseKey),
    (terms, slots): (ClaimTerms, u32),
    now_ms: u64,
) -> Result<(Option<(u32, Stored)>, SlotClaim), StoreError> {
    let refused = |slot, outcome| Ok((None, SlotClaim { slot, outcome }));
    // The number of slots in force: that of any slot with a holder, held or expired, or
    // revoked before its lease would have ended (`Stored::keeps_slots`). Another number is
    // refused as a whole.
    let in_force = records
        .iter()
        .find(|(_, s)| s.slots != slots && s.keeps_slots(now_ms));
    if let Some((_, s)) = in_force {
        return refused(None, Outcome::SemaphoreSize { slots: s.slots });
    }
    let record = |slot: u32| records.iter().find(|(k, _)| *k == slot).map(|(_, s)| s);
    // A holder that claims again with its key gets its own slot back (the retry of a lost
    // answer), never a second one.
    let mine = records.iter().find(|(_, s)| {
        s.state(now_ms) == LeaseState::Held
            && s.owner.as_ref() == Some(owner)
            && s.key == key.hash()
    });
    let candidates: Vec<u32> = match mine {
        Some((slot, _)) => vec![*slot],
        None => (1..=slots).collect(),
    };
    let mut first_free: Option<(u32, Outcome)> = None;
    let mut completed: Option<(u32, Outcome)> = None;
    for slot in candidates {
        let job = slot_job(resource, slot);
        let (new, outcome) = rules::claim(
            &job,
            record(slot),
            floor,
            owner,
            key,
            (terms, slots),
            now_ms,
        )?;
        match (new, outcome) {
            (Some(new), outcome) => {
                return Ok((
                    Some((slot, new)),
                    SlotClaim {
                        slot: Some(slot),
                        outcome,
                    },
                ));
            }
            (None, outcome @ Outcome::Held { .. }) => {
                let sooner = match (&first_free, &outcome) {
                    (None, _) => true,
                    (
                        Some((_, Outcome::Held { expires_in: a, .. })),
                        Outcome::Held { expires_in: b, .. },
                    ) => b < a,
                    _ => false,
                };
                if sooner {
                    first_free = Some((slot, outcome));
                }
            }
            // A completed slot (of a plain job of that name, from before '#' was reserved)
            // stays taken for good.
            (None, outcome) => {
                completed.get_or_insert((slot, outcome));
            }
        }
    }
    match first_free.or(completed) {
        Some((slot, refusal)) => refused(Some(slot), refusal),
        None => Err(StoreError::Protocol(format!(
            "no slot of {resource} was decided: an empty semaphore"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_slot_claim_says_who_refused_it_and_whether_it_was_sent() {
        let resource: JobId = "queue".parse().unwrap();
        let local = check_slot_claim(&resource, 0).unwrap_err();
        let text = local.to_string();
        assert_eq!(
            text,
            format!("the request was refused (400): a semaphore has 1 to {MAX_SLOTS} slots, got 0")
        );
        let sent = refused_before_sending(local).to_string();
        assert!(sent.ends_with("got 0 (refused before sending)"), "{sent}");
        // Other errors pass through unchanged.
        let io = refused_before_sending(StoreError::io(std::io::Error::other("down")));
        assert!(matches!(io, StoreError::Io(_)), "{io:?}");
    }
}
