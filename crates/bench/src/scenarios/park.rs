//! Scenario 4, memory under waiting retries. One consumer process, two phases of the same
//! size and the same work (first delivery fails into a retry):
//! 1. every message comes back after 10 ms and succeeds -> nothing left waiting: RSS "none";
//! 2. every message asks for a 1 h delay -> all of them parked in the delay levels: RSS "parked".
//!
//! If the consumer held waiting retries in memory (timers, buffered copies), phase 2 would
//! grow by about a kilobyte per parked message.

use std::time::Duration;

use anyhow::{bail, Result};

use super::{settled_rss, Ctx};
use crate::broker;
use crate::child::{QueueKind, Side};
use crate::config::{PARK_DELAY, RETRY_DELAY};
use crate::proc_ctl::ChildProc;
use crate::report::{mib, ParkRow, Report};
use crate::stats;

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    for side in [Side::Raw, Side::Redeliver] {
        let row = one(ctx, side).await?;
        eprintln!(
            "   {}: RSS {:.1} MiB with none parked, {:.1} MiB with {} parked ({:+.1} %)",
            side.name(),
            row.rss_none_mib,
            row.rss_parked_mib,
            row.parked,
            row.growth_pct()
        );
        report.park.push(row);
    }
    Ok(())
}

/// Total ready messages in the delay level queues.
async fn parked(ctx: &Ctx) -> Result<u64> {
    let mut total = 0u64;
    let delay = ctx.delay(QueueKind::Quorum);
    for k in 0..delay.configured_levels() {
        total += u64::from(broker::queue_count(&ctx.conn, &delay.level_name(k)).await?);
    }
    Ok(total)
}

async fn one(ctx: &Ctx, side: Side) -> Result<ParkRow> {
    let n = ctx.sizes.parked;
    let queue = QueueKind::Quorum;
    let base = format!("park-{}", side.short());
    let name = ctx.declare(&base, queue, QueueKind::Quorum).await?;
    let result = async {
        let before = parked(ctx).await?;
        let mut child = ChildProc::spawn(
            &ctx.url,
            &ctx.child_args(side, &base, queue, QueueKind::Quorum),
        )
        .await?;
        let publisher = ctx.publisher(side).await?;

        let short_ms = RETRY_DELAY.as_millis() as u32;
        child.start_run("ok", n).await?;
        publisher.backlog(&name, n, &|_| Some(short_ms)).await?;
        child.wait_done(Ctx::timeout_for(n * 2)).await?;
        let rss_none = settled_rss(ctx, child.pid).await?;

        let long_ms = PARK_DELAY.as_millis() as u32;
        child.start_run("fail", n).await?;
        publisher.backlog(&name, n, &|_| Some(long_ms)).await?;
        child.wait_done(Ctx::timeout_for(n)).await?;
        // The handler has failed them all; wait for the copies to be confirmed in the levels.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut now_parked = parked(ctx).await?.saturating_sub(before);
        while now_parked < n {
            if tokio::time::Instant::now() > deadline {
                bail!("only {now_parked} of {n} messages reached the delay levels");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            now_parked = parked(ctx).await?.saturating_sub(before);
        }
        let rss_parked = settled_rss(ctx, child.pid).await?;
        let peak = stats::mem(Some(child.pid))?.hwm_kb;
        child.quit().await?;
        // The parked copies are bound for this queue: purge them with the delay levels at the end.
        Ok::<_, anyhow::Error>(ParkRow {
            side,
            parked: now_parked,
            rss_none_mib: mib(rss_none),
            rss_parked_mib: mib(rss_parked),
            peak_rss_mib: mib(peak),
        })
    }
    .await;
    ctx.drop_queue(&name).await;
    result
}
