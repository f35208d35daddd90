//! One connection's life: connect, topology, consume, settle each delivery, drain or give up.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Consumer, Event};
use redeliver_amqp::headers::{self, RetryState};
use redeliver_amqp::url::BrokerUrl;
use redeliver_amqp::DelayConfig;
use redeliver_amqp::ServerInfo;
use redeliver_amqp::{PublishError, Publisher};
use tokio::sync::{Mutex, OwnedSemaphorePermit};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument, Span};

use crate::acks::AckSender;
use crate::handler::{Context, HandlerFuture};
use crate::meters::Meters;
use crate::metrics_names as m;
use crate::outcome::{self, HandlerOutcome, Plan};
use crate::worker::{DeadLetterMode, Shared, WorkerError};

/// Bound on each broker call made while shutting down, so a dead broker cannot stall the exit.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before requeueing a message whose retry copy could not be published: without it a
/// broker that refuses publishes (delay infrastructure missing, resource alarm) turns into a hot
/// redelivery loop. Holding the permit meanwhile is the intended back-pressure.
const REQUEUE_PAUSE: Duration = Duration::from_secs(1);
/// How often the unroutable-parking queue of the delay infrastructure is measured.
const UNROUTABLE_POLL: Duration = Duration::from_secs(30);

/// Why [`Session::consume`] returned.
pub(crate) enum SessionEnd {
    /// The worker's token was cancelled: drain this session.
    Shutdown(Box<Session>),
    /// The connection or the consumer channel died (the session is already torn down).
    Lost(String),
}

/// What delivery tasks need from their session. Delivery tags belong to the channel they came
/// on, and each task only ever settles through its own delivery's acker, so a delivery of a
/// dead channel can never be acked on a newer one.
pub(crate) struct SessionShared {
    connection: Arc<Connection>,
    delay: DelayConfig,
    publisher: Mutex<Publisher>,
    /// Largest body the publisher sends (the builder's, or the broker version's default).
    max_message_size: Option<usize>,
    /// What the broker announced; `None` when the probe failed (the connection itself worked).
    server: Option<ServerInfo>,
    username: String,
    /// Acks of the consumer channel (batched); rejects and nacks go through each delivery's acker.
    acks: AckSender,
    meters: Meters,
    /// The queue's name, shared with every handler's [`Context`] without a copy.
    queue: Arc<str>,
}

impl SessionShared {
    /// The confirm-mode publisher, reopened if its channel was closed (a soft error closes a
    /// channel and lapin does not reopen it) while the connection is still up.
    async fn publisher(&self) -> Result<Publisher, PublishError> {
        let mut current = self.publisher.lock().await;
        if current.channel().status().connected() {
            return Ok(current.clone());
        }
        let fresh = new_publisher(&self.connection, &self.delay, self.max_message_size).await?;
        debug!("reopened the publisher channel");
        *current = fresh.clone();
        Ok(fresh)
    }
}

async fn new_publisher(
    connection: &Connection,
    delay: &DelayConfig,
    max_message_size: Option<usize>,
) -> Result<Publisher, PublishError> {
    let p = Publisher::new(connection, delay.clone()).await?;
    Ok(match max_message_size {
        Some(n) => p.with_max_message_size(n),
        None => p,
    })
}

/// A connected, consuming session.
pub(crate) struct Session {
    shared: Arc<SessionShared>,
    channel: Channel,
    consumer: Consumer,
    events: futures::stream::BoxStream<'static, Event>,
    unroutable_poll: tokio::task::JoinHandle<()>,
}

impl Session {
    /// Connects to `url`, declares or verifies the topology, opens the publisher and the consumer
    /// channel with its prefetch, and starts consuming.
    pub(crate) async fn open(
        worker: &Arc<Shared>,
        url: &BrokerUrl,
    ) -> Result<Session, WorkerError> {
        let config = &worker.config;
        let props = ConnectionProperties::default()
            .with_connection_name(config.connection_name.clone().into());
        // Lapin's own recovery stays off (DESIGN: it does not recover reliably); this loop owns
        // reconnection.
        // lapin drops the broker's version; a probe of our own reads it meanwhile.
        let tls = if url.is_tls() {
            config.tls.load()?
        } else {
            Default::default()
        };
        let (server, connection) = tokio::join!(
            ServerInfo::probe_uri(url.uri(), tls),
            redeliver_amqp::connect_url(url, props, &config.tls)
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
        match Self::setup(worker, &connection, server).await {
            Ok(session) => Ok(session),
            Err(e) => {
                close_connection(&connection, "setup failed").await;
                Err(e)
            }
        }
    }

    async fn setup(
        worker: &Arc<Shared>,
        connection: &Arc<Connection>,
        server: Option<ServerInfo>,
    ) -> Result<Session, WorkerError> {
        let config = &worker.config;
        if config.verify_only {
            config.topology.verify(connection).await?;
        } else {
            config.topology.declare(connection).await?;
        }
        let delay = config.topology.delay_config().clone();
        let max_message_size = config.max_message_size.or_else(|| {
            server
                .as_ref()
                .and_then(ServerInfo::version)
                .map(|v| v.default_max_message_size())
        });
        let publisher = new_publisher(connection, &delay, max_message_size).await?;
        let channel = connection.create_channel().await?;
        // Per consumer, not global: global QoS is deprecated and refused from RabbitMQ 4.3. It is
        // applied on every channel we open, since nothing replays it for us.
        channel
            .basic_qos(config.prefetch, BasicQosOptions { global: false })
            .await?;
        let events = connection.events_listener().boxed();
        let consumer = channel
            .basic_consume(
                config.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let username = connection.status().username();
        let meters = Meters::new(&config.queue);
        let acks = AckSender::spawn(channel.clone(), meters.clone(), config.prefetch);
        let unroutable_poll = tokio::spawn(poll_unroutable(
            Arc::clone(connection),
            delay.unroutable_name(),
        ));
        Ok(Session {
            shared: Arc::new(SessionShared {
                connection: Arc::clone(connection),
                delay,
                publisher: Mutex::new(publisher),
                max_message_size,
                server,
                username,
                acks,
                meters,
                queue: Arc::from(config.queue.as_str()),
            }),
            channel,
            consumer,
            events,
            unroutable_poll,
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
        let reason = loop {
            // The fast path first: waiting (and watching the token meanwhile) only when every
            // permit is taken.
            let permit = match Arc::clone(&worker.semaphore).try_acquire_owned() {
                Ok(p) => p,
                Err(_) => tokio::select! {
                    biased;
                    _ = &mut cancelled => return SessionEnd::Shutdown(Box::new(self)),
                    p = Arc::clone(&worker.semaphore).acquire_owned() => match p {
                        Ok(p) => p,
                        // The semaphore is never closed; treat it as a shutdown rather than panic.
                        Err(_) => return SessionEnd::Shutdown(Box::new(self)),
                    },
                },
            };
            // The token first, so a stop takes effect even while deliveries keep coming.
            tokio::select! {
                biased;
                _ = &mut cancelled => return SessionEnd::Shutdown(Box::new(self)),
                ev = self.events.next() => match ev {
                    // lapin reports a channel closed by the broker (a 404 or 406 on the
                    // publisher's channel, say) on the connection's events too: only a dead
                    // connection or consumer channel ends the session.
                    Some(Event::Error(e))
                        if self.shared.connection.status().connected()
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
                item = self.consumer.next() => match item {
                    Some(Ok(delivery)) => self.spawn_delivery(worker, delivery, permit),
                    Some(Err(e)) => break format!("consumer error: {e}"),
                    None => break if self.shared.connection.status().connected() {
                        "consumer cancelled by the broker (queue deleted?) or channel closed".to_owned()
                    } else {
                        "connection closed".to_owned()
                    },
                },
            }
        };
        self.teardown().await;
        SessionEnd::Lost(reason)
    }

    fn spawn_delivery(
        &self,
        worker: &Arc<Shared>,
        delivery: Delivery,
        permit: OwnedSemaphorePermit,
    ) {
        self.shared.acks.register(delivery.delivery_tag);
        let task = DeliveryTask {
            worker: Arc::clone(worker),
            session: Arc::clone(&self.shared),
            delivery: Arc::new(delivery),
            _permit: permit,
        };
        // Polled once here before it becomes a task: a delivery whose handler finishes without
        // waiting (a filter, an in-memory update) is settled on the spot, which spares a task
        // and, on a multi-thread runtime, often a wake-up of another worker thread to steal it
        // (measured on a classic-queue drain: 17.7 us of CPU per message inline, 19.0 spawned).
        // One that waits is spawned, and its first poll as a task registers the real waker.
        let mut run = Box::pin(task.run());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if run.as_mut().poll(&mut cx).is_pending() {
            worker.tracker.spawn(run);
        }
    }

    /// Closes a lost session. Its in-flight handlers keep running (their permits still count),
    /// but their settlements fail and are counted: the broker redelivers those messages.
    async fn teardown(self) {
        self.unroutable_poll.abort();
        close_connection(&self.shared.connection, "connection lost, reconnecting").await;
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
        if tokio::time::timeout(CLOSE_TIMEOUT, self.shared.acks.flush())
            .await
            .is_err()
        {
            warn!(queue = %queue, "flushing the last acks timed out");
        }
        self.unroutable_poll.abort();
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
        close_connection(&self.shared.connection, "worker stopped").await;
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

/// Measures the delay infrastructure's unroutable-parking queue (passive declare on a throwaway
/// channel: a 404 would close the channel it ran on).
async fn poll_unroutable(connection: Arc<Connection>, name: String) {
    let mut tick = tokio::time::interval(UNROUTABLE_POLL);
    loop {
        tick.tick().await;
        let Ok(channel) = connection.create_channel().await else {
            return;
        };
        let declared = channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(q) => {
                metrics::gauge!(m::DELAY_UNROUTABLE_MESSAGES, m::LABEL_PARKING_QUEUE => name.clone())
                    .set(f64::from(q.message_count()));
                if q.message_count() > 0 {
                    warn!(queue = %name, messages = q.message_count(), "messages parked in the delay infrastructure's unroutable queue");
                }
            }
            Err(e) => debug!(queue = %name, error = %e, "cannot measure the unroutable queue"),
        }
        if channel.status().connected() {
            let _ = channel.close(200, "done".into()).await;
        }
    }
}

/// Puts why a delivery was dead-lettered on its span.
fn record_dead_letter(reason: &str, error: &str) {
    let span = Span::current();
    span.record("reason", reason);
    span.record("error", error);
}

/// Keeps the in-flight gauge right on every exit path, panics included.
struct InFlight<'a>(&'a metrics::Gauge);

impl<'a> InFlight<'a> {
    fn enter(gauge: &'a metrics::Gauge) -> Self {
        gauge.increment(1.0);
        Self(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

struct DeliveryTask {
    worker: Arc<Shared>,
    session: Arc<SessionShared>,
    /// Shared with the handler's [`Context`], which reads its properties without a copy.
    delivery: Arc<Delivery>,
    _permit: OwnedSemaphorePermit,
}

impl DeliveryTask {
    async fn run(self) {
        let state = RetryState::read(self.delivery.properties.headers().as_ref());
        let span = info_span!(
            "delivery",
            queue = %self.worker.config.queue,
            message_id = %self.message_id(),
            attempt = state.attempt,
            redelivered = self.delivery.redelivered,
            delivery_tag = self.delivery.delivery_tag,
            outcome = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
            reason = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        self.process(state).instrument(span).await;
    }

    /// The message's `message_id` property, for logs (empty when absent).
    fn message_id(&self) -> &str {
        self.delivery
            .properties
            .message_id()
            .as_ref()
            .map_or("", |s| s.as_str())
    }

    async fn process(self, state: RetryState) {
        let message_id = self.message_id();
        let meters = &self.session.meters;
        let _in_flight = InFlight::enter(&meters.in_flight);
        let started = Instant::now();
        meters.received.increment(1);
        if let Some(repaired) =
            headers::sanitize_x_death(self.delivery.properties.headers().as_ref())
        {
            // Before anything can make the broker dead-letter it (a reject, or a quorum queue's
            // delivery limit): RabbitMQ crashes reading such a header.
            // Boxed, like the other cold paths: the task's future stays small, and spawning one
            // per delivery copies it.
            let label = Box::pin(self.sanitize(repaired, message_id)).await;
            Span::current().record("outcome", label);
            return;
        }
        if state.attempt == 0 {
            // Fresh message: a deposit in the retry budget (retries withdraw).
            self.worker.config.policy.record_attempt();
        }
        let ctx = Context::new(
            Arc::clone(&self.session.queue),
            Arc::clone(&self.delivery),
            state.clone(),
            self.worker.draining.clone(),
        );
        // A user decoder may panic too; the task must survive to settle the delivery.
        let prepared = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.worker.config.handler.prepare(&self.delivery, ctx)
        }));
        let plan = match prepared {
            Ok(Err(decode)) => Some(outcome::plan_undecodable(&decode)),
            Ok(Ok(fut)) => {
                let handler_started = Instant::now();
                let result = self.call(fut).await;
                meters
                    .handler_duration
                    .record(handler_started.elapsed().as_secs_f64());
                self.plan(result, &state)
            }
            Err(panic) => self.plan(
                HandlerOutcome::Panicked(outcome::panic_message(&*panic)),
                &state,
            ),
        };
        let label = match plan {
            Some(plan) => self.settle(plan, &state, message_id).await,
            None => "abandoned",
        };
        let span = Span::current();
        span.record("outcome", label);
        span.record("duration_ms", started.elapsed().as_millis() as u64);
        debug!(
            outcome = label,
            duration_ms = started.elapsed().as_millis() as u64,
            "delivery done"
        );
    }

    fn plan(&self, result: HandlerOutcome, state: &RetryState) -> Option<Plan> {
        match result.into_error() {
            Err(()) => None,
            Ok(None) => Some(Plan::Ack),
            Ok(Some(e)) => Some(outcome::plan_failure(&self.worker.config.policy, state, &e)),
        }
    }

    /// Runs the handler future with panic catching, the optional timeout, and the hard stop.
    async fn call(&self, fut: HandlerFuture) -> HandlerOutcome {
        let timeout = self.worker.config.handler_timeout;
        let guarded = async move {
            let caught = AssertUnwindSafe(fut).catch_unwind();
            let caught = match timeout {
                Some(d) => match tokio::time::timeout(d, caught).await {
                    Ok(r) => r,
                    Err(_) => return HandlerOutcome::TimedOut(d),
                },
                None => caught.await,
            };
            match caught {
                Ok(r) => HandlerOutcome::Completed(r),
                Err(panic) => HandlerOutcome::Panicked(outcome::panic_message(&*panic)),
            }
        };
        tokio::select! {
            biased;
            r = guarded => r,
            _ = self.worker.hard_stop.cancelled() => HandlerOutcome::Abandoned,
        }
    }

    /// Carries out the plan; returns the outcome label for the span.
    async fn settle(&self, plan: Plan, state: &RetryState, message_id: &str) -> &'static str {
        match plan {
            Plan::Ack => {
                if self.ack(true) {
                    "acked"
                } else {
                    self.settle_failed("ack", Ok(false))
                }
            }
            Plan::Retry {
                delay,
                attempt,
                error,
            } => Box::pin(self.retry(delay, attempt, &error, state, message_id)).await,
            Plan::DeadLetter { reason, error } => {
                Box::pin(self.dead_letter(reason, &error, state, message_id)).await
            }
        }
    }

    /// Moves the message to the DLQ the configured way; the final error and reason go to the
    /// span, the log line and the metric in every mode.
    async fn dead_letter(
        &self,
        reason: &'static str,
        error: &str,
        state: &RetryState,
        message_id: &str,
    ) -> &'static str {
        record_dead_letter(reason, error);
        match self.worker.config.dead_letter_mode {
            DeadLetterMode::Reject => self.reject_to_dlx(reason, error, state, message_id).await,
            DeadLetterMode::Annotate => {
                Box::pin(self.annotate_to_dlx(reason, error, state, message_id)).await
            }
        }
    }

    /// `Annotate`: publishes the dead letter to `Q.dlx` with the reason and the final error,
    /// confirmed, then acks the original. The broker never sees a reject, so the copy carries no
    /// `x-death`; unconfirmed, the original is requeued like a retry's.
    async fn annotate_to_dlx(
        &self,
        reason: &'static str,
        error: &str,
        state: &RetryState,
        message_id: &str,
    ) -> &'static str {
        let config = &self.worker.config;
        if !self.delivery.acker.usable() {
            return self.settle_failed("dead-letter", Ok(false));
        }
        let original = &self.delivery.properties;
        let info = headers::DeadLetterInfo {
            reason: reason.to_owned(),
            error: Some(error.to_owned()),
            attempts: Some(u64::from(state.attempt) + 1),
            at: Some(headers::now_rfc3339()),
            by: Some(config.connection_name.clone()),
        };
        let hdrs = headers::dead_letter_headers(
            original.headers().as_ref(),
            &info,
            original.expiration().as_ref().map(|e| e.as_str()),
        );
        let props = outcome::retry_copy_properties(original, hdrs, &self.session.username);
        let dlx = config.topology.dlx_name();
        let published = match self.session.publisher().await {
            Ok(p) => {
                p.publish_copy(&dlx, &config.queue, &self.delivery.data, props)
                    .await
            }
            Err(e) => Err(e),
        };
        match published {
            Ok(()) => {
                self.forget_requeues();
                metrics::counter!(m::MESSAGES_DEAD_LETTERED, m::LABEL_QUEUE => config.queue.clone(), m::LABEL_REASON => reason)
                    .increment(1);
                warn!(
                    message_id = %message_id,
                    attempt = state.attempt,
                    reason,
                    error = %error,
                    dlq = %config.topology.dlq_name(),
                    "message dead-lettered (annotated)"
                );
                if self.ack(false) {
                    "dead_lettered"
                } else {
                    warn!(message_id = %message_id, "dead letter published but the original could not be acked: it will be delivered again");
                    self.settle_failed("ack after dead-letter", Ok(false))
                }
            }
            // The body is the one the broker accepted and headers do not count, so only a
            // broker whose limit was lowered since refuses it: it can still move the original.
            Err(PublishError::TooLarge { .. }) => {
                self.reject_to_dlx(reason, error, state, message_id).await
            }
            Err(e) => {
                error!(message_id = %message_id, error = %e, reason, "dead letter not confirmed by the broker; requeueing the original");
                self.requeue_bounded(
                    m::REASON_DEAD_LETTER_UNCONFIRMED,
                    true,
                    &e,
                    state,
                    message_id,
                )
                .await
            }
        }
    }

    /// `basic.reject(requeue = false)`: the broker's DLX moves the message to the DLQ.
    async fn reject_to_dlx(
        &self,
        reason: &'static str,
        error: &str,
        state: &RetryState,
        message_id: &str,
    ) -> &'static str {
        let queue = &self.worker.config.queue;
        let rejected = self
            .delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await;
        // Only once the reject frame is out may a batched ack cover later tags.
        self.session.acks.released(self.delivery.delivery_tag);
        match rejected {
            Ok(true) => {
                metrics::counter!(m::MESSAGES_DEAD_LETTERED, m::LABEL_QUEUE => queue.clone(), m::LABEL_REASON => reason)
                    .increment(1);
                // The broker moves the original to the DLQ unchanged; this event is where
                // the final error lives, so it carries the message id itself.
                warn!(
                    message_id = %message_id,
                    attempt = state.attempt,
                    reason,
                    error = %error,
                    dlq = %self.worker.config.topology.dlq_name(),
                    "message dead-lettered"
                );
                "dead_lettered"
            }
            other => self.settle_failed("reject", other),
        }
    }

    async fn retry(
        &self,
        delay: Duration,
        attempt: u32,
        error: &str,
        state: &RetryState,
        message_id: &str,
    ) -> &'static str {
        let queue = &self.worker.config.queue;
        let acker = &self.delivery.acker;
        if !acker.usable() {
            // The channel died under us: the broker will redeliver the original, so publishing a
            // copy now would only create a duplicate.
            return self.settle_failed("retry", Ok(false));
        }
        let max = self.session.delay.max_delay();
        let delay = if delay > max {
            warn!(requested = ?delay, max = ?max, "retry delay above the delay infrastructure's maximum; using the maximum");
            max
        } else {
            delay
        };
        let copy_state = outcome::next_retry_state(
            state,
            attempt,
            delay,
            error,
            self.delivery.exchange.as_str(),
            self.delivery.routing_key.as_str(),
        );
        let copy_headers =
            headers::retry_copy_headers(self.delivery.properties.headers().as_ref(), &copy_state);
        let props = outcome::retry_copy_properties(
            &self.delivery.properties,
            copy_headers,
            &self.session.username,
        );
        let published = match self.session.publisher().await {
            Ok(p) => {
                p.publish_delayed(queue, delay, &self.delivery.data, props)
                    .await
            }
            Err(e) => Err(e),
        };
        match published {
            Ok(()) => {
                metrics::counter!(m::MESSAGES_RETRIED, m::LABEL_QUEUE => queue.clone(), m::LABEL_ATTEMPT => attempt.to_string())
                    .increment(1);
                info!(
                    message_id = %message_id,
                    attempt,
                    delay_ms = delay.as_millis() as u64,
                    error = %error,
                    "retry scheduled"
                );
                self.forget_requeues();
                // Only now, with the copy confirmed by the broker, may the original go.
                if self.ack(false) {
                    "retried"
                } else {
                    warn!(message_id = %message_id, "retry copy published but the original could not be acked: it will be delivered twice");
                    self.settle_failed("ack after retry", Ok(false))
                }
            }
            Err(e @ PublishError::TooLarge { .. }) => {
                // The same copy will never fit: no requeue, no retry.
                let error = format!("{error} (retry copy refused: {e})");
                self.dead_letter(m::REASON_TOO_LARGE, &error, state, message_id)
                    .await
            }
            Err(e) => {
                error!(
                    message_id = %message_id,
                    attempt,
                    error = %e,
                    handler_error = %error,
                    "retry copy not confirmed by the broker; requeueing the original"
                );
                self.requeue_bounded(m::REASON_RETRY_UNCONFIRMED, true, &e, state, message_id)
                    .await
            }
        }
    }

    /// Republishes the delivery, with its `x-death` repaired, to the back of its own queue and
    /// acks the original once the broker confirmed the copy. The copy is then processed like
    /// any message (the handler never sees the original).
    async fn sanitize(&self, repaired: lapin::types::FieldTable, message_id: &str) -> &'static str {
        let queue = &self.worker.config.queue;
        if !self.delivery.acker.usable() {
            return self.settle_failed("sanitize", Ok(false));
        }
        let props = outcome::retry_copy_properties(
            &self.delivery.properties,
            repaired,
            &self.session.username,
        );
        // The default exchange routes to the queue by name, whatever its bindings.
        let published = match self.session.publisher().await {
            Ok(p) => p.publish_copy("", queue, &self.delivery.data, props).await,
            Err(e) => Err(e),
        };
        match published {
            Ok(()) => {
                self.session.meters.sanitized.increment(1);
                self.forget_requeues();
                warn!(
                    message_id = %message_id,
                    "malformed x-death header (RabbitMQ cannot dead-letter it): republished the message without the bad entries"
                );
                if self.ack(false) {
                    "sanitized"
                } else {
                    self.settle_failed("ack after sanitize", Ok(false))
                }
            }
            Err(e) => {
                error!(message_id = %message_id, error = %e, "copy without the malformed x-death not confirmed by the broker; requeueing the original");
                // Dead-lettering the original itself is what crashes RabbitMQ 3.x; there its
                // quorum queue counts the requeues instead. Unknown version: assume 3.x.
                let may_dead_letter = self
                    .session
                    .server
                    .as_ref()
                    .and_then(ServerInfo::version)
                    .is_some_and(|v| !v.dead_lettering_trusts_client_x_death());
                let state = RetryState::read(self.delivery.properties.headers().as_ref());
                self.requeue_bounded(
                    m::REASON_REPAIR_UNCONFIRMED,
                    may_dead_letter,
                    &e,
                    &state,
                    message_id,
                )
                .await
            }
        }
    }

    /// Hands the delivery to the channel's batched acks (`success`: its handler succeeded);
    /// false when its channel is already closed, so no ack can reach the broker.
    fn ack(&self, success: bool) -> bool {
        let usable = self.delivery.acker.usable();
        if usable {
            self.session.acks.ack(self.delivery.delivery_tag, success);
        }
        usable
    }

    /// Gives a message whose replacement copy was not confirmed back to its queue
    /// (`basic.reject(requeue = true)`), unless this
    /// worker already did so `requeue_limit` times: then, where `may_dead_letter`, it is
    /// dead-lettered instead (RabbitMQ 4.3 no longer counts requeues toward the delivery limit,
    /// and a classic queue never did, so nothing else would end the cycle).
    async fn requeue_bounded(
        &self,
        reason: &'static str,
        may_dead_letter: bool,
        cause: &PublishError,
        state: &RetryState,
        message_id: &str,
    ) -> &'static str {
        let key = crate::requeue::identity(&self.delivery);
        // A poisoned lock still holds good counts; losing them would unbound the requeues.
        let count = self
            .worker
            .requeues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .record(key);
        let limit = self.worker.config.requeue_limit;
        if count > limit && may_dead_letter {
            self.worker
                .requeues
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .forget(key);
            error!(message_id = %message_id, requeues = count - 1, limit, "requeue limit reached: dead-lettering the message instead");
            let error = format!("{reason} {} times, last: {cause}", count - 1);
            // Rejected whatever the mode: publishing is what keeps failing.
            record_dead_letter(m::REASON_REQUEUE_LIMIT, &error);
            return self
                .reject_to_dlx(m::REASON_REQUEUE_LIMIT, &error, state, message_id)
                .await;
        }
        metrics::counter!(m::MESSAGES_REQUEUED, m::LABEL_QUEUE => self.worker.config.queue.clone(), m::LABEL_REASON => reason)
            .increment(1);
        warn!(message_id = %message_id, reason, requeues = count, limit, "requeueing the message");
        self.requeue_after_pause().await
    }

    /// The message's replacement copy is confirmed: its earlier requeues no longer count.
    fn forget_requeues(&self) {
        self.worker
            .requeues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .settled(&self.delivery);
    }

    /// Gives the delivery back to the queue after [`REQUEUE_PAUSE`].
    async fn requeue_after_pause(&self) -> &'static str {
        let acker = &self.delivery.acker;
        if !acker.usable() {
            // Lost with the connection: nothing to requeue, the broker redelivers it.
            return self.settle_failed("requeue", Ok(false));
        }
        tokio::select! {
            _ = tokio::time::sleep(REQUEUE_PAUSE) => {}
            _ = self.worker.hard_stop.cancelled() => {}
        }
        // basic.reject, not basic.nack: from RabbitMQ 4.3 a quorum queue counts a reject toward
        // x-delivery-limit but not a nack, and the delivery limit is the guard of last resort.
        let rejected = acker.reject(BasicRejectOptions { requeue: true }).await;
        self.session.acks.released(self.delivery.delivery_tag);
        match rejected {
            Ok(true) => "requeued",
            other => self.settle_failed("requeue", other),
        }
    }

    /// An ack/nack/reject that did not reach the broker: never a success. The message will be
    /// redelivered (`redelivered = true`), so this counts a future duplicate.
    fn settle_failed(&self, op: &str, result: Result<bool, lapin::Error>) -> &'static str {
        self.session.meters.settle_failures.increment(1);
        match result {
            Ok(_) => warn!(
                op,
                "settle failed: the delivery's channel is closed; the broker will redeliver it"
            ),
            Err(e) => warn!(op, error = %e, "settle failed; the broker will redeliver it"),
        }
        "settle_failed"
    }
}
