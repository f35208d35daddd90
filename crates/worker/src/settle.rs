//! Carrying out an [`Outcome`] on the broker: ack, retry, dead-letter, requeue, repair.
//!
//! Every rule of settling lives in [`Settle::run`], written against the small [`Broker`]
//! trait: [`LapinBroker`] is the real one (the delivery's channel and the session's confirmed
//! publisher), the tests below use a scripted one. The rules:
//!
//! - a copy (retry, annotated dead letter, repaired message) is published and confirmed before
//!   the original is acked, so there is never a moment with neither;
//! - a copy the broker did not take (nacked, returned, channel closed) gives the original back
//!   to its queue after a pause, a bounded number of times;
//! - once the delivery's channel is gone nothing is sent: the broker redelivers the original, so a
//!   copy would only be a duplicate.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::BasicRejectOptions;
use lapin::types::FieldTable;
use lapin::Acker;
use lapin::BasicProperties;
use redeliver_amqp::headers::{self, RetryState};
use redeliver_amqp::DelayConfig;
use redeliver_amqp::{PublishError, Publisher};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn, Span};

use crate::acks::AckSender;
use crate::meters::Meters;
use crate::metrics_names as m;
use crate::outcome::{self, Outcome, Settled};
use crate::publishing::{Publishing, REOPEN_TIMEOUT};
use crate::requeue::{self, RequeueLedger};
use crate::settings::DeadLetterMode;

/// Pause before requeueing a message whose copy could not be published: without it a broker
/// that refuses publishes (delay infrastructure missing, resource alarm) turns into a hot
/// redelivery loop. Holding the concurrency permit meanwhile is the intended back-pressure.
const REQUEUE_PAUSE: Duration = Duration::from_secs(1);

/// What settling one delivery needs from the broker.
pub(crate) trait Broker {
    /// The delivery's channel is still open; settling on a closed one cannot reach the broker.
    fn is_open(&self) -> bool;
    /// Hands the delivery to its channel's batched acks (`success`: its handler succeeded);
    /// false when the channel is closed.
    fn ack(&self, success: bool) -> bool;
    /// `basic.reject`; `Ok(false)` when the channel is closed.
    async fn reject(&self, requeue: bool) -> Result<bool, lapin::Error>;
    /// The delivery was settled by a frame of its own: later batched acks need not wait for it.
    fn released(&self);
    /// A frame of the delivery's own did not go out, so its tag must stay unsettled: closes the
    /// channel, and the broker gives every delivery of it back to the queue.
    async fn abandon_channel(&self, why: &'static str);
    /// Publishes a copy for `queue` through the delay levels and waits for the confirm.
    async fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), CopyError>;
    /// Publishes a copy (mandatory) and waits for the confirm.
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), CopyError>;
}

/// Why a copy was not confirmed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CopyError {
    /// The publisher refused it, or the broker nacked or returned it.
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// No confirm within the confirm timeout.
    #[error("no confirm from the broker within {0:?}")]
    Timeout(Duration),
    /// The broker blocked the publishing connection (a resource alarm) for longer than the
    /// confirm timeout, or while the copy waited for its confirm.
    #[error("the broker blocks the publishing connection (resource alarm); waited {0:?}")]
    Blocked(Duration),
    /// The publishing connection or its channel could not be (re)opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// The publishing connection or its channels were still being reopened when the confirm
    /// timeout ran out (a node that accepts TCP and does not answer, say).
    #[error("the publishing connection could not be reopened within {0:?}")]
    Reopen(Duration),
}

/// Why the publisher could not be (re)opened.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    #[error("publishing connection: {0}")]
    Connect(#[from] redeliver_amqp::ConnectError),
    #[error(transparent)]
    Publish(#[from] PublishError),
}

impl From<OpenError> for crate::WorkerError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::Connect(e) => crate::WorkerError::Connect(e),
            OpenError::Publish(e) => crate::WorkerError::Publisher(e),
        }
    }
}

impl CopyError {
    /// Not the message's fault: its requeue does not count toward the requeue limit.
    fn is_blocked(&self) -> bool {
        matches!(self, CopyError::Blocked(_))
    }
}

/// The settling rules of one session: the worker's settings and what the broker said.
#[derive(Clone, Debug)]
pub(crate) struct Rules {
    pub(crate) queue: String,
    pub(crate) dlx: String,
    pub(crate) dlq: String,
    pub(crate) mode: DeadLetterMode,
    pub(crate) requeue_limit: u32,
    /// Written on annotated dead letters (`x-redeliver-dead-lettered-by`).
    pub(crate) connection_name: String,
    /// Longest delay the delay levels can hold; longer ones are clamped.
    pub(crate) max_delay: Duration,
    /// The connection's user: a copy keeps a `user_id` only if it is this one.
    pub(crate) username: String,
    /// The broker dead-letters a message with a malformed `x-death` without crashing (so a
    /// repair that keeps failing may end in the DLQ). False for RabbitMQ 3.x and unknown ones.
    pub(crate) dead_letters_malformed_x_death: bool,
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
                error,
            } => Box::pin(self.retry(delay, attempt, &error)).await,
            Outcome::DeadLetter { reason, error } => {
                Box::pin(self.dead_letter(reason, &error)).await
            }
            Outcome::Repair(headers) => Box::pin(self.repair(headers)).await,
            Outcome::Requeue { reason, error } => {
                Box::pin(self.requeue_bounded(reason, true, &error, true)).await
            }
            Outcome::Abandon => Settled::Abandoned,
        }
    }

    async fn retry(&self, delay: Duration, attempt: u32, error: &str) -> Settled {
        let msg = &self.message;
        if !self.broker.is_open() {
            return self.failed("retry", Ok(false));
        }
        let max = self.rules.max_delay;
        let delay = if delay > max {
            warn!(requested = ?delay, max = ?max, "retry delay above the delay infrastructure's maximum; using the maximum");
            max
        } else {
            delay
        };
        let copy_state = outcome::next_retry_state(
            msg.state,
            attempt,
            delay,
            error,
            msg.exchange,
            msg.routing_key,
        );
        let copy_headers =
            headers::retry_copy_headers(msg.properties.headers().as_ref(), &copy_state);
        let props =
            outcome::retry_copy_properties(msg.properties, copy_headers, &self.rules.username);
        let queue = &self.rules.queue;
        match self
            .broker
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
                self.dead_letter(m::REASON_TOO_LARGE, &error).await
            }
            Err(e) => {
                error!(
                    message_id = %msg.message_id,
                    attempt,
                    error = %e,
                    handler_error = %error,
                    "retry copy not confirmed by the broker; requeueing the original"
                );
                self.requeue_bounded(m::REASON_RETRY_UNCONFIRMED, true, &e, !e.is_blocked())
                    .await
            }
        }
    }

    /// Moves the message to the DLQ the configured way; the final error and reason go to the
    /// span, the log line and the metric in every mode.
    async fn dead_letter(&self, reason: &'static str, error: &str) -> Settled {
        let span = Span::current();
        span.record("reason", reason);
        span.record("error", error);
        match self.rules.mode {
            DeadLetterMode::Reject => self.reject_to_dlx(reason, error).await,
            DeadLetterMode::Annotate => Box::pin(self.annotate_to_dlx(reason, error)).await,
        }
    }

    /// `Annotate`: publishes the dead letter to `Q.dlx` with the reason and the final error,
    /// confirmed, then acks the original. The broker never sees a reject, so the copy carries no
    /// `x-death`.
    async fn annotate_to_dlx(&self, reason: &'static str, error: &str) -> Settled {
        let msg = &self.message;
        if !self.broker.is_open() {
            return self.failed("dead-letter", Ok(false));
        }
        let info = headers::DeadLetterInfo {
            reason: reason.to_owned(),
            error: Some(error.to_owned()),
            attempts: Some(u64::from(msg.state.attempt) + 1),
            at: Some(headers::now_rfc3339()),
            by: Some(self.rules.connection_name.clone()),
        };
        let hdrs = headers::dead_letter_headers(
            msg.properties.headers().as_ref(),
            &info,
            msg.properties.expiration().as_ref().map(|e| e.as_str()),
        );
        let props = outcome::retry_copy_properties(msg.properties, hdrs, &self.rules.username);
        match self
            .broker
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
                error!(message_id = %msg.message_id, error = %e, reason, "dead letter not confirmed by the broker; requeueing the original");
                self.requeue_bounded(m::REASON_DEAD_LETTER_UNCONFIRMED, true, &e, !e.is_blocked())
                    .await
            }
        }
    }

    /// `basic.reject(requeue = false)`: the broker's DLX moves the message to the DLQ.
    async fn reject_to_dlx(&self, reason: &'static str, error: &str) -> Settled {
        match self.reject(false).await {
            Ok(true) => {
                // The broker moves the original unchanged; this event is where the final error
                // lives, so it carries the message id itself.
                self.count_dead_letter(reason, error, "message dead-lettered");
                Settled::DeadLettered
            }
            other => self.failed("reject", other),
        }
    }

    fn count_dead_letter(&self, reason: &'static str, error: &str, event: &str) {
        metrics::counter!(m::MESSAGES_DEAD_LETTERED, m::LABEL_QUEUE => self.rules.queue.clone(), m::LABEL_REASON => reason)
            .increment(1);
        warn!(
            message_id = %self.message.message_id,
            attempt = self.message.state.attempt,
            reason,
            error = %error,
            dlq = %self.rules.dlq,
            "{event}"
        );
    }

    /// Republishes the delivery, with its `x-death` repaired, to the back of its own queue and
    /// acks the original once the broker confirmed the copy. The copy is then processed like
    /// any message (the handler never sees the original).
    async fn repair(&self, repaired: FieldTable) -> Settled {
        let msg = &self.message;
        if !self.broker.is_open() {
            return self.failed("sanitize", Ok(false));
        }
        let props = outcome::retry_copy_properties(msg.properties, repaired, &self.rules.username);
        // The default exchange routes to the queue by name, whatever its bindings.
        match self
            .broker
            .publish("", &self.rules.queue, msg.body, props)
            .await
        {
            Ok(()) => {
                self.meters.sanitized.increment(1);
                warn!(
                    message_id = %msg.message_id,
                    "malformed x-death header (RabbitMQ cannot dead-letter it): republished the message without the bad entries"
                );
                self.ack_replaced("sanitize", Settled::Repaired)
            }
            Err(e) => {
                error!(message_id = %msg.message_id, error = %e, "copy without the malformed x-death not confirmed by the broker; requeueing the original");
                // Dead-lettering the original itself is what crashes RabbitMQ 3.x; there its
                // quorum queue counts the requeues instead.
                self.requeue_bounded(
                    m::REASON_REPAIR_UNCONFIRMED,
                    self.rules.dead_letters_malformed_x_death,
                    &e,
                    !e.is_blocked(),
                )
                .await
            }
        }
    }

    /// The original's replacement is confirmed: forget its requeues and ack it.
    fn ack_replaced(&self, op: &str, done: Settled) -> Settled {
        {
            let mut ledger = requeue::lock(self.requeues);
            if !ledger.is_empty() {
                ledger.forget(self.message.identity());
            }
        }
        if self.broker.ack(false) {
            done
        } else {
            warn!(message_id = %self.message.message_id, op, "the copy is published but the original could not be acked: it will be delivered again");
            self.failed(op, Ok(false))
        }
    }

    /// Gives a message whose replacement copy was not confirmed back to its queue, unless this
    /// worker already did so `requeue_limit` times: then, where `may_dead_letter`, it is
    /// dead-lettered instead (RabbitMQ 4.3 no longer counts requeues toward the delivery limit,
    /// and a classic queue never did, so nothing else would end the cycle). A requeue that does
    /// not `count` (the broker blocked publishing) leaves the tally as it was.
    async fn requeue_bounded(
        &self,
        reason: &'static str,
        may_dead_letter: bool,
        cause: &(dyn std::fmt::Display + Sync),
        count: bool,
    ) -> Settled {
        let key = self.message.identity();
        let count = if count {
            requeue::lock(self.requeues).record(key)
        } else {
            requeue::lock(self.requeues).count(key)
        };
        let limit = self.rules.requeue_limit;
        if count > limit && may_dead_letter {
            requeue::lock(self.requeues).forget(key);
            error!(message_id = %self.message.message_id, requeues = count - 1, limit, "requeue limit reached: dead-lettering the message instead");
            let error = format!("{reason} {} times, last: {cause}", count - 1);
            let span = Span::current();
            span.record("reason", m::REASON_REQUEUE_LIMIT);
            span.record("error", error.as_str());
            // Rejected whatever the mode: publishing is what keeps failing.
            return self.reject_to_dlx(m::REASON_REQUEUE_LIMIT, &error).await;
        }
        metrics::counter!(m::MESSAGES_REQUEUED, m::LABEL_QUEUE => self.rules.queue.clone(), m::LABEL_REASON => reason)
            .increment(1);
        warn!(message_id = %self.message.message_id, reason, requeues = count, limit, "requeueing the message");
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
        let rejected = self.broker.reject(requeue).await;
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

/// The session's side of settling: the consumer channel's batched acks, the confirmed
/// publisher on the publishing connection, and the rules.
pub(crate) struct Link {
    publishing: Arc<Publishing>,
    delay: DelayConfig,
    publisher: tokio::sync::Mutex<Option<Publisher>>,
    /// Largest body the publisher sends (the builder's, or the broker version's default).
    max_message_size: Option<usize>,
    confirm_timeout: Duration,
    /// Acks of the consumer channel (batched); rejects go through each delivery's acker.
    pub(crate) acks: AckSender,
    pub(crate) rules: Rules,
    pub(crate) meters: Meters,
    /// The queue's name, shared with every handler's [`Context`](crate::Context) without a copy.
    pub(crate) queue: Arc<str>,
}

impl Link {
    /// Opens the publisher on `publishing` (its connection opened if needed).
    pub(crate) async fn open(
        publishing: Arc<Publishing>,
        delay: DelayConfig,
        max_message_size: Option<usize>,
        confirm_timeout: Duration,
        acks: AckSender,
        rules: Rules,
        meters: Meters,
    ) -> Result<Self, OpenError> {
        let link = Self {
            publishing,
            delay,
            publisher: tokio::sync::Mutex::new(None),
            max_message_size,
            confirm_timeout,
            acks,
            queue: Arc::from(rules.queue.as_str()),
            rules,
            meters,
        };
        link.publisher().await?;
        Ok(link)
    }

    /// The broker side of settling `delivery`, which came on this session's consumer channel.
    pub(crate) fn broker<'a>(&'a self, delivery: &'a Delivery) -> LapinBroker<'a> {
        LapinBroker {
            link: self,
            acker: &delivery.acker,
            tag: delivery.delivery_tag,
        }
    }

    /// The confirm-mode publisher, reopened if its channel or connection was closed (a soft
    /// error closes a channel and lapin does not reopen it).
    async fn publisher(&self) -> Result<Publisher, OpenError> {
        let mut current = self.publisher.lock().await;
        if let Some(p) = current
            .as_ref()
            .filter(|p| p.channel().status().connected())
        {
            return Ok(p.clone());
        }
        let connection = self.publishing.connection().await?;
        // Bounded like the connect: a node that took the connection and then stops answering
        // must not hold the lock, and every delivery that needs it, for ever.
        let p = match tokio::time::timeout(
            REOPEN_TIMEOUT,
            Publisher::new(&connection, self.delay.clone()),
        )
        .await
        {
            Ok(p) => p?,
            Err(_) => {
                let timed_out = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the publisher's channels were not opened within {REOPEN_TIMEOUT:?}"),
                );
                return Err(OpenError::Publish(PublishError::Amqp(timed_out.into())));
            }
        };
        let p = match self.max_message_size {
            Some(n) => p.with_max_message_size(n),
            None => p,
        };
        if current.is_some() {
            debug!("reopened the publisher channel");
        }
        *current = Some(p.clone());
        Ok(p)
    }

    /// Publishes with `send` once the broker does not block the publishing connection, within
    /// the confirm timeout.
    async fn confirmed<F>(&self, send: impl FnOnce(Publisher) -> F) -> Result<(), CopyError>
    where
        F: std::future::Future<Output = Result<(), PublishError>>,
    {
        let started = tokio::time::Instant::now();
        let mut blocked = self.publishing.blocked();
        // Waiting here, not in a publish whose frames sit in the socket: the broker would read
        // them after the alarm and route a copy whose original was already given back.
        if *blocked.borrow() {
            let unblocked = blocked.wait_for(|b| !*b);
            if tokio::time::timeout(self.confirm_timeout, unblocked)
                .await
                .is_err()
            {
                return Err(CopyError::Blocked(started.elapsed()));
            }
        }
        // Within the same deadline: reopening after a lost connection may wait on a node that
        // never answers, and the delivery must be settled (requeued) meanwhile, not held.
        let left = self.confirm_timeout.saturating_sub(started.elapsed());
        let publisher = match tokio::time::timeout(left, self.publisher()).await {
            Ok(publisher) => publisher?,
            Err(_) => return Err(CopyError::Reopen(self.confirm_timeout)),
        };
        let left = self.confirm_timeout.saturating_sub(started.elapsed());
        // Giving up drops the publish: the publisher then withdraws it unless it is already on
        // the connection, so a copy whose original is requeued is not sent after that.
        match tokio::time::timeout(left, send(publisher)).await {
            Ok(result) => result.map_err(CopyError::from),
            Err(_) if *self.publishing.blocked().borrow() => {
                Err(CopyError::Blocked(started.elapsed()))
            }
            Err(_) => Err(CopyError::Timeout(self.confirm_timeout)),
        }
    }
}

/// [`Broker`] on lapin: the delivery's own acker (tags belong to their channel, so a delivery of
/// a dead channel can never be settled on a newer one) and the session's publisher.
pub(crate) struct LapinBroker<'a> {
    link: &'a Link,
    acker: &'a Acker,
    tag: u64,
}

impl Broker for LapinBroker<'_> {
    fn is_open(&self) -> bool {
        self.acker.usable()
    }

    fn ack(&self, success: bool) -> bool {
        let usable = self.acker.usable();
        if usable {
            self.link.acks.ack(self.tag, success);
        }
        usable
    }

    async fn reject(&self, requeue: bool) -> Result<bool, lapin::Error> {
        self.acker.reject(BasicRejectOptions { requeue }).await
    }

    fn released(&self) {
        self.link.acks.released(self.tag);
    }

    async fn abandon_channel(&self, why: &'static str) {
        self.link.acks.abandon_channel(why).await;
    }

    async fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), CopyError> {
        self.link
            .confirmed(|p| async move { p.publish_delayed(queue, delay, body, props).await })
            .await
    }

    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), CopyError> {
        self.link
            .confirmed(|p| async move { p.publish_copy(exchange, routing_key, body, props).await })
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex as StdMutex;

    use lapin::types::{AMQPValue, ShortString};

    use super::*;

    /// What the code under test asked of the broker.
    #[derive(Debug, Clone, PartialEq)]
    enum Call {
        Ack {
            success: bool,
        },
        Reject {
            requeue: bool,
        },
        PublishDelayed {
            queue: String,
            delay: Duration,
        },
        Publish {
            exchange: String,
            routing_key: String,
        },
    }

    /// A scripted broker: publishes answer in order from `publish_results` (confirmed when
    /// empty), `open` says whether the channel is up, `close_after_publish` closes it once a
    /// publish is done (a channel lost mid-settle), `reject_result` answers rejects.
    struct FakeBroker {
        calls: StdMutex<Vec<Call>>,
        props: StdMutex<Vec<BasicProperties>>,
        publish_results: StdMutex<VecDeque<Result<(), CopyError>>>,
        open: StdMutex<bool>,
        close_after_publish: bool,
        reject_result: fn() -> Result<bool, lapin::Error>,
        /// Tags released to the batched acks, channels abandoned: what a later multiple ack
        /// could cover, kept apart from `calls` (no frame of their own).
        released: StdMutex<u32>,
        abandoned: StdMutex<Vec<&'static str>>,
    }

    impl FakeBroker {
        fn new() -> Self {
            Self {
                calls: StdMutex::default(),
                props: StdMutex::default(),
                publish_results: StdMutex::default(),
                open: StdMutex::new(true),
                close_after_publish: false,
                reject_result: || Ok(true),
                released: StdMutex::new(0),
                abandoned: StdMutex::default(),
            }
        }

        fn answering(results: impl IntoIterator<Item = Result<(), PublishError>>) -> Self {
            let b = Self::new();
            b.publish_results
                .lock()
                .unwrap()
                .extend(results.into_iter().map(|r| r.map_err(CopyError::from)));
            b
        }

        fn answering_copy(results: impl IntoIterator<Item = Result<(), CopyError>>) -> Self {
            let b = Self::new();
            b.publish_results.lock().unwrap().extend(results);
            b
        }

        fn calls(&self) -> Vec<Call> {
            self.calls.lock().unwrap().clone()
        }

        fn published_headers(&self) -> FieldTable {
            let props = self.props.lock().unwrap();
            props
                .last()
                .and_then(|p| p.headers().clone())
                .expect("a publish with headers")
        }

        fn published(&self, props: BasicProperties) -> Result<(), CopyError> {
            self.props.lock().unwrap().push(props);
            if self.close_after_publish {
                *self.open.lock().unwrap() = false;
            }
            self.publish_results
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Ok(()))
        }
    }

    impl Broker for &FakeBroker {
        fn is_open(&self) -> bool {
            *self.open.lock().unwrap()
        }

        fn ack(&self, success: bool) -> bool {
            if !self.is_open() {
                return false;
            }
            self.calls.lock().unwrap().push(Call::Ack { success });
            true
        }

        async fn reject(&self, requeue: bool) -> Result<bool, lapin::Error> {
            self.calls.lock().unwrap().push(Call::Reject { requeue });
            if !self.is_open() {
                return Ok(false);
            }
            (self.reject_result)()
        }

        fn released(&self) {
            *self.released.lock().unwrap() += 1;
        }

        async fn abandon_channel(&self, why: &'static str) {
            self.abandoned.lock().unwrap().push(why);
        }

        async fn publish_delayed(
            &self,
            queue: &str,
            delay: Duration,
            _body: &[u8],
            props: BasicProperties,
        ) -> Result<(), CopyError> {
            self.calls.lock().unwrap().push(Call::PublishDelayed {
                queue: queue.to_owned(),
                delay,
            });
            self.published(props)
        }

        async fn publish(
            &self,
            exchange: &str,
            routing_key: &str,
            _body: &[u8],
            props: BasicProperties,
        ) -> Result<(), CopyError> {
            self.calls.lock().unwrap().push(Call::Publish {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            });
            self.published(props)
        }
    }

    fn rules(mode: DeadLetterMode) -> Rules {
        Rules {
            queue: "orders".into(),
            dlx: "orders.dlx".into(),
            dlq: "orders.dlq".into(),
            mode,
            requeue_limit: 2,
            connection_name: "test-worker".into(),
            max_delay: Duration::from_secs(60),
            username: "guest".into(),
            dead_letters_malformed_x_death: true,
        }
    }

    fn nacked() -> PublishError {
        PublishError::Nacked {
            exchange: "delay".into(),
            routing_key: "orders".into(),
        }
    }

    fn returned() -> PublishError {
        PublishError::Returned {
            exchange: "delay".into(),
            routing_key: "orders".into(),
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        }
    }

    fn too_large() -> PublishError {
        PublishError::TooLarge {
            exchange: "delay".into(),
            routing_key: "orders".into(),
            size: 10,
            limit: Some(5),
        }
    }

    /// One settling of a message `m-1` with the given rules.
    struct Fixture {
        props: BasicProperties,
        state: RetryState,
        meters: Meters,
        requeues: Mutex<RequeueLedger>,
        hard_stop: CancellationToken,
        rules: Rules,
    }

    impl Fixture {
        fn new(mode: DeadLetterMode) -> Self {
            Self {
                props: BasicProperties::default()
                    .with_message_id("m-1".into())
                    .with_expiration("60000".into()),
                state: RetryState::default(),
                meters: Meters::new("orders"),
                requeues: Mutex::default(),
                hard_stop: CancellationToken::new(),
                rules: rules(mode),
            }
        }

        async fn run(&self, broker: &FakeBroker, outcome: Outcome) -> Settled {
            Settle {
                broker,
                rules: &self.rules,
                message: Message {
                    properties: &self.props,
                    body: b"body",
                    exchange: "shop",
                    routing_key: "order.created",
                    message_id: "m-1",
                    state: &self.state,
                },
                meters: &self.meters,
                requeues: &self.requeues,
                hard_stop: &self.hard_stop,
            }
            .run(outcome)
            .await
        }
    }

    fn retry(delay_ms: u64) -> Outcome {
        Outcome::Retry {
            delay: Duration::from_millis(delay_ms),
            attempt: 1,
            error: "timeout".into(),
        }
    }

    fn dead_letter() -> Outcome {
        Outcome::DeadLetter {
            reason: m::REASON_PERMANENT,
            error: "bad input".into(),
        }
    }

    fn header<'a>(h: &'a FieldTable, name: &str) -> Option<&'a AMQPValue> {
        h.inner().get(&ShortString::from(name))
    }

    #[tokio::test]
    async fn success_is_acked_as_a_success() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker::new();
        assert_eq!(f.run(&b, Outcome::Ack).await, Settled::Acked);
        assert_eq!(b.calls(), [Call::Ack { success: true }]);
    }

    #[tokio::test]
    async fn confirmed_retry_copy_then_ack() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker::new();
        assert_eq!(f.run(&b, retry(250)).await, Settled::Retried);
        assert_eq!(
            b.calls(),
            [
                Call::PublishDelayed {
                    queue: "orders".into(),
                    delay: Duration::from_millis(250)
                },
                Call::Ack { success: false },
            ]
        );
        let h = b.published_headers();
        assert_eq!(
            header(&h, headers::ATTEMPT),
            Some(&AMQPValue::LongLongInt(1))
        );
        assert!(header(&h, headers::LAST_ERROR).is_some());
    }

    #[tokio::test]
    async fn retry_delay_is_clamped_to_the_levels_maximum() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker::new();
        f.run(&b, retry(3_600_000)).await;
        assert_eq!(
            b.calls()[0],
            Call::PublishDelayed {
                queue: "orders".into(),
                delay: Duration::from_secs(60)
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn nacked_or_returned_copy_requeues_the_original_after_a_pause() {
        for error in [nacked(), returned()] {
            let f = Fixture::new(DeadLetterMode::Reject);
            let b = FakeBroker::answering([Err(error)]);
            let started = tokio::time::Instant::now();
            assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
            assert!(started.elapsed() >= REQUEUE_PAUSE);
            assert!(matches!(b.calls()[1], Call::Reject { requeue: true }));
            assert_eq!(b.calls().len(), 2, "never acked: {:?}", b.calls());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn requeues_are_bounded_then_the_message_is_dead_lettered() {
        let f = Fixture::new(DeadLetterMode::Annotate);
        for _ in 0..2 {
            let b = FakeBroker::answering([Err(nacked())]);
            assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
        }
        // The third unconfirmed copy is past the limit of 2: rejected to the DLX, whatever the
        // mode, since publishing is what keeps failing.
        let b = FakeBroker::answering([Err(nacked())]);
        assert_eq!(f.run(&b, retry(10)).await, Settled::DeadLettered);
        assert_eq!(b.calls().last(), Some(&Call::Reject { requeue: false }));
        // The count starts over for the message.
        let b = FakeBroker::answering([Err(nacked())]);
        assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
    }

    #[tokio::test(start_paused = true)]
    async fn a_confirmed_copy_forgets_earlier_requeues() {
        let f = Fixture::new(DeadLetterMode::Reject);
        for _ in 0..2 {
            let b = FakeBroker::answering([Err(nacked())]);
            f.run(&b, retry(10)).await;
        }
        f.run(&FakeBroker::new(), retry(10)).await;
        let b = FakeBroker::answering([Err(nacked())]);
        assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
    }

    #[tokio::test(start_paused = true)]
    async fn requeues_while_the_broker_blocks_publishing_do_not_count() {
        let f = Fixture::new(DeadLetterMode::Reject);
        // Far more than the limit of 2: an alarm never sends a message to the DLQ.
        for _ in 0..6 {
            let b = FakeBroker::answering_copy([Err(CopyError::Blocked(Duration::from_secs(30)))]);
            assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
            assert_eq!(b.calls().last(), Some(&Call::Reject { requeue: true }));
        }
        // A confirm timeout outside an alarm counts like a nack.
        for _ in 0..2 {
            let b = FakeBroker::answering_copy([Err(CopyError::Timeout(Duration::from_secs(30)))]);
            assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
        }
        let b = FakeBroker::answering_copy([Err(CopyError::Timeout(Duration::from_secs(30)))]);
        assert_eq!(f.run(&b, retry(10)).await, Settled::DeadLettered);
    }

    #[tokio::test]
    async fn too_large_copy_dead_letters_at_once() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker::answering([Err(too_large())]);
        assert_eq!(f.run(&b, retry(10)).await, Settled::DeadLettered);
        assert_eq!(b.calls()[1], Call::Reject { requeue: false });
    }

    #[tokio::test]
    async fn channel_gone_before_settling_sends_nothing() {
        for outcome in [Outcome::Ack, retry(10), dead_letter()] {
            for mode in [DeadLetterMode::Reject, DeadLetterMode::Annotate] {
                let f = Fixture::new(mode);
                let b = FakeBroker::new();
                *b.open.lock().unwrap() = false;
                assert_eq!(f.run(&b, outcome.clone()).await, Settled::Failed);
                // A reject on a closed channel is attempted and reports it; nothing else is.
                assert!(
                    b.calls().iter().all(|c| matches!(c, Call::Reject { .. })),
                    "{:?}",
                    b.calls()
                );
            }
        }
    }

    #[tokio::test]
    async fn channel_gone_mid_settle_is_a_failure_not_a_success() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker {
            close_after_publish: true,
            ..FakeBroker::new()
        };
        // The copy is confirmed but the original can no longer be acked: the broker redelivers
        // it, so the outcome is a failed settle (a duplicate to come), never "retried".
        assert_eq!(f.run(&b, retry(10)).await, Settled::Failed);
        assert_eq!(b.calls().len(), 1);
    }

    /// A reject that did not go out (an error, or a channel found closed) is reported as a
    /// failed settle and must keep its tag from every later multiple ack: the channel is given
    /// back, the tag never released. One that went out releases its tag and keeps the channel.
    #[tokio::test]
    async fn a_failed_reject_is_reported_and_abandons_the_channel_instead_of_releasing_its_tag() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let failing = FakeBroker {
            reject_result: || {
                Err(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
                    lapin::ChannelState::Closed,
                    "reject",
                )))
            },
            ..FakeBroker::new()
        };
        let refused = FakeBroker {
            reject_result: || Ok(false),
            ..FakeBroker::new()
        };
        for b in [&failing, &refused] {
            assert_eq!(f.run(b, dead_letter()).await, Settled::Failed);
            assert_eq!(b.calls(), [Call::Reject { requeue: false }]);
            assert_eq!(*b.released.lock().unwrap(), 0, "the tag stays unsettled");
            assert_eq!(*b.abandoned.lock().unwrap(), ["reject failed"]);
        }
        let ok = FakeBroker::new();
        assert_eq!(f.run(&ok, dead_letter()).await, Settled::DeadLettered);
        assert_eq!(*ok.released.lock().unwrap(), 1);
        assert!(ok.abandoned.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn reject_mode_rejects_without_requeue() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker::new();
        assert_eq!(f.run(&b, dead_letter()).await, Settled::DeadLettered);
        assert_eq!(b.calls(), [Call::Reject { requeue: false }]);
    }

    #[tokio::test]
    async fn annotate_mode_publishes_to_the_dlx_then_acks() {
        let f = Fixture::new(DeadLetterMode::Annotate);
        let b = FakeBroker::new();
        assert_eq!(f.run(&b, dead_letter()).await, Settled::DeadLettered);
        assert_eq!(
            b.calls(),
            [
                Call::Publish {
                    exchange: "orders.dlx".into(),
                    routing_key: "orders".into()
                },
                Call::Ack { success: false },
            ]
        );
        let h = b.published_headers();
        assert_eq!(
            header(&h, headers::DEAD_LETTER_REASON),
            Some(&AMQPValue::LongString(m::REASON_PERMANENT.into()))
        );
        assert_eq!(
            header(&h, headers::DEAD_LETTERED_BY),
            Some(&AMQPValue::LongString("test-worker".into()))
        );
        // The original TTL is kept aside, not applied: a dead letter must not expire.
        assert!(header(&h, headers::ORIGINAL_EXPIRATION).is_some());
        assert_eq!(b.props.lock().unwrap()[0].expiration(), &None);
    }

    #[tokio::test(start_paused = true)]
    async fn annotate_unconfirmed_requeues_and_too_large_falls_back_to_reject() {
        let f = Fixture::new(DeadLetterMode::Annotate);
        let b = FakeBroker::answering([Err(returned())]);
        assert_eq!(f.run(&b, dead_letter()).await, Settled::Requeued);
        assert_eq!(b.calls()[1], Call::Reject { requeue: true });

        let b = FakeBroker::answering([Err(too_large())]);
        assert_eq!(f.run(&b, dead_letter()).await, Settled::DeadLettered);
        assert_eq!(b.calls()[1], Call::Reject { requeue: false });
    }

    #[tokio::test]
    async fn repair_republishes_to_the_queue_then_acks() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker::new();
        let mut repaired = FieldTable::default();
        repaired.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        assert_eq!(
            f.run(&b, Outcome::Repair(repaired.clone())).await,
            Settled::Repaired
        );
        assert_eq!(
            b.calls(),
            [
                Call::Publish {
                    exchange: "".into(),
                    routing_key: "orders".into()
                },
                Call::Ack { success: false },
            ]
        );
        assert_eq!(b.published_headers(), repaired);
    }

    #[tokio::test(start_paused = true)]
    async fn unconfirmed_repair_is_never_dead_lettered_where_that_crashes_the_broker() {
        let mut f = Fixture::new(DeadLetterMode::Reject);
        f.rules.dead_letters_malformed_x_death = false;
        for _ in 0..5 {
            let b = FakeBroker::answering([Err(nacked())]);
            assert_eq!(
                f.run(&b, Outcome::Repair(FieldTable::default())).await,
                Settled::Requeued
            );
        }
    }

    #[tokio::test]
    async fn abandoned_is_left_to_the_broker() {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker::new();
        assert_eq!(f.run(&b, Outcome::Abandon).await, Settled::Abandoned);
        assert!(b.calls().is_empty());
    }
}
