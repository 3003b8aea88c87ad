//! An HTTP/2 client's streams, counted against the proxy's connection cap upstream.
//!
//! A client connection's request uses one upstream HTTP/1.1 connection (a kept-alive one
//! that is ready, or a new one) until its answer's body has been read. An HTTP/1.1 client
//! has one request at a time, so the connection cap (`--max-connections`, half of what
//! `ulimit -n` leaves) also bounds the upstream connections in use. An HTTP/2 client has up
//! to `--h2-max-streams` at once: each stream beyond the first that is in use upstream at
//! the same time takes a slot of the cap ([`Slots::try_extra`]), and one that finds none to
//! spare is answered 503 `overloaded` at once, never sent. The gRPC calls of a client
//! connection share one HTTP/2 upstream connection of its own and take no slot (so a client
//! that does not read its answers holds up its own calls, no other client's), but it has at most
//! `--h2-max-streams` of them running upstream ([`ClientStreams::enter_call`]), those its
//! client reset included: the proxy runs each to its end, and a client that reset its calls
//! as fast as it made them would otherwise have any number running there.
//!
//! A request that uses an upstream connection also keeps a share in its client
//! connection's slot ([`SeatHold`]) until it is done there: the proxy runs admitted requests
//! to completion, so one whose client went away goes on upstream, and still counts.

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

use super::{conns::H2Slot, headers::ClientAddr};
use crate::listen::{SeatHold, Slots};

/// What the proxy knows of a request's client connection, put in each of its requests'
/// extensions (one extension for all of it, on the hot path): its address (for
/// `X-Forwarded-For`), its requests using an upstream HTTP/1.1 connection, its share in its
/// seat.
#[derive(Clone)]
pub(super) struct ClientStreams {
    pub(super) addr: ClientAddr,
    using: Arc<AtomicUsize>,
    seat: SeatHold,
    /// Its gRPC calls running upstream (counted apart: they share one upstream connection),
    /// and the most it may have.
    calls: Arc<AtomicUsize>,
    most_calls: usize,
    /// The upstream HTTP/2 connection its gRPC calls share, no other client's.
    pub(super) h2: Arc<H2Slot>,
}

/// One request's use of an upstream connection, given back when dropped: with the answer's
/// body once it is read, or with the request when it failed (or once it is done, when its
/// client went away).
pub(super) struct Upstreaming {
    /// Counted among its connection's streams (an HTTP/2 client's).
    streams: Option<Arc<AtomicUsize>>,
    _extra: Option<OwnedSemaphorePermit>,
    _seat: SeatHold,
}

impl Drop for Upstreaming {
    fn drop(&mut self) {
        if let Some(streams) = &self.streams {
            streams.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl ClientStreams {
    /// The requests of a connection from `addr` seated with `seat`.
    pub(super) fn new(addr: ClientAddr, seat: SeatHold) -> Self {
        Self {
            addr,
            using: Arc::default(),
            seat,
            calls: Arc::default(),
            most_calls: usize::MAX,
            h2: Arc::default(),
        }
    }

    /// At most `calls` gRPC calls of this connection run upstream at once (its stream limit:
    /// as many as its client may have open).
    pub(super) fn calls_at_most(mut self, calls: usize) -> Self {
        self.most_calls = calls;
        self
    }

    /// A gRPC call of this connection going upstream: it takes no slot (its HTTP/2
    /// connection carries it), but counts among the connection's requests running upstream
    /// until it is done there, its client still there or not. `None` when the connection
    /// already has its most: the call is not to be sent.
    pub(super) fn enter_call(self) -> Option<Upstreaming> {
        let others = self.calls.fetch_add(1, Ordering::AcqRel);
        let entered = Upstreaming {
            streams: Some(self.calls.clone()),
            _extra: None,
            _seat: self.seat,
        };
        // Refused, it is dropped, and not counted.
        (others < self.most_calls).then_some(entered)
    }

    /// A request of this connection going upstream: free when none other of it is (the
    /// client's own slot covers it), else one slot of `slots` to spare; always free when the
    /// client has one request at a time (not `several`, HTTP/1.1). `None` when there is
    /// none: the request is not to be sent.
    pub(super) fn enter(self, slots: &Slots, several: bool) -> Option<Upstreaming> {
        let mut entered = Upstreaming {
            streams: None,
            _extra: None,
            _seat: self.seat,
        };
        if several {
            let others = self.using.fetch_add(1, Ordering::AcqRel);
            entered.streams = Some(self.using.clone());
            if others > 0 {
                entered._extra = Some(slots.try_extra()?);
            }
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
        let streams = ClientStreams::new(
            ClientAddr::new(([127, 0, 0, 1], 1).into()),
            SeatHold::unseated(),
        );
        let first = streams
            .clone()
            .enter(&slots, true)
            .expect("the first is free");
        let second = streams
            .clone()
            .enter(&slots, true)
            .expect("6 free: one to spare");
        let third = streams
            .clone()
            .enter(&slots, true)
            .expect("5 free: one to spare");
        let fourth = streams
            .clone()
            .enter(&slots, true)
            .expect("4 free: one to spare");
        assert!(
            streams.clone().enter(&slots, true).is_none(),
            "3 free is not more than half"
        );
        assert_eq!(
            streams.using.load(Ordering::Acquire),
            4,
            "a refused one is not counted"
        );
        drop(second);
        let again = streams
            .clone()
            .enter(&slots, true)
            .expect("a slot given back is taken again");
        assert!(streams.clone().enter(&slots, true).is_none());
        drop((first, third, fourth, again));
        assert_eq!(streams.using.load(Ordering::Acquire), 0);
        // gRPC calls take no slot, up to the connection's most, counted apart from its
        // other requests: a request beside them is still its connection's first.
        let calls = streams.clone().calls_at_most(2);
        let (one, two) = (calls.clone().enter_call(), calls.clone().enter_call());
        assert!(one.is_some() && two.is_some(), "two calls");
        assert!(calls.clone().enter_call().is_none(), "a third is refused");
        assert_eq!(streams.calls.load(Ordering::Acquire), 2, "and not counted");
        assert_eq!(streams.using.load(Ordering::Acquire), 0, "requests apart");
        let request = streams
            .clone()
            .enter(&slots, true)
            .expect("a first request");
        assert!(request._extra.is_none(), "the first takes no slot");
        drop((one, request));
        assert!(
            calls.clone().enter_call().is_some(),
            "a call done makes room"
        );
        // Alone again, a request is free, whatever the slots hold.
        let held: Vec<_> = (0..3).filter_map(|_| slots.try_extra()).collect();
        assert_eq!(held.len(), 3);
        assert!(
            ClientStreams::new(
                ClientAddr::new(([127, 0, 0, 1], 1).into()),
                SeatHold::unseated()
            )
            .enter(&slots, true)
            .is_some()
        );
    }
}
