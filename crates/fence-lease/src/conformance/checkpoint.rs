//! Conformance cases of checkpoints under the generation (contract section 14).

use std::time::Duration;

use fence_core::lease_api::Checkpoint;

use crate::{LeaseOp, LeaseStore, Outcome};

use super::{Advance, TTL, grant_of, job, key_of, ms, owner, stranger_key};

fn save(o: &fence_core::Owner, generation: fence_core::Generation, data: &str) -> LeaseOp {
    LeaseOp::Checkpoint {
        owner: o.clone(),
        generation,
        key: key_of(o),
        data: data.to_owned(),
    }
}

/// The holder's checkpoint comes back with the next claim, naming the generation that saved
/// it; a stale holder's checkpoint is refused like its renewal, so the new holder never
/// resumes from it; forgetting the job forgets its checkpoint.
pub async fn a_checkpoint_passes_to_the_next_holder_and_a_stale_one_is_refused<S: LeaseStore>(
    store: S,
    advance: Advance,
) {
    let (j, a, b, c) = (job("conf-checkpoint"), owner("a"), owner("b"), owner("c"));
    let first = grant_of(&store, &j, &a).await;
    assert_eq!(first.checkpoint, None, "a job that never saved one");
    let ga = first.generation;
    assert!(matches!(
        store
            .apply(&j, save(&a, ga, "rows 0-999 done"))
            .await
            .unwrap(),
        Outcome::Done(_)
    ));
    // The wrong key changes nothing, as for a renewal.
    let wrong = LeaseOp::Checkpoint {
        owner: a.clone(),
        generation: ga,
        key: stranger_key(),
        data: "forged".into(),
    };
    assert_eq!(store.apply(&j, wrong).await.unwrap(), Outcome::KeyMismatch);

    advance(ms(TTL.as_duration() + Duration::from_secs(1))); // a stalls past its lease
    let second = grant_of(&store, &j, &b).await;
    let gb = second.generation;
    assert_eq!(
        second.checkpoint,
        Some(Checkpoint {
            generation: ga,
            data: "rows 0-999 done".into()
        })
    );
    // a wakes up and saves: refused, naming b.
    assert_eq!(
        store
            .apply(&j, save(&a, ga, "rows 0-1999 done"))
            .await
            .unwrap(),
        Outcome::Lost {
            owner: Some(b.clone()),
            generation: gb
        }
    );
    // b's claim retried returns the same checkpoint: a's late one never landed.
    let again = grant_of(&store, &j, &b).await;
    assert_eq!(
        again.checkpoint.map(|c| c.data).as_deref(),
        Some("rows 0-999 done")
    );
    assert!(matches!(
        store
            .apply(&j, save(&b, gb, "rows 0-2999 done"))
            .await
            .unwrap(),
        Outcome::Done(_)
    ));
    store.release(&j, &b, gb, &key_of(&b)).await.unwrap();
    let third = grant_of(&store, &j, &c).await;
    assert_eq!(
        third.checkpoint,
        Some(Checkpoint {
            generation: gb,
            data: "rows 0-2999 done".into()
        }),
        "kept across a release"
    );
    // Forgotten with the job (on a store that forgets).
    store
        .release(&j, &c, third.generation, &key_of(&c))
        .await
        .unwrap();
    advance(ms(Duration::from_secs(3600)));
    if store
        .forget_idle(Duration::from_secs(60), 100)
        .await
        .unwrap()
        > 0
    {
        assert_eq!(store.get(&j).await.unwrap(), None);
        assert_eq!(grant_of(&store, &j, &a).await.checkpoint, None);
    }
}
