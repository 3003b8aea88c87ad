//! Newcomers accepted at the connection cap, waiting for a seat: lightest addresses first.
//!
//! At the cap the kernel's backlog is first come, first served: a flood that reconnects as
//! fast as its connections are closed for room fills it, and a newcomer from another address
//! waits behind every queued connection of the flood (its SYN dropped when the backlog is
//! full, and sent again only after 1 s, then 3 s). So a listener at its cap keeps accepting
//! into a small lobby instead, and seats from it the newcomer whose address holds the fewest
//! connections, the longest waiting among equals. When the lobby is full, the newest waiting
//! connection of the address that holds the most (seated and waiting) is closed unanswered:
//! the backlog keeps moving, and only the address crowding others out is turned away. A
//! waiting connection counts its wait against its first-request deadline.

use std::{
    collections::{HashMap, VecDeque},
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use fence_sink::refusals::peer_key;
use tokio::{net::TcpStream, time::Instant};

use super::slots::Slots;

/// Newcomers waiting for a seat at most, per accept loop.
pub(super) const LOBBY: usize = 64;

/// An accepted connection not yet seated.
#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) stream: TcpStream,
    pub(super) peer: SocketAddr,
    /// When it was accepted: its first-request deadline counts from here.
    pub(super) since: Instant,
}

impl Waiting {
    /// Its peer, as every per-peer count keys it ([`peer_key`]).
    fn key(&self) -> IpAddr {
        peer_key(self.peer.ip())
    }
}

/// The connections waiting for a seat, oldest first.
#[derive(Debug)]
pub(super) struct Lobby {
    waiting: VecDeque<Waiting>,
    max: usize,
}

impl Lobby {
    pub(super) fn new(max: usize) -> Self {
        Self {
            waiting: VecDeque::new(),
            max: max.max(1),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.waiting.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Lets `newcomer` wait; when the lobby is full, closes the newest waiting connection of
    /// the address that holds the most, seated and waiting (perhaps `newcomer` itself).
    pub(super) fn admit(&mut self, newcomer: Waiting, slots: &Slots) {
        self.waiting.push_back(newcomer);
        if self.waiting.len() > self.max {
            self.shed(slots);
        }
    }

    /// Closes the newest waiting connection of the address that holds the most, seated and
    /// waiting: when the lobby is full, or the process is out of open files.
    pub(super) fn shed(&mut self, slots: &Slots) {
        let weight = self.weights(slots);
        let heaviest = weight.iter().copied().max().unwrap_or(0);
        if let Some(at) = weight.iter().rposition(|&w| w == heaviest)
            && let Some(turned) = self.waiting.remove(at)
        {
            tracing::debug!(peer = %turned.peer.ip(), "closing a newcomer unanswered: the listener is at its cap and its address holds the most");
        }
    }

    /// The waiting connection to seat next: of the address that holds the fewest seats,
    /// the longest waiting among equals.
    pub(super) fn next(&mut self, slots: &Slots) -> Option<Waiting> {
        let held = slots.held_by_each(self.waiting.iter().map(|w| w.peer.ip()));
        // The first of the minimum: the longest waiting among equals.
        let lightest = held
            .iter()
            .enumerate()
            .min_by_key(|&(_, &h)| h)
            .map(|(at, _)| at)?;
        self.waiting.remove(lightest)
    }

    /// At the cap: asks one idle connection to close for each newcomer waiting beyond the
    /// room free or already on its way, in the order they will be seated (the lightest address first,
    /// each seat adding to its address): the room on its way goes to the first ones; each of
    /// the others gets room only from its own address or one holding more than it will (see
    /// [`Slots::evict_for_room`]). False when one could not get any, to look again when a
    /// connection ends or at the recheck.
    pub(super) fn make_room(&self, slots: &Slots) -> bool {
        let on_its_way = slots.room();
        if self.len() <= on_its_way {
            return true;
        }
        let peers: Vec<IpAddr> = self.waiting.iter().map(Waiting::key).collect();
        let mut held: HashMap<IpAddr, usize> = peers
            .iter()
            .copied()
            .zip(slots.held_by_each(peers.iter().copied()))
            .collect();
        let mut left = peers;
        let mut order = Vec::with_capacity(left.len());
        while let Some(at) = (0..left.len()).min_by_key(|&i| held[&left[i]]) {
            let peer = left.remove(at);
            let seats = held.entry(peer).or_default();
            order.push((peer, *seats));
            *seats += 1;
        }
        order
            .into_iter()
            .skip(on_its_way)
            .all(|(peer, holding)| slots.evict_for_room(peer, holding))
    }

    /// When the longest waiting connection's first-request deadline passes.
    pub(super) fn first_deadline(&self, header_timeout: Duration) -> Option<Instant> {
        self.waiting.front().map(|w| w.since + header_timeout)
    }

    /// Closes the connections that waited out their first-request deadline.
    pub(super) fn expire(&mut self, now: Instant, header_timeout: Duration) {
        while self
            .waiting
            .front()
            .is_some_and(|w| w.since + header_timeout <= now)
        {
            self.waiting.pop_front();
        }
    }

    /// Each waiting connection's address's weight: its seats plus its waiting connections.
    fn weights(&self, slots: &Slots) -> Vec<usize> {
        let held = slots.held_by_each(self.waiting.iter().map(|w| w.peer.ip()));
        self.waiting
            .iter()
            .zip(held)
            .map(|(w, h)| h + self.waiting.iter().filter(|o| o.key() == w.key()).count())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{super::slots::SeatHold, *};

    /// A connected stream from `source` (a loopback address) to `listener`.
    async fn from(source: &str, listener: &tokio::net::TcpListener) -> Waiting {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
        let _client = socket
            .connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (stream, peer) = listener.accept().await.unwrap();
        Waiting {
            stream,
            peer,
            since: Instant::now(),
        }
    }

    #[tokio::test]
    async fn the_lightest_address_is_seated_first_and_the_heaviest_turned_away() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let slots = Slots::new(10, 10);
        // 127.0.0.2 holds two seats; 127.0.0.3 one.
        let mut seats = Vec::new();
        for peer in ["127.0.0.2", "127.0.0.2", "127.0.0.3"] {
            let permit = slots.permits().clone().try_acquire_owned().unwrap();
            seats.push(slots.seat(peer.parse().unwrap(), permit).unwrap());
        }
        let mut lobby = Lobby::new(3);
        lobby.admit(from("127.0.0.2", &listener).await, &slots);
        lobby.admit(from("127.0.0.3", &listener).await, &slots);
        lobby.admit(from("127.0.0.2", &listener).await, &slots);
        assert_eq!(lobby.len(), 3);
        // Full: the newcomer from 127.0.0.1 stays; the newest of 127.0.0.2 is turned away.
        lobby.admit(from("127.0.0.1", &listener).await, &slots);
        assert_eq!(lobby.len(), 3);
        let order: Vec<String> = std::iter::from_fn(|| lobby.next(&slots))
            .map(|w| w.peer.ip().to_string())
            .collect();
        assert_eq!(order, ["127.0.0.1", "127.0.0.3", "127.0.0.2"]);
    }

    /// Room is made for each newcomer only from an address holding more than it will: with a
    /// flood's newcomer alone in the lobby, the idle connections of 127.0.0.1 and 127.0.0.4
    /// (one each) stay; a newcomer of 127.0.0.3 (none held) may have one of them, and the
    /// flood's newcomer still none.
    #[tokio::test]
    async fn room_is_made_for_each_newcomer_only_from_addresses_holding_more() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let slots = Slots::new(5, 10);
        let seat = |peer: &str| {
            let permit = slots.permits().clone().try_acquire_owned().unwrap();
            slots.seat(peer.parse().unwrap(), permit).unwrap()
        };
        let _light = [seat("127.0.0.1"), seat("127.0.0.4")]; // idle
        let flood: Vec<_> = (0..3).map(|_| seat("127.0.0.2")).collect();
        for seat in &flood {
            seat.conn.begin(); // busy
        }
        let mut lobby = Lobby::new(8);
        lobby.admit(from("127.0.0.2", &listener).await, &slots);
        assert!(!lobby.make_room(&slots), "nothing to close for 127.0.0.2");
        assert_eq!(slots.leaving(), 0, "the light connections stay");
        lobby.admit(from("127.0.0.3", &listener).await, &slots);
        assert!(
            !lobby.make_room(&slots),
            "one closed, none for the flood's newcomer"
        );
        assert_eq!(
            slots.leaving(),
            1,
            "one light connection makes room for 127.0.0.3, the other stays"
        );
    }

    /// One newcomer gets one connection closed for it: while the connection picked for it
    /// closes and gives back its seat, a look for room counts it (as on its way, then as a
    /// free slot) and picks no other. (A look between "closed" and "seat given back" once
    /// closed the worker's authenticated connection too.)
    #[tokio::test]
    async fn a_newcomer_has_one_connection_closed_for_it_not_two() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let slots = Slots::new(2, 2);
        let seat = |peer: &str| {
            let permit = slots.permits().clone().try_acquire_owned().unwrap();
            slots.seat(peer.parse().unwrap(), permit).unwrap()
        };
        let worker = seat("127.0.0.2");
        worker.conn.begin();
        worker.conn.done(true); // idle, authenticated
        let idle = SeatHold::new(seat("127.0.0.2")); // idle, never authenticated
        let mut lobby = Lobby::new(8);
        lobby.admit(from("127.0.0.2", &listener).await, &slots);
        assert!(lobby.make_room(&slots));
        assert_eq!(slots.leaving(), 1, "the unauthenticated one is picked");
        assert!(lobby.make_room(&slots), "its room is on its way");
        idle.closed(); // its only share: the seat goes with it
        assert!(lobby.make_room(&slots), "its slot is free");
        assert_eq!(
            slots.leaving(),
            0,
            "the worker's connection was closed for the same newcomer"
        );
        assert_eq!(
            slots.held_by_each(["127.0.0.2".parse().unwrap()].into_iter()),
            [1]
        );
    }

    #[tokio::test]
    async fn a_connection_waits_no_longer_than_its_first_request_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let slots = Slots::new(10, 10);
        let mut lobby = Lobby::new(8);
        let early = from("127.0.0.2", &listener).await;
        let began = early.since;
        lobby.admit(early, &slots);
        let mut late = from("127.0.0.3", &listener).await;
        late.since = began + Duration::from_secs(5);
        lobby.admit(late, &slots);
        let timeout = Duration::from_secs(10);
        assert_eq!(lobby.first_deadline(timeout), Some(began + timeout));
        lobby.expire(began + timeout, timeout);
        assert_eq!(lobby.len(), 1, "the first one's deadline passed");
        assert_eq!(
            lobby.first_deadline(timeout),
            Some(began + Duration::from_secs(15))
        );
    }
}
