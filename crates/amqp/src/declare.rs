//! What the topology and the delay infrastructure share: queue types, the operator queues'
//! delivery limit, and the broker operations that declare, verify and delete their objects.
//!
//! Every operation runs on a channel opened here and closed afterwards: a 406
//! PRECONDITION_FAILED closes the channel it happens on, and it should never be the caller's.

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ExchangeKind};

use crate::error::TopologyError;
use crate::names::{short, NameError};

/// `x-delivery-limit` of every quorum queue that holds messages for an operator (a quorum
/// `Q.dlq`, the delay levels' parking queue): 2^31 - 1, a limit no reading can reach.
///
/// From RabbitMQ 4.0 every quorum queue has a delivery limit (20 when none is declared), and
/// reading a message without acknowledging it spends one attempt: an operator queue without
/// its own limit drops a message for good after ~20 listings (it has no dead-letter exchange).
/// The usual way to disable the limit, `-1`, works only from 4.0: RabbitMQ 3.10 drops the
/// message on its first return. A large limit means the same on every version, so a queue
/// declared on 3.x keeps its arguments, and its messages, through an upgrade to 4.x.
pub const OPERATOR_DELIVERY_LIMIT: i64 = i32::MAX as i64;

/// Type of a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QueueType {
    /// Replicated quorum queue: supports `x-delivery-limit` and at-least-once dead-lettering.
    #[default]
    Quorum,
    /// Classic queue: faster, no delivery limit, at-most-once dead-lettering.
    Classic,
}

impl QueueType {
    /// `"quorum"` or `"classic"`, the value of `x-queue-type`.
    pub fn as_str(&self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// An argument value of type long string, as RabbitMQ stores text arguments.
pub(crate) fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes()))
}

/// Renders arguments for error messages: `{a = "x", b = 5}`.
pub(crate) fn describe_args(t: &FieldTable) -> String {
    let parts: Vec<String> = t
        .inner()
        .iter()
        .map(|(k, v)| {
            let v = match v {
                AMQPValue::LongString(s) => format!("{:?}", String::from_utf8_lossy(s.as_bytes())),
                AMQPValue::ShortString(s) => format!("{:?}", s.as_str()),
                AMQPValue::LongLongInt(i) => i.to_string(),
                other => format!("{other:?}"),
            };
            format!("{k} = {v}")
        })
        .collect();
    format!("{{{}}}", parts.join(", "))
}

/// One broker operation.
pub(crate) enum Op {
    Exchange {
        name: String,
        kind: ExchangeKind,
        args: FieldTable,
        passive: bool,
    },
    Queue {
        name: String,
        args: FieldTable,
        passive: bool,
    },
    BindQueue {
        queue: String,
        exchange: String,
        key: String,
    },
    BindExchange {
        destination: String,
        source: String,
        key: String,
    },
    UnbindQueue {
        queue: String,
        exchange: String,
        key: String,
    },
    DeleteQueue {
        name: String,
    },
    DeleteExchange {
        name: String,
    },
}

impl Op {
    fn object(&self) -> String {
        match self {
            Op::Exchange { name, .. } | Op::DeleteExchange { name } => {
                format!("exchange '{name}'")
            }
            Op::Queue { name, .. } | Op::DeleteQueue { name } => format!("queue '{name}'"),
            Op::BindQueue {
                queue,
                exchange,
                key,
            }
            | Op::UnbindQueue {
                queue,
                exchange,
                key,
            } => {
                format!("binding of queue '{queue}' to exchange '{exchange}' with key '{key}'")
            }
            Op::BindExchange {
                destination,
                source,
                key,
            } => format!(
                "binding of exchange '{destination}' to exchange '{source}' with key '{key}'"
            ),
        }
    }

    fn requested(&self) -> String {
        match self {
            Op::Exchange { kind, args, .. } => {
                format!(
                    "durable {kind:?} exchange with arguments {}",
                    describe_args(args)
                )
            }
            Op::Queue { args, .. } => {
                format!("durable queue with arguments {}", describe_args(args))
            }
            _ => String::new(),
        }
    }

    fn is_delete(&self) -> bool {
        matches!(self, Op::DeleteQueue { .. } | Op::DeleteExchange { .. })
    }
}

/// A private channel, opened lazily and reopened only after an error closed it.
pub(crate) struct Session<'a> {
    conn: &'a Connection,
    channel: Option<Channel>,
}

/// Declares `queue` passively on `channel`: the queue's counts, or `None` when it does not exist.
/// The broker answers a missing queue with a 404 that closes `channel`: pass a channel of its
/// own, or open another after a `None`. A name longer than 255 bytes names no queue: `None`,
/// without asking the broker.
///
/// ```no_run
/// # async fn demo(conn: &redeliver::lapin::Connection) -> Result<(), redeliver::lapin::Error> {
/// let channel = conn.create_channel().await?;
/// match redeliver::amqp::passive_queue(&channel, "images.dlq").await? {
///     Some(q) => println!("{} ready, {} consumers", q.message_count(), q.consumer_count()),
///     None => println!("no such queue"),
/// }
/// # Ok(()) }
/// ```
pub async fn passive_queue(
    channel: &Channel,
    queue: &str,
) -> Result<Option<lapin::Queue>, lapin::Error> {
    // No queue can have a name longer than AMQP's short string (and lapin would panic on it).
    let Ok(name) = ShortString::try_new(queue) else {
        return Ok(None);
    };
    let declared = channel
        .queue_declare(
            name,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(q) => Ok(Some(q)),
        Err(e) if crate::error::is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Declares `exchange` passively on `channel`: `true` when it exists, `false` when it does not.
/// A passive declare compares neither type nor arguments, so any exchange of that name counts.
/// As with [`passive_queue`], the broker's 404 closes `channel`: pass a channel of its own, or
/// open another after a `false`. A name longer than 255 bytes names no exchange: `false`,
/// without asking the broker.
///
/// ```no_run
/// # async fn demo(conn: &redeliver_amqp::lapin::Connection) -> Result<(), redeliver_amqp::lapin::Error> {
/// let channel = conn.create_channel().await?;
/// if !redeliver_amqp::passive_exchange(&channel, "images.dlx").await? {
///     println!("no such exchange");
/// }
/// # Ok(()) }
/// ```
pub async fn passive_exchange(channel: &Channel, exchange: &str) -> Result<bool, lapin::Error> {
    // No exchange can have a name longer than AMQP's short string (lapin would panic on it).
    let Ok(name) = ShortString::try_new(exchange) else {
        return Ok(false);
    };
    let declared = channel
        .exchange_declare(
            name,
            // Ignored by a passive declare; some kind must be sent.
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(()) => Ok(true),
        Err(e) if crate::error::is_not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

impl<'a> Session<'a> {
    pub(crate) fn new(conn: &'a Connection) -> Self {
        Self {
            conn,
            channel: None,
        }
    }

    /// Runs one (passive) declaration: `Ok(false)` when the object does not exist. The session
    /// stays usable (a 404 closes its channel; the next operation opens another).
    pub(crate) async fn exists(&mut self, op: &Op) -> Result<bool, TopologyError> {
        Ok(self.run_missing_ok(op).await?.is_some())
    }

    /// Ready messages of `queue` (a passive declare), `None` when it does not exist.
    pub(crate) async fn count(&mut self, queue: &str) -> Result<Option<u32>, TopologyError> {
        self.run_missing_ok(&Op::Queue {
            name: queue.to_owned(),
            args: FieldTable::default(),
            passive: true,
        })
        .await
    }

    /// Deletes `queue` with its messages: how many it held, `None` when it did not exist.
    pub(crate) async fn delete_queue(&mut self, queue: &str) -> Result<Option<u32>, TopologyError> {
        self.run_missing_ok(&Op::DeleteQueue {
            name: queue.to_owned(),
        })
        .await
    }

    /// Runs `op`; `Ok(None)` when the broker answered 404 (the object, or one end of a
    /// binding, does not exist), else what [`Self::run`] gives.
    pub(crate) async fn run_missing_ok(&mut self, op: &Op) -> Result<Option<u32>, TopologyError> {
        match self.run(op).await {
            Ok(n) => Ok(Some(n)),
            Err(TopologyError::Missing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Runs `ops` in order, stopping at the first error (deletes skip missing objects),
    /// then closes the channel.
    pub(crate) async fn run_all(mut self, ops: Vec<Op>) -> Result<(), TopologyError> {
        let mut result = Ok(());
        for op in &ops {
            match self.run(op).await {
                Ok(_) => {}
                Err(TopologyError::Missing { .. }) if op.is_delete() => {}
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.close().await;
        result
    }

    /// Closes the session's channel, if open.
    pub(crate) async fn close(mut self) {
        if let Some(ch) = self.channel.take() {
            if ch.status().connected() {
                // Best effort: the work is done (or failed) either way.
                let _ = ch.close(200, "OK".into()).await;
            }
        }
    }

    /// Runs one operation: the message count of a queue declared or deleted, else 0.
    pub(crate) async fn run(&mut self, op: &Op) -> Result<u32, TopologyError> {
        let ch = match &self.channel {
            Some(ch) if ch.status().connected() => ch.clone(),
            _ => {
                let ch = self.conn.create_channel().await?;
                self.channel = Some(ch.clone());
                ch
            }
        };
        match Self::exec(&ch, op).await {
            Ok(n) => Ok(n),
            Err(e) => {
                // A soft error closed the channel; the next op opens a fresh one.
                self.channel = None;
                Err(classify(op, e))
            }
        }
    }

    async fn exec(ch: &Channel, op: &Op) -> Result<u32, Failure> {
        match op {
            Op::Exchange { name, passive, .. } if *passive => {
                if !passive_exchange(ch, short(name)?.as_str()).await? {
                    return Err(Failure::Missing);
                }
            }
            Op::Exchange {
                name, kind, args, ..
            } => {
                let opts = ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                };
                ch.exchange_declare(short(name)?, kind.clone(), opts, args.clone())
                    .await?;
            }
            Op::Queue { name, passive, .. } if *passive => {
                return match passive_queue(ch, short(name)?.as_str()).await? {
                    Some(q) => Ok(q.message_count()),
                    None => Err(Failure::Missing),
                };
            }
            Op::Queue { name, args, .. } => {
                let opts = QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                };
                let q = ch.queue_declare(short(name)?, opts, args.clone()).await?;
                return Ok(q.message_count());
            }
            Op::BindQueue {
                queue,
                exchange,
                key,
            } => {
                ch.queue_bind(
                    short(queue)?,
                    short(exchange)?,
                    short(key)?,
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            }
            Op::UnbindQueue {
                queue,
                exchange,
                key,
            } => {
                ch.queue_unbind(
                    short(queue)?,
                    short(exchange)?,
                    short(key)?,
                    FieldTable::default(),
                )
                .await?;
            }
            Op::BindExchange {
                destination,
                source,
                key,
            } => {
                ch.exchange_bind(
                    short(destination)?,
                    short(source)?,
                    short(key)?,
                    ExchangeBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            }
            Op::DeleteQueue { name } => {
                return Ok(ch
                    .queue_delete(short(name)?, QueueDeleteOptions::default())
                    .await?);
            }
            Op::DeleteExchange { name } => {
                ch.exchange_delete(short(name)?, ExchangeDeleteOptions::default())
                    .await?;
            }
        }
        Ok(0)
    }
}

enum Failure {
    Name(NameError),
    Amqp(lapin::Error),
    /// A passive declare found nothing (the broker's 404, already read).
    Missing,
}

impl From<NameError> for Failure {
    fn from(e: NameError) -> Self {
        Failure::Name(e)
    }
}

impl From<lapin::Error> for Failure {
    fn from(e: lapin::Error) -> Self {
        Failure::Amqp(e)
    }
}

fn classify(op: &Op, f: Failure) -> TopologyError {
    let e = match f {
        Failure::Name(n) => return TopologyError::InvalidName(n),
        Failure::Missing => {
            return TopologyError::Missing {
                object: op.object(),
            }
        }
        Failure::Amqp(e) => e,
    };
    let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
        return TopologyError::Amqp(e);
    };
    let msg = amqp.get_message().as_str().to_owned();
    match amqp.kind() {
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => TopologyError::Mismatch {
            object: op.object(),
            argument: mismatched_argument(&msg),
            requested: op.requested(),
            broker_message: msg,
        },
        AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => TopologyError::Missing {
            object: missing_object(&msg).unwrap_or_else(|| op.object()),
        },
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => TopologyError::AccessRefused {
            object: op.object(),
            broker_message: msg,
        },
        _ => TopologyError::Amqp(e),
    }
}

/// The existing value in a 406's text: `... but current is 'v1'` (both values of one type),
/// `... but current is the value 'q.dlx' of type 'longstr'` -> `v1`, `q.dlx`; `... but current
/// is none` -> `None`.
pub(crate) fn current_value(msg: &str) -> Option<String> {
    const MARK: &str = "but current is ";
    let rest = &msg[msg.find(MARK)? + MARK.len()..];
    let value = match rest.strip_prefix("the value '") {
        Some(typed) => &typed[..typed.rfind("' of type")?],
        None => {
            let quoted = rest.strip_prefix('\'')?;
            &quoted[..quoted.rfind('\'')?]
        }
    };
    Some(value.to_owned())
}

/// `... inequivalent arg 'x-dead-letter-exchange' for queue 'q' ...` -> the argument.
/// Exchange redeclarations with another type read `... with different type, durable,
/// internal or autodelete value`: no single argument is named then.
fn mismatched_argument(msg: &str) -> Option<String> {
    const MARK: &str = "inequivalent arg '";
    let start = msg.find(MARK)? + MARK.len();
    let len = msg[start..].find('\'')?;
    Some(msg[start..start + len].to_owned())
}

/// `NOT_FOUND - no exchange 'x' in vhost '/'` -> `exchange 'x'` (a binding names the end
/// that is missing this way).
fn missing_object(msg: &str) -> Option<String> {
    const MARK: &str = "no ";
    let start = msg.find(MARK)? + MARK.len();
    let rest = &msg[start..];
    let kind_len = rest.find(" '")?;
    let kind = &rest[..kind_len];
    if kind != "queue" && kind != "exchange" {
        return None;
    }
    let name_start = kind_len + 2;
    let name_len = rest[name_start..].find('\'')?;
    Some(format!(
        "{kind} '{}'",
        &rest[name_start..name_start + name_len]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_broker_messages() {
        let m = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received none but current is the value 'q.dlx' of type 'longstr'";
        assert_eq!(
            mismatched_argument(m).as_deref(),
            Some("x-dead-letter-exchange")
        );
        assert_eq!(mismatched_argument("PRECONDITION_FAILED - cannot redeclare exchange 'e' in vhost '/' with different type, durable, internal or autodelete value"), None);
        assert_eq!(
            missing_object("NOT_FOUND - no exchange 'a.b' in vhost '/'").as_deref(),
            Some("exchange 'a.b'")
        );
        assert_eq!(
            missing_object("NOT_FOUND - no queue 'q' in vhost '/'").as_deref(),
            Some("queue 'q'")
        );
        assert_eq!(missing_object("NOT_FOUND - something else"), None);
        assert_eq!(mismatched_argument("inequivalent arg 'unterminated"), None);
        assert_eq!(current_value(m).as_deref(), Some("q.dlx"));
        assert_eq!(
            current_value("PRECONDITION_FAILED - inequivalent arg 'alternate-exchange' for exchange 'e' in vhost '/': received 'levels=4 granularity=10ms queue-type=quorum' but current is 'levels=3 granularity=10ms queue-type=quorum'").as_deref(),
            Some("levels=3 granularity=10ms queue-type=quorum")
        );
        assert_eq!(
            current_value("PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '20' but current is '10'").as_deref(),
            Some("10")
        );
        assert_eq!(
            current_value("received the value 'z' of type 'longstr' but current is none"),
            None
        );
    }
}
