//! Scenario 2, retry path: every message fails once and comes back after 10 ms through the
//! delay levels. msg/s counts messages that completed the whole round trip (first delivery,
//! confirmed copy into the delay levels, ack, TTL hop, dead-lettering back to the queue, second
//! delivery, ack). Run with redeliver's default quorum delay levels, then with classic ones.
//! The broker's CPU over the drain is read too: the round trip is mostly broker work.

use anyhow::Result;

use super::{ms, rounds_of, Ctx};
use crate::child::{QueueKind, Side};
use crate::config::RETRY_DELAY;
use crate::proc_ctl::ChildProc;
use crate::report::{mib, Report, ThroughputRow};

/// Row label of the retry scenario with these delay levels.
pub fn label(levels: QueueKind) -> String {
    match levels {
        QueueKind::Quorum => "retry".into(),
        QueueKind::Classic => "retry, classic delay levels".into(),
    }
}

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    for levels in [QueueKind::Quorum, QueueKind::Classic] {
        let rows = rounds_of(
            ctx.sizes.rounds,
            &[Side::Raw, Side::Redeliver],
            |side, round| one(ctx, levels, side, round),
        )
        .await?;
        report.throughput.extend(rows);
    }
    Ok(())
}

async fn one(ctx: &Ctx, levels: QueueKind, side: Side, round: u32) -> Result<ThroughputRow> {
    let n = ctx.sizes.retry;
    let queue = QueueKind::Quorum;
    let retry_ms = RETRY_DELAY.as_millis() as u32;
    let fail_once = move |_| Some(retry_ms);
    let base = format!("retry-{}-{}-r{round}", levels.name(), side.short());
    let name = ctx.declare(&base, queue, levels).await?;
    let result = async {
        let args = ctx.child_args(side, &base, queue, levels);
        let mut child = ChildProc::spawn(&ctx.url, &args).await?;
        let publisher = ctx.publisher(side).await?;
        let published = publisher.backlog(&name, n, &fail_once).await?;
        let drain = ctx
            .drain(&mut child, "ok", n, Ctx::timeout_for(n * 2))
            .await?;

        let paced = ctx.sizes.paced / 2;
        child.start_run("ok", paced).await?;
        publisher
            .paced(&name, paced, ctx.sizes.paced_rate / 2, &fail_once)
            .await?;
        let lat = child.wait_done(Ctx::timeout_for(paced * 2)).await?;
        child.quit().await?;
        Ok::<_, anyhow::Error>(ThroughputRow {
            scenario: label(levels),
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
