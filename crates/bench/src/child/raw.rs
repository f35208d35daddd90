//! The baseline: a minimal hand-written lapin consumer doing the same work as the redeliver
//! handler. It is what a careful user writes without a framework: per-consumer prefetch, one
//! `ack` per message, and for a retry a copy published to the same delay levels (through
//! `DelayConfig::route`) on a confirm channel, the original acked only after the confirm.
//!
//! [`Side::RawBatch`] is the tuned variant for the happy path: one `multiple = true` ack per
//! [`RAW_ACK_BATCH`] messages, and whatever is pending when the stream has nothing ready.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::Confirmation;
use lapin::{Channel, Connection};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{delay_config, ChildArgs, Probe, Side, RAW_ACK_BATCH};
use crate::payload::PayloadIn;

/// The raw consumer's own retry counter (it does not use redeliver's header codec).
const ATTEMPT: &str = "x-bench-attempt";

pub async fn start(
    conn: Connection,
    args: &ChildArgs,
    probe: Arc<Probe>,
    cancel: CancellationToken,
) -> Result<JoinHandle<Result<()>>> {
    let queue = args.queue_name();
    let ch = conn.create_channel().await.context("opening a channel")?;
    ch.basic_qos(args.prefetch, BasicQosOptions { global: false })
        .await
        .context("basic.qos")?;
    let pub_ch = conn.create_channel().await.context("opening a channel")?;
    pub_ch
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .context("confirm.select")?;
    let delay = delay_config(&args.prefix, args.delay_levels);
    let mut consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "rbench-raw".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("basic.consume on '{queue}'"))?;

    let batch = if args.side == Side::RawBatch {
        RAW_ACK_BATCH
    } else {
        0
    };
    Ok(tokio::spawn(async move {
        // The connection lives as long as the consumer.
        let _conn = conn;
        // Batched mode: the acker of the last successful delivery not acked yet.
        let mut pending: Option<lapin::Acker> = None;
        let mut unacked = 0u64;
        loop {
            let next = match consumer.next().now_or_never() {
                Some(d) => d,
                None => {
                    // Nothing ready: flush the batch rather than sit on it.
                    if let Some(acker) = pending.take() {
                        ack_multiple(&acker).await?;
                        unacked = 0;
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        d = consumer.next() => d,
                    }
                }
            };
            let Some(delivery) = next else {
                bail!("the consumer stream ended (channel or connection closed)");
            };
            let d = delivery.context("delivery error")?;
            let p: PayloadIn = match serde_json::from_slice(&d.data) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("raw: undecodable body, rejecting: {e}");
                    d.acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await
                        .context("basic.reject")?;
                    continue;
                }
            };
            match p.retry_ms {
                Some(ms) if attempt(&d.properties) == 0 => {
                    probe.on_fail(&p);
                    let route = delay
                        .route(&queue, Duration::from_millis(u64::from(ms)))
                        .context("delay route")?;
                    // One task per retry: waiting for each confirm in turn would make the
                    // baseline one broker round trip per message. Prefetch bounds the tasks.
                    tokio::spawn(republish(
                        pub_ch.clone(),
                        route.exchange,
                        route.routing_key,
                        d,
                    ));
                }
                _ if probe.holding() => {
                    // Scenario 6: hold the delivery (body included) in a task of its own until
                    // the whole prefetch is held, as the worker's handlers do.
                    let probe = probe.clone();
                    tokio::spawn(async move {
                        // The whole delivery moves in (not just its acker): its body stays held.
                        let delivery = d;
                        probe.hold().await;
                        probe.on_ok(&p);
                        if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
                            eprintln!("raw: ack failed: {e}");
                        }
                    });
                }
                _ if batch > 0 => {
                    probe.on_ok(&p);
                    pending = Some(d.acker);
                    unacked += 1;
                    if unacked >= batch {
                        if let Some(acker) = pending.take() {
                            ack_multiple(&acker).await?;
                        }
                        unacked = 0;
                    }
                }
                _ => {
                    probe.on_ok(&p);
                    if !d
                        .acker
                        .ack(BasicAckOptions::default())
                        .await
                        .context("basic.ack")?
                    {
                        bail!("ack refused: the channel died");
                    }
                }
            }
        }
        Ok(())
    }))
}

async fn ack_multiple(acker: &lapin::Acker) -> Result<()> {
    if !acker
        .ack(BasicAckOptions { multiple: true })
        .await
        .context("basic.ack multiple")?
    {
        bail!("ack refused: the channel died");
    }
    Ok(())
}

fn attempt(props: &lapin::BasicProperties) -> u32 {
    match props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(ATTEMPT))
    {
        Some(AMQPValue::LongLongInt(n)) => u32::try_from(*n).unwrap_or(0),
        Some(AMQPValue::LongInt(n)) => u32::try_from(*n).unwrap_or(0),
        _ => 0,
    }
}

async fn republish(
    ch: Channel,
    exchange: String,
    routing_key: String,
    d: lapin::message::Delivery,
) {
    let mut headers = d.properties.headers().clone().unwrap_or_default();
    headers.insert(ATTEMPT.into(), AMQPValue::LongLongInt(1));
    let props = d.properties.clone().with_headers(headers);
    let confirmed = async {
        let confirm = ch
            .basic_publish(
                exchange.as_str().into(),
                routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &d.data,
                props,
            )
            .await?
            .await?;
        Ok::<_, lapin::Error>(matches!(confirm, Confirmation::Ack(None)))
    }
    .await;
    let result = match confirmed {
        Ok(true) => d.acker.ack(BasicAckOptions::default()).await,
        Ok(false) => {
            eprintln!("raw: retry copy nacked or returned; requeueing the original");
            d.acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await
        }
        Err(e) => {
            eprintln!("raw: publishing the retry copy failed: {e}; requeueing the original");
            d.acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await
        }
    };
    if let Err(e) = result {
        eprintln!("raw: settling a delivery failed: {e}");
    }
}
