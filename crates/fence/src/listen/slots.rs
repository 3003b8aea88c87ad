//! Who holds a listener's connections, and which of them to close when there is no room.
//!
//! Every connection is seated by its peer's IP address ([`peer_key`]: an IPv4-mapped IPv6
//! address as IPv4, so a dual-stack listener counts an IPv4 client once). A peer
//! holds at most
//! [`Slots::per_peer`] (clients behind one NAT address share it); a newcomer beyond that
//! takes the place of its own peer's oldest idle connection, or is closed at once when all
//! of them are busy. At the listener's cap, [`Slots::evict_for_room`] asks one idle connection
//! to close for a newcomer: of the peer that holds the most, unauthenticated ones first (a
//! connection is authenticated once a request on it carried a credential the service
//! accepted), and only of the newcomer's own peer or of one holding more than it does. A
//! connection answering a request is never picked; a picked one closes gracefully.

use std::{
    cmp::Reverse,
    collections::HashMap,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
};

use fence_sink::refusals::peer_key;
use tokio::{
    sync::{Notify, OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

/// One open connection, as the slots see it.
#[derive(Debug)]
pub(super) struct Tracked {
    /// Rises with every accept: the lowest is the oldest.
    id: u64,
    /// It has sent a request head.
    pub(super) asked: AtomicBool,
    /// Requests being answered now (until their response head).
    busy: AtomicUsize,
    /// Answers whose body has not ended yet (a stream still going after its head).
    bodies: AtomicUsize,
    /// A request on it carried a credential the service accepted.
    authenticated: AtomicBool,
    /// When a request last began or got its answer, in ms since the slots began.
    active_ms: AtomicU64,
    /// Since when a write to it has waited for its client to read.
    write_stalled: Since,
    /// Answers whose head or last frame went out and whose next frame was not asked for yet,
    /// and since when there have been any.
    answers_unasked: AtomicUsize,
    answer_unasked: Since,
    /// Its connection closed; what goes on of its requests (upstream, after the client left)
    /// still holds its seat, and there is nothing of it to close for room.
    gone: AtomicBool,
    /// Notified when it is picked to make room: it closes gracefully then.
    pub(super) evict: Notify,
    evicted: AtomicBool,
    /// Counted in the slots' `leaving` (picked while idle, not closed, no request begun).
    counted: AtomicBool,
    /// The slots' count of connections picked to make room that have not closed yet.
    leaving: Arc<AtomicUsize>,
    epoch: Instant,
}

impl Tracked {
    /// Asks it to close, counted as room on its way; false when it was asked before.
    fn pick(&self) -> bool {
        let first = !self.evicted.swap(true, Ordering::SeqCst);
        if first {
            // Counted first, flagged after: an uncount in between finds nothing to take back.
            self.leaving.fetch_add(1, Ordering::SeqCst);
            self.counted.store(true, Ordering::SeqCst);
            // A request that began meanwhile may have found it not yet counted.
            if self.busy.load(Ordering::SeqCst) > 0 {
                self.uncount();
            }
            self.evict.notify_one();
        }
        first
    }

    /// No longer counted as room on its way: it closed, or a request began on it after it
    /// was picked (its graceful close waits for that request, as long as it takes).
    fn uncount(&self) {
        if self.counted.swap(false, Ordering::SeqCst) {
            self.leaving.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn idle(&self) -> bool {
        self.busy.load(Ordering::Acquire) == 0
            && !self.evicted.load(Ordering::Acquire)
            && !self.gone.load(Ordering::Acquire)
    }

    fn touch(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.active_ms.store(ms, Ordering::Release);
    }

    /// A request head arrived: busy until [`done`](Self::done).
    pub(super) fn begin(&self) {
        self.asked.store(true, Ordering::Release);
        self.busy.fetch_add(1, Ordering::SeqCst);
        self.uncount();
        self.touch();
    }

    /// A request got its answer; `authenticated` when it carried an accepted credential.
    pub(super) fn done(&self, authenticated: bool) {
        if authenticated {
            self.authenticated.store(true, Ordering::Release);
        }
        self.busy.fetch_sub(1, Ordering::AcqRel);
        self.touch();
    }

    /// A write to the connection could not go through: its client has not read what it was
    /// sent (kept from the first such write until one goes through).
    pub(super) fn write_waits(&self) {
        self.write_stalled.mark(self.epoch);
    }

    /// A write went through: the client reads.
    pub(super) fn write_went(&self) {
        self.write_stalled.clear();
    }

    /// An answer's head or a frame of its body went out: until its body is asked for the
    /// next (or dropped), the client has not made room for more (hyper asks once the
    /// client's window, or the socket, has room). Called once per answer until
    /// [`answer_asked`](Self::answer_asked).
    pub(super) fn answer_handed(&self) {
        if self.answers_unasked.fetch_add(1, Ordering::Relaxed) == 0 {
            self.answer_unasked.mark(self.epoch);
        }
    }

    /// An answer handed out before was asked for its next frame, or went: the client made
    /// room. With other answers (HTTP/2 streams) still waiting, their wait counts from now.
    pub(super) fn answer_asked(&self) {
        if self.answers_unasked.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.answer_unasked.clear();
            // A stream of another task may have been handed out in between, found the
            // moment still kept and not marked its own: marked again here.
            if self.answers_unasked.load(Ordering::Relaxed) > 0 {
                self.answer_unasked.mark(self.epoch);
            }
        } else {
            self.answer_unasked.set(self.epoch);
        }
    }

    /// How long a write to the socket has waited for its client to read, if one waits (not
    /// HTTP/2's flow control above it: a client may hold one stream back and read others).
    pub(super) fn socket_unread_for(&self) -> Option<std::time::Duration> {
        self.write_stalled.elapsed(self.epoch)
    }

    /// How long the connection has waited for its client to take in what it sends (at the
    /// socket, or at HTTP/2's flow control above it), if it waits.
    pub(super) fn unread_for(&self) -> Option<std::time::Duration> {
        let (socket, answer) = (
            self.write_stalled.elapsed(self.epoch),
            self.answer_unasked.elapsed(self.epoch),
        );
        socket.max(answer)
    }

    /// An answer's body began: the connection has a stream open until it ends.
    pub(super) fn body_began(&self) {
        self.bodies.fetch_add(1, Ordering::AcqRel);
    }

    /// An answer's body ended (read to its end, or dropped).
    pub(super) fn body_ended(&self) {
        self.bodies.fetch_sub(1, Ordering::AcqRel);
        self.touch();
    }

    /// When the connection has been idle since, or `None` while it is not. Idle: no request
    /// waiting for its answer's head, and no answer's body going on (since its last
    /// activity), or every one going on held back by its client (since one was last asked
    /// for more: an HTTP/2 client that gives its streams no window keeps its connection no
    /// longer than one that sends nothing). An answer whose server has nothing to send yet
    /// (a quiet gRPC stream) keeps it open, whatever the others do.
    pub(super) fn idle_since(&self) -> Option<Instant> {
        if self.busy.load(Ordering::Acquire) != 0 {
            return None;
        }
        let bodies = self.bodies.load(Ordering::Acquire);
        if bodies == 0 {
            let active = self.active_ms.load(Ordering::Acquire);
            return Some(self.epoch + std::time::Duration::from_millis(active));
        }
        // Each answer going on counts once among those handed out and not asked for more
        // while its client holds it back: all of them, or not idle.
        if self.answers_unasked.load(Ordering::Relaxed) < bodies {
            return None;
        }
        let held = self.answer_unasked.elapsed(self.epoch)?;
        Instant::now().checked_sub(held)
    }
}

/// The connections one listener (or several, sharing a socket) may hold.
#[derive(Debug)]
pub struct Slots {
    permits: Arc<Semaphore>,
    /// How many permits there are in all.
    max: usize,
    peers: Mutex<HashMap<IpAddr, HashMap<u64, Arc<Tracked>>>>,
    next_id: AtomicU64,
    per_peer: usize,
    epoch: Instant,
    /// Connections asked to close for room that have not closed yet, nor begun a request.
    leaving: Arc<AtomicUsize>,
}

/// A connection's seat: gives back its slot and its place in its peer's count when dropped.
#[derive(Debug)]
pub(super) struct Seat {
    slots: Arc<Slots>,
    peer: IpAddr,
    pub(super) conn: Arc<Tracked>,
    /// Its slot of the cap: given back in [`Drop`], under the slots' lock.
    permit: Option<OwnedSemaphorePermit>,
}

/// A share in a connection's seat: the seat (its slot of the cap, its place in its
/// peer's count) is given back once the connection closed and every share is dropped. A
/// request that goes on after its client went away (the proxy runs admitted requests to
/// completion) keeps one while it uses an upstream connection, so the cap and the per-peer
/// cap bound those too.
#[derive(Clone, Debug)]
pub struct SeatHold {
    seat: Option<Arc<Seat>>,
}

impl SeatHold {
    /// The first share in `seat`.
    pub(super) fn new(seat: Seat) -> Self {
        Self {
            seat: Some(Arc::new(seat)),
        }
    }

    /// A share in no listener's seat, for tests of what keeps one.
    #[cfg(test)]
    pub(crate) fn unseated() -> Self {
        Self { seat: None }
    }

    /// The connection it is a share of.
    pub(super) fn conn(&self) -> Option<&Arc<Tracked>> {
        self.seat.as_ref().map(|seat| &seat.conn)
    }

    /// The connection closed: what is left of it holds its seat, and is nothing to close
    /// for room (see [`Tracked::idle`]).
    pub(super) fn closed(mut self) {
        let Some(seat) = self.seat.take() else { return };
        seat.conn.gone.store(true, Ordering::Release);
        match Arc::try_unwrap(seat) {
            // The last share: the seat is given back now, and stays counted as room on its
            // way until its slot is free. Uncounted first, a look for room in between would
            // find neither, and close another connection for the same newcomer.
            Ok(seat) => drop(seat),
            // A request of it goes on: picked for room, it is no longer room on its way; its
            // seat stays taken until the last share goes.
            Err(shared) => {
                // Let go of this share first: were it the last by now (the other dropped
                // meanwhile), its drop frees the slot before the uncount below finds it.
                let conn = shared.conn.clone();
                drop(shared);
                conn.uncount();
            }
        }
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut peers = self.slots.lock();
        // Under the lock, the slot before the count: a newcomer seated on the slot finds this
        // connection gone from its peer's count (`seat` takes the lock), and a look for room
        // that finds it no longer counted as on its way finds its slot free (`make_room`).
        drop(self.permit.take());
        self.conn.uncount();
        if let Some(mine) = peers.get_mut(&self.peer) {
            mine.remove(&self.conn.id);
            if mine.is_empty() {
                peers.remove(&self.peer);
            }
        }
    }
}

/// The oldest idle connection among `conns` with `authenticated` as given.
fn oldest_idle<'a>(
    conns: impl Iterator<Item = &'a Arc<Tracked>>,
    authenticated: bool,
) -> Option<&'a Arc<Tracked>> {
    conns
        .filter(|c| c.idle() && c.authenticated.load(Ordering::Acquire) == authenticated)
        .min_by_key(|c| c.id)
}

impl Slots {
    /// Room for `max` connections, `per_peer` of them from any one address (each at least 1).
    pub fn new(max: usize, per_peer: usize) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max.max(1))),
            max: max.max(1),
            peers: Mutex::default(),
            next_id: AtomicU64::new(0),
            per_peer: per_peer.max(1),
            epoch: Instant::now(),
            leaving: Arc::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, HashMap<u64, Arc<Tracked>>>> {
        self.peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn permits(&self) -> &Arc<Semaphore> {
        &self.permits
    }

    /// Seats a connection from `peer` on `permit`; `None` when the peer holds its cap and
    /// none of its connections is idle to make room (the newcomer is to be closed).
    pub(super) fn seat(
        self: &Arc<Self>,
        peer: IpAddr,
        permit: OwnedSemaphorePermit,
    ) -> Option<Seat> {
        let peer = peer_key(peer);
        let mut peers = self.lock();
        let mine = peers.entry(peer).or_default();
        if self.at_its_cap(mine) {
            let victim =
                oldest_idle(mine.values(), false).or_else(|| oldest_idle(mine.values(), true));
            match victim {
                Some(victim) => {
                    victim.pick();
                    tracing::debug!(%peer, "closing an idle connection of a peer at its cap, for its newcomer");
                }
                None => {
                    if mine.is_empty() {
                        peers.remove(&peer);
                    }
                    return None;
                }
            }
        }
        let conn = Arc::new(Tracked {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            asked: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            bodies: AtomicUsize::new(0),
            authenticated: AtomicBool::new(false),
            active_ms: AtomicU64::new(0),
            write_stalled: Since::default(),
            answers_unasked: AtomicUsize::new(0),
            answer_unasked: Since::default(),
            gone: AtomicBool::new(false),
            evict: Notify::new(),
            evicted: AtomicBool::new(false),
            counted: AtomicBool::new(false),
            leaving: self.leaving.clone(),
            epoch: self.epoch,
        });
        conn.touch();
        mine.insert(conn.id, conn.clone());
        Some(Seat {
            slots: self.clone(),
            peer,
            conn,
            permit: Some(permit),
        })
    }

    /// At the cap: asks one idle connection to close for a newcomer from `for_peer`, which
    /// will hold `holding` connections when it is seated: of the peer that holds the most,
    /// unauthenticated ones first, and only of `for_peer` itself or of a peer holding more
    /// than `holding` (those already asked to close not counted), so a lighter peer never
    /// gives up a connection to a heavier one's newcomer. False when none may be picked.
    pub(super) fn evict_for_room(&self, for_peer: IpAddr, holding: usize) -> bool {
        let for_peer = peer_key(for_peer);
        let peers = self.lock();
        let mut heaviest: Vec<(usize, &HashMap<u64, Arc<Tracked>>)> = peers
            .iter()
            .map(|(peer, mine)| (*peer, Self::staying(mine), mine))
            .filter(|&(peer, staying, _)| peer == for_peer || staying > holding)
            .map(|(_, staying, mine)| (staying, mine))
            .collect();
        heaviest.sort_by_key(|&(staying, _)| Reverse(staying));
        for authenticated in [false, true] {
            for (_, mine) in &heaviest {
                if let Some(victim) = oldest_idle(mine.values(), authenticated)
                    && victim.pick()
                {
                    tracing::debug!(
                        authenticated,
                        held = mine.len(),
                        "closing an idle connection of the peer that holds the most, to make room"
                    );
                    return true;
                }
            }
        }
        false
    }

    /// A peer's connections not asked to close.
    fn staying(mine: &HashMap<u64, Arc<Tracked>>) -> usize {
        // One picked for room that closed but still holds its seat (a request of it going on
        // upstream) is no room on its way: it stays until that request ends.
        mine.len()
            - mine
                .values()
                .filter(|c| c.evicted.load(Ordering::Acquire) && !c.gone.load(Ordering::Acquire))
                .count()
    }

    /// Whether a newcomer from `peer` could be seated: not when the peer holds its cap with
    /// every connection answering a request and none leaving ([`seat`](Self::seat) would
    /// close it), so it need not wait, nor have room made for it.
    pub(super) fn could_seat(&self, peer: IpAddr) -> bool {
        let peers = self.lock();
        peers
            .get(&peer_key(peer))
            .is_none_or(|mine| !self.at_its_cap(mine) || mine.values().any(|c| c.idle()))
    }

    /// A slot for an upstream connection beyond the one each client connection counts on
    /// (each concurrent stream of an HTTP/2 client at the proxy uses one): taken only while
    /// more than half of all slots stay free, and never ahead of a newcomer waiting for one.
    /// So connections and such extras together stay within the cap, which leaves as many
    /// file descriptors again for upstream connections, and one client's streams take no
    /// more room than the connections of one address may. `None` when there is none to spare.
    pub fn try_extra(&self) -> Option<OwnedSemaphorePermit> {
        if self.permits.available_permits() <= self.max / 2 {
            return None;
        }
        self.permits.clone().try_acquire_owned().ok()
    }

    /// Whether a peer holding `mine` holds its cap, not counting those already leaving.
    fn at_its_cap(&self, mine: &HashMap<u64, Arc<Tracked>>) -> bool {
        Self::staying(mine) >= self.per_peer
    }

    /// Connections asked to close for room that have not closed yet: the room on its way.
    pub(super) fn leaving(&self) -> usize {
        self.leaving.load(Ordering::SeqCst)
    }

    /// Room for newcomers now or on its way: slots free, and connections asked to close for
    /// room that have not closed yet. Read in that order against [`Seat`]'s drop (slot freed,
    /// then uncounted), so a connection between the two counts at least once.
    pub(super) fn room(&self) -> usize {
        let leaving = self.leaving();
        leaving + self.permits.available_permits()
    }

    /// Connections open now from each of `peers` (each counted by its [`peer_key`]), in order.
    pub(super) fn held_by_each(&self, peers: impl Iterator<Item = IpAddr>) -> Vec<usize> {
        let held = self.lock();
        peers
            .map(|peer| held.get(&peer_key(peer)).map_or(0, HashMap::len))
            .collect()
    }

    /// Connections open now from `peer`.
    #[cfg(test)]
    fn held_by(&self, peer: IpAddr) -> usize {
        self.held_by_each(std::iter::once(peer))[0]
    }
}

#[cfg(test)]
mod tests;

/// A moment kept in an atomic, as ms since the slots began plus one (0: none), for one
/// connection's task to mark and its eviction to read.
#[derive(Debug, Default)]
struct Since(AtomicU64);

impl Since {
    /// Now, unless a moment is kept already.
    fn mark(&self, epoch: Instant) {
        if self.0.load(Ordering::Relaxed) == 0 {
            let _ =
                self.0
                    .compare_exchange(0, Self::now(epoch), Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// Now, whatever was kept.
    fn set(&self, epoch: Instant) {
        self.0.store(Self::now(epoch), Ordering::Relaxed);
    }

    fn now(epoch: Instant) -> u64 {
        u64::try_from(epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    fn clear(&self) {
        if self.0.load(Ordering::Relaxed) != 0 {
            self.0.store(0, Ordering::Relaxed);
        }
    }

    /// How long ago the kept moment was, if one is kept.
    fn elapsed(&self, epoch: Instant) -> Option<std::time::Duration> {
        let at = self.0.load(Ordering::Relaxed);
        (at != 0).then(|| {
            epoch
                .elapsed()
                .saturating_sub(std::time::Duration::from_millis(at - 1))
        })
    }
}
