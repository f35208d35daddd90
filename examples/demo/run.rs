//! The demo run: declares a throwaway topology, consumes with the example's handler, publishes
//! jobs with malformed bodies among them, waits until every message is acked or dead-lettered,
//! and sums up what happened, checked against what the seed predicts.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use clap::Parser;
use futures::future::try_join_all;
use redeliver::amqp::headers::RetryState;
use redeliver::lapin::options::{BasicAckOptions, BasicGetOptions};
use redeliver::lapin::{BasicProperties, Connection, ConnectionProperties};
use redeliver::{
    CancellationToken, Context, DelayConfig, Jitter, Json, Publisher, RetryPolicy, Settings,
    Topology, Worker, WorkerState,
};

use crate::job::{fetch_fails, process, ImageJob};

/// The queue of the worker example; the demo's carries a random prefix too.
const QUEUE: &str = "images";

/// How long the broker gets to answer the first connection attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The demo's options.
#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    about = "The image_processing example's worker in one process: publishes jobs, consumes them with retries, prints what happened, deletes what it declared"
)]
pub(crate) struct Args {
    /// Jobs to publish.
    #[arg(long, default_value_t = 50)]
    pub count: u32,
    /// Chance that one fetch fails with a simulated connection error (0 to 1).
    #[arg(long, default_value_t = 0.5)]
    pub fail_rate: f64,
    /// Malformed (poison) bodies to publish among the jobs.
    #[arg(long, default_value_t = 5)]
    pub poison: u32,
    /// Seed of the simulated failures.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// First backoff delay, in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub base_ms: u64,
    /// Largest backoff delay, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub cap_ms: u64,
    /// Retries per job before it is dead-lettered.
    #[arg(long, default_value_t = 3)]
    pub max_retries: u32,
    /// Give up (and fail) after this many seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout_secs: u64,
    /// Keep the demo's queues and exchanges instead of deleting them.
    #[arg(long)]
    pub keep: bool,
}

/// Number of failed attempts of `job` before it succeeds, or `None` when every attempt up to
/// `max_retries` fails (it is then dead-lettered after `max_retries` retries).
pub(crate) fn failures_before_success(job: &ImageJob, max_retries: u32) -> Option<u32> {
    (0..=max_retries).find(|&a| !fetch_fails(job, a))
}

/// What the demo's handler saw.
#[derive(Default)]
struct Observed {
    /// Job id -> (time of its last failure, whether it succeeded).
    jobs: HashMap<u64, (Option<Instant>, bool)>,
    /// (attempt, scheduled delay, observed delay) of every retry delivery.
    retries: Vec<(u32, Duration, Duration)>,
    handler_calls: u32,
}

/// Delays of the retries with one attempt number.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AttemptDelays {
    /// `x-redeliver-attempt` of the retry copies (1 = first retry).
    pub attempt: u32,
    /// Retry copies delivered with this attempt number.
    pub deliveries: u32,
    /// The delay the policy chose (backoff with jitter): min, avg, max.
    pub scheduled: [Duration; 3],
    /// From the handler's failure to the copy's arrival (publish, confirm and delay levels
    /// included): min, avg, max.
    pub observed: [Duration; 3],
}

/// Outcome of a demo run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Summary {
    /// Well-formed jobs published.
    pub jobs: u32,
    /// Malformed bodies published.
    pub poison: u32,
    /// Jobs whose handler succeeded (each counted once).
    pub processed: u32,
    /// Retry copies delivered to the handler.
    pub retried: u32,
    /// Handler calls (first attempts and retries).
    pub handler_calls: u32,
    /// Messages found in the DLQ.
    pub dead_lettered: u32,
    /// Of those, malformed bodies (never retried).
    pub dead_lettered_poison: u32,
    /// Of those, jobs that failed `max_retries` retries.
    pub dead_lettered_exhausted: u32,
    /// `processed` predicted from the seed.
    pub expected_processed: u32,
    /// `retried` predicted from the seed.
    pub expected_retried: u32,
    /// Delays per attempt.
    pub delays: Vec<AttemptDelays>,
    /// Wall time from the first publish to the last settlement.
    pub elapsed: Duration,
    /// The DLQ's name.
    pub dlq: String,
    /// The options of the run.
    pub args: Args,
}

impl Summary {
    /// All messages published.
    pub(crate) fn published(&self) -> u32 {
        self.jobs + self.poison
    }

    /// Every message ended exactly once, acked or in the DLQ, and the DLQ holds only what truly
    /// failed.
    pub(crate) fn adds_up(&self) -> bool {
        self.processed + self.dead_lettered == self.published()
            && self.dead_lettered == self.dead_lettered_poison + self.dead_lettered_exhausted
            && self.handler_calls == self.jobs + self.retried
    }

    /// The summary table.
    pub(crate) fn render(&self) -> String {
        let a = &self.args;
        let mut out = String::new();
        let ms = |d: Duration| d.as_millis();
        let _ = writeln!(
            out,
            "\nredeliver demo: {} jobs + {} malformed, fail rate {:.0}%, backoff {} ms x 2^n capped at {} ms, full jitter, max {} retries (seed {})\n",
            self.jobs,
            self.poison,
            a.fail_rate * 100.0,
            a.base_ms,
            a.cap_ms,
            a.max_retries,
            a.seed
        );
        let _ = writeln!(out, "  {:<34}{:>8}", "outcome", "messages");
        let rows = [
            ("published", self.published()),
            ("processed (acked)", self.processed),
            ("retried (retry copies delivered)", self.retried),
            ("dead-lettered", self.dead_lettered),
            ("  malformed body (poison pill)", self.dead_lettered_poison),
            ("  retries exhausted", self.dead_lettered_exhausted),
        ];
        for (name, n) in rows {
            let _ = writeln!(out, "  {name:<34}{n:>8}");
        }
        let _ = writeln!(
            out,
            "\n  {:<9}{:>10}   {:<28}{:<28}",
            "attempt", "retries", "scheduled min/avg/max", "observed min/avg/max"
        );
        for d in &self.delays {
            let s = format!(
                "{} / {} / {} ms",
                ms(d.scheduled[0]),
                ms(d.scheduled[1]),
                ms(d.scheduled[2])
            );
            let o = format!(
                "{} / {} / {} ms",
                ms(d.observed[0]),
                ms(d.observed[1]),
                ms(d.observed[2])
            );
            let _ = writeln!(
                out,
                "  {:<9}{:>10}   {s:<28}{o:<28}",
                d.attempt, d.deliveries
            );
        }
        let _ = writeln!(
            out,
            "\n  scheduled = backoff with jitter chosen by the policy; observed = handler failure to redelivery."
        );
        let check = if self.adds_up()
            && self.processed == self.expected_processed
            && self.retried == self.expected_retried
        {
            "adds up"
        } else {
            "DOES NOT ADD UP"
        };
        let _ = writeln!(
            out,
            "  processed + dead-lettered = {} + {} = {} published: {check} (seed predicts {} processed, {} retries).",
            self.processed,
            self.dead_lettered,
            self.published(),
            self.expected_processed,
            self.expected_retried
        );
        let _ = writeln!(
            out,
            "  {} received {} messages: {} malformed, {} out of retries; finished in {:.1} s.",
            self.dlq,
            self.dead_lettered,
            self.dead_lettered_poison,
            self.dead_lettered_exhausted,
            self.elapsed.as_secs_f64()
        );
        out
    }
}

/// The message printed when the broker cannot be reached.
pub(crate) fn no_broker_message(url: &str, error: &dyn std::fmt::Display) -> String {
    format!(
        "cannot reach RabbitMQ at {url}: {error}\n\
         Start a local broker with one of:\n  \
         sudo apt-get install rabbitmq-server     (Debian/Ubuntu; it starts at once)\n  \
         sudo rabbitmq-server -detached           (installed but stopped)\n  \
         docker compose -f compose/docker-compose.yml up -d rabbitmq\n\
         or set AMQP_URL to a reachable broker (amqp://user:pass@host:5672/%2f)."
    )
}

/// Told how far the run is while it waits: (messages settled for good, messages published).
pub(crate) type Progress<'a> = &'a (dyn Fn(u32, u32) + Send + Sync);

/// Connects, or fails with instructions to start a broker.
pub(crate) async fn connect(cfg: &Settings) -> anyhow::Result<Connection> {
    let url = redeliver::amqp::url::redact(cfg.url());
    let props = ConnectionProperties::default().with_connection_name("image-processing".into());
    match tokio::time::timeout(
        CONNECT_TIMEOUT,
        redeliver::amqp::connect(cfg.url(), props, cfg.tls()),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => bail!(no_broker_message(&url, &e)),
        Err(_) => bail!(no_broker_message(
            &url,
            &format!("no answer within {CONNECT_TIMEOUT:?}")
        )),
    }
}

/// Delay levels needed for delays up to `cap` at granularity `g`: enough bits for its ticks.
fn levels_for(cap: Duration, g: Duration) -> u8 {
    let ticks = cap.as_millis().div_ceil(g.as_millis().max(1)).max(1);
    let bits = 128 - ticks.leading_zeros();
    u8::try_from(bits).unwrap_or(24).clamp(1, 24)
}

/// Runs the demo: declares a throwaway topology (random prefix, delay levels included),
/// consumes, publishes, waits for every message to be settled for good (telling `progress` how
/// far it is), reads the DLQ, deletes everything (unless `--keep`) and returns the summary.
pub(crate) async fn run_demo_with(
    args: &Args,
    cfg: &Settings,
    progress: Progress<'_>,
) -> anyhow::Result<Summary> {
    if !(0.0..=1.0).contains(&args.fail_rate) {
        bail!(
            "--fail-rate must be between 0 and 1, got {}",
            args.fail_rate
        );
    }
    let conn = connect(cfg).await?;
    // A per-run prefix for every object, delay levels included, so runs never collide and the
    // cleanup can delete everything.
    let prefix = format!("demo-{}.", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let cap = Duration::from_millis(args.cap_ms);
    let delay = DelayConfig::new().prefix(prefix.clone()).levels(levels_for(
        cap,
        DelayConfig::default().configured_granularity(),
    ));
    let topology = Topology::new(QUEUE)
        .prefix(prefix.clone())
        .delay(delay.clone());

    let result = demo_body(args, cfg, &conn, &topology, progress).await;

    if args.keep {
        eprintln!("kept the demo objects (prefix {prefix})");
    } else {
        // Cleanup runs whatever happened, and its failure must not hide the demo's own error.
        let cleanup = async {
            topology.delete(&conn).await?;
            delay.delete(&conn).await?;
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = cleanup {
            eprintln!("warning: could not delete every demo object (prefix {prefix}): {e:#}");
        }
    }
    let _ = conn.close(200, "demo done".into()).await;
    result
}

async fn demo_body(
    args: &Args,
    cfg: &Settings,
    conn: &Connection,
    topology: &Topology,
    progress: Progress<'_>,
) -> anyhow::Result<Summary> {
    let observed = Arc::new(Mutex::new(Observed::default()));
    let token = CancellationToken::new();
    let policy = RetryPolicy::exponential(Duration::from_millis(args.base_ms))
        .cap(Duration::from_millis(args.cap_ms))
        .jitter(Jitter::Full)
        .max_retries(args.max_retries)
        .seed(args.seed);
    let seen = Arc::clone(&observed);
    let builder = Worker::builder(cfg.url())
        .tls(cfg.tls().clone())
        .topology(topology.clone())
        .policy(policy)
        .prefetch(64)
        .concurrency(16)
        .shutdown_grace(Duration::from_secs(5))
        .handler(move |job: Json<ImageJob>, ctx: Context| {
            let seen = Arc::clone(&seen);
            async move {
                let job = job.into_inner();
                record_arrival(&seen, &job, &ctx);
                let result = process(&job, &ctx).await;
                let mut o = seen.lock().unwrap_or_else(|p| p.into_inner());
                let entry = o.jobs.entry(job.id).or_default();
                match &result {
                    Ok(()) => entry.1 = true,
                    Err(_) => entry.0 = Some(Instant::now()),
                }
                result
            }
        });
    let worker = builder.build()?;
    let mut status = worker.status_handle();
    let worker = tokio::spawn(worker.run(token.clone()));
    // The worker declares the topology; publishing before it exists would be refused.
    let up = status
        .wait_for_timeout(Duration::from_secs(30), |s| {
            matches!(s, WorkerState::Consuming | WorkerState::Stopped)
        })
        .await;
    if up != Some(WorkerState::Consuming) {
        token.cancel();
        return match worker.await {
            Ok(Err(e)) => Err(anyhow!(e).context("the demo worker could not start")),
            _ => bail!(
                "the demo worker did not start consuming within 30 s (it is {}; see the log above)",
                status.state()
            ),
        };
    }

    let started = Instant::now();
    let jobs: Vec<ImageJob> = (1..=u64::from(args.count))
        .map(|id| ImageJob {
            id,
            url: format!("https://images.example/{id}.jpg"),
            width: 320 + (id as u32 % 4) * 320,
            fail_rate: args.fail_rate,
            seed: args.seed,
        })
        .collect();
    let published = publish(conn, topology, &jobs, args.poison).await;
    if let Err(e) = published {
        token.cancel();
        let _ = worker.await;
        return Err(e);
    }

    // Done when every message has ended for good: acked after success, or in the DLQ.
    let total = args.count + args.poison;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let dlq = topology.dlq_name();
    let finished = loop {
        let processed = processed_count(&observed);
        let in_dlq = message_count(conn, &dlq).await?;
        progress((processed + in_dlq).min(total), total);
        if processed + in_dlq >= total {
            break Ok(());
        }
        if Instant::now() > deadline {
            break Err(anyhow!(
                "the demo did not finish within {} s: {processed} processed and {in_dlq} dead-lettered of {total}",
                args.timeout_secs
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let elapsed = started.elapsed();
    token.cancel();
    match worker.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(anyhow!(e).context("the demo worker failed")),
        Err(e) => bail!("the demo worker task failed: {e}"),
    }
    finished?;

    let (dead_lettered, poison, exhausted) = read_dlq(conn, &dlq, args.max_retries).await?;
    let o = observed.lock().unwrap_or_else(|p| p.into_inner());
    Ok(Summary {
        jobs: args.count,
        poison: args.poison,
        processed: o.jobs.values().filter(|(_, ok)| *ok).count() as u32,
        retried: o.retries.len() as u32,
        handler_calls: o.handler_calls,
        dead_lettered,
        dead_lettered_poison: poison,
        dead_lettered_exhausted: exhausted,
        expected_processed: jobs
            .iter()
            .filter(|j| failures_before_success(j, args.max_retries).is_some())
            .count() as u32,
        expected_retried: jobs
            .iter()
            .map(|j| failures_before_success(j, args.max_retries).unwrap_or(args.max_retries))
            .sum(),
        delays: delay_rows(&o.retries),
        elapsed,
        dlq,
        args: args.clone(),
    })
}

fn record_arrival(seen: &Mutex<Observed>, job: &ImageJob, ctx: &Context) {
    let mut o = seen.lock().unwrap_or_else(|p| p.into_inner());
    o.handler_calls += 1;
    if ctx.attempt() == 0 {
        return;
    }
    let failed_at = o.jobs.get(&job.id).and_then(|(t, _)| *t);
    let observed = failed_at.map(|t| t.elapsed()).unwrap_or_default();
    let scheduled = ctx.previous_delay().unwrap_or_default();
    o.retries.push((ctx.attempt(), scheduled, observed));
}

fn processed_count(observed: &Mutex<Observed>) -> u32 {
    let o = observed.lock().unwrap_or_else(|p| p.into_inner());
    o.jobs.values().filter(|(_, ok)| *ok).count() as u32
}

/// Publishes the jobs with the poison pills spread among them, all confirms in flight at once.
async fn publish(
    conn: &Connection,
    topology: &Topology,
    jobs: &[ImageJob],
    poison: u32,
) -> anyhow::Result<()> {
    let publisher = Publisher::new(conn, topology.configured_delay().clone()).await?;
    let queue = topology.queue_name();
    let mut bodies: Vec<(String, Vec<u8>)> = jobs
        .iter()
        .map(|j| Ok((format!("job-{}", j.id), serde_json::to_vec(j)?)))
        .collect::<Result<_, serde_json::Error>>()?;
    let every = (jobs.len() / (poison as usize).max(1)).max(1);
    for i in 0..poison as usize {
        // Truncated JSON: the worker cannot decode it, so it is dead-lettered without a retry.
        let body = format!(
            r#"{{"id": {}, "url": "https://images.example/broken"#,
            1000 + i
        );
        bodies.insert(
            (i * (every + 1)).min(bodies.len()),
            (format!("poison-{i}"), body.into_bytes()),
        );
    }
    let sends = bodies.iter().map(|(id, body)| {
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_content_type("application/json".into());
        publisher.publish_bytes("", &queue, body, props)
    });
    try_join_all(sends).await.context("publishing the jobs")?;
    tracing::info!(messages = bodies.len(), queue = %queue, "published");
    Ok(())
}

/// Ready messages in `queue` (passive declare on a throwaway channel: a 404 closes it).
async fn message_count(conn: &Connection, queue: &str) -> anyhow::Result<u32> {
    let ch = conn.create_channel().await?;
    let q = redeliver::amqp::passive_queue(&ch, queue)
        .await
        .with_context(|| format!("checking queue {queue}"))?
        .with_context(|| format!("queue {queue} does not exist"))?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(q.message_count())
}

/// Reads (and acks) the DLQ: (total, malformed, retries exhausted).
async fn read_dlq(
    conn: &Connection,
    dlq: &str,
    max_retries: u32,
) -> anyhow::Result<(u32, u32, u32)> {
    let ch = conn.create_channel().await?;
    let (mut total, mut poison, mut exhausted) = (0, 0, 0);
    while let Some(m) = ch
        .basic_get(dlq.into(), BasicGetOptions::default())
        .await
        .with_context(|| format!("reading {dlq}"))?
    {
        let d = m.delivery;
        total += 1;
        let attempt = RetryState::read(d.properties.headers().as_ref()).attempt;
        if serde_json::from_slice::<ImageJob>(&d.data).is_err() {
            poison += 1;
        } else if attempt == max_retries {
            exhausted += 1;
        }
        d.ack(BasicAckOptions::default()).await?;
    }
    let _ = ch.close(200, "ok".into()).await;
    Ok((total, poison, exhausted))
}

fn delay_rows(retries: &[(u32, Duration, Duration)]) -> Vec<AttemptDelays> {
    let mut attempts: Vec<u32> = retries.iter().map(|r| r.0).collect();
    attempts.sort_unstable();
    attempts.dedup();
    attempts
        .into_iter()
        .map(|attempt| {
            let rows: Vec<_> = retries.iter().filter(|r| r.0 == attempt).collect();
            let stats = |pick: fn(&(u32, Duration, Duration)) -> Duration| {
                let v: Vec<Duration> = rows.iter().map(|r| pick(r)).collect();
                let min = v.iter().min().copied().unwrap_or_default();
                let max = v.iter().max().copied().unwrap_or_default();
                let avg = v.iter().sum::<Duration>() / (v.len().max(1) as u32);
                [min, avg, max]
            };
            AttemptDelays {
                attempt,
                deliveries: rows.len() as u32,
                scheduled: stats(|r| r.1),
                observed: stats(|r| r.2),
            }
        })
        .collect()
}
