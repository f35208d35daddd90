//! One consumer process (raw lapin or redeliver), driven by the parent over stdin/stdout.
//!
//! Protocol, one line each way:
//! - child -> parent `@@READY {"rss_kb":..}` once connected, before consuming anything;
//! - parent -> child `RUN ok N` / `RUN fail N`: reset the counters, start consuming if not yet
//!   (`@@STARTED` once the consumer is up), then `@@DONE {RunReport}` when N messages have been
//!   handled successfully (`ok`) or failed into a retry (`fail`);
//! - parent -> child `RUN hold N`: like `RUN ok N`, but each handler holds its delivery until N
//!   of them are held at once (the RSS then goes into the report), then they all complete;
//! - parent -> child `STAT`, at any time: `@@STAT {Stat}`, the current run's counts so far;
//! - parent -> child `QUIT`, at any time: stop, `@@BYE`, exit.
//!
//! Anything else the child writes goes to stderr, which the parent passes through.

mod probe;
mod raw;
mod raw_pg;
mod rd;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_util::sync::CancellationToken;

pub use probe::{Probe, RunReport, Stat};

use crate::broker;
use crate::stats;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum Side {
    /// lapin as its examples use it: `delivery.ack(..).await` for each message.
    Raw,
    /// lapin with acks batched: `multiple = true` every [`RAW_ACK_BATCH`] messages (and when
    /// the stream goes idle). Happy path only: a multiple ack would also ack retries whose
    /// copies are not confirmed yet.
    RawBatch,
    Redeliver,
}

/// 10 % of the prefetch (DESIGN: ack every 5-10 % of the prefetch).
pub const RAW_ACK_BATCH: u64 = 20;

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Raw => "raw lapin",
            Side::RawBatch => "raw lapin, batched acks",
            Side::Redeliver => "redeliver",
        }
    }
    pub fn short(self) -> &'static str {
        match self {
            Side::Raw => "raw",
            Side::RawBatch => "rawb",
            Side::Redeliver => "rd",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum QueueKind {
    Quorum,
    Classic,
}

impl QueueKind {
    pub fn name(self) -> &'static str {
        match self {
            QueueKind::Quorum => "quorum",
            QueueKind::Classic => "classic",
        }
    }
    pub fn amqp(self) -> redeliver_amqp::QueueType {
        match self {
            QueueKind::Quorum => redeliver_amqp::QueueType::Quorum,
            QueueKind::Classic => redeliver_amqp::QueueType::Classic,
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct ChildArgs {
    #[arg(long, value_enum)]
    pub side: Side,
    /// Queue name without the run prefix.
    #[arg(long)]
    pub queue: String,
    /// Run prefix (queues, exchanges and delay levels).
    #[arg(long)]
    pub prefix: String,
    #[arg(long, value_enum)]
    pub queue_type: QueueKind,
    /// Queue type of the delay levels.
    #[arg(long, value_enum)]
    pub delay_levels: QueueKind,
    #[arg(long)]
    pub prefetch: u16,
    #[arg(long)]
    pub concurrency: usize,
    /// Keep the first-failure time of each message to measure delay accuracy (scenario 3 only:
    /// the map grows with the message count, which would distort scenario 4's RSS).
    #[arg(long)]
    pub track_delay: bool,
    /// Scenario 7: every message is an INSERT into this schema's effects table, in a
    /// transaction of its own (raw) or through the inbox (redeliver); DATABASE_URL names the
    /// database.
    #[arg(long)]
    pub pg_schema: Option<String>,
    /// Scenario 11 (native): the worker's `RetryMode` (unset: the worker's default, `Levels`).
    #[arg(long, value_enum)]
    pub retry_mode: Option<ChildRetryMode>,
    /// Scenario 11 (native): the policy (exponential from 1 s, cap 60 s, full jitter);
    /// a message with `retry_ms` fails its first delivery with a transient error (the raw side
    /// draws the same policy's delay and rounds it as the worker does), and its retry records
    /// (retry - first failure) - the delay the retry says it was scheduled with. Needs
    /// `--track-delay`.
    #[arg(long)]
    pub jittered: bool,
    /// Scenario 11: count a message handled successfully twice as a duplicate, not as done.
    #[arg(long)]
    pub dedup: bool,
}

/// The worker's retry mode in a child of scenario 11.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum ChildRetryMode {
    /// Retries as confirmed copies through the delay levels (AMQP 0-9-1 consumer).
    Levels,
    /// Retries held by the quorum queue itself (AMQP 1.0 consumer, RabbitMQ 4.3+).
    Native,
}

impl ChildRetryMode {
    pub fn worker(self) -> redeliver_worker::RetryMode {
        match self {
            ChildRetryMode::Levels => redeliver_worker::RetryMode::Levels,
            ChildRetryMode::Native => redeliver_worker::RetryMode::Native,
        }
    }
}

/// Scenario 11's policy, the same for the worker and the raw consumer: the issue's
/// (exponential from 1 s, doubling, cap 60 s, full jitter). One retry per message, so every
/// delay is drawn from 0-1 s.
pub fn jittered_policy() -> redeliver_core::RetryPolicy {
    redeliver_core::RetryPolicy::exponential(Duration::from_secs(1))
        .cap(Duration::from_secs(60))
        .jitter(redeliver_core::Jitter::Full)
        .max_retries(3)
}

impl ChildArgs {
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "child".to_string(),
            "--side".into(),
            enum_name(self.side),
            "--queue".into(),
            self.queue.clone(),
            "--prefix".into(),
            self.prefix.clone(),
            "--queue-type".into(),
            enum_name(self.queue_type),
            "--delay-levels".into(),
            enum_name(self.delay_levels),
            "--prefetch".into(),
            self.prefetch.to_string(),
            "--concurrency".into(),
            self.concurrency.to_string(),
        ];
        if self.track_delay {
            v.push("--track-delay".into());
        }
        if let Some(schema) = &self.pg_schema {
            v.push("--pg-schema".into());
            v.push(schema.clone());
        }
        if let Some(mode) = self.retry_mode {
            v.push("--retry-mode".into());
            v.push(enum_name(mode));
        }
        if self.jittered {
            v.push("--jittered".into());
        }
        if self.dedup {
            v.push("--dedup".into());
        }
        v
    }

    /// Full queue name.
    pub fn queue_name(&self) -> String {
        format!("{}{}", self.prefix, self.queue)
    }
}

fn enum_name<T: ValueEnum>(v: T) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// Scenario 7's database side of a child, set up before `@@READY`.
enum PgSetup {
    /// The hand-written consumer's pool and the schema of the effects table.
    Raw(sqlx::PgPool, String),
    /// The worker's inbox (its pool inside), its tables checked.
    Inbox(redeliver_postgres::Inbox),
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy)]
pub struct Ready {
    pub rss_kb: u64,
}

/// The delay infrastructure of a run: every object name starts with the run prefix.
/// Quorum levels (redeliver's default) use the run prefix; classic levels (the "speed" option)
/// get their own set of objects under `{prefix}cl-`.
pub fn delay_config(prefix: &str, levels: QueueKind) -> redeliver_amqp::DelayConfig {
    let cfg = redeliver_amqp::DelayConfig::new();
    match levels {
        QueueKind::Quorum => cfg.prefix(prefix),
        QueueKind::Classic => cfg
            .prefix(format!("{prefix}cl-"))
            .queue_type(redeliver_amqp::QueueType::Classic),
    }
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    // A parent that went away is the only cause; the child then exits on stdin EOF.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn say_stat(probe: &Probe) -> Result<()> {
    say(&format!("@@STAT {}", serde_json::to_string(&probe.stat())?));
    Ok(())
}

pub async fn main(url: String, database_url: String, args: ChildArgs) -> Result<()> {
    let probe = Arc::new(Probe::new(args.track_delay, args.dedup));
    let cancel = CancellationToken::new();
    // The raw side connects here; the redeliver worker opens its own connection (it owns its
    // reconnect loop) when the first RUN starts it.
    let mut consumer: Option<tokio::task::JoinHandle<Result<()>>> = None;
    // Baseline before any connection on both sides: the RSS delta then covers the whole
    // consumer (connection, buffers, prefetched deliveries, handler state).
    let baseline = stats::mem(None)?;
    let conn = match args.side {
        Side::Raw | Side::RawBatch => Some(broker::connect(&url).await?),
        Side::Redeliver => None,
    };
    // Scenario 7: both sides open their whole pool here, before the parent reads the database's
    // CPU time and starts the clock (the backends' start-up is not the work being compared).
    let pg = match &args.pg_schema {
        Some(schema) => Some(
            crate::pg::pool(&database_url, args.concurrency)
                .await
                .map(|pool| (pool, schema.clone()))?,
        ),
        None => None,
    };
    let mut pg = match (pg, args.side) {
        (Some((pool, schema)), Side::Redeliver) => {
            Some(PgSetup::Inbox(rd::inbox(pool, &schema, &args).await?))
        }
        (Some((pool, schema)), _) => Some(PgSetup::Raw(pool, schema)),
        (None, _) => None,
    };
    say(&format!(
        "@@READY {}",
        serde_json::to_string(&Ready {
            rss_kb: baseline.rss_kb
        })?
    ));

    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut conn = conn;
    loop {
        let line = tokio::select! {
            l = lines.next_line() => l.context("reading stdin")?,
            r = async { consumer.as_mut().expect("guarded").await }, if consumer.is_some() => {
                // The consumer stopped on its own: a broker-side failure.
                return match r {
                    Ok(Ok(())) => Err(anyhow!("consumer stopped unexpectedly")),
                    Ok(Err(e)) => Err(e.context("consumer failed")),
                    Err(e) => Err(anyhow!("consumer task panicked: {e}")),
                };
            }
        };
        let Some(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["RUN", kind, n] => {
                let kind = probe::Kind::parse(kind)?;
                let n: u64 = n.parse().context("RUN count")?;
                let done = probe.reset(kind, n);
                if consumer.is_none() {
                    let handle = match args.side {
                        Side::Raw | Side::RawBatch => {
                            let c = conn.take().context("raw connection")?;
                            match pg.take() {
                                Some(PgSetup::Raw(pool, schema)) => {
                                    raw_pg::start(
                                        c,
                                        &args,
                                        pool,
                                        &schema,
                                        probe.clone(),
                                        cancel.clone(),
                                    )
                                    .await?
                                }
                                _ => raw::start(c, &args, probe.clone(), cancel.clone()).await?,
                            }
                        }
                        Side::Redeliver => match pg.take() {
                            Some(PgSetup::Inbox(inbox)) => {
                                rd::start_inbox(&url, &args, inbox, probe.clone(), cancel.clone())
                                    .await?
                            }
                            _ => rd::start(&url, &args, probe.clone(), cancel.clone()).await?,
                        },
                    };
                    consumer = Some(handle);
                }
                say("@@STARTED");
                // Serve STAT (and QUIT) while the run goes on: scale-out runs are completed by
                // the parent, which adds up the counts of several processes.
                let mut done = done;
                let mut quit = false;
                loop {
                    tokio::select! {
                        r = &mut done => {
                            let last_ns = r.map_err(|_| anyhow!("probe dropped"))?;
                            let report = probe.report(last_ns, baseline.rss_kb)?;
                            say(&format!("@@DONE {}", serde_json::to_string(&report)?));
                            break;
                        }
                        l = lines.next_line() => {
                            match l.context("reading stdin")?.as_deref().map(str::trim) {
                                Some("STAT") => say_stat(&probe)?,
                                Some("QUIT") | None => {
                                    quit = true;
                                    break;
                                }
                                Some("") => {}
                                Some(other) => bail!("unknown command during a run: {other:?}"),
                            }
                        }
                        r = async { consumer.as_mut().expect("set above").await } => {
                            return match r {
                                Ok(Ok(())) => Err(anyhow!("consumer stopped unexpectedly")),
                                Ok(Err(e)) => Err(e.context("consumer failed")),
                                Err(e) => Err(anyhow!("consumer task panicked: {e}")),
                            };
                        }
                    }
                }
                if quit {
                    break;
                }
            }
            ["STAT"] => say_stat(&probe)?,
            ["QUIT"] => break,
            [] => {}
            other => bail!("unknown command {other:?}"),
        }
    }
    cancel.cancel();
    if let Some(h) = consumer {
        match tokio::time::timeout(Duration::from_secs(10), h).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => eprintln!("child: consumer ended with an error: {e:#}"),
            Ok(Err(e)) => eprintln!("child: consumer task panicked: {e}"),
            Err(_) => eprintln!("child: consumer did not stop within 10 s"),
        }
    }
    say("@@BYE");
    Ok(())
}
