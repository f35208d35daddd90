//! Scenario 10, hops per retry (issue 38, item 9): a jittered retry delay is random anyway, so
//! the worker publishes it rounded to at most [`ROUNDED_HOPS`] set bits of its tick count (one
//! level queue, that is one quorum enqueue and one dead-lettering, per set bit). Each round
//! drains the same backlog twice, in turn (exact first, then rounded first in the next round):
//!
//! - **exact**: the delay levels' `jittered_hops(0)`, every draw published as drawn;
//! - **rounded**: `jittered_hops(4)`, the default.
//!
//! Same policy on both: exponential from 100 ms, doubling, cap 6 s, full jitter, and every
//! message fails [`RETRIES`] times before it succeeds, so its retries draw from the whole
//! schedule (100 ms, 200 ms, ..., 3.2 s, 6 s). The delay levels have a granularity of 1 ms:
//! the tick counts (up to 100, 200, ..., 6,000) are those of the case (exponential from
//! 1 s, cap 60 s, at the default 10 ms), so the bit counts are the realistic ones while the
//! longest chain of waits is 12 s instead of 2 minutes.
//!
//! Per retry: hops (set bits of the tick count of the delay each copy carries, read back by the
//! handler from the retry's header), broker CPU (its `beam.smp` from before the backlog is
//! published to the last success, over all retries; the backlog's publish and last deliveries
//! are in it too, the same on both sides) and the bench process's CPU (the worker runs in it).
//! The ratios are rounded / exact of the same round.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use redeliver_amqp::{DelayConfig, Topology};
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_worker::{Context, Raw, Worker};
use tokio_util::sync::CancellationToken;

use super::Ctx;
use crate::child::Side;
use crate::config::{CONCURRENCY, PREFETCH};
use crate::report::{Report, RoundStats};
use crate::stats;

/// Failures of each message before it succeeds: one retry per step of the backoff schedule.
pub const RETRIES: u32 = 7;
/// The rounded side's hop limit (the default).
pub const ROUNDED_HOPS: u8 = redeliver_amqp::DEFAULT_JITTERED_HOPS;
/// Tick of the scenario's delay levels (see the module docs).
const GRANULARITY: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HopsVariant {
    Exact,
    Rounded,
}

impl HopsVariant {
    pub fn name(self) -> &'static str {
        match self {
            HopsVariant::Exact => "exact",
            HopsVariant::Rounded => "rounded",
        }
    }
    fn jittered_hops(self) -> u8 {
        match self {
            HopsVariant::Exact => 0,
            HopsVariant::Rounded => ROUNDED_HOPS,
        }
    }
}

/// One drain of scenario 10.
pub struct HopsRow {
    pub round: u32,
    pub variant: HopsVariant,
    pub messages: u64,
    pub retries: u64,
    pub drain_secs: f64,
    pub hops_per_retry: f64,
    /// Largest hop count of one retry.
    pub max_hops: u32,
    pub broker_cpu_us_per_retry: Option<f64>,
    pub bench_cpu_us_per_retry: f64,
    /// The policy's delays divided by this (`Sizes::hops_time_divisor`).
    pub time_divisor: u32,
}

/// The scenario's policy, the same on both sides: exponential from 100 ms, cap 6 s, both divided
/// by `divisor` (`--short`: 5).
fn policy(divisor: u32) -> RetryPolicy {
    let divisor = divisor.max(1);
    RetryPolicy::exponential(Duration::from_millis(100) / divisor)
        .cap(Duration::from_secs(6) / divisor)
        .jitter(Jitter::Full)
        .max_retries(RETRIES)
}

fn levels(ctx: &Ctx) -> DelayConfig {
    DelayConfig::new()
        .prefix(format!("{}hops-", ctx.prefix))
        .granularity(GRANULARITY)
}

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let result = async {
        for round in 0..ctx.sizes.rounds.max(1) {
            let mut order = [HopsVariant::Exact, HopsVariant::Rounded];
            if round % 2 == 1 {
                order.reverse();
            }
            for variant in order {
                let row = drain(ctx, round, variant).await?;
                eprintln!(
                    "   round {} hops {}: {} retries in {:.2} s, {:.2} hops/retry (max {}), broker {} us/retry, bench {:.1} us/retry",
                    round + 1,
                    variant.name(),
                    row.retries,
                    row.drain_secs,
                    row.hops_per_retry,
                    row.max_hops,
                    row.broker_cpu_us_per_retry
                        .map(|v| format!("{v:.1}"))
                        .unwrap_or_else(|| "n/a".into()),
                    row.bench_cpu_us_per_retry,
                );
                report.hops.push(row);
            }
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    if let Err(e) = levels(ctx).delete(&ctx.conn).await {
        eprintln!("warning: deleting the hops scenario's delay levels: {e}");
    }
    result
}

/// What the handler counts.
#[derive(Default)]
struct Counts {
    done: AtomicU64,
    retries: AtomicU64,
    hops: AtomicU64,
    max_hops: AtomicU64,
}

async fn drain(ctx: &Ctx, round: u32, variant: HopsVariant) -> Result<HopsRow> {
    let n = ctx.sizes.hops;
    let base = format!("hops-{}-r{round}", variant.name());
    let topology = Topology::new(base.clone())
        .prefix(ctx.prefix.clone())
        .delay(levels(ctx).jittered_hops(variant.jittered_hops()));
    topology
        .declare(&ctx.conn)
        .await
        .with_context(|| format!("declaring the topology of '{base}'"))?;
    let name = topology.queue_name();
    let token = CancellationToken::new();
    let counts = Arc::new(Counts::default());
    let result = async {
        let handler_counts = counts.clone();
        let builder = Worker::builder(ctx.url.as_str())
            .tls(crate::broker::tls_from_env())
            .topology(topology.clone())
            .policy(policy(ctx.sizes.hops_time_divisor))
            .prefetch(PREFETCH)
            .concurrency(CONCURRENCY)
            .handler(move |_: Raw, c: Context| {
                let counts = handler_counts.clone();
                async move {
                    if let Some(prev) = c.previous_delay() {
                        let ticks = prev.as_nanos().div_ceil(GRANULARITY.as_nanos());
                        let hops = u64::from(u64::try_from(ticks).unwrap_or(u64::MAX).count_ones());
                        counts.retries.fetch_add(1, Ordering::Relaxed);
                        counts.hops.fetch_add(hops, Ordering::Relaxed);
                        counts.max_hops.fetch_max(hops, Ordering::Relaxed);
                    }
                    if c.attempt() < RETRIES {
                        Err(HandlerError::transient("bench: fails until its last retry"))
                    } else {
                        counts.done.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                }
            });
        let worker = builder.build().context("building the worker")?;
        let status = worker.status_handle();
        let mut handle = tokio::spawn(worker.run(token.clone()));
        let ready_by = Instant::now() + Duration::from_secs(30);
        while !status.is_ready() {
            if handle.is_finished() || Instant::now() > ready_by {
                bail!("the worker did not start consuming");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let publisher = ctx.publisher(Side::Redeliver).await?;
        let (b0, c0) = (ctx.broker_cpu_us(), stats::cpu_us());
        let start = Instant::now();
        publisher.backlog(&name, n, &|_| None).await?;
        // The longest chain of waits is about 12 s; then the broker's pace.
        let deadline = start + Duration::from_secs(60) + Ctx::timeout_for(n * u64::from(RETRIES));
        while counts.done.load(Ordering::Relaxed) < n {
            if handle.is_finished() {
                bail!("the worker stopped");
            }
            if Instant::now() > deadline {
                bail!(
                    "{} of {n} messages completed their {RETRIES} retries in time",
                    counts.done.load(Ordering::Relaxed)
                );
            }
            tokio::select! {
                _ = &mut handle => {}
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        let elapsed = start.elapsed();
        let (b1, c1) = (ctx.broker_cpu_us(), stats::cpu_us());
        token.cancel();
        let _ = handle.await;
        let retries = counts.retries.load(Ordering::Relaxed);
        if retries != n * u64::from(RETRIES) {
            bail!(
                "{retries} retries counted, {} expected",
                n * u64::from(RETRIES)
            );
        }
        let per = |us: u64| us as f64 / retries.max(1) as f64;
        Ok::<_, anyhow::Error>(HopsRow {
            round,
            variant,
            messages: n,
            retries,
            drain_secs: elapsed.as_secs_f64(),
            hops_per_retry: per(counts.hops.load(Ordering::Relaxed)),
            max_hops: u32::try_from(counts.max_hops.load(Ordering::Relaxed)).unwrap_or(u32::MAX),
            broker_cpu_us_per_retry: b0.zip(b1).map(|(a, b)| per(b.saturating_sub(a))),
            bench_cpu_us_per_retry: per(c1.saturating_sub(c0)),
            time_divisor: ctx.sizes.hops_time_divisor,
        })
    }
    .await;
    token.cancel();
    if let Err(e) = topology.delete(&ctx.conn).await {
        eprintln!("warning: deleting '{name}': {e}");
    }
    result
}

/// rounded / exact of `f`, of every round where both ran.
fn ratio(rows: &[HopsRow], f: impl Fn(&HopsRow) -> Option<f64>) -> Option<RoundStats> {
    let of = |round: u32, v: HopsVariant| rows.iter().find(|r| r.round == round && r.variant == v);
    let mut rounds: Vec<u32> = rows.iter().map(|r| r.round).collect();
    rounds.sort_unstable();
    rounds.dedup();
    let ratios: Vec<f64> = rounds
        .into_iter()
        .filter_map(|round| {
            let exact = f(of(round, HopsVariant::Exact)?)?;
            let rounded = f(of(round, HopsVariant::Rounded)?)?;
            (exact > 0.0).then(|| rounded / exact)
        })
        .collect();
    (!ratios.is_empty()).then(|| RoundStats::of(ratios))
}

pub fn render(rows: &[HopsRow], s: &mut String) {
    use std::fmt::Write as _;
    let divided = match rows.first().map_or(1, |r| r.time_divisor) {
        1 => String::new(),
        d => format!("; this run divided both by {d} (`--short`), so its tick counts are smaller"),
    };
    let opt = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "n/a".into());
    let _ = writeln!(
        s,
        "\n#### Hops per retry (scenario 10): jittered delays exact against rounded to {ROUNDED_HOPS} hops\n"
    );
    let _ = writeln!(
        s,
        "One worker in the bench process; every message fails {RETRIES} times (transient error), then \
succeeds. Policy: exponential from 100 ms, cap 6 s, full jitter, on delay levels of 1 ms ticks \
(the tick counts, so the bit counts, of 1 s to 60 s at 10 ms){divided}. **exact**: `jittered_hops(0)`; \
**rounded**: `jittered_hops({ROUNDED_HOPS})`, the default. Hops = set bits of the tick count \
each retry copy carries; CPU per retry over the drain (backlog publish to last success).\n"
    );
    let _ = writeln!(
        s,
        "| round | delays | messages | retries | drain s | hops/retry | max hops | broker CPU us/retry | bench process CPU us/retry |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {:.2} | {:.2} | {} | {} | {:.1} |",
            r.round + 1,
            r.variant.name(),
            r.messages,
            r.retries,
            r.drain_secs,
            r.hops_per_retry,
            r.max_hops,
            opt(r.broker_cpu_us_per_retry),
            r.bench_cpu_us_per_retry,
        );
    }
    let _ = writeln!(
        s,
        "\n| rounded / exact, per round | median | min-max | spread | rounds |\n|---|---:|---|---:|---:|"
    );
    for (what, stats) in [
        ("hops per retry", ratio(rows, |r| Some(r.hops_per_retry))),
        (
            "broker CPU per retry",
            ratio(rows, |r| r.broker_cpu_us_per_retry),
        ),
        (
            "bench process CPU per retry",
            ratio(rows, |r| Some(r.bench_cpu_us_per_retry)),
        ),
        ("drain time", ratio(rows, |r| Some(r.drain_secs))),
    ] {
        if let Some(st) = stats {
            let _ = writeln!(
                s,
                "| {what} | {:.3} | {:.3}-{:.3} | {:.2} | {} |",
                st.median,
                st.min,
                st.max,
                st.spread(),
                st.values.len()
            );
        }
    }
}
