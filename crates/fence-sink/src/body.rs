//! The request and response bodies of [`Fence`](crate::Fence): the original, or bytes.
//!
//! A body is the client's (or the inner service's) own, or bytes the layer holds: an
//! idempotent request it buffered, a problem, a replay.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use fence_storage::BoxError;

/// A body the fence can carry: bytes, sendable across tasks, with errors that box. Every
/// [`Body`] of that kind is one (hyper's `Incoming`, `String`, `Full<Bytes>`, axum's `Body`).
pub trait FenceBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

impl<B> FenceBody for B
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
}

pin_project! {
    /// The body of a request as the inner service sees it: the client's body, or the same
    /// bytes after the layer read them to fingerprint an idempotent request.
    pub struct RequestBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    /// The body of a response of [`Fence`](crate::Fence): the inner service's body, or bytes
    /// the layer produced (a problem, a replay), or the inner body after a prefix the layer
    /// already read while trying to store it.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Bytes { bytes: Option<Bytes> },
        Prefixed { prefix: Option<Bytes>, trailers: Option<HeaderMap>, rest: Pin<Box<B>> },
    }
}

impl<B> Kind<B> {
    fn bytes(bytes: Bytes) -> Self {
        Kind::Bytes {
            bytes: if bytes.is_empty() { None } else { Some(bytes) },
        }
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn buffered(bytes: Bytes) -> Self {
        Self {
            kind: Kind::bytes(bytes),
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::bytes(bytes),
        }
    }

    pub(crate) fn prefixed(prefix: Bytes, trailers: Option<HeaderMap>, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: Kind::Prefixed {
                prefix: Some(prefix),
                trailers,
                rest,
            },
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
        KindProj::Bytes { bytes } => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        KindProj::Prefixed {
            prefix,
            trailers,
            rest,
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
        Kind::Inner { body } => body.is_end_stream(),
        Kind::Bytes { bytes } => bytes.is_none(),
        Kind::Prefixed {
            prefix,
            trailers,
            rest,
        } => {
            prefix.as_ref().is_none_or(Bytes::is_empty)
                && trailers.is_none()
                && rest.is_end_stream()
        }
    }
}

fn hint_kind<B: Body>(kind: &Kind<B>) -> SizeHint {
    match kind {
        Kind::Inner { body } => body.size_hint(),
        Kind::Bytes { bytes } => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
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
    ($t:ident) => {
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
                poll_kind(self.project().kind, cx)
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

impl_body!(RequestBody);
impl_body!(ResponseBody);

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
