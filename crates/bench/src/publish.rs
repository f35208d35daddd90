//! The two publishers: redeliver's `Publisher` and a raw lapin confirm channel, each with many
//! confirms in flight. Used for backlogs (as fast as confirms allow) and paced streams.
//!
//! Both send the same messages: the raw channel sets the `message_id` (a UUID v4) and the
//! `timestamp` that `Publisher` fills in. Which consumer drains faster must not depend on who
//! published: on RabbitMQ 3.10.8 a classic queue drains those two properties' messages a quarter
//! to a third slower than bare ones, whatever the consumer (BENCHMARKS.md, "Same messages for
//! both sides"). The properties restate what `Publisher`'s private `fill` sets; keep them in step.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection};
use redeliver_amqp::Publisher;

use crate::child::Side;
use crate::config::CONFIRM_WINDOW;
use crate::payload::{now_ns, PayloadOut};

#[derive(Clone)]
enum Inner {
    Raw(Channel),
    Redeliver(Publisher),
}

/// Publishes bench payloads to a queue through the default exchange.
#[derive(Clone)]
pub struct BenchPublisher {
    inner: Inner,
    pad: Arc<str>,
    seq: Arc<AtomicU64>,
}

/// What to do with a message: succeed at once, or fail once and retry after some ms.
pub type RetryFn<'a> = &'a (dyn Fn(u64) -> Option<u32> + Sync);

impl BenchPublisher {
    pub async fn new(
        side: Side,
        conn: &Connection,
        delay: redeliver_amqp::DelayConfig,
        pad: Arc<str>,
        seq: Arc<AtomicU64>,
    ) -> Result<Self> {
        let inner = match side {
            Side::Raw | Side::RawBatch => {
                let ch = conn.create_channel().await.context("opening a channel")?;
                ch.confirm_select(ConfirmSelectOptions::default())
                    .await
                    .context("confirm.select")?;
                Inner::Raw(ch)
            }
            Side::Redeliver => Inner::Redeliver(
                Publisher::new(conn, delay)
                    .await
                    .context("creating the redeliver Publisher")?,
            ),
        };
        Ok(BenchPublisher { inner, pad, seq })
    }

    /// One publish, confirmed. The timestamp in the body is taken now.
    fn one(&self, queue: Arc<str>, retry_ms: Option<u32>) -> BoxFuture<'static, Result<()>> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let pad = self.pad.clone();
        match self.inner.clone() {
            Inner::Raw(ch) => Box::pin(async move {
                let ts_ns = now_ns();
                let body = serde_json::to_vec(&PayloadOut {
                    seq,
                    ts_ns,
                    retry_ms,
                    pad: &pad,
                })?;
                let confirm = ch
                    .basic_publish(
                        "".into(),
                        queue.as_ref().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &body,
                        BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_content_type("application/json".into())
                            .with_message_id(uuid::Uuid::new_v4().to_string().into())
                            .with_timestamp(ts_ns / 1_000_000_000),
                    )
                    .await
                    .context("basic.publish")?
                    .await
                    .context("waiting for the confirm")?;
                match confirm {
                    Confirmation::Ack(None) => Ok(()),
                    other => Err(anyhow!("publish to '{queue}' not confirmed: {other:?}")),
                }
            }),
            Inner::Redeliver(p) => Box::pin(async move {
                let payload = PayloadOut {
                    seq,
                    ts_ns: now_ns(),
                    retry_ms,
                    pad: &pad,
                };
                p.publish_json("", &queue, &payload)
                    .await
                    .with_context(|| format!("publishing to '{queue}'"))?;
                Ok(())
            }),
        }
    }

    /// Publishes `n` messages as fast as the confirm window allows; returns the elapsed time.
    pub async fn backlog(&self, queue: &str, n: u64, retry: RetryFn<'_>) -> Result<Duration> {
        let queue: Arc<str> = queue.into();
        let start = Instant::now();
        let mut inflight = FuturesUnordered::new();
        for i in 0..n {
            while inflight.len() >= CONFIRM_WINDOW {
                if let Some(r) = inflight.next().await {
                    r?;
                }
            }
            inflight.push(self.one(queue.clone(), retry(i)));
        }
        while let Some(r) = inflight.next().await {
            r?;
        }
        Ok(start.elapsed())
    }

    /// Publishes `n` messages at `rate` per second (open loop: the schedule does not wait for
    /// the consumer), confirms pipelined.
    pub async fn paced(&self, queue: &str, n: u64, rate: u64, retry: RetryFn<'_>) -> Result<()> {
        let queue: Arc<str> = queue.into();
        let start = Instant::now();
        let mut inflight = FuturesUnordered::new();
        let mut sent = 0u64;
        while sent < n || !inflight.is_empty() {
            let due = ((start.elapsed().as_secs_f64() * rate as f64) as u64 + 1).min(n);
            while sent < due {
                inflight.push(self.one(queue.clone(), retry(sent)));
                sent += 1;
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
        Ok(())
    }
}
