//! The PostgreSQL lease store against the local database: conformance and its own cases.
use super::*;
use crate::store::MAX_LIST_SCAN;

/// A store on a table of its own, so parallel tests do not share jobs.
async fn fresh() -> Option<PgLeaseStore> {
    let url = fence_storage::postgres::test_database_url();
    leftovers_dropped(&url).await;
    let table = PgTable::new("fence_test", &format!("leases_{:016x}", fastrand::u64(..))).unwrap();
    let store = PgLeaseStore::connect(&url, table).await.unwrap();
    store.migrate().await.unwrap();
    Some(store)
}

/// What earlier runs of these tests left in `fence_test`, dropped once per run before any
/// test starts.
async fn leftovers_dropped(url: &str) {
    static ONCE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    ONCE.get_or_init(|| fence_storage::postgres::drop_test_tables(url, &["leases\\_%"]))
        .await;
}

crate::lease_store_conformance!(|| async {
    let store = fresh().await?;
    let shifter = store.clone();
    let advance: crate::conformance::Advance = Box::new(move |ms| shifter.shift_clock_ms(ms));
    Some((store, advance))
});

#[test]
fn table_names_are_checked() {
    assert!(PgTable::new("fence", "leases").is_ok());
    for (s, t) in [
        ("", "x"),
        ("Fence", "x"),
        ("fence", "x;drop"),
        ("fence", "1x"),
        ("a.b", "x"),
    ] {
        assert!(PgTable::new(s, t).is_err(), "{s}.{t}");
    }
}

#[tokio::test]
async fn migrate_is_idempotent_and_generations_never_reset() {
    let Some(store) = fresh().await else { return };
    store.migrate().await.unwrap();
    let (j, a) = ("j".parse().unwrap(), "a".parse().unwrap());
    let key = crate::new_lease_key().unwrap();
    let Outcome::Granted(g) = store.claim(&j, &a, &key, Ttl::DEFAULT).await.unwrap() else {
        panic!()
    };
    store.complete(&j, &a, g.generation, &key).await.unwrap();
    store.migrate().await.unwrap();
    let rec = store.get(&j).await.unwrap().unwrap();
    assert_eq!(
        (rec.generation, rec.state),
        (Generation::new(1), LeaseState::Completed)
    );
}

fn granted(outcome: Outcome) -> Generation {
    match outcome {
        Outcome::Granted(g) => g.generation,
        other => panic!("{other:?}"),
    }
}

/// Contract section 8 on PostgreSQL: idle jobs go, held ones stay, and a job claimed
/// again, or for the first time, from this store or another on the same table (a
/// restart, a second server), starts above every generation forgotten.
#[tokio::test]
async fn forgets_idle_jobs_and_every_store_on_the_table_starts_above_the_floor() {
    const IDLE: Duration = Duration::from_secs(3600);
    let store = fresh().await.unwrap();
    let owner: Owner = "w".parse().unwrap();
    let short = Ttl::from_millis(10_000).unwrap();
    let (a, c, held) = (
        "a".parse::<JobId>().unwrap(),
        "c".parse::<JobId>().unwrap(),
        "held".parse::<JobId>().unwrap(),
    );
    let key = crate::new_lease_key().unwrap();
    let g = granted(store.claim(&a, &owner, &key, short).await.unwrap());
    store.complete(&a, &owner, g, &key).await.unwrap();
    for _ in 0..4 {
        let g = granted(store.claim(&c, &owner, &key, short).await.unwrap());
        store.release(&c, &owner, g, &key).await.unwrap();
    }
    assert_eq!(
        granted(store.claim(&c, &owner, &key, short).await.unwrap()),
        Generation::new(5)
    );
    let day = Ttl::from_millis(24 * 3600 * 1000).unwrap();
    store.claim(&held, &owner, &key, day).await.unwrap();
    assert_eq!(
        store.forget_idle(IDLE, 100).await.unwrap(),
        0,
        "none idle yet"
    );
    store.shift_clock_ms(i64::try_from((IDLE + Duration::from_secs(11)).as_millis()).unwrap());
    assert_eq!(store.forget_idle(IDLE, 100).await.unwrap(), 2, "a and c");
    assert_eq!(store.forget_idle(IDLE, 100).await.unwrap(), 0);
    assert!(store.get(&a).await.unwrap().is_none());
    assert!(store.get(&c).await.unwrap().is_none());
    assert!(
        store.get(&held).await.unwrap().is_some(),
        "a held lease stays"
    );
    let listed = store.list(&ListQuery::default()).await.unwrap();
    assert_eq!(
        listed.leases.len(),
        1,
        "the floor row is never listed: {listed:?}"
    );
    // A completed job forgotten may run again, above everything it had.
    let again = granted(store.claim(&a, &owner, &key, short).await.unwrap());
    assert_eq!(again, Generation::new(6), "the floor is 5 (c's)");
    // Another store on the same table: a restarted or second server.
    let other = PgLeaseStore::connect(
        &fence_storage::postgres::test_database_url(),
        store.table.clone(),
    )
    .await
    .unwrap();
    other.migrate().await.unwrap();
    let fresh_job = "never-seen".parse().unwrap();
    assert_eq!(
        granted(other.claim(&fresh_job, &owner, &key, short).await.unwrap()),
        Generation::new(6)
    );
    assert_eq!(
        granted(other.claim(&c, &owner, &key, short).await.unwrap()),
        Generation::new(6)
    );
}

/// Claims race forgetting that deletes every released job at once: no job is ever
/// granted the same generation twice, which it would be if a claim started a new row
/// from a floor read before a forgetting it raced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_racing_forgetting_never_reuse_a_generation() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let store = fresh().await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let forgetter = {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            let mut forgotten = 0;
            while !stop.load(Ordering::SeqCst) {
                forgotten += store.forget_idle(Duration::ZERO, 20).await.unwrap();
            }
            forgotten
        })
    };
    let mut workers = Vec::new();
    for w in 0..6 {
        let store = store.clone();
        workers.push(tokio::spawn(async move {
            let owner: Owner = format!("w{w}").parse().unwrap();
            let ttl = Ttl::from_millis(10_000).unwrap();
            let mut grants = Vec::new();
            for i in 0..120 {
                let job: JobId = format!("j{}", (i * 7 + w) % 4).parse().unwrap();
                let key = crate::new_lease_key().unwrap();
                if let Outcome::Granted(g) = store.claim(&job, &owner, &key, ttl).await.unwrap() {
                    grants.push((job.clone(), g.generation));
                    store
                        .release(&job, &owner, g.generation, &key)
                        .await
                        .unwrap();
                }
            }
            grants
        }));
    }
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    for w in workers {
        for grant in w.await.unwrap() {
            total += 1;
            assert!(seen.insert(grant.clone()), "generation reused: {grant:?}");
        }
    }
    stop.store(true, Ordering::SeqCst);
    let forgotten = forgetter.await.unwrap();
    assert!(
        total > 100 && forgotten > 20,
        "{total} grants, {forgotten} forgotten"
    );
}

/// 40 semaphore claims of 2 slots at once, claim `i` of resource `resource(i)` by owner
/// `w{i}`: their answers, in that order.
async fn burst(store: &PgLeaseStore, resource: fn(usize) -> String) -> Vec<SlotClaim> {
    let claims: Vec<_> = (0..40)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let resource: JobId = resource(i).parse().unwrap();
                let owner: Owner = format!("w{i}").parse().unwrap();
                let key = crate::new_lease_key().unwrap();
                let terms = ClaimTerms::from(Ttl::from_millis(10_000).unwrap());
                store.claim_slot(&resource, &owner, &key, terms, 2).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for claim in claims {
        answers.push(claim.await.unwrap().unwrap());
    }
    answers
}

/// A burst of semaphore claims of one resource takes one pooled connection at a time (the
/// rest queue for the resource's turn in memory), and claims of many busy resources at most
/// half the pool, so they cannot take the pool from other jobs' requests while they wait
/// for advisory locks; every claim is answered, and one busy resource grants its two slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_of_semaphore_claims_hold_at_most_half_the_pool() {
    let store = fresh().await.unwrap();
    let before = store.pool.status().size;
    let answers = burst(&store, |_| "busy".to_owned()).await;
    let granted = answers
        .iter()
        .filter(|a| matches!(a.outcome, Outcome::Granted(_)))
        .count();
    assert_eq!(granted, 2);
    let after = store.pool.status().size;
    assert!(
        after <= before.max(1) + 1,
        "40 claims of one semaphore opened {after} pooled connections (from {before})"
    );
    // Claims of 40 busy resources at once hold at most half the pool between them, leaving
    // the rest to other jobs' requests.
    burst(&store, |i| format!("busy-{i}")).await;
    let (most, half) = (
        store.pool.status().size,
        fence_storage::postgres::POOL_SIZE / 2,
    );
    assert!(
        most <= half,
        "claims of 40 semaphores opened {most} pooled connections (at most {half} were to be held)"
    );
}

/// A semaphore claim whose caller went away while it waited for the resource's advisory lock
/// (held here as a stalled claim on another server would hold it) gives its connection to
/// nobody: every connection the pool hands out afterwards answers at once, instead of
/// queueing behind the abandoned wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_claim_that_went_away_leaves_no_waiting_connection_in_the_pool() {
    let store = fresh().await.unwrap();
    let resource: JobId = "stalled-elsewhere".parse().unwrap();
    let lock = format!("fence-slots {} {resource}", store.table.qualified());
    let mut holder = store.pool.get().await.unwrap();
    let held = holder.transaction().await.unwrap();
    held.execute(&store.sql.slots.lock, &[&lock]).await.unwrap();
    let owner: Owner = "w".parse().unwrap();
    let key = crate::new_lease_key().unwrap();
    let terms = ClaimTerms::from(Ttl::from_millis(10_000).unwrap());
    let gone = tokio::time::timeout(
        Duration::from_millis(300),
        store.claim_slot(&resource, &owner, &key, terms, 2),
    )
    .await;
    assert!(gone.is_err(), "the claim waited for the advisory lock");
    let idle = store.pool.status().available;
    let mut conns = Vec::new();
    for _ in 0..idle {
        conns.push(store.pool.get().await.unwrap());
    }
    for conn in &conns {
        // Well within the claim's 2 s lock timeout, after which the database itself would
        // end the abandoned wait.
        tokio::time::timeout(Duration::from_secs(1), conn.query_one("SELECT 1", &[]))
            .await
            .expect("a pooled connection was still waiting for the advisory lock")
            .unwrap();
    }
    held.rollback().await.unwrap();
}

/// A job at the last generation: the holder's retry keeps it; anyone else's claim, once the
/// lease is over, is refused as exhausted (HTTP 400 `bad-request`), not a broken CHECK
/// constraint answered as a store failure ("outcome unknown"). Forgetting keeps it: had the
/// floor risen to it, every later claim of any job would have broken the CHECK.
#[tokio::test]
async fn a_job_at_the_last_generation_is_exhausted_not_a_store_failure() {
    let store = fresh().await.unwrap();
    let (j, a, b): (JobId, Owner, Owner) = (
        "j".parse().unwrap(),
        "a".parse().unwrap(),
        "b".parse().unwrap(),
    );
    let key = crate::new_lease_key().unwrap();
    let ttl = Ttl::from_millis(10_000).unwrap();
    granted(store.claim(&j, &a, &key, ttl).await.unwrap());
    let conn = store.pool.get().await.unwrap();
    let last = format!(
        "UPDATE {} SET generation = {} WHERE job = 'j'",
        store.table.qualified(),
        u64::MAX
    );
    conn.execute(&last, &[]).await.unwrap();
    assert_eq!(
        granted(store.claim(&j, &a, &key, ttl).await.unwrap()),
        Generation::new(u64::MAX),
        "the holder's retry keeps its generation"
    );
    assert!(matches!(
        store.claim(&j, &b, &key, ttl).await.unwrap(),
        Outcome::Held { .. }
    ));
    store.shift_clock_ms(20_000);
    for who in [&b, &a] {
        match store.claim(&j, who, &key, ttl).await {
            Err(StoreError::GenerationExhausted(job)) => assert_eq!(job, j),
            other => panic!("{who}'s claim at the last generation: {other:?}"),
        }
    }
    store.shift_clock_ms(3_600_000);
    store.forget_idle(Duration::ZERO, 100).await.unwrap();
    assert!(
        store.get(&j).await.unwrap().is_some(),
        "the exhausted job was forgotten"
    );
    let other: JobId = "other".parse().unwrap();
    assert_eq!(
        granted(store.claim(&other, &b, &key, ttl).await.unwrap()),
        Generation::new(1),
        "a new job after forgetting starts above the floor, not at its end"
    );
}

/// A listing filtered by state pages through a table of more than MAX_LIST_SCAN jobs to the
/// end: a page that scanned its rows and matched none still names where the next starts,
/// and the one held job after them is found.
#[tokio::test]
async fn a_filtered_listing_past_the_scan_limit_goes_on_to_the_end() {
    let store = fresh().await.unwrap();
    let conn = store.pool.get().await.unwrap();
    let fill = format!(
        "INSERT INTO {} (job, owner, generation, lease_until_ms, completed, changed_ms)
         SELECT 'j' || lpad(n::text, 5, '0'), NULL, 1, 0, false, 0
         FROM generate_series(0, {}) AS n",
        store.table.qualified(),
        MAX_LIST_SCAN - 1
    );
    conn.execute(&fill, &[]).await.unwrap();
    let last: JobId = format!("j{MAX_LIST_SCAN:05}").parse().unwrap();
    let key = crate::new_lease_key().unwrap();
    let owner: Owner = "a".parse().unwrap();
    granted(
        store
            .claim(&last, &owner, &key, Ttl::DEFAULT)
            .await
            .unwrap(),
    );
    let mut query = ListQuery {
        state: Some(LeaseState::Held),
        ..ListQuery::default()
    };
    let mut found = Vec::new();
    for _ in 0..10 {
        let page = store.list(&query).await.unwrap();
        found.extend(page.leases.into_iter().map(|r| r.job));
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    assert_eq!(found, vec![last]);
}
