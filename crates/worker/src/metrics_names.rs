//! Names of the metrics the worker emits through the [`metrics`] crate facade.
//!
//! The worker never installs a recorder: without one every macro call is a no-op, so embedding the
//! worker costs nothing until the service installs an exporter (for instance
//! `metrics-exporter-prometheus`). Names and label keys live here, as constants, so an exporter,
//! a dashboard or a test can refer to them without copying strings.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | [`MESSAGES_RECEIVED`] | counter | `queue` |
//! | [`MESSAGES_SUCCEEDED`] | counter | `queue` |
//! | [`MESSAGES_RETRIED`] | counter | `queue`, `attempt` |
//! | [`MESSAGES_DEAD_LETTERED`] | counter | `queue`, `reason` |
//! | [`MESSAGES_SANITIZED`] | counter | `queue` |
//! | [`MESSAGES_REQUEUED`] | counter | `queue`, `reason` |
//! | [`SETTLE_FAILURES`] | counter | `queue` |
//! | [`HANDLER_DURATION`] | histogram (seconds) | `queue` |
//! | [`HANDLERS_IN_FLIGHT`] | gauge | `queue` |
//! | [`CONNECTION_STATE`] | gauge, 1 for the current state | `queue`, `state` |
//! | [`CONNECTION_BLOCKED`] | gauge | `queue` |
//! | [`RECONNECTS`] | counter | `queue` |
//! | [`DELAY_UNROUTABLE_MESSAGES`] | gauge | `parking_queue` |
//!
//! The values of the `reason` label are the names of [`DeadLetterReason`](redeliver_core::DeadLetterReason)
//! ([`as_str`](redeliver_core::DeadLetterReason::as_str)); each variant documents its name.

/// Deliveries taken from the queue (every delivery counts, redeliveries too).
pub const MESSAGES_RECEIVED: &str = "redeliver_messages_received_total";
/// Deliveries whose handler returned `Ok` and whose ack the broker accepted.
pub const MESSAGES_SUCCEEDED: &str = "redeliver_messages_succeeded_total";
/// Retry copies published (and confirmed) into the delay levels; label `attempt` is the
/// `x-redeliver-attempt` value written on the copy (1 on the first retry).
pub const MESSAGES_RETRIED: &str = "redeliver_messages_retried_total";
/// Deliveries moved to the DLQ (rejected without requeue, or published there annotated, then
/// acked); label `reason` is the [`DeadLetterReason::as_str`](redeliver_core::DeadLetterReason::as_str) name of why: one of the reasons
/// that are not [`is_requeue`](redeliver_core::DeadLetterReason::is_requeue), or a name the handler gave
/// ([`DeadLetterReason::Named`](redeliver_core::DeadLetterReason::Named)).
pub const MESSAGES_DEAD_LETTERED: &str = "redeliver_messages_dead_lettered_total";
/// Deliveries sent on to another queue or exchange by the policy's `Forward` destination (the
/// copy confirmed, then the original acked); label `destination` is the queue's name, or
/// `exchange/routing key`.
pub const MESSAGES_FORWARDED: &str = "redeliver_messages_forwarded_total";
/// Deliveries whose malformed `x-death` header the worker removed by republishing a sanitized copy
/// to the queue (see [`redeliver_amqp::headers::sanitize_x_death`]); the broker crashes when it
/// dead-letters such a message.
pub const MESSAGES_SANITIZED: &str = "redeliver_messages_sanitized_total";
/// Deliveries the worker gave back to their queue (`basic.reject(requeue = true)`) because the
/// broker did not confirm the copy that was to replace them (or settling panicked); label
/// `reason` is the [`DeadLetterReason::as_str`](redeliver_core::DeadLetterReason::as_str) name of a reason that
/// [`is_requeue`](redeliver_core::DeadLetterReason::is_requeue) (`retry_unconfirmed`, `settle_panicked`, ...).
/// Bounded per message by `WorkerBuilder::requeue_limit`, past which the message is
/// dead-lettered ([`DeadLetterReason::RequeueLimit`](redeliver_core::DeadLetterReason::RequeueLimit)).
pub const MESSAGES_REQUEUED: &str = "redeliver_messages_requeued_total";
/// Acks, nacks or rejects that did not reach the broker (the delivery's channel died first). The
/// broker redelivers those messages, so this counts future duplicates.
pub const SETTLE_FAILURES: &str = "redeliver_settle_failures_total";
/// Wall time of one handler call, in seconds (decode excluded).
pub const HANDLER_DURATION: &str = "redeliver_handler_duration_seconds";
/// Handlers running right now.
pub const HANDLERS_IN_FLIGHT: &str = "redeliver_handlers_in_flight";
/// The worker's state, one series per state (label [`LABEL_STATE`], the lower-case
/// [`WorkerState`](crate::WorkerState) name): 1 for the current state, 0 for the others.
pub const CONNECTION_STATE: &str = "redeliver_connection_state";
/// 1 while the broker blocks the worker's publishing connection (a memory or disk alarm), 0
/// otherwise.
pub const CONNECTION_BLOCKED: &str = "redeliver_connection_blocked";
/// 1 once the broker handed a native retry out before its delivery time: retries go through the
/// delay levels from then on ([`WorkerStatus::native_retry_ignored`](crate::WorkerStatus::native_retry_ignored)).
pub const NATIVE_RETRY_IGNORED: &str = "redeliver_native_retry_ignored";
/// 1 for the retry mode the current session uses, by label `mode` (`levels`, `native`).
pub const RETRY_MODE: &str = "redeliver_retry_mode";
/// Label: a retry mode.
pub const LABEL_MODE: &str = "mode";
/// Connections re-established after a loss (counted when the worker consumes again, not when it
/// loses the connection).
pub const RECONNECTS: &str = "redeliver_reconnects_total";
/// Messages parked in the delay infrastructure's unroutable queue (their destination queue did not
/// exist when their delay expired). Polled by the worker every 30 s; shared by every consumer of
/// the vhost, so each worker reports the same value.
pub const DELAY_UNROUTABLE_MESSAGES: &str = "redeliver_delay_unroutable_messages";

/// Label key: the full queue name (prefix included).
pub const LABEL_QUEUE: &str = "queue";
/// Label: name of the delay infrastructure's parking queue (one per delay prefix, vhost-wide).
pub const LABEL_PARKING_QUEUE: &str = "parking_queue";
/// Label key: the attempt number written on a retry copy, `1` to `9`, then
/// [`ATTEMPT_TOP_BUCKET`] for every later one (so `max_retries(u32::MAX)` cannot make the
/// series unbounded).
pub const LABEL_ATTEMPT: &str = "attempt";
/// The last value of [`LABEL_ATTEMPT`]: attempts from 10 on.
pub const ATTEMPT_TOP_BUCKET: &str = "10+";
/// Label key: a [`WorkerState`](crate::WorkerState) name, on [`CONNECTION_STATE`].
pub const LABEL_STATE: &str = "state";
/// Label key: why a message was dead-lettered or requeued, a [`DeadLetterReason::as_str`](redeliver_core::DeadLetterReason::as_str) name.
pub const LABEL_REASON: &str = "reason";
/// Label key: where a message was forwarded, on [`MESSAGES_FORWARDED`].
pub const LABEL_DESTINATION: &str = "destination";

/// The [`LABEL_ATTEMPT`] value of an attempt number.
pub(crate) fn attempt_label(attempt: u32) -> &'static str {
    const EXACT: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    EXACT
        .get(attempt as usize)
        .copied()
        .unwrap_or(ATTEMPT_TOP_BUCKET)
}

#[cfg(test)]
mod tests {
    #[test]
    fn attempt_labels_are_bounded() {
        assert_eq!(super::attempt_label(1), "1");
        assert_eq!(super::attempt_label(9), "9");
        assert_eq!(super::attempt_label(10), super::ATTEMPT_TOP_BUCKET);
        assert_eq!(super::attempt_label(u32::MAX), super::ATTEMPT_TOP_BUCKET);
    }
}
