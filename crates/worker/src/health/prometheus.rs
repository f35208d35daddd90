//! The Prometheus recorder: redeliver's histogram buckets, one process-wide installation, and the
//! `# HELP` text of every worker metric.

use std::sync::Mutex;
use std::time::Duration;

use metrics::Unit;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::HealthError;
use crate::metrics_names as m;

/// How often [`install_prometheus`]'s background thread runs the recorder's upkeep (drains
/// histogram samples into buckets, so memory stays bounded even if nobody scrapes).
const UPKEEP_PERIOD: Duration = Duration::from_secs(5);

/// Bucket upper bounds (seconds) of [`HANDLER_DURATION`](crate::metrics_names::HANDLER_DURATION): from
/// 1 ms to 5 min, dense where handlers usually are (10 ms to 10 s).
pub const HANDLER_DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// A [`PrometheusBuilder`] with redeliver's histogram buckets for
/// [`HANDLER_DURATION`](crate::metrics_names::HANDLER_DURATION) (without buckets the exporter renders
/// histograms as summaries, which cannot be aggregated across pods). For services that compose
/// recorders; most use [`install_prometheus`].
#[allow(
    clippy::expect_used,
    reason = "set_buckets_for_metric fails only for an empty slice, and the constant is not empty"
)]
pub fn prometheus_builder() -> PrometheusBuilder {
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(m::HANDLER_DURATION.to_owned()),
            HANDLER_DURATION_BUCKETS,
        )
        .expect("HANDLER_DURATION_BUCKETS is not empty")
}

static INSTALLED: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// Installs the Prometheus recorder as the process-wide `metrics` recorder and returns a handle
/// to render it (pass it to [`Health::metrics`](super::Health::metrics)). Idempotent: the first call installs, later
/// calls return the same handle.
///
/// Also describes every worker metric (the `# HELP` lines) and starts a background thread that
/// runs the recorder's upkeep every few seconds. Works inside or outside a Tokio runtime.
///
/// # Errors
///
/// [`HealthError::RecorderInstalled`] when some other recorder was installed first.
pub fn install_prometheus() -> Result<PrometheusHandle, HealthError> {
    // A poisoned lock only means a panic elsewhere while holding it; the Option is still valid.
    let mut installed = INSTALLED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(handle) = installed.as_ref() {
        return Ok(handle.clone());
    }
    let recorder = prometheus_builder().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|_| HealthError::RecorderInstalled)?;
    describe_worker_metrics();
    let upkeep = handle.clone();
    // A plain thread, not a Tokio task: the recorder outlives any runtime it was installed from.
    let spawned = std::thread::Builder::new()
        .name("redeliver-metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_PERIOD);
            upkeep.run_upkeep();
        });
    if let Err(e) = spawned {
        // Rendering also drains histograms, so scrapes keep working; only unscraped memory grows.
        tracing::warn!(error = %e, "cannot start the metrics upkeep thread");
    }
    *installed = Some(handle.clone());
    Ok(handle)
}

/// `# HELP` text for the worker's metrics (a no-op without a recorder).
fn describe_worker_metrics() {
    metrics::describe_counter!(
        m::MESSAGES_RECEIVED,
        "Deliveries taken from the queue, redeliveries included."
    );
    metrics::describe_counter!(
        m::MESSAGES_SUCCEEDED,
        "Deliveries whose handler succeeded and whose ack was sent to the broker."
    );
    metrics::describe_counter!(
        m::MESSAGES_RETRIED,
        "Retry copies published and confirmed into the delay levels, by attempt (1 = first retry)."
    );
    metrics::describe_counter!(
        m::MESSAGES_DEAD_LETTERED,
        "Deliveries rejected to the dead-letter queue, by reason."
    );
    metrics::describe_counter!(
        m::MESSAGES_FORWARDED,
        "Deliveries sent on to the policy's forward destination (copy confirmed, original acked), by destination."
    );
    metrics::describe_counter!(
        m::MESSAGES_REQUEUED,
        "Deliveries given back to their queue because the copy that was to replace them was not confirmed, by reason."
    );
    metrics::describe_counter!(
        m::MESSAGES_SANITIZED,
        "Deliveries republished without their malformed x-death header (it crashes the broker's dead-lettering)."
    );
    metrics::describe_counter!(
        m::SETTLE_FAILURES,
        "Acks, nacks or rejects that did not reach the broker (the message will be redelivered)."
    );
    metrics::describe_histogram!(
        m::HANDLER_DURATION,
        Unit::Seconds,
        "Wall time of one handler call (decoding excluded)."
    );
    metrics::describe_gauge!(m::HANDLERS_IN_FLIGHT, "Handlers running right now.");
    metrics::describe_gauge!(
        m::CONNECTION_STATE,
        "Worker connection state: 0 disconnected, 1 connecting or reconnecting, 2 consuming, 3 draining."
    );
    metrics::describe_counter!(m::RECONNECTS, "Connections re-established after a loss.");
    metrics::describe_gauge!(
        m::CONNECTION_BLOCKED,
        "1 while the broker blocks the publishing connection (resource alarm)."
    );
    metrics::describe_gauge!(
        m::DELAY_UNROUTABLE_MESSAGES,
        "Messages parked in the delay infrastructure's unroutable queue."
    );
}
