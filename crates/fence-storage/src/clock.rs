//! The store's clock: wall time in milliseconds since the Unix epoch, injectable for tests.
//!
//! Expiry is persisted as the store's wall-clock time, so a restart neither extends nor
//! shortens a lease. Only stores read this clock; workers measure their own deadline on a
//! monotonic clock.
//!
//! ```
//! use fence_storage::clock::{Clock, ManualClock};
//! use std::time::Duration;
//!
//! let clock = ManualClock::new(1_000);
//! clock.advance(Duration::from_millis(500));
//! assert_eq!(clock.now_ms(), 1_500);
//! ```

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// A source of wall-clock time for a lease store.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;

    /// Milliseconds on a clock that only moves forward, at the rate of real time, from an
    /// arbitrary start: what measures time *within* one process, where a step of the wall
    /// clock (NTP after a boot) must not count as time passed. The default reads the
    /// operating system's monotonic clock: a clock of your own that moves time by hand (for
    /// tests) implements this too, or the sled sink store's restart wait and forgetting
    /// count only real time passed since it was opened, and the sink stores' idempotency
    /// records (in-flight timeout, retention) expire only as real time passes.
    fn monotonic_ms(&self) -> u64 {
        static START: std::sync::LazyLock<std::time::Instant> =
            std::sync::LazyLock::new(std::time::Instant::now);
        u64::try_from(START.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Which boot of the machine this is, and the milliseconds since it on a clock that
    /// counts real time and is shared by every process of that boot (Linux: `boot_id` and
    /// `CLOCK_BOOTTIME`, read from `/proc`): compared with a reading an earlier process
    /// recorded, it tells how much real time passed between the two, so a step of the wall
    /// clock in between can be told from time passed. `None` (the default) when not known;
    /// the sled sink store then cannot tell a step between two processes from time passed.
    fn since_boot(&self) -> Option<BootReading> {
        None
    }
}

/// A reading of the time since the machine booted ([`Clock::since_boot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootReading {
    /// Which boot: equal for every process of one boot, different after a reboot.
    pub boot: u128,
    /// Milliseconds since that boot, real time (a suspended machine's sleep included).
    pub ms: u64,
}

impl BootReading {
    /// The machine's reading (Linux; `None` elsewhere or when `/proc` cannot be read).
    pub fn of_machine() -> Option<Self> {
        let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let boot = u128::from_str_radix(&id.trim().replace('-', ""), 16).ok()?;
        // "12345.67 23456.78": seconds since boot (CLOCK_BOOTTIME), to the hundredth.
        let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
        let (secs, hundredths) = uptime.split_whitespace().next()?.split_once('.')?;
        let ms = secs
            .parse::<u64>()
            .ok()?
            .checked_mul(1_000)?
            .checked_add(hundredths.get(..2)?.parse::<u64>().ok()? * 10)?;
        Some(Self { boot, ms })
    }
}

/// The operating system's clock.
#[derive(Debug, Default)]
pub struct SystemClock {
    #[cfg(feature = "test-hooks")]
    offset_ms: std::sync::atomic::AtomicI64,
}

impl SystemClock {
    /// The system clock as it is.
    pub fn new() -> Self {
        Self::default()
    }

    /// Test hook (feature `test-hooks`): the system clock shifted by `offset_ms` (negative:
    /// behind), for fault tests of a server whose clock is off.
    #[cfg(feature = "test-hooks")]
    pub fn with_offset_ms(offset_ms: i64) -> Self {
        Self {
            offset_ms: std::sync::atomic::AtomicI64::new(offset_ms),
        }
    }
}

/// The system clock in ms since the Unix epoch (0 before it).
pub fn system_now_ms() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    u64::try_from(now.as_millis()).unwrap_or(u64::MAX)
}

impl Clock for SystemClock {
    #[cfg(not(feature = "test-hooks"))]
    fn now_ms(&self) -> u64 {
        system_now_ms()
    }

    #[cfg(feature = "test-hooks")]
    fn now_ms(&self) -> u64 {
        system_now_ms().saturating_add_signed(self.offset_ms.load(Ordering::Relaxed))
    }

    fn since_boot(&self) -> Option<BootReading> {
        BootReading::of_machine()
    }
}

/// A clock that only moves when told to. [`advance`](Self::advance) and a forward
/// [`shift_ms`](Self::shift_ms) are time passing (its monotonic reading moves too);
/// [`set_ms`](Self::set_ms), [`step_ms`](Self::step_ms) and a backward `shift_ms` are steps
/// of the wall clock only.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
    monotonic_ms: Arc<AtomicU64>,
    /// Which boot [`Clock::since_boot`] reports (its monotonic reading the time since it);
    /// 0: none reported.
    boot: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `now_ms`, reporting no boot.
    pub fn new(now_ms: u64) -> Self {
        Self {
            now_ms: Arc::new(AtomicU64::new(now_ms)),
            monotonic_ms: Arc::default(),
            boot: Arc::default(),
        }
    }

    /// The same clock, reporting the time since a boot ([`Clock::since_boot`]) as its
    /// monotonic reading: every clone of it is a process of that boot, so a step of the wall
    /// clock between two of them can be told from time passed.
    #[must_use]
    pub fn with_boot(self) -> Self {
        self.boot.store(1, Ordering::SeqCst);
        self
    }

    /// A new boot: what a process recorded before it no longer compares.
    pub fn reboot(&self) {
        self.boot.fetch_add(1, Ordering::SeqCst);
    }

    /// Moves the clock forward: time passes.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.now_ms.fetch_add(by, Ordering::SeqCst);
        self.monotonic_ms.fetch_add(by, Ordering::SeqCst);
    }

    /// Moves the clock by `ms`, never below 0: forward, time passes; backwards, the wall
    /// clock jumps (the monotonic reading stays).
    pub fn shift_ms(&self, ms: i64) {
        self.step_ms(ms);
        if let Ok(forward) = u64::try_from(ms) {
            self.monotonic_ms.fetch_add(forward, Ordering::SeqCst);
        }
    }

    /// Steps the wall clock by `ms` (backwards when negative), never below 0, as NTP does:
    /// no time passes on the monotonic reading.
    pub fn step_ms(&self, ms: i64) {
        let _ = self
            .now_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add_signed(ms))
            });
    }

    /// Sets the clock, also backwards (a clock jump).
    pub fn set_ms(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn monotonic_ms(&self) -> u64 {
        self.monotonic_ms.load(Ordering::SeqCst)
    }

    fn since_boot(&self) -> Option<BootReading> {
        match self.boot.load(Ordering::SeqCst) {
            0 => None,
            boot => Some(BootReading {
                boot: u128::from(boot),
                ms: self.monotonic_ms(),
            }),
        }
    }
}

/// A wall clock that advances with tokio's clock, so `#[tokio::test(start_paused = true)]`
/// drives store-side expiry too; `offset_ms` shifts it against the worker's view.
#[derive(Debug, Clone)]
pub struct TokioClock {
    base_ms: u64,
    base: tokio::time::Instant,
    offset_ms: i64,
}

impl TokioClock {
    /// A clock that reads `base_ms + offset_ms` now and moves with `tokio::time`.
    pub fn new(base_ms: u64, offset_ms: i64) -> Self {
        Self {
            base_ms,
            base: tokio::time::Instant::now(),
            offset_ms,
        }
    }
}

impl Clock for TokioClock {
    fn now_ms(&self) -> u64 {
        self.base_ms
            .saturating_add(self.monotonic_ms())
            .saturating_add_signed(self.offset_ms)
    }

    fn monotonic_ms(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// Moves a store's clock by a signed number of milliseconds (negative: the clock jumps
/// backwards): how a conformance suite makes time pass, or jump, for a backend whatever its
/// clock is (a [`ManualClock`], or a database's clock shifted by a test hook).
pub type Advance = Box<dyn Fn(i64) + Send + Sync>;

/// An [`Advance`] for a [`ManualClock`].
pub fn advance_fn(clock: ManualClock) -> Advance {
    Box::new(move |ms| clock.shift_ms(ms))
}

/// `d` in milliseconds, as an [`Advance`] forward.
pub fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
