//! `listen`: notifications reach the listener, and a lost session comes back saying that
//! notices may have been missed (what lets waiting claims on several servers trust it).
#![cfg(feature = "postgres")]

use std::time::Duration;

use fence_storage::{
    Notice,
    postgres::{connect_pool, listen, test_database_url},
};
use tokio::sync::broadcast::Receiver;

async fn next(rx: &mut Receiver<Notice>) -> Notice {
    tokio::time::timeout(Duration::from_secs(15), rx.recv())
        .await
        .expect("a notice within 15 s")
        .expect("the listener is running")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_arrive_and_a_lost_session_says_it_may_have_missed_some() {
    let url = test_database_url();
    let channel = format!("fence_listen_test_{}", std::process::id());
    let listener = listen(&url, &channel).unwrap();
    let mut rx = listener.subscribe();
    assert_eq!(next(&mut rx).await, Notice::Missed, "a new session says so");
    let pool = connect_pool(&url).unwrap();
    let db = pool.get().await.unwrap();
    let notify = format!("SELECT pg_notify('{channel}', 'job-1')");
    db.execute(&notify, &[]).await.unwrap();
    assert_eq!(next(&mut rx).await, Notice::Payload("job-1".into()));

    // The listening session is cut, as by a database restart or a dropped connection.
    let cut = db
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = $1",
            &[&format!("LISTEN \"{channel}\"")],
        )
        .await
        .unwrap();
    assert_eq!(cut, 1, "one listening session to cut");
    assert_eq!(next(&mut rx).await, Notice::Lost, "the loss is said");
    assert_eq!(
        next(&mut rx).await,
        Notice::Missed,
        "back, and saying notices may have gone unheard"
    );
    db.execute(&notify.replace("job-1", "job-2"), &[])
        .await
        .unwrap();
    assert_eq!(next(&mut rx).await, Notice::Payload("job-2".into()));

    // Dropping the listener ends its session.
    drop(listener);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(matches!(
        rx.recv().await,
        Err(tokio::sync::broadcast::error::RecvError::Closed)
    ));
}
