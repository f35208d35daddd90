//! A publisher on a confirm-mode channel that returns only once the broker has taken
//! responsibility for the message.
//!
//! Every publish is `mandatory`: a message no queue would receive comes back, and is an error
//! ([`PublishError::Returned`]) rather than a silent loss. RabbitMQ confirms such a message with
//! an ack *and* a return, so the ack alone proves nothing; the returned message is checked.
//!
//! ```no_run
//! # async fn demo(conn: &redeliver::lapin::Connection) -> Result<(), redeliver::amqp::PublishError> {
//! use redeliver::{DelayConfig, Publisher};
//! use std::time::Duration;
//!
//! let publisher = Publisher::new(conn, DelayConfig::default()).await?;
//! let id = publisher.publish_json("", "images", &serde_json::json!({"id": 7})).await?;
//! publisher
//!     .publish_delayed("images", Duration::from_secs(5), b"later", Default::default())
//!     .await?;
//! # let _ = id; Ok(()) }
//! ```

use crate::delay::DelayConfig;
use crate::error::DelayError;
use crate::names::{short, NameError};
use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionStatus};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot, Mutex as AsyncMutex};

/// Content type filled in by [`Publisher::publish_bytes`] when none is given.
pub(crate) const OCTET_STREAM: &str = "application/octet-stream";
/// Content type of [`Publisher::publish_json`].
pub(crate) const JSON: &str = "application/json";

/// A message body with its properties.
#[derive(Clone, Debug, Default)]
pub struct OutgoingMessage {
    /// The body, sent as is.
    pub body: Vec<u8>,
    /// The AMQP properties (headers included).
    pub properties: BasicProperties,
}

impl OutgoingMessage {
    /// A message with `body` and default properties.
    pub fn new(body: impl Into<Vec<u8>>) -> Self {
        Self {
            body: body.into(),
            properties: BasicProperties::default(),
        }
    }

    /// A JSON message (`content_type` `application/json`).
    ///
    /// ```
    /// let m = redeliver::amqp::OutgoingMessage::json(&[1, 2]).unwrap();
    /// assert_eq!(m.body, b"[1,2]");
    /// ```
    pub fn json<T: serde::Serialize + ?Sized>(value: &T) -> Result<Self, serde_json::Error> {
        Ok(Self {
            body: serde_json::to_vec(value)?,
            properties: BasicProperties::default().with_content_type(JSON.into()),
        })
    }

    /// Replaces the properties.
    pub fn with_properties(mut self, properties: BasicProperties) -> Self {
        self.properties = properties;
        self
    }
}

/// Why a publish failed. In every case the broker has not taken the message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The broker nacked the message (for instance a quorum queue at its limit with
    /// `x-overflow = reject-publish`), or confirms were unexpectedly off.
    #[error("the broker refused the message published to exchange '{exchange}' with key '{routing_key}'")]
    Nacked {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
    },
    /// No queue was bound to receive the message (a mandatory publish came back).
    #[error("unroutable: exchange '{exchange}' with key '{routing_key}' routed to no queue ({reply_code} {reply_text})")]
    Returned {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
        /// The broker's reply code (312 NO_ROUTE).
        reply_code: u16,
        /// The broker's reply text.
        reply_text: String,
    },
    /// The body is larger than the broker's `max_message_size`: refused before sending when the
    /// publisher knows the limit ([`Publisher::with_max_message_size`]), or by the broker, which
    /// then closes the channel (406 PRECONDITION_FAILED). Retrying the same message cannot help.
    #[error("the message body of {size} bytes exceeds the broker's max_message_size{}; exchange '{exchange}', key '{routing_key}'", limit.map(|l| format!(" of {l} bytes")).unwrap_or_default())]
    TooLarge {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
        /// The body's size in bytes.
        size: usize,
        /// The limit, when known.
        limit: Option<usize>,
    },
    /// The delay could not be routed.
    #[error(transparent)]
    Delay(#[from] DelayError),
    /// The value could not be serialized to JSON.
    #[error("cannot serialize the message: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The exchange name or routing key is longer than 255 bytes.
    #[error(transparent)]
    InvalidName(#[from] NameError),
    /// The channel or connection failed.
    #[error("AMQP error: {0}")]
    Amqp(#[from] lapin::Error),
}

/// Confirm-mode channels opened by [`Publisher::new`]: at most this many batches of publishes
/// are awaiting their confirms at once.
pub const DEFAULT_PUBLISH_CHANNELS: usize = 4;

/// Most publishes sent as one batch on one channel before their confirms are awaited.
const MAX_BATCH: usize = 256;

/// How often a channel looks whether the broker still blocks the connection. Only while it
/// does; lapin sets the flag as soon as it reads the broker's notice.
const BLOCKED_POLL: Duration = Duration::from_millis(10);

/// A few confirm-mode channels shared by every clone, each sending the publishes waiting for it
/// as one batch and then awaiting that batch's confirms (group commit): many publishes may be
/// in flight at once from several tasks, and the broker confirms them with a few `multiple`
/// acks instead of one frame each.
///
/// Why batches, and returns matched by content: lapin (4.12.3) hands a `basic.return` to
/// whichever pending confirm of the channel it completes next, and completes the tags of a
/// `multiple` ack in no particular order. With several mandatory publishes in flight on one
/// channel, a returned message was then reported as `Ack(None)` (a loss that looks safe) and a
/// routed one as returned: measured here, 78 of 400 concurrent publishes (half of them
/// unroutable) were reported wrongly on RabbitMQ 3.10.8, 20 of 400 on 4.3.6. The broker sends a
/// message's return before its ack, so once every confirm of a batch is in, every return of the
/// batch has been handed to one of them; the returned message (exchange, routing key, body,
/// properties) then says which publish of the batch it was. A header naming the publish would
/// not do: [`Self::publish_copy`] must send a message byte for byte. A return that matches no
/// publish exactly (it cannot happen with RabbitMQ, which returns the message as published)
/// marks every publish of the batch with the same exchange and key as returned: the callers
/// keep their originals (a duplicate at worst), rather than trust an ack that may be a loss.
/// An earlier version held one publish in flight per channel instead: correct too, but the
/// broker then confirmed each publish with a frame of its own, which cost it 11-22 % more CPU
/// per retry round trip than raw lapin's; with batches the two are level (BENCHMARKS.md).
///
/// # Giving up on a publish
///
/// Every publish waits for its confirm for as long as the caller lets it: a deadline is the
/// caller's, for instance `tokio::time::timeout` around the publish. A caller that gives up
/// (drops the future) *withdraws* the publish unless a channel has already handed it to the
/// connection: a withdrawn publish is never sent, however long it waited for a free channel, and
/// its body is freed at once. So the publisher holds only the bodies of callers still waiting
/// (the worker's concurrency bounds them), plus those of the batches already on the connection
/// (at most one per channel) until their confirms come.
///
/// While the broker blocks the connection (`connection.blocked`: a memory or disk alarm), lapin
/// writes nothing more on it and sends what it holds once the alarm clears, whatever became of
/// its callers meanwhile. So no publish is handed to a blocked connection: the channels wait for
/// the alarm to clear, and a caller that gives up meanwhile withdraws its publish as above.
///
/// What "gave up" (timed out) guarantees, then: the publish was not confirmed, and it is never
/// sent *after* the caller gave up. It may have been sent *before*, and then the broker may still
/// route it, later: a publish handed to the connection before the broker's blocked notice
/// arrived (RabbitMQ blocks a connection when it publishes during an alarm, so the first publish
/// of each connection meets the alarm this way), or written to a broker that is slow to confirm.
/// A caller that gives up must treat the message as maybe sent: a copy whose original is then
/// given back may be delivered twice, never lost.
///
/// If a channel dies (a connection loss, or the broker closing it after a refused publish), the
/// publisher is closed as a whole: [`Self::channel`] then reports a closed channel and every
/// further publish fails with [`PublishError::Amqp`]; create a new publisher (on the new
/// connection).
#[derive(Clone, Debug)]
pub struct Publisher {
    inner: Arc<Inner>,
}

#[derive(Clone, Debug)]
struct Inner {
    requests: mpsc::Sender<Slot>,
    fate: Arc<Fate>,
    delay: DelayConfig,
    max_message_size: Option<usize>,
}

/// What every channel of a publisher shares: whether one of them died.
#[derive(Debug)]
struct Fate {
    /// The first channel: what [`Publisher::channel`] returns, closed when any channel dies.
    primary: Channel,
    /// The connection's state, blocked by the broker included.
    connection: ConnectionStatus,
    /// The error that killed a channel; every later publish fails with it.
    dead: OnceLock<lapin::Error>,
}

impl Fate {
    /// After a channel died: close the primary too, so that the owner sees a dead publisher and
    /// opens a new one, instead of having some publishes fail on the dead channel.
    async fn retire(&self, error: lapin::Error) {
        let _ = self.dead.set(error);
        if self.primary.status().connected() {
            let _ = self
                .primary
                .close(200, "another channel of this publisher was closed".into())
                .await;
        }
    }
}

/// One publish waiting for its batch, shared by its caller and the queue: the channel that
/// takes it sends it, unless its caller gave up first and took it back ([`Withdraw`]). Whichever
/// comes first wins, under the lock, so a publish is either sent or withdrawn, never both.
type Slot = Arc<Mutex<Option<Request>>>;

fn take(slot: &Slot) -> Option<Request> {
    slot.lock().unwrap_or_else(PoisonError::into_inner).take()
}

/// Held by the caller while it waits: when the caller gives up (its future is dropped), the
/// publish is withdrawn, and its body freed, if no channel took it yet.
struct Withdraw(Slot);

impl Drop for Withdraw {
    fn drop(&mut self) {
        drop(take(&self.0));
    }
}

/// A publish: what it sends and whom to answer.
struct Request {
    exchange: ShortString,
    routing_key: ShortString,
    body: Vec<u8>,
    properties: BasicProperties,
    reply: oneshot::Sender<Verdict>,
}

/// How the broker answered one publish.
#[derive(Debug)]
enum Verdict {
    Acked,
    Nacked,
    Returned { reply_code: u16, reply_text: String },
    Failed(lapin::Error),
}

/// Sends the batches of one channel until every clone of the publisher is gone.
async fn run_channel(
    channel: Channel,
    requests: Arc<AsyncMutex<mpsc::Receiver<Slot>>>,
    fate: Arc<Fate>,
) {
    loop {
        let mut slots = Vec::new();
        {
            // One channel at a time takes what is waiting; the others are sending or awaiting
            // their own batch meanwhile.
            let mut queue = requests.lock().await;
            if queue.recv_many(&mut slots, MAX_BATCH).await == 0 {
                // Every clone of the publisher is gone: nothing more will be sent here.
                if channel.status().connected() {
                    let _ = channel.close(200, "publisher dropped".into()).await;
                }
                return;
            }
        }
        // lapin would hold these until the alarm clears and then send them, even those whose
        // callers gave up meanwhile: they wait here instead, where giving up withdraws them.
        while fate.connection.blocked() && channel.status().connected() {
            tokio::time::sleep(BLOCKED_POLL).await;
        }
        let batch: Vec<Request> = slots.iter().filter_map(take).collect();
        if batch.is_empty() {
            continue;
        }
        if let Some(error) = fate.dead.get() {
            for request in batch {
                let _ = request.reply.send(Verdict::Failed(error.clone()));
            }
            continue;
        }
        if let Err(error) = send_batch(&channel, batch).await {
            fate.retire(error).await;
        }
    }
}

/// Publishes `batch` (mandatory), awaits its confirms and answers each request. An error that
/// leaves the channel unusable is returned after it was given to the requests it failed.
async fn send_batch(channel: &Channel, batch: Vec<Request>) -> Result<(), lapin::Error> {
    // All at once: lapin resolves a publish only once its frames are written, so sending them
    // one after the other would wait for the connection's writer once per publish.
    let confirmations = futures::future::join_all(batch.iter().map(|request| async {
        channel
            .basic_publish(
                request.exchange.clone(),
                request.routing_key.clone(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &request.body,
                request.properties.clone(),
            )
            .await?
            .await
    }))
    .await;
    let mut failure = None;
    let mut verdicts = Vec::with_capacity(batch.len());
    let mut returns = Vec::new();
    for confirmation in confirmations {
        verdicts.push(match confirmation {
            Ok(Confirmation::Ack(returned)) => {
                returns.extend(returned);
                Verdict::Acked
            }
            Ok(Confirmation::Nack(returned)) => {
                returns.extend(returned);
                Verdict::Nacked
            }
            // Cannot happen on a confirm channel; treat it as "not confirmed".
            Ok(Confirmation::NotRequested) => Verdict::Nacked,
            Err(e) => {
                failure.get_or_insert_with(|| e.clone());
                Verdict::Failed(e)
            }
        });
    }
    for returned in returns {
        mark_returned(&batch, &mut verdicts, &returned);
    }
    let fatal = !channel.status().connected();
    for (request, verdict) in batch.into_iter().zip(verdicts) {
        let _ = request.reply.send(verdict);
    }
    match failure {
        Some(e) if fatal => Err(e),
        _ => Ok(()),
    }
}

/// Gives `returned` to the publish of `batch` it is: the one with its exchange, key, body and
/// properties (any one of several identical publishes, which the broker routes alike), or, when
/// none is exactly it, every acked publish with its exchange and key.
fn mark_returned(batch: &[Request], verdicts: &mut [Verdict], returned: &BasicReturnMessage) {
    let d = &returned.delivery;
    let same_route = |r: &Request| r.exchange == d.exchange && r.routing_key == d.routing_key;
    let acked = |verdicts: &[Verdict], i: usize| matches!(verdicts.get(i), Some(Verdict::Acked));
    let exact = batch.iter().enumerate().position(|(i, r)| {
        acked(verdicts, i) && same_route(r) && r.body == d.data && r.properties == d.properties
    });
    let verdict = || Verdict::Returned {
        reply_code: returned.reply_code,
        reply_text: returned.reply_text.as_str().to_owned(),
    };
    match exact {
        Some(i) => verdicts[i] = verdict(),
        None => {
            tracing::warn!(
                exchange = d.exchange.as_str(),
                routing_key = d.routing_key.as_str(),
                "a returned message matches no publish of its batch exactly; \
                 reporting every publish with its exchange and key as returned"
            );
            for (i, r) in batch.iter().enumerate() {
                if acked(verdicts, i) && same_route(r) {
                    verdicts[i] = verdict();
                }
            }
        }
    }
}

impl Publisher {
    /// Opens [`DEFAULT_PUBLISH_CHANNELS`] channels on `conn` and puts them in confirm mode.
    /// `delay` tells [`Self::publish_delayed`] where the delay infrastructure is.
    pub async fn new(conn: &Connection, delay: DelayConfig) -> Result<Self, PublishError> {
        Self::with_channels(conn, delay, DEFAULT_PUBLISH_CHANNELS).await
    }

    /// [`Self::new`] with `channels` confirm-mode channels (at least 1): the number of batches
    /// of publishes that can await their confirms at once (each holds up to 256 publishes). A
    /// tool that publishes one message at a time needs 1.
    ///
    /// Each channel is served by a task of its own, so this must be called within a Tokio
    /// runtime; the tasks end, and close their channels, when the last clone is dropped.
    pub async fn with_channels(
        conn: &Connection,
        delay: DelayConfig,
        channels: usize,
    ) -> Result<Self, PublishError> {
        let open = || async {
            let channel = conn.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, PublishError>(channel)
        };
        let open_all = || futures::future::try_join_all((0..channels.max(1)).map(|_| open()));
        // A channel the broker just closed on this connection (a passive declare's 404, as
        // `DelayConfig::declare` probes) can hand its close to a new channel that reuses its
        // number before lapin has finished with it (seen with lapin 4.12.3): one more try.
        let all = match open_all().await {
            Ok(all) => all,
            Err(PublishError::Amqp(_)) if conn.status().connected() => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                open_all().await?
            }
            Err(e) => return Err(e),
        };
        let Some(primary) = all.first().cloned() else {
            return Err(PublishError::Amqp(
                std::io::Error::other("no publisher channel was opened").into(),
            ));
        };
        let fate = Arc::new(Fate {
            primary,
            connection: conn.status().clone(),
            dead: OnceLock::new(),
        });
        let (requests, queue) = mpsc::channel(MAX_BATCH * all.len());
        let queue = Arc::new(AsyncMutex::new(queue));
        for channel in all {
            tokio::spawn(run_channel(channel, queue.clone(), fate.clone()));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                requests,
                fate,
                delay,
                max_message_size: None,
            }),
        })
    }

    /// Refuse bodies larger than `limit` bytes with [`PublishError::TooLarge`] before sending
    /// them. Without it the broker refuses them itself by closing the channel, which fails every
    /// other publish in flight on it. RabbitMQ's default `max_message_size` is 16 MiB from 4.0
    /// and 128 MiB before ([`BrokerVersion::default_max_message_size`]).
    ///
    /// [`BrokerVersion::default_max_message_size`]: crate::BrokerVersion::default_max_message_size
    pub fn with_max_message_size(mut self, limit: usize) -> Self {
        Arc::make_mut(&mut self.inner).max_message_size = Some(limit);
        self
    }

    /// The limit set with [`Self::with_max_message_size`].
    pub fn max_message_size(&self) -> Option<usize> {
        self.inner.max_message_size
    }

    /// The first of the publisher's confirm-mode channels: open as long as the publisher is
    /// usable (it is closed when any of the others dies).
    pub fn channel(&self) -> &Channel {
        &self.inner.fate.primary
    }

    /// The delay configuration used by [`Self::publish_delayed`].
    pub fn delay_config(&self) -> &DelayConfig {
        &self.inner.delay
    }

    /// Publishes `body` and waits for the broker's confirm.
    ///
    /// Fills, only where absent: `message_id` (a UUID v4), `content_type`
    /// (`application/octet-stream`), `timestamp` (now, Unix seconds) and `delivery_mode` 2
    /// (persistent). A nack or a returned (unroutable) message is an error.
    pub async fn publish_bytes(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), PublishError> {
        self.publish_filled(exchange, routing_key, body, fill(props, OCTET_STREAM))
            .await
    }

    /// Serializes `value` as JSON (`content_type` `application/json`), publishes it like
    /// [`Self::publish_bytes`] and returns its `message_id`.
    pub async fn publish_json<T: serde::Serialize + ?Sized>(
        &self,
        exchange: &str,
        routing_key: &str,
        value: &T,
    ) -> Result<String, PublishError> {
        let body = serde_json::to_vec(value)?;
        let props = fill(BasicProperties::default(), JSON);
        let id = props
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default();
        self.publish_filled(exchange, routing_key, &body, props)
            .await?;
        Ok(id)
    }

    /// Publishes an [`OutgoingMessage`] like [`Self::publish_bytes`].
    pub async fn publish_message(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &OutgoingMessage,
    ) -> Result<(), PublishError> {
        self.publish_bytes(
            exchange,
            routing_key,
            &message.body,
            message.properties.clone(),
        )
        .await
    }

    /// Publishes through the delay infrastructure so the message reaches `queue` (the full queue
    /// name, prefix included) after `delay`, rounded up to the granularity.
    ///
    /// The properties are kept as given, since a retry passes its original's: a message without
    /// a `message_id` gets none (every copy of it must share the original's identity, absent or
    /// not), and only `delivery_mode` is filled when absent (persistent, so the wait survives a
    /// broker restart). Set a `message_id` yourself when publishing a new message this way. The
    /// confirm means the broker holds the message in the delay levels. A
    /// destination queue that does not exist (or is not bound to the deliver exchange) is only
    /// found out when the delay expires: the message is then parked in the unroutable queue.
    pub async fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), PublishError> {
        let route = self.inner.delay.route(queue, delay)?;
        let props = match props.delivery_mode() {
            Some(_) => props,
            None => props.with_delivery_mode(2),
        };
        // A retry copy keeps its original's trace; one without joins the current span's.
        #[cfg(feature = "otel")]
        let props = crate::trace_context::with_current(props);
        self.publish_filled(&route.exchange, &route.routing_key, body, props)
            .await
    }

    /// Publishes a copy of a message the broker already took, its properties exactly as given
    /// (nothing filled in), and waits for the broker's confirm: what a replay, a repaired copy or
    /// an annotated dead letter needs, where the copy must be the original byte for byte,
    /// `message_id` (or its absence) included. The body is the one the broker accepted, and
    /// headers do not count toward `max_message_size`, so [`Self::with_max_message_size`] is not
    /// applied: a dead letter must not be refused for a limit set below the broker's.
    pub async fn publish_copy(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), PublishError> {
        self.send(exchange, routing_key, body, props).await
    }

    async fn publish_filled(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), PublishError> {
        if let Some(limit) = self.inner.max_message_size {
            if body.len() > limit {
                return Err(PublishError::TooLarge {
                    exchange: exchange.to_owned(),
                    routing_key: routing_key.to_owned(),
                    size: body.len(),
                    limit: Some(limit),
                });
            }
        }
        self.send(exchange, routing_key, body, props).await
    }

    /// Publishes (mandatory) and waits for the confirm; a returned message is an error.
    async fn send(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), PublishError> {
        let (reply, verdict) = oneshot::channel();
        let slot = Arc::new(Mutex::new(Some(Request {
            exchange: short(exchange)?,
            routing_key: short(routing_key)?,
            body: body.to_vec(),
            properties: props,
            reply,
        })));
        // Dropped with this future: a caller that stops waiting withdraws the publish.
        let _withdraw = Withdraw(Arc::clone(&slot));
        let stopped = || {
            let error = self.inner.fate.dead.get().cloned().unwrap_or_else(|| {
                std::io::Error::other("the publisher's channels have stopped").into()
            });
            PublishError::Amqp(error)
        };
        if self.inner.requests.send(slot).await.is_err() {
            return Err(stopped());
        }
        match verdict.await.map_err(|_| stopped())? {
            Verdict::Acked => Ok(()),
            Verdict::Returned {
                reply_code,
                reply_text,
            } => Err(PublishError::Returned {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
                reply_code,
                reply_text,
            }),
            Verdict::Nacked => Err(PublishError::Nacked {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            }),
            // The broker closes the channel over one body too large, failing the publishes
            // sent with it too: only the one of that size is refused for its size.
            Verdict::Failed(e) => match refused_size(&e) {
                Some((size, limit)) if size.is_none_or(|s| s == body.len()) => {
                    Err(PublishError::TooLarge {
                        exchange: exchange.to_owned(),
                        routing_key: routing_key.to_owned(),
                        size: body.len(),
                        limit,
                    })
                }
                _ => Err(PublishError::Amqp(e)),
            },
        }
    }
}

/// The broker's refusal of a body over `max_message_size` (406 PRECONDITION_FAILED, "message
/// size N is larger than configured max size M"): `Some((N, M))`, each `None` when the text does
/// not name it.
fn refused_size(e: &lapin::Error) -> Option<(Option<usize>, Option<usize>)> {
    let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
        return None;
    };
    let text = amqp.get_message().as_str();
    if amqp.get_id() != 406 || !text.contains("message size") {
        return None;
    }
    let number_after = |mark: &str| {
        text.find(mark).and_then(|i| {
            let digits: String = text[i + mark.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
    };
    Some((number_after("message size "), number_after("max size ")))
}

/// Fills the properties a publish should always carry, keeping those already set.
fn fill(props: BasicProperties, content_type: &str) -> BasicProperties {
    #[cfg(feature = "otel")]
    let props = crate::trace_context::with_current(props);
    let mut p = props;
    if p.message_id().is_none() {
        p = p.with_message_id(uuid::Uuid::new_v4().to_string().into());
    }
    if p.content_type().is_none() {
        p = p.with_content_type(content_type.into());
    }
    if p.timestamp().is_none() {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        p = p.with_timestamp(now);
    }
    if p.delivery_mode().is_none() {
        p = p.with_delivery_mode(2);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_keeps_given_values() {
        let p = fill(BasicProperties::default(), OCTET_STREAM);
        assert_eq!(p.message_id().as_ref().map(|s| s.as_str().len()), Some(36));
        assert_eq!(
            p.content_type().as_ref().map(|s| s.as_str()),
            Some(OCTET_STREAM)
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        assert!(p.timestamp().is_some());
        let given = BasicProperties::default()
            .with_message_id("m1".into())
            .with_content_type("text/plain".into())
            .with_timestamp(7)
            .with_delivery_mode(1);
        assert_eq!(fill(given.clone(), JSON), given);
    }
}
