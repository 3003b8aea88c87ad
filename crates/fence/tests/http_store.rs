//! `HttpLeaseStore` against a real `fence server` router on loopback: the lease conformance
//! suite (the server signs tokens, as a revoke's answer says its lease's end only in its
//! token), and the Lease handle over HTTP.

mod common;

use std::{sync::Arc, time::Duration};

use fence_lease::{
    HttpLeaseStore, LeaseClient, ManualClock, SledLeaseStore, Ttl, conformance::advance_fn,
};

async fn serve(clock: ManualClock) -> String {
    let dir = tempfile::tempdir().unwrap().keep();
    let store = SledLeaseStore::open_with_clock(dir, Arc::new(clock)).unwrap();
    let signer = fence_core::signing::TokenSigner::from_seed([3; 32]);
    let store = Arc::new(fence_lease::SigningLeaseStore::new(store, signer));
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

/// A lease whose server becomes unreachable (the network to it is cut) is lost at its local
/// deadline, send time + TTL - margin, measured from the last renewal that succeeded: not
/// earlier (the failed renewals do not end it) and not much later (the keeper does not wait
/// for a failed call to time out first). A client of a server that never answered cannot
/// claim at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_ends_the_lease_at_its_local_deadline() {
    let clock = ManualClock::new(1_700_000_000_000);
    let relay = common::Relay::to(&serve(clock).await);
    let client = LeaseClient::new(
        HttpLeaseStore::new(&relay.url)
            .unwrap()
            .timeout(Duration::from_secs(5)),
    )
    // 3 s, renewed every second: a renewal late by a few hundred ms on a loaded machine does
    // not lose it before the cut; held past one TTL, it was renewed.
    .ttl(Ttl::from_millis(3_000).unwrap());
    let lease = client.claim("remote".parse().unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert!(lease.token().is_some(), "renewals over HTTP keep it");
    relay.cut();
    let deadline = lease.deadline();
    let waited = tokio::time::timeout(Duration::from_secs(10), lease.lost()).await;
    assert!(
        waited.is_ok(),
        "never lost although the server is unreachable"
    );
    let lost_at = tokio::time::Instant::now();
    assert!(
        lost_at + Duration::from_millis(5) >= deadline,
        "lost {:?} before its deadline",
        deadline - lost_at
    );
    // Well before the 5 s request timeout, which is what a client that waited for its
    // renewal to fail (instead of its deadline) would take; the slack is for a loaded machine.
    assert!(
        lost_at <= deadline + Duration::from_millis(1_500),
        "lost {:?} after its deadline",
        lost_at - deadline
    );
    // A client pointed at a closed port cannot claim at all.
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

/// A semaphore grant other than what was asked (here slot 3 when 2 slots were asked, from
/// a server that does not follow the contract) is a protocol error, as the Go, Python and
/// TypeScript clients take it: not a third holder of a semaphore of two.
#[tokio::test]
async fn a_slot_grant_past_the_slots_asked_is_refused() {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { continue };
            let mut reader = BufReader::new(client.try_clone().unwrap());
            let mut length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((name, value)) = line.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    length = value.trim().parse().unwrap();
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let answer = r#"{"job":"exports#3","owner":"w","generation":1,"ttl_ms":30000,"expires_at_ms":1,"resource":"exports","slot":3,"slots":2}"#;
            let _ = write!(
                client,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    let store = HttpLeaseStore::new(&url).unwrap();
    let owner: fence_core::Owner = "w".parse().unwrap();
    let key = fence_lease::new_lease_key().unwrap();
    let terms = fence_lease::ClaimTerms::from(Ttl::from_millis(30_000).unwrap());
    let got = fence_lease::LeaseStore::claim_slot(
        &store,
        &"exports".parse().unwrap(),
        &owner,
        &key,
        terms,
        2,
    )
    .await;
    assert!(
        matches!(&got, Err(fence_lease::StoreError::Protocol(why)) if why.contains("slot 3")),
        "{got:?}"
    );
}
