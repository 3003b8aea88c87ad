//! gRPC with real tonic clients and servers over loopback (contract section 9): `FenceLayer`
//! on `tonic::transport::Server`, `FencingLayer` on a tonic `Channel` under a generated
//! client. The seed's worked example, the section 9 mapping as a tonic client sees it,
//! replay of a stored answer, malformed metadata, a streaming call fenced at its start, and
//! a lost lease refusing to send.

use std::{sync::Arc, time::Duration};

use fence_core::{
    JobId,
    signing::{TokenSigner, TokenVerifier},
};
use fence_lease::{LeaseClient, LeaseLost, ManualClock, MemoryLeaseStore, Ttl};
use fence_sink::{FenceLayer, GenerationStore, IdempotencyStore, MemoryStore};
use fence_suite::ledger::{
    Books,
    proto::{ChargeRequest, ledger_client::LedgerClient, ledger_server::LedgerServer},
};
use tonic::{
    Code, Request, Status,
    codegen::tokio_stream::wrappers::ReceiverStream,
    service::Routes,
    transport::{Channel, Server, server::TcpIncoming},
};
use tower::ServiceBuilder;

/// Serves the ledger behind `layer` on a loopback port; returns a channel to it and the books.
async fn serve<St>(layer: FenceLayer<St>) -> (Channel, Books)
where
    St: GenerationStore + IdempotencyStore,
{
    // A charge to the account `held` waits until the test lets it go.
    let books = Books::holding();
    let routes = Routes::new(LedgerServer::new(books.clone()));
    let server = Server::builder().layer(layer).add_routes(routes);
    (
        listen(|incoming| server.serve_with_incoming(incoming)).await,
        books,
    )
}

/// Runs the server `serve` makes on a loopback port; returns a channel to it.
async fn listen<F, Fut>(serve: F) -> Channel
where
    F: FnOnce(TcpIncoming) -> Fut,
    Fut: std::future::Future + Send + 'static,
    Fut::Output: Send,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(TcpIncoming::from(listener)));
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn charge(account: &str) -> ChargeRequest {
    ChargeRequest {
        account: account.into(),
        amount_cents: 4200,
    }
}

/// A unary call with `metadata` (name, value; `-bin` names as binary), without a lease.
async fn call(
    channel: &Channel,
    metadata: &[(&'static str, &str)],
    account: &str,
) -> Result<u64, Status> {
    let mut request = Request::new(charge(account));
    for (name, value) in metadata {
        if name.ends_with("-bin") {
            request.metadata_mut().append_bin(
                *name,
                tonic::metadata::MetadataValue::from_bytes(value.as_bytes()),
            );
        } else {
            request.metadata_mut().append(*name, value.parse().unwrap());
        }
    }
    let mut client = LedgerClient::new(channel.clone());
    client.charge(request).await.map(|r| r.into_inner().entry)
}

fn meta<'a>(status: &'a Status, name: &str) -> Option<&'a str> {
    status.metadata().get(name).and_then(|v| v.to_str().ok())
}

/// [`call`] with the fencing metadata of `job` at `token`.
async fn fenced_call(
    channel: &Channel,
    job: &str,
    token: &str,
    account: &str,
) -> Result<u64, Status> {
    call(
        channel,
        &[("x-fencing-job", job), ("x-fencing-token", token)],
        account,
    )
    .await
}

fn assert_problem(result: Result<u64, Status>, code: Code, problem: &str) -> Status {
    let status = result.expect_err("the fence refuses this call");
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(
        meta(&status, "fence-problem-type"),
        Some(problem),
        "{status:?}"
    );
    assert!(
        !status.message().is_empty(),
        "grpc-message carries the detail"
    );
    status
}

/// The seed's worked example over gRPC: A (generation 7) charges, stalls past its lease; B
/// (generation 8) charges; A's delayed call is ABORTED with `fence-highest: 8` and never
/// booked, and A's client, its lease lost, refuses to send at all.
#[tokio::test]
async fn worked_example_over_grpc() {
    let (channel, books) = serve(FenceLayer::new(MemoryStore::new())).await;
    let clock = ManualClock::new(1_700_000_000_000);
    let store = Arc::new(MemoryLeaseStore::with_clock(Arc::new(clock.clone())));
    let job: JobId = "invoice-42".parse().unwrap();
    let ttl = Ttl::from_millis(2_000).unwrap();
    // Six earlier holders: A's claim is the seventh.
    for _ in 0..6 {
        let lease = LeaseClient::from_arc(store.clone())
            .claim(job.clone())
            .await
            .unwrap();
        lease.release().await.unwrap();
    }
    let a = LeaseClient::from_arc(store.clone())
        .owner("a".parse().unwrap())
        .ttl(ttl);
    let lease_a = a.claim(job.clone()).await.unwrap();
    assert_eq!(lease_a.generation().get(), 7);
    let fenced = |lease: &fence_lease::Lease<MemoryLeaseStore>| {
        LedgerClient::new(
            ServiceBuilder::new()
                .layer(lease.fencing_layer())
                .service(channel.clone()),
        )
    };
    let mut client_a = fenced(&lease_a);
    client_a.charge(charge("a")).await.unwrap();

    // A stalls; the store's clock passes its lease; B claims generation 8 and charges.
    clock.advance(Duration::from_secs(10));
    let b = LeaseClient::from_arc(store.clone())
        .owner("b".parse().unwrap())
        .ttl(ttl);
    let lease_b = b.claim(job.clone()).await.unwrap();
    assert_eq!(lease_b.generation().get(), 8);
    fenced(&lease_b).charge(charge("b")).await.unwrap();

    // A's call, stamped before the stall and delayed in the network.
    let late = fenced_call(&channel, "invoice-42", "7", "a").await;
    let status = assert_problem(late, Code::Aborted, "urn:fence:stale-token");
    assert_eq!(meta(&status, "fence-highest"), Some("8"));

    // A's own client: its lease is lost (the renewal fails), so it does not send; the
    // status says why, and its source is the LeaseLost error.
    tokio::time::timeout(Duration::from_secs(5), lease_a.lost())
        .await
        .expect("A learns it lost the lease");
    let refused = tokio::time::timeout(Duration::from_secs(5), client_a.charge(charge("a")))
        .await
        .expect("a refusal, not a hang")
        .unwrap_err();
    assert!(
        refused.message().contains("lease on job invoice-42"),
        "{refused:?}"
    );
    let source = std::error::Error::source(&refused).expect("the cause is kept");
    assert!(source.downcast_ref::<LeaseLost>().is_some(), "{source:?}");

    let booked: Vec<_> = books.entries().into_iter().map(|e| e.token).collect();
    assert_eq!(
        booked,
        [Some("7".into()), Some("8".into())],
        "A's late call never booked"
    );
}

/// Every answer of the section 9 mapping that a tonic client can be made to see here.
#[tokio::test]
async fn the_section_9_mapping_as_a_tonic_client_sees_it() {
    let signer = TokenSigner::from_seed([5; 32]);
    let verifier = TokenVerifier::new([signer.verify_key()]);
    let layer = FenceLayer::new(MemoryStore::new())
        .require_signatures(verifier)
        .clock_skew(Duration::from_secs(1));
    let (channel, books) = serve(layer).await;
    let job: JobId = "j".parse().unwrap();
    let far = fence_storage::clock::system_now_ms() + 3_600_000; // within the longest lease
    let signed = |g: u64, until: u64| signer.sign(&job, fence_core::Generation::new(g), until);
    let with = |token: &str| {
        [("x-fencing-job", "j"), ("x-fencing-token", token)].map(|(n, v)| (n, v.to_owned()))
    };
    let send = |metadata: Vec<(&'static str, String)>| {
        let channel = channel.clone();
        async move {
            let m: Vec<(&'static str, &str)> =
                metadata.iter().map(|(n, v)| (*n, v.as_str())).collect();
            call(&channel, &m, "x").await
        }
    };

    assert_eq!(send(with(&signed(8, far)).to_vec()).await.unwrap(), 1);
    let stale = send(with(&signed(7, far)).to_vec()).await;
    assert_eq!(
        meta(
            &assert_problem(stale, Code::Aborted, "urn:fence:stale-token"),
            "fence-highest"
        ),
        Some("8")
    );
    let expired = send(with(&signed(9, 1_000)).to_vec()).await;
    assert_problem(expired, Code::Aborted, "urn:fence:token-expired");
    let missing = send(vec![]).await;
    assert_problem(missing, Code::FailedPrecondition, "urn:fence:missing-token");
    let forged = send(with(&format!("9.{far}.{}", "A".repeat(86))).to_vec()).await;
    assert_problem(
        forged,
        Code::PermissionDenied,
        "urn:fence:invalid-signature",
    );
    let plain = send(with("9").to_vec()).await;
    assert_problem(plain, Code::PermissionDenied, "urn:fence:invalid-signature");

    // Malformed metadata: a token that is not one, one repeated, empty, and binary
    // (`-bin`) metadata named like ours. Never a panic, never a call that passes.
    let token = signed(9, far);
    for bad in [
        vec![
            ("x-fencing-job", "j".to_owned()),
            ("x-fencing-token", "seven".to_owned()),
        ],
        vec![
            ("x-fencing-job", "j".to_owned()),
            ("x-fencing-token", token.clone()),
            ("x-fencing-token", token.clone()),
        ],
        vec![
            ("x-fencing-job", "j".to_owned()),
            ("x-fencing-token", String::new()),
        ],
        vec![
            ("x-fencing-job", String::new()),
            ("x-fencing-token", token.clone()),
        ],
        vec![
            ("x-fencing-job", "j".to_owned()),
            ("x-fencing-token-bin", token.clone()),
        ],
        vec![
            ("x-fencing-job-bin", "j".to_owned()),
            ("x-fencing-token", token.clone()),
        ],
        vec![
            ("x-fencing-job", "j".to_owned()),
            ("x-fencing-token", token.clone()),
            ("idempotency-key", "has space".to_owned()),
        ],
    ] {
        let result = send(bad.clone()).await;
        let status = result.expect_err("malformed metadata is refused");
        assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}: {status:?}");
    }

    // Idempotency: the same key with another request is FAILED_PRECONDITION.
    let mut keyed = with(&signed(9, far)).to_vec();
    keyed.push(("idempotency-key", "charge-once".to_owned()));
    let first = send(keyed.clone()).await.unwrap();
    assert_eq!(
        send(keyed.clone()).await.unwrap(),
        first,
        "replayed, not booked again"
    );
    let mismatch = {
        let m: Vec<(&'static str, &str)> = keyed.iter().map(|(n, v)| (*n, v.as_str())).collect();
        call(&channel, &m, "another account").await
    };
    assert_problem(
        mismatch,
        Code::FailedPrecondition,
        "urn:fence:idempotency-key-mismatch",
    );
    assert_eq!(
        books.entries().len(),
        2,
        "only the two accepted charges were booked"
    );
}

/// A store that cannot be reached (a PostgreSQL port nobody listens on): UNAVAILABLE.
#[tokio::test]
async fn an_unreachable_store_is_unavailable() {
    use fence_sink::postgres::{PgStore, PgTables};
    let down = PgStore::connect("postgres://postgres@127.0.0.1:9/test", PgTables::default())
        .await
        .unwrap();
    let (channel, books) = serve(FenceLayer::new(down).store_timeout(Duration::from_secs(2))).await;
    let result = fenced_call(&channel, "j", "3", "x").await;
    assert_problem(result, Code::Unavailable, "urn:fence:store-unavailable");
    assert!(books.entries().is_empty());
}

/// A client stream is fenced when the call starts: the whole stream runs under the token
/// it started with, and a newer token waits for it (at most the drain limit: UNAVAILABLE
/// `drain-timeout` beyond). A stream that outlives its lease is not cut by the fence; the
/// newer holder's first call is what waits for it.
#[tokio::test]
async fn a_client_stream_is_fenced_at_its_start_and_a_newer_token_waits_for_it() {
    let layer = FenceLayer::new(MemoryStore::new()).drain_timeout(Duration::from_millis(300));
    let (channel, books) = serve(layer.clone()).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut request = Request::new(ReceiverStream::new(rx));
    request
        .metadata_mut()
        .insert("x-fencing-job", "s".parse().unwrap());
    request
        .metadata_mut()
        .insert("x-fencing-token", "1".parse().unwrap());
    let stream = {
        let mut client = LedgerClient::new(channel.clone());
        tokio::spawn(async move { client.charge_many(request).await })
    };
    tx.send(charge("s1")).await.unwrap();
    // Until the fence admitted the stream (a guessed delay may be too short on a loaded
    // machine, and token 2 would then come first and pass).
    let job: JobId = "s".parse().unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while layer.job(&job).await.unwrap().in_flight != 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the stream of token 1 is admitted");
    // Token 2 arrives while the stream of token 1 is open: it waits, then gives up.
    let newer = fenced_call(&channel, "s", "2", "n").await;
    assert_problem(newer, Code::Unavailable, "urn:fence:drain-timeout");
    // The open stream goes on under token 1 and is booked when it ends.
    tx.send(charge("s2")).await.unwrap();
    drop(tx);
    let reply = stream.await.unwrap().unwrap().into_inner();
    assert_eq!(reply.booked, 2);
    // Now token 2 passes, and token 1 is stale.
    let newer = fenced_call(&channel, "s", "2", "n").await;
    assert!(newer.is_ok(), "{newer:?}");
    let old = fenced_call(&channel, "s", "1", "o").await;
    assert_problem(old, Code::Aborted, "urn:fence:stale-token");
    let tokens: Vec<_> = books
        .entries()
        .into_iter()
        .map(|e| e.token.unwrap())
        .collect();
    assert_eq!(tokens, ["1", "1", "2"]);
}

/// The layer on one routed service rather than the whole server: the ledger's routes are
/// fenced (through tonic's axum router), and the server serves them like any other.
#[tokio::test]
async fn the_layer_on_a_routed_service() {
    let books = Books::default();
    let fenced: axum::Router = Routes::new(LedgerServer::new(books.clone()))
        .into_axum_router()
        .layer(FenceLayer::new(MemoryStore::new()));
    let server = Server::builder().add_routes(Routes::from(fenced));
    let channel = listen(|incoming| server.serve_with_incoming(incoming)).await;
    let at = |token: &'static str| [("x-fencing-job", "r"), ("x-fencing-token", token)];
    assert_eq!(call(&channel, &at("5"), "a").await.unwrap(), 1);
    assert_problem(
        call(&channel, &at("4"), "b").await,
        Code::Aborted,
        "urn:fence:stale-token",
    );
    assert_problem(
        call(&channel, &[], "c").await,
        Code::FailedPrecondition,
        "urn:fence:missing-token",
    );
    assert_eq!(books.entries().len(), 1);
}

/// The two rows that need a call in flight or a stalled stream: the same idempotency key
/// while its first call still runs is ABORTED (`idempotency-in-flight`), and a keyed client
/// stream that stalls past the body deadline is DEADLINE_EXCEEDED (`body-timeout`).
#[tokio::test]
async fn in_flight_keys_and_stalled_keyed_streams() {
    let layer = FenceLayer::new(MemoryStore::new()).body_timeout(Duration::from_millis(300));
    let (channel, books) = serve(layer).await;
    let keyed = [
        ("x-fencing-job", "k"),
        ("x-fencing-token", "1"),
        ("idempotency-key", "slow-charge"),
    ];
    // The first call runs until the test lets it go: at the service (its record begun,
    // since the service is called only after that), as long as the second takes to come.
    let first = {
        let channel = channel.clone();
        tokio::spawn(async move { call(&channel, &keyed, "held").await })
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while books.reached() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the first call reaches the service");
    let again = tokio::time::timeout(Duration::from_secs(10), call(&channel, &keyed, "held"))
        .await
        .expect("an answer at once: the fence's, not the held service's");
    assert_problem(again, Code::Aborted, "urn:fence:idempotency-in-flight");
    books.release_held();
    assert_eq!(
        first.await.unwrap().unwrap(),
        1,
        "the first call finishes, booked once"
    );

    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let mut request = Request::new(ReceiverStream::new(rx));
    let m = request.metadata_mut();
    m.insert("x-fencing-job", "k".parse().unwrap());
    m.insert("x-fencing-token", "1".parse().unwrap());
    m.insert("idempotency-key", "stalled-stream".parse().unwrap());
    tx.send(charge("s1")).await.unwrap();
    let mut client = LedgerClient::new(channel.clone());
    let stalled = tokio::time::timeout(Duration::from_secs(5), client.charge_many(request))
        .await
        .expect("an answer, not a hang")
        .unwrap_err();
    assert_eq!(stalled.code(), Code::DeadlineExceeded, "{stalled:?}");
    drop(tx);
    assert_eq!(
        books.entries().len(),
        1,
        "the stalled stream booked nothing"
    );
}
