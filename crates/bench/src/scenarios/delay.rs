//! Scenario 3, delay accuracy: each probe fails once and asks for a retry after a uniformly
//! random delay; the consumer measures (second delivery - first failure) - delay. Through
//! redeliver that is `retry_after(d)`, so the error includes the worker's own publish of the
//! copy; the raw consumer republishes through `DelayConfig::route` itself.
//!
//! Two ways to send the probes, each with quorum (default) and classic delay levels:
//! - paced: spread evenly over the delay range (2,000 over 5 s: 400/s), the steady load the
//!   accuracy target is about;
//! - burst: all at once, so a level queue sees hundreds of messages expire in the same tick and
//!   the error shows how fast the broker dead-letters them onward.

use std::time::Duration;

use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::Ctx;
use crate::child::{QueueKind, Side};
use crate::proc_ctl::ChildProc;
use crate::report::{DelayRow, Report};
use crate::stats::percentile_sorted;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Paced,
    Burst,
}

/// Row label; the targets look rows up by it.
pub fn label(mode: Mode, levels: QueueKind, ctx: &Ctx) -> String {
    let how = match mode {
        Mode::Paced => format!("paced, {}/s", paced_rate(ctx)),
        Mode::Burst => "burst, all at once".to_string(),
    };
    format!("{how}, {} delay levels", levels.name())
}

fn paced_rate(ctx: &Ctx) -> u64 {
    let secs = ctx.sizes.delay_max.as_secs_f64().max(0.001);
    ((ctx.sizes.delay_probes as f64 / secs).ceil() as u64).max(1)
}

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    for mode in [Mode::Paced, Mode::Burst] {
        for levels in [QueueKind::Quorum, QueueKind::Classic] {
            for side in [Side::Raw, Side::Redeliver] {
                let row = one(ctx, side, mode, levels).await?;
                eprintln!(
                    "   {} {}: error p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
                    row.label,
                    side.name(),
                    row.p50_ms,
                    row.p99_ms,
                    row.max_ms
                );
                report.delay.push(row);
            }
        }
    }
    Ok(())
}

async fn one(ctx: &Ctx, side: Side, mode: Mode, levels: QueueKind) -> Result<DelayRow> {
    let n = ctx.sizes.delay_probes;
    let max_ms = ctx.sizes.delay_max.as_millis() as u32;
    // Same delays for both sides.
    let mut rng = StdRng::seed_from_u64(7);
    let delays: Vec<u32> = (0..n).map(|_| rng.random_range(0..=max_ms)).collect();
    let queue = QueueKind::Quorum;
    let tag = match mode {
        Mode::Paced => "paced",
        Mode::Burst => "burst",
    };
    let base = format!("delay-{tag}-{}-{}", levels.name(), side.short());
    let name = ctx.declare(&base, queue, levels).await?;
    let result = async {
        let mut args = ctx.child_args(side, &base, queue, levels);
        args.track_delay = true;
        let mut child = ChildProc::spawn(&ctx.url, &args).await?;
        let publisher = ctx.publisher(side).await?;
        child.start_run("ok", n).await?;
        let delay_of = |i: u64| delays.get(i as usize).copied();
        match mode {
            Mode::Paced => {
                publisher
                    .paced(&name, n, paced_rate(ctx), &delay_of)
                    .await?
            }
            Mode::Burst => {
                publisher.backlog(&name, n, &delay_of).await?;
            }
        }
        let done = child
            .wait_done(2 * Duration::from_millis(u64::from(max_ms)) + Ctx::timeout_for(n))
            .await?;
        child.quit().await?;
        Ok::<_, anyhow::Error>(done)
    }
    .await;
    ctx.drop_queue(&name).await;
    let done = result?;
    if done.delay_errors.len() as u64 != n {
        bail!(
            "{}: {} of {n} probes measured",
            side.name(),
            done.delay_errors.len()
        );
    }
    let mut errs: Vec<i64> = done.delay_errors.iter().map(|(_, e)| *e).collect();
    errs.sort_unstable();
    let mut excess: Vec<i64> = done
        .delay_errors
        .iter()
        .map(|(d, e)| e - i64::from(*d) * 20) // 2 % of d ms, in us
        .collect();
    excess.sort_unstable();
    let within = excess.iter().filter(|x| **x <= 50_000).count();
    let ms = |us: i64| us as f64 / 1000.0;
    Ok(DelayRow {
        label: label(mode, levels, ctx),
        side,
        probes: n,
        max_delay_ms: u64::from(max_ms),
        p50_ms: ms(percentile_sorted(&errs, 0.50)),
        p99_ms: ms(percentile_sorted(&errs, 0.99)),
        max_ms: ms(errs.last().copied().unwrap_or(0)),
        min_ms: ms(errs.first().copied().unwrap_or(0)),
        p99_excess_ms: ms(percentile_sorted(&excess, 0.99)),
        within_target_pct: within as f64 * 100.0 / n as f64,
    })
}
