//! A built worker at run time: the reconnect loop around sessions, [`run_all`].

use std::sync::Arc;
use std::time::Duration;

use redeliver_amqp::Topology;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::error::WorkerError;
use crate::metrics_names;
use crate::publishing::Pool;
use crate::session::{Session, SessionEnd};
use crate::settings::{Resolved, Settings};
use crate::shared::Shared;
use crate::status::{StatusSender, WorkerState, WorkerStatus};

/// Upper bound on one connection attempt (TCP + AMQP handshake + topology + consume), so a
/// black-holed broker address cannot hang the reconnect loop.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// A consumer of one queue: connects, declares (or verifies) the topology, consumes with bounded
/// concurrency, settles every delivery (see the [crate] docs), reconnects when the connection drops
/// and drains on shutdown.
///
/// ```no_run
/// use std::time::Duration;
/// use redeliver::{Context, HandlerError, Json, RetryPolicy, Worker};
///
/// #[derive(serde::Deserialize)]
/// struct ImageJob { url: String }
///
/// #[tokio::main]
/// async fn main() -> Result<(), redeliver::WorkerError> {
///     Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
///         .queue("images")
///         .policy(RetryPolicy::exponential(Duration::from_millis(500)).max_retries(5))
///         .prefetch(64)
///         .concurrency(16)
///         .handler(|job: Json<ImageJob>, ctx: Context| async move {
///             tracing::info!(url = %job.url, attempt = ctx.attempt(), "processing");
///             Ok::<(), HandlerError>(())
///         })
///         .build()?
///         .run(redeliver::shutdown_on_signal()?)
///         .await
/// }
/// ```
pub struct Worker {
    config: Arc<Resolved>,
    status: StatusSender,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queue", &self.config.queue)
            .field("prefetch", &self.config.prefetch())
            .field("concurrency", &self.config.settings.concurrency)
            .field("state", &self.status.handle().state())
            .finish_non_exhaustive()
    }
}

impl Worker {
    pub(crate) fn new(config: Resolved, status: StatusSender) -> Self {
        Self {
            config: Arc::new(config),
            status,
        }
    }

    /// What its deliveries share, as a run would make it, without a broker: for the tests of
    /// whole deliveries.
    #[cfg(test)]
    pub(crate) fn shared(&self) -> Arc<Shared> {
        Arc::new(Shared::new(
            Arc::clone(&self.config),
            self.status.blocked_flag(),
            Pool::default(),
            Arc::clone(&self.status.retries),
        ))
    }

    /// The settings it was built with.
    pub fn settings(&self) -> &Settings {
        &self.config.settings
    }

    /// A readiness handle, usable before the worker runs: give it to a health server started
    /// first, which then answers 503 until the worker consumes.
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

    /// Runs until `token` is cancelled, then shuts down gracefully: the consumer is cancelled,
    /// in-flight handlers get the grace period to finish and are settled, channel and connection
    /// are closed; messages not finished go back to the queue through the broker. Returns
    /// `Ok(())` on a clean stop; an error only for what reconnecting cannot fix (see
    /// [`WorkerError`]).
    pub async fn run(self, token: CancellationToken) -> Result<(), WorkerError> {
        self.run_with(Pool::default(), token).await
    }

    /// [`run`](Self::run), sharing the publishing connections of `publishing`.
    async fn run_with(self, publishing: Pool, token: CancellationToken) -> Result<(), WorkerError> {
        let shared = Arc::new(Shared::new(
            Arc::clone(&self.config),
            self.status.blocked_flag(),
            publishing,
            Arc::clone(&self.status.retries),
        ));
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
    // The pauses between rounds, reset once a session consumed.
    let mut delays = config.settings.reconnect_delays();
    let mut failed_rounds: u32 = 0;
    let mut ever_consumed = false;
    // Round robin over the URLs; `tried` counts the failures since the last pause, so a pause
    // comes only after every URL failed once, and `failed_rounds` counts such rounds (for the
    // logs).
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
                    info!(queue = %config.queue, broker = %url, after_failed_rounds = failed_rounds, "connection recovered; consuming again");
                    metrics::counter!(metrics_names::RECONNECTS, metrics_names::LABEL_QUEUE => Arc::clone(&config.queue))
                        .increment(1);
                } else {
                    info!(
                        queue = %config.queue,
                        broker = %url,
                        prefetch = config.prefetch(),
                        concurrency = config.settings.concurrency,
                        "consuming"
                    );
                }
                failed_rounds = 0;
                tried = 0;
                delays.reset();
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
                        status.set(WorkerState::Reconnecting);
                    }
                }
                false
            }
            Ok(Err(e)) if e.is_fatal() => return Err(e),
            Ok(Err(e)) => {
                warn!(queue = %config.queue, broker = %url, round = failed_rounds + 1, error = %e, "cannot connect and consume");
                true
            }
            Err(_elapsed) => {
                warn!(queue = %config.queue, broker = %url, round = failed_rounds + 1, timeout = ?CONNECT_TIMEOUT, "connect attempt timed out");
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
            failed_rounds = failed_rounds.saturating_add(1);
        }
        let d = delays.next_delay();
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

/// Runs several workers (several queues, one process) until `token` is cancelled. If one stops
/// with an error the others are shut down gracefully and the first error is returned.
///
/// ```no_run
/// use redeliver::{run_all, Context, HandlerError, Json, Raw, Worker};
/// # async fn demo(token: redeliver::CancellationToken) -> Result<(), redeliver::WorkerError> {
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
    // One publishing connection per broker for all of them.
    let publishing = Pool::default();
    for w in workers {
        set.spawn(w.run_with(publishing.clone(), group.child_token()));
    }
    let mut first_error = None;
    while let Some(joined) = set.join_next().await {
        let result = match joined {
            Ok(r) => r,
            Err(e) => Err(WorkerError::Task(e)),
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
