//! The lease-store conformance suite: every behaviour of the contract, for every backend.
//!
//! [`lease_store_conformance!`](crate::lease_store_conformance) makes one test per case.
//!
//! A backend's test module supplies an async factory returning `Some((store, advance))`,
//! where `advance` moves the store's clock forward, or `None` (after printing why) to skip:
//!
//! ```ignore
//! fence_lease::lease_store_conformance!(|| async {
//!     let clock = fence_lease::ManualClock::new(1_000_000);
//!     let store = fence_lease::MemoryLeaseStore::with_clock(std::sync::Arc::new(clock.clone()));
//!     Some((store, fence_lease::conformance::advance_fn(clock)))
//! });
//! ```

use std::{
    collections::BTreeSet,
    sync::{Arc, Barrier},
    time::Duration,
};

use fence_core::{Generation, JobId, Owner};

use crate::{Grant, LeaseKey, LeaseOp, LeaseState, LeaseStore, Outcome, Ttl};

#[doc(hidden)]
pub use fence_storage as __storage;

pub use fence_storage::clock::{Advance, advance_fn, ms};

mod checkpoint;
mod list;
mod lock_delay;
mod reclaim;
mod semaphore;
pub use checkpoint::*;
pub use list::*;
pub use lock_delay::*;
pub use reclaim::*;
pub use semaphore::*;

/// Generates one `#[tokio::test]` per conformance case for the backend made by `$make`.
#[macro_export]
macro_rules! lease_store_conformance {
    ($make:expr) => {
        $crate::conformance::__storage::conformance_cases!($crate::conformance; $make;
            first_claim_is_generation_one_and_excludes_others,
            holder_reclaim_extends_same_generation,
            a_holders_claim_retry_never_shortens_its_lease,
            worked_example_stale_holder_is_rejected,
            renew_requires_owner_and_generation,
            renew_after_expiry_succeeds_until_reclaimed,
            a_renewal_never_moves_the_lease_end_earlier,
            release_frees_and_keeps_generation,
            complete_is_final,
            revoke_ends_the_lease_and_raises_the_generation,
            get_reports_every_state,
            clock_jumps_never_lower_a_generation,
            knowing_owner_and_generation_without_the_key_changes_nothing,
            a_claim_retried_with_another_key_is_refused,
            list_pages_through_jobs_in_order_by_state_and_prefix,
            jobs_are_independent,
            competing_claims_have_one_winner_per_round,
            an_expired_lease_keeps_the_job_for_its_lock_delay,
            the_holder_renews_during_its_lock_delay,
            release_and_revoke_free_the_job_without_lock_delay,
            a_checkpoint_passes_to_the_next_holder_and_a_stale_one_is_refused,
            racing_claimers_of_a_semaphore_get_exactly_its_slots,
            a_semaphore_keeps_its_number_of_slots_while_held,
            a_revoked_slot_keeps_its_number_until_its_lease_would_have_ended,
            slots_are_taken_only_through_their_semaphore,
        );
    };
}

fn job(s: &str) -> JobId {
    s.parse().expect("valid job id")
}

fn owner(s: &str) -> Owner {
    s.parse().expect("valid owner")
}

/// The lease key an owner of these cases always claims with (owners here are base64url).
fn key_of(o: &Owner) -> LeaseKey {
    LeaseKey::new(&format!("{o}-{}", "k".repeat(22))).expect("a valid key")
}

/// A key nobody claimed with.
fn stranger_key() -> LeaseKey {
    LeaseKey::new(&"s".repeat(43)).expect("a valid key")
}

const TTL: Ttl = Ttl::DEFAULT;

async fn granted<S: LeaseStore>(store: &S, j: &JobId, o: &Owner) -> Generation {
    grant_of(store, j, o).await.generation
}

/// `o` claims `j` with its own key and must be granted it: the grant.
async fn grant_of<S: LeaseStore>(store: &S, j: &JobId, o: &Owner) -> Grant {
    match store.claim(j, o, &key_of(o), TTL).await.expect("claim") {
        Outcome::Granted(g) => g,
        other => panic!("{o} expected to be granted {j}, got {other:?}"),
    }
}

/// The first claim gets generation 1; another owner is told who holds it and for how long.
pub async fn first_claim_is_generation_one_and_excludes_others<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let j = job("conf-first");
    assert_eq!(store.get(&j).await.unwrap(), None);
    assert_eq!(granted(&store, &j, &owner("a")).await, Generation::new(1));
    advance(ms(Duration::from_secs(10)));
    match store
        .claim(&j, &owner("b"), &key_of(&owner("b")), TTL)
        .await
        .unwrap()
    {
        Outcome::Held {
            owner: o,
            generation,
            expires_in,
            lock_delay: false,
        } => {
            assert_eq!(o, owner("a"));
            assert_eq!(generation, Generation::new(1), "the holder's generation");
            // What is left of the lease 10 s into it (a second of slack for a store whose
            // clock also runs on its own).
            let left = TTL.as_duration() - Duration::from_secs(10);
            assert!(
                expires_in <= left && expires_in + Duration::from_secs(1) >= left,
                "{expires_in:?} left, expected {left:?}"
            );
        }
        other => panic!("expected Held, got {other:?}"),
    }
}

/// A claim by the current holder returns its lease, extended, with the same generation.
pub async fn holder_reclaim_extends_same_generation<S: LeaseStore>(store: S, advance: Advance) {
    let j = job("conf-reclaim");
    let first = grant_of(&store, &j, &owner("a")).await;
    advance(ms(Duration::from_secs(10)));
    let again = grant_of(&store, &j, &owner("a")).await;
    assert_eq!(again.generation, first.generation);
    assert!(
        again.expires_at_ms >= first.expires_at_ms + 9_000,
        "{again:?} not extended past {first:?}"
    );
}

/// The seed's worked example: A claims, pauses past expiry, B claims the next generation;
/// A's completion and renewal are rejected, naming B.
pub async fn worked_example_stale_holder_is_rejected<S: LeaseStore>(store: S, advance: Advance) {
    let (j, a, b) = (job("conf-worked"), owner("worker-a"), owner("worker-b"));
    // Bring the job to generation 6 first, so A gets 7 as in the seed.
    for _ in 0..6 {
        let g = granted(&store, &j, &a).await;
        store.release(&j, &a, g, &key_of(&a)).await.unwrap();
    }
    let ga = granted(&store, &j, &a).await;
    assert_eq!(ga, Generation::new(7));
    advance(ms(TTL.as_duration() + Duration::from_millis(1)));
    let gb = granted(&store, &j, &b).await;
    assert_eq!(gb, Generation::new(8));
    let lost = Outcome::Lost {
        owner: Some(b.clone()),
        generation: gb,
    };
    assert_eq!(store.complete(&j, &a, ga, &key_of(&a)).await.unwrap(), lost);
    assert_eq!(
        store.renew(&j, &a, ga, &key_of(&a), TTL).await.unwrap(),
        Outcome::Lost {
            owner: Some(b.clone()),
            generation: gb
        }
    );
    assert_eq!(store.release(&j, &a, ga, &key_of(&a)).await.unwrap(), lost);
    let rec = store.get(&j).await.unwrap().unwrap();
    assert_eq!(
        (rec.owner, rec.generation, rec.state),
        (Some(b), gb, LeaseState::Held)
    );
}

/// Renewal needs both the owner and the generation to match.
pub async fn renew_requires_owner_and_generation<S: LeaseStore>(store: S, advance: Advance) {
    let (j, a) = (job("conf-renew"), owner("a"));
    let g = granted(&store, &j, &a).await;
    advance(ms(Duration::from_secs(20)));
    match store.renew(&j, &a, g, &key_of(&a), TTL).await.unwrap() {
        Outcome::Granted(grant) => assert_eq!(grant.generation, g),
        other => panic!("{other:?}"),
    }
    advance(ms(Duration::from_secs(20))); // 40 s after the claim, 20 s after the renewal: still held
    assert_eq!(
        store.get(&j).await.unwrap().unwrap().state,
        LeaseState::Held
    );
    let wrong_gen = Generation::new(g.get() + 1);
    assert!(matches!(
        store
            .renew(&j, &a, wrong_gen, &key_of(&a), TTL)
            .await
            .unwrap(),
        Outcome::Lost { .. }
    ));
    assert!(matches!(
        store
            .renew(&j, &owner("b"), g, &key_of(&owner("b")), TTL)
            .await
            .unwrap(),
        Outcome::Lost { .. }
    ));
    assert_eq!(
        store
            .renew(&job("conf-never"), &a, g, &key_of(&a), TTL)
            .await
            .unwrap(),
        Outcome::Lost {
            owner: None,
            generation: Generation::ZERO
        }
    );
}

/// An expired lease can still be renewed by its holder while nobody has claimed since.
pub async fn renew_after_expiry_succeeds_until_reclaimed<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let (j, a) = (job("conf-expired"), owner("a"));
    let g = granted(&store, &j, &a).await;
    advance(ms(TTL.as_duration() * 2));
    let rec = store.get(&j).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.owner.as_ref(), rec.expires_in),
        (LeaseState::Expired, Some(&a), Duration::ZERO)
    );
    assert!(matches!(
        store.renew(&j, &a, g, &key_of(&a), TTL).await.unwrap(),
        Outcome::Granted(_)
    ));
    assert_eq!(
        store.get(&j).await.unwrap().unwrap().state,
        LeaseState::Held
    );
}

/// A renewal for less time than is left never moves the lease's end earlier: a holder whose
/// renewal's answer is lost keeps the deadline of its last grant, and the store must not
/// let the job go before it (a server with a lower `--max-ttl` answering the renewal, or a
/// client asking for less).
pub async fn a_renewal_never_moves_the_lease_end_earlier<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let (j, a) = (job("conf-renew-shorter"), owner("a"));
    let first = grant_of(&store, &j, &a).await;
    advance(ms(Duration::from_secs(1)));
    let short = Ttl::new(Duration::from_secs(5)).expect("a valid ttl");
    match store
        .renew(&j, &a, first.generation, &key_of(&a), short)
        .await
        .unwrap()
    {
        Outcome::Granted(renewed) => assert!(
            renewed.expires_at_ms >= first.expires_at_ms,
            "the renewal moved the end from {} to {}",
            first.expires_at_ms,
            renewed.expires_at_ms
        ),
        other => panic!("{other:?}"),
    }
    // 20 s after the renewal, 21 s after the claim (TTL 30 s): still held, not claimable.
    advance(ms(Duration::from_secs(20)));
    assert_eq!(
        store.get(&j).await.unwrap().unwrap().state,
        LeaseState::Held
    );
    assert!(matches!(
        store
            .claim(&j, &owner("b"), &key_of(&owner("b")), TTL)
            .await
            .unwrap(),
        Outcome::Held { .. }
    ));
}

/// Release frees the job (owner none) and keeps the generation; the next claim adds one.
pub async fn release_frees_and_keeps_generation<S: LeaseStore>(store: S, _advance: Advance) {
    let (j, a) = (job("conf-release"), owner("a"));
    let g = granted(&store, &j, &a).await;
    match store.release(&j, &a, g, &key_of(&a)).await.unwrap() {
        Outcome::Done(rec) => {
            assert_eq!(
                (rec.state, rec.owner, rec.generation),
                (LeaseState::Free, None, g)
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        store.release(&j, &a, g, &key_of(&a)).await.unwrap(),
        Outcome::Lost { owner: None, .. }
    ));
    assert!(matches!(
        store.renew(&j, &a, g, &key_of(&a), TTL).await.unwrap(),
        Outcome::Lost { .. }
    ));
    assert_eq!(granted(&store, &j, &a).await, Generation::new(g.get() + 1));
}

/// Completion is final: no claim, renewal or release afterwards, not even by the completer.
pub async fn complete_is_final<S: LeaseStore>(store: S, advance: Advance) {
    let (j, a) = (job("conf-complete"), owner("a"));
    let g = granted(&store, &j, &a).await;
    match store.complete(&j, &a, g, &key_of(&a)).await.unwrap() {
        Outcome::Done(rec) => assert_eq!(
            (rec.state, rec.owner.as_ref()),
            (LeaseState::Completed, Some(&a))
        ),
        other => panic!("{other:?}"),
    }
    advance(ms(TTL.as_duration() * 3));
    for o in [&a, &owner("b")] {
        assert_eq!(
            store.claim(&j, o, &key_of(o), TTL).await.unwrap(),
            Outcome::Completed {
                owner: Some(a.clone()),
                generation: g
            }
        );
    }
    assert!(matches!(
        store.renew(&j, &a, g, &key_of(&a), TTL).await.unwrap(),
        Outcome::Lost { .. }
    ));
    assert!(matches!(
        store.complete(&j, &a, g, &key_of(&a)).await.unwrap(),
        Outcome::Lost { .. }
    ));
    assert!(matches!(
        store.release(&j, &a, g, &key_of(&a)).await.unwrap(),
        Outcome::Lost { .. }
    ));
    assert_eq!(store.get(&j).await.unwrap().unwrap().generation, g);
}

/// An operator's revoke frees the job one generation up: the holder has lost it, the next
/// claim gets the generation after; an unknown or completed job is refused, unchanged.
pub async fn revoke_ends_the_lease_and_raises_the_generation<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let (j, a, b) = (job("conf-revoke"), owner("a"), owner("b"));
    let unknown = store.apply(&j, LeaseOp::Revoke).await.unwrap();
    assert_eq!(
        (unknown, store.get(&j).await.unwrap()),
        (Outcome::Unknown, None)
    );
    let grant = grant_of(&store, &j, &a).await;
    let g = grant.generation;
    let Outcome::Revoked(r) = store.apply(&j, LeaseOp::Revoke).await.unwrap() else {
        panic!("a held job is revoked")
    };
    let up = |g: Generation, n: u64| Generation::new(g.get() + n);
    assert_eq!(
        (r.record.state, r.record.owner, r.record.generation),
        (LeaseState::Free, None, up(g, 1))
    );
    assert_eq!(r.expires_at_ms, Some(grant.expires_at_ms)); // when its tokens end
    let lost = store.complete(&j, &a, g, &key_of(&a)).await.unwrap();
    assert_eq!(
        lost,
        Outcome::Lost {
            owner: None,
            generation: up(g, 1)
        }
    );
    assert_eq!(store.get(&j).await.unwrap().unwrap().generation, up(g, 1));
    assert_eq!(granted(&store, &j, &b).await, up(g, 2));
    // An expired lease: the revoked tokens ended already, so the revoke's own ends now.
    advance(ms(TTL.as_duration() * 2));
    let Outcome::Revoked(r) = store.apply(&j, LeaseOp::Revoke).await.unwrap() else {
        panic!("an expired job is revoked")
    };
    assert_eq!(r.record.generation, up(g, 3));
    assert!(r.expires_at_ms.unwrap() >= grant.expires_at_ms + TTL.as_millis());
    let g = granted(&store, &j, &a).await;
    assert_eq!(g, up(grant.generation, 4));
    store.complete(&j, &a, g, &key_of(&a)).await.unwrap();
    let completed = Outcome::Completed {
        owner: Some(a.clone()),
        generation: g,
    };
    assert_eq!(store.apply(&j, LeaseOp::Revoke).await.unwrap(), completed);
    assert_eq!(store.get(&j).await.unwrap().unwrap().generation, g);
}

/// `get` reports free, held, expired and completed as the contract defines them.
pub async fn get_reports_every_state<S: LeaseStore>(store: S, advance: Advance) {
    let (j, a) = (job("conf-get"), owner("a"));
    assert_eq!(store.get(&j).await.unwrap(), None);
    let g = granted(&store, &j, &a).await;
    let held = store.get(&j).await.unwrap().unwrap();
    assert_eq!(
        (held.state, held.owner.as_ref(), held.generation),
        (LeaseState::Held, Some(&a), g)
    );
    assert!(held.expires_in > Duration::from_secs(29) && held.expires_in <= TTL.as_duration());
    advance(ms(TTL.as_duration()));
    let expired = store.get(&j).await.unwrap().unwrap();
    assert_eq!(
        (expired.state, expired.owner.as_ref(), expired.expires_in),
        (LeaseState::Expired, Some(&a), Duration::ZERO)
    );
}

/// The store's clock jumping backwards keeps generations monotonic and claims exclusive:
/// after each lease ends and the next owner claims, the clock jumps back by two TTLs, which
/// makes the newest lease look held for longer (expiry is the store's clock), never an older
/// one current again.
pub async fn clock_jumps_never_lower_a_generation<S: LeaseStore>(store: S, advance: Advance) {
    let (j, a, b) = (job("conf-jump"), owner("a"), owner("b"));
    let ttl = ms(TTL.as_duration());
    let mut last = Generation::ZERO;
    for round in 0..3 {
        let (o, other) = if round % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let g = granted(&store, &j, o).await;
        assert!(g > last, "generation went from {last} to {g}");
        advance(ttl + 1_000); // o's lease ends
        let next = granted(&store, &j, other).await;
        assert_eq!(
            Some(next),
            g.next(),
            "the next owner gets the next generation"
        );
        advance(-2 * ttl); // the clock jumps back
        assert!(
            matches!(
                store.claim(&j, o, &key_of(o), TTL).await.unwrap(),
                Outcome::Held { generation, .. } if generation == next
            ),
            "after the jump the newest lease is still the one held"
        );
        let record = store.get(&j).await.unwrap().expect("a record");
        assert_eq!(record.generation, next, "no generation went back");
        advance(3 * ttl + 1_000); // well past every lease again
        assert!(
            matches!(
                store.renew(&j, o, g, &key_of(o), TTL).await.unwrap(),
                Outcome::Lost { generation, .. } if generation == next
            ),
            "the older lease never comes back"
        );
        last = next;
    }
}

/// Two jobs never affect each other's generations.
pub async fn jobs_are_independent<S: LeaseStore>(store: S, _advance: Advance) {
    let (x, y, a, b) = (job("conf-x"), job("conf-y"), owner("a"), owner("b"));
    assert_eq!(granted(&store, &x, &a).await, Generation::new(1));
    assert_eq!(granted(&store, &y, &b).await, Generation::new(1));
    let gx = granted(&store, &x, &a).await;
    assert_eq!(gx, Generation::new(1), "re-claim by the holder");
    store.complete(&x, &a, gx, &key_of(&a)).await.unwrap();
    assert_eq!(
        store.get(&y).await.unwrap().unwrap().state,
        LeaseState::Held
    );
}

/// 64 tasks race for one job over 50 rounds: exactly one winner per round, generations +1.
pub async fn competing_claims_have_one_winner_per_round<S: LeaseStore>(
    store: S,
    _advance: Advance,
) {
    const TASKS: usize = 64;
    const ROUNDS: u64 = 50;
    let store = Arc::new(store);
    let j = job("conf-race");
    for round in 1..=ROUNDS {
        let barrier = Arc::new(Barrier::new(TASKS));
        let mut tasks = Vec::with_capacity(TASKS);
        for t in 0..TASKS {
            let (store, j, barrier) = (store.clone(), j.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                let o = owner(&format!("racer-{t}"));
                tokio::task::spawn_blocking(move || barrier.wait())
                    .await
                    .unwrap();
                match store.claim(&j, &o, &key_of(&o), TTL).await.unwrap() {
                    Outcome::Granted(g) => Some((o, g.generation)),
                    Outcome::Held { .. } => None,
                    other => panic!("{other:?}"),
                }
            }));
        }
        let mut winners = Vec::new();
        for t in tasks {
            winners.extend(t.await.unwrap());
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let (o, g) = winners.pop().unwrap();
        assert_eq!(g, Generation::new(round), "round {round}");
        assert!(matches!(
            store.release(&j, &o, g, &key_of(&o)).await.unwrap(),
            Outcome::Done(_)
        ));
    }
    let owners: BTreeSet<_> = [store.get(&j).await.unwrap().unwrap().generation].into();
    assert_eq!(owners, [Generation::new(ROUNDS)].into());
}

/// Owner and generation are public (`get` shows them): without the lease key, renew, release
/// and complete are refused with `KeyMismatch`, nothing changes, and the holder keeps its lease.
pub async fn knowing_owner_and_generation_without_the_key_changes_nothing<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let (j, a) = (job("conf-stranger"), owner("a"));
    let g = granted(&store, &j, &a).await;
    let before = store.get(&j).await.unwrap().unwrap();
    let wrong = stranger_key();
    assert_eq!(
        store.renew(&j, &a, g, &wrong, TTL).await.unwrap(),
        Outcome::KeyMismatch
    );
    assert_eq!(
        store.complete(&j, &a, g, &wrong).await.unwrap(),
        Outcome::KeyMismatch
    );
    assert_eq!(
        store.release(&j, &a, g, &wrong).await.unwrap(),
        Outcome::KeyMismatch
    );
    let after = store.get(&j).await.unwrap().unwrap();
    assert_eq!(
        (&after.owner, after.generation, after.state),
        (&before.owner, before.generation, before.state),
        "nothing changed"
    );
    assert!(
        after.expires_in <= before.expires_in,
        "a refused renewal must not extend the lease: {after:?} after {before:?}"
    );
    // A wrong generation or owner is still `Lost`, whatever the key: nothing to learn there.
    assert!(matches!(
        store.renew(&j, &owner("b"), g, &wrong, TTL).await.unwrap(),
        Outcome::Lost { .. }
    ));
    // After expiry too (state expired, nobody claimed since): the key is still needed.
    advance(ms(TTL.as_duration() * 2));
    assert_eq!(
        store.complete(&j, &a, g, &wrong).await.unwrap(),
        Outcome::KeyMismatch
    );
    // The holder, with its key, is untouched by all of that.
    assert!(matches!(
        store.renew(&j, &a, g, &key_of(&a), TTL).await.unwrap(),
        Outcome::Granted(_)
    ));
    assert!(matches!(
        store.complete(&j, &a, g, &key_of(&a)).await.unwrap(),
        Outcome::Done(_)
    ));
}

/// A claim retried by the holder with its key returns the same lease; the same owner with
/// another key is refused as `Held`, so a second process reusing an owner name cannot take
/// over a lease.
pub async fn a_claim_retried_with_another_key_is_refused<S: LeaseStore>(
    store: S,
    _advance: Advance,
) {
    let (j, a) = (job("conf-retry-key"), owner("a"));
    let g = granted(&store, &j, &a).await;
    match store.claim(&j, &a, &stranger_key(), TTL).await.unwrap() {
        Outcome::Held { owner: o, .. } => assert_eq!(o, a),
        other => panic!("expected Held, got {other:?}"),
    }
    assert_eq!(
        granted(&store, &j, &a).await,
        g,
        "the same key gets the same lease"
    );
    assert!(matches!(
        store.renew(&j, &a, g, &key_of(&a), TTL).await.unwrap(),
        Outcome::Granted(_)
    ));
}
