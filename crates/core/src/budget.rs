//! A retry budget: a token bucket that limits retries to a fraction of recent first attempts.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::clock::{Clock, SystemClock};

/// What a policy decides when the retry budget is empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum BudgetExhausted {
    /// Dead-letter the message with reason
    /// [`DeadLetterReason::BudgetExhausted`](crate::DeadLetterReason::BudgetExhausted).
    #[default]
    DeadLetter,
    /// Retry anyway, but no sooner than this delay (the policy uses the larger of its own delay
    /// and this one). The retry still counts against `max_retries`.
    RetryLater(Duration),
}

/// Settings of a [`RetryBudget`]. The defaults are Finagle's `RetryBudget` defaults.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct BudgetConfig {
    /// How long a deposit (or a withdrawal) counts. Default 10 s.
    pub ttl: Duration,
    /// A reserve of retries per second allowed whatever the traffic, so that a consumer that
    /// sees few messages can still retry. Default 10.
    pub min_retries_per_sec: u32,
    /// Retries allowed per first attempt, e.g. 0.2 = 20 %. Default 0.2. NaN and negative
    /// values count as 0, values above 1000 as 1000 (Finagle's bounds).
    pub percent_can_retry: f64,
    /// What to do when the budget is empty. Default [`BudgetExhausted::DeadLetter`].
    pub when_exhausted: BudgetExhausted,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        BudgetConfig {
            ttl: Duration::from_secs(10),
            min_retries_per_sec: 10,
            percent_can_retry: 0.2,
            when_exhausted: BudgetExhausted::DeadLetter,
        }
    }
}

/// Fixed point: one retry is worth this many units, so 20 % is exactly 200 000 per deposit.
const SCALE: i64 = 1_000_000;
/// Number of slices of the sliding window (as Finagle's `WindowedAdder`).
const SLICES: usize = 10;

/// A retry budget with Finagle `RetryBudget` semantics (the same idea as gRPC retry
/// throttling): every first attempt deposits `percent_can_retry` of a token, every retry
/// withdraws one, and tokens expire after `ttl`. On top of that a constant reserve of
/// `min_retries_per_sec * ttl` tokens lets a quiet consumer retry at all. A retry is allowed
/// while the balance is at least one token.
///
/// This is how a whole fleet stops amplifying an outage: when every message fails, retries
/// stay at about 20 % of the traffic (plus the reserve) instead of multiplying it.
///
/// Clones share the same bucket; all methods take `&self` and are thread-safe.
///
/// ```
/// use std::time::Duration;
/// use redeliver::{BudgetConfig, RetryBudget};
/// use redeliver::policy::ManualClock;
///
/// let clock = ManualClock::new();
/// let budget = RetryBudget::with_clock(
///     BudgetConfig { min_retries_per_sec: 0, ..BudgetConfig::default() },
///     clock.clone(),
/// );
/// for _ in 0..10 {
///     budget.deposit(); // 10 first attempts at 20 % = 2 retries
/// }
/// assert!(budget.try_withdraw());
/// assert!(budget.try_withdraw());
/// assert!(!budget.try_withdraw());
/// clock.advance(Duration::from_secs(11)); // everything expired
/// assert_eq!(budget.balance(), 0);
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    config: BudgetConfig,
    clock: Box<dyn Clock>,
    deposit_amount: i64,
    reserve: i64,
    slice_nanos: u128,
    window: Mutex<Window>,
}

struct Window {
    slices: [i64; SLICES],
    /// Index of the current slice, i.e. `now / slice_len`.
    current: u128,
}

impl RetryBudget {
    /// A budget on the real monotonic clock.
    pub fn new(cfg: BudgetConfig) -> Self {
        Self::with_clock(cfg, SystemClock::new())
    }

    /// A budget on the given clock (a [`ManualClock`](crate::ManualClock) in tests).
    pub fn with_clock(cfg: BudgetConfig, clock: impl Clock + 'static) -> Self {
        let pct = if cfg.percent_can_retry > 0.0 {
            cfg.percent_can_retry.min(1000.0)
        } else {
            0.0
        };
        let deposit_amount = (pct * SCALE as f64).round() as i64;
        let reserve_f = f64::from(cfg.min_retries_per_sec) * cfg.ttl.as_secs_f64() * SCALE as f64;
        // `as` saturates for floats, so an enormous reserve is just i64::MAX / 2, leaving room
        // for the additions below.
        let reserve = (reserve_f as i64).min(i64::MAX / 2);
        // A zero ttl would mean a zero-length window; a nanosecond per slice is the least.
        let slice_nanos = (cfg.ttl.as_nanos() / SLICES as u128).max(1);
        let current = clock.now().as_nanos() / slice_nanos;
        RetryBudget {
            inner: Arc::new(Inner {
                config: cfg,
                clock: Box::new(clock),
                deposit_amount,
                reserve,
                slice_nanos,
                window: Mutex::new(Window {
                    slices: [0; SLICES],
                    current,
                }),
            }),
        }
    }

    /// The configuration this budget was built from.
    pub fn config(&self) -> &BudgetConfig {
        &self.inner.config
    }

    /// What a policy should do when this budget is empty.
    pub fn when_exhausted(&self) -> BudgetExhausted {
        self.inner.config.when_exhausted
    }

    /// Records a first attempt (success or failure): adds `percent_can_retry` of a token.
    pub fn deposit(&self) {
        let amount = self.inner.deposit_amount;
        self.with_window(|w| w.add(amount));
    }

    /// Takes one token for a retry if the balance allows it; `false` means the retry should not
    /// happen.
    pub fn try_withdraw(&self) -> bool {
        let reserve = self.inner.reserve;
        self.with_window(|w| {
            if w.sum().saturating_add(reserve) >= SCALE {
                w.add(-SCALE);
                true
            } else {
                false
            }
        })
    }

    /// How many retries the budget would allow right now.
    pub fn balance(&self) -> u64 {
        let reserve = self.inner.reserve;
        let tokens = self.with_window(|w| w.sum().saturating_add(reserve)) / SCALE;
        u64::try_from(tokens).unwrap_or(0)
    }

    fn with_window<T>(&self, f: impl FnOnce(&mut Window) -> T) -> T {
        let now = self.inner.clock.now().as_nanos() / self.inner.slice_nanos;
        let mut w = self.lock();
        w.expire(now);
        f(&mut w)
    }

    fn lock(&self) -> MutexGuard<'_, Window> {
        // The window is a set of counters, consistent after any panic: keep using it.
        self.inner
            .window
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Window {
    fn index(slice: u128) -> usize {
        (slice % SLICES as u128) as usize
    }

    /// Moves the window to slice `now`, zeroing the slices that fell out of it.
    fn expire(&mut self, now: u128) {
        if now <= self.current {
            return;
        }
        let steps = (now - self.current).min(SLICES as u128);
        for k in 1..=steps {
            self.slices[Self::index(self.current + k)] = 0;
        }
        self.current = now;
    }

    fn add(&mut self, amount: i64) {
        let i = Self::index(self.current);
        self.slices[i] = self.slices[i].saturating_add(amount);
    }

    fn sum(&self) -> i64 {
        self.slices.iter().fold(0i64, |a, s| a.saturating_add(*s))
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("config", &self.inner.config)
            .field("balance", &self.balance())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn budget(cfg: BudgetConfig) -> (RetryBudget, ManualClock) {
        let clock = ManualClock::new();
        (RetryBudget::with_clock(cfg, clock.clone()), clock)
    }

    fn no_reserve() -> BudgetConfig {
        BudgetConfig {
            min_retries_per_sec: 0,
            ..BudgetConfig::default()
        }
    }

    fn drain(b: &RetryBudget) -> u32 {
        let mut n = 0;
        while b.try_withdraw() {
            n += 1;
            assert!(n < 1_000_000, "budget never empties");
        }
        n
    }

    #[test]
    fn defaults_are_finagles() {
        let c = BudgetConfig::default();
        assert_eq!(c.ttl, Duration::from_secs(10));
        assert_eq!(c.min_retries_per_sec, 10);
        assert_eq!(c.percent_can_retry, 0.2);
        assert_eq!(c.when_exhausted, BudgetExhausted::DeadLetter);
    }

    #[test]
    fn reserve_alone_is_min_retries_per_sec_times_ttl() {
        let (b, _) = budget(BudgetConfig::default());
        assert_eq!(b.balance(), 100);
        assert_eq!(drain(&b), 100);
        assert_eq!(b.balance(), 0);
    }

    #[test]
    fn twenty_percent_of_deposits_exactly() {
        let (b, _) = budget(no_reserve());
        assert_eq!(b.balance(), 0);
        assert!(!b.try_withdraw());
        for _ in 0..4 {
            b.deposit();
        }
        assert_eq!(b.balance(), 0, "4 * 0.2 is less than one retry");
        b.deposit();
        assert_eq!(b.balance(), 1);
        for _ in 0..95 {
            b.deposit();
        }
        assert_eq!(b.balance(), 20);
        assert_eq!(drain(&b), 20);
        assert!(b.when_exhausted() == BudgetExhausted::DeadLetter);
    }

    #[test]
    fn deposits_and_withdrawals_expire_after_ttl() {
        let (b, clock) = budget(no_reserve());
        for _ in 0..50 {
            b.deposit(); // 10 retries worth at t = 0
        }
        clock.advance(Duration::from_secs(5));
        for _ in 0..50 {
            b.deposit(); // 10 more at t = 5 s
        }
        assert_eq!(b.balance(), 20);
        assert_eq!(drain(&b), 20); // withdrawn at t = 5 s
        clock.advance(Duration::from_secs(5)); // t = 10 s: the first deposits expire
        assert_eq!(
            b.balance(),
            0,
            "withdrawals (at 5 s) outlive the deposits of 0 s"
        );
        clock.advance(Duration::from_secs(6)); // t = 16 s: everything expired
        assert_eq!(b.balance(), 0);
        b.deposit();
        b.deposit();
        b.deposit();
        b.deposit();
        b.deposit();
        assert_eq!(b.balance(), 1);
        clock.advance(Duration::from_secs(3600));
        assert_eq!(b.balance(), 0);
    }

    #[test]
    fn withdrawals_expire_too_so_the_reserve_refills() {
        let (b, clock) = budget(BudgetConfig::default());
        assert_eq!(drain(&b), 100);
        clock.advance(Duration::from_secs(11));
        assert_eq!(b.balance(), 100);
    }

    #[test]
    fn clones_share_the_bucket() {
        let (b, _) = budget(no_reserve());
        let b2 = b.clone();
        for _ in 0..5 {
            b.deposit();
        }
        assert!(b2.try_withdraw());
        assert!(!b.try_withdraw());
    }

    #[test]
    fn odd_configs_do_not_panic() {
        for pct in [f64::NAN, -1.0, 0.0, f64::INFINITY, 1e9] {
            let (b, clock) = budget(BudgetConfig {
                ttl: Duration::ZERO,
                percent_can_retry: pct,
                ..no_reserve()
            });
            b.deposit();
            let _ = b.try_withdraw();
            clock.advance(Duration::MAX);
            let _ = b.balance();
        }
        let (b, _) = budget(BudgetConfig {
            percent_can_retry: 0.0,
            ..no_reserve()
        });
        for _ in 0..1000 {
            b.deposit();
        }
        assert!(!b.try_withdraw(), "0 % allows no retries");
        let (b, _) = budget(BudgetConfig {
            percent_can_retry: 1e9,
            ..no_reserve()
        });
        b.deposit();
        assert_eq!(
            b.balance(),
            1000,
            "clamped to Finagle's 1000 retries per request"
        );
        let (b, _) = budget(BudgetConfig {
            ttl: Duration::MAX,
            min_retries_per_sec: u32::MAX,
            ..BudgetConfig::default()
        });
        assert!(b.try_withdraw());
        b.deposit();
        assert!(b.balance() > 0);
    }

    #[test]
    fn time_going_backwards_is_ignored() {
        let (b, clock) = budget(no_reserve());
        clock.set(Duration::from_secs(100));
        for _ in 0..5 {
            b.deposit();
        }
        clock.set(Duration::from_secs(1));
        assert_eq!(b.balance(), 1);
    }

    #[test]
    fn poisoned_lock_is_recovered() {
        let (b, _) = budget(BudgetConfig::default());
        let b2 = b.clone();
        let _ = std::thread::spawn(move || {
            let _guard = b2.lock();
            panic!("poison the budget");
        })
        .join();
        assert!(b.inner.window.is_poisoned());
        assert!(b.try_withdraw());
        assert_eq!(b.balance(), 99);
        assert!(format!("{b:?}").contains("balance: 99"));
    }
}
