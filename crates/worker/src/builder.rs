//! Configuring a worker: [`WorkerBuilder`], its validation, and [`Worker::builder`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redeliver_amqp::url::BrokerUrl;
use redeliver_amqp::DelayConfig;
use redeliver_amqp::TlsConfig;
use redeliver_amqp::Topology;
use redeliver_core::{Backoff, HandlerError, Jitter, RetryPolicy};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::error::{SettingError, WorkerError};
use crate::handler::{Erased, ErasedHandler, FromDelivery, Handler};
use crate::permits::Permits;
use crate::runtime::Worker;
use crate::settings::{DeadLetterMode, Resolved, Settings};
use crate::status::{StatusSender, WorkerStatus};

type TopologyMap = Box<dyn FnOnce(Topology) -> Topology + Send>;

/// Configures a [`Worker`]. Start with [`Worker::builder`] (or
/// [`WorkerBuilder::from_env`](crate::WorkerBuilder::from_env)).
///
/// Required: a queue ([`queue`](Self::queue) or [`topology`](Self::topology)) and a handler
/// ([`handler`](Self::handler) or [`handler_impl`](Self::handler_impl)).
///
/// # Defaults
///
/// | setting | default |
/// |---|---|
/// | [`failover_urls`](Self::failover_urls) | none |
/// | [`topology`](Self::topology) | [`Topology::new`] of the queue: quorum queue, `Q.dlx`, `Q.dlq`, delivery limit 20 |
/// | [`prefix`](Self::prefix) | none |
/// | [`delay`](Self::delay) | the topology's ([`DelayConfig::default`] with the topology's prefix) |
/// | [`policy`](Self::policy) | `RetryPolicy::exponential(1 s)` with the policy's own defaults (see [`RetryPolicy`]) |
/// | [`prefetch`](Self::prefetch) | twice the concurrency, at most 65535 |
/// | [`concurrency`](Self::concurrency) | 10 |
/// | [`verify_only`](Self::verify_only) | false: declare the topology |
/// | [`handler_timeout`](Self::handler_timeout) | none |
/// | [`shutdown_grace`](Self::shutdown_grace) | 25 s (below Kubernetes' 30 s `terminationGracePeriodSeconds`) |
/// | [`connection_name`](Self::connection_name) | `redeliver-worker:<queue>` |
/// | [`reconnect_backoff`](Self::reconnect_backoff) | exponential 100 ms × 2 up to 30 s, full jitter |
/// | [`requeue_limit`](Self::requeue_limit) | 10 requeues, each after a 1 s pause |
/// | [`max_message_size`](Self::max_message_size) | the broker version's default `max_message_size` (16 MiB from RabbitMQ 4.0, 128 MiB before) |
/// | [`confirm_timeout`](Self::confirm_timeout) | 30 s |
/// | [`topology_check_interval`](Self::topology_check_interval) | 30 s |
/// | [`dead_letter_mode`](Self::dead_letter_mode) | [`DeadLetterMode::Reject`] |
/// | [`tls`](Self::tls) | the system's root certificates, password login |
///
/// The environment layer ([`env`](crate::env)) writes into the same settings; read them back
/// with [`settings`](Self::settings).
pub struct WorkerBuilder {
    settings: Settings,
    topology_maps: Vec<TopologyMap>,
    handler: Option<Arc<dyn ErasedHandler>>,
    status: StatusSender,
}

impl std::fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("settings", &self.settings)
            .field("handler", &self.handler.is_some())
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Starts configuring a worker for the broker at `amqp_url`
    /// (e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`).
    pub fn builder(amqp_url: impl Into<String>) -> WorkerBuilder {
        WorkerBuilder {
            settings: Settings::new(amqp_url.into()),
            topology_maps: Vec::new(),
            handler: None,
            status: StatusSender::new(),
        }
    }
}

impl WorkerBuilder {
    /// The settings so far.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The settings, for the environment layer to write into.
    pub(crate) fn settings_mut(&mut self) -> &mut Settings {
        &mut self.settings
    }

    /// More brokers to connect to, tried in turn after the URL given to [`Worker::builder`]:
    /// the nodes of a RabbitMQ cluster, for instance.
    ///
    /// When a connection attempt fails, or a connection is lost, the worker goes on with the next
    /// URL (round robin), so a stopped node is skipped at once; it pauses with its
    /// [`reconnect_backoff`](Self::reconnect_backoff) only after a whole round of URLs failed.
    /// Every URL must reach the same vhost of the same cluster: the topology and the delay
    /// levels are declared (or verified) on whichever node answers.
    ///
    /// ```no_run
    /// # use redeliver::{Worker, Raw, Context, HandlerError};
    /// # async fn demo() -> Result<(), redeliver::WorkerError> {
    /// Worker::builder("amqp://app:secret@rabbit-0:5672/%2f")
    ///     .failover_urls([
    ///         "amqp://app:secret@rabbit-1:5672/%2f",
    ///         "amqp://app:secret@rabbit-2:5672/%2f",
    ///     ])
    ///     .queue("orders")
    ///     .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
    ///     .run_until_signal()
    ///     .await
    /// # }
    /// ```
    pub fn failover_urls<I>(mut self, urls: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.settings.failover_urls = urls.into_iter().map(Into::into).collect();
        self
    }

    /// The queue to consume, with the default topology (quorum queue, `Q.dlx`, `Q.dlq`,
    /// delivery limit 20, see [`Topology`]). Refine it with [`map_topology`](Self::map_topology),
    /// or pass a whole [`Topology`] with [`topology`](Self::topology) instead.
    pub fn queue(mut self, name: impl Into<String>) -> Self {
        self.settings.queue = Some(name.into());
        self
    }

    /// The full topology (queue, type, delivery limit, DLQ options, bindings, prefix, delay
    /// configuration). Replaces [`queue`](Self::queue).
    pub fn topology(mut self, topology: Topology) -> Self {
        self.settings.topology = Some(topology);
        self
    }

    /// Adjusts the topology built from [`queue`](Self::queue) (or given to
    /// [`topology`](Self::topology)); calls accumulate in order.
    ///
    /// ```no_run
    /// # use redeliver::{Worker, Raw, Context, HandlerError};
    /// # async fn demo() -> Result<(), redeliver::WorkerError> {
    /// Worker::builder("amqp://127.0.0.1:5672/%2f")
    ///     .queue("orders")
    ///     .map_topology(|t| t.prefix("eu-").classic().bind("shop", "order.created"))
    ///     .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
    ///     .run_until_signal()
    ///     .await
    /// # }
    /// ```
    pub fn map_topology(mut self, f: impl FnOnce(Topology) -> Topology + Send + 'static) -> Self {
        self.topology_maps.push(Box::new(f));
        self
    }

    /// Name prefix for every object (queue, DLX, DLQ and, unless [`delay`](Self::delay) is
    /// given, the delay levels). Applied before [`map_topology`](Self::map_topology)'s functions.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.settings.prefix = Some(prefix.into());
        self
    }

    /// Delay infrastructure settings (granularity, levels, queue type, prefix).
    pub fn delay(mut self, cfg: DelayConfig) -> Self {
        self.settings.delay = Some(cfg);
        self
    }

    /// Retry policy: backoff, jitter, max retries, error classification, retry budget.
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.settings.policy = policy;
        self
    }

    /// Per-consumer prefetch (`basic.qos`, `global = false`), applied on every channel the worker
    /// opens. It is the only bound on messages buffered in memory. Must be at least
    /// 1.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.settings.prefetch = Some(n);
        self
    }

    /// Handlers allowed to run at once. A prefetch below it caps concurrency.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings.concurrency = n;
        self
    }

    /// The handler, as a closure `|msg: M, ctx: Context| async move { ... }` returning
    /// `Result<(), HandlerError>`; `M` is any [`FromDelivery`] type ([`Json<T>`](crate::Json),
    /// [`Raw`](crate::Raw), [`Text`](crate::Text)). A body that does not decode as `M` is
    /// dead-lettered without calling the handler.
    ///
    /// The worker polls a handler's future once itself before making it a task (a handler that
    /// completes without waiting costs no task then), so CPU-heavy work before the first
    /// `.await` delays the intake of the next delivery: move such work to
    /// `tokio::task::spawn_blocking`, as in any async code.
    pub fn handler<M, F, Fut>(mut self, f: F) -> Self
    where
        M: FromDelivery,
        F: Fn(M, crate::Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        self.handler = Some(Arc::new(Erased::<F, M>::new(f)));
        self
    }

    /// The handler, as a value implementing [`Handler`] (a struct holding pools and clients).
    pub fn handler_impl<M, H>(mut self, handler: H) -> Self
    where
        M: FromDelivery,
        H: Handler<M>,
    {
        self.handler = Some(Arc::new(Erased::<H, M>::new(handler)));
        self
    }

    /// Only verify (passively) that the topology exists instead of declaring it, for
    /// deployments where an operator or the CLI owns the topology.
    pub fn verify_only(mut self, yes: bool) -> Self {
        self.settings.verify_only = yes;
        self
    }

    /// Per-message handler time limit; a handler that exceeds it is dropped and the message
    /// retried as a transient failure.
    ///
    /// Keep it well below the broker's `consumer_timeout` (30 min by default): a delivery held
    /// longer than that makes the broker close the channel, and every in-flight message of that
    /// channel is redelivered.
    pub fn handler_timeout(mut self, d: Duration) -> Self {
        self.settings.handler_timeout = Some(d);
        self
    }

    /// How long shutdown waits for in-flight handlers before dropping them (their messages go
    /// back to the queue when the channel closes).
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.settings.shutdown_grace = d;
        self
    }

    /// Connection name shown in the management UI (client property `connection_name`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.settings.connection_name = Some(name.into());
        self
    }

    /// Pacing of reconnect attempts: the pause after a lost session, or after a round of URLs
    /// that all failed, is the next of [`Backoff::delays`]; it starts over from the first once a
    /// session consumes again.
    pub fn reconnect_backoff(mut self, backoff: Backoff, jitter: Jitter) -> Self {
        self.settings.reconnect_backoff = backoff;
        self.settings.reconnect_jitter = jitter;
        self
    }

    /// How often the worker itself gives one message back to its queue, because the broker did
    /// not confirm the copy that would have replaced it (a retry copy, a repaired copy), before
    /// it dead-letters the message instead (reason `requeue_limit`). Each requeue waits 1 s.
    ///
    /// Before RabbitMQ 4.3 a quorum queue counted these requeues toward its delivery limit; from
    /// 4.3 it does not, and a classic queue never did, so without this bound a copy that can
    /// never be confirmed would cycle forever.
    pub fn requeue_limit(mut self, n: u32) -> Self {
        self.settings.requeue_limit = n;
        self
    }

    /// Largest body the worker publishes (retry and repaired copies); a larger copy is refused
    /// before it reaches the broker, and its original dead-lettered with reason `too_large`.
    /// Set it when the broker's `max_message_size` is not its version's default.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.settings.max_message_size = Some(bytes);
        self
    }

    /// How long the worker waits for the broker to confirm a copy it publishes (a retry copy, a
    /// repaired copy, an annotated dead letter), and for the broker to unblock its publishing
    /// connection during a resource alarm, before it gives the original back to the queue (as
    /// when the copy is refused). Copies go out on a connection of their own, so a blocked
    /// publish never holds up the acks of successful deliveries. Requeues while the broker
    /// blocks the connection do not count toward the [`requeue_limit`](Self::requeue_limit):
    /// an alarm is not the message's fault.
    pub fn confirm_timeout(mut self, d: Duration) -> Self {
        self.settings.confirm_timeout = d;
        self
    }

    /// How often the running worker checks that its topology still exists (`Q.dlx`, `Q.dlq`,
    /// `Q`, and the delay infrastructure: its levels and the parking queue of retries whose queue
    /// is gone), declares again what was deleted (unless [`verify_only`](Self::verify_only)),
    /// and measures the parking queue (metric `redeliver_delay_unroutable_messages`). Without the
    /// parking queue, such a retry would be dropped; without `Q.dlx`, the broker drops (classic
    /// `Q`) or holds (quorum `Q`) dead letters, silently. The interval bounds that window.
    pub fn topology_check_interval(mut self, d: Duration) -> Self {
        self.settings.topology_check_interval = d;
        self
    }

    /// How messages that cannot succeed reach `Q.dlq`; see the modes' trade-offs on
    /// [`DeadLetterMode`].
    ///
    /// ```
    /// use redeliver::{DeadLetterMode, Worker};
    /// let builder = Worker::builder("amqp://127.0.0.1:5672/%2f")
    ///     .queue("images")
    ///     .dead_letter_mode(DeadLetterMode::Annotate);
    /// # let _ = builder;
    /// ```
    pub fn dead_letter_mode(mut self, mode: DeadLetterMode) -> Self {
        self.settings.dead_letter_mode = mode;
        self
    }

    /// TLS settings for `amqps://` URLs: a CA bundle, a client certificate for mutual TLS, SASL
    /// EXTERNAL. The broker's certificate is always verified, its host name included. See [`TlsConfig`].
    ///
    /// ```
    /// use redeliver::{TlsConfig, Worker};
    /// let builder = Worker::builder("amqps://app:secret@rabbit.internal:5671/%2f")
    ///     .queue("images")
    ///     .tls(TlsConfig::new().ca_file("/etc/redeliver/ca.pem"));
    /// # let _ = builder;
    /// ```
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.settings.tls = tls;
        self
    }

    /// A readiness handle, usable before the worker runs (for a health server started first).
    pub fn status_handle(&self) -> WorkerStatus {
        self.status.handle()
    }

    /// Validates the configuration and returns the worker.
    ///
    /// # Errors
    ///
    /// [`WorkerError::Config`] for a missing queue or handler, a concurrency or prefetch out of
    /// range, an unparsable URL; [`WorkerError::Topology`] for invalid names or delay settings;
    /// [`WorkerError::Connect`] for an `amqps://` URL in a build without TLS or TLS settings that
    /// cannot work. Nothing is connected yet.
    pub fn build(self) -> Result<Worker, WorkerError> {
        let settings = self.settings;
        let mut urls = Vec::with_capacity(1 + settings.failover_urls.len());
        for raw in std::iter::once(&settings.url).chain(&settings.failover_urls) {
            // An amqps:// URL in a build without TLS is refused here, before any connection.
            let url = BrokerUrl::parse(raw).map_err(SettingError::Url)?;
            settings.tls.check(&url)?;
            urls.push(url);
        }
        // TLS for some nodes only would let whoever blocks them get the password in clear text.
        redeliver_amqp::url::check_list(&urls).map_err(SettingError::Url)?;
        let mut topology = match (&settings.topology, &settings.queue) {
            (Some(t), _) => t.clone(),
            (None, Some(q)) => Topology::new(q.clone()),
            (None, None) => return Err(SettingError::NoQueue.into()),
        };
        if let Some(p) = &settings.prefix {
            topology = topology.prefix(p.clone());
        }
        for f in self.topology_maps {
            topology = f(topology);
        }
        if let Some(delay) = &settings.delay {
            topology = topology.delay(delay.clone());
        }
        let queue = topology.queue_name();
        // Names and delay settings are checked now, not on the first connect, so a typo fails
        // fast instead of entering the reconnect loop.
        topology.validate()?;
        if settings
            .policy
            .configured_forward()
            .and_then(|to| to.queue())
            == Some(queue.as_str())
        {
            // The forwarded copy carries no retry state, so it would come back as a fresh
            // message and be forwarded again for ever, never reaching the DLQ.
            return Err(SettingError::ForwardToItself(queue).into());
        }
        let handler = self.handler.ok_or(SettingError::NoHandler)?;
        let concurrency = settings.concurrency;
        if concurrency == 0 || concurrency > Permits::MAX {
            return Err(SettingError::Concurrency {
                got: concurrency,
                max: Permits::MAX,
            }
            .into());
        }
        for (name, d) in [
            ("confirm_timeout", settings.confirm_timeout),
            ("topology_check_interval", settings.topology_check_interval),
        ] {
            if d.is_zero() {
                return Err(SettingError::Zero(name).into());
            }
        }
        let prefetch = settings
            .prefetch
            .unwrap_or_else(|| u16::try_from(concurrency.saturating_mul(2)).unwrap_or(u16::MAX));
        if prefetch == 0 {
            // 0 means "unlimited" to the broker, and lapin buffers deliveries without bound.
            return Err(SettingError::Prefetch.into());
        }
        if usize::from(prefetch) < concurrency {
            warn!(
                queue = %queue,
                prefetch,
                concurrency,
                "prefetch below concurrency: at most `prefetch` handlers will run at once"
            );
        }
        self.status.set_queue(queue.clone());
        let connection_name = settings
            .connection_name
            .clone()
            .unwrap_or_else(|| format!("redeliver-worker:{queue}"));
        Ok(Worker::new(
            Resolved {
                settings,
                urls,
                topology,
                queue,
                prefetch,
                connection_name,
                handler,
            },
            self.status,
        ))
    }

    /// [`build`](Self::build), then [`Worker::run`].
    pub async fn run(self, token: CancellationToken) -> Result<(), WorkerError> {
        self.build()?.run(token).await
    }

    /// [`build`](Self::build), then [`Worker::run_until_signal`].
    pub async fn run_until_signal(self) -> Result<(), WorkerError> {
        self.build()?.run_until_signal().await
    }
}
