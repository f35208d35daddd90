//! What to do with a delivery ([`Outcome`]), decided from the handler's result, a decoding
//! failure or a malformed header; and how settling it ended ([`Settled`]). No I/O: the next
//! step down, [`crate::settle`], carries an outcome out.

use std::any::Any;
use std::fmt;
use std::time::Duration;

use lapin::types::FieldTable;
use redeliver_amqp::headers::RetryState;
use redeliver_core::{
    BudgetExhausted, DeadLetterReason, Decision, ErrorKind, Forward, HandlerError, Jitter,
    RetryBudget, RetryPolicy, TimedOut,
};

/// What to do with a delivery, carried out by [`crate::settle`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// The handler succeeded: `basic.ack`.
    Ack,
    /// Publish a copy through the delay levels, wait for the confirm, then ack.
    Retry {
        delay: Duration,
        /// `x-redeliver-attempt` of the copy.
        attempt: u32,
        /// `delay` is a draw of the policy's jitter, random anyway: it is published rounded to
        /// few delay-level hops ([`DelayConfig::round_jittered`](redeliver_amqp::DelayConfig::round_jittered)).
        /// False for a `retry_after` delay, an unjittered backoff and a retry budget's fixed
        /// delay, which stay exact.
        jittered: bool,
        error: String,
    },
    /// Move it to the DLQ the configured way.
    DeadLetter {
        reason: DeadLetterReason,
        error: String,
    },
    /// Publish a copy to another queue or exchange, wait for the confirm, then ack.
    Forward {
        to: Forward,
        /// [`FORWARD_REASON`](redeliver_amqp::headers::FORWARD_REASON): `timeout`, `handler`
        /// or `classified`.
        reason: &'static str,
        /// Attempts made here, this one included.
        attempts: u32,
        error: String,
    },
    /// Republish it with its malformed `x-death` removed (these headers), then ack the
    /// original.
    Sanitize(FieldTable),
    /// Give it back to its queue after a pause, at most `requeue_limit` times, then dead-letter
    /// it: what is left when settling itself failed unexpectedly (a panic).
    Requeue {
        reason: DeadLetterReason,
        error: String,
    },
    /// The shutdown grace period ran out: leave it unsettled, the broker requeues it when the
    /// channel closes.
    Abandon,
    /// A native retry delivered `remaining` before its time: the broker ignores the delivery
    /// time. The handler does not run; the message waits out the rest in the delay levels.
    Early { remaining: Duration },
}

impl Outcome {
    /// The outcome of a handler call: `None` when it was abandoned at shutdown, its result
    /// otherwise (panics and timeouts already turned into errors).
    pub(crate) fn decide(
        policy: &RetryPolicy,
        state: &RetryState,
        result: Option<Result<(), HandlerError>>,
    ) -> Self {
        let error = match result {
            None => return Outcome::Abandon,
            Some(Ok(())) => return Outcome::Ack,
            Some(Err(e)) => e,
        };
        let message = error.message();
        match policy.decide(state.attempt, state.delay, &error) {
            Decision::Retry { delay, attempt } => Outcome::Retry {
                delay,
                attempt,
                jittered: jittered(policy, &error, delay),
                error: message,
            },
            Decision::DeadLetter(reason) => Outcome::DeadLetter {
                reason,
                error: message,
            },
            Decision::Forward(to) => Outcome::Forward {
                to,
                reason: forward_reason(&error),
                attempts: state.attempt.saturating_add(1),
                error: message,
            },
        }
    }

    /// A body that cannot be decoded: a poison pill, never retried.
    pub(crate) fn undecodable(error: &dyn std::error::Error) -> Self {
        Outcome::DeadLetter {
            reason: DeadLetterReason::Undecodable,
            error: redeliver_core::error_chain(error),
        }
    }
}

/// Whether a retry's `delay` came from the policy's jitter: a jittered policy, an error that
/// did not name its delay (`retry_after`, by the handler or the classifier), and not a retry
/// budget's "retry later" delay (the budget takes the longer of it and the backoff's draw).
fn jittered(policy: &RetryPolicy, error: &HandlerError, delay: Duration) -> bool {
    if policy.configured_jitter() == Jitter::None {
        return false;
    }
    if let ErrorKind::RetryAfter(_) = policy.configured_classifier().classify(error) {
        return false;
    }
    !matches!(
        policy.configured_budget().map(RetryBudget::when_exhausted),
        Some(BudgetExhausted::RetryLater(later)) if later == delay
    )
}

/// Why a failure is forwarded, as the copy's header says it.
fn forward_reason(error: &HandlerError) -> &'static str {
    if error.is::<TimedOut>() {
        "timeout"
    } else if error.kind() == ErrorKind::Forward {
        "handler"
    } else {
        "classified"
    }
}

/// The transient error a panicking handler (or decoder) stands for. A panic is most often a bug
/// that a retry will not fix, but it can also be a transient condition (an unwrap on a network
/// call); bounded retries keep the message and its panic message for the DLQ.
pub(crate) fn panicked(payload: &(dyn Any + Send)) -> HandlerError {
    HandlerError::transient(format!("handler panicked: {}", panic_message(payload)))
}

/// The error of a handler dropped at its time limit: unclassified, so that a classifier can
/// name it ([`Classifier::forward_on::<TimedOut>`](redeliver_core::Classifier::forward_on));
/// transient otherwise.
pub(crate) fn timed_out(limit: Duration) -> HandlerError {
    HandlerError::unclassified(TimedOut::after(limit))
}

/// How settling a delivery ended: the `outcome` field of its span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    Acked,
    Retried,
    DeadLettered,
    Forwarded,
    /// Republished without its malformed `x-death`, the original acked.
    Sanitized,
    /// Given back to its queue by the worker.
    Requeued,
    /// Left to the broker at shutdown.
    Abandoned,
    /// A settlement that did not reach the broker: it redelivers the message.
    Failed,
}

impl fmt::Display for Settled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Settled::Acked => "acked",
            Settled::Retried => "retried",
            Settled::DeadLettered => "dead_lettered",
            Settled::Forwarded => "forwarded",
            Settled::Sanitized => "sanitized",
            Settled::Requeued => "requeued",
            Settled::Abandoned => "abandoned",
            Settled::Failed => "settle_failed",
        })
    }
}

/// Renders a panic payload (a `&str` or `String` for `panic!` with a message).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy::exponential(Duration::from_millis(100))
            .jitter(Jitter::None)
            .max_retries(2)
    }

    fn fail(e: HandlerError) -> Option<Result<(), HandlerError>> {
        Some(Err(e))
    }

    #[test]
    fn transient_errors_retry_until_exhausted() {
        let p = policy();
        let e = HandlerError::transient("down");
        let mut state = RetryState::default();
        match Outcome::decide(&p, &state, fail(HandlerError::transient("down"))) {
            Outcome::Retry {
                attempt,
                delay,
                jittered,
                error,
            } => {
                assert_eq!(attempt, 1);
                assert_eq!(delay, Duration::from_millis(100));
                assert!(!jittered, "no jitter: exact");
                assert!(error.contains("down"));
            }
            other => panic!("expected retry, got {other:?}"),
        }
        state.attempt = 1;
        assert!(matches!(
            Outcome::decide(&p, &state, fail(HandlerError::transient("down"))),
            Outcome::Retry { attempt: 2, .. }
        ));
        state.attempt = 2;
        assert_eq!(
            Outcome::decide(&p, &state, fail(HandlerError::transient("down"))),
            Outcome::DeadLetter {
                reason: DeadLetterReason::RetriesExhausted { retries: 2 },
                error: e.message()
            }
        );
    }

    #[test]
    fn success_abandon_permanent_and_retry_after() {
        let p = policy();
        let state = RetryState::default();
        assert_eq!(Outcome::decide(&p, &state, Some(Ok(()))), Outcome::Ack);
        assert_eq!(Outcome::decide(&p, &state, None), Outcome::Abandon);
        assert!(matches!(
            Outcome::decide(&p, &state, fail(HandlerError::permanent("bad"))),
            Outcome::DeadLetter {
                reason: DeadLetterReason::Permanent,
                ..
            }
        ));
        assert!(matches!(
            Outcome::decide(&p, &state, fail(HandlerError::retry_after(Duration::from_secs(7), "later"))),
            Outcome::Retry { delay, attempt: 1, .. } if delay == Duration::from_secs(7)
        ));
    }

    #[test]
    fn only_jitter_draws_are_jittered() {
        let jittered = |p: &RetryPolicy, e: HandlerError| match Outcome::decide(
            p,
            &RetryState::default(),
            fail(e),
        ) {
            Outcome::Retry { jittered, .. } => jittered,
            other => panic!("expected retry, got {other:?}"),
        };
        let full = policy().jitter(Jitter::Full);
        assert!(jittered(&full, HandlerError::transient("down")));
        assert!(jittered(&full, HandlerError::unclassified("down")));
        assert!(!jittered(&policy(), HandlerError::transient("down")));
        let later = HandlerError::retry_after(Duration::from_secs(7), "later");
        assert!(!jittered(&full, later));
        // A classifier's retry_after is exact too.
        let classified = full.clone().classifier(
            redeliver_core::Classifier::default()
                .with_fn(|_| Some(ErrorKind::RetryAfter(Duration::from_secs(3)))),
        );
        assert!(!jittered(&classified, HandlerError::unclassified("429")));
    }

    #[test]
    fn panics_and_timeouts_are_transient() {
        let r = std::panic::catch_unwind(|| panic!("boom"));
        let e = panicked(&*r.unwrap_err());
        assert_eq!(e.kind(), redeliver_core::ErrorKind::Transient);
        assert!(e.message().contains("boom"));
        let e = timed_out(Duration::from_millis(1500));
        let classifier = redeliver_core::Classifier::permanent_by_default();
        assert_eq!(
            classifier.classify(&e),
            redeliver_core::ErrorKind::Transient
        );
        assert!(e.message().contains("timed out"), "{}", e.message());
    }

    #[test]
    fn forwards_say_why() {
        let p = policy()
            .classifier(redeliver_core::Classifier::default().forward_on::<TimedOut>())
            .forward(Forward::to_queue("heavy"));
        let state = RetryState {
            attempt: 1,
            ..RetryState::default()
        };
        for (error, reason) in [
            (timed_out(Duration::from_secs(1)), "timeout"),
            (HandlerError::forward("too big"), "handler"),
        ] {
            match Outcome::decide(&p, &state, fail(error)) {
                Outcome::Forward {
                    to,
                    reason: r,
                    attempts,
                    ..
                } => {
                    assert_eq!(to.routing_key(), "heavy");
                    assert_eq!((r, attempts), (reason, 2));
                }
                other => panic!("expected forward, got {other:?}"),
            }
        }
    }

    #[test]
    fn panic_payloads() {
        let r = std::panic::catch_unwind(|| panic!("static"));
        assert_eq!(panic_message(&*r.unwrap_err()), "static");
        let n = 3;
        let r = std::panic::catch_unwind(|| panic!("formatted {n}"));
        assert_eq!(panic_message(&*r.unwrap_err()), "formatted 3");
    }
}
