//! A request body that stops flowing once its lease is lost, for uploads streamed under it.
//!
//! [`Fencing`](super::Fencing) checks the lease until the answer's head comes, but a body
//! still streaming after that (a server may answer before the body ends, and hyper goes on
//! sending it) keeps flowing when the lease is lost: a long upload would finish under a token
//! that a newer holder has replaced, and a destination that commits at the body's end would
//! commit it (its fence may only order it before the newer holder's writes). Wrapped in a
//! [`FencedBody`], the body ends with a [`LeaseLost`] error at the first frame asked for after
//! the loss; hyper then aborts the request, and the destination sees a body that never
//! completed.
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
    pin::Pin,
    task::{Context, Poll},
};

use fence_storage::BoxError;
use hyper::body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::LeaseLost;
use crate::LeaseView;

impl LeaseView {
    /// `body`, ending with a [`LeaseLost`] error at the first frame asked for once this lease
    /// is lost (see [`FencedBody`]).
    pub fn fence_body<B>(&self, body: B) -> FencedBody<B> {
        FencedBody {
            inner: body,
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
        if this.lease.is_lost() {
            return Poll::Ready(Some(Err(LeaseLost::of(this.lease, true).into())));
        }
        this.inner
            .poll_frame(cx)
            .map(|frame| frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
