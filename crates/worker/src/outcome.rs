//! From a handler's result to the broker action ([`Outcome`]), how settling ended
//! ([`Settled`]), and the pure parts of a copy (retry state, properties). No I/O.

use std::any::Any;
use std::fmt;
use std::time::Duration;

use lapin::types::FieldTable;
use lapin::BasicProperties;
use redeliver_amqp::headers::{self, RetryState};
use redeliver_core::{Decision, HandlerError, RetryPolicy};

use crate::metrics_names;

/// What to do with a delivery: decided from the handler's result (or a decoding failure, or a
/// malformed header) and carried out by [`crate::settle`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// The handler succeeded: `basic.ack`.
    Ack,
    /// Publish a copy through the delay levels, wait for the confirm, then ack.
    Retry {
        delay: Duration,
        /// `x-redeliver-attempt` of the copy.
        attempt: u32,
        error: String,
    },
    /// Move it to the DLQ the configured way.
    DeadLetter { reason: &'static str, error: String },
    /// Republish it with its `x-death` repaired (these headers), then ack the original.
    Repair(FieldTable),
    /// Give it back to its queue after a pause, at most `requeue_limit` times, then dead-letter
    /// it: what is left when settling itself failed unexpectedly (a panic).
    Requeue { reason: &'static str, error: String },
    /// The shutdown grace period ran out: leave it unsettled, the broker requeues it when the
    /// channel closes.
    Abandon,
}

impl Outcome {
    /// The outcome of a handler call: `None` when it was abandoned at shutdown, its result
    /// otherwise (panics and timeouts already turned into transient errors).
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
                error: message,
            },
            Decision::DeadLetter(reason) => Outcome::DeadLetter {
                reason: reason.as_str(),
                error: message,
            },
        }
    }

    /// A body that cannot be decoded: a poison pill, never retried.
    pub(crate) fn undecodable(error: &dyn std::error::Error) -> Self {
        Outcome::DeadLetter {
            reason: metrics_names::REASON_UNDECODABLE,
            error: error_chain(error),
        }
    }
}

/// The transient error a panicking handler (or decoder) stands for. A panic is most often a bug
/// that a retry will not fix, but it can also be a transient condition (an unwrap on a network
/// call); bounded retries keep the message and its panic message for the DLQ.
pub(crate) fn panicked(payload: &(dyn Any + Send)) -> HandlerError {
    HandlerError::transient(format!("handler panicked: {}", panic_message(payload)))
}

/// The transient error of a handler dropped at its time limit.
pub(crate) fn timed_out(limit: Duration) -> HandlerError {
    HandlerError::transient(format!(
        "handler timed out after {}",
        humantime::format_duration(limit)
    ))
}

/// How settling a delivery ended: the `outcome` field of its span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    Acked,
    Retried,
    DeadLettered,
    /// Republished with a repaired `x-death`, the original acked.
    Repaired,
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
            Settled::Repaired => "sanitized",
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

/// "a: b: c" for an error and its sources.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let text = s.to_string();
        // thiserror's `{source}` in a message already contains the source's text.
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// Retry state written on the copy: attempt and delay from the decision, the first failure time
/// and original routing kept from earlier attempts.
pub(crate) fn next_retry_state(
    previous: &RetryState,
    attempt: u32,
    delay: Duration,
    error: &str,
    delivery_exchange: &str,
    delivery_routing_key: &str,
) -> RetryState {
    RetryState {
        attempt,
        first_failed_at: previous
            .first_failed_at
            .clone()
            .or_else(|| Some(headers::now_rfc3339())),
        last_error: Some(headers::truncate_error(error)),
        // A retry copy arrives through the delay infrastructure, so its own exchange and
        // routing key say nothing about where the message came from: keep the first ones.
        original_exchange: previous
            .original_exchange
            .clone()
            .or_else(|| Some(delivery_exchange.to_owned())),
        original_routing_key: previous
            .original_routing_key
            .clone()
            .or_else(|| Some(delivery_routing_key.to_owned())),
        delay: Some(delay),
    }
}

/// Properties of a retry copy: every property of the original, with `headers` replaced, except
///
/// - `expiration`: a per-message TTL shorter than a delay level's TTL would make the copy leave
///   that level early and arrive too soon; the copy's wait is the delay, not the original TTL;
/// - `user_id` when it differs from the worker's own user, because RabbitMQ refuses (406, closing
///   the publishing channel) a publish whose `user_id` is not the connection's user.
pub(crate) fn retry_copy_properties(
    original: &BasicProperties,
    headers: FieldTable,
    connection_user: &str,
) -> BasicProperties {
    let mut p = BasicProperties::default().with_headers(headers);
    if let Some(v) = original.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(v) = original.delivery_mode() {
        p = p.with_delivery_mode(*v);
    }
    if let Some(v) = original.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = original.user_id() {
        if v.as_str() == connection_user {
            p = p.with_user_id(v.clone());
        }
    }
    if let Some(v) = original.app_id() {
        p = p.with_app_id(v.clone());
    }
    if let Some(v) = original.cluster_id() {
        p = p.with_cluster_id(v.clone());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{AMQPValue, ShortString};
    use redeliver_core::Jitter;

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
                error,
            } => {
                assert_eq!(attempt, 1);
                assert_eq!(delay, Duration::from_millis(100));
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
                reason: metrics_names::REASON_RETRIES_EXHAUSTED,
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
                reason: metrics_names::REASON_PERMANENT,
                ..
            }
        ));
        assert!(matches!(
            Outcome::decide(&p, &state, fail(HandlerError::retry_after(Duration::from_secs(7), "later"))),
            Outcome::Retry { delay, attempt: 1, .. } if delay == Duration::from_secs(7)
        ));
    }

    #[test]
    fn panics_and_timeouts_are_transient() {
        let r = std::panic::catch_unwind(|| panic!("boom"));
        let e = panicked(&*r.unwrap_err());
        assert_eq!(e.kind(), redeliver_core::ErrorKind::Transient);
        assert!(e.message().contains("boom"));
        let e = timed_out(Duration::from_millis(1500));
        assert_eq!(e.kind(), redeliver_core::ErrorKind::Transient);
        assert!(e.message().contains("timed out"), "{}", e.message());
    }

    #[test]
    fn panic_payloads() {
        let r = std::panic::catch_unwind(|| panic!("static"));
        assert_eq!(panic_message(&*r.unwrap_err()), "static");
        let n = 3;
        let r = std::panic::catch_unwind(|| panic!("formatted {n}"));
        assert_eq!(panic_message(&*r.unwrap_err()), "formatted 3");
    }

    #[test]
    fn next_state_keeps_origin() {
        let fresh = next_retry_state(
            &RetryState::default(),
            1,
            Duration::from_millis(5),
            "e1",
            "orders",
            "eu.new",
        );
        assert_eq!(fresh.attempt, 1);
        assert_eq!(fresh.original_exchange.as_deref(), Some("orders"));
        assert_eq!(fresh.original_routing_key.as_deref(), Some("eu.new"));
        assert!(fresh.first_failed_at.is_some());
        let second = next_retry_state(
            &fresh,
            2,
            Duration::from_millis(9),
            "e2",
            "delay.deliver",
            "0.1.q",
        );
        assert_eq!(second.original_exchange.as_deref(), Some("orders"));
        assert_eq!(second.original_routing_key.as_deref(), Some("eu.new"));
        assert_eq!(second.first_failed_at, fresh.first_failed_at);
        assert_eq!(second.last_error.as_deref(), Some("e2"));
        assert_eq!(second.delay, Some(Duration::from_millis(9)));
        let long = "x".repeat(5000);
        let s = next_retry_state(&RetryState::default(), 1, Duration::ZERO, &long, "", "q");
        assert!(s.last_error.unwrap().len() <= headers::LAST_ERROR_MAX_BYTES);
    }

    #[test]
    fn copy_keeps_properties_but_expiration_and_foreign_user() {
        let mut h = FieldTable::default();
        h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let original = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_content_type("application/json".into())
            .with_correlation_id("c-9".into())
            .with_delivery_mode(2)
            .with_priority(3)
            .with_expiration("60000".into())
            .with_user_id("alice".into())
            .with_app_id("shop".into())
            .with_headers(h.clone());
        let copy = retry_copy_properties(&original, h.clone(), "guest");
        assert_eq!(copy.message_id(), &Some(ShortString::from("m-1")));
        assert_eq!(
            copy.content_type(),
            &Some(ShortString::from("application/json"))
        );
        assert_eq!(copy.correlation_id(), &Some(ShortString::from("c-9")));
        assert_eq!(copy.delivery_mode(), &Some(2));
        assert_eq!(copy.priority(), &Some(3));
        assert_eq!(copy.app_id(), &Some(ShortString::from("shop")));
        assert_eq!(copy.expiration(), &None);
        assert_eq!(copy.user_id(), &None);
        assert_eq!(copy.headers(), &Some(h.clone()));
        let copy = retry_copy_properties(&original, h, "alice");
        assert_eq!(copy.user_id(), &Some(ShortString::from("alice")));
    }

    #[test]
    fn error_chain_does_not_repeat() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer: {0}")]
        struct Outer(#[source] std::io::Error);
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(error_chain(&e), "outer: inner");
    }
}
