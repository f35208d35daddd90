//! Scenario 1, happy path: a backlog of persistent 1 KB JSON messages, the handler does
//! nothing. msg/s is the drain rate of the backlog (published before the consumer starts, the
//! same way for both sides); latency comes from a second, paced phase with the consumer running,
//! because the latency of a pre-published backlog only measures how long it waited.

use anyhow::Result;

use super::{ms, rounds_of, Ctx};
use crate::child::{QueueKind, Side};
use crate::proc_ctl::ChildProc;
use crate::report::{mib, Report, ThroughputRow};

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    for queue in [QueueKind::Quorum, QueueKind::Classic] {
        let rows = rounds_of(
            ctx.sizes.rounds,
            &[Side::Raw, Side::RawBatch, Side::Redeliver],
            |side, round| one(ctx, queue, side, round),
        )
        .await?;
        report.throughput.extend(rows);
    }
    Ok(())
}

async fn one(ctx: &Ctx, queue: QueueKind, side: Side, round: u32) -> Result<ThroughputRow> {
    let n = ctx.sizes.happy;
    let levels = QueueKind::Quorum;
    let base = format!("happy-{}-{}-r{round}", queue.name(), side.short());
    let name = ctx.declare(&base, queue, levels).await?;
    let result = async {
        let args = ctx.child_args(side, &base, queue, levels);
        let mut child = ChildProc::spawn(&ctx.url, &args).await?;
        let publisher = ctx.publisher(side).await?;
        let published = publisher.backlog(&name, n, &|_| None).await?;
        let drain = ctx.drain(&mut child, "ok", n, Ctx::timeout_for(n)).await?;

        let paced = ctx.sizes.paced;
        child.start_run("ok", paced).await?;
        publisher
            .paced(&name, paced, ctx.sizes.paced_rate, &|_| None)
            .await?;
        let lat = child.wait_done(Ctx::timeout_for(paced)).await?;
        child.quit().await?;
        Ok::<_, anyhow::Error>(ThroughputRow {
            scenario: "happy".into(),
            queue,
            side,
            round,
            messages: n,
            consume_per_s: drain.rate(n),
            publish_per_s: n as f64 / published.as_secs_f64(),
            p50_ms: ms(lat.lat_p50_us),
            p99_ms: ms(lat.lat_p99_us),
            peak_rss_mib: mib(lat.hwm_kb),
            rss_delta_mib: mib(lat.hwm_kb.saturating_sub(lat.baseline_rss_kb)),
            cpu_us_per_msg: drain.cpu_us_per_msg(n),
            setup_cpu_ms: drain.setup_cpu_ms(),
            broker_cpu_us_per_msg: drain.broker_us_per_msg(n),
            db_cpu_us_per_msg: None,
        })
    }
    .await;
    ctx.drop_queue(&name).await;
    result
}
