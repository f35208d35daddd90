//! One connection's life: connect, topology, consume (each delivery handed to
//! [`crate::delivery`]), drain or give up.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Consumer, Event};
use redeliver_amqp::url::BrokerUrl;
use redeliver_amqp::ServerInfo;
use redeliver_amqp1::Incoming;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::acks::AckSender;
use crate::delivery::{self, Deliveries};
use crate::error::WorkerError;
use crate::link::{Copies, LapinLink};
use crate::meters::Meters;
use crate::metrics_names as m;
use crate::native::NativeLink;
use crate::settings::RetryMode;
use crate::settle::Rules;
use crate::shared::Shared;
use crate::status::BlockedFlag;

mod checks;

use checks::{verify_forward, watch_topology};

/// Bound on each broker call made while shutting down, so a dead broker cannot stall the exit.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a worker consumes over AMQP 0-9-1 after the broker failed delivering a message
/// over AMQP 1.0: long enough to take that message (and its neighbours) over 0-9-1.
const NATIVE_PAUSE: Duration = Duration::from_secs(60);

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

/// How the session consumes: AMQP 0-9-1 on a channel of its connection, or AMQP 1.0 on a
/// connection of its own where the queue holds retries.
enum Consuming {
    Lapin {
        deliveries: Arc<Deliveries<LapinLink>>,
        channel: Channel,
        consumer: Consumer,
    },
    Native {
        deliveries: Arc<Deliveries<NativeLink>>,
        consumer: redeliver_amqp1::Consumer,
    },
}

/// A connected, consuming session.
pub(crate) struct Session {
    connection: Arc<Connection>,
    consuming: Consuming,
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
        let native = choose_retry_mode(worker, url, server.as_ref())?;
        let topology = if native {
            // A crash loop (a delivery failing without our delivery time) backs off too, within
            // the policy's bounds.
            let backoff = settings.policy.configured_backoff();
            let min = backoff.base().max(Duration::from_millis(1));
            config
                .topology
                .clone()
                .delayed_retry(min, backoff.cap().max(min))
        } else {
            config.topology.clone()
        };
        if settings.verify_only {
            topology.verify(connection).await?;
        } else {
            topology.declare(connection).await?;
        }
        if let Some(to) = settings.policy.configured_forward() {
            verify_forward(connection, to).await?;
        }
        let delay = config.topology.configured_delay().clone();
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
            retries: Arc::clone(&worker.retries),
            retry_mode: if native {
                RetryMode::Native
            } else {
                RetryMode::Levels
            },
        };
        let meters = Meters::new(&config.queue);
        let publishing = worker
            .publishing
            .get(url, &settings.tls, &rules.connection_name);
        let blocked = tokio::spawn(forward_blocked(
            publishing.blocked(),
            worker.blocked.clone(),
        ));
        let copies = Copies::new(
            publishing,
            delay.clone(),
            max_message_size,
            settings.confirm_timeout,
        );
        let mode = rules.retry_mode;
        worker.retries.set_mode(mode);
        for each in [RetryMode::Levels, RetryMode::Native] {
            metrics::gauge!(m::RETRY_MODE, m::LABEL_QUEUE => Arc::clone(&config.queue), m::LABEL_MODE => each.to_string())
                .set(if each == mode { 1.0 } else { 0.0 });
        }
        let consuming = if native {
            match Self::consume_native(worker, url, copies, rules, meters).await {
                Ok(c) => c,
                Err(e) => {
                    blocked.abort();
                    return Err(e);
                }
            }
        } else {
            match Self::consume_lapin(worker, connection, copies, rules, meters).await {
                Ok(c) => c,
                Err(e) => {
                    blocked.abort();
                    return Err(e);
                }
            }
        };
        let events = connection.events_listener().boxed();
        let unroutable_poll = tokio::spawn(watch_topology(
            Arc::clone(connection),
            topology,
            settings.verify_only,
            settings.topology_check_interval,
        ));
        info!(queue = %config.queue, retry_mode = %mode, "retries wait {}", if native { "in the queue itself (native, AMQP 1.0)" } else { "in the delay levels" });
        Ok(Session {
            connection: Arc::clone(connection),
            consuming,
            events,
            unroutable_poll,
            blocked,
        })
    }

    /// Consumes over AMQP 1.0 on a connection of its own; the queue holds retries.
    async fn consume_native(
        worker: &Arc<Shared>,
        url: &BrokerUrl,
        copies: Copies,
        rules: Rules,
        meters: Meters,
    ) -> Result<Consuming, WorkerError> {
        let config = &worker.config;
        let uri = url.uri();
        // The URL's port and TLS settings: RabbitMQ serves AMQP 1.0 on its AMQPS port too.
        let tls = url.is_tls().then(|| {
            redeliver_amqp1::Tls::new(uri.authority.host.clone(), config.settings.tls.clone())
        });
        let endpoint = redeliver_amqp1::Endpoint {
            host: uri.authority.host.clone(),
            port: uri.authority.port,
            username: uri.authority.userinfo.username.clone(),
            password: uri.authority.userinfo.password.clone(),
            vhost: uri.vhost.clone(),
            container_id: rules.connection_name.clone(),
            tls,
        };
        copies.publisher().await?;
        let consumer =
            redeliver_amqp1::Consumer::open(&endpoint, &config.queue, u32::from(config.prefetch()))
                .await?;
        let link = NativeLink {
            copies,
            settler: consumer.settler(),
            succeeded: meters.succeeded.clone(),
        };
        Ok(Consuming::Native {
            deliveries: Arc::new(Deliveries::new(link, rules, meters)),
            consumer,
        })
    }

    /// Consumes over AMQP 0-9-1 on a channel of `connection`.
    async fn consume_lapin(
        worker: &Arc<Shared>,
        connection: &Arc<Connection>,
        copies: Copies,
        rules: Rules,
        meters: Meters,
    ) -> Result<Consuming, WorkerError> {
        let config = &worker.config;
        let channel = connection.create_channel().await?;
        // Per consumer, not global: global QoS is deprecated and refused from RabbitMQ 4.3. It is
        // applied on every channel we open, since nothing replays it for us.
        channel
            .basic_qos(config.prefetch(), BasicQosOptions { global: false })
            .await?;
        let acks = AckSender::spawn(channel.clone(), meters.clone(), config.prefetch());
        let link = LapinLink::open(copies, acks).await?;
        let consumer = channel
            .basic_consume(
                (*config.queue).into(),
                CONSUMER_TAG.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Consuming::Lapin {
            deliveries: Arc::new(Deliveries::new(link, rules, meters)),
            channel,
            consumer,
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
                item = self.consuming.next() => match item {
                    Ok(d) => self.consuming.start(worker, d, permit),
                    Err(why) => break if self.connection.status().connected() {
                        why
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
                            && self.consuming.channel_connected() =>
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
        if let Consuming::Native { consumer, .. } = &self.consuming {
            if consumer.broker_failed() {
                // RabbitMQ cannot convert some message for AMQP 1.0 and ends the connection at
                // each delivery of it: that message would stop the queue and, through the
                // delivery limit, take the messages delivered with it to the DLQ. AMQP 0-9-1
                // reads it as it was published.
                warn!(queue = %worker.config.queue, pause = ?NATIVE_PAUSE, "the broker failed delivering a message over AMQP 1.0 (it cannot convert it, a decimal header for one); consuming over AMQP 0-9-1 for a while, retries through the delay levels");
                worker.retries.pause_native(NATIVE_PAUSE);
            }
        }
        self.teardown().await;
        SessionEnd::Lost(reason)
    }

    /// Closes a lost session. Its in-flight handlers keep running (their permits still count),
    /// but their settlements fail and are counted: the broker redelivers those messages.
    async fn teardown(self) {
        self.unroutable_poll.abort();
        self.blocked.abort();
        if let Consuming::Native { consumer, .. } = self.consuming {
            consumer.close().await;
        }
        close_connection(&self.connection, "connection lost, reconnecting").await;
    }

    /// Graceful stop: cancel the consumer so the broker sends nothing more, let in-flight
    /// handlers finish within the grace period and settle, then close channel and connection.
    /// Deliveries prefetched but never started are not touched: closing the channel returns them
    /// to the queue.
    pub(crate) async fn drain(self, worker: &Arc<Shared>) {
        let queue = &worker.config.queue;
        info!(queue = %queue, "draining: cancelling the consumer");
        match self.consuming {
            Consuming::Lapin {
                deliveries,
                channel,
                consumer,
            } => {
                match tokio::time::timeout(
                    CLOSE_TIMEOUT,
                    channel.basic_cancel(consumer.tag(), BasicCancelOptions::default()),
                )
                .await
                {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(queue = %queue, error = %e, "basic.cancel failed"),
                    Err(_) => warn!(queue = %queue, "basic.cancel timed out"),
                }
                drop(consumer);
                worker.drain_tasks().await;
                // Before the channel closes: acks still batched would otherwise be lost with
                // it, and those messages delivered twice.
                if tokio::time::timeout(CLOSE_TIMEOUT, deliveries.link.acks.flush())
                    .await
                    .is_err()
                {
                    warn!(queue = %queue, "flushing the last acks timed out");
                }
                if channel.status().connected() {
                    if let Ok(Err(e)) = tokio::time::timeout(
                        CLOSE_TIMEOUT,
                        channel.close(200, "worker stopped".into()),
                    )
                    .await
                    {
                        debug!(error = %e, "closing the consumer channel");
                    }
                }
            }
            Consuming::Native { mut consumer, .. } => {
                // Deliveries received but not started stay unsettled: the broker gives them
                // back when the link closes, after the in-flight ones are settled.
                consumer.stop_receiving();
                worker.drain_tasks().await;
                consumer.close().await;
            }
        }
        self.unroutable_poll.abort();
        self.blocked.abort();
        close_connection(&self.connection, "worker stopped").await;
    }
}

impl Consuming {
    /// The next delivery, or why consuming ended.
    async fn next(&mut self) -> Result<Delivery, String> {
        match self {
            Consuming::Lapin { consumer, .. } => match consumer.next().await {
                Some(Ok(d)) => Ok(d),
                Some(Err(e)) => Err(format!("consumer error: {e}")),
                None => Err(
                    "consumer cancelled by the broker (queue deleted?) or channel closed"
                        .to_owned(),
                ),
            },
            Consuming::Native { consumer, .. } => match consumer.next().await {
                Some(Incoming::Message(d)) => Ok(d),
                Some(Incoming::Undecodable { tag, error }) => Ok(undecodable(tag, &error)),
                None => Err(consumer.ended()),
            },
        }
    }

    fn start(&self, worker: &Arc<Shared>, delivery: Delivery, permit: crate::permits::Permit) {
        match self {
            Consuming::Lapin { deliveries, .. } => {
                delivery::start(worker, deliveries, delivery, permit)
            }
            Consuming::Native { deliveries, .. } => {
                delivery::start(worker, deliveries, delivery, permit)
            }
        }
    }

    /// The consumer channel is open (an AMQP 1.0 consumer has none on the connection).
    fn channel_connected(&self) -> bool {
        match self {
            Consuming::Lapin { channel, .. } => channel.status().connected(),
            Consuming::Native { .. } => true,
        }
    }
}

/// A delivery that did not decode over AMQP 1.0, as the frame guard marks one over 0-9-1: the
/// worker dead-letters it without calling the handler, and the broker's dead letter keeps the
/// original.
fn undecodable(tag: u64, error: &str) -> Delivery {
    let mut headers = FieldTable::default();
    headers.insert(
        redeliver_amqp::HEADERS_REMOVED.into(),
        lapin::types::AMQPValue::LongString(error.as_bytes().into()),
    );
    let mut d = Delivery::mock(tag, "".into(), "".into(), false, Vec::new());
    d.properties = lapin::BasicProperties::default().with_headers(headers);
    d
}

/// Whether this session's retries wait in the queue itself: [`RetryMode::Levels`] never,
/// [`RetryMode::Auto`] where the broker and the queue allow it, [`RetryMode::Native`] there or
/// an error saying why not.
fn choose_retry_mode(
    worker: &Shared,
    url: &BrokerUrl,
    server: Option<&ServerInfo>,
) -> Result<bool, WorkerError> {
    let config = &worker.config;
    let asked = config.settings.retry_mode;
    if asked == RetryMode::Levels {
        return Ok(false);
    }
    let version = server.and_then(ServerInfo::version);
    let limit = config.topology.configured_delivery_limit();
    let max_retries = config.settings.policy.configured_max_retries();
    let why_not = if !version.is_some_and(|v| v.holds_native_retries()) {
        Some(format!(
            "the broker is {}: a queue holds retries from RabbitMQ 4.3 on",
            server.map_or_else(|| "of an unknown version".to_owned(), |s| s.to_string())
        ))
    } else if config.topology.configured_queue_type() != redeliver_amqp::QueueType::Quorum {
        Some("the queue is a classic queue: only quorum queues hold retries".to_owned())
    } else if url.is_tls() && !redeliver_amqp1::tls::SUPPORTED {
        Some("the AMQP 1.0 consumer is built without TLS (the `tls` feature)".to_owned())
    } else if limit.is_some_and(|l| max_retries >= l) {
        Some(format!("each native retry counts toward the queue's delivery limit ({}), which must be above max_retries ({max_retries}): raise it with Topology::delivery_limit", limit.unwrap_or_default()))
    } else {
        None
    };
    match (why_not, asked) {
        (None, _) if worker.retries.native_paused() => {
            info!(queue = %config.queue, "native retry paused after a broker failure over AMQP 1.0: consuming over AMQP 0-9-1 for now");
            Ok(false)
        }
        (None, _) => Ok(true),
        (Some(why), RetryMode::Native) => Err(WorkerError::RetryMode(why)),
        (Some(why), _) => {
            info!(queue = %config.queue, reason = %why, "retry mode auto: retries go through the delay levels");
            Ok(false)
        }
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
