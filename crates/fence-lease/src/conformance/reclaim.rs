//! Conformance case of a holder's claim retried with its key (contract section 4).

use std::time::Duration;

use crate::{Grant, LeaseStore, Outcome, Ttl};

use super::{Advance, job, key_of, ms, owner};

/// `o` claims `j` with its own key for `ttl` and must be granted it: the grant.
async fn claim_for<S: LeaseStore>(
    store: &S,
    j: &fence_core::JobId,
    o: &fence_core::Owner,
    ttl: Ttl,
) -> Grant {
    match store.claim(j, o, &key_of(o), ttl).await.expect("claim") {
        Outcome::Granted(g) => g,
        other => panic!("{o} expected to be granted {j}, got {other:?}"),
    }
}

/// A holder's claim retried with its key never moves the lease's end earlier, as a renewal
/// never does. The retry of a lost answer can run after a longer grant (a claim delayed at
/// one server while the retry went through another with a higher `--max-ttl`): were the end
/// moved to the retry's, another owner would get the next generation while the holder still
/// acts under its own until the end it was told.
pub async fn a_holders_claim_retry_never_shortens_its_lease<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let (j, a, b) = (job("conf-reclaim-shorter"), owner("a"), owner("b"));
    let long = Ttl::new(Duration::from_secs(60)).expect("a valid ttl");
    let first = claim_for(&store, &j, &a, long).await;
    advance(ms(Duration::from_secs(1)));
    let again = claim_for(&store, &j, &a, Ttl::MIN).await;
    assert_eq!(again.generation, first.generation);
    assert!(
        again.expires_at_ms >= first.expires_at_ms,
        "the retry moved the end from {} to {}",
        first.expires_at_ms,
        again.expires_at_ms
    );
    advance(ms(Duration::from_secs(5)));
    match store.claim(&j, &b, &key_of(&b), long).await.expect("claim") {
        Outcome::Held {
            owner, generation, ..
        } => {
            assert_eq!(owner, a);
            assert_eq!(generation, first.generation);
        }
        other => panic!("the holder's lease still runs for 54 s; {b} got {other:?}"),
    }
}
