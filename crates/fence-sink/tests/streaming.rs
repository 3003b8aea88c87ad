//! A streaming call through `FenceLayer` counts as in flight until the service answered, the call's request body has ended and (answered early, or a gRPC call) its answer has ended, and an answer kept for an `Idempotency-Key` is read for at most the body deadline (docs/protocol.md section 3).

mod common;

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use common::Channel;
use fence_sink::{Fence, FenceLayer, Fenced, MemoryStore};
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tower::{Layer, Service, ServiceExt};

/// A streaming service: it answers every call at once (the answer's head), then applies
/// each message of the request's body as it arrives (`effect <token> <message>`), as a gRPC
/// client-streaming or bidi call does; the answer's body is a `Channel` the test ends.
#[derive(Clone, Default)]
struct Streams {
    log: Arc<Mutex<Vec<String>>>,
    answers: Arc<Mutex<Vec<mpsc::UnboundedSender<Bytes>>>>,
    /// How long after answering it starts reading the request's body (zero: at once).
    reads_after: Duration,
}

impl Streams {
    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

impl<B> Service<Request<B>> for Streams
where
    B: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<Channel>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Channel>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let token = req
            .extensions()
            .get::<Fenced>()
            .map_or("-".to_owned(), |f| f.token.to_string());
        self.log.lock().unwrap().push(format!("start {token}"));
        let (log, reads_after) = (self.log.clone(), self.reads_after);
        tokio::spawn(async move {
            tokio::time::sleep(reads_after).await;
            let mut body = std::pin::pin!(req.into_body());
            while let Some(Ok(frame)) = body.frame().await {
                if let Some(data) = frame.data_ref() {
                    let message = String::from_utf8_lossy(data);
                    log.lock()
                        .unwrap()
                        .push(format!("effect {token} {message}"));
                }
            }
            log.lock().unwrap().push(format!("end {token}"));
        });
        let (answer, body) = Channel::new();
        self.answers.lock().unwrap().push(answer);
        std::future::ready(Ok(Response::new(body)))
    }
}

fn call<B>(token: u64, body: B) -> Request<B> {
    Request::post("/stream")
        .header("x-fencing-job", "job-1")
        .header("x-fencing-token", token.to_string())
        .header("content-type", "application/grpc")
        .body(body)
        .unwrap()
}

/// An HTTP upload that the service answers before it has read it all: not a gRPC call.
fn upload<B>(token: u64, body: B) -> Request<B> {
    let mut request = call(token, body);
    request
        .headers_mut()
        .insert("content-type", "application/octet-stream".parse().unwrap());
    request
}

/// A request body whose frames a test sends, or fails (as a client's reset stream does).
struct Resettable(mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>);

impl Body for Resettable {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|frame| frame.map(|r| r.map(http_body::Frame::data)))
    }
}

/// A fence layer with body deadline 5 s, unknown-outcome hold 3 s, drain limit 60 s.
fn layer_5_3_60() -> FenceLayer<MemoryStore> {
    FenceLayer::new(MemoryStore::new())
        .body_timeout(Duration::from_secs(5))
        .unknown_outcome_hold(Duration::from_secs(3))
        .drain_timeout(Duration::from_secs(60))
}

/// [`layer_5_3_60`] in front of `app`.
fn fenced(app: &Streams) -> Fence<Streams, MemoryStore> {
    layer_5_3_60().layer(app.clone())
}

/// Hands `body` to a task that holds it, unread, for 600 s (an upstream connection waiting on
/// a stalled server).
fn hold_unread<B: Send + 'static>(body: B) {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(600)).await;
        drop(body);
    });
}

/// How long a call of the newer `token` waited before it was let through (answered 200).
async fn newer_waits(svc: &Fence<Streams, MemoryStore>, token: u64) -> Duration {
    let began = tokio::time::Instant::now();
    let answer = svc
        .clone()
        .oneshot(call(token, String::new()))
        .await
        .unwrap();
    let waited = began.elapsed();
    assert_eq!(answer.status(), 200, "token {token} waited {waited:?}");
    waited
}

/// How long token 8 waits behind token 7's gRPC call, whose one message has arrived and
/// whose stream then stalls (`app` reading it, or not).
async fn newer_waits_behind_a_stalled_stream(svc: &Fence<Streams, MemoryStore>) -> Duration {
    let (messages7, body7) = Channel::new();
    messages7.send(Bytes::from("a")).unwrap();
    let _answer7 = svc.clone().oneshot(call(7, body7)).await.unwrap();
    let waited = newer_waits(svc, 8).await;
    drop(messages7);
    waited
}

/// With paused time: returns once every other task is blocked, the clock moved 1 ms.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// A newer token's call waits while an older call's request still streams (the service
/// answered its head at once): the older call's later messages cannot take effect after the
/// newer call's. The service answered before it had the whole request, so the call stays in
/// flight until its answer ended too; then the newer call goes on.
#[tokio::test(start_paused = true)]
async fn a_streaming_call_is_in_flight_until_its_request_ends() {
    let app = Streams::default();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let (messages7, body7) = Channel::new();
    let answer7 = svc.clone().oneshot(call(7, body7)).await.unwrap();
    assert_eq!(answer7.status(), 200);
    messages7.send(Bytes::from("a")).unwrap();
    let waiting8 = tokio::spawn(svc.clone().oneshot(call(8, String::new())));
    settle().await;
    messages7.send(Bytes::from("b")).unwrap();
    settle().await;
    assert_eq!(
        app.log(),
        ["start 7", "effect 7 a", "effect 7 b"],
        "token 8 started while token 7's request was still streaming"
    );
    assert!(!waiting8.is_finished());
    drop(messages7);
    settle().await;
    assert!(
        !waiting8.is_finished(),
        "token 8 went on while 7's answer, begun before its request ended, still streamed"
    );
    // The service ends its answer, and the client reads it to the end.
    drop(app.answers.lock().unwrap().remove(0));
    answer7.into_body().collect().await.unwrap();
    let answer8 = tokio::time::timeout(Duration::from_secs(1), waiting8)
        .await
        .expect("token 8 still waits after 7's request and answer ended")
        .unwrap()
        .unwrap();
    assert_eq!(answer8.status(), 200);
    assert_eq!(
        app.log(),
        [
            "start 7",
            "effect 7 a",
            "effect 7 b",
            "end 7",
            "start 8",
            "end 8"
        ]
    );
}

/// An upload that stops sending holds a newer token back only until its body deadline: the
/// body then fails (the service never gets a whole request) and lets go.
#[tokio::test(start_paused = true)]
async fn a_stalled_upload_lets_go_at_its_body_deadline() {
    let svc = fenced(&Streams::default());
    let (messages7, body7) = Channel::new();
    let _answer7 = svc.clone().oneshot(upload(7, body7)).await.unwrap();
    let began = tokio::time::Instant::now();
    let answer8 = svc.clone().oneshot(upload(8, String::new())).await.unwrap();
    assert_eq!(answer8.status(), 200);
    let waited = began.elapsed();
    assert!(
        (Duration::from_secs(4)..Duration::from_secs(6)).contains(&waited),
        "token 8 waited {waited:?} for 7's stalled request (body deadline 5 s, no hold)"
    );
    drop(messages7);
}

/// A gRPC call's stream carries whole messages: when it fails after the answer's head (the
/// body deadline passed, or the client reset it), the service may still be acting on the
/// messages it got, so the call holds its job for the unknown-outcome hold from then on.
#[tokio::test(start_paused = true)]
async fn a_failed_grpc_stream_holds_its_job_for_the_hold() {
    let svc = fenced(&Streams::default());

    // Stalled to its body deadline (5 s), then held (3 s).
    let waited = newer_waits_behind_a_stalled_stream(&svc).await;
    assert!(
        (Duration::from_secs(8)..Duration::from_secs(10)).contains(&waited),
        "token 8 waited {waited:?} for 7's stalled gRPC stream (body deadline 5 s, hold 3 s)"
    );

    // Reset by its client after a message: held from the reset. The same for gRPC-Web and
    // Connect's streaming calls, whose messages arrive whole too; in any case (a media type's
    // name is case-insensitive, and servers lower-case it).
    let mut token = 9;
    for kind in [
        "application/grpc",
        "application/grpc-web+proto",
        "application/connect+proto",
        "Application/Connect+Proto",
        "APPLICATION/GRPC-WEB",
    ] {
        let (messages, body) = mpsc::unbounded_channel();
        messages.send(Ok(Bytes::from("b"))).unwrap();
        let mut request = call(token, Resettable(body));
        request
            .headers_mut()
            .insert("content-type", kind.parse().unwrap());
        let _answer = svc.clone().oneshot(request).await.unwrap();
        settle().await;
        messages
            .send(Err(std::io::Error::other("stream reset by the client")))
            .unwrap();
        let waited = newer_waits(&svc, token + 1).await;
        assert!(
            (Duration::from_secs(3)..Duration::from_secs(5)).contains(&waited),
            "token {} waited {waited:?} after {token}'s {kind} stream was reset (hold 3 s)",
            token + 1
        );
        token += 2;
    }
}

/// A service that answers, then stops reading a request whose messages have all arrived,
/// never asks the body for its deadline: the deadline is kept all the same. The request lets
/// go at its body deadline plus the unknown-outcome hold (what it passed on may still be on
/// its way), not when the service drops the body, nor at the newer token's drain limit.
#[tokio::test(start_paused = true)]
async fn a_request_the_service_stops_reading_lets_go_at_its_deadline_and_hold() {
    let svc = fenced(&Streams {
        reads_after: Duration::from_secs(1_000),
        ..Streams::default()
    });
    let waited = newer_waits_behind_a_stalled_stream(&svc).await;
    assert!(
        (Duration::from_secs(8)..Duration::from_secs(10)).contains(&waited),
        "token 8 waited {waited:?} (body deadline 5 s, hold 3 s)"
    );
}

/// Judged where effects commit: a message that arrived before the body deadline but is read
/// by the service only after it (a slow reader) is not passed on, since the request no
/// longer counts as in flight and a newer token may have gone ahead.
#[tokio::test(start_paused = true)]
async fn a_message_read_after_the_body_deadline_is_not_passed_on() {
    let app = Streams {
        reads_after: Duration::from_secs(10),
        ..Streams::default()
    };
    let svc = fenced(&app);
    let (messages7, body7) = Channel::new();
    messages7.send(Bytes::from("a")).unwrap();
    let _answer7 = svc.clone().oneshot(call(7, body7)).await.unwrap();
    newer_waits(&svc, 8).await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    let log = app.log();
    let newer = log.iter().position(|l| l == "start 8").unwrap();
    assert!(
        !log[newer..].iter().any(|l| l.starts_with("effect 7")),
        "token 7's message took effect after token 8 started: {log:?}"
    );
    drop(messages7);
}

/// An answer to keep for an `Idempotency-Key` whose body stalls holds a newer token back
/// until the body deadline from its head: it then streams on to its client unkept (a retry of
/// the key gets 409 not-replayable), and, since the service of a call of messages may still be
/// writing it, the newer token goes on after the unknown-outcome hold (3 s here), as it would
/// without a key; not for as long as the answer stalls.
#[tokio::test(start_paused = true)]
async fn a_stalled_answer_to_keep_lets_go_at_the_body_deadline() {
    let app = Streams::default();
    let svc = FenceLayer::new(MemoryStore::new())
        .body_timeout(Duration::from_secs(5))
        .unknown_outcome_hold(Duration::from_secs(3))
        .drain_timeout(Duration::from_secs(60))
        .layer(app.clone());
    let keyed = |token| {
        let mut request = call(token, String::from("pay 5"));
        request
            .headers_mut()
            .insert("idempotency-key", "k1".parse().unwrap());
        request
    };
    let paying7 = tokio::spawn(svc.clone().oneshot(keyed(7)));
    settle().await;
    assert_eq!(app.log(), ["start 7", "effect 7 pay 5", "end 7"]);
    let began = tokio::time::Instant::now();
    let answer8 = svc.clone().oneshot(call(8, String::new())).await.unwrap();
    assert_eq!(answer8.status(), 200);
    let waited = began.elapsed();
    assert!(
        (Duration::from_secs(7)..Duration::from_secs(12)).contains(&waited),
        "token 8 waited {waited:?} for 7's stalled answer (body deadline 5 s, hold 3 s)"
    );
    // Token 7's client gets the whole answer once the service sends it.
    let answer7 = paying7.await.unwrap().unwrap();
    let stalled = app.answers.lock().unwrap().remove(0);
    stalled.send(Bytes::from("paid")).unwrap();
    drop(stalled);
    let body = answer7.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "paid");
}

/// A service behind a hop (the proxy, whose HTTP client reads a request's body eagerly into
/// its send buffers): the hop takes the body as fast as it comes, and the service applies
/// each message `delay` (10 ms by default) after the hop took it, then ends its answer. It
/// answers at once, or (`reads_first`) once the hop has taken the whole body, as the proxy
/// does when it sent a short body before the upstream's answer came back.
#[derive(Clone, Default)]
struct BehindAHop {
    log: Arc<Mutex<Vec<String>>>,
    reads_first: bool,
    delay: Option<Duration>,
}

impl<B> Service<Request<B>> for BehindAHop
where
    B: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<Channel>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<Channel>, Infallible>> + Send>,
    >;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let token = req.extensions().get::<Fenced>().unwrap().token.to_string();
        let (log, reads_first) = (self.log.clone(), self.reads_first);
        let delay = self.delay.unwrap_or(Duration::from_millis(10));
        Box::pin(async move {
            let (answer, body) = Channel::new();
            let (hop, mut service) = mpsc::unbounded_channel::<Bytes>();
            let take = async move {
                let mut body = std::pin::pin!(req.into_body());
                while let Some(Ok(frame)) = body.frame().await {
                    if let Ok(data) = frame.into_data() {
                        let _ = hop.send(data);
                    }
                }
            };
            if reads_first {
                take.await;
            } else {
                tokio::spawn(take);
            }
            tokio::spawn(async move {
                while let Some(message) = service.recv().await {
                    tokio::time::sleep(delay).await;
                    let message = String::from_utf8_lossy(&message).into_owned();
                    log.lock()
                        .unwrap()
                        .push(format!("effect {token} {message}"));
                }
                drop(answer);
            });
            Ok(Response::new(body))
        })
    }
}

/// Judged where effects commit: a bidi call answered at once, whose last messages the hop
/// has taken but the service has not yet applied when the request's body ends here. A newer
/// token that went on at the body's end would take effect before them.
#[tokio::test(start_paused = true)]
async fn messages_on_their_way_through_a_hop_take_effect_before_a_newer_token() {
    let app = BehindAHop::default();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let (messages7, body7) = Channel::new();
    let answer7 = svc.clone().oneshot(call(7, body7)).await.unwrap();
    messages7.send(Bytes::from("a")).unwrap();
    messages7.send(Bytes::from("b")).unwrap();
    drop(messages7);
    // The client reads its answer to the end, as a bidi client does.
    let reading7 = tokio::spawn(answer7.into_body().collect());
    let answer8 = svc
        .clone()
        .oneshot(call(8, String::from("c")))
        .await
        .unwrap();
    assert_eq!(answer8.status(), 200);
    reading7.await.unwrap().unwrap();
    answer8.into_body().collect().await.unwrap();
    assert_eq!(
        app.log.lock().unwrap().clone(),
        ["effect 7 a", "effect 7 b", "effect 8 c"],
        "token 8's effect committed before 7's messages that were on their way"
    );
}

/// A client that does not read the answer of a call answered before its request ended
/// holds the job only until the body deadline plus the unknown-outcome hold, as a stalled
/// body does. A gRPC answer dropped unfinished (its client went away) leaves the service's
/// outcome unknown: held for the hold; a plain answer dropped unfinished lets go at once.
#[tokio::test(start_paused = true)]
async fn an_early_answer_unread_or_cut_holds_its_job_for_a_bounded_time() {
    let svc = fenced(&Streams::default());

    let (messages7, body7) = Channel::new();
    let _unread7 = svc.clone().oneshot(call(7, body7)).await.unwrap();
    messages7.send(Bytes::from("a")).unwrap();
    drop(messages7);
    let waited = newer_waits(&svc, 8).await;
    assert!(
        (Duration::from_secs(8)..Duration::from_secs(10)).contains(&waited),
        "token 8 waited {waited:?} behind 7's unread answer (body deadline 5 s, hold 3 s)"
    );

    let (messages9, body9) = Channel::new();
    let answer9 = svc.clone().oneshot(call(9, body9)).await.unwrap();
    drop(messages9);
    settle().await;
    drop(answer9);
    let waited = newer_waits(&svc, 10).await;
    assert!(
        (Duration::from_secs(3)..Duration::from_secs(5)).contains(&waited),
        "token 10 waited {waited:?} after 9's gRPC answer was cut (hold 3 s)"
    );

    let (messages11, body11) = Channel::new();
    let answer11 = svc.clone().oneshot(upload(11, body11)).await.unwrap();
    drop(messages11);
    settle().await;
    drop(answer11);
    let waited = newer_waits(&svc, 12).await;
    assert!(
        waited < Duration::from_secs(1),
        "token 12 waited {waited:?} after 11's plain answer was dropped"
    );
}

/// Keeping a call's body deadline costs a task only while the call is in flight: calls that
/// ended leave none sleeping to their deadline (at thousands of calls a second and a 30 s
/// deadline, that would be tens of thousands of tasks).
#[tokio::test(start_paused = true)]
async fn finished_calls_leave_no_task_behind() {
    let app = Streams::default();
    let svc = fenced(&app);
    let before = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    for _ in 0..100 {
        let (messages, body) = Channel::new();
        let answer = svc.clone().oneshot(call(7, body)).await.unwrap();
        messages.send(Bytes::from("a")).unwrap();
        drop(messages);
        drop(app.answers.lock().unwrap().pop());
        answer.into_body().collect().await.unwrap();
    }
    settle().await;
    let alive = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
        - before;
    assert!(alive < 10, "{alive} tasks alive after 100 finished calls");
}

/// A service that hands the request's body to a task of its own (as the proxy hands it to
/// its upstream connection) and then panics may have sent its effect on its way: the next
/// token waits the unknown-outcome hold, not only until that task is done with the body.
#[tokio::test(start_paused = true)]
async fn a_panic_after_handing_the_body_on_holds_the_next_token() {
    let layer = layer_5_3_60();
    let panicking = layer.layer(tower::service_fn(
        |req: Request<fence_sink::RequestBody<Channel>>| async move {
            let body = req.into_body();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                body.collect().await.unwrap();
            });
            tokio::task::yield_now().await;
            if true {
                panic!("the handler failed after it sent its effect on its way");
            }
            Ok::<_, Infallible>(Response::new(String::new()))
        },
    ));
    let next = layer.layer(Streams::default());
    let (messages7, body7) = Channel::new();
    messages7.send(Bytes::from("a")).unwrap();
    drop(messages7);
    let crashed = tokio::spawn(panicking.oneshot(call(7, body7))).await;
    assert!(crashed.expect_err("the service panicked").is_panic());
    let began = tokio::time::Instant::now();
    let answer8 = next.oneshot(call(8, String::new())).await.unwrap();
    assert_eq!(answer8.status(), 200);
    let waited = began.elapsed();
    assert!(
        waited >= Duration::from_secs(3),
        "token 8 passed {waited:?} after 7's service panicked with its body handed on (hold 3 s)"
    );
}

/// The same, when the task the body was handed to holds it without reading it (an upstream
/// connection waiting on a stalled server): the deadline is kept all the same, so the next
/// token waits the body deadline and the hold, not until it gives up at its drain limit.
#[tokio::test(start_paused = true)]
async fn a_panic_with_the_body_held_unread_lets_go_at_the_deadline() {
    let layer = layer_5_3_60();
    let panicking = layer.layer(tower::service_fn(
        |req: Request<fence_sink::RequestBody<Channel>>| async move {
            hold_unread(req.into_body());
            tokio::task::yield_now().await;
            if true {
                panic!("the handler failed after it handed its body on");
            }
            Ok::<_, Infallible>(Response::new(String::new()))
        },
    ));
    let next = layer.layer(Streams::default());
    let (messages7, body7) = Channel::new();
    messages7.send(Bytes::from("a")).unwrap();
    let crashed = tokio::spawn(panicking.oneshot(call(7, body7))).await;
    assert!(crashed.expect_err("the service panicked").is_panic());
    let began = tokio::time::Instant::now();
    let answer8 = next.oneshot(call(8, String::new())).await.unwrap();
    let waited = began.elapsed();
    assert_eq!(
        answer8.status(),
        200,
        "token 8 was refused after {waited:?} behind 7's panicked call"
    );
    assert!(
        waited >= Duration::from_secs(8) && waited < Duration::from_secs(9),
        "token 8 passed {waited:?} after 7's service panicked with its body held unread \
         (deadline 5 s, hold 3 s)"
    );
    drop(messages7);
}

/// A call whose caller goes away (a client that closed its connection; the layer's futures
/// are cancelled with their callers) after the service handed the body to a task of its own
/// and before it answered: that task may still send the effect on its way, so the next token
/// waits the unknown-outcome hold after the task is done with the body, and, when the task
/// holds it unread, no longer than the body deadline and the hold. A call cancelled with its
/// body still in it holds nothing.
#[tokio::test(start_paused = true)]
async fn a_call_cancelled_with_its_body_handed_on_holds_the_next_token() {
    // A gRPC call and a plain HTTP upload alike: what is held does not depend on the body's
    // kind here. `kept`: how long the task the body was handed to keeps it, and whether it
    // reads it (`None`: the body is not handed on); then the bounds, in seconds, of when the
    // next token passes.
    let kinds: [fn(u64, Channel) -> Request<Channel>; 2] = [call, upload];
    for (kind, (kept, at_least, below)) in kinds.into_iter().flat_map(|kind| {
        [
            (Some((1, true)), 4, 5),
            (Some((600, false)), 8, 9),
            (None, 0, 1),
        ]
        .map(|case| (kind, case))
    }) {
        let layer = layer_5_3_60();
        let unanswered = layer.layer(tower::service_fn(
            move |req: Request<fence_sink::RequestBody<Channel>>| async move {
                let body = req.into_body();
                let _kept_here = match kept {
                    Some((secs, read)) => {
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_secs(secs)).await;
                            if read {
                                body.collect().await.unwrap();
                            }
                        });
                        None
                    }
                    None => Some(body),
                };
                std::future::pending::<()>().await;
                Ok::<_, Infallible>(Response::new(String::new()))
            },
        ));
        let next = layer.layer(Streams::default());
        let (messages7, body7) = Channel::new();
        messages7.send(Bytes::from("a")).unwrap();
        if kept.is_some_and(|(_, read)| read) {
            drop(messages7);
        }
        let began = tokio::time::Instant::now();
        let cancelled = tokio::time::timeout(
            Duration::from_millis(10),
            unanswered.oneshot(kind(7, body7)),
        )
        .await;
        assert!(
            cancelled.is_err(),
            "the service never answers: {:?}",
            cancelled.map(|r| r.map(|a| a.status()))
        );
        let answer8 = next.oneshot(call(8, String::new())).await.unwrap();
        let waited = began.elapsed();
        assert_eq!(answer8.status(), 200, "token 8 after {waited:?} ({kept:?})");
        assert!(
            waited >= Duration::from_secs(at_least) && waited < Duration::from_secs(below),
            "token 8 passed {waited:?} after 7's call was cancelled with its body kept {kept:?} \
             (deadline 5 s, hold 3 s): expected {at_least} to {below} s"
        );
    }
}

/// A service that fails (answers an error, not a response) after handing the body to a task
/// that holds it unread: the outcome is unknown, and the body deadline is kept, so the next
/// token waits the deadline and the hold, not until it gives up at its drain limit.
#[tokio::test(start_paused = true)]
async fn a_failure_with_the_body_held_unread_lets_go_at_the_deadline() {
    let layer = layer_5_3_60();
    let failing = layer.layer(tower::service_fn(
        |req: Request<fence_sink::RequestBody<Channel>>| async move {
            hold_unread(req.into_body());
            Err::<Response<String>, _>(std::io::Error::other("the handler failed"))
        },
    ));
    let next = layer.layer(Streams::default());
    let (messages7, body7) = Channel::new();
    messages7.send(Bytes::from("a")).unwrap();
    let began = tokio::time::Instant::now();
    assert!(failing.oneshot(call(7, body7)).await.is_err());
    let answer8 = next.oneshot(call(8, String::new())).await.unwrap();
    let waited = began.elapsed();
    assert_eq!(answer8.status(), 200, "token 8 after {waited:?}");
    assert!(
        waited >= Duration::from_secs(8) && waited < Duration::from_secs(9),
        "token 8 passed {waited:?} after 7's service failed with its body held unread \
         (deadline 5 s, hold 3 s)"
    );
    drop(messages7);
}

/// The same, when the hop took the whole (short) body before the service answered: the body
/// ended at the fence before the answer came, and the call still waits for its answer's end,
/// since its body is one of whole messages.
#[tokio::test(start_paused = true)]
async fn a_grpc_body_the_hop_took_before_the_answer_still_waits_for_the_answer() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let layer = FenceLayer::new(MemoryStore::new());
    let slow = layer.layer(BehindAHop {
        log: log.clone(),
        reads_first: true,
        delay: Some(Duration::from_millis(50)),
    });
    let quick = layer.layer(BehindAHop {
        log: log.clone(),
        reads_first: true,
        delay: Some(Duration::ZERO),
    });
    let answer7 = slow.oneshot(call(7, String::from("a"))).await.unwrap();
    let reading7 = tokio::spawn(answer7.into_body().collect());
    let answer8 = quick.oneshot(call(8, String::from("z"))).await.unwrap();
    answer8.into_body().collect().await.unwrap();
    reading7.await.unwrap().unwrap();
    assert_eq!(
        log.lock().unwrap().clone(),
        ["effect 7 a", "effect 8 z"],
        "token 8's effect committed before 7's message the hop had taken"
    );
}

/// A gRPC answer that is all there: one message then trailers, after which it says it has
/// ended (as hyper's HTTP/2 body does, so that hyper stops polling it), or nothing at all.
struct Finished {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl Body for Finished {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        let frame = match self.data.take() {
            Some(data) => Some(http_body::Frame::data(data)),
            None => self.trailers.take().map(http_body::Frame::trailers),
        };
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

/// A finished gRPC call lets the next token through at once, however its client reads the
/// answer: as hyper does, stopping once the body says it ended (after its trailers), or a
/// trailers-only answer that is never polled. Had either counted as an answer cut short,
/// every finished call would hold its job for the unknown-outcome hold.
#[tokio::test(start_paused = true)]
async fn a_finished_grpc_call_lets_the_next_token_through_at_once() {
    let layer = FenceLayer::new(MemoryStore::new())
        .unknown_outcome_hold(Duration::from_secs(3))
        .drain_timeout(Duration::from_secs(60));
    let mut token = 7;
    for trailers_only in [false, true] {
        let svc = layer.layer(tower::service_fn(
            move |req: Request<fence_sink::RequestBody<Channel>>| async move {
                req.into_body().collect().await.unwrap();
                let mut status = http::HeaderMap::new();
                status.insert("grpc-status", "0".parse().unwrap());
                let mut answer = Response::new(Finished {
                    data: (!trailers_only).then(|| Bytes::from("x")),
                    trailers: (!trailers_only).then(|| status.clone()),
                });
                if trailers_only {
                    answer.headers_mut().extend(status);
                }
                Ok::<_, Infallible>(answer)
            },
        ));
        let (messages, body) = Channel::new();
        messages.send(Bytes::from("a")).unwrap();
        drop(messages);
        let answer = svc.clone().oneshot(call(token, body)).await.unwrap();
        let mut body = answer.into_body();
        while !body.is_end_stream() {
            match body.frame().await {
                Some(Ok(_)) => {}
                _ => break,
            }
        }
        drop(body);
        let (ended, empty) = Channel::new();
        drop(ended);
        let began = tokio::time::Instant::now();
        let next = svc.oneshot(call(token + 1, empty)).await.unwrap();
        assert_eq!(next.status(), 200);
        assert!(
            began.elapsed() < Duration::from_secs(1),
            "token {} waited {:?} after {token}'s finished call (trailers only: {trailers_only})",
            token + 1,
            began.elapsed()
        );
        token += 2;
    }
}

/// A request's trailers reach the service without the fields the fence judges in the head:
/// a service that merges trailers into its headers (a gRPC server's metadata) would read a
/// token or key sent after the one the fence admitted, which the fence never judged. Other
/// trailers pass. Both ways a body reaches the service: as it streams, and read whole for an
/// `Idempotency-Key`.
#[tokio::test(start_paused = true)]
async fn request_trailers_lose_the_fields_the_fence_judges() {
    let seen: Arc<Mutex<Vec<http::HeaderMap>>> = Arc::default();
    let layer = FenceLayer::new(MemoryStore::new()).idempotency(
        fence_sink::IdempotencyConfig::default().scope_headers([http::header::AUTHORIZATION]),
    );
    let svc = layer.layer(tower::service_fn({
        let seen = seen.clone();
        move |req: Request<fence_sink::RequestBody<Finished>>| {
            let seen = seen.clone();
            async move {
                let trailers = req.into_body().collect().await.unwrap().trailers().cloned();
                seen.lock().unwrap().push(trailers.unwrap_or_default());
                Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from("ok"))))
            }
        }
    }));
    for (token, key) in [(7u64, None), (8, Some("key-1"))] {
        let mut trailers = http::HeaderMap::new();
        for (name, value) in [
            ("x-fencing-token", "999"),
            ("x-fencing-job", "job-2"),
            ("idempotency-key", "other-key"),
            ("x-fencing-token-bin", "OTk5"),
            ("authorization", "Bearer another-tenant"),
            ("x-checksum", "abc"),
        ] {
            trailers.insert(name, value.parse().unwrap());
        }
        let body = Finished {
            data: Some(Bytes::from("a")),
            trailers: Some(trailers),
        };
        let mut request = upload(token, body);
        if let Some(key) = key {
            request
                .headers_mut()
                .insert("idempotency-key", key.parse().unwrap());
        }
        let answer = svc.clone().oneshot(request).await.unwrap();
        assert_eq!(answer.status(), 200, "token {token}");
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    for (i, trailers) in seen.iter().enumerate() {
        for judged in [
            "x-fencing-token",
            "x-fencing-job",
            "idempotency-key",
            "x-fencing-token-bin",
        ] {
            assert!(
                !trailers.contains_key(judged),
                "request {i}: the service read a trailer {judged} the fence never judged: {trailers:?}"
            );
        }
        assert_eq!(
            trailers.get("x-checksum").map(|v| v.as_bytes()),
            Some(&b"abc"[..]),
            "request {i}"
        );
        // A header the fingerprint covers (a scope header) is judged in the head only, for a
        // request read whole for its key; a streamed one has no fingerprint.
        assert_eq!(
            trailers.contains_key("authorization"),
            i == 0,
            "request {i}: {trailers:?}"
        );
    }
}
