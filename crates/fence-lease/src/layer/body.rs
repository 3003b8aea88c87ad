//! A request body that stops flowing once its lease is lost, for uploads streamed under it.
//!
//! [`Fencing`](super::Fencing) checks the lease until the answer's head comes, but a body
//! still streaming after that (a server may answer before the body ends, and hyper goes on
//! sending it) keeps flowing when the lease is lost: a long upload would finish under a token
//! that a newer holder has replaced, and a destination that commits at the body's end would
//! commit it (its fence may only order it before the newer holder's writes). Wrapped in a
//! [`FencedBody`], the body ends with a [`LeaseLost`] error at the loss: at the first frame
//! asked for after it, or at the loss itself while the body waits for its producer (a
//! client-streaming upload between two messages); hyper then aborts the request, and the
//! destination sees a body that never completed. Frames the body handed over before the loss
//! are hyper's: those still in its buffers (or an HTTP/2 stream's send window) may go out
//! after the loss, and the destination's fence judges them.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use bytes::Bytes;
//! use fence_lease::{LeaseClient, MemoryLeaseStore};
//! use http_body_util::{BodyExt, Full};
//!
//! let lease = LeaseClient::new(MemoryLeaseStore::new()).claim("upload-7".parse()?).await?;
//! let body = lease.view().fence_body(Full::new(Bytes::from_static(b"chunk")));
//! lease.release().await?;
//! assert!(body.collect().await.is_err(), "nothing more flows once the lease is gone");
//! # Ok(()) }
//! ```

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use fence_storage::BoxError;
use hyper::body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::LeaseLost;
use crate::LeaseView;

impl LeaseView {
    /// `body`, ending with a [`LeaseLost`] error once this lease is lost, also while it waits
    /// for its producer (see [`FencedBody`]).
    pub fn fence_body<B>(&self, body: B) -> FencedBody<B> {
        FencedBody {
            inner: body,
            lost: Box::pin(self.lost()),
            lease: self.clone(),
        }
    }
}

pin_project! {
    /// A body whose frames flow only while its lease is held; made by
    /// [`LeaseView::fence_body`]. Its error is the inner body's, or [`LeaseLost`]
    /// (`handed_over`: the request it belongs to has left, the frames before did too).
    #[derive(Debug)]
    pub struct FencedBody<B> {
        #[pin]
        inner: B,
        // Ready once the lease is lost: ends a body waiting for its producer at the loss.
        // Boxed, so the body is `Unpin` when the inner body is (`BodyExt::frame` needs it).
        lost: Pin<Box<WaitForCancellationFutureOwned>>,
        lease: LeaseView,
    }
}

impl<B> FencedBody<B> {
    /// The wrapped body.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B> Body for FencedBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let cut = || Poll::Ready(Some(Err(LeaseLost::of(this.lease, true).into())));
        if this.lease.is_lost() {
            return cut();
        }
        match this.inner.poll_frame(cx) {
            // Waiting for the producer: woken by the loss too, not only by the next frame.
            Poll::Pending => match this.lost.as_mut().poll(cx) {
                Poll::Ready(()) => cut(),
                Poll::Pending => Poll::Pending,
            },
            frame => frame.map(|frame| frame.map(|f| f.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::{
        convert::Infallible,
        pin::Pin,
        task::{Context, Poll},
        time::Duration,
    };

    use bytes::Bytes;
    use http_body_util::BodyExt;
    use hyper::body::{Body, Frame};

    use crate::{LeaseClient, LeaseLost, MemoryLeaseStore};

    /// A producer that never yields a frame (a client-streaming upload between messages).
    struct Silent;

    impl Body for Silent {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Pending
        }
    }

    /// A body waiting for its producer ends at the loss, not whenever the producer yields:
    /// until then the request stays open with a partial body, holding the destination's
    /// in-flight slot.
    #[tokio::test(start_paused = true)]
    async fn a_body_waiting_for_its_producer_ends_at_the_loss() {
        let lease = LeaseClient::new(MemoryLeaseStore::new())
            .claim("upload-7".parse().unwrap())
            .await
            .unwrap();
        let mut body = lease.view().fence_body(Silent);
        let upload = tokio::spawn(async move { body.frame().await.map(|f| f.map(|_| ())) });
        tokio::time::sleep(Duration::from_millis(10)).await; // the body waits for a frame
        assert!(!upload.is_finished());
        lease.release().await.unwrap();
        let frame = tokio::time::timeout(Duration::from_secs(60), upload)
            .await
            .expect("the body did not end at the loss")
            .unwrap();
        assert!(
            matches!(&frame, Some(Err(e)) if e.is::<LeaseLost>()),
            "{frame:?}"
        );
    }
}
