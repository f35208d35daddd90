//! The run: shared context, the scenarios in turn, targets, report and cleanup.

mod delay;
mod happy;
mod hops;
mod inbox;
mod inflight;
mod native;
mod outbox;
mod outbox_refused;
mod park;
mod retry;
mod scale;

pub use hops::{render as render_hops, HopsRow};
pub use native::{render as render_native, NativeRow};

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use lapin::Connection;
use redeliver_amqp::DelayConfig;
use redeliver_amqp::Topology;

use crate::broker;
use crate::child::{self, ChildArgs, QueueKind, RunReport, Side};
use crate::config::{
    Scenario, Sizes, CONCURRENCY, DB_CONCURRENCY, MIN_ROUNDS_TO_CONCLUDE, PREFETCH, SPREAD_LIMIT,
};
use crate::payload;
use crate::pg::PgCtx;
use crate::proc_ctl::ChildProc;
use crate::publish::BenchPublisher;
use crate::report::{Report, Target, ThroughputRow};
use crate::stats;

pub struct RunOptions {
    pub url: String,
    pub management_url: String,
    /// PostgreSQL of scenarios 7 to 9 (connected only when one of them is selected).
    pub database_url: String,
    pub sizes: Sizes,
    pub short: bool,
    pub only: Vec<Scenario>,
    pub out: Option<PathBuf>,
    /// The broker's beam.smp pid (`--broker-pid`); found through the management API if unset.
    pub broker_pid: Option<u32>,
}

/// What every scenario needs: the parent's connection, the run prefix and delay levels.
pub struct Ctx {
    pub url: String,
    pub conn: Connection,
    pub prefix: String,
    delay_quorum: DelayConfig,
    delay_classic: DelayConfig,
    pub sizes: Sizes,
    /// The broker node's OS process, when it runs on this host (broker CPU figures).
    pub broker_pid: Option<u32>,
    broker_version: String,
    pad: Arc<str>,
    seq: Arc<AtomicU64>,
    declared: Mutex<Vec<Topology>>,
    /// The database and the run's schema, when scenario 7 or 8 is selected.
    pg: Option<PgCtx>,
}

impl Ctx {
    /// Declares the queue `base` (run prefix prepended) with redeliver's topology, for both
    /// sides alike: the raw consumer reads a queue with exactly the same arguments.
    pub async fn declare(
        &self,
        base: &str,
        queue_type: QueueKind,
        levels: QueueKind,
    ) -> Result<String> {
        let topo = Topology::new(base)
            .prefix(self.prefix.clone())
            .queue_type(queue_type.amqp())
            .delay(self.delay(levels).clone());
        topo.declare(&self.conn)
            .await
            .with_context(|| format!("declaring the topology of '{base}'"))?;
        let name = topo.queue_name();
        self.lock_declared().push(topo);
        Ok(name)
    }

    /// Deletes a scenario's queues as soon as it is done (the broker keeps quorum queues'
    /// logs on disk; a long run should not accumulate them).
    pub async fn drop_queue(&self, name: &str) {
        let topo = {
            let mut d = self.lock_declared();
            d.iter()
                .position(|t| t.queue_name() == name)
                .map(|i| d.remove(i))
        };
        if let Some(t) = topo {
            if let Err(e) = t.delete(&self.conn).await {
                eprintln!("warning: deleting '{name}': {e}");
            }
        }
    }

    /// The run's delay levels of one queue type.
    pub fn delay(&self, levels: QueueKind) -> &DelayConfig {
        match levels {
            QueueKind::Quorum => &self.delay_quorum,
            QueueKind::Classic => &self.delay_classic,
        }
    }

    fn lock_declared(&self) -> std::sync::MutexGuard<'_, Vec<Topology>> {
        self.declared.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub async fn publisher(&self, side: Side) -> Result<BenchPublisher> {
        self.publisher_padded(side, self.pad.clone()).await
    }

    /// A publisher whose bodies are about `bytes` long instead of 1 KB.
    pub async fn publisher_sized(&self, side: Side, bytes: usize) -> Result<BenchPublisher> {
        self.publisher_padded(side, payload::padding_for(bytes).into())
            .await
    }

    async fn publisher_padded(&self, side: Side, pad: Arc<str>) -> Result<BenchPublisher> {
        BenchPublisher::new(
            side,
            &self.conn,
            self.delay_quorum.clone(),
            pad,
            self.seq.clone(),
        )
        .await
    }

    /// CPU time the broker node has used so far, microseconds (`None`: not on this host).
    pub fn broker_cpu_us(&self) -> Option<u64> {
        self.broker_pid.and_then(stats::cpu_us_of)
    }

    /// The database of scenarios 7 to 9 (connected at the start of a run that selects them).
    pub fn pg(&self) -> Result<&PgCtx> {
        self.pg
            .as_ref()
            .ok_or_else(|| anyhow!("PostgreSQL was not set up for this run"))
    }

    /// [`Self::drain`], also reading the CPU time of the database's processes (scenario 7).
    pub async fn drain_with_db(
        &self,
        child: &mut ChildProc,
        kind: &str,
        n: u64,
        timeout: Duration,
    ) -> Result<Drain> {
        let pg = self.pg()?;
        let d0 = pg.cpu_us();
        let mut drain = self.drain(child, kind, n, timeout).await?;
        drain.db_us = d0.zip(pg.cpu_us()).map(|(a, b)| b.saturating_sub(a));
        Ok(drain)
    }

    /// One timed drain: `RUN kind n` on the child, with the broker's CPU time read before the
    /// RUN and after its DONE.
    pub async fn drain(
        &self,
        child: &mut ChildProc,
        kind: &str,
        n: u64,
        timeout: Duration,
    ) -> Result<Drain> {
        let b0 = self.broker_cpu_us();
        let report = child.run(kind, n, timeout).await?;
        let broker_us = b0
            .zip(self.broker_cpu_us())
            .map(|(a, b)| b.saturating_sub(a));
        Ok(Drain {
            report,
            broker_us,
            db_us: None,
        })
    }

    pub fn child_args(
        &self,
        side: Side,
        base: &str,
        queue_type: QueueKind,
        delay_levels: QueueKind,
    ) -> ChildArgs {
        ChildArgs {
            side,
            queue: base.to_string(),
            prefix: self.prefix.clone(),
            queue_type,
            delay_levels,
            prefetch: PREFETCH,
            concurrency: CONCURRENCY,
            track_delay: false,
            pg_schema: None,
            retry_mode: None,
            jittered: false,
            dedup: false,
        }
    }

    /// Generous timeout for draining `n` messages (a stuck run fails instead of hanging).
    pub fn timeout_for(n: u64) -> Duration {
        Duration::from_secs(60 + n / 200)
    }
}

/// A timed drain: the child's report and the broker's CPU time over it.
pub struct Drain {
    pub report: RunReport,
    pub broker_us: Option<u64>,
    /// The database's processes over it (scenario 7 only).
    pub db_us: Option<u64>,
}

impl Drain {
    pub fn rate(&self, n: u64) -> f64 {
        per_second(n, &self.report)
    }
    pub fn cpu_us_per_msg(&self, n: u64) -> f64 {
        self.report.cpu_us as f64 / n.max(1) as f64
    }
    /// The consumer's CPU before its first delivery (not in the per-message figure), ms.
    pub fn setup_cpu_ms(&self) -> f64 {
        self.report.setup_cpu_us as f64 / 1000.0
    }
    pub fn broker_us_per_msg(&self, n: u64) -> Option<f64> {
        self.broker_us.map(|b| b as f64 / n.max(1) as f64)
    }
    pub fn db_us_per_msg(&self, n: u64) -> Option<f64> {
        self.db_us.map(|b| b as f64 / n.max(1) as f64)
    }
}

/// Messages per second between the first delivery the consumer handled and the event that
/// completed the run (the consumer's connection and setup are not timed, on either side).
pub fn per_second(n: u64, r: &RunReport) -> f64 {
    let start = if r.first_ns > 0 { r.first_ns } else { r.go_ns };
    let secs = r.last_ns.saturating_sub(start) as f64 / 1e9;
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Runs `one` for every side `rounds` times, interleaved: A B C, then C B A, and so on (the
/// first side of a round is the last of the one before, so no side always runs on a broker that
/// just drained the same side's queue). Every round's row is kept; the report pairs the sides of
/// the same round and takes medians.
pub async fn rounds_of<'a, F, Fut>(
    rounds: u32,
    sides: &[Side],
    mut one: F,
) -> Result<Vec<ThroughputRow>>
where
    F: FnMut(Side, u32) -> Fut + 'a,
    Fut: std::future::Future<Output = Result<ThroughputRow>> + 'a,
{
    let mut rows: Vec<ThroughputRow> = Vec::new();
    for round in 0..rounds.max(1) {
        let mut order = sides.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for side in order {
            let mut row = one(side, round).await?;
            row.round = round;
            eprintln!(
                "   round {} {} {} {}: {:.0} msg/s consume ({:.1} us CPU/msg, {:.0} ms CPU before the first, broker {}), {:.0} msg/s publish, p50 {:.1} ms, p99 {:.1} ms",
                round + 1,
                row.scenario,
                row.queue.name(),
                side.name(),
                row.consume_per_s,
                row.cpu_us_per_msg,
                row.setup_cpu_ms,
                row.broker_cpu_us_per_msg
                    .map(|b| format!("{b:.1} us/msg"))
                    .unwrap_or_else(|| "n/a".into()),
                row.publish_per_s,
                row.p50_ms,
                row.p99_ms
            );
            rows.push(row);
        }
    }
    Ok(rows)
}

/// RSS of a child once it has settled: the largest of a few samples after a pause (full: 8
/// samples a quarter second apart, after 2 s; see [`crate::config::Sizes::rss_settle`]).
pub async fn settled_rss(ctx: &Ctx, pid: u32) -> Result<u64> {
    tokio::time::sleep(ctx.sizes.rss_settle).await;
    let mut best = 0;
    for _ in 0..ctx.sizes.rss_samples {
        best = best.max(stats::mem(Some(pid))?.rss_kb);
        tokio::time::sleep(ctx.sizes.rss_sample).await;
    }
    Ok(best)
}

pub fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// What the report measured and how; printed above the tables.
fn legend(rounds: u32) -> String {
    format!(
        "Sides: **raw** = hand-written lapin consumer acking each message \
(`delivery.ack(..).await`, as lapin's examples do); **rawb** = the same with `multiple = true` acks \
every 20 messages (10 % of the prefetch) and on idle; **redeliver** = `Worker` + `Publisher`. \
Every side's messages carry the same properties (`Publisher`'s `message_id` and `timestamp`: the \
raw side's publisher sets them too). In the inbox scenario (7), **raw** = a hand-written lapin \
consumer doing `BEGIN`, one `INSERT`, `COMMIT`, then `basic.ack` per message, and **redeliver** = the \
same `INSERT` in a handler behind `Inbox` (which first inserts its own row with `ON CONFLICT DO \
NOTHING` in the same transaction), both with {DB_CONCURRENCY} handlers in flight and a sqlx pool of \
as many connections (prefetch {PREFETCH}).\n\n\
Method: scenarios 1, 2, 5 and 7 run {rounds} interleaved round(s) per side (A B C, then C B A, ...); \
scenario 8 (outbox) runs once per round, scenario 9 (outbox-refused) its two backlogs once per \
round, alternating which goes first. \
consume msg/s = drain rate of a pre-published backlog, from the first delivery handled to the last \
(retry: completed round trips); each side's figures are the median over its rounds, with min-max. \
The ratios pair the two sides of the same round (redeliver / raw of round 1, of round 2, ...) and \
report the median of those per-round ratios with their min-max. A ratio is *conclusive* with at \
least {MIN_ROUNDS_TO_CONCLUDE} round pairs, a spread (max / min of the per-round ratios) of at most \
{SPREAD_LIMIT} and, for a target, a min-max interval that does not cross the target value. \
consumer CPU = user + system time of the consumer process (each consumer runs in a child process) \
during the drain, per message; broker CPU = the same for the RabbitMQ node's OS process \
(`/proc/<pid>/stat` of its beam.smp; n/a when the broker is not on this host), which also counts \
whatever else uses that broker meanwhile. Latency = publish -> handler in a second phase published \
at a fixed rate. RSS is the consumer process's own (RSS delta = peak minus before connecting)."
    )
}

pub async fn run_all(opts: RunOptions) -> Result<()> {
    let conn = broker::connect(&opts.url).await?;
    let prefix = broker::run_prefix();
    // Before any scenario runs: a missing database fails the run now, not after the others.
    let pg = if opts.only.iter().any(|s| s.needs_postgres()) {
        Some(PgCtx::new(&opts.database_url, &prefix).await?)
    } else {
        None
    };
    let delay_quorum = child::delay_config(&prefix, QueueKind::Quorum);
    let delay_classic = child::delay_config(&prefix, QueueKind::Classic);
    // The version comes from the broker the scenarios use. A management API of another node
    // (a management URL left at its default while AMQP_URL points elsewhere) would give that
    // node's version, and its process's CPU as the broker's.
    let amqp = broker::amqp_identity(&opts.url).await;
    let management = broker::management_identity(&opts.management_url);
    let same_node = match (&amqp, &management) {
        (Some((av, ac)), Some((mv, mc))) => av == mv && (ac.is_none() || mc.is_none() || ac == mc),
        _ => true,
    };
    if let (false, Some((av, ac)), Some((mv, mc))) = (same_node, &amqp, &management) {
        eprintln!(
            "note: the management API at {} is RabbitMQ {mv} (cluster {}), the broker at {} is \
             RabbitMQ {av} (cluster {}): another node, so broker CPU is n/a and the final sweep \
             misses this run's leftovers; pass --management-url (RABBITMQ_MANAGEMENT_URL)",
            redeliver_amqp::url::redact(&opts.management_url),
            mc.as_deref().unwrap_or("?"),
            redeliver_amqp::url::redact(&opts.url),
            ac.as_deref().unwrap_or("?"),
        );
    }
    let broker_pid = match opts.broker_pid {
        Some(pid) if broker::is_beam(pid) => Some(pid),
        Some(pid) => {
            eprintln!("note: --broker-pid {pid} is not a beam.smp process here: broker CPU n/a");
            None
        }
        None if same_node => broker::broker_pid(&opts.management_url),
        None => None,
    };
    let ctx = Ctx {
        url: opts.url.clone(),
        conn,
        prefix: prefix.clone(),
        delay_quorum,
        delay_classic,
        sizes: opts.sizes.clone(),
        broker_pid,
        broker_version: amqp
            .map(|(v, _)| v)
            .or_else(|| management.map(|(v, _)| v))
            .unwrap_or_else(|| "(version unknown)".into()),
        pad: payload::padding().into(),
        seq: Arc::new(AtomicU64::new(0)),
        declared: Mutex::new(Vec::new()),
        pg,
    };
    eprintln!(
        "redeliver-bench{}: prefix '{prefix}', broker {} (OS pid {}), {} round(s)",
        if opts.short { " --short" } else { "" },
        redeliver_amqp::url::redact(&opts.url),
        broker_pid
            .map(|p| p.to_string())
            .unwrap_or_else(|| "unknown: broker CPU n/a".into()),
        opts.sizes.rounds
    );
    let run_started = std::time::Instant::now();
    let load_start = loadavg();
    let mut report = Report::default();
    let run = run_scenarios(&ctx, &opts.only, &mut report);
    tokio::select! {
        r = run => {
            if let Err(e) = r {
                report.errors.push(format!("{e:#}"));
            }
        }
        _ = tokio::signal::ctrl_c() => {
            report.errors.push("interrupted (Ctrl-C)".to_string());
        }
    }
    add_targets(&mut report);

    eprintln!("cleaning up objects with prefix '{prefix}'");
    let topologies: Vec<Topology> = std::mem::take(&mut *ctx.lock_declared());
    for t in topologies {
        if let Err(e) = t.delete(&ctx.conn).await {
            eprintln!("warning: deleting '{}': {e}", t.queue_name());
        }
    }
    for levels in [QueueKind::Quorum, QueueKind::Classic] {
        if let Err(e) = ctx.delay(levels).delete(&ctx.conn).await {
            eprintln!("warning: deleting the {} delay levels: {e}", levels.name());
        }
    }
    if let Some(pg) = &ctx.pg {
        eprintln!("dropping PostgreSQL schema '{}'", pg.schema.name());
        if let Err(e) = pg.drop_schema().await {
            eprintln!("warning: {e:#}");
        }
        pg.pool.close().await;
    }
    match broker::management_sweep(&opts.management_url, &prefix) {
        Ok(left) if !left.is_empty() => eprintln!("swept leftovers: {}", left.join(", ")),
        Ok(_) => {}
        Err(e) => eprintln!("note: management API sweep skipped ({e:#})"),
    }
    let _ = ctx.conn.close(200, "bench done".into()).await;

    // URLs may carry a password: the recorded command shows where they went, not what they are.
    let command = std::env::args()
        .skip(1)
        .map(|a| match a.split_once('=') {
            Some((flag, v)) if flag.starts_with("--") && v.contains("://") => format!("{flag}=URL"),
            _ if a.contains("://") => "URL".to_string(),
            _ => a,
        })
        .collect::<Vec<_>>()
        .join(" ");
    let header = format!(
        "### redeliver-bench{} results, RabbitMQ {}\n\nCommand: `redeliver-bench{}{command}` ({} rounds; run took {}). \
         {} Load average (1/5/15 min) at start {load_start}, at the end {}: \
         everything else on the host competes for the same CPUs as the broker.\n\n{}",
        if opts.short {
            " --short (sizes too small for meaningful numbers)"
        } else {
            ""
        },
        ctx.broker_version,
        if command.is_empty() { "" } else { " " },
        opts.sizes.rounds,
        elapsed(run_started.elapsed()),
        machine_line(&ctx),
        loadavg(),
        legend(opts.sizes.rounds)
    );
    let text = report.render(&header);
    println!("{text}");
    if let Some(path) = &opts.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.errors.is_empty() {
        bail!(
            "{} scenario(s) failed: see the Errors section",
            report.errors.len()
        );
    }
    Ok(())
}

async fn run_scenarios(ctx: &Ctx, only: &[Scenario], report: &mut Report) -> Result<()> {
    for s in Scenario::all() {
        if !only.contains(s) {
            continue;
        }
        eprintln!("== scenario {s:?}");
        let r = match s {
            Scenario::Happy => happy::run(ctx, report).await,
            Scenario::Retry => retry::run(ctx, report).await,
            Scenario::Delay => delay::run(ctx, report).await,
            Scenario::Park => park::run(ctx, report).await,
            Scenario::Scale => scale::run(ctx, report).await,
            Scenario::Inflight => inflight::run(ctx, report).await,
            Scenario::Inbox => inbox::run(ctx, report).await,
            Scenario::Outbox => outbox::run(ctx, report).await,
            Scenario::OutboxRefused => outbox_refused::run(ctx, report).await,
            Scenario::Hops => hops::run(ctx, report).await,
            Scenario::Native => native::run(ctx, report).await,
        };
        if let Err(e) = r {
            eprintln!("scenario {s:?} failed: {e:#}");
            report.errors.push(format!("scenario {s:?}: {e:#}"));
        }
    }
    Ok(())
}

fn add_targets(report: &mut Report) {
    let mut targets = Vec::new();
    let happy = |q: QueueKind| ("happy".to_string(), q, format!("happy path, {}", q.name()));
    for q in [QueueKind::Quorum, QueueKind::Classic] {
        let (scenario, q, name) = happy(q);
        if let Some(c) = report.comparison(&scenario, q, Side::RawBatch) {
            targets.push(Target::from_ratio(
                format!("{name}: msg/s"),
                "redeliver / rawb >= 0.95 (median of per-round ratios)",
                &c.msg_ratio,
                0.95,
                true,
            ));
            targets.push(Target::from_ratio(
                format!("{name}: consumer CPU per message"),
                "redeliver / rawb <= 1.05 (median of per-round ratios)",
                &c.cpu_ratio,
                1.05,
                false,
            ));
        }
    }
    for levels in [QueueKind::Quorum, QueueKind::Classic] {
        if let Some(c) = report.comparison(&retry::label(levels), QueueKind::Quorum, Side::Raw) {
            targets.push(Target::from_ratio(
                format!("retry round trip, {} delay levels: msg/s", levels.name()),
                "redeliver / raw doing the same round trip >= 0.9",
                &c.msg_ratio,
                0.9,
                true,
            ));
        }
    }
    if let Some(c) = report.comparison(inbox::LABEL, QueueKind::Quorum, Side::Raw) {
        targets.push(Target::from_ratio(
            "inbox (an INSERT per message, exactly once): msg/s".into(),
            "redeliver Inbox / hand-written transaction + ack >= 0.8 (median of per-round ratios)",
            &c.msg_ratio,
            0.8,
            true,
        ));
    }
    if let Some(r) = report.refused_ratio() {
        targets.push(Target::from_ratio(
            "outbox relay, 1 % of rows refused: good rows/s".into(),
            "with 1 % refused / none refused, same round >= 0.9 (median of per-round ratios)",
            &r,
            0.9,
            true,
        ));
    }
    targets.extend(native::targets(&report.native));
    for d in report.delay.iter().filter(|d| d.side == Side::Redeliver) {
        targets.push(Target {
            name: format!("delay accuracy ({})", d.label),
            goal: "p99 error <= 50 ms + 2 % of the delay".into(),
            measured: format!(
                "p99 of (error - 2 % of delay) = {:.1} ms; {:.1} % of probes within",
                d.p99_excess_ms, d.within_target_pct
            ),
            met: d.p99_excess_ms <= 50.0,
            conclusive: None,
        });
    }
    for p in report.park.iter().filter(|p| p.side == Side::Redeliver) {
        targets.push(Target {
            name: "RSS with parked retries".into(),
            goal: format!("{} parked within 10 % of none", p.parked),
            measured: format!(
                "{:.1} -> {:.1} MiB ({:+.1} %)",
                p.rss_none_mib,
                p.rss_parked_mib,
                p.growth_pct()
            ),
            met: p.growth_pct().abs() <= 10.0,
            conclusive: None,
        });
    }
    report.targets = targets;
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" / "))
        .unwrap_or_else(|_| "?".into())
}

fn machine_line(ctx: &Ctx) -> String {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok())
        })
        .unwrap_or(0);
    let database = match &ctx.pg {
        Some(pg) if pg.local => format!("; PostgreSQL {} on the same host", pg.version),
        Some(pg) => format!(
            "; PostgreSQL {} on another host (database CPU n/a)",
            pg.version
        ),
        None => String::new(),
    };
    format!(
        "Machine: {cpus} CPUs, {:.1} GiB RAM; RabbitMQ {}{}{database}; prefetch {PREFETCH} per consumer, worker concurrency {CONCURRENCY}, ~1 KB persistent JSON messages.",
        mem_kb as f64 / 1024.0 / 1024.0,
        ctx.broker_version,
        if ctx.broker_pid.is_some() {
            " on the same host"
        } else {
            " (broker process not found on this host: broker CPU n/a)"
        }
    )
}

fn elapsed(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{} min {} s", s / 60, s % 60)
    } else {
        format!("{s} s")
    }
}
