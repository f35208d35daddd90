//! Carrying out an [`Outcome`] on the broker: ack, retry, dead-letter, forward, requeue,
//! sanitize.
//!
//! Every rule of settling lives in [`Settle::run`], written against the small [`Broker`]
//! trait: [`crate::link`] holds the real one (the delivery's channel and the session's confirmed
//! publisher); the tests use a scripted one. The rules:
//!
//! - a copy (retry, annotated dead letter, forwarded or sanitized copy) is published and
//!   confirmed before the original is acked, so there is never a moment with neither;
//! - a copy the broker did not take (nacked, returned, channel closed) gives the original back
//!   to its queue after a pause, a bounded number of times;
//! - once the delivery's channel is gone nothing is sent: the broker redelivers the original, so a
//!   copy would only be a duplicate.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::message::Delivery;
use lapin::BasicProperties;
use redeliver_amqp::headers::{self, DeadLetterInfo, ForwardInfo, RetryState};
use redeliver_amqp::{DelayConfig, PublishError};
use redeliver_core::{DeadLetterReason, Forward};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn, Span};

use crate::broker::{Broker, CopyError, Publish};
use crate::copy::Original;
use crate::meters::Meters;
use crate::metrics_names as m;
use crate::outcome::{Outcome, Settled};
use crate::requeue::{self, RequeueLedger};
use crate::settings::{DeadLetterMode, RetryMode};
use crate::status::RetryStatus;

#[cfg(test)]
mod tests;

/// Pause before requeueing a message whose copy could not be published: without it a broker
/// that refuses publishes (delay infrastructure missing, resource alarm) turns into a hot
/// redelivery loop. Holding the concurrency permit meanwhile is the intended back-pressure.
pub(crate) const REQUEUE_PAUSE: Duration = Duration::from_secs(1);

/// The settling rules of one session: the worker's settings and what the broker said.
#[derive(Clone, Debug)]
pub(crate) struct Rules {
    /// The worker's (shared with [`crate::settings::Resolved`] and every delivery's context).
    pub(crate) queue: Arc<str>,
    pub(crate) dlx: String,
    pub(crate) dlq: String,
    pub(crate) mode: DeadLetterMode,
    pub(crate) requeue_limit: u32,
    /// Written on annotated dead letters and forwarded copies (`…-by` headers).
    pub(crate) connection_name: String,
    /// Longest delay the delay levels can hold; longer ones are clamped.
    pub(crate) max_delay: Duration,
    /// The delay levels: jittered retry delays are rounded to their hop limit
    /// ([`DelayConfig::round_jittered`]).
    pub(crate) delay_levels: DelayConfig,
    /// The connection's user: a copy keeps a `user_id` only if it is this one.
    pub(crate) username: String,
    /// Where this session's retries wait ([`RetryMode::Levels`] or [`RetryMode::Native`]), for
    /// the delivery span.
    pub(crate) retry_mode: RetryMode,
    /// The worker's retry status: set once the broker ignored a native retry's delivery time,
    /// after which retries go through the delay levels.
    pub(crate) retries: Arc<RetryStatus>,
    /// The broker dead-letters a message with a malformed `x-death` without crashing (so a
    /// sanitized copy that keeps failing may end in the DLQ). False for RabbitMQ 3.x and
    /// unknown ones.
    pub(crate) dead_letters_malformed_x_death: bool,
}

/// The time now in Unix milliseconds (0 before 1970, which no clock here is).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The delivery being settled, as settling reads it.
#[derive(Clone, Copy)]
pub(crate) struct Message<'a> {
    pub(crate) properties: &'a BasicProperties,
    pub(crate) body: &'a [u8],
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    /// Empty when the message has none.
    pub(crate) message_id: &'a str,
    pub(crate) state: &'a RetryState,
}

impl<'a> Message<'a> {
    pub(crate) fn of(delivery: &'a Delivery, state: &'a RetryState) -> Self {
        Self {
            properties: &delivery.properties,
            body: &delivery.data,
            exchange: delivery.exchange.as_str(),
            routing_key: delivery.routing_key.as_str(),
            message_id: delivery
                .properties
                .message_id()
                .as_ref()
                .map_or("", |s| s.as_str()),
            state,
        }
    }

    fn identity(&self) -> u64 {
        requeue::identity(self.message_id, self.routing_key, self.body)
    }
}

/// What a requeue answers for: a copy the broker did not confirm, or a panic while settling.
enum Cause<'a> {
    Copy(&'a CopyError),
    /// The copy without a malformed `x-death`: its original cannot always be dead-lettered.
    SanitizedCopy(&'a CopyError),
    Panic(&'a str),
}

impl Cause<'_> {
    /// A requeue that does not count toward the limit: the broker blocked publishing, which is
    /// not the message's fault.
    fn counts(&self) -> bool {
        !matches!(
            self,
            Cause::Copy(CopyError::Blocked(_)) | Cause::SanitizedCopy(CopyError::Blocked(_))
        )
    }

    /// Whether the requeue limit may end in the DLQ: not for a message with a malformed
    /// `x-death` on a broker that crashes dead-lettering it.
    fn may_dead_letter(&self, rules: &Rules) -> bool {
        !matches!(self, Cause::SanitizedCopy(_)) || rules.dead_letters_malformed_x_death
    }
}

impl fmt::Display for Cause<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::Copy(e) | Cause::SanitizedCopy(e) => e.fmt(f),
            Cause::Panic(e) => f.write_str(e),
        }
    }
}

/// One delivery's settling: the broker side, the rules, and the worker state it touches.
pub(crate) struct Settle<'a, B> {
    pub(crate) broker: B,
    pub(crate) rules: &'a Rules,
    pub(crate) message: Message<'a>,
    pub(crate) meters: &'a Meters,
    pub(crate) requeues: &'a Mutex<RequeueLedger>,
    /// Cancelled when the shutdown grace period is over: a requeue pause ends early.
    pub(crate) hard_stop: &'a CancellationToken,
}

impl<B: Broker> Settle<'_, B> {
    /// Carries out `outcome`.
    pub(crate) async fn run(&self, outcome: Outcome) -> Settled {
        match outcome {
            Outcome::Ack => {
                if self.broker.ack(true) {
                    Settled::Acked
                } else {
                    self.failed("ack", Ok(false))
                }
            }
            // Boxed, like the other cold paths: the delivery's future stays small.
            Outcome::Retry {
                delay,
                attempt,
                jittered,
                error,
            } => Box::pin(self.retry(delay, attempt, jittered, &error)).await,
            Outcome::DeadLetter { reason, error } => {
                Box::pin(self.dead_letter(reason, &error)).await
            }
            Outcome::Forward {
                to,
                reason,
                attempts,
                error,
            } => Box::pin(self.forward(&to, reason, attempts, &error)).await,
            Outcome::Sanitize(headers) => Box::pin(self.sanitize(headers)).await,
            Outcome::Requeue { reason, error } => {
                Box::pin(self.requeue_bounded(reason, Cause::Panic(&error))).await
            }
            Outcome::Abandon => Settled::Abandoned,
            Outcome::Early { remaining } => Box::pin(self.early(remaining)).await,
        }
    }

    /// A native retry handed out `remaining` before its time: the broker ignores
    /// `x-opt-delivery-time` (a classic queue, a node before 4.3). The message waits the rest in
    /// the delay levels (a confirmed copy, its retry state unchanged, then the original
    /// accepted), and this worker's later retries go there too.
    async fn early(&self, remaining: Duration) -> Settled {
        let msg = &self.message;
        if !self.rules.retries.ignored() {
            error!(queue = %self.rules.queue, message_id = %msg.message_id, early_by_ms = remaining.as_millis() as u64, "the broker delivered a native retry before its time (it ignores x-opt-delivery-time: a classic queue, or a node before RabbitMQ 4.3?); the handler did not run, and retries use the delay levels from now on");
        }
        self.rules.retries.set_ignored(&self.rules.queue);
        if !self.broker.is_open() {
            return self.failed("hold", Ok(false));
        }
        let delay = remaining.min(self.rules.max_delay);
        let props = self.original().waiting();
        match self
            .broker
            .copies()
            .publish_delayed(&self.rules.queue, delay, msg.body, props)
            .await
        {
            Ok(()) => self.ack_replaced("hold", Settled::Retried),
            Err(e) => {
                error!(message_id = %msg.message_id, error = %e, "the copy holding an early retry was not confirmed; requeueing the original");
                self.requeue_bounded(DeadLetterReason::EarlyUnconfirmed, Cause::Copy(&e))
                    .await
            }
        }
    }

    /// A native retry: the queue holds the delivery until `delay` has passed and hands it out
    /// again with the new retry state as annotations. No copy, no hop, the delay exact.
    async fn hold(&self, delay: Duration, attempt: u32, error: &str) -> Settled {
        let msg = &self.message;
        let until_ms =
            now_ms().saturating_add(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX));
        let state = self.original().next_state(attempt, delay, error, until_ms);
        match self.own_frame(self.broker.hold(until_ms, &state)).await {
            Ok(true) => {
                self.forget_requeues();
                metrics::counter!(m::MESSAGES_RETRIED, m::LABEL_QUEUE => self.rules.queue.clone(), m::LABEL_ATTEMPT => m::attempt_label(attempt))
                    .increment(1);
                info!(
                    message_id = %msg.message_id,
                    attempt,
                    delay_ms = delay.as_millis() as u64,
                    error = %error,
                    native = true,
                    "retry scheduled"
                );
                Settled::Retried
            }
            other => self.failed("retry", other),
        }
    }

    fn original(&self) -> Original<'_> {
        let msg = &self.message;
        Original {
            properties: msg.properties,
            exchange: msg.exchange,
            routing_key: msg.routing_key,
            state: msg.state,
            connection_user: &self.rules.username,
        }
    }

    /// Publishes the retry copy, confirmed, then acks the original. A `jittered` delay is random
    /// anyway: it is rounded to the delay levels' hop limit first, and the copy records the
    /// rounded delay (the next decision's `prev_delay`), as does the log line.
    async fn retry(&self, delay: Duration, attempt: u32, jittered: bool, error: &str) -> Settled {
        let msg = &self.message;
        if !self.broker.is_open() {
            return self.failed("retry", Ok(false));
        }
        if self.broker.holds_retries() && !self.rules.retries.ignored() {
            return self.hold(delay, attempt, error).await;
        }
        let max = self.rules.max_delay;
        let delay = if delay > max {
            warn!(requested = ?delay, max = ?max, "retry delay above the delay infrastructure's maximum; using the maximum");
            max
        } else {
            delay
        };
        let delay = if jittered {
            self.rules.delay_levels.round_jittered(delay)
        } else {
            delay
        };
        let props = self.original().retry(attempt, delay, error);
        let queue = &self.rules.queue;
        match self
            .broker
            .copies()
            .publish_delayed(queue, delay, msg.body, props)
            .await
        {
            Ok(()) => {
                metrics::counter!(m::MESSAGES_RETRIED, m::LABEL_QUEUE => queue.clone(), m::LABEL_ATTEMPT => m::attempt_label(attempt))
                    .increment(1);
                info!(
                    message_id = %msg.message_id,
                    attempt,
                    delay_ms = delay.as_millis() as u64,
                    error = %error,
                    "retry scheduled"
                );
                self.ack_replaced("retry", Settled::Retried)
            }
            Err(CopyError::Publish(e @ PublishError::TooLarge { .. })) => {
                // The same copy will never fit: no requeue, no retry.
                let error = format!("{error} (retry copy refused: {e})");
                self.dead_letter(DeadLetterReason::TooLarge, &error).await
            }
            Err(e) => {
                error!(
                    message_id = %msg.message_id,
                    attempt,
                    error = %e,
                    handler_error = %error,
                    "retry copy not confirmed by the broker; requeueing the original"
                );
                self.requeue_bounded(DeadLetterReason::RetryUnconfirmed, Cause::Copy(&e))
                    .await
            }
        }
    }

    /// Moves the message to the DLQ the configured way; the final error and reason go to the
    /// span, the log line and the metric in every mode.
    async fn dead_letter(&self, reason: DeadLetterReason, error: &str) -> Settled {
        let span = Span::current();
        span.record("reason", reason.as_str());
        span.record("error", error);
        if self.broker.holds_retries() {
            // The queue's DLX moves the message with the reason as annotations: Reject's path
            // and Annotate's readable reason in one.
            return self.reject_to_dlx(reason, error).await;
        }
        match self.rules.mode {
            DeadLetterMode::Reject => self.reject_to_dlx(reason, error).await,
            DeadLetterMode::Annotate => Box::pin(self.annotate_to_dlx(reason, error)).await,
        }
    }

    /// `Annotate`: publishes the dead letter to `Q.dlx` with the reason and the final error,
    /// confirmed, then acks the original. The broker never sees a reject, so the copy carries no
    /// `x-death`.
    async fn annotate_to_dlx(&self, reason: DeadLetterReason, error: &str) -> Settled {
        let msg = &self.message;
        if !self.broker.is_open() {
            return self.failed("dead-letter", Ok(false));
        }
        let props = self.original().dead_letter(&DeadLetterInfo {
            reason: reason.as_str().to_owned(),
            error: Some(error.to_owned()),
            attempts: Some(u64::from(msg.state.attempt) + 1),
            at: Some(headers::now_rfc3339()),
            by: Some(self.rules.connection_name.clone()),
        });
        match self
            .broker
            .copies()
            .publish(&self.rules.dlx, &self.rules.queue, msg.body, props)
            .await
        {
            Ok(()) => {
                self.count_dead_letter(reason, error, "message dead-lettered (annotated)");
                self.ack_replaced("dead-letter", Settled::DeadLettered)
            }
            // The body is the one the broker accepted and headers do not count, so only a
            // broker whose limit was lowered since refuses it: it can still move the original.
            Err(CopyError::Publish(PublishError::TooLarge { .. })) => {
                self.reject_to_dlx(reason, error).await
            }
            Err(e) => {
                error!(message_id = %msg.message_id, error = %e, reason = reason.as_str(), "dead letter not confirmed by the broker; requeueing the original");
                self.requeue_bounded(DeadLetterReason::DeadLetterUnconfirmed, Cause::Copy(&e))
                    .await
            }
        }
    }

    /// `basic.reject(requeue = false)`, or a native dead letter: the broker's DLX moves the
    /// message to the DLQ.
    async fn reject_to_dlx(&self, reason: DeadLetterReason, error: &str) -> Settled {
        let info = DeadLetterInfo {
            reason: reason.as_str().to_owned(),
            error: Some(error.to_owned()),
            attempts: Some(u64::from(self.message.state.attempt) + 1),
            at: Some(headers::now_rfc3339()),
            by: Some(self.rules.connection_name.clone()),
        };
        let dead_letter = self.broker.dead_letter(&info, self.message.state);
        match self.own_frame(dead_letter).await {
            Ok(true) => {
                // The broker moves the original unchanged; this event is where the final error
                // lives, so it carries the message id itself.
                self.count_dead_letter(reason, error, "message dead-lettered");
                Settled::DeadLettered
            }
            other => self.failed("reject", other),
        }
    }

    fn count_dead_letter(&self, reason: DeadLetterReason, error: &str, event: &str) {
        metrics::counter!(m::MESSAGES_DEAD_LETTERED, m::LABEL_QUEUE => self.rules.queue.clone(), m::LABEL_REASON => reason.as_str())
            .increment(1);
        warn!(
            message_id = %self.message.message_id,
            attempt = self.message.state.attempt,
            reason = reason.as_str(),
            error = %error,
            dlq = %self.rules.dlq,
            "{event}"
        );
    }

    /// Publishes a copy to the policy's other destination, confirmed and mandatory, then acks
    /// the original (as an annotated dead letter does). A destination that no longer routes
    /// it returns the copy: the original is requeued, bounded like every unconfirmed copy.
    async fn forward(
        &self,
        to: &Forward,
        reason: &'static str,
        attempts: u32,
        error: &str,
    ) -> Settled {
        let msg = &self.message;
        if !self.broker.is_open() {
            return self.failed("forward", Ok(false));
        }
        let span = Span::current();
        span.record("reason", reason);
        span.record("error", error);
        let props = self.original().forwarded(&ForwardInfo {
            from: self.rules.queue.to_string(),
            reason: reason.to_owned(),
            error: Some(error.to_owned()),
            attempts: Some(u64::from(attempts)),
            at: Some(headers::now_rfc3339()),
            by: Some(self.rules.connection_name.clone()),
        });
        match self
            .broker
            .copies()
            .publish(to.exchange(), to.routing_key(), msg.body, props)
            .await
        {
            Ok(()) => {
                let destination = match to.queue() {
                    Some(q) => q.to_owned(),
                    None => format!("{}/{}", to.exchange(), to.routing_key()),
                };
                metrics::counter!(m::MESSAGES_FORWARDED, m::LABEL_QUEUE => self.rules.queue.clone(), m::LABEL_DESTINATION => destination)
                    .increment(1);
                info!(message_id = %msg.message_id, attempts, reason, error = %error, to = %to, "message forwarded");
                self.ack_replaced("forward", Settled::Forwarded)
            }
            Err(CopyError::Publish(e @ PublishError::TooLarge { .. })) => {
                let error = format!("{error} (forwarded copy refused: {e})");
                self.dead_letter(DeadLetterReason::TooLarge, &error).await
            }
            Err(e) => {
                error!(message_id = %msg.message_id, error = %e, to = %to, "forwarded copy not confirmed by the broker; requeueing the original");
                self.requeue_bounded(DeadLetterReason::ForwardUnconfirmed, Cause::Copy(&e))
                    .await
            }
        }
    }

    /// Republishes the delivery, with its malformed `x-death` removed, to the back of its own
    /// queue and acks the original once the broker confirmed the copy. The copy is then
    /// processed like any message (the handler never sees the original).
    async fn sanitize(&self, sanitized: lapin::types::FieldTable) -> Settled {
        let msg = &self.message;
        if !self.broker.is_open() {
            return self.failed("sanitize", Ok(false));
        }
        let props = self.original().sanitized(sanitized);
        // The default exchange routes to the queue by name, whatever its bindings.
        match self
            .broker
            .copies()
            .publish("", &self.rules.queue, msg.body, props)
            .await
        {
            Ok(()) => {
                self.meters.sanitized.increment(1);
                warn!(
                    message_id = %msg.message_id,
                    "malformed x-death header (RabbitMQ cannot dead-letter it): republished the message without the bad entries"
                );
                self.ack_replaced("sanitize", Settled::Sanitized)
            }
            Err(e) => {
                error!(message_id = %msg.message_id, error = %e, "copy without the malformed x-death not confirmed by the broker; requeueing the original");
                self.requeue_bounded(
                    DeadLetterReason::SanitizeUnconfirmed,
                    Cause::SanitizedCopy(&e),
                )
                .await
            }
        }
    }

    fn forget_requeues(&self) {
        let mut ledger = requeue::lock(self.requeues);
        if !ledger.is_empty() {
            ledger.forget(self.message.identity());
        }
    }

    /// The original's replacement is confirmed: forget its requeues and ack it.
    fn ack_replaced(&self, op: &str, done: Settled) -> Settled {
        self.forget_requeues();
        if self.broker.ack(false) {
            done
        } else {
            warn!(message_id = %self.message.message_id, op, "the copy is published but the original could not be acked: it will be delivered again");
            self.failed(op, Ok(false))
        }
    }

    /// Gives a message whose replacement copy was not confirmed back to its queue, unless this
    /// worker already did so `requeue_limit` times: then it is dead-lettered instead (RabbitMQ
    /// 4.3 no longer counts requeues toward the delivery limit, and a classic queue never did,
    /// so nothing else would end the cycle), except a message with a malformed `x-death` on a
    /// broker that crashes dead-lettering it (there its quorum queue counts the requeues).
    async fn requeue_bounded(&self, reason: DeadLetterReason, cause: Cause<'_>) -> Settled {
        let key = self.message.identity();
        let count = if cause.counts() {
            requeue::lock(self.requeues).record(key)
        } else {
            requeue::lock(self.requeues).count(key)
        };
        let limit = self.rules.requeue_limit;
        if count > limit && cause.may_dead_letter(self.rules) {
            requeue::lock(self.requeues).forget(key);
            error!(message_id = %self.message.message_id, requeues = count - 1, limit, "requeue limit reached: dead-lettering the message instead");
            let error = format!("{} {} times, last: {cause}", reason.as_str(), count - 1);
            let span = Span::current();
            span.record("reason", DeadLetterReason::RequeueLimit.as_str());
            span.record("error", error.as_str());
            // Rejected whatever the mode: publishing is what keeps failing.
            return self
                .reject_to_dlx(DeadLetterReason::RequeueLimit, &error)
                .await;
        }
        metrics::counter!(m::MESSAGES_REQUEUED, m::LABEL_QUEUE => self.rules.queue.clone(), m::LABEL_REASON => reason.as_str())
            .increment(1);
        warn!(message_id = %self.message.message_id, reason = reason.as_str(), requeues = count, limit, "requeueing the message");
        if !self.broker.is_open() {
            // Lost with the connection: nothing to requeue, the broker redelivers it.
            return self.failed("requeue", Ok(false));
        }
        tokio::select! {
            _ = tokio::time::sleep(REQUEUE_PAUSE) => {}
            _ = self.hard_stop.cancelled() => {}
        }
        // basic.reject, not basic.nack: from RabbitMQ 4.3 a quorum queue counts a reject toward
        // x-delivery-limit but not a nack, and the delivery limit is the guard of last resort.
        match self.reject(true).await {
            Ok(true) => Settled::Requeued,
            other => self.failed("requeue", other),
        }
    }

    /// `basic.reject`, and what its fate means for the channel's batched acks.
    async fn reject(&self, requeue: bool) -> Result<bool, lapin::Error> {
        self.own_frame(self.broker.reject(requeue)).await
    }

    /// A settlement sent in a frame of its own (a reject, a native outcome), and what its fate
    /// means for the channel's batched acks.
    async fn own_frame(
        &self,
        frame: impl std::future::Future<Output = Result<bool, lapin::Error>>,
    ) -> Result<bool, lapin::Error> {
        let rejected = frame.await;
        match rejected {
            // Only once the reject frame is out may a batched ack cover later tags.
            Ok(true) => self.broker.released(),
            // Releasing the tag now would let a later multiple ack settle a message that was
            // never rejected: give the whole channel back instead.
            _ => self.broker.abandon_channel("reject failed").await,
        }
        rejected
    }

    /// An ack/reject that did not reach the broker: never a success. The message will be
    /// redelivered (`redelivered = true`), so this counts a future duplicate.
    fn failed(&self, op: &str, result: Result<bool, lapin::Error>) -> Settled {
        self.meters.settle_failures.increment(1);
        match result {
            Ok(_) => warn!(
                op,
                "settle failed: the delivery's channel is closed; the broker will redeliver it"
            ),
            Err(e) => warn!(op, error = %e, "settle failed; the broker will redeliver it"),
        }
        Settled::Failed
    }
}
