//! The copies that replace a delivery: a retry copy, an annotated dead letter, a sanitized
//! copy, a forwarded copy. Each is the original's properties with new headers, built here in
//! one step each; [`crate::settle`] decides which one to publish. No I/O.

use std::time::Duration;

use lapin::types::FieldTable;
use lapin::BasicProperties;
use redeliver_amqp::headers::{self, DeadLetterInfo, ForwardInfo, RetryState};
use redeliver_amqp::properties::copy_properties;

/// The delivery a copy replaces.
#[derive(Clone, Copy)]
pub(crate) struct Original<'a> {
    pub(crate) properties: &'a BasicProperties,
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) state: &'a RetryState,
    /// The connection's user: a copy keeps a `user_id` only if it is this one.
    pub(crate) connection_user: &'a str,
}

impl Original<'_> {
    fn headers(&self) -> Option<&FieldTable> {
        self.properties.headers().as_ref()
    }

    fn with_headers(&self, headers: FieldTable) -> BasicProperties {
        copy_properties(self.properties, Some(self.connection_user)).with_headers(headers)
    }

    /// A retry copy: the retry state moved on to `attempt`, the broker's bookkeeping dropped.
    pub(crate) fn retry(&self, attempt: u32, delay: Duration, error: &str) -> BasicProperties {
        let state = next_retry_state(
            self.state,
            attempt,
            delay,
            error,
            self.exchange,
            self.routing_key,
        );
        self.with_headers(headers::retry_copy_headers(self.headers(), &state))
    }

    /// The retry state a native retry leaves on the message: as a copy's, plus the earliest
    /// time it may run (`until_ms`).
    pub(crate) fn next_state(
        &self,
        attempt: u32,
        delay: Duration,
        error: &str,
        until_ms: u64,
    ) -> RetryState {
        RetryState {
            not_before_ms: Some(until_ms),
            ..next_retry_state(
                self.state,
                attempt,
                delay,
                error,
                self.exchange,
                self.routing_key,
            )
        }
    }

    /// A copy that waits out the rest of an early native retry in the delay levels: the same
    /// retry state (its earliest time included), the broker's bookkeeping dropped.
    pub(crate) fn waiting(&self) -> BasicProperties {
        self.with_headers(headers::retry_copy_headers(self.headers(), self.state))
    }

    /// An annotated dead letter (`DeadLetterMode::Annotate`), its `expiration` kept aside.
    pub(crate) fn dead_letter(&self, info: &DeadLetterInfo) -> BasicProperties {
        let expiration = self.properties.expiration().as_ref().map(|e| e.as_str());
        self.with_headers(headers::dead_letter_headers(
            self.headers(),
            info,
            expiration,
        ))
    }

    /// A copy with the malformed `x-death` removed: `sanitized` are its headers.
    pub(crate) fn sanitized(&self, sanitized: FieldTable) -> BasicProperties {
        self.with_headers(sanitized)
    }

    /// A forwarded copy: user headers kept, retry state dropped, where it came from added.
    pub(crate) fn forwarded(&self, info: &ForwardInfo) -> BasicProperties {
        self.with_headers(headers::forward_headers(self.headers(), info))
    }
}

/// Retry state written on the copy: attempt and delay from the decision, the first failure time
/// and original routing kept from earlier attempts.
fn next_retry_state(
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
        // The delay levels hold this copy: no earliest time to check (a native retry's is gone).
        not_before_ms: None,
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, ShortString};

    use super::*;

    fn original<'a>(props: &'a BasicProperties, state: &'a RetryState) -> Original<'a> {
        Original {
            properties: props,
            exchange: "orders",
            routing_key: "eu.new",
            state,
            connection_user: "guest",
        }
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
        assert!(s.last_error.unwrap_or_default().len() <= headers::LAST_ERROR_MAX_BYTES);
    }

    /// What every copy keeps of the original is `copy_properties`' (tested in the amqp crate);
    /// here: each copy goes through it, and gets its own headers.
    #[test]
    fn every_copy_keeps_identity_but_not_expiration_or_a_foreign_user() {
        let mut h = FieldTable::default();
        h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        h.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(2));
        let props = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_expiration("60000".into())
            .with_user_id("alice".into())
            .with_headers(h);
        let state = RetryState::read(props.headers().as_ref());
        let o = original(&props, &state);
        let info = ForwardInfo {
            from: "images".into(),
            reason: "timeout".into(),
            ..ForwardInfo::default()
        };
        let copies = [
            o.retry(3, Duration::from_secs(1), "e"),
            o.dead_letter(&DeadLetterInfo::default()),
            o.sanitized(FieldTable::default()),
            o.forwarded(&info),
        ];
        for copy in &copies {
            assert_eq!(copy.message_id(), &Some(ShortString::from("m-1")));
            assert_eq!(copy.expiration(), &None);
            assert_eq!(copy.user_id(), &None);
        }
        let retry = RetryState::read(copies[0].headers().as_ref());
        assert_eq!(retry.attempt, 3);
        // The forwarded copy starts afresh where it goes, and says where it came from.
        let forwarded = copies[3].headers().as_ref();
        assert_eq!(RetryState::read(forwarded).attempt, 0);
        assert_eq!(ForwardInfo::read(forwarded), Some(info));
        assert!(forwarded.is_some_and(|h| h.contains_key("tenant")));
        let alice = Original {
            connection_user: "alice",
            ..o
        };
        assert_eq!(
            alice.sanitized(FieldTable::default()).user_id(),
            &Some(ShortString::from("alice"))
        );
    }
}
