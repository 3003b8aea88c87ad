//! The request and response bodies of [`Fence`](crate::Fence): the original, or bytes.
//!
//! A body is the client's (or the inner service's) own, the client's under a deadline, or
//! bytes the layer holds: an idempotent request it buffered, a problem, a replay. Bytes the
//! layer holds carry their [`Reservation`] of the layer's memory budget, given back when the
//! body is dropped.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use fence_core::headers::{
    IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_BIN, X_FENCING_JOB, X_FENCING_JOB_BIN, X_FENCING_TOKEN,
    X_FENCING_TOKEN_BIN,
};
use fence_storage::BoxError;
use tokio::time::{Instant, Sleep};

use crate::{budget::Reservation, gate::InFlight};

mod unfinished;

/// The error a fenced request's body yields to the inner service when it did not arrive
/// within the layer's [`body_timeout`](crate::FenceLayer::body_timeout) of admission. The
/// client is answered 408 `urn:fence:body-timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the request body did not arrive within {limit:?} of admission")]
pub struct BodyTimeout {
    /// The limit that ran out.
    pub limit: Duration,
}

/// A body the fence can carry: bytes, sendable across tasks, with errors that box. Every
/// [`Body`] of that kind is one (hyper's `Incoming`, `String`, `Full<Bytes>`, axum's `Body`).
pub trait FenceBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

impl<B> FenceBody for B
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
}

/// An admitted request's place in flight while its body streams, shared by the request body,
/// the layer and, for a request answered before its body ended or one of whole messages, the
/// answer's body: the guard goes once all are done with it (the body ended, failed or was
/// dropped; the service answered; the answer ended), held for `hold` more when the outcome
/// became unknown meanwhile (the service failed instead of answering, or said it could not
/// tell), or when the body was still on its way at its deadline
/// ([`overdue`](Self::overdue)), or when the body failed and a failure leaves the outcome
/// unknown ([`body_failed`](Self::body_failed)).
pub(crate) struct Streaming {
    guard: std::sync::Mutex<Option<InFlight>>,
    hold: Duration,
    unknown: AtomicBool,
    /// Whether the service answered with a body that counts for the request's time in flight
    /// ([`ResponseBody::answering`]): a failure of the request's body then lets go at once.
    answered: AtomicBool,
    /// Dropped with this: tells the task that keeps the deadline (see `ends`) to stop.
    ended: std::sync::OnceLock<tokio::sync::oneshot::Sender<()>>,
    /// Whether a failure of the body leaves the service's outcome unknown: a gRPC (or
    /// gRPC-Web, or Connect streaming) call's messages arrive whole, and the service may be
    /// acting on those it got when the stream fails (reset by the client, or cut at the body
    /// deadline). A plain body that fails was never a whole request.
    failure_unknown: bool,
    /// The gRPC statuses that leave the outcome unknown, in the answer's head or trailers.
    pub(crate) unknown_grpc: crate::GrpcStatuses,
}

impl Streaming {
    /// `failure_unknown`, `unknown_grpc`: see the fields (the first true for a body of whole
    /// messages).
    pub(crate) fn new(
        guard: InFlight,
        hold: Duration,
        failure_unknown: bool,
        unknown_grpc: crate::GrpcStatuses,
    ) -> Arc<Self> {
        Arc::new(Self {
            guard: std::sync::Mutex::new(Some(guard)),
            hold,
            unknown: AtomicBool::new(false),
            answered: AtomicBool::new(false),
            ended: std::sync::OnceLock::new(),
            failure_unknown,
            unknown_grpc,
        })
    }

    /// The service's outcome is unknown: the guard is held for `hold` when it goes.
    pub(crate) fn unknown(&self) {
        // Release, with the Acquire loads: whichever thread lets the guard go (the body's, on
        // a failure after the answer) sees an unknown outcome marked before it.
        self.unknown.store(true, Ordering::Release);
    }

    /// Resolves (with an error) once this is dropped: the request is no longer in flight,
    /// and a task keeping its deadline can stop instead of sleeping to it. One per request.
    pub(crate) fn ends(&self) -> tokio::sync::oneshot::Receiver<()> {
        let (ended, ends) = tokio::sync::oneshot::channel();
        let first = self.ended.set(ended).is_ok();
        debug_assert!(first, "one task keeps a request's deadline");
        ends
    }

    /// Lets the guard go as [`overdue`](Self::overdue) at `at` if this place is still held
    /// then, from a task that ends with this place instead of sleeping to `at` (one per
    /// request in flight, not one per request of the last body timeout). Needs a runtime:
    /// without one (a service driven outside tokio) nothing keeps it.
    pub(crate) fn keep_deadline(self: &Arc<Self>, at: tokio::time::Instant) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let ends = self.ends();
        let flight = Arc::downgrade(self);
        runtime.spawn(async move {
            if tokio::time::timeout_at(at, ends).await.is_err()
                && let Some(flight) = flight.upgrade()
            {
                flight.overdue();
            }
        });
    }

    /// Whether the request's body is one of whole messages (gRPC and its kin).
    pub(crate) fn carries_messages(&self) -> bool {
        self.failure_unknown
    }

    /// A body failed (the request's or the answer's): the outcome is unknown when such a
    /// failure leaves it so.
    fn failed(&self) {
        if self.failure_unknown {
            self.unknown();
        }
    }

    /// The request's body failed: it passes nothing more on. Once the service has answered,
    /// an answer still streaming no longer keeps the request in flight: the guard goes now
    /// (held for `hold` when the outcome is unknown), as it did before answers counted.
    fn body_failed(&self) {
        self.failed();
        if self.answered.load(Ordering::Acquire) {
            self.let_go();
        }
    }

    /// The guard goes now (if it is still here): held for `hold` when the outcome is unknown.
    fn let_go(&self) {
        if let Some(guard) = self.take()
            && self.unknown.load(Ordering::Acquire)
        {
            guard.hold(self.hold);
        }
    }

    fn take(&self) -> Option<InFlight> {
        self.guard
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// The body's deadline passed with the body unfinished and unpolled (a service that
    /// answered, then stopped reading), or with the answer to a request answered before its
    /// body ended still unfinished (a client that stopped reading it): the body yields
    /// nothing more once asked, but what it passed on may still be on its way to the
    /// service, which may act on it. The guard goes now, held for `hold`, rather than
    /// whenever the service drops the body or the answer ends.
    pub(crate) fn overdue(&self) {
        if let Some(guard) = self.take() {
            guard.hold(self.hold);
        }
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        self.let_go();
    }
}

pin_project! {
    /// The body of a request as the inner service sees it: the client's body, or the same
    /// bytes after the layer read them to fingerprint an idempotent request.
    pub struct RequestBody<B> {
        #[pin]
        kind: Kind<B>,
        flight: Option<Arc<Streaming>>,
    }
}

pin_project! {
    /// The body of a response of [`Fence`](crate::Fence): the inner service's body, or bytes
    /// the layer produced (a problem, a replay), or the inner body after a prefix the layer
    /// already read while trying to store it.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        answering: Answering,
    }
}

/// The request's place in flight held by an answer that counts for it (one that began before
/// the request's body ended, or a call's: see [`ResponseBody::answering`]): let go when the
/// answer ends; an answer cut
/// before its end (failed, or dropped unfinished) counts as the body's failure.
#[derive(Default)]
struct Answering(Option<Arc<Streaming>>);

impl Answering {
    /// The answer ended: its part of the request's time in flight is over.
    fn ended(&mut self) {
        self.0 = None;
    }

    /// The answer failed or was cut: the outcome is unknown when a failure leaves it so.
    fn cut(&mut self) {
        if let Some(flight) = self.0.take() {
            flight.failed();
        }
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.cut();
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Timed {
            #[pin] body: B,
            // Made when the body first has to wait: a body that is all there never needs it.
            sleep: Option<Pin<Box<Sleep>>>,
            deadline: Instant,
            limit: Duration,
            fired: Arc<AtomicBool>,
        },
        Bytes { bytes: Option<Bytes>, trailers: Option<HeaderMap>, held: Option<Reservation> },
        Prefixed {
            prefix: Option<Bytes>,
            trailers: Option<HeaderMap>,
            rest: Pin<Box<B>>,
            held: Option<Reservation>,
        },
    }
}

impl<B> Kind<B> {
    fn bytes(bytes: Bytes, trailers: Option<HeaderMap>, held: Option<Reservation>) -> Self {
        Kind::Bytes {
            bytes: if bytes.is_empty() { None } else { Some(bytes) },
            trailers,
            held,
        }
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            flight: None,
        }
    }

    /// The client's body, which must end by `deadline`; past it, the body yields
    /// [`BodyTimeout`] and `fired` is set.
    pub(crate) fn timed(
        body: B,
        deadline: Instant,
        limit: Duration,
        fired: Arc<AtomicBool>,
    ) -> Self {
        Self {
            kind: Kind::Timed {
                body,
                sleep: None,
                deadline,
                limit,
                fired,
            },
            flight: None,
        }
    }

    /// Counts the request in flight until this body ended or was dropped.
    pub(crate) fn in_flight(mut self, flight: Arc<Streaming>) -> Self {
        self.flight = Some(flight);
        self
    }

    pub(crate) fn buffered(bytes: Bytes, trailers: Option<HeaderMap>, held: Reservation) -> Self {
        Self {
            kind: Kind::bytes(bytes, trailers, Some(held)),
            flight: None,
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            answering: Answering::default(),
        }
    }

    /// Counts the request in flight until this answer ended, too: for an answer that began
    /// before the request's body ended. The service answered before it had the whole
    /// request, and what it does with the rest (the last messages of a bidi call, an
    /// upload's end) may still be on its way to it when the body ends here: a hop (the
    /// proxy) hands a body on eagerly, and a service may act after it read the last frame.
    /// Its answer's end is the service saying it is done.
    pub(crate) fn answering(mut self, flight: Arc<Streaming>) -> Self
    where
        B: Body,
    {
        flight.answered.store(true, Ordering::Release);
        // An answer with nothing in it (a trailers-only gRPC answer, a 202 without a body) is
        // complete as it stands, and never polled: the service has said all it will say.
        if !end_kind(&self.kind) {
            self.answering = Answering(Some(flight));
        }
        self
    }

    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::bytes(bytes, None, None),
            answering: Answering::default(),
        }
    }

    /// Bytes the layer holds under `held` (a replay, a captured response), then `trailers`.
    pub(crate) fn held(
        bytes: Bytes,
        trailers: Option<HeaderMap>,
        held: Option<Reservation>,
    ) -> Self {
        Self {
            kind: Kind::bytes(bytes, trailers, held),
            answering: Answering::default(),
        }
    }

    pub(crate) fn prefixed(
        prefix: Bytes,
        trailers: Option<HeaderMap>,
        rest: Pin<Box<B>>,
        held: Option<Reservation>,
    ) -> Self {
        Self {
            kind: Kind::Prefixed {
                prefix: Some(prefix),
                trailers,
                rest,
                held,
            },
            answering: Answering::default(),
        }
    }
}

impl<B> From<Vec<u8>> for ResponseBody<B> {
    fn from(v: Vec<u8>) -> Self {
        Self::full(Bytes::from(v))
    }
}

fn poll_kind<B>(
    kind: Pin<&mut Kind<B>>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match kind.project() {
        KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
        KindProj::Timed {
            body,
            sleep,
            deadline,
            limit,
            fired,
        } => {
            if fired.load(Ordering::Relaxed) {
                return Poll::Ready(None); // the error was the body's last frame
            }
            // Past the deadline nothing more is passed on, even what already arrived: a
            // service that reads slowly must not get the rest after the request stopped
            // counting as in flight.
            if Instant::now() >= *deadline {
                fired.store(true, Ordering::Relaxed);
                return Poll::Ready(Some(Err(BodyTimeout { limit: *limit }.into())));
            }
            match body.poll_frame(cx) {
                Poll::Pending => match sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(*deadline)))
                    .as_mut()
                    .poll(cx)
                {
                    Poll::Ready(()) => {
                        fired.store(true, Ordering::Relaxed);
                        Poll::Ready(Some(Err(BodyTimeout { limit: *limit }.into())))
                    }
                    Poll::Pending => Poll::Pending,
                },
                ready => ready.map_err(Into::into),
            }
        }
        KindProj::Bytes {
            bytes, trailers, ..
        } => Poll::Ready(
            bytes
                .take()
                .map(Frame::data)
                .or_else(|| trailers.take().map(Frame::trailers))
                .map(Ok),
        ),
        KindProj::Prefixed {
            prefix,
            trailers,
            rest,
            ..
        } => {
            if let Some(p) = prefix.take().filter(|p| !p.is_empty()) {
                return Poll::Ready(Some(Ok(Frame::data(p))));
            }
            if let Some(t) = trailers.take() {
                return Poll::Ready(Some(Ok(Frame::trailers(t))));
            }
            rest.as_mut().poll_frame(cx).map_err(Into::into)
        }
    }
}

fn end_kind<B: Body>(kind: &Kind<B>) -> bool {
    match kind {
        Kind::Inner { body } | Kind::Timed { body, .. } => body.is_end_stream(),
        Kind::Bytes {
            bytes, trailers, ..
        } => bytes.is_none() && trailers.is_none(),
        Kind::Prefixed {
            prefix,
            trailers,
            rest,
            ..
        } => {
            prefix.as_ref().is_none_or(Bytes::is_empty)
                && trailers.is_none()
                && rest.is_end_stream()
        }
    }
}

fn hint_kind<B: Body>(kind: &Kind<B>) -> SizeHint {
    match kind {
        Kind::Inner { body } | Kind::Timed { body, .. } => body.size_hint(),
        Kind::Bytes { bytes, .. } => {
            SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
        }
        Kind::Prefixed { prefix, rest, .. } => {
            let extra = prefix.as_ref().map_or(0, |b| b.len() as u64);
            let h = rest.size_hint();
            let mut out = SizeHint::new();
            out.set_lower(h.lower() + extra);
            if let Some(u) = h.upper() {
                out.set_upper(u + extra);
            }
            out
        }
    }
}

macro_rules! impl_body {
    ($t:ident, |$this:ident, $polled:ident| $after:block) => {
        impl<B> Body for $t<B>
        where
            B: Body<Data = Bytes>,
            B::Error: Into<BoxError>,
        {
            type Data = Bytes;
            type Error = BoxError;

            fn poll_frame(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
                let mut $this = self.project();
                let $polled = poll_kind($this.kind.as_mut(), cx);
                $after
            }

            fn is_end_stream(&self) -> bool {
                end_kind(&self.kind)
            }

            fn size_hint(&self) -> SizeHint {
                hint_kind(&self.kind)
            }
        }
    };
}

// A request body that ended or failed ends its part of the request's time in flight; a
// failure may leave the outcome unknown (see `Streaming::body_failed`). Its trailers lose
// the fields the fence judges (see `unjudged_trailers`).
impl_body!(RequestBody, |this, polled| {
    if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
        if let (Poll::Ready(Some(Err(_))), Some(flight)) = (&polled, this.flight.as_ref()) {
            flight.body_failed();
        }
        *this.flight = None;
    }
    unjudged_trailers(polled)
});

/// A request's trailers without the fields the fence judges in its head (`X-Fencing-Job`,
/// `X-Fencing-Token`, `Idempotency-Key`, and their gRPC binary `-bin` forms): a service that
/// merges trailers into its headers (as a gRPC server may merge them into metadata) would
/// otherwise read a token or key the fence never judged, sent after the one it admitted.
fn unjudged_trailers(
    mut polled: Poll<Option<Result<Frame<Bytes>, BoxError>>>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    if let Poll::Ready(Some(Ok(frame))) = &mut polled
        && let Some(trailers) = frame.trailers_mut()
    {
        for name in [
            X_FENCING_JOB,
            X_FENCING_TOKEN,
            IDEMPOTENCY_KEY,
            X_FENCING_JOB_BIN,
            X_FENCING_TOKEN_BIN,
            IDEMPOTENCY_KEY_BIN,
        ] {
            trailers.remove(name);
        }
    }
    polled
}

// An answer that holds the request in flight lets go at its end; a failure may leave the
// outcome unknown, as a dropped unfinished answer does (see `Answering`).
impl_body!(ResponseBody, |this, polled| {
    if let Some(flight) = this.answering.0.as_ref() {
        // A call that ran out of time or was cancelled after its answer began: its handler
        // may still have a write on its way.
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && frame
                .trailers_ref()
                .is_some_and(|t| flight.unknown_grpc.in_headers(t))
        {
            flight.unknown();
        }
        match &polled {
            Poll::Ready(None) => this.answering.ended(),
            Poll::Ready(Some(Err(_))) => this.answering.cut(),
            Poll::Ready(Some(Ok(_))) if end_kind(&*this.kind) => this.answering.ended(),
            _ => {}
        }
    }
    polled
});

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RequestBody")
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseBody")
    }
}
