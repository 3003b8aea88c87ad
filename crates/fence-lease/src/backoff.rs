//! Pauses between retries: doubling up to a ceiling, each drawn at random from its upper half.

use std::time::Duration;

/// Exponential backoff with "equal jitter": the pause doubles after every failed attempt, up
/// to `max`, and each pause is drawn uniformly from the upper half of its step, so many
/// clients that failed together do not retry together.
///
/// ```
/// use fence_lease::Backoff;
/// use std::time::Duration;
///
/// let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
/// let first = backoff.next_pause();
/// assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
/// for _ in 0..10 {
///     assert!(backoff.next_pause() <= Duration::from_secs(2));
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    step: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `first` (at least 1 ms) and doubles up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        let first = first.max(Duration::from_millis(1));
        Self {
            first,
            step: first,
            max: max.max(first),
        }
    }

    /// The pause before the next attempt.
    pub fn next_pause(&mut self) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.max);
        let half = step / 2;
        let nanos = u64::try_from((step - half).as_nanos()).unwrap_or(u64::MAX);
        half + Duration::from_nanos(fastrand::u64(0..=nanos))
    }

    /// Starts over at the first pause (after a success).
    pub fn reset(&mut self) {
        self.step = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_within_their_bounds_and_reset() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(100), ms(700));
        for step in [100, 200, 400, 700, 700] {
            let pause = b.next_pause();
            assert!(
                pause >= ms(step) / 2 && pause <= ms(step),
                "{pause:?} for {step}"
            );
        }
        b.reset();
        assert!(b.next_pause() <= ms(100));
        let spread: std::collections::HashSet<_> = (0..50)
            .map(|_| Backoff::new(ms(100), ms(100)).next_pause())
            .collect();
        assert!(spread.len() > 10, "jitter spreads pauses: {spread:?}");
    }
}
