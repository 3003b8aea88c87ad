//! An HTTP/2 client's streams, counted against the proxy's connection cap upstream.
//!
//! A client connection's request uses one upstream HTTP/1.1 connection (a kept-alive one
//! that is ready, or a new one) until its answer's body has been read. An HTTP/1.1 client
//! has one request at a time, so the connection cap (`--max-connections`, half of what
//! `ulimit -n` leaves) also bounds the upstream connections in use. An HTTP/2 client has up
//! to `--h2-max-streams` at once: each stream beyond the first that is in use upstream at
//! the same time takes a slot of the cap ([`Slots::try_extra`]), and one that finds none to
//! spare is answered 503 `overloaded` at once, never sent. gRPC calls share the worker's one
//! HTTP/2 upstream connection and take nothing.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
};

use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::OwnedSemaphorePermit;

use crate::listen::Slots;

/// The requests of one client connection that are using an upstream HTTP/1.1 connection,
/// put in each of its requests' extensions.
#[derive(Clone, Default)]
pub(super) struct ClientStreams(Arc<AtomicUsize>);

/// One request's use of an upstream connection, given back when dropped: with the answer's
/// body once it is read, or with the request when it failed.
pub(super) struct Upstreaming {
    streams: Arc<AtomicUsize>,
    _extra: Option<OwnedSemaphorePermit>,
}

impl Drop for Upstreaming {
    fn drop(&mut self) {
        self.streams.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ClientStreams {
    /// A request of this connection going upstream: free when none other of it is (the
    /// client's own slot covers it), else one slot of `slots` to spare. `None` when there is
    /// none: the request is not to be sent.
    pub(super) fn enter(&self, slots: &Slots) -> Option<Upstreaming> {
        let others = self.0.fetch_add(1, Ordering::AcqRel);
        let mut entered = Upstreaming {
            streams: self.0.clone(),
            _extra: None,
        };
        if others > 0 {
            entered._extra = Some(slots.try_extra()?);
        }
        Some(entered)
    }
}

/// An upstream answer's body that keeps its request's [`Upstreaming`] until it is dropped
/// (read to its end, or cut).
pub(super) struct Held<B> {
    body: B,
    _using: Option<Upstreaming>,
}

impl<B> Held<B> {
    pub(super) fn new(body: B, using: Option<Upstreaming>) -> Self {
        Self {
            body,
            _using: using,
        }
    }
}

impl<B: Body + Unpin> Body for Held<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first request of a connection takes nothing; each one beside it takes a slot
    /// while more than half stay free, and gives it back when it ends.
    #[test]
    fn streams_beyond_the_first_take_slots_while_half_stay_free() {
        let slots = Slots::new(6, 6);
        let streams = ClientStreams::default();
        let first = streams.enter(&slots).expect("the first is free");
        let second = streams.enter(&slots).expect("6 free: one to spare");
        let third = streams.enter(&slots).expect("5 free: one to spare");
        let fourth = streams.enter(&slots).expect("4 free: one to spare");
        assert!(
            streams.enter(&slots).is_none(),
            "3 free is not more than half"
        );
        assert_eq!(
            streams.0.load(Ordering::Acquire),
            4,
            "a refused one is not counted"
        );
        drop(second);
        let again = streams
            .enter(&slots)
            .expect("a slot given back is taken again");
        assert!(streams.enter(&slots).is_none());
        drop((first, third, fourth, again));
        assert_eq!(streams.0.load(Ordering::Acquire), 0);
        // Alone again, a request is free, whatever the slots hold.
        let held: Vec<_> = (0..3).filter_map(|_| slots.try_extra()).collect();
        assert_eq!(held.len(), 3);
        assert!(ClientStreams::default().enter(&slots).is_some());
    }
}
