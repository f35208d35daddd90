//! Scenario 9, the outbox relay with refused rows (issue 37): does a row the broker refuses
//! slow down the rows behind it? Each round drains two committed backlogs of the same size, in
//! turn (clean then refused, the next round refused then clean):
//!
//! - **clean**: every row goes to a quorum queue a plain auto-ack consumer reads;
//! - **refused**: the same, but every 100th row ([`REFUSED_EVERY`]) is published to the default
//!   exchange with a routing key no queue has: the broker returns it (mandatory publish), the
//!   relay records the refusal and tries it again after [`refused_policy`]'s backoff, and parks
//!   it after its last retry.
//!
//! good rows/s = good rows / (the relay reports `Relaying`, connected -> the consumer received
//! the last good row), so the relay's connection and schema check are not timed. The ratio is
//! refused / clean of the same round. After each drain the relay is stopped (its last round
//! commits) and the accounting is checked: every good row reached the consumer and left the
//! table, every refused row is still in it (retrying or parked), nothing else is.
//!
//! Relay and consumer run in the bench process, as in scenario 8.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use futures::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use redeliver_core::RetryPolicy;
use redeliver_postgres::{OutboxMessage, RelayState};
use tokio_util::sync::CancellationToken;

use super::outbox::{body, relay, stop_relay, store_backlog};
use super::Ctx;
use crate::child::QueueKind;
use crate::payload;
use crate::pg::PgCtx;
use crate::report::{OutboxRefusedRow, RefusedVariant, Report};
use crate::stats;

/// One row in this many is refused in the refused variant (1 %).
pub const REFUSED_EVERY: u64 = 100;
/// Which row of each hundred: not the last, so the backlog ends with a good row.
const REFUSED_AT: u64 = REFUSED_EVERY / 2;

/// The relay's policy in both variants: 100 ms doubling, full jitter, 3 retries, so a refused row
/// is refused 4 times and parked inside the drain (its three backoffs add up to 0.7 s at most).
/// The default policy (1 s doubling to 5 min, 12 retries) would retry each refused row once or
/// twice during a 3-second drain and park none: this one does more refusal work per refused
/// row, and takes the park path too, in the measured window.
pub fn refused_policy() -> RetryPolicy {
    RetryPolicy::exponential(Duration::from_millis(100))
        .cap(Duration::from_secs(1))
        .max_retries(3)
}

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let pg = ctx.pg()?;
    for round in 0..ctx.sizes.rounds.max(1) {
        let mut order = [RefusedVariant::Clean, RefusedVariant::Refused];
        if round % 2 == 1 {
            order.reverse();
        }
        for variant in order {
            let row = drain(ctx, pg, round, variant).await?;
            eprintln!(
                "   round {} outbox {}: {} good rows in {:.2} s = {:.0} good rows/s ({} refused: {} refusals recorded, {} retrying, {} parked at the end)",
                round + 1,
                variant.name(),
                row.good,
                row.drain_secs,
                row.good_per_s,
                row.refused,
                row.refusals,
                row.retrying,
                row.parked
            );
            report.outbox_refused.push(row);
        }
    }
    Ok(())
}

/// What the consumer saw.
#[derive(Default)]
struct Seen {
    received: HashSet<String>,
    /// When the last good row arrived.
    done_at: Option<Instant>,
    duplicates: u64,
    /// Deliveries whose message id is no good row's.
    unexpected: u64,
}

/// One drain of a committed backlog of `outbox_backlog` rows.
async fn drain(
    ctx: &Ctx,
    pg: &PgCtx,
    round: u32,
    variant: RefusedVariant,
) -> Result<OutboxRefusedRow> {
    let base = format!("outbox-{}-r{round}", variant.name());
    let name = ctx
        .declare(&base, QueueKind::Quorum, QueueKind::Quorum)
        .await?;
    // No queue has this name (nothing declares it): the default exchange returns what goes there.
    let nowhere = format!("{}outbox-nowhere", ctx.prefix);
    let token = CancellationToken::new();
    let result = async {
        pg.truncate(&[pg.schema.outbox_table()]).await?;
        let n = ctx.sizes.outbox_backlog;
        let pad = payload::padding();
        let mut good = HashSet::new();
        let mut refused = 0u64;
        let mut backlog = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
        for seq in 0..n {
            let refuse = variant == RefusedVariant::Refused && seq % REFUSED_EVERY == REFUSED_AT;
            let to = if refuse { &nowhere } else { &name };
            let m = OutboxMessage::new("", to.as_str(), body(&pad, seq)?);
            if refuse {
                refused += 1;
            } else {
                good.insert(m.message_id.clone());
            }
            backlog.push(m);
        }
        store_backlog(pg, &backlog).await?;
        drop(backlog);
        let good = Arc::new(good);

        // The plain consumer: auto-ack, done when every good row has come.
        let ch = ctx
            .conn
            .create_channel()
            .await
            .context("opening a channel")?;
        let mut deliveries = ch
            .basic_consume(
                name.as_str().into(),
                "rbench-outbox-refused".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("basic.consume on '{name}'"))?;
        let mut consumer = {
            let (good, token) = (good.clone(), token.clone());
            tokio::spawn(async move {
                let mut seen = Seen::default();
                while seen.received.len() < good.len() {
                    let next = tokio::select! {
                        _ = token.cancelled() => break,
                        d = deliveries.next() => d,
                    };
                    let Some(d) = next else {
                        bail!("the consumer stream ended (channel or connection closed)");
                    };
                    let d = d.context("delivery error")?;
                    let id = d
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.as_str().to_string())
                        .unwrap_or_default();
                    if !good.contains(&id) {
                        seen.unexpected += 1;
                    } else if !seen.received.insert(id) {
                        seen.duplicates += 1;
                    }
                }
                if seen.received.len() == good.len() {
                    seen.done_at = Some(Instant::now());
                }
                Ok::<_, anyhow::Error>(seen)
            })
        };

        let relay = relay(ctx, pg).await?.policy(refused_policy());
        let mut status = relay.status_handle();
        let relay = tokio::spawn(relay.run(token.clone()));
        if status
            .wait_for_timeout(Duration::from_secs(30), |s| *s == RelayState::Relaying)
            .await
            .is_none()
        {
            let _ = stop_relay(&token, relay).await;
            bail!("the outbox relay did not connect within 30 s");
        }
        let start = Instant::now();
        let (b0, d0, c0) = (ctx.broker_cpu_us(), pg.cpu_us(), stats::cpu_us());
        let deadline = start + Ctx::timeout_for(n);
        let seen = loop {
            tokio::select! {
                r = &mut consumer => break r,
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            if relay.is_finished() {
                stop_relay(&token, relay).await?;
                bail!("the relay stopped before every good row reached the consumer");
            }
            if Instant::now() > deadline {
                let _ = stop_relay(&token, relay).await;
                bail!("the good rows of the outbox did not all reach the consumer in time");
            }
        };
        let (b1, d1, c1) = (ctx.broker_cpu_us(), pg.cpu_us(), stats::cpu_us());
        let stopped = stop_relay(&token, relay).await;
        let _ = ch.close(200, "bench done".into()).await;
        stopped?;
        let seen = match seen {
            Ok(Ok(seen)) => seen,
            Ok(Err(e)) => return Err(e.context("the outbox consumer failed")),
            Err(e) => bail!("the outbox consumer panicked: {e}"),
        };
        let done_at = seen.done_at.ok_or_else(|| {
            anyhow!(
                "{} of {} good rows reached the consumer",
                seen.received.len(),
                good.len()
            )
        })?;
        if seen.unexpected > 0 {
            bail!(
                "{} deliveries that are no good row's reached the consumer",
                seen.unexpected
            );
        }

        // The accounting, once the relay's last round committed.
        let left = left_in_outbox(pg, &name).await?;
        let pending = redeliver_postgres::pending(&pg.pool, &pg.schema)
            .await
            .context("counting the outbox")?;
        if left.good > 0 {
            bail!(
                "{} good rows reached the consumer but are still in the outbox",
                left.good
            );
        }
        if left.rows != refused || pending.count + pending.parked != refused {
            bail!(
                "{refused} rows were refused but the outbox holds {} (pending {}, parked {})",
                left.rows,
                pending.count,
                pending.parked
            );
        }
        let elapsed = done_at.saturating_duration_since(start);
        let per_good = |us: Option<u64>| us.map(|u| u as f64 / good.len().max(1) as f64);
        Ok::<_, anyhow::Error>(OutboxRefusedRow {
            round,
            variant,
            rows: n,
            good: good.len() as u64,
            refused,
            drain_secs: elapsed.as_secs_f64(),
            good_per_s: good.len() as f64 / elapsed.as_secs_f64().max(1e-9),
            relay_cpu_us_per_row: c1.saturating_sub(c0) as f64 / good.len().max(1) as f64,
            db_cpu_us_per_row: per_good(d0.zip(d1).map(|(a, b)| b.saturating_sub(a))),
            broker_cpu_us_per_row: per_good(b0.zip(b1).map(|(a, b)| b.saturating_sub(a))),
            refusals: left.attempts,
            retrying: pending.retrying,
            parked: pending.parked,
            duplicates: seen.duplicates,
        })
    }
    .await;
    token.cancel();
    ctx.drop_queue(&name).await;
    result
}

/// The rows left in the run's outbox.
struct Left {
    rows: u64,
    /// Of those, rows for the good queue.
    good: u64,
    /// Refusals recorded on them.
    attempts: u64,
}

async fn left_in_outbox(pg: &PgCtx, good_queue: &str) -> Result<Left> {
    let (rows, good, attempts): (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(*) FILTER (WHERE routing_key = $1),
                coalesce(sum(attempts), 0)::bigint
           FROM \"{}\".\"{}\"",
        pg.schema.name(),
        pg.schema.outbox_table()
    ))
    .bind(good_queue)
    .fetch_one(&pg.pool)
    .await
    .context("reading what is left in the outbox")?;
    let u = |v: i64| u64::try_from(v).unwrap_or(0);
    Ok(Left {
        rows: u(rows),
        good: u(good),
        attempts: u(attempts),
    })
}
