//! Injectable time, so that the retry budget can be tested deterministically.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A monotonic clock: the time elapsed since some fixed origin of the clock's choosing.
pub trait Clock: Send + Sync {
    /// Time since the clock's origin. Must never go backwards (if it does, the budget treats
    /// it as no time passing).
    fn now(&self) -> Duration;
}

/// The real monotonic clock ([`Instant`]), with its origin at creation.
#[derive(Clone, Copy, Debug)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    /// A clock starting at zero now.
    pub fn new() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that only moves when told to, for tests. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use redeliver::policy::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let c2 = clock.clone();
/// clock.advance(Duration::from_secs(3));
/// assert_eq!(c2.now(), Duration::from_secs(3));
/// ```
#[derive(Clone, Default)]
pub struct ManualClock {
    // Nanoseconds; u64 covers 584 years, and advancing saturates.
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `d` (saturating at about 584 years).
    pub fn advance(&self, d: Duration) {
        let add = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // fetch_update with a closure that always returns Some cannot fail.
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_add(add))
            });
    }

    /// Sets the clock to `t` since its origin (moving it backwards is allowed but the budget
    /// ignores backward steps).
    pub fn set(&self, t: Duration) {
        let n = u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.store(n, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ManualClock").field(&self.now()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_advances_saturating_and_shares_time() {
        let c = ManualClock::new();
        assert_eq!(c.now(), Duration::ZERO);
        let c2 = c.clone();
        c.advance(Duration::from_millis(1500));
        assert_eq!(c2.now(), Duration::from_millis(1500));
        c.advance(Duration::MAX);
        assert_eq!(c.now(), Duration::from_nanos(u64::MAX));
        c.set(Duration::from_secs(1));
        assert_eq!(c2.now(), Duration::from_secs(1));
    }

    #[test]
    fn system_clock_is_monotonic() {
        let c = SystemClock::new();
        let a = c.now();
        let b = c.now();
        assert!(b >= a);
    }
}
