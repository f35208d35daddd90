//! Un-jittered delay schedules, and [`Delays`]: a schedule with its jitter as an iterator.

use std::fmt;
use std::iter::FusedIterator;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::jitter::{os_seeded_rng, Jitter};
use crate::nanos::{from_nanos_f64, from_nanos_saturating};

/// How long to wait before retry number `attempt` (0 = first retry), before any jitter.
///
/// Every variant saturates instead of overflowing: any `attempt` up to `u32::MAX`, any factor
/// (even NaN or infinity) and any durations up to [`Duration::MAX`] give a result without
/// panicking.
///
/// ```
/// use std::time::Duration;
/// use redeliver::Backoff;
///
/// let b = Backoff::Exponential {
///     base: Duration::from_millis(100),
///     factor: 2.0,
///     cap: Duration::from_secs(1),
/// };
/// assert_eq!(b.delay(0), Duration::from_millis(100));
/// assert_eq!(b.delay(3), Duration::from_millis(800));
/// assert_eq!(b.delay(4), Duration::from_secs(1)); // capped
/// assert_eq!(b.delay(u32::MAX), Duration::from_secs(1));
/// ```
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Backoff {
    /// The same delay for every retry.
    Constant(Duration),
    /// `min(cap, base + step * attempt)`.
    Linear {
        /// Delay of the first retry.
        base: Duration,
        /// Added for each further retry.
        step: Duration,
        /// Upper bound of every delay.
        cap: Duration,
    },
    /// `min(cap, base * factor^attempt)`. A `factor` that is NaN or below 1.0 is treated as 1.0:
    /// a shrinking backoff is never what a retry policy wants.
    Exponential {
        /// Delay of the first retry.
        base: Duration,
        /// Growth per retry (2.0 doubles).
        factor: f64,
        /// Upper bound of every delay.
        cap: Duration,
    },
    /// An explicit schedule: retry `attempt` waits `delays[attempt]`; past the end the last
    /// element repeats; an empty schedule means no delay.
    Fixed(Vec<Duration>),
}

impl Backoff {
    /// The delay of retry number `attempt` (0 = first retry), without jitter.
    pub fn delay(&self, attempt: u32) -> Duration {
        match self {
            Backoff::Constant(d) => *d,
            Backoff::Linear { base, step, cap } => {
                let grown = step.as_nanos().saturating_mul(u128::from(attempt));
                from_nanos_saturating(base.as_nanos().saturating_add(grown)).min(*cap)
            }
            Backoff::Exponential { base, factor, cap } => {
                exponential(*base, *factor, *cap, attempt)
            }
            Backoff::Fixed(delays) => delays
                .get(attempt as usize)
                .or_else(|| delays.last())
                .copied()
                .unwrap_or(Duration::ZERO),
        }
    }

    /// The smallest delay the schedule starts from: what decorrelated jitter uses as its lower
    /// bound (and as "previous delay" on a first retry).
    pub fn base(&self) -> Duration {
        match self {
            Backoff::Constant(d) => *d,
            Backoff::Linear { base, cap, .. } | Backoff::Exponential { base, cap, .. } => {
                (*base).min(*cap)
            }
            Backoff::Fixed(delays) => delays.first().copied().unwrap_or(Duration::ZERO),
        }
    }

    /// The largest delay the schedule can produce: no jitter goes above it.
    pub fn cap(&self) -> Duration {
        match self {
            Backoff::Constant(d) => *d,
            Backoff::Linear { cap, .. } | Backoff::Exponential { cap, .. } => *cap,
            Backoff::Fixed(delays) => delays.iter().copied().max().unwrap_or(Duration::ZERO),
        }
    }

    /// The delays of successive waits with `jitter` applied, as an endless iterator: the pacing
    /// of something retried in place (a reconnect loop), where a message's retries take theirs
    /// from [`RetryPolicy`](crate::RetryPolicy). [`Delays::reset`] starts over after a success.
    ///
    /// The randomness is seeded by the operating system; [`Delays::seed`] makes it repeatable.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redeliver::{Backoff, Jitter};
    ///
    /// let backoff = Backoff::Exponential {
    ///     base: Duration::from_millis(100),
    ///     factor: 2.0,
    ///     cap: Duration::from_secs(1),
    /// };
    /// let mut delays = backoff.delays(Jitter::None);
    /// let first: Vec<u128> = delays.by_ref().take(6).map(|d| d.as_millis()).collect();
    /// assert_eq!(first, [100, 200, 400, 800, 1000, 1000]);
    ///
    /// delays.reset(); // it worked: the next failure waits the shortest delay again
    /// assert_eq!(delays.next(), Some(Duration::from_millis(100)));
    ///
    /// // With jitter each delay is drawn between zero and the backoff's.
    /// for (n, d) in backoff.delays(Jitter::Full).take(20).enumerate() {
    ///     assert!(d <= backoff.delay(n as u32));
    /// }
    /// ```
    pub fn delays(&self, jitter: Jitter) -> Delays {
        Delays {
            backoff: self.clone(),
            jitter,
            attempt: 0,
            prev: None,
            rng: os_seeded_rng(),
        }
    }
}

/// The delays of successive waits: a [`Backoff`] with its [`Jitter`], made by
/// [`Backoff::delays`]. Never ends; each delay is between zero and [`Backoff::cap`].
#[derive(Clone)]
pub struct Delays {
    backoff: Backoff,
    jitter: Jitter,
    /// Delays given since the start or the last reset: the backoff's `attempt` of the next one.
    attempt: u32,
    /// The previous delay given, which decorrelated jitter grows from.
    prev: Option<Duration>,
    rng: StdRng,
}

impl Delays {
    /// A deterministic RNG (`StdRng::seed_from_u64(seed)`): the same seed gives the same delays.
    pub fn seed(mut self, seed: u64) -> Self {
        self.rng = StdRng::seed_from_u64(seed);
        self
    }

    /// Starts the schedule over: the next delay is the first one again. For after a success.
    pub fn reset(&mut self) {
        self.attempt = 0;
        self.prev = None;
    }

    /// How many delays were given since the start or the last [`reset`](Self::reset).
    pub fn taken(&self) -> u32 {
        self.attempt
    }

    /// The next delay: [`Iterator::next`] without the `Option`, since there always is one.
    pub fn next_delay(&mut self) -> Duration {
        let b = &self.backoff;
        let d = self.jitter.apply(
            b.delay(self.attempt),
            self.prev,
            b.base(),
            b.cap(),
            &mut self.rng,
        );
        // Saturates: past u32::MAX every delay is the backoff's last (capped) one anyway.
        self.attempt = self.attempt.saturating_add(1);
        self.prev = Some(d);
        d
    }
}

impl Iterator for Delays {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (usize::MAX, None)
    }
}

impl FusedIterator for Delays {}

impl fmt::Debug for Delays {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delays")
            .field("backoff", &self.backoff)
            .field("jitter", &self.jitter)
            .field("taken", &self.attempt)
            .field("prev", &self.prev)
            .finish_non_exhaustive()
    }
}

fn exponential(base: Duration, factor: f64, cap: Duration, attempt: u32) -> Duration {
    // 0 * inf would be NaN; a zero base stays zero whatever the factor.
    if base.is_zero() || attempt == 0 {
        return base.min(cap);
    }
    let factor = if factor >= 1.0 { factor } else { 1.0 };
    // Nanoseconds rather than seconds: integer factors then give exact results (100 ms * 2^3 is
    // exactly 800 ms), since f64 holds integers exactly up to 2^53 ns (about 104 days).
    let nanos = base.as_nanos() as f64 * factor.powf(f64::from(attempt));
    if nanos.is_nan() || nanos >= cap.as_nanos() as f64 {
        return cap;
    }
    from_nanos_f64(nanos).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn exponential_exact_sequence() {
        let b = Backoff::Exponential {
            base: ms(100),
            factor: 2.0,
            cap: Duration::from_secs(60),
        };
        let got: Vec<Duration> = (0..12).map(|n| b.delay(n)).collect();
        let want: Vec<Duration> = [
            100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 51200, 60000, 60000,
        ]
        .into_iter()
        .map(ms)
        .collect();
        assert_eq!(got, want);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(60));
    }

    #[test]
    fn exponential_fractional_factor() {
        let b = Backoff::Exponential {
            base: Duration::from_secs(1),
            factor: 1.5,
            cap: Duration::from_secs(10),
        };
        assert_eq!(b.delay(1), ms(1500));
        assert_eq!(b.delay(2), ms(2250));
        assert_eq!(b.delay(3), ms(3375));
    }

    #[test]
    fn exponential_degenerate_factors_and_bases() {
        let cap = Duration::from_secs(60);
        for factor in [f64::NAN, -3.0, 0.0, 0.5, 1.0] {
            let b = Backoff::Exponential {
                base: ms(100),
                factor,
                cap,
            };
            assert_eq!(b.delay(0), ms(100), "factor {factor}");
            assert_eq!(b.delay(u32::MAX), ms(100), "factor {factor}");
        }
        for factor in [f64::INFINITY, f64::MAX, 1e300] {
            let b = Backoff::Exponential {
                base: ms(100),
                factor,
                cap,
            };
            assert_eq!(b.delay(0), ms(100));
            assert_eq!(b.delay(1), cap);
            assert_eq!(b.delay(u32::MAX), cap);
        }
        let b = Backoff::Exponential {
            base: Duration::ZERO,
            factor: f64::INFINITY,
            cap,
        };
        assert_eq!(b.delay(u32::MAX), Duration::ZERO);
        let b = Backoff::Exponential {
            base: Duration::MAX,
            factor: 2.0,
            cap: Duration::MAX,
        };
        assert_eq!(b.delay(u32::MAX), Duration::MAX);
        let b = Backoff::Exponential {
            base: Duration::from_secs(120),
            factor: 2.0,
            cap,
        };
        assert_eq!(b.delay(0), cap, "a base above the cap is capped too");
    }

    #[test]
    fn constant_linear_fixed() {
        assert_eq!(Backoff::Constant(ms(5)).delay(u32::MAX), ms(5));

        let b = Backoff::Linear {
            base: ms(100),
            step: ms(50),
            cap: ms(300),
        };
        let got: Vec<Duration> = (0..6).map(|n| b.delay(n)).collect();
        assert_eq!(got, [100, 150, 200, 250, 300, 300].map(ms));
        let b = Backoff::Linear {
            base: Duration::MAX,
            step: Duration::MAX,
            cap: Duration::MAX,
        };
        assert_eq!(b.delay(u32::MAX), Duration::MAX);

        let b = Backoff::Fixed(vec![ms(1), ms(10), ms(5)]);
        let got: Vec<Duration> = [0, 1, 2, 3, u32::MAX].map(|n| b.delay(n)).to_vec();
        assert_eq!(got, [1, 10, 5, 5, 5].map(ms));
        assert_eq!(b.base(), ms(1));
        assert_eq!(b.cap(), ms(10));
        let empty = Backoff::Fixed(vec![]);
        assert_eq!(empty.delay(0), Duration::ZERO);
        assert_eq!(empty.cap(), Duration::ZERO);
    }
}
