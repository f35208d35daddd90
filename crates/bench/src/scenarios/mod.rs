//! The run: shared context, the four scenarios in turn, targets, report and cleanup.

mod delay;
mod happy;
mod park;
mod retry;

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use lapin::Connection;
use redeliver_amqp::DelayConfig;
use redeliver_amqp::Topology;

use crate::broker;
use crate::child::{self, ChildArgs, QueueKind, RunReport, Side};
use crate::config::{Scenario, Sizes, CONCURRENCY, PREFETCH};
use crate::payload;
use crate::publish::BenchPublisher;
use crate::report::{Report, Target, ThroughputRow};

pub struct RunOptions {
    pub url: String,
    pub management_url: String,
    pub sizes: Sizes,
    pub short: bool,
    pub only: Vec<Scenario>,
    pub out: Option<PathBuf>,
}

/// What every scenario needs: the parent's connection, the run prefix and delay levels.
pub struct Ctx {
    pub url: String,
    pub management_url: String,
    pub conn: Connection,
    pub prefix: String,
    delay_quorum: DelayConfig,
    delay_classic: DelayConfig,
    pub sizes: Sizes,
    pad: Arc<str>,
    seq: Arc<AtomicU64>,
    declared: Mutex<Vec<Topology>>,
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
        BenchPublisher::new(
            side,
            &self.conn,
            self.delay_quorum.clone(),
            self.pad.clone(),
            self.seq.clone(),
        )
        .await
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
        }
    }

    /// Generous timeout for draining `n` messages (a stuck run fails instead of hanging).
    pub fn timeout_for(n: u64) -> Duration {
        Duration::from_secs(60 + n / 200)
    }
}

/// Messages per second between the RUN command and the event that completed it.
pub fn per_second(n: u64, r: &RunReport) -> f64 {
    let secs = r.last_ns.saturating_sub(r.go_ns) as f64 / 1e9;
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Runs `one` for both sides `rounds` times, alternating which side goes first (the broker
/// shares the machine: whatever else runs slows one run, never speeds one up, so the best of the
/// rounds is each side's figure, and every round's rate is kept in the row).
pub async fn best_of<'a, F, Fut>(
    rounds: u32,
    sides: &[Side],
    mut one: F,
) -> Result<Vec<ThroughputRow>>
where
    F: FnMut(Side, u32) -> Fut + 'a,
    Fut: std::future::Future<Output = Result<ThroughputRow>> + 'a,
{
    let mut best: Vec<ThroughputRow> = Vec::new();
    let mut runs: [Vec<f64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..rounds.max(1) {
        let mut order = sides.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for side in order {
            let row = one(side, round).await?;
            eprintln!(
                "   round {} {} {}: {:.0} msg/s consume ({:.1} us CPU/msg), {:.0} msg/s publish, p50 {:.1} ms, p99 {:.1} ms",
                round + 1,
                row.scenario,
                side.name(),
                row.consume_per_s,
                row.cpu_us_per_msg,
                row.publish_per_s,
                row.p50_ms,
                row.p99_ms
            );
            runs[side as usize].push(row.consume_per_s);
            match best.iter_mut().find(|b| b.side == side) {
                Some(b) if b.consume_per_s >= row.consume_per_s => {}
                Some(b) => *b = row,
                None => best.push(row),
            }
        }
    }
    best.sort_by_key(|r| r.side as usize);
    for b in &mut best {
        b.runs = runs[b.side as usize].clone();
    }
    Ok(best)
}

pub fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

const LEGEND: &str = "Sides: **raw** = hand-written lapin consumer acking each message \
(`delivery.ack(..).await`, as lapin's examples do); **rawb** = the same with `multiple = true` acks \
every 20 messages (10 % of the prefetch) and on idle; **redeliver** = `Worker` + `Publisher`. \
consume msg/s = drain rate of a pre-published backlog (retry: completed round trips); latency = \
publish -> handler in a second phase published at a fixed rate; CPU and RSS are the consumer \
process's own (each consumer runs in a child process; RSS delta = peak minus before connecting). \
Scenarios 1-2 run every side in alternating order and report each side's best round.";

pub async fn run_all(opts: RunOptions) -> Result<()> {
    let conn = broker::connect(&opts.url).await?;
    let prefix = broker::run_prefix();
    let delay_quorum = child::delay_config(&prefix, QueueKind::Quorum);
    let delay_classic = child::delay_config(&prefix, QueueKind::Classic);
    let ctx = Ctx {
        url: opts.url.clone(),
        management_url: opts.management_url.clone(),
        conn,
        prefix: prefix.clone(),
        delay_quorum,
        delay_classic,
        sizes: opts.sizes.clone(),
        pad: payload::padding().into(),
        seq: Arc::new(AtomicU64::new(0)),
        declared: Mutex::new(Vec::new()),
    };
    eprintln!(
        "redeliver-bench{}: prefix '{prefix}', broker {}",
        if opts.short { " --short" } else { "" },
        redeliver_amqp::url::redact(&opts.url)
    );
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
    match broker::management_sweep(&opts.management_url, &prefix) {
        Ok(left) if !left.is_empty() => eprintln!("swept leftovers: {}", left.join(", ")),
        Ok(_) => {}
        Err(e) => eprintln!("note: management API sweep skipped ({e:#})"),
    }
    let _ = ctx.conn.close(200, "bench done".into()).await;

    let header = format!(
        "## redeliver-bench{} results\n\n{} Load average (1/5/15 min) at start {load_start}, at the end {}: \
         everything else on the host competes for the same CPUs as the broker.\n\n{LEGEND}",
        if opts.short {
            " (--short: sizes too small for meaningful numbers)"
        } else {
            ""
        },
        machine_line(&ctx),
        loadavg()
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
    for q in [QueueKind::Quorum, QueueKind::Classic] {
        // Against the faster of the two raw consumers of this run.
        let raw = [Side::Raw, Side::RawBatch]
            .into_iter()
            .filter_map(|s| report.consume_rate("happy", q, s).map(|r| (s, r)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        if let (Some(rd), Some((raw_side, raw))) =
            (report.consume_rate("happy", q, Side::Redeliver), raw)
        {
            let ratio = rd / raw;
            targets.push(Target {
                name: format!("happy path, {}", q.name()),
                goal: "redeliver >= 0.95 x the faster raw consumer's msg/s".into(),
                measured: format!(
                    "{ratio:.2}x ({rd:.0} vs {raw:.0} msg/s, {})",
                    raw_side.name()
                ),
                met: ratio >= 0.95,
            });
        }
    }
    if let (Some(retry_rate), Some(happy)) = (
        report.consume_rate(
            &retry::label(QueueKind::Quorum),
            QueueKind::Quorum,
            Side::Redeliver,
        ),
        report.consume_rate("happy", QueueKind::Quorum, Side::Redeliver),
    ) {
        let ratio = retry_rate / happy;
        targets.push(Target {
            name: "retry path (quorum queue, quorum delay levels)".into(),
            goal: ">= 0.4 x redeliver happy-path msg/s (quorum)".into(),
            measured: format!("{ratio:.2}x ({retry_rate:.0} vs {happy:.0} msg/s)"),
            met: ratio >= 0.4,
        });
    }
    for d in report.delay.iter().filter(|d| d.side == Side::Redeliver) {
        targets.push(Target {
            name: format!("delay accuracy ({})", d.label),
            goal: "p99 error <= 50 ms + 2 % of the delay".into(),
            measured: format!(
                "p99 of (error - 2 % of delay) = {:.1} ms; {:.1} % of probes within",
                d.p99_excess_ms, d.within_target_pct
            ),
            met: d.p99_excess_ms <= 50.0,
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
    let version = broker::management_version(&ctx.management_url)
        .unwrap_or_else(|| "(version unknown: management API unreachable)".into());
    format!(
        "Machine: {cpus} CPUs, {:.1} GiB RAM; RabbitMQ {version} on the same host; prefetch {PREFETCH}, worker concurrency {CONCURRENCY}, ~1 KB persistent JSON messages.",
        mem_kb as f64 / 1024.0 / 1024.0
    )
}
