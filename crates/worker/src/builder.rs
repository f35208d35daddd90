//! Configuring a worker: [`WorkerBuilder`], its validation, and [`Worker::builder`].

use std::sync::Arc;

use redeliver_amqp::url::BrokerUrl;
use redeliver_amqp::DelayConfig;
use redeliver_amqp::TlsConfig;
use redeliver_amqp::Topology;
use redeliver_core::{Backoff, Jitter, RetryPolicy};
use tracing::warn;

use crate::error::{SettingError, WorkerError};
use crate::handler::{Erased, ErasedHandler, FromDelivery, Handler};
use crate::runtime::Worker;
use crate::settings::{Resolved, Settings};
use crate::status::StatusSender;

type TopologyMap = Box<dyn FnOnce(Topology) -> Topology + Send>;

/// Configures a [`Worker`]. Start with [`Worker::builder`] (or
/// [`WorkerBuilder::from_env`](crate::WorkerBuilder::from_env)).
///
/// Required: a queue ([`queue`](Self::queue) or [`topology`](Self::topology)) and a handler
/// ([`handler`](Self::handler) or [`handler`](Self::handler)).
///
/// # Defaults
///
/// Every setting, its default and its environment variable (the hand-written rows first):
///
#[doc = crate::settings::builder_table!()]
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
    ///     .build()?
    ///     .run(redeliver::shutdown_on_signal()?)
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
    ///     .build()?
    ///     .run(redeliver::shutdown_on_signal()?)
    ///     .await
    /// # }
    /// ```
    pub fn map_topology(mut self, f: impl FnOnce(Topology) -> Topology + Send + 'static) -> Self {
        self.topology_maps.push(Box::new(f));
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

    /// The handler: a closure `|msg: M, ctx: Context| async move { ... }` returning
    /// `Result<(), HandlerError>`, or a value implementing [`Handler`] (a struct holding pools
    /// and clients; closures implement it too). `M` is any [`FromDelivery`] type
    /// ([`Json<T>`](crate::Json), [`Raw`](crate::Raw), [`Text`](crate::Text)); a closure names it,
    /// and the [`Context`](crate::Context), in its arguments' types. A body that does not decode
    /// as `M` is dead-lettered without calling the handler.
    ///
    /// The worker polls a handler's future once itself before making it a task (a handler that
    /// completes without waiting costs no task then), so CPU-heavy work before the first
    /// `.await` delays the intake of the next delivery: move such work to
    /// `tokio::task::spawn_blocking`, as in any async code.
    pub fn handler<M, H>(mut self, handler: H) -> Self
    where
        M: FromDelivery,
        H: Handler<M>,
    {
        self.handler = Some(Arc::new(Erased::<H, M>::new(handler)));
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
        settings.check_simple()?;
        self.status.set_queue(queue.clone());
        let resolved = Resolved {
            settings,
            urls,
            topology,
            queue: Arc::from(queue),
            handler,
        };
        let (prefetch, concurrency) = (resolved.prefetch(), resolved.settings.concurrency);
        if usize::from(prefetch) < concurrency {
            warn!(
                queue = %resolved.queue,
                prefetch,
                concurrency,
                "prefetch below concurrency: at most `prefetch` handlers will run at once"
            );
        }
        Ok(Worker::new(resolved, self.status))
    }
}
