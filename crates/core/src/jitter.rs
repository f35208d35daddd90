//! Randomisation of backoff delays.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::nanos::from_nanos_saturating;

/// How a delay is randomised so that many consumers failing together do not retry together.
///
/// The formulas are those of the AWS Architecture Blog's "Exponential Backoff And Jitter", with
/// `d` the capped backoff delay:
///
/// | variant | result |
/// |---|---|
/// | [`Jitter::None`] | `d` |
/// | [`Jitter::Full`] | `rand(0, d)` |
/// | [`Jitter::Equal`] | `d/2 + rand(0, d/2)` |
/// | [`Jitter::Decorrelated`] | `min(cap, rand(base, prev * 3))` |
///
/// All bounds are inclusive. Every result is at most `cap`. Non-exhaustive: another formula may
/// come, so a match outside this crate needs a `_` arm.
///
/// ```
/// use std::time::Duration;
/// use rand::{rngs::StdRng, SeedableRng};
/// use redeliver::Jitter;
///
/// let mut rng = StdRng::seed_from_u64(7);
/// let d = Duration::from_secs(10);
/// let cap = Duration::from_secs(60);
/// let j = Jitter::Equal.apply(d, None, Duration::from_secs(1), cap, &mut rng);
/// assert!(j >= Duration::from_secs(5) && j <= d);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum Jitter {
    /// No randomisation: the backoff delay as is.
    #[default]
    None,
    /// Uniform in `[0, d]`. Spreads retries the most; the one Celery uses (`retry_jitter`).
    Full,
    /// Uniform in `[d/2, d]`: keeps at least half of the backoff.
    Equal,
    /// `min(cap, rand(base, prev * 3))`, where `prev` is the delay applied before this delivery
    /// (`base` on a first retry). Ignores `d`: the schedule grows from the previous draw.
    Decorrelated,
}

impl Jitter {
    /// Randomises `d` with nanosecond resolution.
    ///
    /// `d` is the capped backoff delay; `prev` the delay applied on the previous retry of this
    /// message (`None` on the first retry, which then uses `base`); `base` and `cap` come from
    /// the backoff (see [`Backoff::base`](crate::Backoff::base) and
    /// [`Backoff::cap`](crate::Backoff::cap)).
    pub fn apply<R: Rng + ?Sized>(
        &self,
        d: Duration,
        prev: Option<Duration>,
        base: Duration,
        cap: Duration,
        rng: &mut R,
    ) -> Duration {
        self.apply_with_granularity(d, prev, base, cap, Duration::from_nanos(1), rng)
    }

    /// Like [`apply`](Self::apply), but every input is first rounded down to a whole number of
    /// `granularity` units and the draw is uniform over whole units, so the result is a multiple
    /// of `granularity`. With one second this is Python's `random.randrange(countdown + 1)`, as
    /// Celery does. A zero `granularity` means one nanosecond.
    pub fn apply_with_granularity<R: Rng + ?Sized>(
        &self,
        d: Duration,
        prev: Option<Duration>,
        base: Duration,
        cap: Duration,
        granularity: Duration,
        rng: &mut R,
    ) -> Duration {
        let unit = granularity.as_nanos().max(1);
        let cap_u = cap.as_nanos() / unit;
        let d_u = (d.as_nanos() / unit).min(cap_u);
        let units = match self {
            Jitter::None => d_u,
            Jitter::Full => rng.random_range(0..=d_u),
            Jitter::Equal => {
                let half = d_u / 2;
                half + rng.random_range(0..=d_u - half)
            }
            Jitter::Decorrelated => {
                let base_u = base.as_nanos() / unit;
                let prev_u = prev.map_or(base_u, |p| p.as_nanos() / unit);
                let spread = prev_u.saturating_mul(3);
                // A previous delay shorter than base/3 (a changed policy, a forged header)
                // would make the range empty; draw between the two instead.
                let (lo, hi) = if spread >= base_u {
                    (base_u, spread)
                } else {
                    (spread, base_u)
                };
                rng.random_range(lo..=hi).min(cap_u)
            }
        };
        from_nanos_saturating(units.saturating_mul(unit))
    }
}

/// An RNG seeded by the operating system, or by the clock where it has no randomness to give.
pub(crate) fn os_seeded_rng() -> StdRng {
    StdRng::try_from_os_rng().unwrap_or_else(|_| {
        // No OS randomness (a sandbox without getrandom): jitter still needs to differ between
        // processes, which the clock and an address provide well enough.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let local = 0u8;
        let addr = &local as *const u8 as u64;
        StdRng::seed_from_u64(nanos ^ addr.rotate_left(32))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn none_is_identity_but_capped() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            Jitter::None.apply(ms(7), None, ms(1), ms(10), &mut rng),
            ms(7)
        );
        assert_eq!(
            Jitter::None.apply(ms(70), None, ms(1), ms(10), &mut rng),
            ms(10)
        );
    }

    #[test]
    fn full_and_equal_bounds_and_spread() {
        let mut rng = StdRng::seed_from_u64(2);
        let d = ms(1000);
        let (mut lo_full, mut hi_full) = (d, Duration::ZERO);
        for _ in 0..2000 {
            let f = Jitter::Full.apply(d, None, ms(1), ms(5000), &mut rng);
            assert!(f <= d);
            lo_full = lo_full.min(f);
            hi_full = hi_full.max(f);
            let e = Jitter::Equal.apply(d, None, ms(1), ms(5000), &mut rng);
            assert!(e >= ms(500) && e <= d, "{e:?}");
        }
        // Uniform over [0, 1 s]: 2000 draws reach both ends' neighbourhoods.
        assert!(lo_full < ms(10) && hi_full > ms(990));
        assert_eq!(
            Jitter::Full.apply(Duration::ZERO, None, ms(1), ms(5), &mut rng),
            Duration::ZERO
        );
        // Odd nanosecond count: d/2 rounds down, the top stays d.
        let d = Duration::from_nanos(3);
        for _ in 0..100 {
            let e = Jitter::Equal.apply(d, None, Duration::ZERO, d, &mut rng);
            assert!(e >= Duration::from_nanos(1) && e <= d);
        }
    }

    #[test]
    fn decorrelated_bounds() {
        let mut rng = StdRng::seed_from_u64(3);
        let (base, cap) = (ms(100), ms(10_000));
        for _ in 0..1000 {
            // First retry: rand(base, base * 3).
            let j = Jitter::Decorrelated.apply(ms(1), None, base, cap, &mut rng);
            assert!(j >= base && j <= ms(300), "{j:?}");
            let j = Jitter::Decorrelated.apply(ms(1), Some(ms(2000)), base, cap, &mut rng);
            assert!(j >= base && j <= ms(6000), "{j:?}");
            let j = Jitter::Decorrelated.apply(ms(1), Some(ms(9000)), base, cap, &mut rng);
            assert!(j >= base && j <= cap, "{j:?}");
            // prev * 3 below base: drawn between the two, never an empty range.
            let j = Jitter::Decorrelated.apply(ms(1), Some(ms(10)), base, cap, &mut rng);
            assert!(j >= ms(30) && j <= base, "{j:?}");
        }
        let j = Jitter::Decorrelated.apply(ms(1), None, ms(500), ms(200), &mut rng);
        assert_eq!(j, ms(200), "base above cap gives the cap");
        let j = Jitter::Decorrelated.apply(
            Duration::MAX,
            Some(Duration::MAX),
            Duration::MAX,
            Duration::MAX,
            &mut rng,
        );
        assert_eq!(j, Duration::MAX);
    }

    #[test]
    fn whole_units_like_randrange() {
        let mut rng = StdRng::seed_from_u64(4);
        let s = Duration::from_secs(1);
        let mut seen = [0u32; 5];
        for _ in 0..4000 {
            let j = Jitter::Full.apply_with_granularity(
                Duration::from_millis(4999),
                None,
                s,
                Duration::from_secs(600),
                s,
                &mut rng,
            );
            assert_eq!(j.subsec_nanos(), 0);
            // 4.999 s rounds down to 4 s: randrange(5) = 0..=4.
            seen[j.as_secs() as usize] += 1;
        }
        for (v, n) in seen.iter().enumerate() {
            assert!((600..1000).contains(n), "value {v} drawn {n} of 4000 times");
        }
        let zero = Jitter::Equal.apply_with_granularity(
            ms(10),
            None,
            ms(1),
            ms(10),
            Duration::ZERO,
            &mut rng,
        );
        assert!(zero >= ms(5), "zero granularity means nanoseconds");
    }
}
