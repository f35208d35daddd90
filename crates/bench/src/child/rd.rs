//! The redeliver side: a `Worker` whose handler does the same as the raw consumer's loop.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use redeliver_amqp::Topology;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_worker::{Context, Json, Worker};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{delay_config, ChildArgs, Probe};
use crate::config::RETRY_DELAY;
use crate::payload::PayloadIn;

pub async fn start(
    url: &str,
    args: &ChildArgs,
    probe: Arc<Probe>,
    cancel: CancellationToken,
) -> Result<JoinHandle<Result<()>>> {
    let delay = delay_config(&args.prefix, args.delay_levels);
    let prefix = args.prefix.clone();
    let queue_type = args.queue_type.amqp();
    // Scenario 2's failures go through the policy (a transient error, constant 10 ms backoff);
    // scenarios 3 and 4 ask for an exact delay with `retry_after`.
    let policy = RetryPolicy::constant(RETRY_DELAY)
        .jitter(Jitter::None)
        .max_retries(3);
    // The same topology the parent declared for this queue.
    let topology = Topology::new(args.queue.clone())
        .prefix(prefix)
        .queue_type(queue_type)
        .delay(delay);
    let builder = Worker::builder(url)
        .tls(crate::broker::tls_from_env())
        .topology(topology)
        .policy(policy)
        .prefetch(args.prefetch)
        .concurrency(args.concurrency)
        .handler(move |msg: Json<PayloadIn>, ctx: Context| {
            let probe = probe.clone();
            async move {
                match msg.retry_ms {
                    Some(ms) if ctx.attempt() == 0 => {
                        probe.on_fail(&msg);
                        let d = Duration::from_millis(u64::from(ms));
                        if d == RETRY_DELAY {
                            Err(HandlerError::transient("bench: fails once"))
                        } else {
                            Err(ctx.retry_after(d, "bench: fails once"))
                        }
                    }
                    _ => {
                        // Scenario 6 holds the delivery (and `ctx`, which shares it) here.
                        probe.hold().await;
                        probe.on_ok(&msg);
                        drop(ctx);
                        Ok(())
                    }
                }
            }
        });
    let status = builder.status_handle();
    let worker = builder.build().context("building the worker")?;
    let handle = tokio::spawn(async move {
        worker.run(cancel).await.context("worker")?;
        Ok::<(), anyhow::Error>(())
    });
    // Consuming before the parent starts the clock.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !status.is_ready() {
        if handle.is_finished() {
            return match handle.await {
                Ok(Err(e)) => Err(e.context("the worker stopped before consuming")),
                Ok(Ok(())) => bail!("the worker stopped before consuming"),
                Err(e) => bail!("the worker task panicked: {e}"),
            };
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the worker did not start consuming within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(handle)
}
