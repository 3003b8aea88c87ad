//! One cap on the bytes of bodies a layer holds in memory.
//!
//! Buffered idempotent requests, responses captured for storage and replays all count. A
//! [`Reservation`] travels with the bytes it covers and gives them back to the [`Budget`]
//! when dropped.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

/// The bytes held now by every clone of one layer.
#[derive(Debug, Default)]
pub(crate) struct Budget {
    used: AtomicUsize,
}

impl Budget {
    /// Takes `bytes` if that keeps the total within `max`.
    pub(crate) fn reserve(self: &Arc<Self>, bytes: usize, max: usize) -> Option<Reservation> {
        let mut reservation = Reservation {
            budget: self.clone(),
            bytes: 0,
        };
        reservation.grow(bytes, max).then_some(reservation)
    }

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
}

impl Reservation {
    /// Takes `more` bytes if that keeps the budget's total within `max`; false (and nothing
    /// taken) otherwise.
    pub(crate) fn grow(&mut self, more: usize, max: usize) -> bool {
        let taken = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(more).filter(|total| *total <= max)
            });
        if taken.is_ok() {
            self.bytes += more;
        }
        taken.is_ok()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
