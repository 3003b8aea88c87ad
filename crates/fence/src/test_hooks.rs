//! Test hooks (feature `test-hooks`): what the fault-injection harness sets; never shipped.

use std::sync::atomic::{AtomicI64, Ordering};

static CLOCK_OFFSET_MS: AtomicI64 = AtomicI64::new(0);

/// Shifts the clock of the lease store this process opens (`--clock-offset-ms`).
pub fn set_clock_offset_ms(ms: i64) {
    CLOCK_OFFSET_MS.store(ms, Ordering::SeqCst);
}

/// The shift set by [`set_clock_offset_ms`].
pub fn clock_offset_ms() -> i64 {
    CLOCK_OFFSET_MS.load(Ordering::SeqCst)
}
