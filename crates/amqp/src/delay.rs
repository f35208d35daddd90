//! The binary TTL delay infrastructure: its configuration, names, routing and declarations.

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;

use crate::declare::{self, text, Op, QueueType, OPERATOR_DELIVERY_LIMIT};
use crate::error::{DelayConfigError, DelayError, TopologyError};
use crate::names;

/// RabbitMQ refuses an `x-message-ttl` above 2^32 - 1 ms.
const MAX_TTL_MS: u128 = u32::MAX as u128;
/// 2^(L-1) ticks of at least 1 ms must fit [`MAX_TTL_MS`].
const MAX_LEVELS: u8 = 32;

/// Default of [`DelayConfig::jittered_hops`]: a jittered delay waits in at most 4 level queues,
/// within 1/31 (3.2 %) of its exact value.
pub const DEFAULT_JITTERED_HOPS: u8 = 4;

/// What to do with a delay above [`DelayConfig::max_delay`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum OverMax {
    /// Refuse it with [`DelayError::TooLong`].
    #[default]
    Reject,
    /// Deliver it after the maximum delay instead.
    Clamp,
}

/// Configuration of the delay infrastructure of one vhost (shared by all its consumers).
///
/// Defaults: no prefix, granularity 10 ms, 24 levels (max delay (2^24 - 1) * 10 ms, about 46.6 h),
/// quorum level queues, delays above the maximum rejected, jittered delays rounded to at most 4
/// hops ([`Self::jittered_hops`]).
///
/// A delay `d` becomes `n = ceil(d / g)` ticks of the granularity `g`, written as `L` bits most
/// significant first. The routing key is those bits as `L` words, then the destination queue's
/// name: `b(L-1). ... .b1.b0.{queue}`.
///
/// For each level `k` there is a topic exchange and a queue, both named
/// `{prefix}redeliver.delay.{k}`. The queue holds messages for `2^k * g` (`x-message-ttl`) and then
/// dead-letters them to exchange `k - 1` (level 0 to `{prefix}redeliver.delay.deliver`), keeping the
/// routing key. Exchange `k` sends a key with a `1` at bit `k`'s word to queue `k`, and a key with a
/// `0` there straight on to exchange `k - 1` (an exchange-to-exchange binding). A message therefore
/// waits exactly in the levels of its set bits, and since every message in one level queue has the
/// same TTL, expiry order is arrival order: a short delay never waits behind a long one.
///
/// `deliver` is a topic exchange where each consumer queue `Q` binds with `L` `*` words and then
/// `Q`'s words. A publish goes to the exchange of the highest set bit (skipping empty hops); delay
/// 0 goes straight to `deliver`. Every delay exchange has the alternate exchange
/// `{prefix}redeliver.delay.unroutable` (fanout, bound to a quorum queue of the same name), which
/// parks messages whose destination queue is gone instead of losing them.
///
/// ```
/// use redeliver::DelayConfig;
/// use std::time::Duration;
///
/// let cfg = DelayConfig::new().levels(4);
/// // 50 ms = 5 ticks of 10 ms = 0b0101: first wait in level 2 (40 ms), then level 0 (10 ms).
/// let r = cfg.route("orders", Duration::from_millis(50)).unwrap();
/// assert_eq!(r.exchange, "redeliver.delay.2");
/// assert_eq!(r.routing_key, "0.1.0.1.orders");
/// assert_eq!(cfg.deliver_binding_key("orders"), "*.*.*.*.orders");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DelayConfig {
    prefix: String,
    granularity: Duration,
    levels: u8,
    queue_type: QueueType,
    over_max: OverMax,
    jittered_hops: u8,
}

impl Default for DelayConfig {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            granularity: Duration::from_millis(10),
            levels: 24,
            queue_type: QueueType::Quorum,
            over_max: OverMax::Reject,
            jittered_hops: DEFAULT_JITTERED_HOPS,
        }
    }
}

/// Where to publish a message so that it reaches its queue after the requested delay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DelayRoute {
    /// Exchange to publish to: the level of the highest set bit, or `deliver` for zero ticks.
    pub exchange: String,
    /// `L` words of `0`/`1` (most significant bit first), then the queue name.
    pub routing_key: String,
    /// The delay in ticks of the granularity: `ceil(delay / granularity)` (clamped if configured).
    pub ticks: u64,
    /// The delay the message will actually get (`ticks * granularity`, before broker latency).
    pub effective: Duration,
}

impl DelayConfig {
    /// The default configuration (see [`DelayConfig`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Prefix of every delay object's name (`{prefix}redeliver.delay.{k}`); use it to isolate
    /// tests or tenants. Empty by default.
    ///
    /// Read it back with [`Self::configured_prefix`].
    pub fn prefix(mut self, p: impl Into<String>) -> Self {
        self.prefix = p.into();
        self
    }

    /// Tick length `g` (default 10 ms). Must be a whole number of milliseconds, at least 1 ms,
    /// since RabbitMQ TTLs are in milliseconds. Delays are rounded up to a multiple of it.
    ///
    /// Read it back with [`Self::configured_granularity`].
    pub fn granularity(mut self, g: Duration) -> Self {
        self.granularity = g;
        self
    }

    /// Number of levels `L` (default 24, at most 32 and limited by 2^(L-1) * g <= 2^32 - 1 ms).
    /// The maximum delay is `(2^L - 1) * g`.
    ///
    /// Read it back with [`Self::configured_levels`].
    pub fn levels(mut self, l: u8) -> Self {
        self.levels = l;
        self
    }

    /// Queue type of the level queues: quorum (default, at-least-once dead-lettering so a hop
    /// never drops a message) or classic (faster, at-most-once between hops).
    ///
    /// Read it back with [`Self::configured_queue_type`].
    pub fn queue_type(mut self, t: QueueType) -> Self {
        self.queue_type = t;
        self
    }

    /// Clamp delays above the maximum to the maximum instead of refusing them.
    ///
    /// Read it back with [`Self::configured_clamp_over_max`].
    pub fn clamp_over_max(mut self, yes: bool) -> Self {
        self.over_max = if yes { OverMax::Clamp } else { OverMax::Reject };
        self
    }

    /// At most `k` hops (level queues) for a delay that is random anyway, such as a retry delay
    /// drawn by a policy's jitter: see [`Self::round_jittered`]. Default
    /// [`DEFAULT_JITTERED_HOPS`] (4); 0 keeps such delays exact.
    ///
    /// Only the publisher's choice: it is not part of the [`Self::settings`] deployments sharing
    /// the delay levels must agree on.
    ///
    /// Read it back with [`Self::configured_jittered_hops`].
    pub fn jittered_hops(mut self, k: u8) -> Self {
        self.jittered_hops = k;
        self
    }

    /// The configured hop limit of jittered delays (0: exact).
    pub fn configured_jittered_hops(&self) -> u8 {
        self.jittered_hops
    }

    /// The configured name prefix.
    pub fn configured_prefix(&self) -> &str {
        &self.prefix
    }

    /// The configured granularity.
    pub fn configured_granularity(&self) -> Duration {
        self.granularity
    }

    /// The configured level count.
    pub fn configured_levels(&self) -> u8 {
        self.levels
    }

    /// The configured level queue type.
    pub fn configured_queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// Whether delays above the maximum are clamped to it (else refused).
    pub fn configured_clamp_over_max(&self) -> bool {
        self.over_max == OverMax::Clamp
    }

    /// Checks granularity and level count.
    pub fn validate(&self) -> Result<(), DelayError> {
        let g_ns = self.granularity.as_nanos();
        if g_ns < 1_000_000 || !g_ns.is_multiple_of(1_000_000) {
            return Err(DelayConfigError::Granularity {
                granularity: self.granularity,
            }
            .into());
        }
        if self.levels == 0 || self.levels > MAX_LEVELS {
            return Err(DelayConfigError::Levels {
                levels: self.levels,
                max: MAX_LEVELS,
            }
            .into());
        }
        let top_ttl = (1u128 << (self.levels - 1)) * self.granularity.as_millis();
        if top_ttl > MAX_TTL_MS {
            return Err(DelayConfigError::TopLevelTtl {
                ttl_ms: top_ttl,
                max_ms: MAX_TTL_MS,
            }
            .into());
        }
        Ok(())
    }

    /// Largest delay that can be expressed: `(2^L - 1) * g`.
    pub fn max_delay(&self) -> Duration {
        let ms = self
            .max_ticks()
            .saturating_mul(self.granularity.as_millis());
        Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    /// Largest tick count: `2^L - 1`.
    fn max_ticks(&self) -> u128 {
        (1u128 << self.levels.min(64)) - 1
    }

    /// Name of level `k`'s exchange and queue: `{prefix}redeliver.delay.{k}`.
    pub fn level_name(&self, k: u8) -> String {
        format!("{}redeliver.delay.{k}", self.prefix)
    }

    /// Name of the exchange the last level dead-letters into: `{prefix}redeliver.delay.deliver`.
    pub fn deliver_exchange(&self) -> String {
        format!("{}redeliver.delay.deliver", self.prefix)
    }

    /// Name of the alternate exchange and its queue: `{prefix}redeliver.delay.unroutable`.
    pub fn unroutable_name(&self) -> String {
        format!("{}redeliver.delay.unroutable", self.prefix)
    }

    /// TTL of level `k`'s queue: `2^k * g`.
    pub fn level_ttl(&self, k: u8) -> Duration {
        let ms = (1u128 << k.min(64)).saturating_mul(self.granularity.as_millis());
        Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    /// Where to publish a message so it reaches `queue` after `delay`.
    ///
    /// `n = ceil(delay / g)`; the message never arrives earlier than `delay`. Errors when the
    /// queue name is not topic-safe ([`names::validate_routed_queue_name`]), when the
    /// configuration is invalid, or when the delay exceeds [`Self::max_delay`] and clamping is off.
    pub fn route(&self, queue: &str, delay: Duration) -> Result<DelayRoute, DelayError> {
        self.validate()?;
        names::validate_routed_queue_name(queue, self.levels)?;
        let g = self.granularity.as_nanos();
        let mut ticks = delay.as_nanos().div_ceil(g);
        if ticks > self.max_ticks() {
            match self.over_max {
                OverMax::Reject => {
                    return Err(DelayError::TooLong {
                        requested: delay,
                        max: self.max_delay(),
                    })
                }
                OverMax::Clamp => ticks = self.max_ticks(),
            }
        }
        // validate() bounds L to 32, so ticks < 2^32.
        let ticks = u64::try_from(ticks).unwrap_or(u64::MAX);
        let l = u32::from(self.levels);
        let mut key = String::with_capacity(2 * self.levels as usize + queue.len());
        for bit in (0..l).rev() {
            key.push(if ticks >> bit & 1 == 1 { '1' } else { '0' });
            key.push('.');
        }
        key.push_str(queue);
        let exchange = match ticks {
            0 => self.deliver_exchange(),
            // Highest set bit; fits u8 since ticks < 2^32.
            t => self.level_name((63 - t.leading_zeros()) as u8),
        };
        Ok(DelayRoute {
            exchange,
            routing_key: key,
            ticks,
            effective: Duration::from_millis(
                ticks.saturating_mul(u64::try_from(self.granularity.as_millis()).unwrap_or(0)),
            ),
        })
    }

    /// [`Self::round_to_hops`] with the configured [`Self::jittered_hops`]: what a delay drawn
    /// by a jitter is published with.
    pub fn round_jittered(&self, delay: Duration) -> Duration {
        self.round_to_hops(delay, self.jittered_hops)
    }

    /// The delay nearest to `delay` that waits in at most `k` level queues: each set bit of the
    /// tick count is one hop (a quorum enqueue and a dead-lettering), so fewer bits are less
    /// broker work. For delays that are random anyway (a jittered backoff), where the error is
    /// far below the randomness.
    ///
    /// Precisely: with `n = ceil(delay / g)`, the tick count [`Self::route`] would use, the
    /// result is `r * g` where `r` is the integer nearest to `n` with at most `k` bits set and
    /// at most `2^L - 1` (ties round up). So:
    ///
    /// - `n` with at most `k` bits set is kept: every delay of at most `k` ticks' bits, among
    ///   them every delay below `2^(k+1) - 1` ticks, is exact;
    /// - the error is `|r - n| <= n / (2^(k+1) - 1)` ticks (3.2 % for `k = 4`), and below
    ///   `n * 2^-k` in every case: only just under [`Self::max_delay`], where rounding up
    ///   would exceed it and the top `k` bits are kept instead, does it pass `n / (2^(k+1) - 1)`;
    /// - a non-zero delay stays at least one tick (as in [`Self::route`], `n >= 1` and `r >= 1`
    ///   for `k >= 1`), and never exceeds [`Self::max_delay`];
    /// - it is monotonic (a longer delay never rounds to a shorter one than a shorter delay
    ///   does) and idempotent (a rounded delay rounds to itself), and [`Self::route`] of the
    ///   result has exactly `r` ticks.
    ///
    /// `k = 0` returns `delay` unchanged (no limit), as does an invalid configuration
    /// (which [`Self::route`] refuses anyway). A delay above [`Self::max_delay`] is rounded from
    /// the maximum when the configuration clamps ([`Self::clamp_over_max`]); otherwise it is
    /// returned unchanged, for [`Self::route`] to refuse.
    ///
    /// ```
    /// use redeliver_amqp::DelayConfig;
    /// use std::time::Duration;
    ///
    /// let cfg = DelayConfig::new(); // 10 ms ticks
    /// // 37.23 s = 3723 ticks = 0b1110_1000_1011: 7 hops. The nearest value with at most 4 bits
    /// // set is 0b1110_1000_0000 = 3712 ticks: 4 hops, 110 ms (0.3 %) shorter.
    /// let r = cfg.round_to_hops(Duration::from_millis(37_230), 4);
    /// assert_eq!(r, Duration::from_millis(37_120));
    /// assert_eq!(cfg.route("orders", r).unwrap().ticks.count_ones(), 4);
    /// // 31 ticks = 0b11111 is the worst case: 32 ticks, 1/31 longer.
    /// assert_eq!(cfg.round_to_hops(Duration::from_millis(310), 4), Duration::from_millis(320));
    /// // Up to 4 bits set: exact (in whole ticks, as `route` rounds up).
    /// assert_eq!(cfg.round_to_hops(Duration::from_millis(25), 4), Duration::from_millis(30));
    /// ```
    pub fn round_to_hops(&self, delay: Duration, k: u8) -> Duration {
        if k == 0 || self.validate().is_err() {
            return delay;
        }
        // validate(): g is at least 1 ms, so no division by zero.
        let g = self.granularity.as_nanos();
        let max = self.max_ticks();
        let mut ticks = delay.as_nanos().div_ceil(g);
        if ticks > max {
            match self.over_max {
                OverMax::Reject => return delay,
                OverMax::Clamp => ticks = max,
            }
        }
        // validate() bounds L to 32, so ticks <= max < 2^32 and fits both u64 and u32.
        let (Ok(n), Ok(max)) = (u64::try_from(ticks), u64::try_from(max)) else {
            return delay;
        };
        let r = nearest_with_bits(n, u32::from(k), max);
        match u32::try_from(r) {
            Ok(r) => self.granularity.saturating_mul(r),
            Err(_) => delay,
        }
    }

    /// Binding key of `queue` on the deliver exchange: `L` `*` words, then the queue's words
    /// (not `#.{queue}`, which would also match a queue whose name ends with `.{queue}`).
    pub fn deliver_binding_key(&self, queue: &str) -> String {
        let mut key = "*.".repeat(self.levels as usize);
        key.push_str(queue);
        key
    }

    /// Binding key on level `k`'s exchange: `bit` at bit `k`'s word, `*` elsewhere, then `#`.
    pub fn level_binding_key(&self, k: u8, bit: bool) -> String {
        let mut words: Vec<&str> = vec!["*"; self.levels as usize];
        let pos = usize::from(self.levels.saturating_sub(1).saturating_sub(k));
        if let Some(w) = words.get_mut(pos) {
            *w = if bit { "1" } else { "0" };
        }
        words.push("#");
        words.join(".")
    }

    /// Where level `k`'s queue dead-letters and its `0` binding points: exchange `k - 1`, or the
    /// deliver exchange for level 0.
    pub fn next_exchange(&self, k: u8) -> String {
        match k {
            0 => self.deliver_exchange(),
            k => self.level_name(k - 1),
        }
    }

    /// Arguments of every delay exchange: the alternate exchange.
    pub fn exchange_arguments(&self) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("alternate-exchange".into(), text(&self.unroutable_name()));
        t
    }

    /// Arguments of level `k`'s queue.
    pub fn level_queue_arguments(&self, k: u8) -> FieldTable {
        let mut t = FieldTable::default();
        let ttl = u64::try_from(self.level_ttl(k).as_millis()).unwrap_or(u64::MAX);
        t.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(i64::try_from(ttl).unwrap_or(i64::MAX)),
        );
        t.insert(
            "x-dead-letter-exchange".into(),
            text(&self.next_exchange(k)),
        );
        if self.queue_type == QueueType::Quorum {
            t.insert("x-queue-type".into(), text("quorum"));
            t.insert("x-dead-letter-strategy".into(), text("at-least-once"));
            t.insert("x-overflow".into(), text("reject-publish"));
        }
        t
    }

    /// Arguments of the unroutable queue: always quorum, and since it parks messages for an
    /// operator, with a delivery limit no listing can reach
    /// ([`OPERATOR_DELIVERY_LIMIT`](OPERATOR_DELIVERY_LIMIT)).
    pub fn unroutable_queue_arguments(&self) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("x-queue-type".into(), text("quorum"));
        t.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(OPERATOR_DELIVERY_LIMIT),
        );
        t
    }

    /// Every declaration, in an order where each binding's ends already exist.
    fn declare_ops(&self, passive: bool) -> Vec<Op> {
        let unroutable = self.unroutable_name();
        let mut v = vec![
            Op::Exchange {
                name: unroutable.clone(),
                kind: ExchangeKind::Fanout,
                args: FieldTable::default(),
                passive,
            },
            Op::Queue {
                name: unroutable.clone(),
                args: self.unroutable_queue_arguments(),
                passive,
            },
        ];
        if !passive {
            v.push(Op::BindQueue {
                queue: unroutable.clone(),
                exchange: unroutable,
                key: String::new(),
            });
        }
        v.push(Op::Exchange {
            name: self.deliver_exchange(),
            kind: ExchangeKind::Topic,
            args: self.exchange_arguments(),
            passive,
        });
        for k in 0..self.levels {
            let name = self.level_name(k);
            v.push(Op::Exchange {
                name: name.clone(),
                kind: ExchangeKind::Topic,
                args: self.exchange_arguments(),
                passive,
            });
            v.push(Op::Queue {
                name: name.clone(),
                args: self.level_queue_arguments(k),
                passive,
            });
            if !passive {
                v.push(Op::BindQueue {
                    queue: name.clone(),
                    exchange: name.clone(),
                    key: self.level_binding_key(k, true),
                });
                v.push(Op::BindExchange {
                    destination: self.next_exchange(k),
                    source: name,
                    key: self.level_binding_key(k, false),
                });
            }
        }
        v
    }

    /// Name of the exchange that records the settings of the delay infrastructure:
    /// `{prefix}redeliver.delay.settings` (see [`Self::declare`]).
    pub fn settings_name(&self) -> String {
        format!("{}redeliver.delay.settings", self.prefix)
    }

    /// The settings every deployment on this prefix must share, as recorded on the broker:
    /// `levels=24 granularity=10ms queue-type=quorum`.
    pub fn settings(&self) -> String {
        format!(
            "levels={} granularity={}ms queue-type={}",
            self.levels,
            self.granularity.as_millis(),
            self.queue_type.as_str()
        )
    }

    /// Arguments of the settings exchange: [`Self::settings`] as its `alternate-exchange`.
    ///
    /// RabbitMQ compares no other argument when an exchange is declared again (and reads none
    /// back over AMQP), so this is where a second declaration with other settings is refused
    /// (406 PRECONDITION_FAILED, naming both values). The settings exchange has no bindings and
    /// nothing publishes to it; the alternate exchange it names does not exist.
    pub fn settings_arguments(&self) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("alternate-exchange".into(), text(&self.settings()));
        t
    }

    fn settings_op(&self, passive: bool) -> Op {
        Op::Exchange {
            name: self.settings_name(),
            kind: ExchangeKind::Fanout,
            args: self.settings_arguments(),
            passive,
        }
    }

    fn level_queue_probe(&self, k: u8) -> Op {
        Op::Queue {
            name: self.level_name(k),
            args: FieldTable::default(),
            passive: true,
        }
    }

    fn settings_mismatch(&self, existing: String) -> TopologyError {
        TopologyError::DelaySettingsMismatch {
            prefix: self.prefix.clone(),
            existing,
            requested: self.settings(),
        }
    }

    /// Declares the settings exchange; other settings already recorded are a
    /// [`TopologyError::DelaySettingsMismatch`].
    async fn declare_settings(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        match declare::Session::new(conn)
            .run_all(vec![self.settings_op(false)])
            .await
        {
            Err(TopologyError::Mismatch {
                argument: Some(a),
                broker_message,
                ..
            }) if a == "alternate-exchange" => Err(self.settings_mismatch(
                declare::current_value(&broker_message)
                    .unwrap_or_else(|| "none recorded on the settings exchange".to_owned()),
            )),
            other => other,
        }
    }

    /// Declares every delay object (idempotent). A mismatch with an existing object is a
    /// [`TopologyError::Mismatch`]; declarations run on a channel of their own, so none of the
    /// caller's channels is closed by the broker's 406.
    ///
    /// Two deployments sharing a prefix must share the level count, the granularity and the
    /// level queue type: with other levels they would declare the same level queues and bind
    /// the level exchanges twice, duplicating and misrouting messages. The settings are
    /// therefore recorded on the broker, in the settings exchange ([`Self::settings_name`],
    /// [`Self::settings_arguments`]), declared before anything else; a declaration with other
    /// settings fails with [`TopologyError::DelaySettingsMismatch`], naming both, before it has
    /// changed anything.
    ///
    /// Delay infrastructure declared by an earlier version has no settings exchange. It is
    /// recognized by its level 0 queue and checked as far as the broker can tell: the number of
    /// level queues must be the level count (else [`TopologyError::DelaySettingsMismatch`]), and
    /// the level queues' TTLs and type are compared as usual when they are declared again (a
    /// difference is reported as a [`TopologyError::DelaySettingsMismatch`] too). Only when all
    /// of it matched is the settings exchange declared, so an upgraded deployment keeps working
    /// and records its settings on its first start.
    pub async fn declare(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        self.validate()?;
        let mut probe = declare::Session::new(conn);
        let recorded = probe.exists(&self.settings_op(true)).await?;
        let earlier = !recorded && probe.exists(&self.level_queue_probe(0)).await?;
        let mut existing_levels = 0u8;
        if earlier {
            existing_levels = 1;
            while existing_levels <= MAX_LEVELS
                && probe
                    .exists(&self.level_queue_probe(existing_levels))
                    .await?
            {
                existing_levels += 1;
            }
        }
        probe.run_all(Vec::new()).await?;
        if earlier && existing_levels != self.levels {
            return Err(self.settings_mismatch(format!(
                "levels={existing_levels} (level queues 0 to {} exist; declared by an earlier \
                 version, which recorded no settings)",
                existing_levels - 1
            )));
        }
        if !earlier {
            // First: of two deployments declaring at once, the second fails here, unchanged.
            self.declare_settings(conn).await?;
        }
        let declared = declare::Session::new(conn)
            .run_all(self.declare_ops(false))
            .await;
        match declared {
            Err(TopologyError::Mismatch {
                object,
                argument: Some(argument),
                broker_message,
                ..
            }) if earlier && self.level_of_queue(&object).is_some() => {
                let current =
                    declare::current_value(&broker_message).unwrap_or_else(|| "none".to_owned());
                let k = self.level_of_queue(&object).unwrap_or(0);
                let granularity = match (argument.as_str(), current.parse::<u64>()) {
                    ("x-message-ttl", Ok(ttl)) => format!("granularity={}ms, from ", ttl >> k),
                    _ => String::new(),
                };
                return Err(self.settings_mismatch(format!(
                    "{granularity}{argument} = {current} on {object} (declared by an earlier \
                     version, which recorded no settings)"
                )));
            }
            other => other?,
        }
        if earlier {
            self.declare_settings(conn).await?;
        }
        Ok(())
    }

    /// `k` for `queue '{level k's name}'`, as [`TopologyError::Mismatch`] names objects.
    fn level_of_queue(&self, object: &str) -> Option<u8> {
        (0..self.levels).find(|k| object == format!("queue '{}'", self.level_name(*k)))
    }

    /// Checks with passive declares that every delay exchange and queue exists, without needing
    /// the configure permission. Bindings and arguments cannot be checked passively.
    pub async fn verify(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        self.validate()?;
        declare::Session::new(conn)
            .run_all(self.declare_ops(true))
            .await
    }

    /// Deletes every delay exchange and queue, messages included (for tests). Objects that do
    /// not exist are skipped. To keep other services' pending retries and parked messages, use
    /// [`Self::delete_checked`] with [`HeldMessages::Refuse`](crate::HeldMessages::Refuse).
    pub async fn delete(&self, conn: &lapin::Connection) -> Result<(), TopologyError> {
        self.delete_checked(conn, crate::HeldMessages::Discard)
            .await
            .map(drop)
    }
}

/// The integer nearest to `n` with at most `k` (>= 1) bits set and at most `max`; ties round up
/// unless that would pass `max`. `n <= max`.
///
/// Below `n` the nearest is `n` with all but its `k` highest set bits cleared (any smaller
/// value with `k` bits differs from `n` first at a set bit of `n`, below which it has fewer
/// bits left); above `n` it is that value plus its lowest set bit (the carry merges bits, so
/// there are still at most `k`): nothing with `k` bits lies strictly between them.
fn nearest_with_bits(n: u64, k: u32, max: u64) -> u64 {
    if n.count_ones() <= k {
        return n;
    }
    let mut floor = n;
    while floor.count_ones() > k {
        // Clears the lowest set bit.
        floor &= floor - 1;
    }
    // floor has k >= 1 bits set, so it is not 0.
    let lowest = floor & floor.wrapping_neg();
    match floor.checked_add(lowest) {
        Some(ceil) if ceil <= max && ceil - n <= n - floor => ceil,
        _ => floor,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn exact_keys() {
        let c = DelayConfig::new();
        let zeros = "0.".repeat(24);
        let r = c.route("q", Duration::ZERO).unwrap();
        assert_eq!(r.exchange, "redeliver.delay.deliver");
        assert_eq!(r.routing_key, format!("{zeros}q"));
        assert_eq!((r.ticks, r.effective), (0, Duration::ZERO));

        let r = c.route("q", ms(10)).unwrap();
        assert_eq!(r.exchange, "redeliver.delay.0");
        assert_eq!(r.routing_key, format!("{}1.q", "0.".repeat(23)));

        // 1 ns rounds up to one tick: never earlier than asked.
        assert_eq!(c.route("q", Duration::from_nanos(1)).unwrap().ticks, 1);
        // 30 ms = 3 ticks = 0b11.
        let r = c.route("a.b", ms(30)).unwrap();
        assert_eq!(r.exchange, "redeliver.delay.1");
        assert_eq!(r.routing_key, format!("{}1.1.a.b", "0.".repeat(22)));
        // 3.3 s = 330 ticks = 0b1_0100_1010.
        let r = c.route("q", ms(3300)).unwrap();
        assert_eq!(r.exchange, "redeliver.delay.8");
        assert_eq!(
            r.routing_key,
            format!("{}1.0.1.0.0.1.0.1.0.q", "0.".repeat(15))
        );
        assert_eq!(r.effective, ms(3300));
        // 25 ms rounds up to 30.
        assert_eq!(c.route("q", ms(25)).unwrap().effective, ms(30));
    }

    #[test]
    fn small_config_and_prefix() {
        let c = DelayConfig::new()
            .prefix("t1.")
            .levels(3)
            .granularity(ms(100));
        assert_eq!(c.max_delay(), ms(700));
        let r = c.route("q", ms(500)).unwrap();
        assert_eq!(r.exchange, "t1.redeliver.delay.2");
        assert_eq!(r.routing_key, "1.0.1.q");
        assert_eq!(c.level_binding_key(2, true), "1.*.*.#");
        assert_eq!(c.level_binding_key(0, false), "*.*.0.#");
        assert_eq!(c.next_exchange(0), "t1.redeliver.delay.deliver");
        assert_eq!(c.next_exchange(2), "t1.redeliver.delay.1");
        assert_eq!(c.level_ttl(2), ms(400));
        assert_eq!(c.deliver_binding_key("a.b"), "*.*.*.a.b");
        assert_eq!(c.unroutable_name(), "t1.redeliver.delay.unroutable");
    }

    #[test]
    fn max_and_over_max() {
        let c = DelayConfig::new();
        let max = c.max_delay();
        assert_eq!(max, ms(((1 << 24) - 1) * 10));
        let r = c.route("q", max).unwrap();
        assert_eq!(r.exchange, "redeliver.delay.23");
        assert_eq!(r.routing_key, format!("{}q", "1.".repeat(24)));
        let over = max + Duration::from_nanos(1);
        assert_eq!(
            c.route("q", over),
            Err(DelayError::TooLong {
                requested: over,
                max
            })
        );
        let clamped = c
            .clone()
            .clamp_over_max(true)
            .route("q", ms(u64::MAX))
            .unwrap();
        assert_eq!(clamped, c.route("q", max).unwrap());
    }

    #[test]
    fn invalid() {
        let c = DelayConfig::new();
        assert!(matches!(
            c.route("a.*", ms(1)),
            Err(DelayError::InvalidName(_))
        ));
        assert!(matches!(
            c.route("", ms(1)),
            Err(DelayError::InvalidName(_))
        ));
        assert!(c.route(&"x".repeat(208), ms(1)).is_err());
        for bad in [
            c.clone().levels(0),
            c.clone().levels(33),
            c.clone().levels(32).granularity(ms(2)),
            c.clone().granularity(Duration::from_micros(1500)),
            c.clone().granularity(Duration::ZERO),
        ] {
            assert!(
                matches!(bad.route("q", ms(1)), Err(DelayError::InvalidConfig(_))),
                "{bad:?}"
            );
        }
        assert!(c.clone().levels(32).granularity(ms(1)).validate().is_ok());
    }

    #[test]
    fn arguments() {
        let c = DelayConfig::new().prefix("p.");
        let a = c.level_queue_arguments(3);
        let get = |k: &str| a.inner().get(k).cloned();
        assert_eq!(get("x-message-ttl"), Some(AMQPValue::LongLongInt(80)));
        assert_eq!(
            get("x-dead-letter-exchange"),
            Some(text("p.redeliver.delay.2"))
        );
        assert_eq!(get("x-queue-type"), Some(text("quorum")));
        assert_eq!(get("x-dead-letter-strategy"), Some(text("at-least-once")));
        assert_eq!(get("x-overflow"), Some(text("reject-publish")));
        let classic = c
            .clone()
            .queue_type(QueueType::Classic)
            .level_queue_arguments(0);
        assert_eq!(classic.inner().len(), 2);
        let parking = c.unroutable_queue_arguments();
        assert_eq!(
            parking.inner().get("x-delivery-limit"),
            Some(&AMQPValue::LongLongInt(2_147_483_647))
        );
        assert_eq!(c.declare_ops(false).len(), 4 + 4 * 24);
        assert_eq!(c.declare_ops(true).len(), 3 + 2 * 24);
    }

    /// Ticks of `round_to_hops(ticks * g, k)`.
    fn rounded(c: &DelayConfig, ticks: u64, k: u8) -> u64 {
        let g = c.configured_granularity();
        let r = c.round_to_hops(g * u32::try_from(ticks).unwrap(), k);
        u64::try_from(r.as_nanos() / g.as_nanos()).unwrap()
    }

    #[test]
    fn round_to_hops_boundaries() {
        let c = DelayConfig::new();
        assert_eq!(c.configured_jittered_hops(), DEFAULT_JITTERED_HOPS);
        // Up to k bits: unchanged; every count below 2^(k+1) - 1 has at most k.
        for n in 0..31 {
            assert_eq!(rounded(&c, n, 4), n);
        }
        // 31 = 0b11111: 30 and 32 are both 1 away; ties round up.
        assert_eq!(rounded(&c, 31, 4), 32);
        // 0b101011 = 43: 42 (0b101010) is 1 below, 44 (0b101100) 1 above: up.
        assert_eq!(rounded(&c, 43, 3), 44);
        // 0b1000_0111 = 135, k = 2: 132 is 3 below, 136 1 above.
        assert_eq!(rounded(&c, 135, 2), 136);
        // 0b1011 = 11, k = 1: 8 is 3 below, 16 is 5 above.
        assert_eq!(rounded(&c, 11, 1), 8);
        // A non-zero delay below a tick is one tick, as in route().
        assert_eq!(c.round_to_hops(Duration::from_nanos(1), 1), ms(10));
        assert_eq!(c.round_to_hops(Duration::ZERO, 4), Duration::ZERO);
        // k = 0: unchanged, to the nanosecond.
        let odd = Duration::from_nanos(123_456_789);
        assert_eq!(c.round_to_hops(odd, 0), odd);
        assert_eq!(c.clone().jittered_hops(0).round_jittered(odd), odd);
        // A delay between ticks is rounded from its tick count, rounded up.
        assert_eq!(c.round_to_hops(ms(305), 4), ms(320));
    }

    #[test]
    fn round_to_hops_at_the_maximum() {
        // 4 levels: max 15 ticks = 0b1111; rounding up (16) would pass it.
        let c = DelayConfig::new().levels(4);
        assert_eq!(rounded(&c, 15, 3), 14);
        assert_eq!(rounded(&c, 15, 2), 12);
        assert_eq!(rounded(&c, 15, 4), 15);
        assert_eq!(rounded(&c, 13, 2), 12);
        assert_eq!(rounded(&c, 7, 2), 8);
        // Over the maximum: unchanged for route() to refuse it...
        let over = ms(151);
        assert_eq!(c.round_to_hops(over, 2), over);
        assert!(matches!(
            c.route("q", c.round_to_hops(over, 2)),
            Err(DelayError::TooLong { .. })
        ));
        // ...or rounded from the maximum when clamping.
        let clamped = c.clone().clamp_over_max(true);
        assert_eq!(clamped.round_to_hops(ms(10_000), 2), ms(120));
        // An invalid configuration: unchanged (route() refuses it).
        let bad = DelayConfig::new().granularity(Duration::ZERO);
        assert_eq!(bad.round_to_hops(ms(310), 4), ms(310));
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn config() -> impl Strategy<Value = (DelayConfig, u8)> {
            // Levels and granularity that validate(), k from 1 to past the level count.
            (1u8..=32, 1u64..=20, 1u8..=34).prop_filter_map("valid", |(levels, g, k)| {
                let c = DelayConfig::new().levels(levels).granularity(ms(g));
                c.validate().is_ok().then_some((c, k))
            })
        }

        /// Delays up to the maximum, dense in small values as well as large ones.
        fn delay_in(c: &DelayConfig, x: u64, shift: u32) -> Duration {
            let max = u64::try_from(c.max_delay().as_nanos()).unwrap();
            Duration::from_nanos((x >> (shift % 64)) % (max + 1))
        }

        fn ticks(c: &DelayConfig, d: Duration) -> u64 {
            let n = d.as_nanos().div_ceil(c.configured_granularity().as_nanos());
            u64::try_from(n).unwrap()
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// At most k hops, never above the maximum, whole ticks, non-zero stays non-zero,
            /// and the error bounds of the docs, in ticks of route().
            #[test]
            fn bits_and_error((c, k) in config(), x in any::<u64>(), s in 0u32..64) {
                let d = delay_in(&c, x, s);
                let r = c.round_to_hops(d, k);
                let n = ticks(&c, d);
                let rt = ticks(&c, r);
                let route = c.route("q", r).unwrap();
                prop_assert_eq!(route.ticks, rt);
                prop_assert_eq!(route.effective, r);
                prop_assert!(rt.count_ones() <= u32::from(k));
                prop_assert!(r <= c.max_delay());
                prop_assert_eq!(rt == 0, d.is_zero());
                let err = u128::from(rt.abs_diff(n));
                let n = u128::from(n);
                // Below n * 2^-k always.
                prop_assert!(err == 0 || (err << k) < n, "err {} n {} k {}", err, n, k);
                // Within n / (2^(k+1) - 1) unless rounding up would pass the maximum.
                let max = (1u128 << c.configured_levels()) - 1;
                let top_k = max - ((1u128 << c.configured_levels().saturating_sub(k)) - 1);
                if n < top_k || k >= c.configured_levels() {
                    prop_assert!(err * ((2u128 << k) - 1) <= n, "err {} n {} k {}", err, n, k);
                }
            }

            #[test]
            fn monotonic_and_idempotent(
                (c, k) in config(), x in any::<u64>(), y in any::<u64>(), s in 0u32..64,
            ) {
                let (a, b) = (delay_in(&c, x, s), delay_in(&c, y, s));
                let (lo, hi) = (a.min(b), a.max(b));
                prop_assert!(c.round_to_hops(lo, k) <= c.round_to_hops(hi, k));
                let r = c.round_to_hops(a, k);
                prop_assert_eq!(c.round_to_hops(r, k), r);
            }

            /// Near neighbours too: consecutive tick counts never round out of order.
            #[test]
            fn monotonic_on_neighbours((c, k) in config(), x in any::<u64>(), s in 0u32..64) {
                let d = delay_in(&c, x, s);
                let next = (d + c.configured_granularity()).min(c.max_delay());
                prop_assert!(c.round_to_hops(d, k) <= c.round_to_hops(next, k));
            }

            /// The nearest: no value with at most k bits (and at most the maximum) is closer.
            #[test]
            fn nearest(n in 1u64..5000, k in 1u32..6) {
                let r = nearest_with_bits(n, k, u64::MAX);
                let best = (0..=2 * n)
                    .filter(|v| v.count_ones() <= k)
                    .map(|v| v.abs_diff(n))
                    .min()
                    .unwrap();
                prop_assert_eq!(r.abs_diff(n), best);
            }
        }
    }
}
