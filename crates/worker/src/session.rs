//! One connection's life: connect, topology, consume (each delivery handed to
//! [`crate::delivery`]), drain or give up.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Consumer, Event};
use redeliver_amqp::url::BrokerUrl;
use redeliver_amqp::ServerInfo;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::acks::AckSender;
use crate::delivery::{self, Deliveries};
use crate::error::WorkerError;
use crate::link::LapinLink;
use crate::meters::Meters;
use crate::settle::Rules;
use crate::shared::Shared;
use crate::status::BlockedFlag;

mod checks;

use checks::{verify_forward, watch_topology};

/// Bound on each broker call made while shutting down, so a dead broker cannot stall the exit.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Deliveries taken in a row, at most, before a stop requested meanwhile is seen.
const STOP_CHECK_EVERY: u32 = 16;

/// The consumer's tag. One consumer per channel, so a fixed tag is unique where it must be, and
/// it names us in the management UI. lapin looks the tag up in a hash map for every frame of
/// every delivery: the broker's generated `amq.ctag-...` (31 bytes) costs several hash rounds
/// more each time.
const CONSUMER_TAG: &str = "redeliver";

/// Why [`Session::consume`] returned.
pub(crate) enum SessionEnd {
    /// The worker's token was cancelled: drain this session.
    Shutdown(Box<Session>),
    /// The connection or the consumer channel died (the session is already torn down).
    Lost(String),
}

/// A connected, consuming session.
pub(crate) struct Session {
    connection: Arc<Connection>,
    deliveries: Arc<Deliveries<LapinLink>>,
    channel: Channel,
    consumer: Consumer,
    events: futures::stream::BoxStream<'static, Event>,
    unroutable_poll: tokio::task::JoinHandle<()>,
    /// Forwards the publishing connection's blocked state to the worker's status.
    blocked: tokio::task::JoinHandle<()>,
}

impl Session {
    /// Connects to `url`, declares or verifies the topology, opens the publisher and the consumer
    /// channel with its prefetch, and starts consuming.
    pub(crate) async fn open(
        worker: &Arc<Shared>,
        url: &BrokerUrl,
    ) -> Result<Session, WorkerError> {
        let config = &worker.config;
        let props =
            ConnectionProperties::default().with_connection_name(config.connection_name().into());
        // lapin's own recovery stays off: the runtime's reconnect loop owns reconnection. lapin
        // drops the broker's version, so a probe of our own reads it meanwhile.
        let tls = if url.is_tls() {
            config.settings.tls.load()?
        } else {
            Default::default()
        };
        let (server, connection) = tokio::join!(
            ServerInfo::probe_uri(url.uri(), tls),
            redeliver_amqp::connect_url(url, props, &config.settings.tls)
        );
        let connection = Arc::new(connection?);
        let server = match server {
            Ok(info) => {
                info!(queue = %config.queue, broker = %info, "connected");
                Some(info)
            }
            Err(e) => {
                warn!(queue = %config.queue, error = %e, "connected, but the broker's version is unknown: broker-specific behaviour uses the safe choice");
                None
            }
        };
        match Self::setup(worker, url, &connection, server).await {
            Ok(session) => Ok(session),
            Err(e) => {
                close_connection(&connection, "setup failed").await;
                Err(e)
            }
        }
    }

    async fn setup(
        worker: &Arc<Shared>,
        url: &BrokerUrl,
        connection: &Arc<Connection>,
        server: Option<ServerInfo>,
    ) -> Result<Session, WorkerError> {
        let config = &worker.config;
        let settings = &config.settings;
        if settings.verify_only {
            config.topology.verify(connection).await?;
        } else {
            config.topology.declare(connection).await?;
        }
        if let Some(to) = settings.policy.configured_forward() {
            verify_forward(connection, to).await?;
        }
        let delay = config.topology.delay_config().clone();
        let version = server.as_ref().and_then(ServerInfo::version);
        let max_message_size = settings
            .max_message_size
            .or_else(|| version.map(|v| v.default_max_message_size()));
        let rules = Rules {
            queue: Arc::clone(&config.queue),
            dlx: config.topology.dlx_name(),
            dlq: config.topology.dlq_name(),
            mode: settings.dead_letter_mode,
            requeue_limit: settings.requeue_limit,
            connection_name: config.connection_name(),
            max_delay: delay.max_delay(),
            delay_levels: delay.clone(),
            username: connection.status().username(),
            // Unknown version: assume 3.x, whose dead-lettering crashes on such a header.
            dead_letters_malformed_x_death: version
                .is_some_and(|v| !v.dead_lettering_trusts_client_x_death()),
        };
        let channel = connection.create_channel().await?;
        // Per consumer, not global: global QoS is deprecated and refused from RabbitMQ 4.3. It is
        // applied on every channel we open, since nothing replays it for us.
        channel
            .basic_qos(config.prefetch(), BasicQosOptions { global: false })
            .await?;
        let meters = Meters::new(&config.queue);
        let acks = AckSender::spawn(channel.clone(), meters.clone(), config.prefetch());
        let publishing = worker
            .publishing
            .get(url, &settings.tls, &rules.connection_name);
        let blocked = tokio::spawn(forward_blocked(
            publishing.blocked(),
            worker.blocked.clone(),
        ));
        let link = match LapinLink::open(
            publishing,
            delay.clone(),
            max_message_size,
            settings.confirm_timeout,
            acks,
        )
        .await
        {
            Ok(link) => link,
            Err(e) => {
                blocked.abort();
                return Err(e.into());
            }
        };
        let events = connection.events_listener().boxed();
        let consumer = channel
            .basic_consume(
                (*config.queue).into(),
                CONSUMER_TAG.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let unroutable_poll = tokio::spawn(watch_topology(
            Arc::clone(connection),
            config.topology.clone(),
            settings.verify_only,
            settings.topology_check_interval,
        ));
        Ok(Session {
            connection: Arc::clone(connection),
            deliveries: Arc::new(Deliveries::new(link, rules, meters)),
            channel,
            consumer,
            events,
            unroutable_poll,
            blocked,
        })
    }

    /// Takes deliveries while a concurrency permit is free and hands each to its own task, so a
    /// slow handler never delays another's ack. Returns on shutdown or when the session dies.
    pub(crate) async fn consume(
        mut self,
        worker: &Arc<Shared>,
        token: &CancellationToken,
    ) -> SessionEnd {
        // Created once: registering a fresh waiter with the token for every delivery is a lock
        // and an unlock each time.
        let cancelled = token.cancelled();
        tokio::pin!(cancelled);
        let mut unchecked = 0u32;
        let reason = loop {
            // While deliveries keep coming, the select below takes them without looking at the
            // token (polling it takes its lock, and a delivery is a few microseconds): look every
            // few deliveries instead, so a stop still takes effect under load.
            unchecked += 1;
            if unchecked >= STOP_CHECK_EVERY {
                unchecked = 0;
                if token.is_cancelled() {
                    return SessionEnd::Shutdown(Box::new(self));
                }
            }
            // The fast path first: waiting (and watching the token meanwhile) only when every
            // permit is taken.
            let permit = match worker.permits.try_take() {
                Some(p) => p,
                None => tokio::select! {
                    biased;
                    _ = &mut cancelled => return SessionEnd::Shutdown(Box::new(self)),
                    p = worker.permits.take() => p,
                },
            };
            // Deliveries first; the token and the connection's events are polled when none is
            // ready. A dead connection or channel also ends the consumer's stream, so nothing
            // that ends the session waits behind a backlog.
            tokio::select! {
                biased;
                item = self.consumer.next() => match item {
                    Some(Ok(d)) => delivery::start(worker, &self.deliveries, d, permit),
                    Some(Err(e)) => break format!("consumer error: {e}"),
                    None => break if self.connection.status().connected() {
                        "consumer cancelled by the broker (queue deleted?) or channel closed".to_owned()
                    } else {
                        "connection closed".to_owned()
                    },
                },
                _ = &mut cancelled => return SessionEnd::Shutdown(Box::new(self)),
                ev = self.events.next() => match ev {
                    // lapin reports a channel closed by the broker (a 404 or 406 on the
                    // publisher's channel, say) on the connection's events too: only a dead
                    // connection or consumer channel ends the session.
                    Some(Event::Error(e))
                        if self.connection.status().connected()
                            && self.channel.status().connected() =>
                    {
                        warn!(queue = %worker.config.queue, error = %e, "the broker closed a channel of this connection (the publisher reopens its own)");
                        continue;
                    }
                    Some(Event::Error(e)) => break format!("connection error: {e}"),
                    Some(other) => {
                        debug!(event = ?other, "connection event");
                        continue;
                    }
                    None => break "connection event stream ended".to_owned(),
                },
            }
        };
        self.teardown().await;
        SessionEnd::Lost(reason)
    }

    /// Closes a lost session. Its in-flight handlers keep running (their permits still count),
    /// but their settlements fail and are counted: the broker redelivers those messages.
    async fn teardown(self) {
        self.unroutable_poll.abort();
        self.blocked.abort();
        close_connection(&self.connection, "connection lost, reconnecting").await;
    }

    /// Graceful stop: cancel the consumer so the broker sends nothing more, let in-flight
    /// handlers finish within the grace period and settle, then close channel and connection.
    /// Deliveries prefetched but never started are not touched: closing the channel returns them
    /// to the queue.
    pub(crate) async fn drain(self, worker: &Arc<Shared>) {
        let queue = &worker.config.queue;
        info!(queue = %queue, "draining: cancelling the consumer");
        match tokio::time::timeout(
            CLOSE_TIMEOUT,
            self.channel
                .basic_cancel(self.consumer.tag(), BasicCancelOptions::default()),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(queue = %queue, error = %e, "basic.cancel failed"),
            Err(_) => warn!(queue = %queue, "basic.cancel timed out"),
        }
        drop(self.consumer);
        worker.drain_tasks().await;
        // Before the channel closes: acks still batched would otherwise be lost with it, and
        // those messages delivered twice.
        if tokio::time::timeout(CLOSE_TIMEOUT, self.deliveries.link.acks.flush())
            .await
            .is_err()
        {
            warn!(queue = %queue, "flushing the last acks timed out");
        }
        self.unroutable_poll.abort();
        self.blocked.abort();
        if self.channel.status().connected() {
            if let Ok(Err(e)) = tokio::time::timeout(
                CLOSE_TIMEOUT,
                self.channel.close(200, "worker stopped".into()),
            )
            .await
            {
                debug!(error = %e, "closing the consumer channel");
            }
        }
        close_connection(&self.connection, "worker stopped").await;
    }
}

async fn close_connection(connection: &Connection, why: &str) {
    if !connection.status().connected() {
        return;
    }
    match tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, why.into())).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => debug!(error = %e, "closing the connection"),
        Err(_) => debug!("closing the connection timed out"),
    }
}

/// Keeps the worker's blocked flag (readiness, metric) in step with the publishing connection.
async fn forward_blocked(mut rx: tokio::sync::watch::Receiver<bool>, flag: BlockedFlag) {
    loop {
        flag.set(*rx.borrow_and_update());
        if rx.changed().await.is_err() {
            flag.set(false);
            return;
        }
    }
}
