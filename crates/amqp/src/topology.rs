//! The objects of one consumer queue `Q`: the queue itself, its dead-letter exchange `Q.dlx`, its
//! dead-letter queue `Q.dlq`, optional user bindings, and its binding to the delay
//! infrastructure's deliver exchange.
//!
//! | object | kind | arguments |
//! |---|---|---|
//! | `Q` | quorum (default) or classic queue | `x-dead-letter-exchange = Q.dlx`, `x-dead-letter-routing-key = Q`; quorum: `x-delivery-limit` (default 20), `x-dead-letter-strategy = at-least-once`, `x-overflow = reject-publish` |
//! | `Q.dlx` | direct exchange | |
//! | `Q.dlq` | classic (default) or quorum queue bound to `Q.dlx` with key `Q` | optional `x-message-ttl`, `x-max-length`; quorum: `x-queue-type = quorum`, `x-delivery-limit =` [`OPERATOR_DELIVERY_LIMIT`] |
//!
//! Every declaration runs on a channel this crate opens and closes itself: a 406
//! PRECONDITION_FAILED closes the channel it happens on, and it should never be one of yours.
//!
//! ```no_run
//! # async fn demo(conn: &redeliver_amqp::lapin::Connection) -> Result<(), redeliver_amqp::topology::TopologyError> {
//! use redeliver_amqp::topology::Topology;
//!
//! let topo = Topology::new("images").prefix("prod.").bind("uploads", "image.*");
//! topo.declare(conn).await?; // idempotent: the same call on every start is a no-op
//! assert_eq!(topo.dlq_name(), "prod.images.dlq");
//! # Ok(()) }
//! ```

use crate::delay::{DelayConfig, DelayError};
use crate::names::{self, NameError};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::ExchangeKind;
use std::time::Duration;

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

/// A binding of the consumer queue to a user exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The user's exchange (used as given: no prefix, and it must already exist).
    pub exchange: String,
    /// The binding key.
    pub routing_key: String,
}

/// What declaring, verifying or deleting topology can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// An object exists with other arguments than requested (406 PRECONDITION_FAILED).
    #[error("{object} exists with different arguments{}: the broker said \"{broker_message}\"; requested {requested}", argument.as_ref().map(|a| format!(" (argument '{a}' differs)")).unwrap_or_default())]
    Mismatch {
        /// The object, e.g. `queue 'orders'`.
        object: String,
        /// The differing argument, when the broker's message names it.
        argument: Option<String>,
        /// The arguments we asked for.
        requested: String,
        /// The broker's reply text.
        broker_message: String,
    },
    /// An object does not exist (404 NOT_FOUND), e.g. on verify or when binding to a user
    /// exchange that was never declared.
    #[error("{object} does not exist")]
    Missing {
        /// The object, e.g. `queue 'orders'`.
        object: String,
    },
    /// The user lacks the permission (403 ACCESS_REFUSED); with a read/write-only user, use
    /// `verify` instead of `declare`.
    #[error("access refused on {object}: {broker_message}")]
    AccessRefused {
        /// The object, e.g. `queue 'orders'`.
        object: String,
        /// The broker's reply text.
        broker_message: String,
    },
    /// A queue or exchange name is unusable.
    #[error(transparent)]
    InvalidName(#[from] NameError),
    /// The delay configuration is invalid.
    #[error(transparent)]
    Delay(#[from] DelayError),
    /// Any other AMQP error (connection lost, ...).
    #[error("AMQP error: {0}")]
    Amqp(#[from] lapin::Error),
}

/// The topology of one consumer queue; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct Topology {
    queue: String,
    prefix: String,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
    dlq_message_ttl: Option<Duration>,
    dlq_max_length: Option<u64>,
    dlq_queue_type: QueueType,
    bindings: Vec<Binding>,
    delay: DelayConfig,
    delay_given: bool,
}

impl Topology {
    /// Topology for the queue `queue` (the prefix, if any, is prepended).
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            prefix: String::new(),
            queue_type: QueueType::Quorum,
            delivery_limit: Some(20),
            dlq_message_ttl: None,
            dlq_max_length: None,
            dlq_queue_type: QueueType::Classic,
            bindings: Vec::new(),
            delay: DelayConfig::default(),
            delay_given: false,
        }
    }

    /// Prefix of the queue, DLX and DLQ names; also the delay infrastructure's prefix unless
    /// [`Self::delay`] was given.
    pub fn prefix(mut self, p: impl Into<String>) -> Self {
        self.prefix = p.into();
        if !self.delay_given {
            self.delay = self.delay.prefix(self.prefix.clone());
        }
        self
    }

    /// Type of the consumer queue (quorum by default).
    pub fn queue_type(mut self, t: QueueType) -> Self {
        self.queue_type = t;
        self
    }

    /// Shorthand for `queue_type(QueueType::Classic)`.
    pub fn classic(self) -> Self {
        self.queue_type(QueueType::Classic)
    }

    /// `x-delivery-limit` of a quorum queue (default `Some(20)`): a message redelivered more
    /// often (say it crashes the worker every time) is dead-lettered with reason
    /// `delivery_limit`. `None` disables it. Ignored for classic queues.
    pub fn delivery_limit(mut self, n: Option<u32>) -> Self {
        self.delivery_limit = n;
        self
    }

    /// Retention of dead-lettered messages (`x-message-ttl` on `Q.dlq`); none by default.
    pub fn dlq_message_ttl(mut self, d: Duration) -> Self {
        self.dlq_message_ttl = Some(d);
        self
    }

    /// Type of `Q.dlq`: classic by default (one node holds it). On a cluster choose
    /// [`QueueType::Quorum`], so dead letters survive the loss of the node that holds them, as the
    /// work queue's messages do.
    ///
    /// The type of an existing queue cannot change: declaring `Q.dlq` with another type fails with
    /// [`TopologyError::Mismatch`]; empty it first (`redeliver dlq replay` sends its messages back to the work queue),
    /// delete it, then declare again.
    ///
    /// ```
    /// use redeliver_amqp::topology::{QueueType, Topology};
    /// let topo = Topology::new("images").dlq_queue_type(QueueType::Quorum);
    /// assert_eq!(topo.get_dlq_queue_type(), QueueType::Quorum);
    /// ```
    pub fn dlq_queue_type(mut self, t: QueueType) -> Self {
        self.dlq_queue_type = t;
        self
    }

    /// `x-max-length` of `Q.dlq`; unbounded by default.
    pub fn dlq_max_length(mut self, n: u64) -> Self {
        self.dlq_max_length = Some(n);
        self
    }

    /// Also bind the queue to the user's `exchange` (as given, no prefix; it must exist)
    /// with `routing_key`.
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.bindings.push(Binding {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        });
        self
    }

    /// Use this delay configuration (its own prefix wins over [`Self::prefix`]).
    pub fn delay(mut self, cfg: DelayConfig) -> Self {
        self.delay = cfg;
        self.delay_given = true;
        self
    }

    /// The delay configuration in use.
    pub fn delay_config(&self) -> &DelayConfig {
        &self.delay
    }

    /// The configured prefix.
    pub fn get_prefix(&self) -> &str {
        &self.prefix
    }

    /// The consumer queue's type.
    pub fn get_queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// The dead-letter queue's type.
    pub fn get_dlq_queue_type(&self) -> QueueType {
        self.dlq_queue_type
    }

    /// The configured delivery limit.
    pub fn get_delivery_limit(&self) -> Option<u32> {
        self.delivery_limit
    }

    /// The user bindings.
    pub fn bindings(&self) -> &[Binding] {
        &self.bindings
    }

    /// `{prefix}{queue}`.
    pub fn queue_name(&self) -> String {
        format!("{}{}", self.prefix, self.queue)
    }

    /// `{prefix}{queue}.dlx`.
    pub fn dlx_name(&self) -> String {
        format!("{}.dlx", self.queue_name())
    }

    /// `{prefix}{queue}.dlq`.
    pub fn dlq_name(&self) -> String {
        format!("{}.dlq", self.queue_name())
    }

    /// Arguments of the consumer queue.
    pub fn queue_arguments(&self) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("x-dead-letter-exchange".into(), text(&self.dlx_name()));
        t.insert("x-dead-letter-routing-key".into(), text(&self.queue_name()));
        if self.queue_type == QueueType::Quorum {
            t.insert("x-queue-type".into(), text("quorum"));
            if let Some(n) = self.delivery_limit {
                t.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongLongInt(i64::from(n)),
                );
            }
            t.insert("x-dead-letter-strategy".into(), text("at-least-once"));
            t.insert("x-overflow".into(), text("reject-publish"));
        }
        t
    }

    /// Arguments of the dead-letter queue.
    pub fn dlq_arguments(&self) -> FieldTable {
        let mut t = FieldTable::default();
        if self.dlq_queue_type == QueueType::Quorum {
            t.insert("x-queue-type".into(), text("quorum"));
            t.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(OPERATOR_DELIVERY_LIMIT),
            );
        }
        if let Some(d) = self.dlq_message_ttl {
            let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
            t.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ms));
        }
        if let Some(n) = self.dlq_max_length {
            let n = i64::try_from(n).unwrap_or(i64::MAX);
            t.insert("x-max-length".into(), AMQPValue::LongLongInt(n));
        }
        t
    }

    /// Checks every name this topology would use.
    pub fn validate(&self) -> Result<(), TopologyError> {
        self.delay.validate()?;
        let q = self.queue_name();
        names::validate_routed_queue_name(&q, self.delay.get_levels())?;
        names::validate_short(&self.dlq_name())?;
        names::validate_short(&self.dlx_name())?;
        for b in &self.bindings {
            names::validate_short(&b.exchange)?;
            names::validate_short(&b.routing_key)?;
        }
        Ok(())
    }

    fn own_ops(&self, passive: bool) -> Vec<ops::Op> {
        use ops::Op;
        let q = self.queue_name();
        let mut v = vec![
            Op::Exchange {
                name: self.dlx_name(),
                kind: ExchangeKind::Direct,
                args: FieldTable::default(),
                passive,
            },
            Op::Queue {
                name: self.dlq_name(),
                args: self.dlq_arguments(),
                passive,
            },
        ];
        if !passive {
            v.push(Op::BindQueue {
                queue: self.dlq_name(),
                exchange: self.dlx_name(),
                key: q.clone(),
            });
        }
        v.push(Op::Queue {
            name: q.clone(),
            args: self.queue_arguments(),
            passive,
        });
        if !passive {
            v.push(Op::BindQueue {
                queue: q.clone(),
                exchange: self.delay.deliver_exchange(),
                key: self.delay.deliver_binding_key(&q),
            });
            for b in &self.bindings {
                v.push(Op::BindQueue {
                    queue: q.clone(),
                    exchange: b.exchange.clone(),
                    key: b.routing_key.clone(),
                });
            }
        }
        v
    }

    /// Declares the delay infrastructure, `Q.dlx`, `Q.dlq`, `Q` and the bindings. Idempotent;
    /// an existing object with other arguments gives [`TopologyError::Mismatch`], and the
    /// caller's channels are unaffected.
    pub async fn declare(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        self.validate()?;
        self.delay.declare(conn).await?;
        ops::Session::new(conn).run_all(self.own_ops(false)).await
    }

    /// Checks with passive declares only (no configure permission needed) that the queue, the
    /// DLX, the DLQ and the delay infrastructure exist: [`TopologyError::Missing`] otherwise.
    /// Arguments and bindings cannot be checked passively.
    pub async fn verify(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        self.validate()?;
        self.delay.verify(conn).await?;
        ops::Session::new(conn).run_all(self.own_ops(true)).await
    }

    /// Deletes `Q`, `Q.dlq` and `Q.dlx` with their messages (not the shared delay
    /// infrastructure). Objects that do not exist are skipped.
    pub async fn delete(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        use ops::Op;
        ops::Session::new(conn)
            .run_all(vec![
                Op::DeleteQueue {
                    name: self.queue_name(),
                },
                Op::DeleteQueue {
                    name: self.dlq_name(),
                },
                Op::DeleteExchange {
                    name: self.dlx_name(),
                },
            ])
            .await
    }
}

fn text(s: &str) -> AMQPValue {
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

/// Running declarations on a private channel and turning broker errors into [`TopologyError`].
pub(crate) mod ops {
    use super::{describe_args, TopologyError};
    use crate::names::short;
    use lapin::options::{
        ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
        QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    use lapin::types::FieldTable;
    use lapin::{Channel, Connection, ExchangeKind};

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

    impl<'a> Session<'a> {
        pub(crate) fn new(conn: &'a Connection) -> Self {
            Self {
                conn,
                channel: None,
            }
        }

        /// Runs `ops` in order, stopping at the first error (deletes skip missing objects),
        /// then closes the channel.
        pub(crate) async fn run_all(mut self, ops: Vec<Op>) -> Result<(), TopologyError> {
            let mut result = Ok(());
            for op in &ops {
                match self.run(op).await {
                    Ok(()) => {}
                    Err(TopologyError::Missing { .. }) if op.is_delete() => {}
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            if let Some(ch) = self.channel.take() {
                if ch.status().connected() {
                    // Best effort: the work is done (or failed) either way.
                    let _ = ch.close(200, "OK".into()).await;
                }
            }
            result
        }

        async fn run(&mut self, op: &Op) -> Result<(), TopologyError> {
            let ch = match &self.channel {
                Some(ch) if ch.status().connected() => ch.clone(),
                _ => {
                    let ch = self.conn.create_channel().await?;
                    self.channel = Some(ch.clone());
                    ch
                }
            };
            let res = Self::exec(&ch, op).await;
            if let Err(e) = res {
                // A soft error closed the channel; the next op opens a fresh one.
                self.channel = None;
                return Err(classify(op, e));
            }
            Ok(())
        }

        async fn exec(ch: &Channel, op: &Op) -> Result<(), Failure> {
            match op {
                Op::Exchange {
                    name,
                    kind,
                    args,
                    passive,
                } => {
                    let opts = ExchangeDeclareOptions {
                        passive: *passive,
                        durable: true,
                        ..Default::default()
                    };
                    ch.exchange_declare(short(name)?, kind.clone(), opts, args.clone())
                        .await?;
                }
                Op::Queue {
                    name,
                    args,
                    passive,
                } => {
                    let opts = QueueDeclareOptions {
                        passive: *passive,
                        durable: true,
                        ..Default::default()
                    };
                    ch.queue_declare(short(name)?, opts, args.clone()).await?;
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
                    ch.queue_delete(short(name)?, QueueDeleteOptions::default())
                        .await?;
                }
                Op::DeleteExchange { name } => {
                    ch.exchange_delete(short(name)?, ExchangeDeleteOptions::default())
                        .await?;
                }
            }
            Ok(())
        }
    }

    pub(crate) enum Failure {
        Name(crate::names::NameError),
        Amqp(lapin::Error),
    }

    impl From<crate::names::NameError> for Failure {
        fn from(e: crate::names::NameError) -> Self {
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

    /// `... inequivalent arg 'x-dead-letter-exchange' for queue 'q' ...` -> the argument.
    /// Exchange redeclarations with another type read `... with different type, durable,
    /// internal or autodelete value`: no single argument is named then.
    pub(crate) fn mismatched_argument(msg: &str) -> Option<String> {
        const MARK: &str = "inequivalent arg '";
        let start = msg.find(MARK)? + MARK.len();
        let len = msg[start..].find('\'')?;
        Some(msg[start..start + len].to_owned())
    }

    /// `NOT_FOUND - no exchange 'x' in vhost '/'` -> `exchange 'x'` (a binding names the end
    /// that is missing this way).
    pub(crate) fn missing_object(msg: &str) -> Option<String> {
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_arguments() {
        let t = Topology::new("orders").prefix("t.");
        assert_eq!(t.queue_name(), "t.orders");
        assert_eq!(t.dlx_name(), "t.orders.dlx");
        assert_eq!(t.dlq_name(), "t.orders.dlq");
        assert_eq!(t.delay_config().get_prefix(), "t.");
        let a = describe_args(&t.queue_arguments());
        assert_eq!(
            a,
            r#"{x-dead-letter-exchange = "t.orders.dlx", x-dead-letter-routing-key = "t.orders", x-dead-letter-strategy = "at-least-once", x-delivery-limit = 20, x-overflow = "reject-publish", x-queue-type = "quorum"}"#
        );
        let c = Topology::new("o").classic();
        assert_eq!(c.queue_arguments().inner().len(), 2);
        assert!(t.dlq_arguments().inner().is_empty());
        let d = Topology::new("o")
            .dlq_message_ttl(Duration::from_secs(1))
            .dlq_max_length(5);
        assert_eq!(
            describe_args(&d.dlq_arguments()),
            "{x-max-length = 5, x-message-ttl = 1000}"
        );
        let q = Topology::new("o").dlq_queue_type(QueueType::Quorum);
        assert_eq!(
            describe_args(&q.dlq_arguments()),
            r#"{x-delivery-limit = 2147483647, x-queue-type = "quorum"}"#
        );
    }

    #[test]
    fn delay_prefix_rules() {
        let given = Topology::new("q")
            .delay(DelayConfig::new().prefix("d."))
            .prefix("p.");
        assert_eq!(given.delay_config().get_prefix(), "d.");
        let none = Topology::new("q").delivery_limit(None);
        assert!(!none.queue_arguments().contains_key("x-delivery-limit"));
        assert!(Topology::new("a..b").validate().is_err());
        assert!(Topology::new("a.b").validate().is_ok());
    }
}
