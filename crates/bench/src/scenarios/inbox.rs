//! Scenario 7, exactly-once effects: every message is one INSERT into PostgreSQL. redeliver
//! runs it through the inbox (`Inbox::handler_fn` + `WorkerBuilder::handler`: `BEGIN`,
//! the inbox's `INSERT ... ON CONFLICT DO NOTHING`, the handler's INSERT, `COMMIT`, ack); the
//! raw side is a hand-written lapin consumer doing `BEGIN`, the same INSERT, `COMMIT`, ack.
//! Same queue type, prefetch, handlers in flight and pool size on both sides; msg/s is the drain
//! of a pre-published backlog as in scenario 1, latency comes from a paced phase after it.

use anyhow::Result;

use super::{ms, rounds_of, Ctx};
use crate::child::{QueueKind, Side};
use crate::config::DB_CONCURRENCY;
use crate::pg::{PgCtx, EFFECTS_TABLE};
use crate::proc_ctl::ChildProc;
use crate::report::{mib, Report, ThroughputRow};

/// The scenario's row label.
pub const LABEL: &str = "inbox";

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let pg = ctx.pg()?;
    let rows = rounds_of(
        ctx.sizes.rounds,
        &[Side::Raw, Side::Redeliver],
        |side, round| one(ctx, pg, side, round),
    )
    .await?;
    report.throughput.extend(rows);
    Ok(())
}

/// Empties the tables the consumers write: every drain starts from the same empty tables and
/// indexes, not from the rows of the rounds (and the other side) before.
async fn empty_tables(pg: &PgCtx) -> Result<()> {
    pg.truncate(&[pg.schema.inbox_table(), EFFECTS_TABLE]).await
}

async fn one(ctx: &Ctx, pg: &PgCtx, side: Side, round: u32) -> Result<ThroughputRow> {
    let n = ctx.sizes.inbox;
    let queue = QueueKind::Quorum;
    let levels = QueueKind::Quorum;
    let base = format!("inbox-{}-r{round}", side.short());
    let name = ctx.declare(&base, queue, levels).await?;
    let result = async {
        empty_tables(pg).await?;
        let mut args = ctx.child_args(side, &base, queue, levels);
        args.concurrency = DB_CONCURRENCY;
        args.pg_schema = Some(pg.schema.name().to_string());
        let mut child = ChildProc::spawn_with_db(&ctx.url, Some(pg.url.as_str()), &args).await?;
        let publisher = ctx.publisher(side).await?;
        let published = publisher.backlog(&name, n, &|_| None).await?;
        let drain = ctx
            .drain_with_db(&mut child, "ok", n, Ctx::timeout_for(n * 4))
            .await?;

        let paced = ctx.sizes.inbox_paced;
        child.start_run("ok", paced).await?;
        publisher
            .paced(&name, paced, ctx.sizes.inbox_paced_rate, &|_| None)
            .await?;
        let lat = child.wait_done(Ctx::timeout_for(paced * 4)).await?;
        child.quit().await?;
        Ok::<_, anyhow::Error>(ThroughputRow {
            scenario: LABEL.into(),
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
            db_cpu_us_per_msg: drain.db_us_per_msg(n),
        })
    }
    .await;
    ctx.drop_queue(&name).await;
    result
}
