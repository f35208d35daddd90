//! Scenario 6, memory with the whole prefetch in flight: a consumer holds `prefetch` deliveries
//! of 64 KiB bodies at once (each handler waits until all of them have arrived; the raw lapin
//! consumer holds each `Delivery` in a task of its own, unacked, the same way), and its RSS is
//! read at that moment, against its RSS while consuming with nothing held. The growth per
//! delivery is what a prefetch of large messages costs: the body, plus whatever the consumer
//! keeps around it.

use anyhow::{bail, Result};

use super::{settled_rss, Ctx};
use crate::child::{QueueKind, Side};
use crate::config::{INFLIGHT_BODY_BYTES, PREFETCH};
use crate::proc_ctl::ChildProc;
use crate::report::{mib, InflightRow, Report};
use crate::stats;

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    for side in [Side::Raw, Side::Redeliver] {
        let row = one(ctx, side).await?;
        eprintln!(
            "   {}: RSS {:.1} MiB consuming, {:.1} MiB with {} x {:.0} KiB held ({:.1} KiB per delivery)",
            side.name(),
            row.rss_idle_mib,
            row.rss_held_mib,
            row.held,
            row.body_kib,
            row.per_delivery_kib()
        );
        report.inflight.push(row);
    }
    Ok(())
}

async fn one(ctx: &Ctx, side: Side) -> Result<InflightRow> {
    let held = u64::from(PREFETCH);
    let queue = QueueKind::Quorum;
    let base = format!("inflight-{}", side.short());
    let name = ctx.declare(&base, queue, QueueKind::Quorum).await?;
    let result = async {
        let args = ctx.child_args(side, &base, queue, QueueKind::Quorum);
        let mut child = ChildProc::spawn(&ctx.url, &args).await?;
        // Warm-up with 1 KB messages: the consumer, its buffers and the allocator's arenas are
        // all in use before the idle RSS is read.
        let small = ctx.publisher(side).await?;
        let warm = ctx.sizes.inflight_warmup;
        small.backlog(&name, warm, &|_| None).await?;
        child.run("ok", warm, Ctx::timeout_for(warm)).await?;
        let rss_idle = settled_rss(ctx, child.pid).await?;

        let big = ctx.publisher_sized(side, INFLIGHT_BODY_BYTES).await?;
        child.start_run("hold", held).await?;
        big.backlog(&name, held, &|_| None).await?;
        let done = child.wait_done(Ctx::timeout_for(held)).await?;
        if done.held_rss_kb == 0 {
            bail!(
                "the {} consumer did not report its RSS while holding",
                side.name()
            );
        }
        let rss_after = settled_rss(ctx, child.pid).await?;
        let peak = stats::mem(Some(child.pid))?.hwm_kb;
        child.quit().await?;
        Ok::<_, anyhow::Error>(InflightRow {
            side,
            held,
            body_kib: INFLIGHT_BODY_BYTES as f64 / 1024.0,
            rss_idle_mib: mib(rss_idle),
            rss_held_mib: mib(done.held_rss_kb),
            rss_after_mib: mib(rss_after),
            peak_rss_mib: mib(peak),
        })
    }
    .await;
    ctx.drop_queue(&name).await;
    result
}
