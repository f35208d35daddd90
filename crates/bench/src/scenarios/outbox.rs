//! Scenario 8, the outbox relay, in two phases per round (no raw side: nothing hand-written
//! is compared; the report gives each round and the medians):
//!
//! 1. **Commit to delivery.** A producer stores one message per transaction with
//!    `Outbox::store` at a fixed rate ([`OUTBOX_RATE`]) and commits; one `Relay` (LISTEN/NOTIFY,
//!    default batch size) publishes them; a plain consumer (auto-ack) on the destination queue
//!    receives them. Latency = from just after the producer's `COMMIT` returned to the delivery
//!    reaching the consumer. The relay does not expose when the broker confirmed each publish,
//!    so this bounds commit-to-confirm from above: it adds the broker's delivery to the consumer.
//! 2. **Relay throughput.** N rows committed with no relay running, then one relay started:
//!    rows/s = N / (time from starting it to the table being empty), its pool, its broker
//!    connection (the relay connects itself) and its schema check included. Every row is deleted
//!    only after the broker's confirm, so an empty table means every message confirmed.
//!
//! The relay runs with its defaults (batch size 100, the default retry policy): nothing is
//! refused here; scenario 9 (`outbox_refused`) is the relay with refused rows.
//!
//! Producer, relay and consumer run in the bench process itself (not a child): they share
//! one clock, and there is no second side whose memory or CPU has to be kept apart.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use futures::stream::{FuturesUnordered, StreamExt};
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use redeliver_postgres::{Outbox, OutboxMessage, Relay};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{ms, Ctx};
use crate::broker;
use crate::child::QueueKind;
use crate::config::OUTBOX_RATE;
use crate::payload::{self, PayloadOut};
use crate::pg::PgCtx;
use crate::report::{OutboxRow, Report};
use crate::stats::{self, Histogram};

/// Rows per transaction when the backlog of phase 2 is stored (its speed is not measured).
const BACKLOG_TX_ROWS: usize = 500;
/// Connections of each relay's pool: its LISTEN, its round's transaction, its gauges' count.
const RELAY_POOL: usize = 4;

pub async fn run(ctx: &Ctx, report: &mut Report) -> Result<()> {
    let pg = ctx.pg()?;
    for round in 0..ctx.sizes.rounds.max(1) {
        let lat = latency(ctx, pg, round).await?;
        let thr = throughput(ctx, pg, round).await?;
        let row = OutboxRow {
            round,
            latency_messages: ctx.sizes.outbox_latency,
            rate: OUTBOX_RATE,
            p50_ms: ms(lat.percentile(0.50)),
            p99_ms: ms(lat.percentile(0.99)),
            max_ms: ms(lat.max()),
            backlog: thr.rows,
            drain_secs: thr.elapsed.as_secs_f64(),
            rows_per_s: thr.rows as f64 / thr.elapsed.as_secs_f64().max(1e-9),
            relay_cpu_us_per_row: thr.relay_cpu_us as f64 / thr.rows.max(1) as f64,
            db_cpu_us_per_row: thr.db_us.map(|u| u as f64 / thr.rows.max(1) as f64),
            broker_cpu_us_per_row: thr.broker_us.map(|u| u as f64 / thr.rows.max(1) as f64),
        };
        eprintln!(
            "   round {} outbox: commit -> delivery p50 {:.1} ms, p99 {:.1} ms (max {:.1}); relay {} rows in {:.2} s = {:.0} rows/s",
            round + 1,
            row.p50_ms,
            row.p99_ms,
            row.max_ms,
            row.backlog,
            row.drain_secs,
            row.rows_per_s
        );
        report.outbox.push(row);
    }
    Ok(())
}

/// Phase 1's clock. A delivery can reach the consumer before the producer's task has taken the
/// time of its commit (the notification leaves with the commit, not after its reply): whichever
/// of the two comes second records the latency, 0 in that case.
#[derive(Default)]
struct Timing {
    waiting: HashMap<String, Seen>,
    hist: Histogram,
    received: u64,
}

enum Seen {
    Committed(Instant),
    Received(Instant),
}

impl Timing {
    fn committed(&mut self, id: String, at: Instant) {
        match self.waiting.remove(&id) {
            Some(Seen::Received(r)) => self.record(r.saturating_duration_since(at)),
            _ => {
                self.waiting.insert(id, Seen::Committed(at));
            }
        }
    }

    fn received(&mut self, id: String, at: Instant) {
        self.received += 1;
        match self.waiting.remove(&id) {
            Some(Seen::Committed(c)) => self.record(at.saturating_duration_since(c)),
            _ => {
                self.waiting.insert(id, Seen::Received(at));
            }
        }
    }

    fn record(&mut self, d: Duration) {
        self.hist
            .record(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }
}

fn lock(t: &Mutex<Timing>) -> std::sync::MutexGuard<'_, Timing> {
    // A panic while holding it is a bench bug; the figures are then lost anyway.
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// The bench's 1 KB JSON body, the same size as every other scenario's messages.
pub(super) fn body(pad: &str, seq: u64) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec(&PayloadOut {
        seq,
        ts_ns: payload::now_ns(),
        retry_ms: None,
        pad,
    })?)
}

/// Stores one message in a transaction of its own and commits it.
async fn store_one(pg: &PgCtx, outbox: &Outbox, message: &OutboxMessage) -> Result<()> {
    let mut tx = pg.pool.begin().await.context("BEGIN")?;
    outbox
        .store(&mut tx, message)
        .await
        .context("storing an outbox message")?;
    tx.commit().await.context("COMMIT")?;
    Ok(())
}

/// Commits `messages` to the run's outbox, [`BACKLOG_TX_ROWS`] per transaction and a few
/// transactions at once (not timed: the relay is not running).
pub(super) async fn store_backlog(pg: &PgCtx, messages: &[OutboxMessage]) -> Result<()> {
    let outbox = Outbox::new(pg.schema.clone());
    let mut chunks = messages.chunks(BACKLOG_TX_ROWS);
    let mut running = FuturesUnordered::new();
    loop {
        while running.len() < 4 {
            let Some(chunk) = chunks.next() else {
                break;
            };
            let outbox = &outbox;
            running.push(async move {
                let mut tx = pg.pool.begin().await.context("BEGIN")?;
                for m in chunk {
                    outbox
                        .store(&mut tx, m)
                        .await
                        .context("storing the backlog")?;
                }
                tx.commit().await.context("COMMIT")?;
                Ok::<_, anyhow::Error>(())
            });
        }
        match running.next().await {
            Some(r) => r?,
            None => return Ok(()),
        }
    }
}

/// A relay of the run's schema with a pool of its own, connecting to the run's broker itself
/// (TLS from the same variables as the consumers), as a service would run it; started at once.
async fn start_relay(
    ctx: &Ctx,
    pg: &PgCtx,
    token: &CancellationToken,
) -> Result<JoinHandle<Result<(), redeliver_postgres::Error>>> {
    Ok(tokio::spawn(relay(ctx, pg).await?.run(token.clone())))
}

/// The relay [`start_relay`] starts, not started yet.
pub(super) async fn relay(ctx: &Ctx, pg: &PgCtx) -> Result<Relay> {
    let pool = crate::pg::pool(&pg.url, RELAY_POOL).await?;
    Ok(Relay::new(pool, ctx.url.clone())
        .schema(pg.schema.clone())
        .tls(broker::tls_from_env())
        .connection_name(format!("{}outbox-relay", ctx.prefix)))
}

/// Stops a relay and reports how it ended.
pub(super) async fn stop_relay(
    token: &CancellationToken,
    relay: JoinHandle<Result<(), redeliver_postgres::Error>>,
) -> Result<()> {
    token.cancel();
    match tokio::time::timeout(Duration::from_secs(30), relay).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(e))) => Err(anyhow!(e).context("the outbox relay failed")),
        Ok(Err(e)) => Err(anyhow!("the outbox relay task panicked: {e}")),
        Err(_) => Err(anyhow!("the outbox relay did not stop within 30 s")),
    }
}

/// Phase 1: commit -> delivery latency at [`OUTBOX_RATE`] messages/s.
async fn latency(ctx: &Ctx, pg: &PgCtx, round: u32) -> Result<Histogram> {
    let base = format!("outbox-lat-r{round}");
    let name = ctx
        .declare(&base, QueueKind::Quorum, QueueKind::Quorum)
        .await?;
    let token = CancellationToken::new();
    let result = async {
        pg.truncate(&[pg.schema.outbox_table()]).await?;
        let timing = Arc::new(Mutex::new(Timing::default()));
        let (count_tx, mut count_rx) = watch::channel(0u64);

        // The plain consumer: auto-ack, so what is timed is the delivery, not an ack.
        let ch = ctx
            .conn
            .create_channel()
            .await
            .context("opening a channel")?;
        let mut deliveries = ch
            .basic_consume(
                name.as_str().into(),
                "rbench-outbox".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("basic.consume on '{name}'"))?;
        let consumer = {
            let (timing, token) = (timing.clone(), token.clone());
            tokio::spawn(async move {
                loop {
                    let next = tokio::select! {
                        _ = token.cancelled() => break,
                        d = deliveries.next() => d,
                    };
                    let Some(d) = next else {
                        bail!("the consumer stream ended (channel or connection closed)");
                    };
                    let d = d.context("delivery error")?;
                    let at = Instant::now();
                    let id = d
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.as_str().to_string())
                        .unwrap_or_default();
                    let received = {
                        let mut t = lock(&timing);
                        t.received(id, at);
                        t.received
                    };
                    count_tx.send_replace(received);
                }
                Ok::<(), anyhow::Error>(())
            })
        };

        let outbox = Outbox::new(pg.schema.clone());
        let relay = start_relay(ctx, pg, &token).await?;
        // One message through the whole path before the clock starts: the relay has prepared its
        // schema and is LISTENing (its first round comes after the LISTEN), the consumer is up.
        let pad = payload::padding();
        let warm = OutboxMessage::new("", name.as_str(), body(&pad, 0)?);
        store_one(pg, &outbox, &warm).await?;
        tokio::time::timeout(Duration::from_secs(30), count_rx.wait_for(|c| *c >= 1))
            .await
            .map_err(|_| anyhow!("the warm-up message did not come through the relay in 30 s"))?
            .context("the consumer stopped")?;
        {
            // The clock starts now; the count goes on (the warm-up message is its first).
            let mut t = lock(&timing);
            t.hist = Histogram::default();
            t.waiting.clear();
        }

        let n = ctx.sizes.outbox_latency;
        let start = Instant::now();
        let mut inflight = FuturesUnordered::new();
        let mut sent = 0u64;
        while sent < n || !inflight.is_empty() {
            let due = ((start.elapsed().as_secs_f64() * OUTBOX_RATE as f64) as u64 + 1).min(n);
            while sent < due {
                sent += 1;
                let message = OutboxMessage::new("", name.as_str(), body(&pad, sent)?);
                let (outbox, timing) = (&outbox, timing.clone());
                inflight.push(async move {
                    store_one(pg, outbox, &message).await?;
                    lock(&timing).committed(message.message_id, Instant::now());
                    Ok::<_, anyhow::Error>(())
                });
            }
            tokio::select! {
                r = inflight.next(), if !inflight.is_empty() => {
                    if let Some(r) = r {
                        r?;
                    }
                }
                _ = tokio::time::sleep(Duration::from_millis(1)) => {}
            }
        }
        // A bool, not the watch's guard: holding that would block the consumer's next count.
        let arrived = tokio::time::timeout(Duration::from_secs(60), count_rx.wait_for(|c| *c > n))
            .await
            .is_ok_and(|r| r.is_ok());
        let stopped = stop_relay(&token, relay).await;
        match consumer.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.context("the outbox consumer failed")),
            Err(e) => bail!("the outbox consumer panicked: {e}"),
        }
        let _ = ch.close(200, "bench done".into()).await;
        stopped?;
        let t = std::mem::take(&mut *lock(&timing));
        if !arrived {
            bail!(
                "only {} of {n} outbox messages reached the consumer within 60 s",
                t.received.saturating_sub(1)
            );
        }
        Ok::<_, anyhow::Error>(t.hist)
    }
    .await;
    token.cancel();
    ctx.drop_queue(&name).await;
    result
}

/// What phase 2 measured.
struct Throughput {
    rows: u64,
    elapsed: Duration,
    relay_cpu_us: u64,
    db_us: Option<u64>,
    broker_us: Option<u64>,
}

/// Phase 2: rows/s of one relay over a committed backlog.
async fn throughput(ctx: &Ctx, pg: &PgCtx, round: u32) -> Result<Throughput> {
    let base = format!("outbox-relay-r{round}");
    let name = ctx
        .declare(&base, QueueKind::Quorum, QueueKind::Quorum)
        .await?;
    let token = CancellationToken::new();
    let result = async {
        pg.truncate(&[pg.schema.outbox_table()]).await?;
        let n = ctx.sizes.outbox_backlog;
        let pad = payload::padding();
        let backlog = (0..n)
            .map(|seq| Ok(OutboxMessage::new("", name.as_str(), body(&pad, seq)?)))
            .collect::<Result<Vec<_>>>()?;
        store_backlog(pg, &backlog).await?;
        drop(backlog);

        let empty_sql = format!(
            "SELECT NOT EXISTS (SELECT 1 FROM \"{}\".\"{}\")",
            pg.schema.name(),
            pg.schema.outbox_table()
        );
        let (b0, d0, c0) = (ctx.broker_cpu_us(), pg.cpu_us(), stats::cpu_us());
        let start = Instant::now();
        let relay = start_relay(ctx, pg, &token).await?;
        let deadline = start + Ctx::timeout_for(n);
        loop {
            // Every 10 ms: 1 % of a one-second drain; the query is an index-only probe.
            tokio::time::sleep(Duration::from_millis(10)).await;
            let empty: bool = sqlx::query_scalar(&empty_sql)
                .fetch_one(&pg.pool)
                .await
                .context("looking at the outbox")?;
            if empty {
                break;
            }
            if relay.is_finished() {
                return stop_relay(&token, relay)
                    .await
                    .and_then(|()| Err(anyhow!("the relay stopped before the outbox was empty")));
            }
            if Instant::now() > deadline {
                let _ = stop_relay(&token, relay).await;
                bail!("the relay did not empty the outbox of {n} rows in time");
            }
        }
        let elapsed = start.elapsed();
        let (b1, d1, c1) = (ctx.broker_cpu_us(), pg.cpu_us(), stats::cpu_us());
        stop_relay(&token, relay).await?;

        // Every row was deleted after its confirm: the queue must hold them all.
        let wait = Instant::now() + Duration::from_secs(10);
        let mut in_queue = broker::queue_count(&ctx.conn, &name).await?;
        while u64::from(in_queue) < n && Instant::now() < wait {
            tokio::time::sleep(Duration::from_millis(100)).await;
            in_queue = broker::queue_count(&ctx.conn, &name).await?;
        }
        if u64::from(in_queue) != n {
            bail!("the relay emptied the outbox of {n} rows but the queue holds {in_queue}");
        }
        Ok::<_, anyhow::Error>(Throughput {
            rows: n,
            elapsed,
            // The bench process: the relay, plus this loop's probes (small against the relay).
            relay_cpu_us: c1.saturating_sub(c0),
            db_us: d0.zip(d1).map(|(a, b)| b.saturating_sub(a)),
            broker_us: b0.zip(b1).map(|(a, b)| b.saturating_sub(a)),
        })
    }
    .await;
    token.cancel();
    ctx.drop_queue(&name).await;
    result
}
