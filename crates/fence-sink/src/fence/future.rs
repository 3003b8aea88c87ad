//! The response future of [`Fence`](crate::Fence).

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, atomic::AtomicBool},
    task::{Context, Poll},
};

use http::Response;
use pin_project_lite::pin_project;

use crate::{
    body::ResponseBody,
    detach::{BoxFuture, Detachable},
    refusals::Asked,
};

pin_project! {
    /// The response future of [`Fence`](crate::Fence): the inner future itself for requests
    /// that are not fenced, an immediate rejection, or the fenced path.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
        // A gRPC call: a rejection is answered the gRPC way.
        grpc: bool,
        // What a request that may be refused asked, for the refusal log.
        asked: Option<Asked>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Unfenced { #[pin] future: F },
        Rejected { response: Option<Response<ResponseBody<B>>> },
        Fenced { future: Detachable<Result<Response<ResponseBody<B>>, E>> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn unfenced(future: F) -> Self {
        Self {
            kind: Kind::Unfenced { future },
            grpc: false,
            asked: None,
        }
    }

    pub(crate) fn rejected(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Rejected {
                response: Some(response),
            },
            grpc: false,
            asked: None,
        }
    }

    /// The fenced path; with `detach`, dropping the future before it finished lets the
    /// rest of it run on in a task of its own; without it, so does dropping it once
    /// `committed` is set (see [`Detachable::finishing_once`]).
    pub(crate) fn fenced(
        future: BoxFuture<Result<Response<ResponseBody<B>>, E>>,
        detach: bool,
        committed: Option<Arc<AtomicBool>>,
    ) -> Self
    where
        B: 'static,
        E: 'static,
    {
        Self {
            kind: Kind::Fenced {
                future: match (detach, committed) {
                    (true, _) => Detachable::finishing(future),
                    (false, Some(committed)) => Detachable::finishing_once(future, committed),
                    (false, None) => Detachable::cancelled_with_caller(future),
                },
            },
            grpc: false,
            asked: None,
        }
    }

    /// Answers rejections the gRPC way when `grpc` (the request is a gRPC call).
    pub(crate) fn grpc(mut self, grpc: bool) -> Self {
        self.grpc = grpc;
        self
    }

    /// Logs the answer if it is a refusal, as one to `asked`.
    pub(crate) fn asked(mut self, asked: Asked) -> Self {
        self.asked = Some(asked);
        self
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = match this.kind.project() {
            KindProj::Unfenced { future } => {
                return future.poll(cx).map_ok(|r| r.map(ResponseBody::inner));
            }
            KindProj::Rejected { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            KindProj::Fenced { future } => Pin::new(future).poll(cx),
        };
        if let (Some(asked), Poll::Ready(Ok(response))) = (this.asked.as_ref(), &answer) {
            asked.log_if_refused(response);
        }
        if *this.grpc {
            answer.map_ok(crate::reject::grpc)
        } else {
            answer
        }
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture")
    }
}
