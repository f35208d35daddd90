//! The worker's settings: one type, written by the builder's methods and by the environment
//! layer ([`crate::env`]), read back through [`WorkerBuilder::settings`](crate::WorkerBuilder::settings).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redeliver_amqp::url::{self, BrokerUrl};
use redeliver_amqp::DelayConfig;
use redeliver_amqp::TlsConfig;
use redeliver_amqp::Topology;
use redeliver_core::{Backoff, Delays, Jitter, RetryPolicy};

use crate::handler::ErasedHandler;

/// Default number of requeues of one message before the worker dead-letters it.
const DEFAULT_REQUEUE_LIMIT: u32 = 10;

/// How the worker dead-letters a message that cannot succeed.
///
/// | | `Reject` (default) | `Annotate` |
/// |---|---|---|
/// | how | `basic.reject(requeue = false)`: the broker's DLX moves the message to `Q.dlq` | the worker publishes it to `Q.dlx` (routing key `Q`, mandatory, confirmed), then acks the original |
/// | what the DLQ copy says | `x-death` (reason `rejected`); a message retried before carries its last retry's error (`x-redeliver-last-error`) | `x-redeliver-dead-letter-reason`, `-error` (the final error and its sources, at most 4 KiB), `-attempts`, `x-redeliver-dead-lettered-at`, `-by` (the connection name), `x-redeliver-first-failed-at`; no `x-death` |
/// | the final error | in the log line, the metric's `reason` and the delivery's span | on the message too |
/// | cost | one frame | one confirmed publish per dead letter |
/// | if `Q.dlq` is missing | a quorum `Q` keeps the message (at-least-once); a classic one drops it | the publish comes back unroutable: the original is requeued (bounded by [`WorkerBuilder::requeue_limit`](crate::WorkerBuilder::requeue_limit), then rejected) |
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

/// Everything a [`WorkerBuilder`](crate::WorkerBuilder) holds, as its methods and the
/// environment set it. The defaults are listed once, on
/// [`WorkerBuilder`](crate::WorkerBuilder#defaults).
///
/// ```
/// use redeliver::Worker;
/// let builder = Worker::builder("amqp://127.0.0.1:5672/%2f").queue("images").prefetch(32);
/// assert_eq!(builder.settings().queue(), Some("images"));
/// assert_eq!(builder.settings().prefetch(), Some(32));
/// assert_eq!(builder.settings().concurrency(), 10);
/// ```
#[derive(Clone)]
pub struct Settings {
    pub(crate) url: String,
    pub(crate) failover_urls: Vec<String>,
    pub(crate) queue: Option<String>,
    pub(crate) topology: Option<Topology>,
    pub(crate) prefix: Option<String>,
    pub(crate) delay: Option<DelayConfig>,
    pub(crate) policy: RetryPolicy,
    pub(crate) prefetch: Option<u16>,
    pub(crate) concurrency: usize,
    pub(crate) verify_only: bool,
    pub(crate) handler_timeout: Option<Duration>,
    pub(crate) shutdown_grace: Duration,
    pub(crate) connection_name: Option<String>,
    pub(crate) reconnect_backoff: Backoff,
    pub(crate) reconnect_jitter: Jitter,
    pub(crate) requeue_limit: u32,
    pub(crate) max_message_size: Option<usize>,
    pub(crate) confirm_timeout: Duration,
    pub(crate) topology_check_interval: Duration,
    pub(crate) tls: TlsConfig,
    pub(crate) dead_letter_mode: DeadLetterMode,
}

impl Settings {
    pub(crate) fn new(url: String) -> Self {
        Self {
            url,
            failover_urls: Vec::new(),
            queue: None,
            topology: None,
            prefix: None,
            delay: None,
            policy: RetryPolicy::exponential(Duration::from_secs(1)),
            prefetch: None,
            concurrency: 10,
            verify_only: false,
            handler_timeout: None,
            // Below Kubernetes' default `terminationGracePeriodSeconds` (30 s), so settling and
            // closing fit before the pod is killed.
            shutdown_grace: Duration::from_secs(25),
            connection_name: None,
            reconnect_backoff: Backoff::Exponential {
                base: Duration::from_millis(100),
                factor: 2.0,
                cap: Duration::from_secs(30),
            },
            reconnect_jitter: Jitter::Full,
            requeue_limit: DEFAULT_REQUEUE_LIMIT,
            max_message_size: None,
            confirm_timeout: Duration::from_secs(30),
            topology_check_interval: Duration::from_secs(30),
            tls: TlsConfig::new(),
            dead_letter_mode: DeadLetterMode::Reject,
        }
    }

    /// The first broker URL (it may hold a password: log [`Settings`]' `Debug`, which masks it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URLs tried after [`url`](Self::url).
    pub fn failover_urls(&self) -> &[String] {
        &self.failover_urls
    }

    /// The queue given to [`queue`](crate::WorkerBuilder::queue), if any.
    pub fn queue(&self) -> Option<&str> {
        self.queue.as_deref()
    }

    /// The topology given to [`topology`](crate::WorkerBuilder::topology), if any.
    pub fn topology(&self) -> Option<&Topology> {
        self.topology.as_ref()
    }

    /// The name prefix given to [`prefix`](crate::WorkerBuilder::prefix), if any.
    pub fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }

    /// The delay settings given to [`delay`](crate::WorkerBuilder::delay), if any.
    pub fn delay(&self) -> Option<&DelayConfig> {
        self.delay.as_ref()
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The prefetch, if set (otherwise twice the concurrency, at most 65535).
    pub fn prefetch(&self) -> Option<u16> {
        self.prefetch
    }

    /// Handlers allowed to run at once.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// Whether the topology is only verified, not declared.
    pub fn verify_only(&self) -> bool {
        self.verify_only
    }

    /// The per-message handler time limit, if any.
    pub fn handler_timeout(&self) -> Option<Duration> {
        self.handler_timeout
    }

    /// How long shutdown waits for in-flight handlers.
    pub fn shutdown_grace(&self) -> Duration {
        self.shutdown_grace
    }

    /// The connection name, if set (otherwise `redeliver-worker:<queue>`).
    pub fn connection_name(&self) -> Option<&str> {
        self.connection_name.as_deref()
    }

    /// Pacing of reconnect attempts.
    pub fn reconnect_backoff(&self) -> (&Backoff, Jitter) {
        (&self.reconnect_backoff, self.reconnect_jitter)
    }

    /// The pauses of the reconnect loop: [`reconnect_backoff`](Self::reconnect_backoff) as an
    /// iterator of delays.
    pub(crate) fn reconnect_delays(&self) -> Delays {
        self.reconnect_backoff.delays(self.reconnect_jitter)
    }

    /// Requeues of one message before it is dead-lettered instead.
    pub fn requeue_limit(&self) -> u32 {
        self.requeue_limit
    }

    /// The largest body the worker publishes, if set (otherwise the broker version's default).
    pub fn max_message_size(&self) -> Option<usize> {
        self.max_message_size
    }

    /// How long a copy's publish may wait for the broker's confirm.
    pub fn confirm_timeout(&self) -> Duration {
        self.confirm_timeout
    }

    /// How often the running worker checks the delay infrastructure.
    pub fn topology_check_interval(&self) -> Duration {
        self.topology_check_interval
    }

    /// TLS settings for `amqps://` URLs.
    pub fn tls(&self) -> &TlsConfig {
        &self.tls
    }

    /// How messages that cannot succeed reach the DLQ.
    pub fn dead_letter_mode(&self) -> DeadLetterMode {
        self.dead_letter_mode
    }
}

impl fmt::Debug for Settings {
    // By hand, so that logging the settings never prints the broker password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("url", &url::redact(&self.url))
            .field(
                "failover_urls",
                &self
                    .failover_urls
                    .iter()
                    .map(|u| url::redact(u))
                    .collect::<Vec<_>>(),
            )
            .field("queue", &self.queue)
            .field("topology", &self.topology)
            .field("prefix", &self.prefix)
            .field("delay", &self.delay)
            .field("policy", &self.policy)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("verify_only", &self.verify_only)
            .field("handler_timeout", &self.handler_timeout)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("connection_name", &self.connection_name)
            .field("reconnect_backoff", &self.reconnect_backoff)
            .field("reconnect_jitter", &self.reconnect_jitter)
            .field("requeue_limit", &self.requeue_limit)
            .field("max_message_size", &self.max_message_size)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("topology_check_interval", &self.topology_check_interval)
            .field("tls", &self.tls)
            .field("dead_letter_mode", &self.dead_letter_mode)
            .finish()
    }
}

/// What [`WorkerBuilder::build`](crate::WorkerBuilder::build) made of the settings: URLs parsed,
/// the final topology, the resolved defaults. Shared by the worker's sessions and deliveries.
pub(crate) struct Resolved {
    pub(crate) settings: Settings,
    /// The first URL, then the failover URLs; never empty.
    pub(crate) urls: Vec<BrokerUrl>,
    pub(crate) topology: Topology,
    pub(crate) queue: String,
    pub(crate) prefetch: u16,
    pub(crate) connection_name: String,
    pub(crate) handler: Arc<dyn ErasedHandler>,
}
