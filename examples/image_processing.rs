//! An image-processing worker on redeliver, the file to start a service from.
//!
//! It consumes `images`, retries a failed fetch with exponential backoff and full jitter in the
//! broker's delay queues, and dead-letters to `images.dlq` what cannot succeed: a malformed body
//! or a bad request at once, a fetch still failing after 3 retries then. The handler is in
//! `image_processing/job.rs`; its image server is simulated and fails about half the fetches.
//!
//! A job that runs past the 10 s time limit of `images` twice is forwarded to `images.heavy`
//! (Celery's pattern of sending a task that hits its time limit to a more powerful queue), which
//! a second worker of this process consumes with a limit twelve times longer. In a real
//! deployment that is a Deployment of its own, on bigger nodes; `images` does not consume until
//! `images.heavy` exists.
//!
//! ```text
//! REDELIVER_HEALTH_ADDR=127.0.0.1:8080 cargo run --example image_processing
//! cargo run --example publish -- --count 20 --fail-rate 0.5 --poison 2 --large 1   # elsewhere
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
#[path = "common/logging.rs"]
mod logging;

use std::time::Duration;

use redeliver::worker::env::ServiceSettings;
use redeliver::worker::health::{self, Health};
use redeliver::{
    run_all, CancellationToken, Classifier, Context, Forward, Jitter, Json, RetryMode, RetryPolicy,
    TimedOut, Worker, WorkerBuilder,
};

/// Time limit of one job on the standard queue; the heavy queue's is twelve times longer.
const TIME_LIMIT: Duration = Duration::from_secs(10);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = ServiceSettings::from_env()?;
    logging::init(&cfg, &["lapin"])?;
    let standard = builder()?;
    let settings = standard.settings().clone();
    let queue = settings.queue().unwrap_or("images").to_owned();
    let limit = settings.handler_timeout().unwrap_or(TIME_LIMIT);
    // The destination is named in full: the prefix applies to the worker's own topology only.
    let heavy = format!("{queue}.heavy");
    let heavy_full = format!("{}{heavy}", settings.prefix().unwrap_or_default());
    // Built on the policy the environment left, so REDELIVER_MAX_RETRIES and the like still
    // apply: timeouts are retried once here, then forwarded.
    let forwarding = settings
        .policy()
        .clone()
        .classifier(Classifier::default().forward_on::<TimedOut>())
        .forward(Forward::to_queue(heavy_full).after_attempts(2));
    let worker = standard.policy(forwarding).handler(process).build()?;
    let heavy_worker = builder()?
        .queue(heavy)
        .handler_timeout(limit * 12)
        .handler(process)
        .build()?;

    // The health server has a token of its own: it outlives the drain the signal starts.
    let token = CancellationToken::new();
    let health = match cfg.health_addr {
        Some(addr) => {
            let server = Health::new()
                .workers([worker.status_handle(), heavy_worker.status_handle()])
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
    let result = run_all([worker, heavy_worker], redeliver::shutdown_on_signal()?).await;
    // The health server outlives the drain, so probes see 503 while it happens.
    token.cancel();
    if let Some(health) = health {
        health.await??;
    }
    Ok(result?)
}

/// The code's defaults; AMQP_URL and the REDELIVER_* variables win.
fn builder() -> anyhow::Result<WorkerBuilder> {
    Ok(Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
        .queue("images")
        .policy(
            RetryPolicy::exponential(Duration::from_secs(1))
                .cap(Duration::from_secs(60))
                .jitter(Jitter::Full)
                .max_retries(3),
        )
        // On RabbitMQ 4.3+ the quorum queue holds each retry itself (no copy, no delay-level
        // hops, the jittered delay exact); elsewhere the delay levels do.
        .retry_mode(RetryMode::Auto)
        .handler_timeout(TIME_LIMIT)
        .env()?)
}

async fn process(job: Json<job::ImageJob>, ctx: Context) -> Result<(), redeliver::HandlerError> {
    job::process(&job, &ctx).await
}
