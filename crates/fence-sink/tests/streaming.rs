//! A streaming call through `FenceLayer` counts as in flight until its request body and its answer have both ended (docs/protocol.md, gRPC: "until the service's answer ends").

use std::{
    convert::Infallible,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use fence_sink::{FenceLayer, Fenced, MemoryStore};
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tower::{Layer, Service, ServiceExt};

/// A body whose frames a test sends, one `Bytes` each; it ends when the sender is dropped.
struct Channel(mpsc::UnboundedReceiver<Bytes>);

impl Channel {
    fn new() -> (mpsc::UnboundedSender<Bytes>, Self) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Self(rx))
    }
}

impl Body for Channel {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|frame| frame.map(|b| Ok(Frame::data(b))))
    }
}

/// A streaming service: it answers every call at once (the answer's head), then applies
/// each message of the request's body as it arrives (`effect <token> <message>`), as a gRPC
/// client-streaming or bidi call does; the answer's body is a `Channel` the test ends.
#[derive(Clone, Default)]
struct Streams {
    log: Arc<Mutex<Vec<String>>>,
    answers: Arc<Mutex<Vec<mpsc::UnboundedSender<Bytes>>>>,
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
        let log = self.log.clone();
        tokio::spawn(async move {
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

/// With paused time: returns once every other task is blocked, the clock moved 1 ms.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// A newer token's call waits while an older call's request still streams and while its
/// answer still streams: the older call's later messages cannot take effect after the newer
/// call's. Released once both ended, the newer call goes on.
#[tokio::test(start_paused = true)]
async fn a_streaming_call_is_in_flight_until_its_request_and_answer_end() {
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
    // The request ends; the answer still streams.
    drop(messages7);
    settle().await;
    assert_eq!(app.log().last().map(String::as_str), Some("end 7"));
    assert!(
        !waiting8.is_finished(),
        "token 8 went on while 7's answer streamed"
    );
    // The answer ends too: token 8 goes on.
    app.answers.lock().unwrap().clear();
    let rest = answer7.into_body().collect().await.unwrap().to_bytes();
    assert!(rest.is_empty());
    let answer8 = tokio::time::timeout(Duration::from_secs(1), waiting8)
        .await
        .expect("token 8 still waits after 7 ended")
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

/// An answer dropped by its client (it went away mid-stream) releases the call like one that
/// ended.
#[tokio::test(start_paused = true)]
async fn a_dropped_answer_releases_a_streaming_call() {
    let app = Streams::default();
    let svc = FenceLayer::new(MemoryStore::new()).layer(app.clone());
    let answer7 = svc.clone().oneshot(call(7, String::new())).await.unwrap();
    let waiting8 = tokio::spawn(svc.clone().oneshot(call(8, String::new())));
    settle().await;
    assert!(
        !waiting8.is_finished(),
        "token 8 went on while 7's answer streamed"
    );
    drop(answer7);
    let answer8 = tokio::time::timeout(Duration::from_secs(1), waiting8)
        .await
        .expect("token 8 still waits after 7's answer was dropped")
        .unwrap()
        .unwrap();
    assert_eq!(answer8.status(), 200);
}
