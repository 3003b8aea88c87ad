//! gRPC through `fence proxy` with a real tonic client and server (contract section 9): the
//! proxy speaks HTTP/2 to an h2c upstream, passes trailers and streams, and fences like the
//! layer. A unary call, a client-streaming call, a stale call and a replayed one.

mod common;

use std::time::Duration;

use common::*;
use fence_suite::ledger::{
    Books,
    proto::{ChargeRequest, ledger_client::LedgerClient, ledger_server::LedgerServer},
};
use tonic::{
    Code, Request,
    codegen::tokio_stream,
    transport::{Channel, Server, server::TcpIncoming},
};

fn charge(account: &str) -> ChargeRequest {
    ChargeRequest {
        account: account.into(),
        amount_cents: 100,
    }
}

fn fenced<T>(message: T, job: &str, token: &str) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("x-fencing-job", job.parse().unwrap());
    request
        .metadata_mut()
        .insert("x-fencing-token", token.parse().unwrap());
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_and_client_streaming_calls_through_the_proxy() {
    // The upstream: the ledger over h2c.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let books = Books::default();
    let service = LedgerServer::new(books.clone());
    tokio::spawn(async move {
        Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
    });
    let dir = tempfile::tempdir().unwrap();
    let (_proxy, addr) = tokio::task::spawn_blocking({
        let upstream = upstream.clone();
        let data = dir.path().to_str().unwrap().to_owned();
        move || start_proxy_with(&upstream, &["--data-dir", &data])
    })
    .await
    .unwrap();
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let mut ledger = LedgerClient::new(channel);

    // Unary, fenced at 3.
    let reply = ledger.charge(fenced(charge("u"), "g", "3")).await.unwrap();
    assert_eq!(reply.into_inner().entry, 1);

    // A client stream of three charges at 4: carried both ways, booked when it ends.
    let stream = tokio_stream::iter([charge("s1"), charge("s2"), charge("s3")]);
    let reply = ledger.charge_many(fenced(stream, "g", "4")).await.unwrap();
    let reply = reply.into_inner();
    assert_eq!((reply.booked, reply.entry), (3, 4));

    // A stale unary call: ABORTED from the proxy, with the highest; nothing booked.
    let status = ledger
        .charge(fenced(charge("late"), "g", "3"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert_eq!(
        status
            .metadata()
            .get("fence-highest")
            .and_then(|v| v.to_str().ok()),
        Some("4")
    );
    // No token at all: FAILED_PRECONDITION, from the proxy, not a transport error.
    let status = ledger
        .charge(Request::new(charge("none")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");

    // A retried call with the same idempotency key: the stored answer, trailers and all.
    let keyed = || {
        let mut r = fenced(charge("k"), "g", "4");
        r.metadata_mut()
            .insert("idempotency-key", "charge-k".parse().unwrap());
        r
    };
    let first = ledger.charge(keyed()).await.unwrap();
    let again = ledger.charge(keyed()).await.unwrap();
    assert!(
        again.metadata().get("idempotent-replayed").is_some(),
        "{:?}",
        again.metadata()
    );
    assert_eq!(again.into_inner(), first.into_inner());

    let tokens: Vec<String> = books
        .entries()
        .into_iter()
        .map(|e| e.token.unwrap())
        .collect();
    assert_eq!(
        tokens,
        ["3", "4", "4", "4", "4"],
        "the stale call never reached the ledger"
    );
}

/// A gRPC-typed call to an upstream that speaks only HTTP/1.1 is answered at once (UNAVAILABLE)
/// and is a *known* failure: the upstream never understood a request, so the next holder of
/// the job passes at once instead of waiting out an unknown outcome's hold (issue 31).
#[test]
fn a_grpc_call_to_an_http1_upstream_holds_nobody_up() {
    let upstream = format!("http://{}", start_upstream());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    // A short drain limit: a held slot would show as 503 drain-timeout within a second.
    let (_proxy, addr) =
        start_proxy_with(&upstream, &["--data-dir", &data, "--drain-timeout", "1s"]);
    let (status, answer) = exchange(
        &addr,
        "POST",
        "/ledger.Ledger/Charge",
        &[
            ("X-Fencing-Job", "g".to_owned()),
            ("X-Fencing-Token", "3".to_owned()),
            ("content-type", "application/grpc".to_owned()),
        ],
        "\0\0\0\0\0",
    );
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("grpc-status: 14"), "{answer}");
    assert!(answer.contains("does not speak HTTP/2"), "{answer}");
    // An upstream that closes without a byte (restarting, shedding load) is not said not to
    // speak HTTP/2: it closed the connection.
    let closing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closing_at = format!("http://{}", closing.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in closing.incoming() {
            drop(stream);
        }
    });
    let other = tempfile::tempdir().unwrap();
    let other = other.path().to_str().unwrap().to_owned();
    let (_closing_proxy, closing_addr) = start_proxy_with(&closing_at, &["--data-dir", &other]);
    let (_, closed) = exchange(
        &closing_addr,
        "POST",
        "/ledger.Ledger/Charge",
        &[
            ("X-Fencing-Job", "c".to_owned()),
            ("X-Fencing-Token", "1".to_owned()),
            ("content-type", "application/grpc".to_owned()),
        ],
        "\0\0\0\0\0",
    );
    assert!(closed.contains("grpc-status: 14"), "{closed}");
    assert!(!closed.contains("HTTP/2"), "{closed}");
    assert!(closed.contains("closed or reset"), "{closed}");
    // A held slot would answer 503 drain-timeout after 1 s: the status tells it; the time
    // only bounds it (not 900 ms: a loaded machine's slow answer is not a held slot).
    let started = std::time::Instant::now();
    assert_eq!(fenced_post(&addr, "/effects", "g", "4"), 200);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the newer holder waited {:?}",
        started.elapsed()
    );
}

/// A TCP relay to `target` whose connections open so far can be frozen: they stay open and
/// carry nothing more either way, as a connection to a host that lost power or behind a NAT
/// that forgot it. Connections opened after a freeze relay normally.
struct Relay {
    addr: String,
    frozen: std::sync::Arc<std::sync::atomic::AtomicU64>,
    opened: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Relay {
    async fn start(target: String) -> Self {
        use std::sync::{
            Arc,
            atomic::{AtomicU64, Ordering},
        };
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (frozen, opened) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (f, o) = (frozen.clone(), opened.clone());
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let n = o.fetch_add(1, Ordering::SeqCst) + 1;
                let outbound = tokio::net::TcpStream::connect(&target).await.unwrap();
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                for (mut from, mut to) in [
                    (
                        Box::new(ri) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                        Box::new(wo) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                    ),
                    (Box::new(ro), Box::new(wi)),
                ] {
                    let f = f.clone();
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        while let Ok(read) = from.read(&mut buf).await {
                            if read == 0 {
                                break;
                            }
                            while f.load(Ordering::SeqCst) >= n {
                                // Frozen: hold both sockets, carry nothing.
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            if to.write_all(&buf[..read]).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            }
        });
        Self {
            addr,
            frozen,
            opened,
        }
    }

    /// Freezes every connection opened so far.
    fn freeze(&self) {
        let opened = self.opened.load(std::sync::atomic::Ordering::SeqCst);
        self.frozen
            .store(opened, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A gRPC call that times out retires its client connection's HTTP/2 connection to the upstream: when
/// the upstream went silent without closing it, the next call reaches the upstream on a new
/// connection instead of waiting out the upstream timeout on the dead one, as every later
/// call would until the kernel gives up on the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_times_out_retires_the_upstream_connection() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = listener.local_addr().unwrap().to_string();
    let books = Books::default();
    let service = LedgerServer::new(books.clone());
    tokio::spawn(async move {
        Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
    });
    let relay = Relay::start(target).await;
    let dir = tempfile::tempdir().unwrap();
    let (_proxy, addr) = tokio::task::spawn_blocking({
        let upstream = format!("http://{}", relay.addr);
        let data = dir.path().to_str().unwrap().to_owned();
        move || {
            start_proxy_with(
                &upstream,
                &[
                    "--data-dir",
                    &data,
                    "--workers",
                    "1",
                    "--upstream-timeout",
                    "3s",
                ],
            )
        }
    })
    .await
    .unwrap();
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let mut ledger = LedgerClient::new(channel);
    ledger.charge(fenced(charge("a"), "ka", "1")).await.unwrap();
    let opened = || relay.opened.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(opened(), 1);

    relay.freeze();
    // Sent on the silent connection: DEADLINE_EXCEEDED at the upstream timeout (3 s, room
    // for the first call to open its connection on a loaded machine).
    let lost = tokio::time::timeout(
        Duration::from_secs(10),
        ledger.charge(fenced(charge("b"), "kb", "1")),
    )
    .await
    .expect("the call on the silent connection was not answered at the upstream timeout");
    assert_eq!(lost.unwrap_err().code(), Code::DeadlineExceeded);
    // The next call goes out on a new connection and is answered.
    let started = std::time::Instant::now();
    let next = tokio::time::timeout(
        Duration::from_secs(10),
        ledger.charge(fenced(charge("c"), "kc", "1")),
    )
    .await;
    assert!(
        matches!(next, Ok(Ok(_))),
        "the call after a timeout on the silent connection: {next:?} after {:?}",
        started.elapsed()
    );
    assert_eq!(
        opened(),
        2,
        "the call did not reach the upstream on a new connection"
    );
}

/// An h2c upstream whose gRPC handler for token 3 is dropped at its deadline while a write it
/// sent is still on its way to the database: it answers DEADLINE_EXCEEDED (4, trailers-only)
/// at once, and the write commits 300 ms later. Any other token commits at once and answers
/// OK. Returns the address and the tokens in the order their writes committed.
async fn upstream_that_times_out_a_handler()
-> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use hyper::{body::Incoming, service::service_fn};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let committed = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let books = committed.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let books = books.clone();
            let serve = service_fn(move |request: hyper::Request<Incoming>| {
                let books = books.clone();
                async move {
                    let token = request.headers()["x-fencing-token"]
                        .to_str()
                        .unwrap()
                        .to_owned();
                    let status = if token == "3" {
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            books.lock().unwrap().push(token);
                        });
                        "4"
                    } else {
                        books.lock().unwrap().push(token);
                        "0"
                    };
                    Ok::<_, std::convert::Infallible>(
                        hyper::Response::builder()
                            .header("content-type", "application/grpc")
                            .header("grpc-status", status)
                            .body(http_body_util::Empty::<bytes::Bytes>::new())
                            .unwrap(),
                    )
                }
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), serve),
            );
        }
    });
    (format!("http://{addr}"), committed)
}

/// A call the upstream answers DEADLINE_EXCEEDED (its handler dropped at the call's deadline,
/// a write it sent still on its way) is of unknown outcome, like a 504: the job's newer
/// token waits out the hold, so the writes commit in token order, and a retry of its
/// Idempotency-Key meanwhile is not run a second time (its record stays in flight).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_deadline_exceeded_answer_holds_the_job() {
    let (upstream, committed) = upstream_that_times_out_a_handler().await;
    let dir = tempfile::tempdir().unwrap();
    let (_proxy, addr) = tokio::task::spawn_blocking({
        let data = dir.path().to_str().unwrap().to_owned();
        move || {
            start_proxy_with(
                &upstream,
                &["--data-dir", &data, "--unknown-outcome-hold", "2s"],
            )
        }
    })
    .await
    .unwrap();
    let call = move |token: &str, key: &str| {
        let (addr, token, key) = (addr.clone(), token.to_owned(), key.to_owned());
        tokio::task::spawn_blocking(move || {
            exchange(
                &addr,
                "POST",
                "/ledger.Ledger/Charge",
                &[
                    ("X-Fencing-Job", "slow".to_owned()),
                    ("X-Fencing-Token", token),
                    ("Idempotency-Key", key),
                    ("content-type", "application/grpc".to_owned()),
                ],
                "\0\0\0\0\0",
            )
        })
    };
    let (status, answer) = call("3", "charge-1").await.unwrap();
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("grpc-status: 4"), "{answer}");
    // The retry of the same step is not run again while the first may still commit.
    let (_, retried) = call("3", "charge-1").await.unwrap();
    assert!(
        retried.contains("urn:fence:idempotency-in-flight"),
        "run again: {retried}"
    );
    let started = std::time::Instant::now();
    let (status, newer) = call("4", "charge-2").await.unwrap();
    assert_eq!(status, 200, "{newer}");
    assert!(newer.contains("grpc-status: 0"), "{newer}");
    assert!(
        started.elapsed() >= Duration::from_millis(1_500),
        "the newer token passed after {:?}, while the older call's write was on its way",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        *committed.lock().unwrap(),
        ["3", "4"],
        "writes committed out of token order, or the retry ran again"
    );
}

/// A client connection has at most --h2-max-streams gRPC calls running upstream, those its
/// client reset included: the proxy runs an admitted call to its end, and a client that cut
/// its calls as fast as it made them had any number running upstream. With 8 streams, the
/// calls a client sends while 8 cut ones still run are refused (UNAVAILABLE, overloaded)
/// before they are sent, round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_cut_by_their_client_still_count_upstream() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let books = Books::default();
    let service = LedgerServer::new(books.clone());
    tokio::spawn(async move {
        Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
    });
    let dir = tempfile::tempdir().unwrap();
    let (_proxy, addr) = tokio::task::spawn_blocking({
        let data = dir.path().to_str().unwrap().to_owned();
        move || {
            start_proxy_with(
                &upstream,
                &[
                    "--data-dir",
                    &data,
                    "--workers",
                    "1",
                    "--h2-max-streams",
                    "8",
                ],
            )
        }
    })
    .await
    .unwrap();
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let mut refused = 0;
    for round in 0..3 {
        let calls: Vec<_> = (0..20)
            .map(|i| {
                let mut ledger = LedgerClient::new(channel.clone());
                let request = fenced(charge("slow-2000"), &format!("cut-{round}-{i}"), "1");
                // Cut by the client after 300 ms: the call goes on upstream.
                tokio::spawn(async move {
                    tokio::time::timeout(Duration::from_millis(300), ledger.charge(request)).await
                })
            })
            .collect();
        for call in calls {
            if let Ok(Err(status)) = call.await.unwrap() {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                // Refused by the fence, or (a stream over the limit, which the client
                // counts a moment later than the proxy) by HTTP/2 itself: never sent.
                let fenced = status.metadata().get("fence-problem-type");
                if fenced.is_some_and(|t| t == "urn:fence:overloaded") {
                    refused += 1;
                } else {
                    assert!(
                        format!("{status:?}").contains("REFUSED_STREAM"),
                        "{status:?}"
                    );
                }
            }
        }
    }
    // Every call sent upstream is booked when its 2 s are up.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let booked = books.entries().len();
    // The client sends 8 at a time (the proxy's stream limit): the first 8, cut, run on.
    assert!(
        booked <= 8,
        "{booked} cut calls ran upstream at once, with 8 streams per connection"
    );
    assert!(refused >= 8, "only {refused} calls were refused");
}

/// A call the upstream refused before processing it (RST_STREAM REFUSED_STREAM, RFC 9113
/// section 8.7: a server at its stream limit, or going away) is a known failure: the client
/// gets UNAVAILABLE, and the job's next holder passes at once instead of waiting out an
/// unknown outcome's hold (here it would get drain-timeout after 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_upstream_refused_unprocessed_holds_nobody_up() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let refused = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (once, counted) = (refused.clone(), accepted.clone());
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let once = once.clone();
            tokio::spawn(async move {
                let mut conn = h2::server::handshake(socket).await.unwrap();
                while let Some(Ok((_, mut respond))) = conn.accept().await {
                    if !once.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    let ok = http::Response::builder()
                        .header("content-type", "application/grpc")
                        .header("grpc-status", "0")
                        .body(())
                        .unwrap();
                    let _ = respond.send_response(ok, true);
                }
            });
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let (_proxy, addr) = tokio::task::spawn_blocking({
        let data = dir.path().to_str().unwrap().to_owned();
        move || {
            start_proxy_with(
                &upstream,
                &[
                    "--data-dir",
                    &data,
                    "--drain-timeout",
                    "1s",
                    "--workers",
                    "1",
                ],
            )
        }
    })
    .await
    .unwrap();
    // Both calls on one client connection: each client connection has its own upstream one.
    let socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(socket).await.unwrap();
    tokio::spawn(conn);
    let first = h2_call(&mut client, &addr, "/ledger.Ledger/Charge", "refused", "3").await;
    assert_eq!(grpc_status(first).await, "14");
    assert!(refused.load(std::sync::atomic::Ordering::SeqCst));
    let newer = h2_call(&mut client, &addr, "/ledger.Ledger/Charge", "refused", "4").await;
    assert_eq!(grpc_status(newer).await, "0", "held up");
    // A refused stream leaves the connection in use: no new connection per refusal to an
    // upstream at its stream limit.
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// An h2c upstream answering each gRPC call after its request body ends: `/ledger.Ledger/Big`
/// with 3 MiB of data, anything else with one empty message, then `grpc-status: 0`. With it,
/// how many connections to it are open.
async fn upstream_with_big_answers() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let open = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = open.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let open = counted.clone();
            open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(socket).await else {
                    open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    return;
                };
                while let Some(Ok((request, mut respond))) = conn.accept().await {
                    tokio::spawn(async move {
                        let big = request.uri().path().ends_with("/Big");
                        let mut body = request.into_body();
                        while let Some(Ok(_)) = body.data().await {}
                        let head = http::Response::builder()
                            .header("content-type", "application/grpc")
                            .body(())
                            .unwrap();
                        let Ok(mut send) = respond.send_response(head, false) else {
                            return;
                        };
                        let answer = if big {
                            bytes::Bytes::from(vec![0u8; 3 << 20])
                        } else {
                            bytes::Bytes::from_static(b"\0\0\0\0\0")
                        };
                        let _ = send.send_data(answer, false);
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", "0".parse().unwrap());
                        let _ = send.send_trailers(trailers);
                    });
                }
                open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
    });
    (upstream, open)
}

/// A gRPC call of job `job` with `token` on the HTTP/2 client connection `client`: its
/// answer stream.
async fn h2_call(
    client: &mut h2::client::SendRequest<bytes::Bytes>,
    addr: &str,
    path: &str,
    job: &str,
    token: &str,
) -> h2::client::ResponseFuture {
    let request = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("x-fencing-job", job)
        .header("x-fencing-token", token)
        .body(())
        .unwrap();
    let (answer, mut body) = client.send_request(request, false).unwrap();
    body.send_data(bytes::Bytes::from_static(b"\0\0\0\0\0"), true)
        .unwrap();
    answer
}

/// The `grpc-status` a call ended with: in its head (trailers-only) or its trailers.
async fn grpc_status(answer: h2::client::ResponseFuture) -> String {
    let answer = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("an answer")
        .unwrap();
    if let Some(status) = answer.headers().get("grpc-status") {
        return status.to_str().unwrap().to_owned();
    }
    let mut body = answer.into_body();
    while let Some(chunk) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.unwrap().len());
    }
    let trailers = body.trailers().await.unwrap().unwrap_or_default();
    trailers["grpc-status"].to_str().unwrap().to_owned()
}

/// A client that stops reading its answers holds up its own calls, no other client's. An
/// audit: every gRPC call of a worker shared one upstream HTTP/2 connection, and a client
/// whose receive window stayed at 0 let three large answers fill that connection's window
/// upstream (here twelve, for the smaller windows the proxy now asks for); every other client's answers on the worker, for every job, stopped until the
/// proxy closed the idle client 60 to 88 s later. Each client connection now has its own
/// upstream connection: the other client's call is answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_holds_up_no_other_clients_calls() {
    let (upstream, _) = upstream_with_big_answers().await;
    let dir = tempfile::tempdir().unwrap();
    let (_proxy, addr) = tokio::task::spawn_blocking({
        let data = dir.path().to_str().unwrap().to_owned();
        move || start_proxy_with(&upstream, &["--data-dir", &data, "--workers", "1"])
    })
    .await
    .unwrap();
    let connect = |window: Option<u32>| {
        let addr = addr.clone();
        async move {
            let socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let mut builder = h2::client::Builder::new();
            if let Some(window) = window {
                builder.initial_window_size(window);
            }
            let (client, conn) = builder.handshake(socket).await.unwrap();
            tokio::spawn(conn);
            client
        }
    };
    // The stalled client: a window of 0 on each of its streams, never opened.
    let mut stalled = connect(Some(0)).await;
    let mut stalled_calls = Vec::new();
    for i in 0..12 {
        let job = format!("big-{i}");
        stalled_calls.push(h2_call(&mut stalled, &addr, "/ledger.Ledger/Big", &job, "1").await);
    }
    // The upstream's answers reach the proxy, which cannot pass them on.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut other = connect(None).await;
    let call = h2_call(
        &mut other,
        &addr,
        "/ledger.Ledger/Small",
        "another-job",
        "1",
    )
    .await;
    let answered = tokio::time::timeout(Duration::from_secs(5), async move {
        let answer = call.await.unwrap();
        let mut body = answer.into_body();
        let mut data = 0;
        while let Some(chunk) = body.data().await {
            let chunk = chunk.unwrap();
            data += chunk.len();
            let _ = body.flow_control().release_capacity(chunk.len());
        }
        let trailers = body.trailers().await.unwrap().unwrap_or_default();
        (data, trailers.get("grpc-status").cloned())
    })
    .await;
    assert_eq!(
        answered.ok(),
        Some((5, Some(http::HeaderValue::from_static("0")))),
        "another client's call was held up by one that does not read"
    );
    drop((stalled_calls, stalled));
}

/// A client connection's upstream HTTP/2 connection closes once the client connection and
/// its calls are done: clients that each make a call and leave do not pile up connections
/// to the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_connections_upstream_connection_closes_with_it() {
    let (upstream, open) = upstream_with_big_answers().await;
    let dir = tempfile::tempdir().unwrap();
    let (_proxy, addr) = tokio::task::spawn_blocking({
        let data = dir.path().to_str().unwrap().to_owned();
        move || start_proxy_with(&upstream, &["--data-dir", &data, "--workers", "1"])
    })
    .await
    .unwrap();
    for i in 0..5 {
        let socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let (mut client, conn) = h2::client::handshake(socket).await.unwrap();
        let driven = tokio::spawn(conn);
        let job = format!("short-{i}");
        let call = h2_call(&mut client, &addr, "/ledger.Ledger/Small", &job, "1").await;
        assert_eq!(grpc_status(call).await, "0");
        drop(client);
        let _ = driven.await;
    }
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        while open.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "{} upstream connections still open after their clients left",
        open.load(std::sync::atomic::Ordering::SeqCst)
    );
}

/// An upstream speaking HTTP/1.1 and h2c on one port: `/slow` answers once `release` is
/// sent `true`; anything else is a gRPC call, counted and answered at once (grpc-status 0,
/// trailers-only). With `close_after_grpc`, each connection ends (GOAWAY) after its first
/// gRPC call. Returns its address, the release and the count of gRPC calls.
async fn upstream_for_the_cap(
    close_after_grpc: bool,
) -> (
    String,
    tokio::sync::watch::Sender<bool>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use http_body_util::Full;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let (release, released) = tokio::sync::watch::channel(false);
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = calls.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let (released, counted) = (released.clone(), counted.clone());
            let answered = std::sync::Arc::new(tokio::sync::Notify::new());
            let notify = answered.clone();
            let service =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let (mut released, counted, notify) =
                        (released.clone(), counted.clone(), notify.clone());
                    async move {
                        let answer = if req.uri().path() == "/slow" {
                            let _ = released.wait_for(|r| *r).await;
                            http::Response::new(Full::new(bytes::Bytes::from_static(b"slow")))
                        } else {
                            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            notify.notify_one();
                            http::Response::builder()
                                .header("content-type", "application/grpc")
                                .header("grpc-status", "0")
                                .body(Full::new(bytes::Bytes::new()))
                                .unwrap()
                        };
                        Ok::<_, std::convert::Infallible>(answer)
                    }
                });
            tokio::spawn(async move {
                let builder = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                );
                let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(socket), service);
                tokio::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => {}
                    () = answered.notified(), if close_after_grpc => {
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    }
                }
            });
        }
    });
    (upstream, release, calls)
}

/// A proxy in front of `upstream` with six seats (`--max-connections 6`, one worker), an h2c
/// client connection to it, and `slow` requests of that client in flight at the upstream's
/// `/slow`: the seat covers the first, each further one takes a slot the cap spares.
async fn capped_client_with_slow_requests(
    upstream: String,
    slow: usize,
) -> (
    tempfile::TempDir,
    Proc,
    String,
    h2::client::SendRequest<bytes::Bytes>,
    Vec<h2::client::ResponseFuture>,
) {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, addr) = tokio::task::spawn_blocking({
        let data = dir.path().to_str().unwrap().to_owned();
        move || {
            start_proxy_with(
                &upstream,
                &[
                    "--data-dir",
                    &data,
                    "--workers",
                    "1",
                    "--max-connections",
                    "6",
                    "--max-connections-per-peer",
                    "6",
                ],
            )
        }
    })
    .await
    .unwrap();
    let socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(socket).await.unwrap();
    tokio::spawn(conn);
    let mut answers = Vec::new();
    for i in 0..slow {
        let request = http::Request::post(format!("http://{addr}/slow"))
            .header("x-fencing-job", format!("slow-{i}"))
            .header("x-fencing-token", "1")
            .body(())
            .unwrap();
        let (answer, mut body) = client.send_request(request, false).unwrap();
        body.send_data(bytes::Bytes::from_static(b"x"), true)
            .unwrap();
        answers.push(answer);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    (dir, proxy, addr, client, answers)
}

/// A client connection's upstream HTTP/2 connection counts against --max-connections as one
/// of its requests using an upstream connection: the client's seat covers one, so while its
/// HTTP/1.1-bound requests hold the room the cap spares (here 6 seats, three of them to
/// spare at most), its first gRPC call, which must open the HTTP/2 one, is refused
/// UNAVAILABLE before anything is sent, and goes through once they are done. A review counted
/// three file descriptors per seat without it, where the cap allows two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_connections_upstream_http2_connection_counts_against_the_cap() {
    let (upstream, release, calls) = upstream_for_the_cap(false).await;
    // Three slow requests: the seat's own, and the two slots the cap spares while more than
    // half of its six stay free.
    let (_dir, _proxy, addr, mut client, slow) =
        capped_client_with_slow_requests(upstream, 3).await;
    let call = h2_call(&mut client, &addr, "/ledger.Ledger/Charge", "grpc", "1").await;
    assert_eq!(
        grpc_status(call).await,
        "14",
        "sent with no room for its connection"
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    release.send_replace(true);
    for answer in slow {
        let answer = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.status(), 200);
        let mut body = answer.into_body();
        while let Some(chunk) = body.data().await {
            let _ = body.flow_control().release_capacity(chunk.unwrap().len());
        }
    }
    let call = h2_call(&mut client, &addr, "/ledger.Ledger/Charge", "grpc", "1").await;
    assert_eq!(grpc_status(call).await, "0", "the room came back");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// An upstream HTTP/2 connection that closed gives back its share of the cap before the
/// next call opens another: counted twice, the next call near the cap was refused although
/// there was room (a fact-check of 7db46d2). The upstream ends each HTTP/2 connection after
/// its first gRPC call; with six seats and two slow requests in flight, every call goes
/// through on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_upstream_http2_connection_gives_back_its_share_of_the_cap() {
    let (upstream, release, _) = upstream_for_the_cap(true).await;
    // Two slow requests: the seat's own, and one slot of the cap.
    let (_dir, _proxy, addr, mut client, slow) =
        capped_client_with_slow_requests(upstream, 2).await;
    for i in 0..3 {
        let call = h2_call(&mut client, &addr, "/ledger.Ledger/Charge", "grpc", "1").await;
        assert_eq!(grpc_status(call).await, "0", "call {i}");
        // The upstream's GOAWAY reaches the proxy.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    release.send_replace(true);
    drop(slow);
}
