//! Middleware that stamps outgoing requests with the lease's fencing headers.
//!
//! Once the lease is lost it refuses to send at all.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use fence_lease::{LeaseClient, MemoryLeaseStore};
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//!
//! let lease = LeaseClient::new(MemoryLeaseStore::new()).claim("job-1".parse()?).await?;
//! // In production the inner service is hyper_util's legacy `Client`.
//! let mut http = ServiceBuilder::new().layer(lease.fencing_layer()).service(service_fn(
//!     |req: http::Request<()>| async move {
//!         assert_eq!(req.headers()["x-fencing-token"], "1");
//!         Ok::<_, std::convert::Infallible>(http::Response::new(()))
//!     },
//! ));
//! http.ready().await?.call(http::Request::new(())).await?;
//! # Ok(()) }
//! ```

mod body;

pub use body::FencedBody;

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};

use fence_core::{Generation, JobId, headers};
use http::Request;
use pin_project_lite::pin_project;
use tokio_util::sync::WaitForCancellationFutureOwned;
use tower_layer::Layer;
use tower_service::Service;

use fence_storage::BoxError;

use crate::{Lease, LeaseStore, LeaseView, LossReason};

/// The error a [`Fencing`] service returns instead of sending once its lease is lost.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
#[error(
    "{}: the lease on job {job} (generation {generation}) is lost: {reason}",
    if *in_flight { "cut before its answer came: the request may have reached the destination (its outcome is unknown)" } else if *handed_over { "not sent by this layer (it had handed the request over before the loss: a lazy client such as hyper's sends nothing before this poll, an eager one such as a buffer may have)" } else { "not sent" }
)]
pub struct LeaseLost {
    /// The job.
    pub job: JobId,
    /// The generation that was lost.
    pub generation: Generation,
    /// Why.
    pub reason: LossReason,
    /// Whether the inner service's `call` had already run when the loss was seen (at the
    /// first poll of its future, or later: see `in_flight`): a lazy inner service (hyper's
    /// client) sent nothing before that first poll, an eager one (a buffer, tonic's
    /// `Channel`) may have. `false`: the inner service never saw the request.
    pub handed_over: bool,
    /// Whether the request was on its way when the loss cut it (its future had been polled,
    /// its answer's head had not come): it may have reached the destination, so its outcome
    /// is unknown. The destination's fence decides whether it took effect.
    pub in_flight: bool,
}

impl LeaseLost {
    fn of(lease: &LeaseView, handed_over: bool) -> Self {
        Self {
            job: lease.job().clone(),
            generation: lease.generation(),
            reason: lease.loss_reason().unwrap_or(LossReason::DeadlinePassed),
            handed_over,
            in_flight: false,
        }
    }
}

impl<S: LeaseStore> Lease<S> {
    /// A [`FencingLayer`] that stamps this lease on outgoing requests.
    pub fn fencing_layer(&self) -> FencingLayer {
        FencingLayer::new(self.view())
    }
}

/// Applies [`Fencing`] to a service.
#[derive(Debug, Clone)]
pub struct FencingLayer {
    lease: LeaseView,
}

impl FencingLayer {
    /// Stamps requests with `lease`'s job and token.
    pub fn new(lease: LeaseView) -> Self {
        Self { lease }
    }
}

impl<S> Layer<S> for FencingLayer {
    type Service = Fencing<S>;
    fn layer(&self, inner: S) -> Fencing<S> {
        Fencing {
            inner,
            lease: self.lease.clone(),
        }
    }
}

/// Sets `X-Fencing-Job` and `X-Fencing-Token` on every request while the lease is held;
/// fails with [`LeaseLost`] without calling the inner service once it is not.
///
/// The lease is checked when the request is handed over and again before every poll of its
/// future (a lazy client such as hyper's sends nothing before the first): once the lease is
/// lost, the inner future is never polled again (a retry or redirect layer under it starts
/// no further attempt). A loss before the answer's head comes drops the inner future at once
/// and fails with [`LeaseLost`] whose `in_flight` is true (after the first poll): a request
/// still waiting for a connection (a slow connect, a full pool) is then never written, and
/// one already written may have reached the destination, so its outcome is unknown. What
/// has left the process is out of the lease's reach, which is why the destination must check
/// the token too (the worked example's delayed write shows it refused there). An answer
/// whose head came is the caller's, body and all; one whose head arrived but was not yet
/// taken when the loss was seen counts as cut, its outcome unknown. A request body is ended at the loss only
/// when it is wrapped with [`LeaseView::fence_body`] (frames it handed over before may still
/// go out): without it, what becomes of a body still streaming when the request is cut is
/// the inner client's (hyper's HTTP/1 client closes the connection), and after the answer's
/// head it keeps flowing.
#[derive(Debug, Clone)]
pub struct Fencing<S> {
    inner: S,
    lease: LeaseView,
}

impl<S> Fencing<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, lease: LeaseView) -> Self {
        Self { inner, lease }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B> Service<Request<B>> for Fencing<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        match self.lease.token_header() {
            Some(token) => {
                let map = req.headers_mut();
                map.insert(
                    headers::X_FENCING_JOB,
                    headers::job_header_value(self.lease.job()),
                );
                map.insert(headers::X_FENCING_TOKEN, token);
                ResponseFuture {
                    kind: Kind::Sent {
                        future: self.inner.call(req),
                        lost: self.lease.lost(),
                        lease: self.lease.clone(),
                        polled: false,
                    },
                }
            }
            None => ResponseFuture {
                kind: Kind::Refused {
                    error: Some(LeaseLost::of(&self.lease, false)),
                },
            },
        }
    }
}

pin_project! {
    /// The response future of [`Fencing`].
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    #[project_replace = KindReplace]
    enum Kind<F> {
        Sent {
            #[pin]
            future: F,
            // Ready once the lease is lost: cuts the request until its answer's head comes.
            #[pin]
            lost: WaitForCancellationFutureOwned,
            lease: LeaseView,
            polled: bool,
        },
        Refused { error: Option<LeaseLost> },
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        let lost = match kind.as_mut().project() {
            KindProj::Sent {
                future,
                lost,
                lease,
                polled,
            } => {
                // Checked before every poll of the inner future, not only the first: a poll
                // after the loss may start another attempt (a retry or redirect layer), enqueue
                // (a lazy client) or run an effect in process, and must never happen.
                if lease.is_lost() {
                    // Before the first poll a lazy inner future sent nothing; after it, the
                    // request was on its way and its outcome is unknown.
                    LeaseLost {
                        in_flight: *polled,
                        ..LeaseLost::of(lease, true)
                    }
                } else {
                    *polled = true;
                    if let Poll::Ready(answer) = future.poll(cx) {
                        return Poll::Ready(answer.map_err(Into::into));
                    }
                    ready!(lost.poll(cx));
                    LeaseLost {
                        in_flight: true,
                        ..LeaseLost::of(lease, true)
                    }
                }
            }
            KindProj::Refused { error } => {
                return Poll::Ready(Err(error.take().expect("polled after completion").into()));
            }
        };
        // The inner future dropped now, not whenever the caller drops this one: a request it
        // has not written yet is never written; one written is out of the lease's reach.
        kind.project_replace(Kind::Refused { error: None });
        Poll::Ready(Err(lost.into()))
    }
}

#[cfg(test)]
mod tests {
    use std::{
        convert::Infallible,
        future::{Future, poll_fn},
        pin::pin,
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        task::Poll,
    };

    use tower::{Service, ServiceExt, service_fn};
    use tower_layer::Layer;

    use super::LeaseLost;
    use crate::{LeaseClient, MemoryLeaseStore};

    /// An inner future that was polled once before the loss is never polled again: its
    /// second poll (the next attempt of a retry layer, a lazy client's enqueue, an effect run
    /// in process) would send after the loss, and could even answer Ok.
    #[tokio::test(start_paused = true)]
    async fn the_inner_future_is_not_polled_after_the_loss() {
        let lease = LeaseClient::new(MemoryLeaseStore::new())
            .claim("job-1".parse().unwrap())
            .await
            .unwrap();
        let sent = Arc::new(AtomicBool::new(false));
        let flag = sent.clone();
        let mut svc = lease
            .fencing_layer()
            .layer(service_fn(move |_req: http::Request<()>| {
                let flag = flag.clone();
                let mut polls = 0;
                poll_fn(move |cx| {
                    polls += 1;
                    if polls == 1 {
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    flag.store(true, Ordering::SeqCst);
                    Poll::Ready(Ok::<_, Infallible>(http::Response::new(())))
                })
            }));
        let mut call = pin!(svc.ready().await.unwrap().call(http::Request::new(())));
        poll_fn(|cx| {
            assert!(call.as_mut().poll(cx).is_pending(), "the first poll waits");
            Poll::Ready(())
        })
        .await;
        lease.release().await.unwrap();
        let err = call.await.expect_err("sent after the loss");
        let lost = err.downcast_ref::<LeaseLost>().expect("a LeaseLost error");
        assert!(lost.in_flight, "polled once: its outcome is unknown");
        assert!(
            !sent.load(Ordering::SeqCst),
            "the inner future ran after the loss"
        );
    }
}
