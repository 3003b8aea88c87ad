//! The response future of [`Fence`](crate::Fence).

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::Response;
use pin_project_lite::pin_project;

use super::body::ResponseBody;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project! {
    /// The response future of [`Fence`](crate::Fence): the inner future itself for requests
    /// that are not fenced, an immediate rejection, or the fenced path.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
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
        }
    }

    pub(crate) fn rejected(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Rejected {
                response: Some(response),
            },
        }
    }

    /// The fenced path; with `detach`, dropping the future before it finished lets the
    /// rest of it run on in a task of its own (see [`Detachable`]).
    pub(crate) fn fenced(
        future: BoxFuture<Result<Response<ResponseBody<B>>, E>>,
        detach: bool,
    ) -> Self
    where
        B: 'static,
        E: 'static,
    {
        Self {
            kind: Kind::Fenced {
                future: Detachable {
                    future: Some(future),
                    detach: detach.then_some(finish_in_a_task),
                },
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Unfenced { future } => future.poll(cx).map_ok(|r| r.map(ResponseBody::inner)),
            KindProj::Rejected { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            KindProj::Fenced { future } => Pin::new(future).poll(cx),
        }
    }
}

/// A boxed future that runs in its caller's task while the caller waits for it and, when
/// `detach` is set and the caller drops it unfinished (a client went away), is handed to a
/// task of its own to finish there: the request it carries then stays in flight until its
/// effect is over, as if it had been spawned from the start, without the cost of a task per
/// request when nobody goes away. Without a tokio runtime at the drop, it is dropped.
struct Detachable<T> {
    future: Option<BoxFuture<T>>,
    /// What a drop does with an unfinished future, if anything.
    detach: Option<fn(BoxFuture<T>)>,
}

fn finish_in_a_task<T: 'static>(future: BoxFuture<T>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        // The box moves, the future inside it does not: it stays pinned.
        runtime.spawn(async move {
            let _ = future.await;
        });
    }
}

impl<T> Future for Detachable<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let future = self.future.as_mut().expect("polled after completion");
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T> Drop for Detachable<T> {
    fn drop(&mut self) {
        if let (Some(future), Some(detach)) = (self.future.take(), self.detach) {
            detach(future);
        }
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture")
    }
}
