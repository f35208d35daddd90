//! Scenario 5, scale-out: 1, 2 and 4 redeliver worker processes (each a child process with its
//! own connection, prefetch 200 and concurrency 200) drain one backlog on one quorum queue, as
//! replicas of a deployment would. msg/s is the whole backlog over the time from the first
//! delivery any process handled to the last; the parent adds up the processes' counts (`STAT`)
//! since none of them alone reaches the total. Rounds are interleaved like scenarios 1-2
//! (1 2 4, then 4 2 1, ...).
//!
//! On a host whose broker shares the CPUs with the workers, the broker saturates first: more
//! processes then add consumer CPU, not throughput.

use std::time::Duration;

use anyhow::{bail, Result};
use futures::future::try_join_all;

use super::Ctx;
use crate::child::{QueueKind, Side};
use crate::config::{PREFETCH, SCALE_PROCESSES};
use crate::proc_ctl::ChildProc;
use crate::report::{Report, ScaleRow};

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    for round in 0..ctx.sizes.rounds.max(1) {
        let mut order = SCALE_PROCESSES.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for p in order {
            let row = one(ctx, p, round).await?;
            eprintln!(
                "   round {} scale-out {p} process(es): {:.0} msg/s total ({:.1} us CPU/msg, broker {}), {}-{} messages per process",
                round + 1,
                row.total_per_s,
                row.cpu_us_per_msg,
                row.broker_cpu_us_per_msg
                    .map(|b| format!("{b:.1} us/msg"))
                    .unwrap_or_else(|| "n/a".into()),
                row.min_share,
                row.max_share
            );
            report.scale.push(row);
        }
    }
    Ok(())
}

async fn one(ctx: &Ctx, processes: usize, round: u32) -> Result<ScaleRow> {
    let n = ctx.sizes.scale;
    let queue = QueueKind::Quorum;
    let base = format!("scale-{processes}-r{round}");
    let name = ctx.declare(&base, queue, QueueKind::Quorum).await?;
    let result = async {
        let args = ctx.child_args(Side::Redeliver, &base, queue, QueueKind::Quorum);
        let mut children =
            try_join_all((0..processes).map(|_| ChildProc::spawn(&ctx.url, &args))).await?;
        let publisher = ctx.publisher(Side::Redeliver).await?;
        publisher.backlog(&name, n, &|_| None).await?;

        let b0 = ctx.broker_cpu_us();
        // Every process starts together (each connects its worker on its first RUN); none of
        // them reaches `n` alone unless it is the only one.
        for c in children.iter_mut() {
            c.send_run("ok", n).await?;
        }
        for c in children.iter_mut() {
            c.wait_started().await?;
        }
        let deadline = tokio::time::Instant::now() + Ctx::timeout_for(n);
        let stats = loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut stats = Vec::with_capacity(children.len());
            for c in children.iter_mut() {
                stats.push(c.stat().await?);
            }
            let done: u64 = stats.iter().map(|s| s.ok).sum();
            if done >= n {
                break stats;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("{processes} worker processes handled {done} of {n} messages in time");
            }
        };
        let broker_us = b0
            .zip(ctx.broker_cpu_us())
            .map(|(a, b)| b.saturating_sub(a));
        for c in children {
            c.quit().await?;
        }
        let first = stats
            .iter()
            .filter(|s| s.first_ns > 0)
            .map(|s| s.first_ns)
            .min()
            .unwrap_or(0);
        let last = stats.iter().map(|s| s.last_ns).max().unwrap_or(0);
        let secs = last.saturating_sub(first) as f64 / 1e9;
        let cpu: u64 = stats.iter().map(|s| s.cpu_us).sum();
        Ok::<_, anyhow::Error>(ScaleRow {
            processes,
            prefetch: PREFETCH,
            messages: n,
            total_per_s: if secs > 0.0 { n as f64 / secs } else { 0.0 },
            cpu_us_per_msg: cpu as f64 / n as f64,
            broker_cpu_us_per_msg: broker_us.map(|b| b as f64 / n as f64),
            min_share: stats.iter().map(|s| s.ok).min().unwrap_or(0),
            max_share: stats.iter().map(|s| s.ok).max().unwrap_or(0),
        })
    }
    .await;
    ctx.drop_queue(&name).await;
    result
}
