//! Why a worker stops.

use redeliver_amqp::url::UrlError;
use redeliver_amqp::ConnectError;
use redeliver_amqp::PublishError;
use redeliver_amqp::TopologyError;

/// Errors that stop a worker. Connection problems are not among them: the worker reconnects
/// (with backoff) until it is told to stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The builder was given something unusable.
    #[error("invalid worker configuration: {0}")]
    Config(#[from] SettingError),
    /// Declaring or verifying the topology failed for a reason reconnecting will not fix (an
    /// argument mismatch with an existing queue, a missing object in verify-only mode, access
    /// refused, an invalid name).
    #[error("topology: {0}")]
    Topology(#[from] TopologyError),
    /// The policy's [`Forward`](redeliver_core::Forward) destination does not exist, or could
    /// not be checked. Checked passively at every connection, before consuming: the worker
    /// declares its own topology, never another queue's. Not fatal: the worker stays unready
    /// and tries again with the reconnect backoff, so the destination's own worker (or an
    /// operator) may create it meanwhile, as in a rollout of both at once.
    #[error("forward destination {destination} is missing or cannot be checked (create it, or start the worker that declares it); the worker does not consume until it exists: {source}")]
    ForwardDestination {
        /// The destination as the policy names it.
        destination: String,
        /// What the broker answered.
        #[source]
        source: lapin::Error,
    },
    /// A broker operation failed (returned only where retrying makes no sense).
    #[error("AMQP: {0}")]
    Amqp(#[from] lapin::Error),
    /// The confirmed publisher could not be set up.
    #[error("publisher: {0}")]
    Publisher(#[from] PublishError),
    /// [`shutdown_on_signal`](crate::shutdown_on_signal) could not install its SIGTERM / SIGINT
    /// handlers, or was called outside a Tokio runtime.
    #[error("cannot install signal handler: {0}")]
    Signal(#[source] std::io::Error),
    /// A worker task of [`run_all`](crate::run_all) panicked or was cancelled.
    #[error("worker task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// Connecting failed: TLS settings, a refused certificate, an unreachable broker.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// [`RetryMode::Native`](crate::RetryMode::Native) was asked where it cannot work: fatal,
    /// since the queue would otherwise retry in a hot loop or not at all.
    #[error("retry mode `native` cannot work here: {0}; use `auto` (native where it works, the delay levels elsewhere) or `levels`")]
    RetryMode(String),
    /// The AMQP 1.0 consumer (native retry) could not be opened or failed.
    #[error("AMQP 1.0: {0}")]
    Amqp1(#[from] redeliver_amqp1::Error),
}

/// A setting that cannot work: reported by [`WorkerBuilder::build`](crate::WorkerBuilder::build)
/// before any connection, or an environment variable read into the settings.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingError {
    /// Neither [`queue`](crate::WorkerBuilder::queue) nor
    /// [`topology`](crate::WorkerBuilder::topology) was called.
    #[error("no queue: call .queue(name) or .topology(..)")]
    NoQueue,
    /// Neither [`handler`](crate::WorkerBuilder::handler) nor
    /// [`handler`](crate::WorkerBuilder::handler) was called.
    #[error("no handler: call .handler(..) or .handler(..)")]
    NoHandler,
    /// [`concurrency`](crate::WorkerBuilder::concurrency) out of range.
    #[error("concurrency must be between 1 and {max}, got {got}")]
    Concurrency {
        /// The value given.
        got: usize,
        /// The largest allowed.
        max: usize,
    },
    /// [`prefetch`](crate::WorkerBuilder::prefetch) of 0.
    #[error("prefetch must be at least 1 (0 would mean an unbounded buffer)")]
    Prefetch,
    /// A duration that must be positive was zero.
    #[error("{0} must be more than zero")]
    Zero(&'static str),
    /// The policy forwards to the worker's own queue: a forwarded message would come back
    /// without its retry state and be forwarded again for ever.
    #[error("the retry policy forwards to queue '{0}', the worker's own queue: forwarded messages would loop for ever; forward to another queue")]
    ForwardToItself(String),
    /// A broker URL that does not parse (its password is never in the text).
    #[error(transparent)]
    Url(#[from] UrlError),
    /// An environment variable with a value that cannot be used (from
    /// [`WorkerBuilder::env`](crate::WorkerBuilder::env)), when a service turns it into a
    /// [`WorkerError`] with `?`.
    #[error(transparent)]
    Env(#[from] EnvError),
}

/// A variable with a value that cannot be used. Converts into
/// [`SettingError::Env`](crate::SettingError::Env), the error of every other unusable setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {var}={value:?}: {reason}")]
pub struct EnvError {
    var: &'static str,
    value: String,
    reason: String,
}

impl EnvError {
    pub(crate) fn new(var: &'static str, value: &str, reason: impl Into<String>) -> Self {
        Self {
            var,
            value: value.to_owned(),
            reason: reason.into(),
        }
    }

    /// The variable's name.
    pub fn var(&self) -> &'static str {
        self.var
    }

    /// The value found (a URL's password is masked).
    pub fn value(&self) -> &str {
        &self.value
    }

    /// What was expected.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl From<EnvError> for WorkerError {
    fn from(e: EnvError) -> Self {
        WorkerError::Config(SettingError::Env(e))
    }
}

impl WorkerError {
    /// True when reconnecting cannot help, so `run` returns the error instead of retrying.
    pub(crate) fn is_fatal(&self) -> bool {
        match self {
            WorkerError::Topology(TopologyError::Amqp(_)) => false,
            WorkerError::Topology(_) | WorkerError::Config(_) | WorkerError::Signal(_) => true,
            // Its own worker, started at the same time, may be about to declare it.
            WorkerError::ForwardDestination { .. } => false,
            WorkerError::Amqp(_) | WorkerError::Publisher(_) | WorkerError::Task(_) => false,
            // Unusable settings are fatal; a refused certificate or an unreachable broker may be
            // fixed on the other side (a renewed certificate, a DNS change) while we retry.
            WorkerError::Connect(ConnectError::Url(_) | ConnectError::Tls(_)) => true,
            WorkerError::Connect(_) => false,
            WorkerError::RetryMode(_) => true,
            WorkerError::Amqp1(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_that_forwards_to_the_workers_own_queue_is_refused_at_build() {
        use redeliver_core::{Forward, HandlerError, RetryPolicy};
        let build = |to: &str| {
            crate::Worker::builder("amqp://127.0.0.1:5672/%2f")
                .queue("images")
                .prefix("eu-")
                .policy(RetryPolicy::default().forward(Forward::to_queue(to)))
                .handler(|_: crate::Raw, _| async { Ok::<(), HandlerError>(()) })
                .build()
        };
        match build("eu-images") {
            Err(WorkerError::Config(SettingError::ForwardToItself(q))) => {
                assert_eq!(q, "eu-images")
            }
            other => panic!("expected ForwardToItself, got {other:?}"),
        }
        assert!(build("eu-images.heavy").is_ok());
        // Without the prefix it is another queue.
        assert!(build("images").is_ok());
    }

    #[test]
    fn a_missing_forward_destination_says_what_to_do_and_is_waited_for() {
        let not_found = lapin::Error::from(lapin::ErrorKind::ProtocolError(
            lapin::protocol::AMQPError::new(
                lapin::protocol::AMQPSoftError::NOTFOUND.into(),
                "NOT_FOUND - no queue 'images.heavy' in vhost '/'".into(),
            ),
        ));
        let e = WorkerError::ForwardDestination {
            destination: "queue 'images.heavy'".into(),
            source: not_found,
        };
        let text = e.to_string();
        assert!(text.contains("queue 'images.heavy'"), "{text}");
        assert!(text.contains("NOT_FOUND"), "{text}");
        assert!(text.contains("create it"), "{text}");
        assert!(!e.is_fatal());
    }
}
