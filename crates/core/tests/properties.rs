//! Property tests: delay bounds, caps, overflow safety and reproducibility.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::SeedableRng;
use redeliver_core::{Backoff, Decision, HandlerError, Jitter, RetryPolicy};

/// Durations from nanoseconds to `Duration::MAX`, weighted towards realistic ones.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        4 => (0u64..=3_600_000_000_000).prop_map(Duration::from_nanos),
        1 => (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        1 => Just(Duration::ZERO),
        1 => Just(Duration::MAX),
    ]
}

fn factor() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 1.0f64..10.0,
        1 => any::<f64>(), // includes NaN, infinities, negatives, subnormals
        1 => Just(f64::INFINITY),
        1 => Just(f64::NAN),
        1 => Just(f64::MAX),
    ]
}

fn attempt() -> impl Strategy<Value = u32> {
    prop_oneof![3 => 0u32..64, 1 => any::<u32>(), 1 => Just(u32::MAX)]
}

fn jitter() -> impl Strategy<Value = Jitter> {
    prop_oneof![
        Just(Jitter::None),
        Just(Jitter::Full),
        Just(Jitter::Equal),
        Just(Jitter::Decorrelated),
    ]
}

fn backoff() -> impl Strategy<Value = Backoff> {
    prop_oneof![
        duration().prop_map(Backoff::Constant),
        (duration(), duration(), duration()).prop_map(|(base, step, cap)| Backoff::Linear {
            base,
            step,
            cap
        }),
        (duration(), factor(), duration()).prop_map(|(base, factor, cap)| Backoff::Exponential {
            base,
            factor,
            cap
        }),
        prop::collection::vec(duration(), 0..8).prop_map(Backoff::Fixed),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn full_jitter_in_zero_to_d(d in duration(), cap in duration(), seed in any::<u64>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let j = Jitter::Full.apply(d, None, Duration::ZERO, cap, &mut rng);
        prop_assert!(j <= d.min(cap));
    }

    #[test]
    fn equal_jitter_in_half_d_to_d(d in duration(), cap in duration(), seed in any::<u64>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let d = d.min(cap);
        let j = Jitter::Equal.apply(d, None, Duration::ZERO, cap, &mut rng);
        // d/2 rounded down to the nanosecond.
        let half = d / 2;
        prop_assert!(j >= half && j <= d, "{j:?} not in [{half:?}, {d:?}]");
    }

    #[test]
    fn decorrelated_jitter_in_base_to_prev_times_three(
        base in duration(),
        prev in proptest::option::of(duration()),
        cap in duration(),
        seed in any::<u64>(),
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let j = Jitter::Decorrelated.apply(Duration::ZERO, prev, base, cap, &mut rng);
        let spread = prev.unwrap_or(base).checked_mul(3).unwrap_or(Duration::MAX);
        let (lo, hi) = if spread >= base { (base, spread) } else { (spread, base) };
        prop_assert!(j <= cap);
        prop_assert!(j >= lo.min(cap) && j <= hi.min(cap), "{j:?} not in [{lo:?}, {hi:?}] cap {cap:?}");
    }

    #[test]
    fn granular_jitter_is_whole_units_and_bounded(
        d in duration(),
        cap in duration(),
        g in 1u64..=10_000_000_000,
        j in jitter(),
        seed in any::<u64>(),
    ) {
        let g = Duration::from_nanos(g);
        let mut rng = StdRng::seed_from_u64(seed);
        let out = j.apply_with_granularity(d, Some(d), d, cap, g, &mut rng);
        prop_assert!(out <= cap);
        prop_assert_eq!(out.as_nanos() % g.as_nanos(), 0);
    }

    #[test]
    fn backoff_never_panics_and_stays_under_cap(b in backoff(), n in attempt()) {
        let d = b.delay(n);
        prop_assert!(d <= b.cap());
        let _ = b.delay(u32::MAX);
        let _ = b.base();
    }

    #[test]
    fn exponential_is_monotonic(base in duration(), f in factor(), cap in duration(), n in 0u32..u32::MAX) {
        let b = Backoff::Exponential { base, factor: f, cap };
        prop_assert!(b.delay(n) <= b.delay(n + 1));
        prop_assert!(b.delay(n) <= cap);
    }

    #[test]
    fn policy_delay_never_exceeds_cap_nor_overflows(
        b in backoff(),
        j in jitter(),
        g in prop_oneof![Just(Duration::ZERO), duration()],
        n in attempt(),
        prev in proptest::option::of(duration()),
        seed in any::<u64>(),
    ) {
        let cap = b.cap();
        let p = RetryPolicy::from_backoff(b).jitter(j).granularity(g).seed(seed);
        prop_assert!(p.delay_for(n, prev) <= cap);
        prop_assert!(p.delay_for(u32::MAX, prev) <= cap);
    }

    #[test]
    fn exponential_builder_never_exceeds_cap(
        base in duration(),
        f in factor(),
        cap in duration(),
        j in jitter(),
        n in attempt(),
        seed in any::<u64>(),
    ) {
        // Uncapped backoff, then the policy's cap: the setter must bound it too.
        let b = Backoff::Exponential { base, factor: f, cap: Duration::MAX };
        let p = RetryPolicy::from_backoff(b).cap(cap).jitter(j).max_retries(u32::MAX).seed(seed);
        match p.decide(n, None, &HandlerError::transient("x")) {
            Decision::Retry { delay, attempt } => {
                prop_assert!(delay <= cap);
                prop_assert_eq!(attempt, n.saturating_add(1));
            }
            Decision::DeadLetter(r) => {
                prop_assert_eq!(n, u32::MAX, "dead-lettered early: {:?}", r);
            }
            other => prop_assert!(false, "a transient error without a forward destination: {:?}", other),
        }
    }

    #[test]
    fn celery_is_whole_seconds_in_randrange(n in attempt(), seed in any::<u64>()) {
        let p = RetryPolicy::celery().seed(seed);
        let countdown = if n >= 10 { 600 } else { 600u64.min(1 << n) };
        let d = p.delay_for(n, None);
        prop_assert_eq!(d.subsec_nanos(), 0);
        prop_assert!(d.as_secs() <= countdown);
    }

    #[test]
    fn seeded_rng_makes_sequences_repeat(
        b in backoff(),
        j in jitter(),
        seed in any::<u64>(),
        attempts in prop::collection::vec(attempt(), 1..20),
    ) {
        let run = || {
            let p = RetryPolicy::from_backoff(b.clone()).jitter(j).seed(seed);
            let mut prev = None;
            attempts
                .iter()
                .map(|n| {
                    let d = p.delay_for(*n, prev);
                    prev = Some(d);
                    d
                })
                .collect::<Vec<_>>()
        };
        prop_assert_eq!(run(), run());
    }

    #[test]
    fn jitter_apply_repeats_with_same_seed(
        d in duration(), prev in proptest::option::of(duration()), base in duration(),
        cap in duration(), j in jitter(), seed in any::<u64>(),
    ) {
        let a = j.apply(d, prev, base, cap, &mut StdRng::seed_from_u64(seed));
        let b = j.apply(d, prev, base, cap, &mut StdRng::seed_from_u64(seed));
        prop_assert_eq!(a, b);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn delays_stay_within_zero_and_cap(
        b in backoff(),
        j in jitter(),
        seed in any::<u64>(),
        n in 1usize..40,
    ) {
        let cap = b.cap();
        for d in b.delays(j).seed(seed).take(n) {
            prop_assert!(d <= cap, "{:?} above the cap {:?}", d, cap);
        }
    }

    #[test]
    fn delays_without_jitter_follow_the_backoff(b in backoff(), n in 1usize..40, before in 0usize..8) {
        let mut delays = b.delays(Jitter::None);
        // Whatever came before a reset, the schedule starts over.
        delays.by_ref().take(before).for_each(drop);
        delays.reset();
        for (attempt, d) in delays.take(n).enumerate() {
            prop_assert_eq!(d, b.delay(attempt as u32));
        }
    }

    #[test]
    fn seeded_delays_repeat(b in backoff(), j in jitter(), seed in any::<u64>()) {
        let one: Vec<Duration> = b.delays(j).seed(seed).take(10).collect();
        let two: Vec<Duration> = b.delays(j).seed(seed).take(10).collect();
        prop_assert_eq!(one, two);
    }
}
