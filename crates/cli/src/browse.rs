//! Reading a queue without disturbing it.
//!
//! Method: a passive `queue.declare` gives the number of ready messages; a consumer with manual
//! acknowledgements and a prefetch sized to what we want to see takes the deliveries; rejecting
//! all of them at once with requeue (after cancelling the consumer) returns every one to the
//! queue in its original position and order (classic queues requeue by sequence number, quorum
//! queues return a consumer's checked-out messages in the order they were delivered).
//!
//! Not basic.get + requeue: each requeued message goes back to the head of the queue one by one,
//! so the next reader (or the next basic.get) sees them in another order, and a quorum queue
//! counts every single requeue as a delivery. The consumer approach costs one return per message
//! in total, and `replay` uses the same reader: it acknowledges only what it moved.

use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use redeliver_amqp::is_not_found;
use tokio::time::Instant;

use crate::errors::QueueMissing;
use crate::output;

/// How long to wait for the next delivery before asking whether the broker has more for us
/// (someone else consumed them, or the queue shrank since the count). Deliveries of ready
/// messages normally follow each other within milliseconds.
pub(crate) const IDLE: Duration = Duration::from_secs(3);

/// How long [`Reader::next`] keeps waiting while this reader is the queue's only consumer.
/// Then nobody else can have taken the missing messages, so they are on their way: RabbitMQ 4.x
/// takes about 3 s to hand out one message whose header nests 26,000 levels deep (it converts
/// the header on delivery), and much longer on a loaded node.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

/// Largest prefetch AMQP can express (basic.qos prefetch-count is a short).
pub(crate) const MAX_PREFETCH: u32 = u16::MAX as u32;

/// Live counts of a queue, from a passive declare.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QueueCounts {
    pub messages: u32,
    pub consumers: u32,
}

/// Passive declare of `queue` on a throwaway channel (a 404 closes the channel it happens on).
/// `Ok(None)` when the queue does not exist.
pub(crate) async fn probe_queue(
    conn: &Connection,
    queue: &str,
) -> anyhow::Result<Option<QueueCounts>> {
    let ch = conn
        .create_channel()
        .await
        .context("cannot open a channel")?;
    let Some(q) = redeliver_amqp::passive_queue(&ch, queue)
        .await
        .with_context(|| format!("cannot inspect queue '{queue}'"))?
    else {
        return Ok(None);
    };
    // Best effort: the channel is done either way and the connection closes soon.
    let _ = ch.close(200, "ok".into()).await;
    Ok(Some(QueueCounts {
        messages: q.message_count(),
        consumers: q.consumer_count(),
    }))
}

/// Like [`probe_queue`] but a missing queue is an error that tells how to declare it.
pub(crate) async fn require_queue(conn: &Connection, queue: &str) -> anyhow::Result<QueueCounts> {
    probe_queue(conn, queue).await?.ok_or_else(|| {
        anyhow::Error::new(QueueMissing {
            queue: queue.to_owned(),
        })
    })
}

/// A consumer over one queue whose unacknowledged deliveries all go back, in order, when it is
/// closed. Used by list and peek (which acknowledge nothing) and replay (which acknowledges
/// only what it has safely republished).
pub(crate) struct Reader {
    channel: Channel,
    consumer: Consumer,
    tag: String,
    queue: String,
    /// Deliveries handed out by [`Reader::next`] and not acknowledged through [`Reader::ack`]:
    /// what [`Reader::close`] gives back.
    outstanding: u64,
}

impl Reader {
    /// Starts consuming `queue` with manual acks and `prefetch` (clamped to 1..=65535).
    pub(crate) async fn open(
        conn: &Connection,
        queue: &str,
        prefetch: u32,
    ) -> anyhow::Result<Self> {
        let channel = conn
            .create_channel()
            .await
            .context("cannot open a channel")?;
        let prefetch = prefetch.clamp(1, MAX_PREFETCH) as u16;
        channel
            // Per consumer (global = false): global QoS is deprecated in RabbitMQ.
            .basic_qos(prefetch, BasicQosOptions { global: false })
            .await
            .context("cannot set the prefetch")?;
        let tag = format!("redeliver-cli-{}", uuid::Uuid::new_v4().simple());
        let consumer = channel
            .basic_consume(
                queue.into(),
                tag.as_str().into(),
                BasicConsumeOptions {
                    no_ack: false,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                if is_not_found(&e) {
                    anyhow::Error::new(QueueMissing {
                        queue: queue.to_owned(),
                    })
                } else {
                    anyhow::Error::new(e).context(format!("cannot consume from '{queue}'"))
                }
            })?;
        Ok(Self {
            channel,
            consumer,
            tag,
            queue: queue.to_owned(),
            outstanding: 0,
        })
    }

    /// The next delivery, or `None` when the consumer was cancelled by the broker (queue
    /// deleted) or none came within `idle` while another consumer shares the queue (it may have
    /// taken the rest). While this reader is the only consumer, the wait goes on up to
    /// [`PATIENCE`]: a slow delivery is not mistaken for the end of the queue.
    pub(crate) async fn next(&mut self, idle: Duration) -> anyhow::Result<Option<Delivery>> {
        let started = Instant::now();
        loop {
            match tokio::time::timeout(idle, self.consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    self.outstanding += 1;
                    return Ok(Some(d));
                }
                Ok(Some(Err(e))) => {
                    return Err(e)
                        .with_context(|| format!("lost the consumer on '{}'", self.queue));
                }
                Ok(None) => return Ok(None),
                Err(_) if started.elapsed() >= PATIENCE => return Ok(None),
                Err(_) => {
                    let alone = self.counts().await?.is_some_and(|c| c.consumers <= 1);
                    if !alone {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// The queue read.
    pub(crate) fn queue(&self) -> &str {
        &self.queue
    }

    /// Acknowledges `d` (one of this reader's deliveries): it leaves the queue for good.
    /// `Ok(false)` when the channel closed first, so the broker keeps the message.
    pub(crate) async fn ack(&mut self, d: &Delivery) -> lapin::Result<bool> {
        let acked = d.acker.ack(BasicAckOptions::default()).await?;
        if acked {
            self.outstanding = self.outstanding.saturating_sub(1);
        }
        Ok(acked)
    }

    /// Gives every unacknowledged delivery back to the queue, in its original position, and
    /// returns once the queue counts them again, so that the next command (a `list` right after
    /// a `purge --queue`) sees them.
    ///
    /// Closing the channel alone would return them too, but later: the broker requeues a closed
    /// channel's deliveries when its channel process has gone, after close-ok, and a quorum
    /// queue counts them only once that return is applied. So: cancel the consumer (nothing
    /// more arrives), reject everything outstanding with requeue in one frame, wait until the
    /// ready count has grown by what went back, then close.
    pub(crate) async fn close(mut self) -> anyhow::Result<()> {
        let returned = self.give_back().await;
        if !self.channel.status().connected() {
            // The queue went away under us (a 404 closed the channel): nothing to give back.
            return returned;
        }
        let closed = self
            .channel
            .close(200, "redeliver-cli done".into())
            .await
            .with_context(|| {
                format!(
                    "closing the channel on '{}' failed; the broker returns its messages when \
                     the connection closes",
                    self.queue
                )
            });
        returned.and(closed)
    }

    async fn give_back(&mut self) -> anyhow::Result<()> {
        let queue = self.queue.clone();
        self.channel
            .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
            .await
            .with_context(|| format!("cannot stop the consumer on '{queue}'"))?;
        // What the broker sent ahead and nobody read is outstanding too. After cancel-ok the
        // stream ends; the timeout only guards against a stream that never does.
        while let Ok(Some(Ok(_))) = tokio::time::timeout(IDLE, self.consumer.next()).await {
            self.outstanding += 1;
        }
        if self.outstanding == 0 {
            return Ok(());
        }
        let Some(before) = self.counts().await?.map(|c| c.messages) else {
            return Ok(());
        };
        self.channel
            .basic_nack(
                0,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            )
            .await
            .with_context(|| format!("cannot give the messages back to '{queue}'"))?;
        let target = u64::from(before) + self.outstanding;
        let deadline = Instant::now() + IDLE;
        // Someone else consuming the queue meanwhile can keep it below the target: then this
        // waits `IDLE` and lets the command end anyway, since the messages are back either way.
        while let Some(ready) = self.counts().await?.map(|c| c.messages) {
            if u64::from(ready) >= target || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// The queue's counts, by a passive declare on the reader's own channel; `None` when the
    /// queue was deleted meanwhile (which closes the channel).
    async fn counts(&self) -> anyhow::Result<Option<QueueCounts>> {
        let q = redeliver_amqp::passive_queue(&self.channel, &self.queue)
            .await
            .with_context(|| format!("cannot count the messages of '{}'", self.queue))?;
        Ok(q.map(|q| QueueCounts {
            messages: q.message_count(),
            consumers: q.consumer_count(),
        }))
    }
}

/// What a [`scan`] saw.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scanned {
    /// The queue's counts when the scan started.
    pub counts: QueueCounts,
    /// How many messages the scan meant to read: the ready count, at most the limit.
    pub expected: u32,
    /// How many it read. Fewer than `expected` when another consumer took some, or the queue
    /// shrank, while it ran.
    pub read: u32,
}

impl Scanned {
    /// The stderr note for a scan that read fewer messages than it expected; None when complete.
    pub(crate) fn shortfall_note(&self, queue: &str) -> Option<String> {
        (self.read < self.expected).then(|| {
            format!(
                "note: the broker handed out {} of the {} expected messages (another consumer \
                 on '{queue}' took the rest, or they expired or were purged meanwhile)",
                self.read, self.expected,
            )
        })
    }
}

/// Reads up to `limit` messages of `queue` from the head, hands each to `each` in queue order,
/// and puts them all back, in order, by closing the channel. The scan keeps no message after
/// `each` returns, so counting a large queue does not hold all of it in memory (lapin still
/// buffers what the broker sends ahead of the reader). A progress bar (`what`) shows on a
/// terminal.
pub(crate) async fn scan(
    conn: &Connection,
    queue: &str,
    limit: u32,
    what: &str,
    mut each: impl FnMut(Delivery),
) -> anyhow::Result<Scanned> {
    let counts = require_queue(conn, queue).await?;
    let expected = counts.messages.min(limit);
    let mut scanned = Scanned {
        counts,
        expected,
        read: 0,
    };
    if expected == 0 {
        return Ok(scanned);
    }
    let bar = output::progress(u64::from(expected), what);
    let mut reader = Reader::open(conn, queue, expected).await?;
    let got = async {
        while scanned.read < expected {
            let Some(d) = reader.next(IDLE).await? else {
                break;
            };
            scanned.read += 1;
            bar.inc(1);
            each(d);
        }
        anyhow::Ok(())
    }
    .await;
    bar.finish_and_clear();
    // Close even when reading failed, so the messages go back now rather than at disconnect.
    let closed = reader.close().await;
    got?;
    closed?;
    Ok(scanned)
}
