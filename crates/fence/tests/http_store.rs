//! `HttpLeaseStore` against a real `fence server` router on loopback: the lease conformance
//! suite, and the Lease handle over HTTP.

use std::{sync::Arc, time::Duration};

use fence_lease::{
    HttpLeaseStore, LeaseClient, ManualClock, SledLeaseStore, Ttl, conformance::advance_fn,
};

async fn serve(clock: ManualClock) -> String {
    let dir = tempfile::tempdir().unwrap().keep();
    let store = Arc::new(SledLeaseStore::open_with_clock(dir, Arc::new(clock)).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            fence::server::router(store, fence::server::ServerOptions::default()),
        )
        .await
    });
    format!("http://{addr}")
}

fence_lease::lease_store_conformance!(|| async {
    let clock = ManualClock::new(1_700_000_000_000);
    let url = serve(clock.clone()).await;
    Some((HttpLeaseStore::new(&url).unwrap(), advance_fn(clock)))
});

#[tokio::test]
async fn unreachable_server_counts_toward_the_deadline() {
    let clock = ManualClock::new(1_700_000_000_000);
    let url = serve(clock).await;
    let client = LeaseClient::new(
        HttpLeaseStore::new(&url)
            .unwrap()
            .timeout(Duration::from_secs(1)),
    )
    .ttl(Ttl::from_millis(600).unwrap());
    let lease = client.claim("remote".parse().unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(lease.token().is_some(), "renewals over HTTP keep it");
    // A client pointed at a closed port: every renewal fails, and the deadline still governs.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let store = HttpLeaseStore::new(&dead).unwrap();
    let err = LeaseClient::new(store)
        .claim("remote".parse().unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, fence_lease::ClaimError::Store(_)), "{err}");
}
