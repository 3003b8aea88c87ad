//! Conformance case of listing: pages, order, and the state and prefix filters.

use crate::{LeaseState, LeaseStore};

use super::{Advance, granted, job, key_of, owner};

/// The list: job id order, pages that end with `next`, and the state and prefix filters.
pub async fn list_pages_through_jobs_in_order_by_state_and_prefix<S: LeaseStore>(
    store: S,
    _advance: Advance,
) {
    use fence_core::lease_api::ListQuery;
    let a = owner("a");
    // list-0 .. list-9: even ones held, odd ones released (free); others- elsewhere.
    for i in 0..10 {
        let j = job(&format!("list-{i}"));
        let g = granted(&store, &j, &a).await;
        if i % 2 == 1 {
            store.release(&j, &a, g, &key_of(&a)).await.unwrap();
        }
    }
    granted(&store, &job("other"), &a).await;
    let prefix = Some("list-".to_owned());
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = store
            .list(&ListQuery {
                prefix: prefix.clone(),
                after: after.clone(),
                limit: Some(3),
                ..ListQuery::default()
            })
            .await
            .unwrap();
        assert!(page.leases.len() <= 3, "{page:?}");
        seen.extend(page.leases.iter().map(|r| r.job.to_string()));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let want: Vec<String> = (0..10).map(|i| format!("list-{i}")).collect();
    assert_eq!(seen, want, "every job once, in order, and only the prefix");
    let held = store
        .list(&ListQuery {
            state: Some(LeaseState::Held),
            prefix: prefix.clone(),
            ..ListQuery::default()
        })
        .await
        .unwrap();
    let held: Vec<String> = held.leases.iter().map(|r| r.job.to_string()).collect();
    assert_eq!(held, ["list-0", "list-2", "list-4", "list-6", "list-8"]);
    let rest = store
        .list(&ListQuery {
            after: Some(job("list-8")),
            ..ListQuery::default()
        })
        .await
        .unwrap();
    let rest: Vec<String> = rest.leases.iter().map(|r| r.job.to_string()).collect();
    assert_eq!(rest, ["list-9", "other"]);
}
