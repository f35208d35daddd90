//! Scenario 11, native retries (issue 38, item 8): on RabbitMQ 4.3+ a quorum queue holds a
//! retry itself (`RetryMode::Native`: the worker consumes over AMQP 1.0 and settles a retry as
//! `modified` with `x-opt-delivery-time`), against the delay levels (`RetryMode::Levels`: a
//! confirmed copy into the TTL levels, then an ack) and against a hand-written lapin consumer
//! doing the levels round trip. Every consumer runs in a child process, on a quorum queue with
//! quorum delay levels, all with the policy: exponential from 1 s, cap 60 s, full
//! jitter. Two parts, each `--rounds` interleaved rounds (A B C, then C B A, ...):
//!
//! - **retry**: a backlog of messages that each fail their first delivery (transient error) and
//!   succeed on their one retry, so every delay is drawn from 0-1 s. retries/s = messages over
//!   the time from the first delivery handled to the last retry's success; broker CPU per retry
//!   = the broker's CPU over that drain (first delivery, retry, second delivery and its ack:
//!   the whole round trip) over the retries. Delay error = (retry handler start - first failure
//!   handler) - the delay the retry says it was scheduled with (`x-redeliver-delay-ms` of the
//!   worker's retry, native or copy; the raw consumer's own header), measured in the consumer
//!   process by one monotonic clock. Native retries also give handler start -
//!   `x-redeliver-not-before` (the Unix ms the worker asked the queue for).
//! - **happy**: a backlog published over AMQP 0-9-1 and drained by the worker in `Levels` mode
//!   (AMQP 0-9-1 consumer) and in `Native` mode (AMQP 1.0 consumer): msg/s, consumer and broker
//!   CPU per message, then a paced phase for the latency.
//!
//! On a broker before 4.3 only the levels sides run (the report says so).

use anyhow::Result;
use redeliver_amqp::BrokerVersion;

use super::{ms, Ctx};
use crate::child::{ChildRetryMode, QueueKind, Side};
use crate::proc_ctl::ChildProc;
use crate::report::{mib, Report, RoundStats, Target};
use crate::stats::{median, percentile_sorted};

/// One side of scenario 11.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NSide {
    /// Hand-written lapin consumer: confirmed copy into the delay levels, then ack.
    Raw,
    /// The worker, `RetryMode::Levels` (AMQP 0-9-1).
    Levels,
    /// The worker, `RetryMode::Native` (AMQP 1.0).
    Native,
}

impl NSide {
    pub fn name(self) -> &'static str {
        match self {
            NSide::Raw => "raw lapin, levels round trip",
            NSide::Levels => "worker, Levels (AMQP 0-9-1)",
            NSide::Native => "worker, Native (AMQP 1.0)",
        }
    }
    fn short(self) -> &'static str {
        match self {
            NSide::Raw => "raw",
            NSide::Levels => "levels",
            NSide::Native => "native",
        }
    }
    fn child_side(self) -> Side {
        match self {
            NSide::Raw => Side::Raw,
            NSide::Levels | NSide::Native => Side::Redeliver,
        }
    }
    fn mode(self) -> Option<ChildRetryMode> {
        match self {
            NSide::Raw => None,
            NSide::Levels => Some(ChildRetryMode::Levels),
            NSide::Native => Some(ChildRetryMode::Native),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Retry,
    Happy,
}

/// One drain of scenario 11.
pub struct NativeRow {
    pub part: Part,
    pub side: NSide,
    pub round: u32,
    pub messages: u64,
    pub drain_secs: f64,
    /// Retries (retry part) or messages (happy part) per second.
    pub per_s: f64,
    pub consumer_cpu_us: f64,
    pub broker_cpu_us: Option<f64>,
    pub setup_cpu_ms: f64,
    pub peak_rss_mib: f64,
    /// Retry part: mean delay the retries were scheduled with, ms.
    pub asked_mean_ms: f64,
    /// Retry part: delay-level hops per retry (set bits of the tick count; 0 for native).
    pub hops_per_retry: f64,
    /// Retry part, backlog drain: (retry - first failure) - delay asked, ms.
    pub backlog_err: Option<Pcts>,
    /// Retry part, paced phase: (retry - first failure) - delay asked, ms.
    pub err: Option<Pcts>,
    /// Native retries: handler start - `x-redeliver-not-before`, ms.
    pub nb_err: Option<Pcts>,
    /// Retry part: deliveries handled twice (a retry after its message completed, or first
    /// deliveries beyond the messages published).
    pub duplicates: u64,
    /// Happy part: latency of the paced phase, ms.
    pub lat_p50_ms: f64,
    pub lat_p99_ms: f64,
}

#[derive(Clone, Copy, Debug)]
pub struct Pcts {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub min: f64,
}

impl Pcts {
    /// Of microsecond values, in ms.
    fn of_us(mut v: Vec<i64>) -> Option<Self> {
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let f = |us: i64| us as f64 / 1000.0;
        Some(Pcts {
            p50: f(percentile_sorted(&v, 0.50)),
            p99: f(percentile_sorted(&v, 0.99)),
            max: f(v[v.len() - 1]),
            min: f(v[0]),
        })
    }
}

/// Whether the broker holds retries in a queue, and if not the note the report shows.
fn native_check(ctx: &Ctx) -> Result<(), String> {
    match BrokerVersion::parse(&ctx.broker_version) {
        Some(v) if v.holds_native_retries() => Ok(()),
        Some(_) => Err(format!(
            "RabbitMQ {} holds no retries in a queue (`RetryMode::Native` needs 4.3+): only the \
levels sides ran (raw lapin and the worker in `Levels` mode), no native figures and no native \
ratios",
            ctx.broker_version
        )),
        None => Err(format!(
            "the broker's version is unknown ({}): `RetryMode::Native` needs RabbitMQ 4.3+, so \
only the levels sides ran",
            ctx.broker_version
        )),
    }
}

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let native = native_check(ctx);
    if let Err(why) = &native {
        eprintln!("   note: {why}");
        report.native_note = Some(why.clone());
    }
    let retry_sides: &[NSide] = if native.is_ok() {
        &[NSide::Raw, NSide::Levels, NSide::Native]
    } else {
        &[NSide::Raw, NSide::Levels]
    };
    let happy_sides: &[NSide] = if native.is_ok() {
        &[NSide::Levels, NSide::Native]
    } else {
        &[NSide::Levels]
    };
    for (part, sides) in [(Part::Retry, retry_sides), (Part::Happy, happy_sides)] {
        for round in 0..ctx.sizes.rounds.max(1) {
            let mut order = sides.to_vec();
            if round % 2 == 1 {
                order.reverse();
            }
            for side in order {
                let row = match part {
                    Part::Retry => retry_one(ctx, side, round).await?,
                    Part::Happy => happy_one(ctx, side, round).await?,
                };
                log(&row);
                report.native.push(row);
            }
        }
    }
    Ok(())
}

fn log(r: &NativeRow) {
    let opt = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |v| format!("{v:.1}"));
    match r.part {
        Part::Retry => eprintln!(
            "   round {} native-retry {}: {:.0} retries/s ({:.2} s), broker {} us/retry, consumer {:.1} us/retry, asked mean {:.0} ms, {:.2} hops, backlog error p50 {} ms; paced error p50 {} ms p99 {} ms, not-before p50 {} p99 {}",
            r.round + 1,
            r.side.short(),
            r.per_s,
            r.drain_secs,
            opt(r.broker_cpu_us),
            r.consumer_cpu_us,
            r.asked_mean_ms,
            r.hops_per_retry,
            opt(r.backlog_err.map(|e| e.p50)),
            opt(r.err.map(|e| e.p50)),
            opt(r.err.map(|e| e.p99)),
            opt(r.nb_err.map(|e| e.p50)),
            opt(r.nb_err.map(|e| e.p99)),
        ),
        Part::Happy => eprintln!(
            "   round {} native-happy {}: {:.0} msg/s ({:.2} s), broker {} us/msg, consumer {:.1} us/msg ({:.0} ms before the first), p50 {:.1} ms p99 {:.1} ms",
            r.round + 1,
            r.side.short(),
            r.per_s,
            r.drain_secs,
            opt(r.broker_cpu_us),
            r.consumer_cpu_us,
            r.setup_cpu_ms,
            r.lat_p50_ms,
            r.lat_p99_ms,
        ),
    }
}

async fn retry_one(ctx: &Ctx, side: NSide, round: u32) -> Result<NativeRow> {
    let n = ctx.sizes.native_retry;
    let queue = QueueKind::Quorum;
    let base = format!("native-retry-{}-r{round}", side.short());
    let name = ctx.declare(&base, queue, queue).await?;
    let tick_ms = ctx.delay(queue).configured_granularity().as_millis().max(1);
    let result = async {
        let mut args = ctx.child_args(side.child_side(), &base, queue, queue);
        args.track_delay = true;
        args.jittered = true;
        args.retry_mode = side.mode();
        let mut child = ChildProc::spawn(&ctx.url, &args).await?;
        let publisher = ctx.publisher(side.child_side()).await?;
        // Every message fails once; the value is not read (the policy draws the delay).
        publisher.backlog(&name, n, &|_| Some(0)).await?;
        // Up to 1 s of delay after the last first delivery, then the broker's pace.
        let drain = ctx
            .drain(&mut child, "ok", n, Ctx::timeout_for(n * 2))
            .await?;
        // The delay error without a backlog: in the drain above a retry that comes back through
        // the delay levels queues behind the first deliveries still waiting.
        let paced = ctx.sizes.native_paced;
        child.start_run("ok", paced).await?;
        publisher
            .paced(&name, paced, ctx.sizes.native_paced_rate, &|_| Some(0))
            .await?;
        let lat = child.wait_done(Ctx::timeout_for(paced * 2)).await?;
        child.quit().await?;
        let r = &drain.report;
        let errors = &r.delay_errors;
        let count = errors.len().max(1) as f64;
        let asked_mean_ms = errors.iter().map(|(ms, _)| f64::from(*ms)).sum::<f64>() / count;
        let hops_per_retry = if side == NSide::Native {
            0.0
        } else {
            errors
                .iter()
                .map(|(ms, _)| f64::from(u128::from(*ms).div_ceil(tick_ms).count_ones()))
                .sum::<f64>()
                / count
        };
        let duplicates = r.duplicates + r.fail.saturating_sub(n);
        if duplicates > 0 {
            eprintln!(
                "   warning: {duplicates} deliveries handled twice ({} retries, {} first deliveries handled)",
                r.duplicates, r.fail
            );
        }
        Ok::<_, anyhow::Error>(NativeRow {
            part: Part::Retry,
            side,
            round,
            messages: n,
            drain_secs: n as f64 / drain.rate(n).max(f64::MIN_POSITIVE),
            per_s: drain.rate(n),
            consumer_cpu_us: drain.cpu_us_per_msg(n),
            broker_cpu_us: drain.broker_us_per_msg(n),
            setup_cpu_ms: drain.setup_cpu_ms(),
            peak_rss_mib: mib(r.hwm_kb),
            asked_mean_ms,
            hops_per_retry,
            backlog_err: Pcts::of_us(errors.iter().map(|(_, e)| *e).collect()),
            err: Pcts::of_us(lat.delay_errors.iter().map(|(_, e)| *e).collect()),
            nb_err: Pcts::of_us(lat.not_before_errors.clone()),
            duplicates: duplicates + lat.duplicates + lat.fail.saturating_sub(paced),
            lat_p50_ms: 0.0,
            lat_p99_ms: 0.0,
        })
    }
    .await;
    ctx.drop_queue(&name).await;
    result
}

async fn happy_one(ctx: &Ctx, side: NSide, round: u32) -> Result<NativeRow> {
    let n = ctx.sizes.native_happy;
    let queue = QueueKind::Quorum;
    let base = format!("native-happy-{}-r{round}", side.short());
    let name = ctx.declare(&base, queue, queue).await?;
    let result = async {
        let mut args = ctx.child_args(side.child_side(), &base, queue, queue);
        args.retry_mode = side.mode();
        args.dedup = true;
        let mut child = ChildProc::spawn(&ctx.url, &args).await?;
        // Published over AMQP 0-9-1 for both modes, by redeliver's Publisher.
        let publisher = ctx.publisher(side.child_side()).await?;
        publisher.backlog(&name, n, &|_| None).await?;
        let drain = ctx.drain(&mut child, "ok", n, Ctx::timeout_for(n)).await?;
        let duplicates = drain.report.duplicates;
        if duplicates > 0 {
            eprintln!("   warning: {duplicates} messages handled twice (a consumer session lost?)");
        }
        let paced = ctx.sizes.paced / 2;
        child.start_run("ok", paced).await?;
        publisher
            .paced(&name, paced, ctx.sizes.paced_rate, &|_| None)
            .await?;
        let lat = child.wait_done(Ctx::timeout_for(paced)).await?;
        child.quit().await?;
        Ok::<_, anyhow::Error>(NativeRow {
            part: Part::Happy,
            side,
            round,
            messages: n,
            drain_secs: n as f64 / drain.rate(n).max(f64::MIN_POSITIVE),
            per_s: drain.rate(n),
            consumer_cpu_us: drain.cpu_us_per_msg(n),
            broker_cpu_us: drain.broker_us_per_msg(n),
            setup_cpu_ms: drain.setup_cpu_ms(),
            peak_rss_mib: mib(lat.hwm_kb),
            asked_mean_ms: 0.0,
            hops_per_retry: 0.0,
            backlog_err: None,
            err: None,
            nb_err: None,
            duplicates,
            lat_p50_ms: ms(lat.lat_p50_us),
            lat_p99_ms: ms(lat.lat_p99_us),
        })
    }
    .await;
    ctx.drop_queue(&name).await;
    result
}

fn row(rows: &[NativeRow], part: Part, side: NSide, round: u32) -> Option<&NativeRow> {
    rows.iter()
        .find(|r| r.part == part && r.side == side && r.round == round)
}

fn rounds(rows: &[NativeRow]) -> Vec<u32> {
    let mut v: Vec<u32> = rows.iter().map(|r| r.round).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// `a / b` of `f`, per round where both ran.
fn ratio(
    rows: &[NativeRow],
    part: Part,
    a: NSide,
    b: NSide,
    f: impl Fn(&NativeRow) -> Option<f64>,
) -> Option<RoundStats> {
    let ratios: Vec<f64> = rounds(rows)
        .into_iter()
        .filter_map(|round| {
            let x = f(row(rows, part, a, round)?)?;
            let y = f(row(rows, part, b, round)?)?;
            (y > 0.0).then(|| x / y)
        })
        .collect();
    (!ratios.is_empty()).then(|| RoundStats::of(ratios))
}

/// Broker CPU a retry adds to a message of the same transport and round: the retry part's
/// broker CPU per retry minus the happy part's broker CPU per message (the raw side has no
/// happy row of its own: the levels worker's, same transport, stands in).
fn marginal(rows: &[NativeRow], side: NSide, round: u32) -> Option<f64> {
    let happy_side = if side == NSide::Raw {
        NSide::Levels
    } else {
        side
    };
    let retry = row(rows, Part::Retry, side, round)?.broker_cpu_us?;
    let happy = row(rows, Part::Happy, happy_side, round)?.broker_cpu_us?;
    Some(retry - happy)
}

fn marginal_ratio(rows: &[NativeRow], a: NSide, b: NSide) -> Option<RoundStats> {
    let ratios: Vec<f64> = rounds(rows)
        .into_iter()
        .filter_map(|round| {
            let x = marginal(rows, a, round)?;
            let y = marginal(rows, b, round)?;
            (y > 0.0).then(|| x / y)
        })
        .collect();
    (!ratios.is_empty()).then(|| RoundStats::of(ratios))
}

/// The targets, from a run that had native sides.
pub fn targets(rows: &[NativeRow]) -> Vec<Target> {
    let mut t = Vec::new();
    if let Some(r) = ratio(rows, Part::Retry, NSide::Native, NSide::Levels, |r| {
        r.broker_cpu_us
    }) {
        t.push(Target::from_ratio(
            "native retry: broker CPU per retry (whole round trip)".into(),
            "Native / Levels worker <= 0.35 (median of per-round ratios)",
            &r,
            0.35,
            false,
        ));
    }
    if let Some(r) = marginal_ratio(rows, NSide::Native, NSide::Levels) {
        t.push(Target::from_ratio(
            "native retry: broker CPU a retry adds (round trip - happy path, same transport)"
                .into(),
            "Native / Levels worker <= 0.35 (median of per-round ratios)",
            &r,
            0.35,
            false,
        ));
    }
    if let Some(r) = ratio(rows, Part::Happy, NSide::Native, NSide::Levels, |r| {
        Some(r.per_s)
    }) {
        t.push(Target::from_ratio(
            "happy path over AMQP 1.0 (Native) against AMQP 0-9-1 (Levels): msg/s".into(),
            "Native / Levels worker >= 0.95 (median of per-round ratios)",
            &r,
            0.95,
            true,
        ));
    }
    t
}

pub fn render(rows: &[NativeRow], note: Option<&str>, s: &mut String) {
    use std::fmt::Write as _;
    let opt = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |v| format!("{v:.1}"));
    let pct = |p: Option<Pcts>, f: fn(&Pcts) -> f64| {
        p.map_or_else(|| "-".into(), |p| format!("{:.1}", f(&p)))
    };
    let _ = writeln!(
        s,
        "\n#### Native retries (scenario 11): the queue holds the retry (AMQP 1.0) against the delay levels\n"
    );
    let _ = writeln!(
        s,
        "Quorum queue, quorum delay levels, policy exponential from 1 s, cap 60 s, full jitter; \
every consumer in a child process, prefetch and concurrency 200. **raw lapin, levels round \
trip**: a hand-written lapin consumer that draws the same policy's delay, rounds it as the worker \
does (`round_jittered`), publishes a confirmed copy to `DelayConfig::route` and acks after the \
confirm. **Levels**: the worker, `RetryMode::Levels` (AMQP 0-9-1). **Native**: the worker, \
`RetryMode::Native` (AMQP 1.0, a retry is `modified` with `x-opt-delivery-time`). Retry part: \
every message fails its first delivery (transient) and succeeds on its one retry (delays 0-1 s); \
broker CPU per retry = the broker's CPU from the first delivery handled to the last success over \
the retries (the whole round trip: both deliveries and settlements). Delay error = (retry \
handler start - first failure handler return) - the delay the retry was scheduled with \
(`x-redeliver-delay-ms`), one monotonic clock in the consumer process; native also: retry \
handler start - `x-redeliver-not-before`. *backlog*: in the drain of the backlog (a retry coming \
back through the delay levels queues behind the first deliveries still waiting); *paced*: a second \
phase, messages published at a fixed rate below every side's capacity, the accuracy itself. Happy part: a backlog published over AMQP 0-9-1, drained \
by the worker in each mode, then a paced phase for the latency. *handled twice*: deliveries a \
consumer handled again after it had completed them (not counted as done): a consumer session was \
lost with deliveries unsettled and the broker gave them back; that round's figures include the \
reconnection and the repeated work.\n"
    );
    if let Some(note) = note {
        let _ = writeln!(s, "**Note: {note}.**\n");
    }
    let _ = writeln!(
        s,
        "| round | side | retries | drain s | retries/s | broker CPU us/retry | consumer CPU us/retry | delay asked, mean ms | hops/retry | backlog: delay error p50 ms | p99 ms | paced: delay error p50 ms | p99 ms | min-max ms | paced: not-before error p50 ms | p99 ms | handled twice | peak RSS MiB |"
    );
    let _ = writeln!(
        s,
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"
    );
    for r in rows.iter().filter(|r| r.part == Part::Retry) {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {:.0} | {} | {:.1} | {:.0} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} |",
            r.round + 1,
            r.side.name(),
            r.messages,
            r.drain_secs,
            r.per_s,
            opt(r.broker_cpu_us),
            r.consumer_cpu_us,
            r.asked_mean_ms,
            r.hops_per_retry,
            pct(r.backlog_err, |p| p.p50),
            pct(r.backlog_err, |p| p.p99),
            pct(r.err, |p| p.p50),
            pct(r.err, |p| p.p99),
            r.err
                .map_or_else(|| "-".into(), |p| format!("{:.1}-{:.1}", p.min, p.max)),
            pct(r.nb_err, |p| p.p50),
            pct(r.nb_err, |p| p.p99),
            r.duplicates,
            r.peak_rss_mib,
        );
    }
    let _ = writeln!(
        s,
        "\n| round | side (happy path) | messages | drain s | msg/s | broker CPU us/msg | consumer CPU us/msg | CPU before the first ms | p50 latency ms | p99 latency ms | handled twice | peak RSS MiB |"
    );
    let _ = writeln!(
        s,
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows.iter().filter(|r| r.part == Part::Happy) {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {:.0} | {} | {:.1} | {:.0} | {:.1} | {:.1} | {} | {:.1} |",
            r.round + 1,
            r.side.name(),
            r.messages,
            r.drain_secs,
            r.per_s,
            opt(r.broker_cpu_us),
            r.consumer_cpu_us,
            r.setup_cpu_ms,
            r.lat_p50_ms,
            r.lat_p99_ms,
            r.duplicates,
            r.peak_rss_mib,
        );
    }

    // Medians per side.
    let _ = writeln!(
        s,
        "\n| part | side | rounds | per s (median) | broker CPU us (median) | consumer CPU us (median) | broker CPU a retry adds us (median) | paced delay error p50 ms (median) | p99 ms (median) |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for part in [Part::Retry, Part::Happy] {
        for side in [NSide::Raw, NSide::Levels, NSide::Native] {
            let of: Vec<&NativeRow> = rows
                .iter()
                .filter(|r| r.part == part && r.side == side)
                .collect();
            if of.is_empty() {
                continue;
            }
            let med = |f: &dyn Fn(&NativeRow) -> Option<f64>| {
                let v: Vec<f64> = of.iter().filter_map(|r| f(r)).collect();
                (!v.is_empty()).then(|| median(&v))
            };
            let add = (part == Part::Retry)
                .then(|| {
                    let v: Vec<f64> = of
                        .iter()
                        .filter_map(|r| marginal(rows, side, r.round))
                        .collect();
                    (!v.is_empty()).then(|| median(&v))
                })
                .flatten();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} |",
                match part {
                    Part::Retry => "retry",
                    Part::Happy => "happy",
                },
                side.name(),
                of.len(),
                med(&|r| Some(r.per_s)).unwrap_or(0.0),
                opt(med(&|r| r.broker_cpu_us)),
                opt(med(&|r| Some(r.consumer_cpu_us))),
                if part == Part::Retry {
                    opt(add)
                } else {
                    "-".into()
                },
                if part == Part::Retry {
                    opt(med(&|r| r.err.map(|e| e.p50)))
                } else {
                    "-".into()
                },
                if part == Part::Retry {
                    opt(med(&|r| r.err.map(|e| e.p99)))
                } else {
                    "-".into()
                },
            );
        }
    }

    // Per-round ratios.
    let _ = writeln!(
        s,
        "\n| per-round ratio | median | min-max | spread (max/min) | rounds | every round |"
    );
    let _ = writeln!(s, "|---|---:|---|---:|---:|---|");
    let mut line = |what: String, st: Option<RoundStats>| {
        if let Some(st) = st {
            let every: Vec<String> = st.values.iter().map(|v| format!("{v:.2}")).collect();
            let _ = writeln!(
                s,
                "| {what} | **{:.2}x** | {:.2}-{:.2} | {:.2} | {} | {} |",
                st.median,
                st.min,
                st.max,
                st.spread(),
                st.values.len(),
                every.join(" / ")
            );
        }
    };
    let pairs = [
        (NSide::Native, NSide::Levels),
        (NSide::Native, NSide::Raw),
        (NSide::Levels, NSide::Raw),
    ];
    for (a, b) in pairs {
        let ab = format!("{} / {}", a.short(), b.short());
        line(
            format!("retry: broker CPU per retry, {ab}"),
            ratio(rows, Part::Retry, a, b, |r| r.broker_cpu_us),
        );
        line(
            format!("retry: broker CPU a retry adds, {ab}"),
            marginal_ratio(rows, a, b),
        );
        line(
            format!("retry: retries/s, {ab}"),
            ratio(rows, Part::Retry, a, b, |r| Some(r.per_s)),
        );
        line(
            format!("retry: consumer CPU per retry, {ab}"),
            ratio(rows, Part::Retry, a, b, |r| Some(r.consumer_cpu_us)),
        );
    }
    line(
        "happy: msg/s, native / levels".into(),
        ratio(rows, Part::Happy, NSide::Native, NSide::Levels, |r| {
            Some(r.per_s)
        }),
    );
    line(
        "happy: broker CPU per message, native / levels".into(),
        ratio(rows, Part::Happy, NSide::Native, NSide::Levels, |r| {
            r.broker_cpu_us
        }),
    );
    line(
        "happy: consumer CPU per message, native / levels".into(),
        ratio(rows, Part::Happy, NSide::Native, NSide::Levels, |r| {
            Some(r.consumer_cpu_us)
        }),
    );
}
