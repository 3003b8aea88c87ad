//! A refused HTTP/2 request is answered after its body ended (bounded in bytes and time), so
//! a client still sending it sees the refusal instead of a stream closed under it.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use fence_sink::{FenceLayer, MemoryStore, RequestBody};
use http::{Request, Response, StatusCode, Version};
use http_body::{Body, Frame};
use tokio::sync::mpsc;
use tower::{Layer, ServiceExt, service_fn};

/// A request body the test sends piece by piece; `ended` is set once it was read to its end.
struct Streamed {
    rx: mpsc::Receiver<Bytes>,
    ended: Arc<AtomicBool>,
}

impl Body for Streamed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(bytes)) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
            Poll::Ready(None) => {
                self.ended.store(true, Ordering::SeqCst);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

fn streamed() -> (mpsc::Sender<Bytes>, Streamed, Arc<AtomicBool>) {
    let (tx, rx) = mpsc::channel(4);
    let ended = Arc::new(AtomicBool::new(false));
    let body = Streamed {
        rx,
        ended: ended.clone(),
    };
    (tx, body, ended)
}

fn post(version: Version, token: Option<u64>, body: Streamed) -> Request<Streamed> {
    let mut req = Request::post("/effects")
        .version(version)
        .header("x-fencing-job", "job-1");
    if let Some(token) = token {
        req = req.header("x-fencing-token", token.to_string());
    }
    req.body(body).unwrap()
}

/// The fence over a service that answers 200, with job-1's highest generation at 5.
async fn fence() -> impl tower::Service<
    Request<Streamed>,
    Response = Response<fence_sink::ResponseBody<String>>,
    Error = Infallible,
    Future: Send,
> + Clone {
    let svc = FenceLayer::new(MemoryStore::new()).layer(service_fn(
        |_req: Request<RequestBody<Streamed>>| async {
            Ok::<_, Infallible>(Response::new(String::from("done")))
        },
    ));
    let (tx, body, _) = streamed();
    drop(tx);
    let first = svc.clone().oneshot(post(Version::HTTP_11, Some(5), body));
    assert_eq!(first.await.unwrap().status(), StatusCode::OK);
    svc
}

#[tokio::test(start_paused = true)]
async fn a_refused_http2_request_is_answered_once_its_body_ended() {
    for token in [Some(4), None] {
        let (tx, body, ended) = streamed();
        let svc = fence().await;
        let answer = tokio::spawn(svc.oneshot(post(Version::HTTP_2, token, body)));
        tx.send(Bytes::from_static(b"first part")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !answer.is_finished(),
            "token {token:?}: answered while the client was still sending"
        );
        tx.send(Bytes::from_static(b"last part")).await.unwrap();
        drop(tx);
        let response = answer.await.unwrap().unwrap();
        let expected = if token.is_some() {
            StatusCode::CONFLICT
        } else {
            StatusCode::BAD_REQUEST
        };
        assert_eq!(response.status(), expected, "token {token:?}");
        assert!(ended.load(Ordering::SeqCst), "the body was read to its end");
    }
}

#[tokio::test(start_paused = true)]
async fn a_refused_http2_body_that_does_not_end_delays_the_answer_one_second_at_most() {
    let (tx, body, ended) = streamed();
    let svc = fence().await;
    let started = tokio::time::Instant::now();
    let response = svc
        .oneshot(post(Version::HTTP_2, Some(4), body))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert!(!ended.load(Ordering::SeqCst));
    drop(tx);
}

#[tokio::test(start_paused = true)]
async fn a_refused_http2_body_is_read_no_further_than_64_kib() {
    let (tx, body, ended) = streamed();
    let svc = fence().await;
    let started = tokio::time::Instant::now();
    let answer = tokio::spawn(svc.oneshot(post(Version::HTTP_2, Some(4), body)));
    for _ in 0..4 {
        tx.send(Bytes::from(vec![b'x'; 16 << 10])).await.unwrap();
    }
    let response = answer.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert!(!ended.load(Ordering::SeqCst));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "answered after 64 KiB, without waiting for more"
    );
}

#[tokio::test(start_paused = true)]
async fn a_refused_http1_request_is_answered_at_once_without_reading_its_body() {
    // Reading it would send the `100 Continue` a client waits for before sending.
    let (_tx, body, ended) = streamed();
    let svc = fence().await;
    let started = tokio::time::Instant::now();
    let response = svc
        .oneshot(post(Version::HTTP_11, Some(4), body))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert!(!ended.load(Ordering::SeqCst));
}
