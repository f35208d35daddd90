//! The redeliver side: a `Worker` whose handler does the same as the raw consumer's loop.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use redeliver_amqp::Topology;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_postgres::{Inbox, Schema, Tx};
use redeliver_worker::{Context, Handler, Json, Raw, Worker, WorkerBuilder};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{delay_config, ChildArgs, Probe};
use crate::config::RETRY_DELAY;
use crate::payload::PayloadIn;

/// The worker with everything but its handler, the same for every scenario.
fn builder(url: &str, args: &ChildArgs) -> WorkerBuilder {
    let delay = delay_config(&args.prefix, args.delay_levels);
    // Scenario 2's failures go through the policy (a transient error, constant 10 ms backoff);
    // scenarios 3 and 4 ask for an exact delay with `retry_after`.
    // Scenario 11 uses the jittered policy instead.
    let policy = if args.jittered {
        super::jittered_policy()
    } else {
        RetryPolicy::constant(RETRY_DELAY)
            .jitter(Jitter::None)
            .max_retries(3)
    };
    // The same topology the parent declared for this queue.
    let topology = Topology::new(args.queue.clone())
        .prefix(args.prefix.clone())
        .queue_type(args.queue_type.amqp())
        .delay(delay);
    let builder = Worker::builder(url)
        .tls(crate::broker::tls_from_env())
        .topology(topology)
        .policy(policy)
        .prefetch(args.prefetch)
        .concurrency(args.concurrency);
    match args.retry_mode {
        Some(mode) => builder.retry_mode(mode.worker()),
        None => builder,
    }
}

pub async fn start(
    url: &str,
    args: &ChildArgs,
    probe: Arc<Probe>,
    cancel: CancellationToken,
) -> Result<JoinHandle<Result<()>>> {
    let jittered = args.jittered;
    let builder = builder(url, args).handler(move |msg: Json<PayloadIn>, ctx: Context| {
        let probe = probe.clone();
        async move {
            match msg.retry_ms {
                // Scenario 11: the policy draws the delay; the retry says which it was.
                Some(_) if jittered => {
                    if ctx.attempt() == 0 {
                        probe.on_fail(&msg);
                        return Err(HandlerError::transient("bench: fails once"));
                    }
                    let state = redeliver_amqp::headers::RetryState::read(ctx.headers());
                    let asked = ctx.previous_delay().unwrap_or_default();
                    probe.on_retry_ok(&msg, asked, state.not_before_ms);
                    drop(ctx);
                    Ok(())
                }
                Some(ms) if ctx.attempt() == 0 => {
                    probe.on_fail(&msg);
                    let d = Duration::from_millis(u64::from(ms));
                    if d == RETRY_DELAY {
                        Err(HandlerError::transient("bench: fails once"))
                    } else {
                        Err(HandlerError::retry_after(d, "bench: fails once"))
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
    run(builder, cancel).await
}

/// Scenario 7's inbox on `pool`, in the run's `schema`, its tables checked (the parent created
/// them): done before the clock starts, as the raw side opens its pool then.
pub async fn inbox(pool: sqlx::PgPool, schema: &str, args: &ChildArgs) -> Result<Inbox> {
    let schema = Schema::named(schema).with_context(|| format!("schema name '{schema}'"))?;
    let inbox = Inbox::new(pool, args.queue_name()).schema(schema);
    inbox.prepare().await.context("preparing the inbox")?;
    Ok(inbox)
}

/// Scenario 7: the worker's handler inserts one row through the inbox (which inserts its own
/// row first, in the same transaction, and commits after the handler).
pub async fn start_inbox(
    url: &str,
    args: &ChildArgs,
    inbox: Inbox,
    probe: Arc<Probe>,
    cancel: CancellationToken,
) -> Result<JoinHandle<Result<()>>> {
    // The same statement as the raw side's.
    let insert: Arc<str> = format!(
        "INSERT INTO {} (message_id, body) VALUES ($1, $2)",
        crate::pg::effects_sql(inbox.configured_schema().name())
    )
    .into();
    let handler = inbox.handler_fn(move |m: Raw, ctx: Context, mut tx: Tx| {
        let insert = insert.clone();
        async move {
            sqlx::query(&insert)
                .bind(ctx.message_id())
                .bind(&m.0)
                .execute(&mut *tx)
                .await
                .map_err(HandlerError::transient)?;
            Ok(tx)
        }
    });
    let builder = builder(url, args).handler(Counted {
        inner: handler,
        probe,
    });
    run(builder, cancel).await
}

/// Counts a message once the inbox has committed it, as the raw side does after its commit
/// (a count inside the handler would come before the commit). Decodes the same struct as the
/// raw side.
struct Counted<H> {
    inner: H,
    probe: Arc<Probe>,
}

impl<H: Handler<Raw>> Handler<Raw> for Counted<H> {
    async fn handle(&self, m: Raw, ctx: Context) -> Result<(), HandlerError> {
        let p: PayloadIn = serde_json::from_slice(&m).map_err(HandlerError::permanent)?;
        self.inner.handle(m, ctx).await?;
        self.probe.on_ok(&p);
        Ok(())
    }
}

/// Runs the worker and waits until it consumes.
async fn run(builder: WorkerBuilder, cancel: CancellationToken) -> Result<JoinHandle<Result<()>>> {
    let worker = builder.build().context("building the worker")?;
    let status = worker.status_handle();
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
