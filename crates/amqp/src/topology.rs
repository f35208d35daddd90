//! The objects of one consumer queue and their declaration.

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;

use crate::declare::{self, text, Op, QueueType, OPERATOR_DELIVERY_LIMIT};
use crate::delay::DelayConfig;
use crate::error::TopologyError;
use crate::names;

/// Something [`Topology::declare_with_warnings`] found in place and used, although this version
/// would declare it differently.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyWarning {
    /// `Q.dlx` exists without an alternate exchange (declared by an earlier version): a dead
    /// letter that `Q.dlq` cannot take is dropped by a classic work queue (a quorum queue keeps
    /// retrying it). To migrate, delete `Q.dlx` and declare again (`redeliver topology declare`);
    /// until the new `Q.dlx` exists (a moment), the work queue's dead letters have nowhere to go.
    #[error("exchange '{dlx}' was declared without the alternate exchange '{alternate_exchange}' (by an earlier version): a dead letter that '{dlq}' cannot take is not parked; delete '{dlx}' and declare the topology again to add it")]
    DlxWithoutAlternateExchange {
        /// `Q.dlx`.
        dlx: String,
        /// `Q.dlq`.
        dlq: String,
        /// The alternate exchange it lacks.
        alternate_exchange: String,
    },
    /// `Q` exists without (or with other) delayed-retry arguments ([`Topology::delayed_retry`]):
    /// native retries work, but a delivery that fails without a delivery time (a crashed
    /// consumer) comes back at once. RabbitMQ refuses to add the arguments to an existing queue;
    /// a policy can.
    #[error("queue '{queue}' was declared without x-delayed-retry-type: native retries work, but a crash loop is not backed off; add it with a policy: rabbitmqctl set_policy --apply-to quorum_queues {queue}-delayed-retry '^{queue}$' '{{\"delayed-retry-type\":\"failed\",\"delayed-retry-min\":1000,\"delayed-retry-max\":60000}}'")]
    QueueWithoutDelayedRetry {
        /// `Q`.
        queue: String,
    },
}

/// RabbitMQ 4.3's queue argument for delayed retry of failed deliveries.
const DELAYED_RETRY_TYPE: &str = "x-delayed-retry-type";
/// Every delayed-retry argument starts so.
const DELAYED_RETRY_PREFIX: &str = "x-delayed-retry-";

/// [`Topology::delayed_retry`]'s bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DelayedRetry {
    min: Duration,
    max: Duration,
}

/// A binding of the consumer queue to a user exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The user's exchange (used as given: no prefix, and it must already exist).
    pub exchange: String,
    /// The binding key.
    pub routing_key: String,
}

/// The topology of one consumer queue `Q`: the queue itself, its dead-letter exchange `Q.dlx`, its
/// dead-letter queue `Q.dlq`, optional user bindings, and its binding to the delay
/// infrastructure's deliver exchange.
///
/// | object | kind | arguments |
/// |---|---|---|
/// | `Q` | quorum (default) or classic queue | `x-dead-letter-exchange = Q.dlx`, `x-dead-letter-routing-key = Q`; quorum: `x-delivery-limit` (default 20), `x-dead-letter-strategy = at-least-once`, `x-overflow = reject-publish` |
/// | `Q.dlx` | direct exchange | `alternate-exchange =` the delay infrastructure's parking exchange ([`DelayConfig::unroutable_name`]) |
/// | `Q.dlq` | classic (default) or quorum queue bound to `Q.dlx` with key `Q` | optional `x-message-ttl`, `x-max-length`; quorum: `x-queue-type = quorum`, `x-delivery-limit =` [`OPERATOR_DELIVERY_LIMIT`] |
///
/// Every declaration runs on a channel this crate opens and closes itself: a 406
/// PRECONDITION_FAILED closes the channel it happens on, and it should never be one of yours.
///
/// ```no_run
/// # async fn demo(conn: &redeliver::lapin::Connection) -> Result<(), redeliver::amqp::TopologyError> {
/// use redeliver::Topology;
///
/// let topo = Topology::new("images").prefix("prod.").bind("uploads", "image.*");
/// topo.declare(conn).await?; // idempotent: the same call on every start is a no-op
/// assert_eq!(topo.dlq_name(), "prod.images.dlq");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Topology {
    queue: String,
    prefix: String,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
    delayed_retry: Option<DelayedRetry>,
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
            delayed_retry: None,
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
    ///
    /// Read it back with [`Self::configured_prefix`].
    pub fn prefix(mut self, p: impl Into<String>) -> Self {
        self.prefix = p.into();
        if !self.delay_given {
            self.delay = self.delay.prefix(self.prefix.clone());
        }
        self
    }

    /// Type of the consumer queue (quorum by default).
    ///
    /// Read it back with [`Self::configured_queue_type`].
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
    ///
    /// Read it back with [`Self::configured_delivery_limit`].
    pub fn delivery_limit(mut self, n: Option<u32>) -> Self {
        self.delivery_limit = n;
        self
    }

    /// Declares a new quorum `Q` with RabbitMQ 4.3's delayed retry (`x-delayed-retry-type =
    /// failed`, `x-delayed-retry-min`, `x-delayed-retry-max`): a delivery that fails without a
    /// delivery time of its own (a consumer that crashed) comes back after `min × its delivery
    /// count`, at most `max`, instead of at once. The worker sets it in native retry mode, from
    /// its policy's base and cap. Ignored for classic queues.
    ///
    /// An existing `Q` keeps what it was declared with, in both directions (RabbitMQ refuses a
    /// redeclare that adds or drops these arguments): declaring goes on with the queue as found,
    /// and [`Self::declare_with_warnings`] says when it lacks them. A policy adds them to such a
    /// queue: `rabbitmqctl set_policy --apply-to quorum_queues NAME '^Q$'
    /// '{"delayed-retry-type":"failed","delayed-retry-min":1000,"delayed-retry-max":60000}'`.
    pub fn delayed_retry(mut self, min: Duration, max: Duration) -> Self {
        self.delayed_retry = Some(DelayedRetry { min, max });
        self
    }

    /// The delayed retry [`Self::delayed_retry`] set, as `(min, max)`.
    pub fn configured_delayed_retry(&self) -> Option<(Duration, Duration)> {
        self.delayed_retry.map(|d| (d.min, d.max))
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
    /// use redeliver::{QueueType, Topology};
    /// let topo = Topology::new("images").dlq_queue_type(QueueType::Quorum);
    /// assert_eq!(topo.configured_dlq_queue_type(), QueueType::Quorum);
    /// ```
    ///
    /// Read it back with [`Self::configured_dlq_queue_type`].
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
    ///
    /// Read them back with [`Self::configured_bindings`].
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.bindings.push(Binding {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        });
        self
    }

    /// Use this delay configuration (its own prefix wins over [`Self::prefix`]).
    ///
    /// Read it back with [`Self::configured_delay`].
    pub fn delay(mut self, cfg: DelayConfig) -> Self {
        self.delay = cfg;
        self.delay_given = true;
        self
    }

    /// The delay configuration: the one given to [`Self::delay`], or else the default one with
    /// this topology's prefix.
    pub fn configured_delay(&self) -> &DelayConfig {
        &self.delay
    }

    /// The configured prefix.
    pub fn configured_prefix(&self) -> &str {
        &self.prefix
    }

    /// The consumer queue's type.
    pub fn configured_queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// The dead-letter queue's type.
    pub fn configured_dlq_queue_type(&self) -> QueueType {
        self.dlq_queue_type
    }

    /// The configured delivery limit.
    pub fn configured_delivery_limit(&self) -> Option<u32> {
        self.delivery_limit
    }

    /// The user bindings, one per [`Self::bind`] call.
    pub fn configured_bindings(&self) -> &[Binding] {
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
            if let Some(d) = self.delayed_retry {
                let ms = |d: Duration| {
                    AMQPValue::LongLongInt(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
                };
                t.insert(DELAYED_RETRY_TYPE.into(), text("failed"));
                t.insert("x-delayed-retry-min".into(), ms(d.min));
                t.insert("x-delayed-retry-max".into(), ms(d.max));
            }
        }
        t
    }

    /// Arguments of `Q.dlx`: its alternate exchange is the delay infrastructure's parking
    /// exchange ([`DelayConfig::unroutable_name`]), so a dead letter that `Q.dlq` cannot take
    /// (the queue was deleted, or its binding) is parked in that queue instead of being dropped.
    /// A classic work queue dead-letters at most once: without the alternate exchange, a reject
    /// while `Q.dlq` is missing loses the message. The parking queue is the one operators
    /// already watch and replay (`redeliver unroutable list`, `replay --to Q.dlq`).
    pub fn dlx_arguments(&self) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert(
            "alternate-exchange".into(),
            text(&self.delay.unroutable_name()),
        );
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
        names::validate_routed_queue_name(&q, self.delay.configured_levels())?;
        names::validate_short(&self.dlq_name())?;
        names::validate_short(&self.dlx_name())?;
        for b in &self.bindings {
            names::validate_short(&b.exchange)?;
            names::validate_short(&b.routing_key)?;
        }
        Ok(())
    }

    fn dlx_op(&self, args: FieldTable, passive: bool) -> Op {
        Op::Exchange {
            name: self.dlx_name(),
            kind: ExchangeKind::Direct,
            args,
            passive,
        }
    }

    /// Every operation after `Q.dlx`.
    fn own_ops(&self, passive: bool) -> Vec<Op> {
        let q = self.queue_name();
        let mut v = vec![Op::Queue {
            name: self.dlq_name(),
            args: self.dlq_arguments(),
            passive,
        }];
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
    ///
    /// One exception keeps deployments of earlier versions starting: a `Q.dlx` declared without
    /// its alternate exchange (see [`Self::dlx_arguments`]) is used as it is, since an exchange's
    /// arguments cannot change; this is a [`TopologyWarning`], logged (with the `tracing`
    /// crate) and returned by [`Self::declare_with_warnings`].
    pub async fn declare(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        for w in self.declare_with_warnings(conn).await? {
            tracing::warn!(queue = %self.queue_name(), "{w}");
        }
        Ok(())
    }

    /// [`Self::declare`], returning what was found in place but not as this version would
    /// declare it, instead of logging it.
    pub async fn declare_with_warnings(
        &self,
        conn: &lapin::Connection,
    ) -> Result<Vec<TopologyWarning>, TopologyError> {
        self.validate()?;
        self.delay.declare(conn).await?;
        let mut warnings = Vec::new();
        let with_ae = declare::Session::new(conn)
            .run_all(vec![self.dlx_op(self.dlx_arguments(), false)])
            .await;
        match with_ae {
            Ok(()) => {}
            // "received '...unroutable' but current is none": an earlier version's Q.dlx.
            Err(TopologyError::Mismatch {
                argument: Some(a),
                broker_message,
                ..
            }) if a == "alternate-exchange" && broker_message.contains("current is none") => {
                declare::Session::new(conn)
                    .run_all(vec![self.dlx_op(FieldTable::default(), false)])
                    .await?;
                warnings.push(TopologyWarning::DlxWithoutAlternateExchange {
                    dlx: self.dlx_name(),
                    dlq: self.dlq_name(),
                    alternate_exchange: self.delay.unroutable_name(),
                });
            }
            Err(e) => return Err(e),
        }
        match declare::Session::new(conn)
            .run_all(self.own_ops(false))
            .await
        {
            Ok(()) => {}
            // `Q` exists with other delayed-retry arguments (added or dropped by a policy, by a
            // worker of the other retry mode, by an earlier version): take it as it is.
            Err(TopologyError::Mismatch {
                argument: Some(a), ..
            }) if a.starts_with(DELAYED_RETRY_PREFIX) => {
                let as_found = Self {
                    delayed_retry: None,
                    ..self.clone()
                };
                let mut ops = as_found.own_ops(false);
                for op in &mut ops {
                    if let Op::Queue { name, passive, .. } = op {
                        if *name == self.queue_name() {
                            *passive = true;
                        }
                    }
                }
                declare::Session::new(conn).run_all(ops).await?;
                if self.delayed_retry.is_some() {
                    warnings.push(TopologyWarning::QueueWithoutDelayedRetry {
                        queue: self.queue_name(),
                    });
                }
            }
            Err(e) => return Err(e),
        }
        Ok(warnings)
    }

    /// Checks with passive declares only (no configure permission needed) that the queue, the
    /// DLX, the DLQ and the delay infrastructure exist: [`TopologyError::Missing`] otherwise.
    /// Arguments and bindings cannot be checked passively.
    pub async fn verify(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        self.validate()?;
        self.delay.verify(conn).await?;
        let mut ops = vec![self.dlx_op(FieldTable::default(), true)];
        ops.extend(self.own_ops(true));
        declare::Session::new(conn).run_all(ops).await
    }

    /// Deletes `Q`, `Q.dlq` and `Q.dlx` with their messages (not the shared delay
    /// infrastructure: see [`Self::delete_with_delay`]). Objects that do not exist are skipped.
    pub async fn delete(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        declare::Session::new(conn)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::declare::describe_args;

    #[test]
    fn names_and_arguments() {
        let t = Topology::new("orders").prefix("t.");
        assert_eq!(t.queue_name(), "t.orders");
        assert_eq!(t.dlx_name(), "t.orders.dlx");
        assert_eq!(t.dlq_name(), "t.orders.dlq");
        assert_eq!(t.configured_delay().configured_prefix(), "t.");
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
        assert_eq!(given.configured_delay().configured_prefix(), "d.");
        let none = Topology::new("q").delivery_limit(None);
        assert!(!none.queue_arguments().contains_key("x-delivery-limit"));
        assert!(Topology::new("a..b").validate().is_err());
        assert!(Topology::new("a.b").validate().is_ok());
    }
}
