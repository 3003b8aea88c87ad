//! The service of a served connection, marking its requests on the connection's record.
//!
//! A connection is busy from a request's start to its answer's head, and authenticated once
//! an answer says so ([`Tracked`]). Its answers' bodies note whether the client takes what
//! they hand out: hyper asks a body for more only once the client's window (HTTP/2) or the
//! socket (HTTP/1.1) has room.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};
use hyper::body::{Body, Frame, SizeHint};

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
    type Response = Response<Watched<B>>;
    type Error = S::Error;
    type Future = Answering<S::Future>;

    fn call(&self, req: Request<R>) -> Self::Future {
        self.conn.begin();
        Answering {
            inner: self.inner.call(req),
            conn: self.conn.clone(),
            answered: false,
        }
    }
}

pin_project_lite::pin_project! {
    /// A request being answered: its connection is busy until the answer's head.
    pub(super) struct Answering<F> {
        #[pin]
        inner: F,
        conn: Arc<Tracked>,
        answered: bool,
    }

    impl<F> PinnedDrop for Answering<F> {
        fn drop(this: Pin<&mut Self>) {
            // Dropped unanswered (the connection went away): no longer busy either.
            let this = this.project();
            if !*this.answered {
                this.conn.done(false);
            }
        }
    }
}

impl<F, B, E> Future for Answering<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<Watched<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = std::task::ready!(this.inner.poll(cx));
        if !*this.answered {
            *this.answered = true;
            let accepted = answer
                .as_ref()
                .is_ok_and(|response| response.extensions().get::<Authenticated>().is_some());
            this.conn.done(accepted);
        }
        Poll::Ready(answer.map(|response| {
            // The head goes out now: handed until the body is first asked for a frame (an
            // HTTP/2 client that gives no window is never asked to).
            this.conn.answer_handed();
            let conn = this.conn.clone();
            conn.body_began();
            response.map(|inner| Watched {
                inner,
                conn,
                handed: true,
            })
        }))
    }
}

pin_project_lite::pin_project! {
    /// An answer's body: notes on its connection when it handed out a frame that the
    /// connection has not asked to follow yet (its client is not taking it in).
    pub(super) struct Watched<B> {
        #[pin]
        inner: B,
        conn: Arc<Tracked>,
        // Counted on the connection as handed out and not asked for more.
        handed: bool,
    }

    impl<B> PinnedDrop for Watched<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if *this.handed {
                this.conn.answer_asked();
            }
            this.conn.body_ended();
        }
    }
}

impl<B: Body> Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if std::mem::take(this.handed) {
            this.conn.answer_asked();
        }
        let frame = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &frame {
            *this.handed = true;
            this.conn.answer_handed();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
