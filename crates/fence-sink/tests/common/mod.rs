//! What several of the sink's test binaries share: a counting service, partial bodies.
#![allow(dead_code, unreachable_pub)] // each test binary uses its own subset

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};

use fence_sink::{FenceLayer, GenerationStore, IdempotencyStore, RequestBody};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tower::{Layer, ServiceExt, service_fn};

/// `layer` in front of a service answering 200 `done` that counts its calls.
pub struct CountingSink<St> {
    pub layer: FenceLayer<St>,
    calls: Arc<AtomicUsize>,
}

impl<St: GenerationStore + IdempotencyStore> CountingSink<St> {
    pub fn new(layer: FenceLayer<St>) -> Self {
        Self {
            layer,
            calls: Arc::default(),
        }
    }

    /// How many requests reached the service.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// A fenced `POST /` for `job` with `token`: the status and the problem body (`Null`
    /// when the body is not JSON).
    pub async fn send(&self, job: &str, token: &str) -> (StatusCode, serde_json::Value) {
        let calls = self.calls.clone();
        let inner = service_fn(move |_req: Request<RequestBody<String>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(String::from("done"))) }
        });
        let req = Request::post("/")
            .header("x-fencing-job", job)
            .header("x-fencing-token", token)
            .body(String::new())
            .unwrap();
        let resp = self.layer.layer(inner).oneshot(req).await.unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap_or_default())
    }
}

/// A body that sends one frame and then fails with its error, or, without one, sends
/// nothing ever: a peer that went away, or one that stalled mid-body.
pub struct Partial<E> {
    first: Option<Bytes>,
    error: Option<E>,
}

impl<E> Partial<E> {
    /// `first`, then nothing, ever.
    pub fn stalls_after(first: &'static [u8]) -> Self {
        Self {
            first: Some(Bytes::from_static(first)),
            error: None,
        }
    }

    /// `first`, then `error`.
    pub fn fails_after(first: &'static [u8], error: E) -> Self {
        Self {
            first: Some(Bytes::from_static(first)),
            error: Some(error),
        }
    }
}

/// What [`Body::poll_frame`] answers.
type Polled<E> = Poll<Option<Result<Frame<Bytes>, E>>>;

impl<E: Unpin> Body for Partial<E> {
    type Data = Bytes;
    type Error = E;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Polled<E> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        match self.error.take() {
            Some(e) => Poll::Ready(Some(Err(e))),
            None => Poll::Pending,
        }
    }
}

/// A body whose frames a test sends, one `Bytes` each; it ends when the sender is dropped.
pub struct Channel(mpsc::UnboundedReceiver<Bytes>);

impl Channel {
    pub fn new() -> (mpsc::UnboundedSender<Bytes>, Self) {
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
