//! What outlives one connection: the settings, the concurrency limit, the in-flight tasks and
//! the shutdown tokens belong to the worker, so handlers of a lost connection still count
//! against the limit and are awaited at shutdown.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::permits::Permits;
use crate::publishing::Pool;
use crate::requeue::RequeueLedger;
use crate::settings::Resolved;
use crate::status::BlockedFlag;

/// Time allowed, after the grace period, for abandoned handlers to unwind and for settling the
/// ones that just finished, before the channel is closed regardless.
const SETTLE_GRACE: Duration = Duration::from_secs(5);

pub(crate) struct Shared {
    pub(crate) config: Arc<Resolved>,
    pub(crate) permits: Arc<Permits>,
    pub(crate) tracker: TaskTracker,
    /// Cancelled when draining starts; handed to handlers as [`Context::shutdown_token`](crate::Context::shutdown_token).
    pub(crate) draining: Arc<CancellationToken>,
    /// Cancelled when the grace period is over: handlers still running are dropped unsettled.
    pub(crate) hard_stop: CancellationToken,
    /// The worker's own requeues per message, bounded by the requeue limit.
    pub(crate) requeues: Mutex<RequeueLedger>,
    /// [`WorkerStatus::is_blocked`](crate::WorkerStatus::is_blocked), set by the sessions.
    pub(crate) blocked: BlockedFlag,
    /// The publishing connections, shared with the other workers of a `run_all`.
    pub(crate) publishing: Pool,
    /// Where retries wait; [`WorkerStatus::retry_mode`](crate::WorkerStatus::retry_mode).
    pub(crate) retries: Arc<crate::status::RetryStatus>,
}

impl Shared {
    pub(crate) fn new(
        config: Arc<Resolved>,
        blocked: BlockedFlag,
        publishing: Pool,
        retries: Arc<crate::status::RetryStatus>,
    ) -> Self {
        Self {
            blocked,
            publishing,
            retries,
            permits: Permits::new(config.settings.concurrency),
            tracker: TaskTracker::new(),
            draining: Arc::default(),
            hard_stop: CancellationToken::new(),
            requeues: Mutex::default(),
            config,
        }
    }

    /// Waits for in-flight handlers up to the grace period, then drops the rest.
    pub(crate) async fn drain_tasks(&self) {
        self.draining.cancel();
        self.tracker.close();
        if self.tracker.is_empty() {
            return;
        }
        let grace = self.config.settings.shutdown_grace;
        info!(
            queue = %self.config.queue,
            in_flight = self.tracker.len(),
            grace = %humantime::format_duration(grace),
            "waiting for in-flight handlers"
        );
        if tokio::time::timeout(grace, self.tracker.wait())
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
