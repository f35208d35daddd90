//! Durations from nanosecond counts that saturate instead of panicking: the backoff and jitter
//! formulas overflow a `Duration` easily (factor 10 at attempt 40).

use std::time::Duration;

/// Largest [`Duration`] expressed in nanoseconds.
const MAX_NANOS: u128 = Duration::MAX.as_nanos();

/// Builds a [`Duration`] from nanoseconds, saturating at [`Duration::MAX`].
pub(crate) fn from_nanos_saturating(nanos: u128) -> Duration {
    if nanos >= MAX_NANOS {
        return Duration::MAX;
    }
    // Both casts are lossless: nanos < MAX_NANOS means secs <= u64::MAX.
    Duration::new(
        (nanos / 1_000_000_000) as u64,
        (nanos % 1_000_000_000) as u32,
    )
}

/// Builds a [`Duration`] from a nanosecond count held in an `f64`, rounding to the nearest
/// nanosecond. NaN and negative values give zero, anything at or above [`Duration::MAX`]
/// (including infinity) gives [`Duration::MAX`]; `Duration::from_secs_f64` would panic on those.
pub(crate) fn from_nanos_f64(nanos: f64) -> Duration {
    if nanos.is_nan() || nanos <= 0.0 {
        return Duration::ZERO;
    }
    if nanos >= MAX_NANOS as f64 {
        return Duration::MAX;
    }
    from_nanos_saturating(nanos.round() as u128)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_conversion_guards() {
        assert_eq!(from_nanos_f64(f64::NAN), Duration::ZERO);
        assert_eq!(from_nanos_f64(-1.0), Duration::ZERO);
        assert_eq!(from_nanos_f64(f64::NEG_INFINITY), Duration::ZERO);
        assert_eq!(from_nanos_f64(f64::INFINITY), Duration::MAX);
        assert_eq!(from_nanos_f64(1e40), Duration::MAX);
        assert_eq!(from_nanos_f64(1.4), Duration::from_nanos(1));
        assert_eq!(from_nanos_saturating(u128::MAX), Duration::MAX);
        assert_eq!(
            from_nanos_saturating(Duration::MAX.as_nanos() - 1),
            Duration::MAX - Duration::from_nanos(1)
        );
    }
}
