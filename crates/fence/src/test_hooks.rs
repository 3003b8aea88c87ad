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

/// The environment variable that makes `fence run` take the process it names (`command` or
/// `watchdog`) for one stuck in uninterruptible sleep, which not even a SIGKILL ends: its
/// waits for it never return. `leftover`: once the watchdog is reaped, a process of the
/// command's tree is seen left (as one in uninterruptible sleep that outlived the watchdog's
/// SIGKILL of the group would be).
pub const STUCK_AFTER_KILL: &str = "FENCE_TEST_STUCK_AFTER_KILL";

/// Whether [`STUCK_AFTER_KILL`] names `who`.
pub fn stuck_after_kill(who: &str) -> bool {
    std::env::var(STUCK_AFTER_KILL).is_ok_and(|named| named == who)
}
