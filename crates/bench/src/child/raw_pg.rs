//! Scenario 7's baseline: a hand-written lapin consumer whose every message is one INSERT in a
//! transaction of its own, acked after the commit. What a careful user writes without the inbox:
//! the same prefetch, the same number of handlers in flight as the worker's concurrency (a task
//! per delivery, bounded by a semaphore), a pool of that many connections, `BEGIN`, `INSERT`,
//! `COMMIT`, `basic.ack`. It has no deduplication: a redelivered message inserts twice.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::FieldTable;
use lapin::Connection;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{ChildArgs, Probe};
use crate::payload::PayloadIn;

pub async fn start(
    conn: Connection,
    args: &ChildArgs,
    pool: PgPool,
    schema: &str,
    probe: Arc<Probe>,
    cancel: CancellationToken,
) -> Result<JoinHandle<Result<()>>> {
    let queue = args.queue_name();
    let ch = conn.create_channel().await.context("opening a channel")?;
    ch.basic_qos(args.prefetch, BasicQosOptions { global: false })
        .await
        .context("basic.qos")?;
    let mut consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "rbench-raw-pg".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("basic.consume on '{queue}'"))?;
    // The same statement as the redeliver side's handler.
    let insert: Arc<str> = format!(
        "INSERT INTO {} (message_id, body) VALUES ($1, $2)",
        crate::pg::effects_sql(schema)
    )
    .into();
    let slots = Arc::new(Semaphore::new(args.concurrency.max(1)));

    Ok(tokio::spawn(async move {
        // The connection lives as long as the consumer.
        let _conn = conn;
        loop {
            // A free handler slot first, as the worker takes one before it runs a handler.
            let slot = tokio::select! {
                _ = cancel.cancelled() => break,
                s = slots.clone().acquire_owned() => s.context("handler slots closed")?,
            };
            let next = tokio::select! {
                _ = cancel.cancelled() => break,
                d = consumer.next() => d,
            };
            let Some(delivery) = next else {
                bail!("the consumer stream ended (channel or connection closed)");
            };
            let d = delivery.context("delivery error")?;
            let (pool, insert, probe) = (pool.clone(), insert.clone(), probe.clone());
            tokio::spawn(async move {
                let _slot = slot;
                handle(&pool, &insert, &probe, d).await;
            });
        }
        Ok(())
    }))
}

/// One message: decode, `BEGIN`, `INSERT`, `COMMIT`, ack. A database error requeues the message
/// (the hand-written consumer's retry); neither happens in a healthy run, so both are only
/// logged.
async fn handle(pool: &PgPool, insert: &str, probe: &Probe, d: lapin::message::Delivery) {
    let p: PayloadIn = match serde_json::from_slice(&d.data) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("raw-pg: undecodable body, rejecting: {e}");
            if let Err(e) = d.acker.reject(BasicRejectOptions { requeue: false }).await {
                eprintln!("raw-pg: basic.reject failed: {e}");
            }
            return;
        }
    };
    let message_id = d.properties.message_id().as_ref().map(|id| id.as_str());
    let written = async {
        let mut tx = pool.begin().await?;
        sqlx::query(insert)
            .bind(message_id)
            .bind(&d.data[..])
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }
    .await;
    let settled = match written {
        Ok(()) => {
            probe.on_ok(&p);
            d.acker.ack(BasicAckOptions::default()).await
        }
        Err(e) => {
            eprintln!("raw-pg: the transaction failed: {e}; requeueing the message");
            d.acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await
        }
    };
    match settled {
        Ok(true) => {}
        Ok(false) => eprintln!("raw-pg: settling a delivery refused: the channel died"),
        Err(e) => eprintln!("raw-pg: settling a delivery failed: {e}"),
    }
}
