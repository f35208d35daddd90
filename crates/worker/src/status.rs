//! Readiness of a worker, observable from outside its task (health endpoints, tests).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::watch;

use crate::metrics_names;
use crate::settings::RetryMode;

/// Lifecycle state of one [`Worker`](crate::Worker).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerState {
    /// Built, `run` not called yet.
    Starting,
    /// First connection attempt (connect, declare or verify topology, consume).
    Connecting,
    /// Connected and consuming: the only ready state.
    Consuming,
    /// The connection or channel was lost; the worker is waiting out its backoff or reconnecting.
    Reconnecting,
    /// Shutdown requested: the consumer is cancelled, in-flight handlers are finishing.
    Draining,
    /// `run` returned.
    Stopped,
}

impl WorkerState {
    /// Every state, in the order a worker goes through them.
    pub const ALL: [WorkerState; 6] = [
        WorkerState::Starting,
        WorkerState::Connecting,
        WorkerState::Consuming,
        WorkerState::Reconnecting,
        WorkerState::Draining,
        WorkerState::Stopped,
    ];

    /// Lower-case name, for logs and health responses.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Starting => "starting",
            WorkerState::Connecting => "connecting",
            WorkerState::Consuming => "consuming",
            WorkerState::Reconnecting => "reconnecting",
            WorkerState::Draining => "draining",
            WorkerState::Stopped => "stopped",
        }
    }
}

impl fmt::Display for WorkerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Cloneable, read-only view of a worker's [`WorkerState`], for readiness probes.
///
/// Get one from [`Worker::status_handle`](crate::Worker::status_handle), after
/// [`build`](crate::WorkerBuilder::build) and before or while the worker runs.
///
/// ```no_run
/// # async fn demo() -> Result<(), redeliver::WorkerError> {
/// use redeliver::{Context, HandlerError, Raw, Worker};
/// let worker = Worker::builder("amqp://127.0.0.1:5672/%2f")
///     .queue("images")
///     .handler(|_msg: Raw, _ctx: Context| async move { Ok::<(), HandlerError>(()) })
///     .build()?;
/// let status = worker.status_handle();
/// tokio::spawn(async move {
///     // e.g. answer /readyz with 200 only while this is true
///     let _ready = status.is_ready();
/// });
/// worker.run(redeliver::shutdown_on_signal()?).await
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct WorkerStatus {
    rx: watch::Receiver<WorkerState>,
    queue: Arc<OnceLock<String>>,
    broker: Arc<AtomicUsize>,
    blocked: Arc<AtomicBool>,
    retries: Arc<RetryStatus>,
}

/// Where the current session's retries wait, and whether the broker was seen to ignore a native
/// retry's delivery time: the retry side of [`WorkerStatus`].
#[derive(Debug, Default)]
pub(crate) struct RetryStatus {
    /// 0 before the first session, 1 levels, 2 native.
    mode: std::sync::atomic::AtomicU8,
    ignored: AtomicBool,
    /// Native consumption is paused until then: the broker failed delivering a message over
    /// AMQP 1.0.
    paused_until: std::sync::Mutex<Option<std::time::Instant>>,
}

impl RetryStatus {
    pub(crate) fn set_mode(&self, mode: RetryMode) {
        let v = match mode {
            RetryMode::Native => 2,
            _ => 1,
        };
        self.mode.store(v, Ordering::Release);
    }

    /// The broker handed a native retry out before its time: retries go through the delay
    /// levels from now on (this worker's life), which the status and a metric say.
    pub(crate) fn set_ignored(&self, queue: &str) {
        if !self.ignored.swap(true, Ordering::AcqRel) {
            metrics::gauge!(metrics_names::NATIVE_RETRY_IGNORED, metrics_names::LABEL_QUEUE => queue.to_owned())
                .set(1.0);
        }
    }

    pub(crate) fn ignored(&self) -> bool {
        self.ignored.load(Ordering::Acquire)
    }

    /// Consume over AMQP 0-9-1 for `d`.
    pub(crate) fn pause_native(&self, d: Duration) {
        if let Ok(mut until) = self.paused_until.lock() {
            *until = Some(std::time::Instant::now() + d);
        }
    }

    /// Whether native consumption is paused now.
    pub(crate) fn native_paused(&self) -> bool {
        self.paused_until
            .lock()
            .ok()
            .and_then(|u| *u)
            .is_some_and(|u| std::time::Instant::now() < u)
    }
}

/// [`WorkerStatus::broker`] before the first connection.
const NO_BROKER: usize = usize::MAX;

impl WorkerStatus {
    /// The state right now.
    pub fn state(&self) -> WorkerState {
        *self.rx.borrow()
    }

    /// True only while the worker is connected and consuming (not while connecting, reconnecting
    /// or draining) and the broker does not block its publishing connection: what a Kubernetes
    /// readiness probe should report.
    pub fn is_ready(&self) -> bool {
        self.state() == WorkerState::Consuming && !self.is_blocked()
    }

    /// True while the broker blocks the worker's publishing connection (a memory or disk alarm):
    /// deliveries that succeed are still acked, retries and annotated dead letters wait (at most
    /// the [confirm timeout](crate::WorkerBuilder::confirm_timeout), then their originals go back
    /// to the queue).
    pub fn is_blocked(&self) -> bool {
        self.blocked.load(Ordering::Acquire)
    }

    /// Full name of the queue this worker consumes (prefix included), for labelling; `None` until
    /// the worker is built (the builder may still change the queue).
    pub fn queue(&self) -> Option<&str> {
        self.queue.get().map(String::as_str)
    }

    /// Where retries wait in the current session: [`RetryMode::Levels`] or
    /// [`RetryMode::Native`] (what [`RetryMode::Auto`] chose); `None` before the first session.
    pub fn retry_mode(&self) -> Option<RetryMode> {
        match self.retries.mode.load(Ordering::Acquire) {
            1 => Some(RetryMode::Levels),
            2 => Some(RetryMode::Native),
            _ => None,
        }
    }

    /// True once the broker handed a native retry out before its delivery time (a classic
    /// queue, a node older than 4.3 behind the same address): the handler did not run early,
    /// and this worker's retries go through the delay levels from then on. Metric
    /// `redeliver_native_retry_ignored`.
    pub fn native_retry_ignored(&self) -> bool {
        self.retries.ignored()
    }

    /// Which URL the worker connected through last: 0 for the one given to
    /// [`Worker::builder`](crate::Worker::builder), `i` for the `i`-th of its
    /// [`failover_urls`](crate::WorkerBuilder::failover_urls). Set before the state turns
    /// [`Consuming`](WorkerState::Consuming), so a watcher woken by that change reads the new
    /// value; `None` until the first connection.
    pub fn broker(&self) -> Option<usize> {
        match self.broker.load(Ordering::Acquire) {
            NO_BROKER => None,
            i => Some(i),
        }
    }

    /// Waits until the state satisfies `pred` (checked on the current value first). Returns the
    /// matching state, or `None` if the worker was dropped before reaching it.
    pub async fn wait_for(
        &mut self,
        pred: impl FnMut(&WorkerState) -> bool,
    ) -> Option<WorkerState> {
        self.rx.wait_for(pred).await.ok().map(|s| *s)
    }

    /// Like [`wait_for`](Self::wait_for) with a time limit; `None` on timeout or drop.
    pub async fn wait_for_timeout(
        &mut self,
        timeout: Duration,
        pred: impl FnMut(&WorkerState) -> bool,
    ) -> Option<WorkerState> {
        tokio::time::timeout(timeout, self.wait_for(pred))
            .await
            .ok()
            .flatten()
    }

    /// Waits for the next change of state and returns it (`None` once the worker is dropped).
    pub async fn changed(&mut self) -> Option<WorkerState> {
        self.rx.changed().await.ok()?;
        Some(*self.rx.borrow_and_update())
    }
}

/// Write side, owned by the worker. Also keeps the connection-state gauge in step.
#[derive(Debug)]
pub(crate) struct StatusSender {
    tx: watch::Sender<WorkerState>,
    queue: Arc<OnceLock<String>>,
    broker: Arc<AtomicUsize>,
    blocked: Arc<AtomicBool>,
    pub(crate) retries: Arc<RetryStatus>,
}

/// The write side of [`WorkerStatus::is_blocked`], for the sessions of a running worker.
#[derive(Clone, Debug)]
pub(crate) struct BlockedFlag {
    blocked: Arc<AtomicBool>,
    queue: Arc<OnceLock<String>>,
}

impl BlockedFlag {
    pub(crate) fn set(&self, blocked: bool) {
        self.blocked.store(blocked, Ordering::Release);
        let queue = self.queue.get().cloned().unwrap_or_default();
        metrics::gauge!(metrics_names::CONNECTION_BLOCKED, metrics_names::LABEL_QUEUE => queue)
            .set(if blocked { 1.0 } else { 0.0 });
    }
}

impl StatusSender {
    pub(crate) fn new() -> Self {
        let (tx, _rx) = watch::channel(WorkerState::Starting);
        Self {
            tx,
            queue: Arc::new(OnceLock::new()),
            broker: Arc::new(AtomicUsize::new(NO_BROKER)),
            blocked: Arc::new(AtomicBool::new(false)),
            retries: Arc::default(),
        }
    }

    pub(crate) fn blocked_flag(&self) -> BlockedFlag {
        BlockedFlag {
            blocked: Arc::clone(&self.blocked),
            queue: Arc::clone(&self.queue),
        }
    }

    /// Fixes the queue name once the worker is built; later calls are ignored (a built worker
    /// never changes queue).
    pub(crate) fn set_queue(&self, queue: String) {
        let _ = self.queue.set(queue);
    }

    fn queue_label(&self) -> String {
        self.queue.get().cloned().unwrap_or_default()
    }

    pub(crate) fn handle(&self) -> WorkerStatus {
        WorkerStatus {
            rx: self.tx.subscribe(),
            queue: self.queue.clone(),
            broker: self.broker.clone(),
            blocked: self.blocked.clone(),
            retries: Arc::clone(&self.retries),
        }
    }

    /// Records the index of the URL the worker is connected through.
    pub(crate) fn set_broker(&self, index: usize) {
        self.broker.store(index, Ordering::Release);
    }

    pub(crate) fn set(&self, state: WorkerState) {
        // send_if_modified, not send: send fails when no receiver exists (nobody may be
        // watching), and watchers should wake only on a real change.
        // The gauge first: a watcher woken by the change must already read the new value.
        let queue = self.queue_label();
        for s in WorkerState::ALL {
            metrics::gauge!(
                metrics_names::CONNECTION_STATE,
                metrics_names::LABEL_QUEUE => queue.clone(),
                metrics_names::LABEL_STATE => s.as_str()
            )
            .set(if s == state { 1.0 } else { 0.0 });
        }
        let mut previous = state;
        self.tx.send_if_modified(|current| {
            previous = *current;
            *current = state;
            previous != state
        });
        if previous != state {
            tracing::debug!(queue = %self.queue_label(), from = %previous, to = %state, "worker state");
        }
    }
}
