//! Conformance cases of the lock-delay (contract section 12).

use std::time::Duration;

use crate::{ClaimTerms, LeaseState, LeaseStore, Outcome};

use super::{Advance, TTL, job, key_of, ms, owner};

const DELAY: Duration = Duration::from_secs(10);

/// `o` claims `j` with a lock-delay of `delay`, and must be granted it: the generation.
async fn claim_delayed<S: LeaseStore>(
    store: &S,
    j: &fence_core::JobId,
    o: &fence_core::Owner,
    delay: Duration,
) -> fence_core::Generation {
    let terms = ClaimTerms {
        ttl: TTL,
        lock_delay: Some(delay),
    };
    match store.apply(j, terms.op(o, &key_of(o))).await.unwrap() {
        Outcome::Granted(g) => g.generation,
        other => panic!("{o} expected to be granted {j}, got {other:?}"),
    }
}

/// A lease that *expires* keeps the job from every claim for its lock-delay after its end
/// (the refusal says who held it and how long is left), is never forgotten meanwhile, and
/// can still be renewed by its holder; after the delay the next claim gets the next
/// generation.
pub async fn an_expired_lease_keeps_the_job_for_its_lock_delay<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let (j, a, b) = (job("conf-delay"), owner("a"), owner("b"));
    let ga = claim_delayed(&store, &j, &a, DELAY).await;
    advance(ms(TTL.as_duration() + Duration::from_secs(1)));
    for claimer in [&b, &a] {
        match store
            .claim(&j, claimer, &key_of(claimer), TTL)
            .await
            .unwrap()
        {
            Outcome::Held {
                owner: o,
                generation,
                expires_in,
                lock_delay: true,
            } => {
                assert_eq!((o, generation), (a.clone(), ga), "the expired lease's");
                let left = DELAY - Duration::from_secs(1);
                assert!(
                    expires_in <= left && expires_in + Duration::from_secs(1) >= left,
                    "{expires_in:?} left, expected {left:?}"
                );
            }
            other => panic!("{claimer} claimed during the lock-delay: {other:?}"),
        }
    }
    assert_eq!(
        store.get(&j).await.unwrap().unwrap().state,
        LeaseState::Expired
    );
    // Forgetting would let the next claim in at once: the job stays while the delay runs.
    let _ = store.forget_idle(Duration::ZERO, 100).await.unwrap();
    assert!(
        store.get(&j).await.unwrap().is_some(),
        "forgotten during its lock-delay"
    );
    advance(ms(DELAY));
    let gb = claim_delayed(&store, &j, &b, DELAY).await;
    assert_eq!(gb.get(), ga.get() + 1);
}

/// The holder of an expired lease may renew it during the delay (nobody claimed since), as
/// after any expiry; the delay then counts from the renewed lease's end.
pub async fn the_holder_renews_during_its_lock_delay<S: LeaseStore>(store: S, advance: Advance) {
    let (j, a, b) = (job("conf-delay-renew"), owner("a"), owner("b"));
    let ga = claim_delayed(&store, &j, &a, DELAY).await;
    advance(ms(TTL.as_duration() + Duration::from_secs(1)));
    assert!(matches!(
        store.renew(&j, &a, ga, &key_of(&a), TTL).await.unwrap(),
        Outcome::Granted(_)
    ));
    advance(ms(TTL.as_duration() + Duration::from_secs(1)));
    assert!(
        matches!(
            store.claim(&j, &b, &key_of(&b), TTL).await.unwrap(),
            Outcome::Held {
                lock_delay: true,
                ..
            }
        ),
        "the renewed lease expired: its delay runs again"
    );
}

/// A release, a completion's end or an operator's revoke is no expiry: no lock-delay.
pub async fn release_and_revoke_free_the_job_without_lock_delay<S: LeaseStore>(
    store: S,
    _advance: Advance,
) {
    let (j, a, b, c) = (job("conf-delay-free"), owner("a"), owner("b"), owner("c"));
    let hour = Duration::from_secs(3600);
    let ga = claim_delayed(&store, &j, &a, hour).await;
    store.release(&j, &a, ga, &key_of(&a)).await.unwrap();
    let gb = claim_delayed(&store, &j, &b, hour).await;
    assert_eq!(gb.get(), ga.get() + 1, "claimed at once after a release");
    assert!(matches!(
        store.apply(&j, crate::LeaseOp::Revoke).await.unwrap(),
        Outcome::Revoked(_)
    ));
    let gc = claim_delayed(&store, &j, &c, hour).await;
    assert_eq!(gc.get(), gb.get() + 2, "claimed at once after a revoke");
}
