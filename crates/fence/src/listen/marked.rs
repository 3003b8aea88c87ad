//! The service of a served connection, marking its requests on the connection's record.
//!
//! A connection is busy from a request's start to its answer's head, and authenticated once
//! an answer says so ([`Tracked`]).

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};

use super::{Authenticated, slots::Tracked};

/// The service of a connection: notes each request's start and answer on the connection's
/// [`Tracked`] (busy or idle, authenticated or not).
#[derive(Clone)]
pub(super) struct Marked<S> {
    pub(super) inner: S,
    pub(super) conn: Arc<Tracked>,
}

impl<S, B, R> hyper::service::Service<Request<R>> for Marked<S>
where
    S: hyper::service::Service<Request<R>, Response = Response<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Answering<S::Future>;

    fn call(&self, req: Request<R>) -> Self::Future {
        self.conn.begin();
        Answering {
            inner: self.inner.call(req),
            conn: Some(self.conn.clone()),
        }
    }
}

pin_project_lite::pin_project! {
    /// A request being answered: its connection is busy until the answer's head.
    pub(super) struct Answering<F> {
        #[pin]
        inner: F,
        conn: Option<Arc<Tracked>>,
    }

    impl<F> PinnedDrop for Answering<F> {
        fn drop(this: Pin<&mut Self>) {
            // Dropped unanswered (the connection went away): no longer busy either.
            if let Some(conn) = this.project().conn.take() {
                conn.done(false);
            }
        }
    }
}

impl<F, B, E> Future for Answering<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = std::task::ready!(this.inner.poll(cx));
        if let Some(conn) = this.conn.take() {
            let accepted = answer
                .as_ref()
                .is_ok_and(|response| response.extensions().get::<Authenticated>().is_some());
            conn.done(accepted);
        }
        Poll::Ready(answer)
    }
}
