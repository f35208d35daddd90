//! An image-processing worker on redeliver, the file to start a service from.
//!
//! It consumes `images`, retries a failed fetch with exponential backoff and full jitter in the
//! broker's delay queues, and dead-letters to `images.dlq` what cannot succeed: a malformed body
//! or a bad request at once, a fetch still failing after 3 retries then. The handler is in
//! `image_processing/job.rs`; its image server is simulated and fails about half the fetches.
//!
//! ```text
//! REDELIVER_HEALTH_ADDR=127.0.0.1:8080 cargo run --example image_processing
//! cargo run --example publish -- --count 20 --fail-rate 0.5 --poison 2   # in another terminal
//! ```
//!
//! Configured from the environment: `AMQP_URL`, `REDELIVER_QUEUE`, `REDELIVER_PREFETCH`,
//! `REDELIVER_CONCURRENCY`, `REDELIVER_HEALTH_ADDR`, `REDELIVER_GRACE_PERIOD`,
//! `REDELIVER_LOG_FORMAT` (json|pretty), `RUST_LOG` and the other `REDELIVER_*` variables.
//!
//! The health server starts first: while no broker answers (at start-up, or during an outage)
//! `/livez` says 200 and `/readyz` 503, and the worker keeps trying every URL of `AMQP_URL`
//! with backoff instead of exiting, so a broker outage during a rollout is no CrashLoopBackOff.

#[path = "image_processing/job.rs"]
mod job;

use std::time::Duration;

use anyhow::anyhow;
use redeliver::worker::env::{LogFormat, ServiceConfig};
use redeliver::worker::health::{self, Health};
use redeliver::{CancellationToken, Context, Jitter, Json, RetryPolicy, Worker};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = ServiceConfig::from_env()?;
    init_logging(&cfg)?;
    let worker = Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
        .queue("images")
        .policy(
            RetryPolicy::exponential(Duration::from_secs(1))
                .cap(Duration::from_secs(60))
                .jitter(Jitter::Full)
                .max_retries(3),
        )
        // The code's defaults above; AMQP_URL and the REDELIVER_* variables win.
        .env()?
        .handler(
            |job: Json<job::ImageJob>, ctx: Context| async move { job::process(&job, &ctx).await },
        );

    let token = CancellationToken::new();
    let health = match cfg.health_addr {
        Some(addr) => {
            let server = Health::new()
                .worker(worker.status_handle())
                .metrics(health::install_prometheus()?)
                .bind(addr)
                .await?;
            tracing::info!(addr = %server.local_addr(), "health endpoints: /livez /readyz /metrics");
            Some(server.spawn(token.clone()))
        }
        None => None,
    };
    tracing::info!(settings = ?worker.settings(), "starting the image-processing worker");
    // Until SIGTERM or Ctrl-C, then the handlers in flight finish (the grace period).
    let result = worker.run_until_signal().await;
    // The health server outlives the drain, so probes see 503 while it happens.
    token.cancel();
    if let Some(health) = health {
        health.await??;
    }
    Ok(result?)
}

/// Logs to stderr, as JSON when `REDELIVER_LOG_FORMAT=json`, filtered by `RUST_LOG`: the
/// worker reads these settings but leaves installing a subscriber to the service.
fn init_logging(cfg: &ServiceConfig) -> anyhow::Result<()> {
    // Without RUST_LOG: our info lines, but not lapin's chatter.
    let directives = match std::env::var_os("RUST_LOG") {
        Some(_) => cfg.log_filter.clone(),
        None => format!("{},lapin=warn", cfg.log_filter),
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&directives)
        .map_err(|e| anyhow!("invalid RUST_LOG={directives:?}: {e}"))?;
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cfg.log_format {
        LogFormat::Json => fmt.json().try_init(),
        LogFormat::Pretty => fmt.try_init(),
    }
    .map_err(|e| anyhow!("cannot install the logger: {e}"))
}
