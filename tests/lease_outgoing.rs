//! The FencingLayer over hyper-util's legacy Client against a real HTTP server: headers
//! arrive while the lease is held, and nothing is sent once it is lost.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use fence_lease::{
    LeaseClient, LeaseLost, LeaseStore, LossReason, ManualClock, MemoryLeaseStore, Ttl,
};
use http_body_util::Empty;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower::{Service, ServiceBuilder, ServiceExt};

#[tokio::test]
async fn legacy_client_sends_fencing_headers_until_the_lease_is_lost() {
    let (addr, mut seen) = fence_suite::spawn_echo_server().await.unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryLeaseStore::with_clock(Arc::new(clock.clone()));
    let client = LeaseClient::new(store.clone()).ttl(Ttl::from_millis(1_000).unwrap());
    let lease = client.claim("job-9".parse().unwrap()).await.unwrap();
    let mut http = ServiceBuilder::new()
        .layer(lease.fencing_layer())
        .service(Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>());
    let url = format!("http://{addr}/effect");

    for _ in 0..3 {
        let response = http
            .ready()
            .await
            .unwrap()
            .call(http::Request::post(&url).body(Empty::new()).unwrap())
            .await;
        assert_eq!(response.unwrap().status(), 200);
        let s = seen.recv().await.unwrap();
        assert_eq!(
            (s.job.as_deref(), s.token.as_deref()),
            (Some("job-9"), Some("1"))
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    // 1.2 s after the claim, past a 1 s lease: only renewals can have kept it.
    assert!(!lease.is_lost(), "renewals keep the lease across its ttl");

    // The store's clock runs ahead and another worker claims: the next renewal is refused.
    clock.advance(Duration::from_secs(2));
    let (job, other) = ("job-9".parse().unwrap(), "other".parse().unwrap());
    let key = fence_lease::new_lease_key().unwrap();
    let claimed = store.claim(&job, &other, &key, Ttl::DEFAULT).await.unwrap();
    assert!(matches!(claimed, fence_lease::Outcome::Granted(_)));
    tokio::time::timeout(Duration::from_secs(2), lease.lost())
        .await
        .expect("lost within the ttl");

    let err = http
        .ready()
        .await
        .unwrap()
        .call(http::Request::post(&url).body(Empty::new()).unwrap())
        .await
        .unwrap_err();
    let lost = err.downcast_ref::<LeaseLost>().expect("LeaseLost");
    assert!(
        matches!(lost.reason, LossReason::Superseded { .. }),
        "{lost}"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        seen.try_recv().is_err(),
        "the server must not have seen the refused request"
    );
}

/// hyper's client does nothing until its future is polled: a request handed over while the
/// lease was held and polled after it was lost is refused then, and never reaches the server.
#[tokio::test]
async fn a_request_handed_over_before_the_loss_and_polled_after_it_is_not_sent() {
    let (addr, mut seen) = fence_suite::spawn_echo_server().await.unwrap();
    let client = LeaseClient::new(MemoryLeaseStore::new());
    let lease = client.claim("job-10".parse().unwrap()).await.unwrap();
    let mut http = ServiceBuilder::new()
        .layer(lease.fencing_layer())
        .service(Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>());
    let url = format!("http://{addr}/effect");
    let pending = http
        .ready()
        .await
        .unwrap()
        .call(http::Request::post(&url).body(Empty::new()).unwrap());
    let view = lease.view();
    lease.release().await.unwrap();
    assert!(view.is_lost());
    let err = pending.await.unwrap_err();
    let lost = err.downcast_ref::<LeaseLost>().expect("a LeaseLost error");
    assert!(lost.handed_over, "{lost}");
    assert!(
        lost.to_string().starts_with("not sent by this layer"),
        "{lost}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(seen.try_recv().is_err(), "the server saw the request");
}

/// A request still waiting for its connection when the lease is lost (a slow connect, a full
/// pool) is cut then, says it was on its way, and never reaches the server: it had not left
/// the process.
#[tokio::test]
async fn a_request_still_connecting_when_the_lease_is_lost_is_cut_and_never_sent() {
    let (addr, mut seen) = fence_suite::spawn_echo_server().await.unwrap();
    let client = LeaseClient::new(MemoryLeaseStore::new());
    let lease = client.claim("job-11".parse().unwrap()).await.unwrap();
    // A connect that takes 600 ms.
    let slow = tower::service_fn(|uri: http::Uri| {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(600)).await;
            hyper_util::client::legacy::connect::HttpConnector::new()
                .call(uri)
                .await
        })
    });
    let mut http = ServiceBuilder::new()
        .layer(lease.fencing_layer())
        .service(Client::builder(TokioExecutor::new()).build::<_, Empty<Bytes>>(slow));
    let url = format!("http://{addr}/effect");
    let pending = tokio::spawn(
        http.ready()
            .await
            .unwrap()
            .call(http::Request::post(&url).body(Empty::new()).unwrap()),
    );
    // Polled and connecting, then lost.
    tokio::time::sleep(Duration::from_millis(100)).await;
    lease.release().await.unwrap();
    let err = tokio::time::timeout(Duration::from_millis(400), pending)
        .await
        .expect("not cut at the loss: it waited for its connection")
        .unwrap()
        .expect_err("a request cut by the loss got an answer");
    let lost = err.downcast_ref::<LeaseLost>().expect("a LeaseLost error");
    assert!(lost.in_flight && lost.handed_over, "{lost}");
    assert!(
        lost.to_string().starts_with("cut before its answer came"),
        "{lost}"
    );
    // Past the connect: the request was never written.
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(
        seen.try_recv().is_err(),
        "the request reached the server after the lease was lost"
    );
}

/// The cut drops the inner future at once, not when the caller drops the response future:
/// a caller that keeps it (a `select!` over `&mut fut`, say) does not keep the request's
/// connection wait, or a pool's checkout, alive with it.
#[tokio::test]
async fn the_cut_drops_the_inner_future_at_once() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    struct Dropped(Arc<AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let lease = LeaseClient::new(MemoryLeaseStore::new())
        .claim("job-12".parse().unwrap())
        .await
        .unwrap();
    let flag = dropped.clone();
    // A request that waits for ever (a connection that never comes).
    let waiting = tower::service_fn(move |_req: http::Request<()>| {
        let guard = Dropped(flag.clone());
        async move {
            let _guard = guard;
            std::future::pending::<Result<http::Response<()>, std::convert::Infallible>>().await
        }
    });
    let mut http = ServiceBuilder::new()
        .layer(lease.fencing_layer())
        .service(waiting);
    let mut fut = std::pin::pin!(http.ready().await.unwrap().call(http::Request::new(())));
    let pending =
        std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx).is_pending()));
    assert!(pending.await, "answered without an answer");
    lease.release().await.unwrap();
    let err = fut.as_mut().await.unwrap_err();
    assert!(
        err.downcast_ref::<LeaseLost>().is_some_and(|l| l.in_flight),
        "{err}"
    );
    assert!(
        dropped.load(SeqCst),
        "the inner future lives on inside the finished response future"
    );
}

/// What the destination saw of one streamed body.
#[derive(Debug, PartialEq)]
enum BodyEvent {
    Chunk(Vec<u8>),
    Ended,
    Failed,
}

/// A server that reports each body frame as it arrives, and how the body ended.
async fn spawn_body_recorder() -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<BodyEvent>,
) {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let tx = tx.clone();
                        async move {
                            let mut body = req.into_body();
                            let end = loop {
                                match body.frame().await {
                                    Some(Ok(frame)) => {
                                        if let Ok(data) = frame.into_data() {
                                            let _ = tx.send(BodyEvent::Chunk(data.to_vec()));
                                        }
                                    }
                                    Some(Err(_)) => break BodyEvent::Failed,
                                    None => break BodyEvent::Ended,
                                }
                            };
                            let _ = tx.send(end);
                            Ok::<_, std::convert::Infallible>(http::Response::new(
                                Empty::<Bytes>::new(),
                            ))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, rx)
}

/// A body whose frames the test sends; it ends when the sender is dropped.
struct Frames(tokio::sync::mpsc::UnboundedReceiver<Bytes>);

impl hyper::body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(hyper::body::Frame::data(b))))
    }
}

/// The destination's next report, within 5 s.
async fn next(events: &mut tokio::sync::mpsc::UnboundedReceiver<BodyEvent>) -> Option<BodyEvent> {
    tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .expect("the destination reports within 5 s")
}

/// An upload streamed under a lease, its body wrapped with `fence_body`, stops at the loss:
/// the destination gets what was sent before and then a body that never completes, not the
/// rest of the upload followed by a clean end it would commit.
#[tokio::test]
async fn a_fenced_body_stops_flowing_when_the_lease_is_lost() {
    let (addr, mut events) = spawn_body_recorder().await;
    let lease = LeaseClient::new(MemoryLeaseStore::new())
        .claim("upload-1".parse().unwrap())
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut http = ServiceBuilder::new().layer(lease.fencing_layer()).service(
        Client::builder(TokioExecutor::new()).build_http::<fence_lease::FencedBody<Frames>>(),
    );
    let request = http::Request::post(format!("http://{addr}/upload"))
        .body(lease.view().fence_body(Frames(rx)))
        .unwrap();
    let call = tokio::spawn(http.ready().await.unwrap().call(request));

    tx.send(Bytes::from_static(b"first")).unwrap();
    assert_eq!(
        next(&mut events).await,
        Some(BodyEvent::Chunk(b"first".to_vec()))
    );
    lease.release().await.unwrap();
    tx.send(Bytes::from_static(b"second")).unwrap();
    drop(tx); // unfenced, the body would now end cleanly
    assert_eq!(next(&mut events).await, Some(BodyEvent::Failed));
    call.await
        .unwrap()
        .expect_err("the upload was cut short, not answered");
}
