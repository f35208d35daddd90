//! The retry policy: backoff + jitter + max retries + classification + budget.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::backoff::Backoff;
use crate::budget::{BudgetExhausted, RetryBudget};
use crate::error::{Classifier, ErrorKind, HandlerError};
use crate::forward::Forward;
use crate::jitter::{os_seeded_rng, Jitter};
use crate::reason::DeadLetterReason;

/// Cap of [`RetryPolicy::exponential`] unless [`RetryPolicy::cap`] sets another.
pub const DEFAULT_CAP: Duration = Duration::from_secs(60);
/// `max_retries` of [`RetryPolicy::exponential`], [`RetryPolicy::constant`] and
/// [`RetryPolicy::linear`] unless [`RetryPolicy::max_retries`] sets another.
pub const DEFAULT_MAX_RETRIES: u32 = 5;

/// What to do with a failed delivery. Exhaustive: every consumer of a decision handles each
/// one, and a new kind of decision is a breaking change on purpose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Publish a copy that comes back after `delay`.
    Retry {
        /// How long the copy waits in the delay queues.
        delay: Duration,
        /// Value of `x-redeliver-attempt` on the copy: 1 on the first retry.
        attempt: u32,
    },
    /// Reject the delivery so that the broker dead-letters it.
    DeadLetter(DeadLetterReason),
    /// Publish a copy to the policy's [`Forward`] destination, then ack the original.
    Forward(Forward),
}

/// Backoff, jitter, `max_retries`, error classification and an optional retry budget, turned
/// into a [`Decision`] for each failure.
///
/// Built with a constructor and chained setters:
///
/// ```
/// use std::time::Duration;
/// use redeliver::{Decision, HandlerError, Jitter, RetryPolicy};
///
/// let policy = RetryPolicy::exponential(Duration::from_millis(100))
///     .cap(Duration::from_secs(60))
///     .jitter(Jitter::Full)
///     .max_retries(5)
///     .seed(42);
///
/// let err = HandlerError::transient("connection reset");
/// match policy.decide(0, None, &err) {
///     Decision::Retry { delay, attempt } => {
///         assert_eq!(attempt, 1);
///         assert!(delay <= Duration::from_millis(100));
///     }
///     other => panic!("unexpected {other:?}"),
/// }
/// ```
///
/// The constructor chooses the backoff and takes the parameters only it has:
/// [`exponential`](Self::exponential) a base, [`linear`](Self::linear) a base and a step,
/// [`constant`](Self::constant) a delay, [`fixed`](Self::fixed) a schedule. A backoff with other
/// parameters (an exponential factor other than 2) is given whole to
/// [`from_backoff`](Self::from_backoff). The setters then apply to whatever backoff was chosen:
/// [`cap`](Self::cap) bounds every one, the others do not touch the backoff.
///
/// Rules of [`decide`](Self::decide), in order:
/// 1. the error is classified (see [`Classifier`]); permanent →
///    [`DeadLetterReason::Permanent`]; forward kind (see [`Forward`]) → [`Decision::Forward`]
///    once the destination's `after_attempts` is reached, or
///    [`DeadLetterReason::ForwardUnconfigured`] without a destination; before that it goes on
///    like a transient error;
/// 2. `retries_so_far >= max_retries` → [`DeadLetterReason::RetriesExhausted`] (this also
///    bounds [`ErrorKind::RetryAfter`] errors);
/// 3. the delay is the error's `RetryAfter` delay as given, or else the backoff with jitter;
/// 4. with a budget, a retry withdraws a token; if none is left the budget's
///    [`BudgetExhausted`] setting decides.
///
/// Thread-safe; clones share the RNG and the budget.
#[derive(Clone)]
pub struct RetryPolicy {
    backoff: Backoff,
    jitter: Jitter,
    max_retries: u32,
    granularity: Duration,
    classifier: Classifier,
    budget: Option<RetryBudget>,
    forward: Option<Forward>,
    rng: Arc<Mutex<StdRng>>,
}

impl RetryPolicy {
    /// A policy on any backoff: no jitter, [`DEFAULT_MAX_RETRIES`] (or the schedule's length for
    /// [`Backoff::Fixed`]), default classifier, no budget.
    ///
    /// The way to a growth factor other than [`exponential`](Self::exponential)'s 2:
    ///
    /// ```
    /// use std::time::Duration;
    /// use redeliver::{Backoff, Jitter, RetryPolicy};
    ///
    /// let policy = RetryPolicy::from_backoff(Backoff::Exponential {
    ///     base: Duration::from_millis(100),
    ///     factor: 3.0,
    ///     cap: Duration::from_secs(60),
    /// })
    /// .jitter(Jitter::Full);
    /// assert_eq!(policy.configured_backoff().delay(2), Duration::from_millis(900));
    /// ```
    pub fn from_backoff(backoff: Backoff) -> Self {
        let max_retries = match &backoff {
            Backoff::Fixed(d) => u32::try_from(d.len()).unwrap_or(u32::MAX),
            _ => DEFAULT_MAX_RETRIES,
        };
        RetryPolicy {
            backoff,
            jitter: Jitter::None,
            max_retries,
            granularity: Duration::ZERO,
            classifier: Classifier::default(),
            budget: None,
            forward: None,
            rng: Arc::new(Mutex::new(os_seeded_rng())),
        }
    }

    /// `min(cap, base * factor^attempt)` with factor 2.0, cap [`DEFAULT_CAP`] (60 s),
    /// [`Jitter::Full`] and max_retries [`DEFAULT_MAX_RETRIES`] (5).
    pub fn exponential(base: Duration) -> Self {
        Self::from_backoff(Backoff::Exponential {
            base,
            factor: 2.0,
            cap: DEFAULT_CAP,
        })
        .jitter(Jitter::Full)
    }

    /// The same delay every time, no jitter, max_retries [`DEFAULT_MAX_RETRIES`] (5).
    pub fn constant(d: Duration) -> Self {
        Self::from_backoff(Backoff::Constant(d))
    }

    /// `base + step * attempt`, uncapped unless [`cap`](Self::cap) is set, no jitter,
    /// max_retries [`DEFAULT_MAX_RETRIES`] (5).
    pub fn linear(base: Duration, step: Duration) -> Self {
        Self::from_backoff(Backoff::Linear {
            base,
            step,
            cap: Duration::MAX,
        })
    }

    /// An explicit schedule (see [`Backoff::Fixed`]); max_retries defaults to its length, no
    /// jitter.
    pub fn fixed(delays: impl IntoIterator<Item = Duration>) -> Self {
        Self::from_backoff(Backoff::Fixed(delays.into_iter().collect()))
    }

    /// Celery 5's autoretry defaults: `get_exponential_backoff_interval(factor=1,
    /// retries, maximum=600, full_jitter=True)` with `max_retries = 3`, that is
    /// `countdown = min(600, 1 * 2**retries)` seconds, then `random.randrange(countdown + 1)`,
    /// in whole seconds.
    ///
    /// Equivalent to `RetryPolicy::exponential(1 s).cap(600 s).granularity(1 s).max_retries(3)`
    /// (an exponential policy has factor 2 and full jitter already). Celery's
    /// `retry_backoff = n` is that with `exponential(n s)`; see the crate docs for the full
    /// mapping.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redeliver::{Jitter, RetryPolicy};
    ///
    /// let p = RetryPolicy::celery().jitter(Jitter::None);
    /// let secs: Vec<u64> = (0..12).map(|n| p.delay_for(n, None).as_secs()).collect();
    /// assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 600, 600]);
    /// ```
    pub fn celery() -> Self {
        Self::exponential(Duration::from_secs(1))
            .cap(Duration::from_secs(600))
            .granularity(Duration::from_secs(1))
            .max_retries(3)
    }

    /// Never retry: every failure is dead-lettered (transient ones with
    /// [`DeadLetterReason::RetriesExhausted`]).
    pub fn none() -> Self {
        Self::constant(Duration::ZERO).max_retries(0)
    }

    /// Upper bound of every delay (jitter included). A constant delay or a fixed schedule is
    /// clamped to it.
    pub fn cap(mut self, d: Duration) -> Self {
        match &mut self.backoff {
            Backoff::Constant(c) => *c = (*c).min(d),
            Backoff::Linear { cap, .. } | Backoff::Exponential { cap, .. } => *cap = d,
            Backoff::Fixed(v) => v.iter_mut().for_each(|x| *x = (*x).min(d)),
        }
        self
    }

    /// Replaces the backoff the constructor chose, keeping every other setting (jitter,
    /// `max_retries`, granularity, ...).
    ///
    /// Read it back with [`Self::configured_backoff`].
    pub fn backoff(mut self, b: Backoff) -> Self {
        self.backoff = b;
        self
    }

    /// The jitter applied to backoff delays (not to `retry_after` delays).
    ///
    /// Read it back with [`Self::configured_jitter`].
    pub fn jitter(mut self, j: Jitter) -> Self {
        self.jitter = j;
        self
    }

    /// Retries allowed per message; the failure after the last one is dead-lettered. `u32::MAX`
    /// is effectively unbounded (Celery's `max_retries=None`).
    ///
    /// Read it back with [`Self::configured_max_retries`].
    pub fn max_retries(mut self, n: u32) -> Self {
        self.max_retries = n;
        self
    }

    /// Makes every backoff delay a whole multiple of `g`: the un-jittered delay is rounded down
    /// to a multiple, and jitter draws uniformly among whole multiples. Zero (the default)
    /// means nanoseconds. [`celery`](Self::celery) uses one second.
    ///
    /// Read it back with [`Self::configured_granularity`].
    pub fn granularity(mut self, g: Duration) -> Self {
        self.granularity = g;
        self
    }

    /// How unclassified errors (from `anyhow`) are classified; default
    /// [`Classifier::transient_by_default`].
    ///
    /// Read it back with [`Self::configured_classifier`].
    pub fn classifier(mut self, c: Classifier) -> Self {
        self.classifier = c;
        self
    }

    /// Limits retries with a shared budget (none by default). Call
    /// [`record_attempt`](Self::record_attempt) for every first attempt to fill it.
    ///
    /// Read it back with [`Self::configured_budget`].
    pub fn budget(mut self, b: RetryBudget) -> Self {
        self.budget = Some(b);
        self
    }

    /// Where failures of the forward kind go (none by default): see [`Forward`].
    ///
    /// Read it back with [`Self::configured_forward`].
    pub fn forward(mut self, to: Forward) -> Self {
        self.forward = Some(to);
        self
    }

    /// The forward destination, if any.
    pub fn configured_forward(&self) -> Option<&Forward> {
        self.forward.as_ref()
    }

    /// A deterministic RNG (`StdRng::seed_from_u64(seed)`): the same seed and the same calls
    /// give the same delays. Without it the RNG is seeded from the OS.
    pub fn seed(mut self, seed: u64) -> Self {
        // A fresh Arc: clones made before this call keep their own RNG.
        self.rng = Arc::new(Mutex::new(StdRng::seed_from_u64(seed)));
        self
    }

    /// The backoff.
    pub fn configured_backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// The jitter.
    pub fn configured_jitter(&self) -> Jitter {
        self.jitter
    }

    /// The maximum number of retries per message.
    pub fn configured_max_retries(&self) -> u32 {
        self.max_retries
    }

    /// The granularity of backoff delays (zero = nanoseconds).
    pub fn configured_granularity(&self) -> Duration {
        self.granularity
    }

    /// The classifier.
    pub fn configured_classifier(&self) -> &Classifier {
        &self.classifier
    }

    /// The budget, if any.
    pub fn configured_budget(&self) -> Option<&RetryBudget> {
        self.budget.as_ref()
    }

    /// Decides what to do with a delivery that failed with `err`.
    ///
    /// `retries_so_far` is the value of `x-redeliver-attempt` on the delivery (0 for a fresh
    /// message); `prev_delay` the delay applied to reach this delivery (`None` on a fresh
    /// message), used by [`Jitter::Decorrelated`].
    pub fn decide(
        &self,
        retries_so_far: u32,
        prev_delay: Option<Duration>,
        err: &HandlerError,
    ) -> Decision {
        let delay = match self.classifier.classify(err) {
            ErrorKind::Permanent => {
                return Decision::DeadLetter(match err.dead_letter_reason() {
                    Some(reason) => DeadLetterReason::Named(reason),
                    None => DeadLetterReason::Permanent,
                })
            }
            ErrorKind::Forward => match &self.forward {
                None => return Decision::DeadLetter(DeadLetterReason::ForwardUnconfigured),
                Some(to) if to.due(retries_so_far) => return Decision::Forward(to.clone()),
                Some(_) if retries_so_far >= self.max_retries => {
                    return Decision::DeadLetter(DeadLetterReason::RetriesExhausted {
                        retries: retries_so_far,
                    })
                }
                Some(_) => self.delay_for(retries_so_far, prev_delay),
            },
            _ if retries_so_far >= self.max_retries => {
                return Decision::DeadLetter(DeadLetterReason::RetriesExhausted {
                    retries: retries_so_far,
                })
            }
            ErrorKind::RetryAfter(d) => d,
            ErrorKind::Transient | ErrorKind::Unclassified => {
                self.delay_for(retries_so_far, prev_delay)
            }
        };
        let attempt = retries_so_far.saturating_add(1);
        match &self.budget {
            Some(b) if !b.try_withdraw() => match b.when_exhausted() {
                BudgetExhausted::DeadLetter => {
                    Decision::DeadLetter(DeadLetterReason::BudgetExhausted)
                }
                BudgetExhausted::RetryLater(later) => Decision::Retry {
                    delay: delay.max(later),
                    attempt,
                },
            },
            _ => Decision::Retry { delay, attempt },
        }
    }

    /// The backoff delay for retry number `retries_so_far` (0 = first retry), with jitter
    /// (drawn from the policy's RNG) and granularity applied. Never above the backoff's cap.
    pub fn delay_for(&self, retries_so_far: u32, prev_delay: Option<Duration>) -> Duration {
        let d = self.backoff.delay(retries_so_far);
        let mut rng = self
            .rng
            .lock()
            // An RNG state is valid whatever panicked while it was held.
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        self.jitter.apply_with_granularity(
            d,
            prev_delay,
            self.backoff.base(),
            self.backoff.cap(),
            self.granularity,
            &mut *rng,
        )
    }

    /// Call once per fresh (attempt 0) delivery, success or not: feeds the retry budget. Does
    /// nothing without a budget.
    pub fn record_attempt(&self) {
        if let Some(b) = &self.budget {
            b.deposit();
        }
    }
}

impl Default for RetryPolicy {
    /// [`RetryPolicy::exponential`] from 1 s: 1 s, 2 s, 4 s, … capped at 60 s, full jitter,
    /// 5 retries. The worker's default policy.
    fn default() -> Self {
        Self::exponential(Duration::from_secs(1))
    }
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("backoff", &self.backoff)
            .field("jitter", &self.jitter)
            .field("max_retries", &self.max_retries)
            .field("granularity", &self.granularity)
            .field("classifier", &self.classifier)
            .field("budget", &self.budget)
            .field("forward", &self.forward)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::BudgetConfig;
    use crate::clock::ManualClock;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn transient() -> HandlerError {
        HandlerError::transient("boom")
    }

    #[test]
    fn forward_kind_goes_to_the_destination_from_its_attempt() {
        use crate::forward::TimedOut;
        let p = RetryPolicy::constant(ms(10))
            .max_retries(5)
            .classifier(Classifier::permanent_by_default().forward_on::<TimedOut>())
            .forward(Forward::to_queue("heavy").after_attempts(3));
        let timeout = || HandlerError::unclassified(TimedOut::after(secs(1)));
        assert_eq!(
            p.decide(0, None, &timeout()),
            Decision::Retry {
                delay: ms(10),
                attempt: 1
            }
        );
        assert!(matches!(
            p.decide(1, None, &timeout()),
            Decision::Retry { attempt: 2, .. }
        ));
        assert_eq!(
            p.decide(2, None, &timeout()),
            Decision::Forward(Forward::to_queue("heavy").after_attempts(3))
        );
        // Explicit from the handler; other errors keep their own rules.
        assert!(matches!(
            p.decide(2, None, &HandlerError::forward("too big")),
            Decision::Forward(_)
        ));
        assert_eq!(
            p.decide(
                0,
                None,
                &HandlerError::unclassified(std::io::Error::other("x"))
            ),
            Decision::DeadLetter(DeadLetterReason::Permanent)
        );
    }

    #[test]
    fn forward_without_destination_or_retries_left_dead_letters() {
        let p = RetryPolicy::constant(ms(10)).max_retries(1);
        assert_eq!(
            p.decide(0, None, &HandlerError::forward("x")),
            Decision::DeadLetter(DeadLetterReason::ForwardUnconfigured)
        );
        let p = p.forward(Forward::to_queue("heavy").after_attempts(5));
        assert!(matches!(
            p.decide(0, None, &HandlerError::forward("x")),
            Decision::Retry { .. }
        ));
        assert_eq!(
            p.decide(1, None, &HandlerError::forward("x")),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 1 })
        );
    }

    #[test]
    fn timeouts_stay_transient_under_a_permanent_default() {
        use crate::forward::TimedOut;
        let p = RetryPolicy::constant(ms(10)).classifier(Classifier::permanent_by_default());
        assert!(matches!(
            p.decide(
                0,
                None,
                &HandlerError::unclassified(TimedOut::after(secs(1)))
            ),
            Decision::Retry { .. }
        ));
    }

    #[test]
    fn builder_from_the_issue() {
        let p = RetryPolicy::exponential(ms(100))
            .cap(secs(60))
            .jitter(Jitter::Full)
            .max_retries(5);
        assert_eq!(
            p.configured_backoff(),
            &Backoff::Exponential {
                base: ms(100),
                factor: 2.0,
                cap: secs(60)
            }
        );
        assert_eq!(p.configured_jitter(), Jitter::Full);
        assert_eq!(p.configured_max_retries(), 5);
        assert!(p.configured_budget().is_none());
        assert_eq!(
            p.configured_classifier().default_kind(),
            ErrorKind::Transient
        );
    }

    #[test]
    fn constructor_defaults() {
        let p = RetryPolicy::exponential(ms(100));
        assert_eq!(p.configured_jitter(), Jitter::Full);
        assert_eq!(p.configured_max_retries(), DEFAULT_MAX_RETRIES);
        assert_eq!(p.configured_backoff().cap(), DEFAULT_CAP);
        assert_eq!(
            RetryPolicy::constant(ms(1)).configured_jitter(),
            Jitter::None
        );
        assert_eq!(
            RetryPolicy::linear(ms(1), ms(2)).configured_backoff().cap(),
            Duration::MAX
        );
        assert_eq!(
            RetryPolicy::fixed([ms(1), ms(2), ms(3)]).configured_max_retries(),
            3
        );
        assert_eq!(RetryPolicy::none().configured_max_retries(), 0);
        assert_eq!(RetryPolicy::default().configured_backoff().base(), secs(1));
        let c = RetryPolicy::celery();
        assert_eq!(c.configured_max_retries(), 3);
        assert_eq!(c.configured_jitter(), Jitter::Full);
        assert_eq!(c.configured_granularity(), secs(1));
        assert_eq!(
            c.configured_backoff(),
            &Backoff::Exponential {
                base: secs(1),
                factor: 2.0,
                cap: secs(600)
            }
        );
    }

    #[test]
    fn setters_on_other_backoffs() {
        let p = RetryPolicy::constant(secs(10)).cap(secs(3));
        assert_eq!(p.configured_backoff(), &Backoff::Constant(secs(3)));
        let p = RetryPolicy::fixed([secs(1), secs(5)]).cap(secs(2));
        assert_eq!(
            p.configured_backoff(),
            &Backoff::Fixed(vec![secs(1), secs(2)])
        );
        let p = RetryPolicy::linear(secs(2), secs(1)).cap(secs(3));
        assert_eq!(p.delay_for(5, None), secs(3));
        assert_eq!(p.delay_for(0, None), secs(2));
        let p = RetryPolicy::none().backoff(Backoff::Constant(ms(7)));
        assert_eq!(p.delay_for(0, None), ms(7));
        assert_eq!(
            p.configured_max_retries(),
            0,
            "replacing the backoff keeps the rest"
        );
    }

    #[test]
    fn no_jitter_sequence_exact() {
        let p = RetryPolicy::exponential(ms(100))
            .jitter(Jitter::None)
            .max_retries(12);
        let want = [
            100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 51200, 60000, 60000,
        ];
        for (n, w) in want.into_iter().enumerate() {
            let n = n as u32;
            assert_eq!(p.delay_for(n, None), ms(w), "attempt {n}");
            assert_eq!(
                p.decide(n, None, &transient()),
                Decision::Retry {
                    delay: ms(w),
                    attempt: n + 1
                }
            );
        }
        assert_eq!(
            p.decide(12, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 12 })
        );
    }

    #[test]
    fn celery_sequence_before_jitter() {
        let p = RetryPolicy::celery().jitter(Jitter::None);
        let got: Vec<Duration> = (0..12).map(|n| p.delay_for(n, None)).collect();
        let want = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 600, 600].map(secs);
        assert_eq!(got, want);
        assert_eq!(p.delay_for(u32::MAX, None), secs(600));
        // retry_backoff = 3: a base of 3 seconds, the rest of Celery's defaults.
        let p = RetryPolicy::exponential(secs(3))
            .cap(secs(600))
            .granularity(secs(1))
            .max_retries(3)
            .jitter(Jitter::None);
        let got: Vec<u64> = (0..10).map(|n| p.delay_for(n, None).as_secs()).collect();
        assert_eq!(got, [3, 6, 12, 24, 48, 96, 192, 384, 600, 600]);
    }

    #[test]
    fn celery_jitter_is_randrange_of_countdown_plus_one() {
        let p = RetryPolicy::celery().seed(11);
        for retries in 0..12u32 {
            let countdown = 600u64.min(1 << retries);
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..3000 {
                let d = p.delay_for(retries, None);
                assert_eq!(d.subsec_nanos(), 0);
                assert!(d.as_secs() <= countdown);
                seen.insert(d.as_secs());
            }
            if countdown <= 8 {
                // Every value of randrange(countdown + 1), including 0 and countdown itself.
                assert_eq!(seen.len() as u64, countdown + 1, "retries {retries}");
            }
        }
    }

    #[test]
    fn celery_max_retries_is_three() {
        let p = RetryPolicy::celery().seed(1);
        for n in 0..3 {
            assert!(matches!(
                p.decide(n, None, &transient()),
                Decision::Retry { attempt, .. } if attempt == n + 1
            ));
        }
        assert_eq!(
            p.decide(3, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 3 })
        );
    }

    #[test]
    fn permanent_dead_letters_even_with_retries_left() {
        let p = RetryPolicy::constant(secs(1));
        assert_eq!(
            p.decide(0, None, &HandlerError::permanent("bad")),
            Decision::DeadLetter(DeadLetterReason::Permanent)
        );
        // ... and before the exhaustion check.
        assert_eq!(
            p.decide(99, None, &HandlerError::permanent("bad")),
            Decision::DeadLetter(DeadLetterReason::Permanent)
        );
        let p = p.classifier(Classifier::permanent_by_default());
        let e: HandlerError = anyhow::anyhow!("?").into();
        assert_eq!(
            p.decide(0, None, &e),
            Decision::DeadLetter(DeadLetterReason::Permanent)
        );
    }

    #[test]
    fn unclassified_defaults_to_retry() {
        let p = RetryPolicy::constant(secs(1));
        let e: HandlerError = anyhow::anyhow!("?").into();
        assert_eq!(
            p.decide(0, None, &e),
            Decision::Retry {
                delay: secs(1),
                attempt: 1
            }
        );
    }

    #[test]
    fn retry_after_overrides_backoff_but_counts() {
        let p = RetryPolicy::exponential(ms(100)).max_retries(2).seed(3);
        let e = HandlerError::retry_after(secs(3600), "rate limited");
        // Not jittered, not capped by the backoff's 60 s.
        assert_eq!(
            p.decide(0, None, &e),
            Decision::Retry {
                delay: secs(3600),
                attempt: 1
            }
        );
        assert_eq!(
            p.decide(1, None, &e),
            Decision::Retry {
                delay: secs(3600),
                attempt: 2
            }
        );
        assert_eq!(
            p.decide(2, None, &e),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 2 })
        );
        assert_eq!(
            RetryPolicy::none().decide(0, None, &e),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 0 })
        );
    }

    #[test]
    fn none_never_retries() {
        assert_eq!(
            RetryPolicy::none().decide(0, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 0 })
        );
    }

    #[test]
    fn attempt_saturates() {
        let p = RetryPolicy::constant(ms(1)).max_retries(u32::MAX);
        assert_eq!(
            p.decide(u32::MAX - 1, None, &transient()),
            Decision::Retry {
                delay: ms(1),
                attempt: u32::MAX
            }
        );
        assert_eq!(
            p.decide(u32::MAX, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: u32::MAX })
        );
    }

    fn empty_budget(when: BudgetExhausted) -> (RetryBudget, ManualClock) {
        let clock = ManualClock::new();
        let b = RetryBudget::with_clock(
            BudgetConfig {
                min_retries_per_sec: 0,
                when_exhausted: when,
                ..BudgetConfig::default()
            },
            clock.clone(),
        );
        (b, clock)
    }

    #[test]
    fn budget_exhausted_dead_letters() {
        let (b, clock) = empty_budget(BudgetExhausted::DeadLetter);
        let p = RetryPolicy::constant(secs(1)).budget(b.clone());
        assert_eq!(
            p.decide(0, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::BudgetExhausted)
        );
        for _ in 0..10 {
            p.record_attempt();
        }
        assert_eq!(b.balance(), 2);
        for _ in 0..2 {
            assert!(matches!(
                p.decide(0, None, &transient()),
                Decision::Retry { .. }
            ));
        }
        assert_eq!(
            p.decide(1, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::BudgetExhausted)
        );
        // Permanent errors and exhausted retries take no token and keep their reason.
        for _ in 0..5 {
            p.record_attempt();
        }
        assert_eq!(
            p.decide(0, None, &HandlerError::permanent("x")),
            Decision::DeadLetter(DeadLetterReason::Permanent)
        );
        assert_eq!(
            p.decide(5, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 5 })
        );
        assert_eq!(b.balance(), 1);
        clock.advance(secs(20));
        assert_eq!(
            p.decide(0, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::BudgetExhausted)
        );
    }

    #[test]
    fn budget_exhausted_retries_later() {
        let (b, _) = empty_budget(BudgetExhausted::RetryLater(secs(30)));
        let p = RetryPolicy::constant(secs(1)).budget(b);
        assert_eq!(
            p.decide(0, None, &transient()),
            Decision::Retry {
                delay: secs(30),
                attempt: 1
            }
        );
        // A longer own delay wins over the "later" one.
        let e = HandlerError::retry_after(secs(90), "slow down");
        assert_eq!(
            p.decide(1, None, &e),
            Decision::Retry {
                delay: secs(90),
                attempt: 2
            }
        );
        assert_eq!(
            p.decide(5, None, &transient()),
            Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 5 })
        );
    }

    #[test]
    fn record_attempt_without_budget_is_a_no_op() {
        RetryPolicy::default().record_attempt();
    }

    #[test]
    fn seeded_policies_repeat_and_clones_share_the_rng() {
        let a = RetryPolicy::exponential(ms(100)).seed(99);
        let b = RetryPolicy::exponential(ms(100)).seed(99);
        let sa: Vec<Duration> = (0..20).map(|n| a.delay_for(n, None)).collect();
        let sb: Vec<Duration> = (0..20).map(|n| b.delay_for(n, None)).collect();
        assert_eq!(sa, sb);
        let c = RetryPolicy::exponential(ms(100)).seed(100);
        let sc: Vec<Duration> = (0..20).map(|n| c.delay_for(n, None)).collect();
        assert_ne!(sa, sc);

        // A clone continues the same stream rather than replaying it.
        let p = RetryPolicy::exponential(secs(1000)).cap(secs(1000)).seed(5);
        let q = p.clone();
        let x: Vec<Duration> = (0..10).map(|_| p.delay_for(0, None)).collect();
        let y: Vec<Duration> = (0..10).map(|_| q.delay_for(0, None)).collect();
        assert_ne!(x, y);
        let r = RetryPolicy::exponential(secs(1000)).cap(secs(1000)).seed(5);
        let z: Vec<Duration> = (0..20).map(|_| r.delay_for(0, None)).collect();
        assert_eq!([x, y].concat(), z);
    }

    #[test]
    fn decorrelated_uses_prev_delay() {
        let p = RetryPolicy::exponential(ms(100))
            .cap(secs(10))
            .jitter(Jitter::Decorrelated)
            .seed(8);
        let mut prev = None;
        for n in 0..50 {
            let d = p.delay_for(n, prev);
            let hi = prev.map_or(ms(300), |p: Duration| (p * 3).max(ms(100)));
            assert!(d >= ms(100) && d <= hi.min(secs(10)), "{d:?} prev {prev:?}");
            prev = Some(d);
        }
    }

    #[test]
    fn poisoned_rng_is_recovered() {
        let p = RetryPolicy::exponential(ms(100)).seed(1);
        let rng = Arc::clone(&p.rng);
        let _ = std::thread::spawn(move || {
            let _guard = rng.lock();
            panic!("poison the rng");
        })
        .join();
        assert!(p.rng.is_poisoned());
        assert!(p.delay_for(0, None) <= ms(100));
    }

    #[test]
    fn reasons_as_str_and_display() {
        assert_eq!(DeadLetterReason::Permanent.as_str(), "permanent");
        assert_eq!(
            DeadLetterReason::RetriesExhausted { retries: 3 }.as_str(),
            "retries_exhausted"
        );
        assert_eq!(
            DeadLetterReason::BudgetExhausted.as_str(),
            "budget_exhausted"
        );
        assert_eq!(
            DeadLetterReason::RetriesExhausted { retries: 3 }.to_string(),
            "retries_exhausted after 3 retries"
        );
        assert_eq!(DeadLetterReason::Permanent.to_string(), "permanent");
        assert!(format!("{:?}", RetryPolicy::celery()).contains("max_retries: 3"));
    }

    #[test]
    fn policy_is_send_sync() {
        fn check<T: Send + Sync + Clone + 'static>() {}
        check::<RetryPolicy>();
        check::<RetryBudget>();
        check::<Classifier>();
        fn check_err<T: Send + Sync + std::error::Error + 'static>() {}
        check_err::<HandlerError>();
    }
}
