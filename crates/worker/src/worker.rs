//! The builder, the worker and its reconnect loop.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use redeliver_amqp::url::BrokerUrl;
use redeliver_amqp::DelayConfig;
use redeliver_amqp::PublishError;
use redeliver_amqp::{ConnectError, TlsConfig};
use redeliver_amqp::{Topology, TopologyError};
use redeliver_core::{Backoff, Jitter, RetryPolicy};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::handler::{Erased, ErasedHandler, FromDelivery, Handler};
use crate::metrics_names;
use crate::session::{Session, SessionEnd};
use crate::status::{StatusSender, WorkerState, WorkerStatus};
use crate::HandlerError;

/// Default per-worker handler concurrency.
pub const DEFAULT_CONCURRENCY: usize = 10;
/// Default shutdown grace period: below Kubernetes' default `terminationGracePeriodSeconds` (30 s)
/// so that settling and closing fit before the pod is killed.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(25);
/// Time allowed, after the grace period, for abandoned handlers to unwind and for settling the
/// ones that just finished, before the channel is closed regardless.
const SETTLE_GRACE: Duration = Duration::from_secs(5);
/// Upper bound on one connection attempt (TCP + AMQP handshake + topology + consume), so a
/// black-holed broker address cannot hang the reconnect loop.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors that stop a worker. Connection problems are not among them: the worker reconnects
/// (with backoff) until it is told to stop.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The builder was given something unusable (no queue, no handler, prefetch 0, bad URL...).
    #[error("invalid worker configuration: {0}")]
    Config(String),
    /// Declaring or verifying the topology failed for a reason reconnecting will not fix (an
    /// argument mismatch with an existing queue, a missing object in verify-only mode, access
    /// refused, an invalid name).
    #[error("topology: {0}")]
    Topology(#[source] TopologyError),
    /// A broker operation failed (returned only where retrying makes no sense).
    #[error("AMQP: {0}")]
    Amqp(#[from] lapin::Error),
    /// The confirmed publisher could not be set up.
    #[error("publisher: {0}")]
    Publisher(#[from] PublishError),
    /// SIGTERM / SIGINT handlers could not be installed.
    #[error("cannot install signal handler: {0}")]
    Signal(#[source] std::io::Error),
    /// A worker task of [`run_all`] panicked or was cancelled.
    #[error("worker task failed: {0}")]
    Task(String),
    /// Connecting failed: TLS settings, a refused certificate, an unreachable broker.
    #[error(transparent)]
    Connect(#[from] ConnectError),
}

impl WorkerError {
    /// True when reconnecting cannot help, so `run` returns the error instead of retrying.
    pub(crate) fn is_fatal(&self) -> bool {
        match self {
            WorkerError::Topology(TopologyError::Amqp(_)) => false,
            WorkerError::Topology(_) | WorkerError::Config(_) | WorkerError::Signal(_) => true,
            WorkerError::Amqp(_) | WorkerError::Publisher(_) | WorkerError::Task(_) => false,
            // Unusable settings are fatal; a refused certificate or an unreachable broker may be
            // fixed on the other side (a renewed certificate, a DNS change) while we retry.
            WorkerError::Connect(ConnectError::Url(_) | ConnectError::Tls(_)) => true,
            WorkerError::Connect(_) => false,
        }
    }
}

impl From<TopologyError> for WorkerError {
    fn from(e: TopologyError) -> Self {
        WorkerError::Topology(e)
    }
}

type TopologyMap = Box<dyn FnOnce(Topology) -> Topology + Send>;

/// How the worker dead-letters a message that cannot succeed.
///
/// | | `Reject` (default) | `Annotate` |
/// |---|---|---|
/// | how | `basic.reject(requeue = false)`: the broker's DLX moves the message to `Q.dlq` | the worker publishes it to `Q.dlx` (routing key `Q`, mandatory, confirmed), then acks the original |
/// | what the DLQ copy says | `x-death` (reason `rejected`); a message retried before carries its last retry's error (`x-redeliver-last-error`) | `x-redeliver-dead-letter-reason`, `-error` (the final error and its sources, at most 4 KiB), `-attempts`, `x-redeliver-dead-lettered-at`, `-by` (the connection name), `x-redeliver-first-failed-at`; no `x-death` |
/// | the final error | in the log line, the metric's `reason` and the delivery's span | on the message too |
/// | cost | one frame | one confirmed publish per dead letter |
/// | if `Q.dlq` is missing | a quorum `Q` keeps the message (at-least-once); a classic one drops it | the publish comes back unroutable: the original is requeued (bounded by [`WorkerBuilder::requeue_limit`], then rejected) |
///
/// In both modes, messages the broker dead-letters itself (delivery limit, TTL, overflow) carry
/// the broker's `x-death`, and body and properties are kept (a dead letter drops `expiration`,
/// kept in `x-redeliver-original-expiration`, so it cannot expire in the DLQ).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterMode {
    /// The broker-native way: `basic.reject(requeue = false)`.
    #[default]
    Reject,
    /// Spring's republish-to-DLQ: the worker publishes the dead letter with its reason and error.
    Annotate,
}

impl std::str::FromStr for DeadLetterMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "reject" => Ok(Self::Reject),
            "annotate" => Ok(Self::Annotate),
            _ => Err("expected `reject` or `annotate`".into()),
        }
    }
}

/// Configures a [`Worker`]. Start with [`Worker::builder`].
///
/// Required: a queue ([`queue`](Self::queue) or [`topology`](Self::topology)) and a handler
/// ([`handler`](Self::handler) or [`handler_impl`](Self::handler_impl)). Everything else has a
/// documented default.
pub struct WorkerBuilder {
    url: String,
    failover_urls: Vec<String>,
    queue: Option<String>,
    topology: Option<Topology>,
    topology_maps: Vec<TopologyMap>,
    delay: Option<DelayConfig>,
    policy: RetryPolicy,
    prefetch: Option<u16>,
    concurrency: usize,
    handler: Option<Arc<dyn ErasedHandler>>,
    verify_only: bool,
    handler_timeout: Option<Duration>,
    shutdown_grace: Duration,
    connection_name: Option<String>,
    reconnect_backoff: Backoff,
    reconnect_jitter: Jitter,
    requeue_limit: u32,
    max_message_size: Option<usize>,
    tls: TlsConfig,
    dead_letter_mode: DeadLetterMode,
    status: StatusSender,
}

impl std::fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("queue", &self.queue)
            .field("topology", &self.topology)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("verify_only", &self.verify_only)
            .field("handler_timeout", &self.handler_timeout)
            .field("shutdown_grace", &self.shutdown_grace)
            .finish_non_exhaustive()
    }
}

impl WorkerBuilder {
    fn new(url: String) -> Self {
        Self {
            url,
            failover_urls: Vec::new(),
            queue: None,
            topology: None,
            topology_maps: Vec::new(),
            delay: None,
            policy: RetryPolicy::exponential(Duration::from_secs(1)),
            prefetch: None,
            concurrency: DEFAULT_CONCURRENCY,
            handler: None,
            verify_only: false,
            handler_timeout: None,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            connection_name: None,
            reconnect_backoff: Backoff::Exponential {
                base: Duration::from_millis(100),
                factor: 2.0,
                cap: Duration::from_secs(30),
            },
            reconnect_jitter: Jitter::Full,
            requeue_limit: crate::requeue::DEFAULT_REQUEUE_LIMIT,
            max_message_size: None,
            tls: TlsConfig::new(),
            dead_letter_mode: DeadLetterMode::Reject,
            status: StatusSender::new(),
        }
    }

    /// More brokers to connect to, tried in turn after the URL given to [`Worker::builder`]:
    /// the nodes of a RabbitMQ cluster, for instance. Default: none.
    ///
    /// When a connection attempt fails, or a connection is lost, the worker goes on with the next
    /// URL (round robin), so a stopped node is skipped at once; it pauses with its
    /// [`reconnect_backoff`](Self::reconnect_backoff) only after a whole round of URLs failed.
    /// Every URL must reach the same vhost of the same cluster: the topology and the delay
    /// levels are declared (or verified) on whichever node answers.
    ///
    /// ```no_run
    /// # use redeliver_worker::{Worker, Raw, Context, HandlerError};
    /// # async fn demo() -> Result<(), redeliver_worker::WorkerError> {
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
        self.failover_urls = urls.into_iter().map(Into::into).collect();
        self
    }

    /// The queue to consume, with the default topology (quorum queue, `Q.dlx`, `Q.dlq`,
    /// delivery limit 20, see [`Topology`]). Refine it with [`map_topology`](Self::map_topology),
    /// or pass a whole [`Topology`] with [`topology`](Self::topology) instead.
    pub fn queue(mut self, name: impl Into<String>) -> Self {
        self.queue = Some(name.into());
        self
    }

    /// The full topology (queue, type, delivery limit, DLQ options, bindings, prefix, delay
    /// configuration). Replaces [`queue`](Self::queue).
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = Some(topology);
        self
    }

    /// Adjusts the topology built from [`queue`](Self::queue) (or given to
    /// [`topology`](Self::topology)); calls accumulate in order.
    ///
    /// ```no_run
    /// # use redeliver_worker::{Worker, Raw, Context, HandlerError};
    /// # async fn demo() -> Result<(), redeliver_worker::WorkerError> {
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
    /// given, the delay levels). Shorthand for `map_topology(|t| t.prefix(p))`.
    pub fn prefix(self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        self.map_topology(move |t| t.prefix(prefix))
    }

    /// Delay infrastructure settings (granularity, levels, queue type, prefix). Default: the
    /// topology's ([`DelayConfig::default`] with the topology's prefix).
    pub fn delay(mut self, cfg: DelayConfig) -> Self {
        self.delay = Some(cfg);
        self
    }

    /// Retry policy. Default: `RetryPolicy::exponential(1 s)` (its own defaults for factor, cap,
    /// full jitter and max retries; see [`RetryPolicy`]).
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Per-consumer prefetch (`basic.qos`, `global = false`), applied on every channel the worker
    /// opens. It is the only bound on messages buffered in memory. Default: twice the
    /// concurrency (at most 65535). Must be at least 1.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = Some(n);
        self
    }

    /// Handlers allowed to run at once. Default: 10. A prefetch below it caps concurrency.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
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
    /// deployments where an operator or the CLI owns the topology. Default: declare.
    pub fn verify_only(mut self, yes: bool) -> Self {
        self.verify_only = yes;
        self
    }

    /// Per-message handler time limit; a handler that exceeds it is dropped and the message
    /// retried as a transient failure. Default: none.
    ///
    /// Keep it well below the broker's `consumer_timeout` (30 min by default): a delivery held
    /// longer than that makes the broker close the channel, and every in-flight message of that
    /// channel is redelivered.
    pub fn handler_timeout(mut self, d: Duration) -> Self {
        self.handler_timeout = Some(d);
        self
    }

    /// How long shutdown waits for in-flight handlers before dropping them (their messages go
    /// back to the queue when the channel closes). Default: 25 s.
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.shutdown_grace = d;
        self
    }

    /// Connection name shown in the management UI (client property `connection_name`).
    /// Default: `redeliver-worker:<queue>`.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Pacing of reconnect attempts. Default: exponential 100 ms × 2 up to 30 s, full jitter.
    pub fn reconnect_backoff(mut self, backoff: Backoff, jitter: Jitter) -> Self {
        self.reconnect_backoff = backoff;
        self.reconnect_jitter = jitter;
        self
    }

    /// How often the worker itself gives one message back to its queue, because the broker did
    /// not confirm the copy that would have replaced it (a retry copy, a repaired copy), before
    /// it dead-letters the message instead (reason `requeue_limit`). Default: 10, each after a
    /// 1 s pause.
    ///
    /// Before RabbitMQ 4.3 a quorum queue counted these requeues toward its delivery limit; from
    /// 4.3 it does not, and a classic queue never did, so without this bound a copy that can
    /// never be confirmed would cycle forever.
    pub fn requeue_limit(mut self, n: u32) -> Self {
        self.requeue_limit = n;
        self
    }

    /// Largest body the worker publishes (retry and repaired copies); a larger copy is refused
    /// before it reaches the broker, and its original dead-lettered with reason `too_large`.
    /// Default: the broker's default `max_message_size` for the version it announces (16 MiB
    /// from RabbitMQ 4.0, 128 MiB before); set it when the broker is configured otherwise.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = Some(bytes);
        self
    }

    /// How messages that cannot succeed reach `Q.dlq`. Default: [`DeadLetterMode::Reject`]; see
    /// the modes' trade-offs there.
    ///
    /// ```
    /// use redeliver_worker::{DeadLetterMode, Worker};
    /// let builder = Worker::builder("amqp://127.0.0.1:5672/%2f")
    ///     .queue("images")
    ///     .dead_letter_mode(DeadLetterMode::Annotate);
    /// # let _ = builder;
    /// ```
    pub fn dead_letter_mode(mut self, mode: DeadLetterMode) -> Self {
        self.dead_letter_mode = mode;
        self
    }

    /// TLS settings for `amqps://` URLs: a CA bundle, a client certificate for mutual TLS, SASL
    /// EXTERNAL. Default: the system's root certificates, password login. The broker's
    /// certificate is always verified, its host name included. See [`TlsConfig`].
    ///
    /// ```
    /// use redeliver_worker::{TlsConfig, Worker};
    /// let builder = Worker::builder("amqps://app:secret@rabbit.internal:5671/%2f")
    ///     .queue("images")
    ///     .tls(TlsConfig::new().ca_file("/etc/redeliver/ca.pem"));
    /// # let _ = builder;
    /// ```
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = tls;
        self
    }

    /// A readiness handle, usable before the worker runs (for a health server started first).
    pub fn status_handle(&self) -> WorkerStatus {
        self.status.handle()
    }

    /// Validates the configuration and returns the worker.
    pub fn build(self) -> Result<Worker, WorkerError> {
        let mut urls = Vec::with_capacity(1 + self.failover_urls.len());
        for raw in std::iter::once(self.url).chain(self.failover_urls) {
            // An amqps:// URL in a build without TLS is refused here, before any connection.
            let url = BrokerUrl::parse(&raw).map_err(|e| WorkerError::Config(e.to_string()))?;
            self.tls.check(&url)?;
            urls.push(url);
        }
        let mut topology = match (self.topology, self.queue) {
            (Some(t), _) => t,
            (None, Some(q)) => Topology::new(q),
            (None, None) => {
                return Err(WorkerError::Config(
                    "no queue: call .queue(name) or .topology(..)".into(),
                ))
            }
        };
        for f in self.topology_maps {
            topology = f(topology);
        }
        if let Some(delay) = self.delay {
            topology = topology.delay(delay);
        }
        let queue = topology.queue_name();
        // Names and delay settings are checked now, not on the first connect, so a typo fails
        // fast instead of entering the reconnect loop.
        topology.validate()?;
        let handler = self.handler.ok_or_else(|| {
            WorkerError::Config("no handler: call .handler(..) or .handler_impl(..)".into())
        })?;
        if self.concurrency == 0 || self.concurrency > Semaphore::MAX_PERMITS {
            return Err(WorkerError::Config(format!(
                "concurrency must be between 1 and {}, got {}",
                Semaphore::MAX_PERMITS,
                self.concurrency
            )));
        }
        let prefetch = self.prefetch.unwrap_or_else(|| {
            u16::try_from(self.concurrency.saturating_mul(2)).unwrap_or(u16::MAX)
        });
        if prefetch == 0 {
            // 0 means "unlimited" to the broker, and lapin buffers deliveries without bound.
            return Err(WorkerError::Config(
                "prefetch must be at least 1 (0 would mean an unbounded buffer)".into(),
            ));
        }
        if usize::from(prefetch) < self.concurrency {
            warn!(
                queue = %queue,
                prefetch,
                concurrency = self.concurrency,
                "prefetch below concurrency: at most `prefetch` handlers will run at once"
            );
        }
        self.status.set_queue(queue.clone());
        let connection_name = self
            .connection_name
            .unwrap_or_else(|| format!("redeliver-worker:{queue}"));
        Ok(Worker {
            config: Arc::new(Config {
                urls,
                connection_name,
                queue,
                topology,
                policy: self.policy,
                prefetch,
                concurrency: self.concurrency,
                handler,
                verify_only: self.verify_only,
                handler_timeout: self.handler_timeout,
                shutdown_grace: self.shutdown_grace,
                reconnect_backoff: self.reconnect_backoff,
                reconnect_jitter: self.reconnect_jitter,
                requeue_limit: self.requeue_limit,
                max_message_size: self.max_message_size,
                tls: self.tls,
                dead_letter_mode: self.dead_letter_mode,
            }),
            status: self.status,
        })
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

/// Settings of a built worker, shared by its sessions and delivery tasks.
pub(crate) struct Config {
    /// The builder's URL first, then the failover URLs; never empty.
    pub(crate) urls: Vec<BrokerUrl>,
    pub(crate) connection_name: String,
    pub(crate) queue: String,
    pub(crate) topology: Topology,
    pub(crate) policy: RetryPolicy,
    pub(crate) prefetch: u16,
    pub(crate) concurrency: usize,
    pub(crate) handler: Arc<dyn ErasedHandler>,
    pub(crate) verify_only: bool,
    pub(crate) handler_timeout: Option<Duration>,
    pub(crate) shutdown_grace: Duration,
    pub(crate) reconnect_backoff: Backoff,
    pub(crate) reconnect_jitter: Jitter,
    pub(crate) requeue_limit: u32,
    pub(crate) max_message_size: Option<usize>,
    pub(crate) tls: TlsConfig,
    pub(crate) dead_letter_mode: DeadLetterMode,
}

/// State that outlives one connection: the concurrency limit and the in-flight tasks belong to the
/// worker, so handlers of a lost connection still count against the limit and are awaited at
/// shutdown.
pub(crate) struct Shared {
    pub(crate) config: Arc<Config>,
    pub(crate) semaphore: Arc<Semaphore>,
    pub(crate) tracker: TaskTracker,
    /// Cancelled when draining starts; handed to handlers as [`Context::shutdown_token`](crate::Context::shutdown_token).
    pub(crate) draining: CancellationToken,
    /// Cancelled when the grace period is over: handlers still running are dropped unsettled.
    pub(crate) hard_stop: CancellationToken,
    /// The worker's own requeues per message, bounded by `config.requeue_limit`.
    pub(crate) requeues: std::sync::Mutex<crate::requeue::RequeueLedger>,
}

impl Shared {
    /// Waits for in-flight handlers up to the grace period, then drops the rest.
    pub(crate) async fn drain_tasks(&self) {
        self.draining.cancel();
        self.tracker.close();
        if self.tracker.is_empty() {
            return;
        }
        info!(
            queue = %self.config.queue,
            in_flight = self.tracker.len(),
            grace = %humantime::format_duration(self.config.shutdown_grace),
            "waiting for in-flight handlers"
        );
        if tokio::time::timeout(self.config.shutdown_grace, self.tracker.wait())
            .await
            .is_err()
        {
            warn!(
                queue = %self.config.queue,
                abandoned = self.tracker.len(),
                "shutdown grace period over: dropping unfinished handlers; the broker requeues their messages"
            );
            self.hard_stop.cancel();
            let _ = tokio::time::timeout(SETTLE_GRACE, self.tracker.wait()).await;
        }
    }
}

/// A consumer of one queue: connects, declares (or verifies) the topology, consumes with bounded
/// concurrency, settles every delivery as DESIGN.md says, reconnects when the connection drops
/// and drains on shutdown.
///
/// ```no_run
/// use std::time::Duration;
/// use redeliver_worker::{Context, HandlerError, Json, RetryPolicy, Worker};
///
/// #[derive(serde::Deserialize)]
/// struct ImageJob { url: String }
///
/// #[tokio::main]
/// async fn main() -> Result<(), redeliver_worker::WorkerError> {
///     Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
///         .queue("images")
///         .policy(RetryPolicy::exponential(Duration::from_millis(500)).max_retries(5))
///         .prefetch(64)
///         .concurrency(16)
///         .handler(|job: Json<ImageJob>, ctx: Context| async move {
///             tracing::info!(url = %job.url, attempt = ctx.attempt(), "processing");
///             Ok::<(), HandlerError>(())
///         })
///         .run_until_signal()
///         .await
/// }
/// ```
pub struct Worker {
    config: Arc<Config>,
    status: StatusSender,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queue", &self.config.queue)
            .field("prefetch", &self.config.prefetch)
            .field("concurrency", &self.config.concurrency)
            .field("state", &self.status.handle().state())
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Starts configuring a worker for the broker at `amqp_url`
    /// (e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`).
    pub fn builder(amqp_url: impl Into<String>) -> WorkerBuilder {
        WorkerBuilder::new(amqp_url.into())
    }

    /// A readiness handle.
    pub fn status_handle(&self) -> WorkerStatus {
        self.status.handle()
    }

    /// Full name of the consumed queue (prefix included).
    pub fn queue_name(&self) -> &str {
        &self.config.queue
    }

    /// The topology the worker declares or verifies.
    pub fn topology(&self) -> &Topology {
        &self.config.topology
    }

    /// Runs until SIGTERM or SIGINT (Ctrl-C), then shuts down gracefully; `Ok(())` on a clean
    /// stop, so `main` exits 0.
    pub async fn run_until_signal(self) -> Result<(), WorkerError> {
        let token = CancellationToken::new();
        let signals = spawn_signal_canceller(token.clone())?;
        let result = self.run(token).await;
        signals.abort();
        result
    }

    /// Runs until `token` is cancelled, then shuts down gracefully: the consumer is cancelled,
    /// in-flight handlers get the grace period to finish and are settled, channel and connection
    /// are closed; messages not finished go back to the queue through the broker. Returns
    /// `Ok(())` on a clean stop; an error only for what reconnecting cannot fix (see
    /// [`WorkerError`]).
    pub async fn run(self, token: CancellationToken) -> Result<(), WorkerError> {
        let shared = Arc::new(Shared {
            semaphore: Arc::new(Semaphore::new(self.config.concurrency)),
            tracker: TaskTracker::new(),
            draining: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            requeues: std::sync::Mutex::default(),
            config: Arc::clone(&self.config),
        });
        let result = reconnect_loop(&shared, &self.status, &token).await;
        if result.is_err() {
            // A fatal error while handlers of an earlier connection still run: let them end.
            shared.drain_tasks().await;
        }
        self.status.set(WorkerState::Stopped);
        match &result {
            Ok(()) => info!(queue = %self.config.queue, "worker stopped"),
            Err(e) => {
                error!(queue = %self.config.queue, error = %e, "worker stopped with an error")
            }
        }
        result
    }
}

async fn reconnect_loop(
    shared: &Arc<Shared>,
    status: &StatusSender,
    token: &CancellationToken,
) -> Result<(), WorkerError> {
    let config = &shared.config;
    let mut rng = StdRng::from_os_rng();
    let mut failures: u32 = 0;
    let mut prev_delay: Option<Duration> = None;
    let mut ever_consumed = false;
    // Round robin over the URLs; `tried` counts the failures since the last pause, so a pause
    // comes only after every URL failed once, and `failures` counts such failed rounds.
    let mut url_index = 0usize;
    let mut tried = 0usize;
    loop {
        if token.is_cancelled() {
            break;
        }
        let url = &config.urls[url_index];
        status.set(if ever_consumed {
            WorkerState::Reconnecting
        } else {
            WorkerState::Connecting
        });
        let opened = tokio::select! {
            _ = token.cancelled() => break,
            r = tokio::time::timeout(CONNECT_TIMEOUT, Session::open(shared, url)) => r,
        };
        let failed = match opened {
            Ok(Ok(session)) => {
                if ever_consumed {
                    info!(queue = %config.queue, broker = %url, after_failed_rounds = failures, "connection recovered; consuming again");
                } else {
                    info!(
                        queue = %config.queue,
                        broker = %url,
                        prefetch = config.prefetch,
                        concurrency = config.concurrency,
                        "consuming"
                    );
                }
                failures = 0;
                tried = 0;
                prev_delay = None;
                ever_consumed = true;
                status.set_broker(url_index);
                status.set(WorkerState::Consuming);
                match session.consume(shared, token).await {
                    SessionEnd::Shutdown(session) => {
                        status.set(WorkerState::Draining);
                        session.drain(shared).await;
                        return Ok(());
                    }
                    SessionEnd::Lost(reason) => {
                        warn!(queue = %config.queue, broker = %url, reason = %reason, "consumer session lost; reconnecting");
                        // The node may be gone: start the next round with another one.
                        url_index = (url_index + 1) % config.urls.len();
                        metrics::counter!(metrics_names::RECONNECTS, metrics_names::LABEL_QUEUE => config.queue.clone())
                            .increment(1);
                        status.set(WorkerState::Reconnecting);
                    }
                }
                false
            }
            Ok(Err(e)) if e.is_fatal() => return Err(e),
            Ok(Err(e)) => {
                warn!(queue = %config.queue, broker = %url, round = failures + 1, error = %e, "cannot connect and consume");
                true
            }
            Err(_elapsed) => {
                warn!(queue = %config.queue, broker = %url, round = failures + 1, timeout = ?CONNECT_TIMEOUT, "connect attempt timed out");
                true
            }
        };
        if failed {
            url_index = (url_index + 1) % config.urls.len();
            tried += 1;
            if tried < config.urls.len() {
                // Another node may answer right away: no pause within a round.
                continue;
            }
            tried = 0;
            failures = failures.saturating_add(1);
        }
        let backoff = &config.reconnect_backoff;
        let d = config.reconnect_jitter.apply(
            backoff.delay(failures.saturating_sub(1)),
            prev_delay,
            backoff.base(),
            backoff.cap(),
            &mut rng,
        );
        prev_delay = Some(d);
        tracing::debug!(queue = %config.queue, delay = ?d, "waiting before reconnecting");
        tokio::select! {
            _ = token.cancelled() => break,
            _ = tokio::time::sleep(d) => {}
        }
    }
    // Stopped while not connected: handlers of a lost connection may still be running.
    status.set(WorkerState::Draining);
    shared.drain_tasks().await;
    Ok(())
}

/// Cancels `token` on SIGINT or (on Unix) SIGTERM. Handlers are installed before returning, so
/// a signal arriving right after cannot be missed.
fn spawn_signal_canceller(
    token: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, WorkerError> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(WorkerError::Signal)?;
    Ok(tokio::spawn(async move {
        #[cfg(unix)]
        let name = tokio::select! {
            r = tokio::signal::ctrl_c() => match r {
                Ok(()) => "SIGINT",
                Err(e) => {
                    // Without Ctrl-C support SIGTERM still works; keep waiting for it.
                    warn!(error = %e, "cannot listen for Ctrl-C");
                    term.recv().await;
                    "SIGTERM"
                }
            },
            _ = term.recv() => "SIGTERM",
        };
        #[cfg(not(unix))]
        let name = match tokio::signal::ctrl_c().await {
            Ok(()) => "Ctrl-C",
            Err(e) => {
                warn!(error = %e, "cannot listen for Ctrl-C");
                std::future::pending::<()>().await;
                "none"
            }
        };
        info!(signal = name, "shutdown requested");
        token.cancel();
    }))
}

/// Runs several workers (several queues, one process) until `token` is cancelled. If one stops
/// with an error the others are shut down gracefully and the first error is returned.
///
/// ```no_run
/// use redeliver_worker::{run_all, Context, HandlerError, Json, Raw, Worker};
/// # async fn demo(token: tokio_util::sync::CancellationToken) -> Result<(), redeliver_worker::WorkerError> {
/// let url = "amqp://127.0.0.1:5672/%2f";
/// let images = Worker::builder(url)
///     .queue("images")
///     .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
///     .build()?;
/// let emails = Worker::builder(url)
///     .queue("emails")
///     .handler(|_m: Json<serde_json::Value>, _c: Context| async move { Ok::<(), HandlerError>(()) })
///     .build()?;
/// run_all([images, emails], token).await
/// # }
/// ```
pub async fn run_all(
    workers: impl IntoIterator<Item = Worker>,
    token: CancellationToken,
) -> Result<(), WorkerError> {
    // Our own child token, so stopping the others after a failure leaves the caller's untouched.
    let group = token.child_token();
    let mut set = tokio::task::JoinSet::new();
    for w in workers {
        set.spawn(w.run(group.child_token()));
    }
    let mut first_error = None;
    while let Some(joined) = set.join_next().await {
        let result = match joined {
            Ok(r) => r,
            Err(e) => Err(WorkerError::Task(e.to_string())),
        };
        if let Err(e) = result {
            if first_error.is_none() {
                group.cancel();
                first_error = Some(e);
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// [`run_all`] until SIGTERM or SIGINT.
pub async fn run_all_until_signal(
    workers: impl IntoIterator<Item = Worker>,
) -> Result<(), WorkerError> {
    let token = CancellationToken::new();
    let signals = spawn_signal_canceller(token.clone())?;
    let result = run_all(workers, token).await;
    signals.abort();
    result
}
