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
/// Scenario 11: the delay the raw consumer published its retry copy with, ms.
const DELAY_MS: &str = "x-bench-delay-ms";

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

    // Scenario 11: the worker's policy, drawn and rounded the same way (`round_jittered`: the
    // same delay levels, so the same hops per retry).
    let jittered = args.jittered.then(super::jittered_policy);
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
                Some(_) if jittered.is_some() && attempt(&d.properties) == 0 => {
                    probe.on_fail(&p);
                    let drawn = jittered.as_ref().map(|j| j.delay_for(0, None));
                    let asked = delay.round_jittered(drawn.unwrap_or_default());
                    let route = delay.route(&queue, asked).context("delay route")?;
                    tokio::spawn(republish(
                        pub_ch.clone(),
                        route.exchange,
                        route.routing_key,
                        d,
                        Some(asked),
                    ));
                }
                Some(_) if jittered.is_some() => {
                    let asked = header_u64(&d.properties, DELAY_MS).unwrap_or(0);
                    probe.on_retry_ok(&p, Duration::from_millis(asked), None);
                    if !d
                        .acker
                        .ack(BasicAckOptions::default())
                        .await
                        .context("basic.ack")?
                    {
                        bail!("ack refused: the channel died");
                    }
                }
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
                        None,
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
    header_u64(props, ATTEMPT)
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(0)
}

fn header_u64(props: &lapin::BasicProperties, name: &str) -> Option<u64> {
    match props.headers().as_ref().and_then(|h| h.inner().get(name)) {
        Some(AMQPValue::LongLongInt(n)) => u64::try_from(*n).ok(),
        Some(AMQPValue::LongInt(n)) => u64::try_from(*n).ok(),
        _ => None,
    }
}

async fn republish(
    ch: Channel,
    exchange: String,
    routing_key: String,
    d: lapin::message::Delivery,
    delay: Option<Duration>,
) {
    let mut headers = d.properties.headers().clone().unwrap_or_default();
    headers.insert(ATTEMPT.into(), AMQPValue::LongLongInt(1));
    if let Some(delay) = delay {
        let ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        headers.insert(DELAY_MS.into(), AMQPValue::LongLongInt(ms));
    }
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
