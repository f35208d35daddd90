//! What settling needs of the broker: a [`Broker`] per delivery, a [`Link`] per session that
//! hands them out, and why a copy was not confirmed ([`CopyError`]). The real ones are in
//! [`crate::link`]; the tests use a scripted one.

use std::future::Future;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::BasicProperties;
use redeliver_amqp::headers::{DeadLetterInfo, RetryState};
use redeliver_amqp::PublishError;

/// What settling one delivery needs from the broker.
pub(crate) trait Broker: Send + Sync {
    /// What publishes the delivery's copies.
    type Copies: Publish;
    /// The delivery's channel is still open; settling on a closed one cannot reach the broker.
    fn is_open(&self) -> bool;
    /// Hands the delivery to its channel's batched acks (`success`: its handler succeeded);
    /// false when the channel is closed.
    fn ack(&self, success: bool) -> bool;
    /// `basic.reject`; `Ok(false)` when the channel is closed.
    fn reject(&self, requeue: bool) -> impl Future<Output = Result<bool, lapin::Error>> + Send;
    /// The delivery was settled by a frame of its own: later batched acks need not wait for it.
    fn released(&self);
    /// A frame of the delivery's own did not go out, so its tag must stay unsettled: closes the
    /// channel, and the broker gives every delivery of it back to the queue.
    fn abandon_channel(&self, why: &'static str) -> impl Future<Output = ()> + Send;
    /// The confirmed publisher of this delivery's copies (retry, dead letter, forward,
    /// sanitized): the same for both transports, so no broker re-implements it.
    fn copies(&self) -> &Self::Copies;
    /// The queue holds this delivery's retries itself (AMQP 1.0 on a RabbitMQ 4.3+ quorum
    /// queue): [`hold`](Self::hold) and [`dead_letter`](Self::dead_letter) replace the copies.
    fn holds_retries(&self) -> bool {
        false
    }
    /// Gives the delivery back to its queue to be delivered again at `until_ms` (Unix ms), with
    /// `state` as its retry annotations: `modified{delivery-failed}` with `x-opt-delivery-time`.
    fn hold(
        &self,
        _until_ms: u64,
        _state: &RetryState,
    ) -> impl Future<Output = Result<bool, lapin::Error>> + Send {
        async { Ok(false) }
    }
    /// Dead-letters the delivery through its queue's DLX. Over AMQP 0-9-1 a
    /// `basic.reject(requeue = false)` (`info` is only logged); where the queue holds retries,
    /// `modified{undeliverable-here}` with `info` and `state` as annotations, which the dead
    /// letter carries as headers.
    fn dead_letter(
        &self,
        _info: &DeadLetterInfo,
        _state: &RetryState,
    ) -> impl Future<Output = Result<bool, lapin::Error>> + Send {
        self.reject(false)
    }
}

/// Publishing copies, confirmed: [`crate::link::Copies`] on the broker, a script in the tests.
pub(crate) trait Publish: Send + Sync {
    /// Publishes a copy for `queue` through the delay levels and waits for the confirm.
    fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        body: &[u8],
        props: BasicProperties,
    ) -> impl Future<Output = Result<(), CopyError>> + Send;
    /// Publishes a copy (mandatory) and waits for the confirm.
    fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> impl Future<Output = Result<(), CopyError>> + Send;
}

/// A session's side of the broker: gives each of its deliveries a [`Broker`].
pub(crate) trait Link: Send + Sync + 'static {
    /// The broker side of one delivery of this session.
    type Broker<'a>: Broker
    where
        Self: 'a;
    /// Announces a delivery to the channel's batched acks before anything can settle it.
    fn register(&self, delivery_tag: u64);
    /// The broker side of settling `delivery`, which came on this session's consumer channel.
    fn broker<'a>(&'a self, delivery: &'a Delivery) -> Self::Broker<'a>;
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
    Open(#[from] crate::publishing::OpenError),
    /// The publishing connection or its channels were still being reopened when the confirm
    /// timeout ran out (a node that accepts TCP and does not answer, say).
    #[error("the publishing connection could not be reopened within {0:?}")]
    Reopen(Duration),
}
