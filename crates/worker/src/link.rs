//! The broker under settling, on lapin: the consumer channel's batched acks and each delivery's
//! acker, and the session's confirmed publisher on the publishing connection (reopened when a
//! soft error closed its channel, waiting out a blocked connection, bounded by the confirm
//! timeout).

use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::BasicRejectOptions;
use lapin::Acker;
use lapin::BasicProperties;
use redeliver_amqp::DelayConfig;
use redeliver_amqp::{PublishError, Publisher};
use tracing::debug;

use crate::acks::AckSender;
use crate::broker::{Broker, CopyError, Link, Publish};
use crate::publishing::{OpenError, Publishing, REOPEN_TIMEOUT};

/// [`Link`] on lapin: one per session.
pub(crate) struct LapinLink {
    copies: Copies,
    /// Acks of the consumer channel (batched); rejects go through each delivery's acker.
    pub(crate) acks: AckSender,
}

impl LapinLink {
    /// Opens the publisher on `publishing` (its connection opened if needed).
    pub(crate) async fn open(copies: Copies, acks: AckSender) -> Result<Self, OpenError> {
        copies.publisher().await?;
        Ok(Self { copies, acks })
    }
}

/// The session's confirmed publisher of copies (retry, dead letter, forward, sanitized), on the
/// publishing connection: what both transports' links publish with.
pub(crate) struct Copies {
    publishing: Arc<Publishing>,
    delay: DelayConfig,
    publisher: tokio::sync::Mutex<Option<Publisher>>,
    /// Largest body the publisher sends (the builder's, or the broker version's default).
    max_message_size: Option<usize>,
    confirm_timeout: Duration,
}

impl Copies {
    pub(crate) fn new(
        publishing: Arc<Publishing>,
        delay: DelayConfig,
        max_message_size: Option<usize>,
        confirm_timeout: Duration,
    ) -> Self {
        Self {
            publishing,
            delay,
            publisher: tokio::sync::Mutex::new(None),
            max_message_size,
            confirm_timeout,
        }
    }

    /// The confirm-mode publisher, reopened if its channel or connection was closed (a soft
    /// error closes a channel and lapin does not reopen it).
    pub(crate) async fn publisher(&self) -> Result<Publisher, OpenError> {
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

impl Publish for Copies {
    async fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), CopyError> {
        self.confirmed(|p| async move { p.publish_delayed(queue, delay, body, props).await })
            .await
    }

    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), CopyError> {
        self.confirmed(|p| async move { p.publish_copy(exchange, routing_key, body, props).await })
            .await
    }
}

impl Link for LapinLink {
    type Broker<'a> = LapinBroker<'a>;

    fn register(&self, delivery_tag: u64) {
        self.acks.register(delivery_tag);
    }

    fn broker<'a>(&'a self, delivery: &'a Delivery) -> LapinBroker<'a> {
        LapinBroker {
            link: self,
            acker: &delivery.acker,
            tag: delivery.delivery_tag,
        }
    }
}

/// [`Broker`] on lapin: the delivery's own acker (tags belong to their channel, so a delivery of
/// a dead channel can never be settled on a newer one) and the session's publisher.
pub(crate) struct LapinBroker<'a> {
    link: &'a LapinLink,
    acker: &'a Acker,
    tag: u64,
}

impl Broker for LapinBroker<'_> {
    type Copies = Copies;

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

    fn copies(&self) -> &Copies {
        &self.link.copies
    }
}
