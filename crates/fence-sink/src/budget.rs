//! One cap on the bytes of bodies a layer holds in memory, and each peer's share of it.
//!
//! Buffered idempotent requests, responses captured for storage and replays all count. A
//! [`Reservation`] travels with the bytes it covers and gives them back to the [`Budget`]
//! when dropped. The bodies of a request from a known peer (a [`PeerAddr`](crate::PeerAddr)
//! in its extensions, as `fence proxy` puts there: its own body read whole, a replay, an
//! answer kept) also count against that peer's share, a [`PEER_SHARE`]th of the cap, unless
//! the peer holds nothing else: one client stalling many bodies cannot hold all of it and
//! starve every other client's keyed requests.

use std::{
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use dashmap::DashMap;

/// One peer's bodies hold at most this fraction of the cap (a quarter), unless it holds
/// nothing else.
pub(crate) const PEER_SHARE: usize = 4;

/// The bytes held now by every clone of one layer, and by each peer's bodies.
#[derive(Debug, Default)]
pub(crate) struct Budget {
    used: AtomicUsize,
    peers: DashMap<IpAddr, usize>,
}

/// Why a [`Reservation`] could not grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// The layer holds its cap.
    Total,
    /// The peer's bodies hold its share of the cap.
    Peer,
}

impl Budget {
    /// The bytes held now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// Bytes taken from a [`Budget`], given back on drop.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<Budget>,
    bytes: usize,
    /// The peer whose share these bytes also count against, if any.
    peer: Option<IpAddr>,
}

impl Reservation {
    /// An empty reservation whose bytes also count against `peer`'s share of the cap
    /// (its [`peer_key`](crate::refusals::peer_key)).
    pub(crate) fn of_peer(budget: &Arc<Budget>, peer: Option<IpAddr>) -> Self {
        Reservation {
            budget: budget.clone(),
            bytes: 0,
            peer: peer.map(crate::refusals::peer_key),
        }
    }

    /// Takes `more` bytes if that keeps the budget's total within `max`; false (and nothing
    /// taken) otherwise.
    #[cfg(test)]
    fn grow(&mut self, more: usize, max: usize) -> bool {
        self.take(more, max).is_ok()
    }

    /// Takes `more` bytes if that keeps the budget's total within `max` and the peer's
    /// bytes within its share of `max`; nothing taken otherwise.
    pub(crate) fn take(&mut self, more: usize, max: usize) -> Result<(), Full> {
        let Reservation {
            budget,
            bytes,
            peer,
        } = self;
        let Some(peer) = peer.filter(|_| more > 0) else {
            return take_total(&budget.used, bytes, more, max);
        };
        let share = max.div_ceil(PEER_SHARE);
        let mut held = budget.peers.entry(peer).or_insert(0);
        // A peer holding nothing but this reservation may always take what the total
        // allows: one body larger than a share (a small cap, many clients behind one
        // address), arriving in any number of frames, is never refused for ever.
        let others = held.saturating_sub(*bytes);
        let taken = if others > 0 && held.checked_add(more).is_none_or(|t| t > share) {
            Err(Full::Peer)
        } else {
            take_total(&budget.used, bytes, more, max)
        };
        match taken {
            Ok(()) => *held += more,
            Err(_) if *held == 0 => {
                drop(held);
                budget.peers.remove_if(&peer, |_, held| *held == 0);
            }
            Err(_) => {}
        }
        taken
    }
}

/// Takes `more` bytes of `used` (counted in `bytes`) if that keeps it within `max`.
fn take_total(used: &AtomicUsize, bytes: &mut usize, more: usize, max: usize) -> Result<(), Full> {
    let taken = used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
        used.checked_add(more).filter(|total| *total <= max)
    });
    if taken.is_ok() {
        *bytes += more;
    }
    taken.map(drop).map_err(|_| Full::Total)
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        if let Some(peer) = self.peer {
            if let Some(mut held) = self.budget.peers.get_mut(&peer) {
                *held = held.saturating_sub(self.bytes);
            }
            self.budget.peers.remove_if(&peer, |_, held| *held == 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Budget {
        /// Takes `bytes` for no peer if that keeps the total within `max`.
        fn reserve(self: &Arc<Self>, bytes: usize, max: usize) -> Option<Reservation> {
            let mut reservation = Reservation::of_peer(self, None);
            reservation.grow(bytes, max).then_some(reservation)
        }
    }

    #[test]
    fn reservations_stay_within_the_cap_and_give_back_on_drop() {
        let budget = Arc::new(Budget::default());
        let mut a = budget.reserve(60, 100).unwrap();
        assert!(budget.reserve(41, 100).is_none(), "over the cap");
        let b = budget.reserve(40, 100).unwrap();
        assert!(!a.grow(1, 100));
        assert_eq!(budget.used(), 100);
        drop(b);
        assert!(a.grow(40, 100));
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 0);
        let all = budget.reserve(usize::MAX, usize::MAX).unwrap();
        assert!(budget.reserve(1, usize::MAX).is_none(), "no overflow");
        drop(all);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_peer_holds_at_most_its_share_and_others_still_fit() {
        let budget = Arc::new(Budget::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let mut first = Reservation::of_peer(&budget, Some(a));
        assert_eq!(first.take(25, 100), Ok(()));
        // The same peer through a dual-stack socket is the same peer.
        let mut second = Reservation::of_peer(&budget, Some(mapped));
        assert_eq!(second.take(1, 100), Err(Full::Peer));
        let mut other = Reservation::of_peer(&budget, Some(b));
        assert_eq!(other.take(25, 100), Ok(()));
        let mut unattributed = budget.reserve(0, usize::MAX).unwrap();
        assert_eq!(unattributed.take(50, 100), Ok(()));
        let mut third = Reservation::of_peer(&budget, Some("10.0.0.3".parse().unwrap()));
        assert_eq!(third.take(1, 100), Err(Full::Total));
        drop(first);
        assert_eq!(second.take(25, 100), Ok(()));
        drop((second, other, unattributed, third));
        assert_eq!(budget.used(), 0);
        assert!(budget.peers.is_empty(), "no peer left counted");
        // Nothing taken leaves nothing counted; a peer holding nothing may take more than a
        // share when the total allows (one body larger than a share is not refused for
        // ever), and then nothing more.
        let mut empty = Reservation::of_peer(&budget, Some(a));
        assert_eq!(empty.take(0, 100), Ok(()));
        assert!(budget.peers.is_empty(), "an empty take counted a peer");
        // In several frames, as a body arrives.
        for _ in 0..6 {
            assert_eq!(empty.take(10, 100), Ok(()));
        }
        let mut another = Reservation::of_peer(&budget, Some(a));
        assert_eq!(another.take(1, 100), Err(Full::Peer));
        drop((empty, another));
        assert!(budget.peers.is_empty() && budget.used() == 0);
    }
}
