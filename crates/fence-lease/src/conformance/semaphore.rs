//! Conformance cases of fenced semaphores (contract section 15).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Barrier},
    time::Duration,
};

use fence_core::{Generation, JobId, Owner, lease_api::slot_job};

use crate::{ClaimTerms, LeaseState, LeaseStore, Outcome, SlotClaim, StoreError};

use super::{Advance, TTL, job, key_of, ms, owner};

/// `o` claims a slot of `resource` of `slots` with its own key.
async fn slot_claim<S: LeaseStore>(
    store: &S,
    resource: &JobId,
    o: &Owner,
    slots: u32,
) -> SlotClaim {
    store
        .claim_slot(resource, o, &key_of(o), ClaimTerms::from(TTL), slots)
        .await
        .expect("semaphore claim")
}

/// `o` must be granted a slot: the slot's number and generation.
async fn slot_of<S: LeaseStore>(
    store: &S,
    resource: &JobId,
    o: &Owner,
    slots: u32,
) -> (u32, Generation) {
    match slot_claim(store, resource, o, slots).await {
        SlotClaim {
            slot: Some(slot),
            outcome: Outcome::Granted(g),
        } => (slot, g.generation),
        other => panic!("{o} expected a slot of {resource}, got {other:?}"),
    }
}

/// N + 1 claimers race for a semaphore of N slots, round after round: exactly N win, each a
/// different slot; the one left out is told the slot that frees first. Each slot's
/// generation only grows across rounds, and a holder whose slot expired and was taken again
/// is refused (its renewal is `Lost`), like the stale holder of any job.
pub async fn racing_claimers_of_a_semaphore_get_exactly_its_slots<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    const SLOTS: u32 = 3;
    const ROUNDS: usize = 6;
    let store = Arc::new(store);
    let resource = job("conf-sem");
    let mut last: BTreeMap<u32, Generation> = BTreeMap::new();
    let mut stale: Option<(Owner, u32, Generation)> = None;
    for round in 0..ROUNDS {
        let claimers = SLOTS as usize + 1;
        let barrier = Arc::new(Barrier::new(claimers));
        let mut tasks = Vec::new();
        for t in 0..claimers {
            let (store, resource, barrier) = (store.clone(), resource.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                let o = owner(&format!("r{round}-racer-{t}"));
                tokio::task::spawn_blocking(move || barrier.wait())
                    .await
                    .unwrap();
                (o.clone(), slot_claim(&*store, &resource, &o, SLOTS).await)
            }));
        }
        let mut winners = BTreeMap::new();
        let mut losers = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                (
                    o,
                    SlotClaim {
                        slot: Some(slot),
                        outcome: Outcome::Granted(g),
                    },
                ) => {
                    assert!(
                        winners.insert(slot, (o, g.generation)).is_none(),
                        "round {round}: slot {slot} granted twice"
                    );
                }
                (
                    o,
                    SlotClaim {
                        slot: Some(slot),
                        outcome: Outcome::Held { expires_in, .. },
                    },
                ) => {
                    assert!((1..=SLOTS).contains(&slot));
                    assert!(expires_in > Duration::ZERO && expires_in <= TTL.as_duration());
                    losers.push(o);
                }
                (_, other) => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(
            (winners.len(), losers.len()),
            (SLOTS as usize, 1),
            "round {round}: exactly {SLOTS} of {claimers} win"
        );
        assert_eq!(
            winners.keys().copied().collect::<Vec<_>>(),
            (1..=SLOTS).collect::<Vec<_>>()
        );
        for (slot, (_, g)) in &winners {
            if let Some(before) = last.get(slot) {
                assert!(
                    g > before,
                    "round {round}: slot {slot} went from {before} to {g}"
                );
            }
            last.insert(*slot, *g);
            let record = store
                .get(&slot_job(&resource, *slot))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(record.generation, *g, "the slot's record");
        }
        if let Some((o, slot, g)) = stale.take() {
            // Its slot expired and went to a claimer of this round.
            let job = slot_job(&resource, slot);
            assert!(
                matches!(
                    store.renew(&job, &o, g, &key_of(&o), TTL).await.unwrap(),
                    Outcome::Lost { .. }
                ),
                "round {round}: the stale holder of slot {slot} renewed"
            );
        }
        // Every other round the slots expire (the first holder's is kept to be refused),
        // else they are released.
        if round % 2 == 0 {
            let (slot, (o, g)) = winners.iter().next().map(|(s, w)| (*s, w.clone())).unwrap();
            stale = Some((o, slot, g));
            advance(ms(TTL.as_duration() + Duration::from_secs(1)));
        } else {
            for (slot, (o, g)) in winners {
                let job = slot_job(&resource, slot);
                assert!(matches!(
                    store.release(&job, &o, g, &key_of(&o)).await.unwrap(),
                    Outcome::Done(_)
                ));
            }
        }
    }
}

/// The number of slots is fixed while any slot has a holder, even one whose lease expired
/// (it may still renew, as for any job): a claim naming another number is refused as a
/// whole with the number in force, also one naming fewer; once every slot is free
/// (released, revoked or forgotten) another number takes over. A holder that claims again
/// with its key gets its own slot back, not a second one.
pub async fn a_semaphore_keeps_its_number_of_slots_while_held<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let resource = job("conf-sem-size");
    let (a, b, c) = (owner("a"), owner("b"), owner("c"));
    let (slot_a, ga) = slot_of(&store, &resource, &a, 2).await;
    assert_eq!((slot_a, ga), (1, Generation::new(1)));
    // The retry of a lost answer: the same slot and generation.
    assert_eq!(slot_of(&store, &resource, &a, 2).await, (1, ga));
    for other in [3, 1] {
        let refused = slot_claim(&store, &resource, &b, other).await;
        assert_eq!(
            refused,
            SlotClaim {
                slot: None,
                outcome: Outcome::SemaphoreSize { slots: 2 }
            },
            "a claim of {other} slots while 2 are in force"
        );
    }
    let (slot_b, gb) = slot_of(&store, &resource, &b, 2).await;
    assert_eq!(slot_b, 2);
    let full = slot_claim(&store, &resource, &c, 2).await;
    assert!(matches!(full.outcome, Outcome::Held { .. }), "{full:?}");
    // Freed: one released, the other expired.
    let job_a = slot_job(&resource, 1);
    assert!(matches!(
        store.release(&job_a, &a, ga, &key_of(&a)).await.unwrap(),
        Outcome::Done(_)
    ));
    // With slot 1 free, b's retry still gets its own slot 2, not a second slot.
    assert_eq!(slot_of(&store, &resource, &b, 2).await, (2, gb));
    // b's lease expires. Its holder may still renew it while nobody claimed it since, as
    // for any job: so its slot still counts, and another number is still refused (else b,
    // renewing, and the new number's holders would be more than either number).
    advance(ms(TTL.as_duration() + Duration::from_secs(1)));
    let refused = slot_claim(&store, &resource, &c, 3).await;
    assert_eq!(refused.outcome, Outcome::SemaphoreSize { slots: 2 });
    let job_b = slot_job(&resource, 2);
    assert!(matches!(
        store.renew(&job_b, &b, gb, &key_of(&b), TTL).await.unwrap(),
        Outcome::Granted(_)
    ));
    // Released, every slot is free: another number takes over.
    assert!(matches!(
        store.release(&job_b, &b, gb, &key_of(&b)).await.unwrap(),
        Outcome::Done(_)
    ));
    let slots: BTreeSet<u32> = [
        slot_of(&store, &resource, &c, 3).await.0,
        slot_of(&store, &resource, &a, 3).await.0,
        slot_of(&store, &resource, &b, 3).await.0,
    ]
    .into();
    assert_eq!(slots, [1, 2, 3].into(), "three slots once both were free");
    let refused = slot_claim(&store, &resource, &owner("d"), 2).await;
    assert_eq!(refused.outcome, Outcome::SemaphoreSize { slots: 3 });
}

/// Shrinking by revoke: a revoked holder may still act until its lease would have ended (a
/// signed token until its end, a plain one until it next renews), and a claim of fewer slots
/// never takes a slot above its number again, which alone would fence that holder. So a
/// revoked slot keeps its number in force until then; a claim of the same number still
/// takes a revoked slot at once, one generation above the revoke.
pub async fn a_revoked_slot_keeps_its_number_until_its_lease_would_have_ended<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let resource = job("conf-sem-shrink");
    let holders = [owner("a"), owner("b"), owner("c")];
    let mut held = Vec::new();
    for o in &holders {
        held.push(slot_of(&store, &resource, o, 3).await);
    }
    for (slot, _) in &held {
        let revoked = store
            .apply(&slot_job(&resource, *slot), crate::LeaseOp::Revoke)
            .await
            .unwrap();
        assert!(matches!(revoked, Outcome::Revoked(_)), "{revoked:?}");
    }
    let (d, e) = (owner("d"), owner("e"));
    let shrink = slot_claim(&store, &resource, &d, 2).await;
    assert_eq!(
        shrink.outcome,
        Outcome::SemaphoreSize { slots: 3 },
        "slot 3's revoked holder may still act: a second holder under 2 would make three"
    );
    advance(ms(TTL.as_duration() - Duration::from_secs(1)));
    let shrink = slot_claim(&store, &resource, &d, 2).await;
    assert_eq!(shrink.outcome, Outcome::SemaphoreSize { slots: 3 });
    // Past the revoked leases' ends: the smaller number takes over.
    advance(ms(Duration::from_secs(2)));
    let (slot, g) = slot_of(&store, &resource, &d, 2).await;
    assert_eq!(slot, 1);
    assert_eq!(g.get(), held[0].1.get() + 2, "above the revoke");
    let grown = slot_claim(&store, &resource, &e, 3).await;
    assert_eq!(grown.outcome, Outcome::SemaphoreSize { slots: 2 });
    // A revoked slot is claimed again at once under the same number.
    let other = job("conf-sem-revoked");
    let (slot, g) = slot_of(&store, &other, &holders[0], 1).await;
    let job = slot_job(&other, slot);
    assert!(matches!(
        store.apply(&job, crate::LeaseOp::Revoke).await.unwrap(),
        Outcome::Revoked(_)
    ));
    assert_eq!(
        slot_of(&store, &other, &e, 1).await,
        (1, Generation::new(g.get() + 2))
    );
}

/// A slot is reached only through its semaphore: a plain claim of a job id holding `#` is
/// refused, whoever asks; so are a resource holding `#` and a number of slots out of 1 to
/// 1,000. The slot's other verbs are a plain lease's, but its completion releases it (a
/// completed slot would be lost to the semaphore for good).
pub async fn slots_are_taken_only_through_their_semaphore<S: LeaseStore>(
    store: S,
    _advance: Advance,
) {
    let resource = job("conf-sem-plain");
    let a = owner("a");
    let slot = slot_job(&resource, 1);
    let plain = store.claim(&slot, &a, &key_of(&a), TTL).await;
    assert!(
        matches!(plain, Err(StoreError::Reserved { .. })),
        "{plain:?}"
    );
    let any_hash = store.claim(&job("a#b"), &a, &key_of(&a), TTL).await;
    assert!(
        matches!(any_hash, Err(StoreError::Reserved { .. })),
        "{any_hash:?}"
    );
    for (resource, slots) in [
        (job("a#b"), 1),
        (resource.clone(), 0),
        (resource.clone(), 1_001),
    ] {
        let refused = store
            .claim_slot(&resource, &a, &key_of(&a), ClaimTerms::from(TTL), slots)
            .await;
        // Refused as a request no store takes (400), whatever the store: asking again cannot
        // change the answer.
        assert!(
            matches!(&refused, Err(StoreError::Refused { status: 400, .. })),
            "{resource} with {slots} slots: {refused:?}"
        );
    }
    // Completing a slot one does not hold is answered as for any job: lost.
    let stranger = store
        .complete(&slot, &a, Generation::new(1), &key_of(&a))
        .await;
    assert!(matches!(stranger, Ok(Outcome::Lost { .. })), "{stranger:?}");
    let (n, g) = slot_of(&store, &resource, &a, 1).await;
    assert_eq!(n, 1);
    assert!(matches!(
        store.renew(&slot, &a, g, &key_of(&a), TTL).await.unwrap(),
        Outcome::Granted(_)
    ));
    // Completed by its holder, a slot is released: free, and claimed again.
    match store.complete(&slot, &a, g, &key_of(&a)).await.unwrap() {
        Outcome::Done(record) => assert_eq!(record.state, LeaseState::Free, "{record:?}"),
        other => panic!("{other:?}"),
    }
    // Released slots are claimed again at the next generation.
    assert_eq!(
        slot_of(&store, &resource, &owner("b"), 1).await,
        (1, g.next().unwrap())
    );
}
