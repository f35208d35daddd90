//! Header names and the codec for retry state and the broker's `x-death` records.
//!
//! Every header redeliver writes is named here, so the prefix can change in one line. All values
//! are strings or integers, so they read well in the management UI.
//!
//! Reading is tolerant by design: headers come from whoever published the message, so a wrong type,
//! a negative or huge number, a string where a number belongs, an array, or a missing field all
//! decode to the default instead of an error or a panic.

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

/// Prefix of every header this crate writes.
pub const PREFIX: &str = "x-redeliver-";
/// Retry number of this copy: long-long int, 1 on the first retry (absent on a fresh message).
pub const ATTEMPT: &str = "x-redeliver-attempt";
/// When the message first failed: an RFC 3339 string.
pub const FIRST_FAILED_AT: &str = "x-redeliver-first-failed-at";
/// The last handler error's message, truncated to [`LAST_ERROR_MAX_BYTES`] on a char boundary.
pub const LAST_ERROR: &str = "x-redeliver-last-error";
/// Exchange the original message was published to.
pub const ORIGINAL_EXCHANGE: &str = "x-redeliver-original-exchange";
/// Routing key the original message was published with.
pub const ORIGINAL_ROUTING_KEY: &str = "x-redeliver-original-routing-key";
/// Delay in milliseconds applied to reach this copy (input of decorrelated jitter).
pub const DELAY_MS: &str = "x-redeliver-delay-ms";
/// Earliest time (Unix milliseconds, a long) the retry may run: set by a native retry (RabbitMQ
/// 4.3+ holds the message until then), checked by every worker before it runs a handler, so a
/// broker that ignores the delivery time never makes a handler run early.
pub const NOT_BEFORE: &str = "x-redeliver-not-before";
/// The prefix RabbitMQ requires of application message annotations over AMQP 1.0: a native
/// retry or dead letter carries `x-opt-redeliver-*` where a copy carries `x-redeliver-*`, and an
/// AMQP 0-9-1 reader sees those annotations as headers of that name. Every reader of this
/// module accepts both spellings ([`annotation_name`]).
pub const ANNOTATION_PREFIX: &str = "x-opt-";
/// Why the worker dead-lettered a message (`Annotate` mode): the name of a
/// `redeliver::DeadLetterReason` (`permanent`, `retries_exhausted`, `undecodable`, ..., or one
/// the handler gave), which lists them all.
pub const DEAD_LETTER_REASON: &str = "x-redeliver-dead-letter-reason";
/// The final error, with its `source()` chain, truncated to [`DEAD_LETTER_ERROR_MAX_BYTES`]
/// (`Annotate` mode).
pub const DEAD_LETTER_ERROR: &str = "x-redeliver-dead-letter-error";
/// Deliveries the worker handled before it gave up: long-long int, 1 when it gave up on the
/// first (`Annotate` mode).
pub const DEAD_LETTER_ATTEMPTS: &str = "x-redeliver-dead-letter-attempts";
/// When the worker dead-lettered the message, RFC 3339 (`Annotate` mode; the last failure).
pub const DEAD_LETTERED_AT: &str = "x-redeliver-dead-lettered-at";
/// The connection name of the worker that dead-lettered it (`Annotate` mode).
pub const DEAD_LETTERED_BY: &str = "x-redeliver-dead-lettered-by";
/// The message's `expiration` property, which a dead letter does not keep (it would expire in
/// the DLQ), as RabbitMQ's own dead-lettering keeps it in `x-death` (`Annotate` mode).
pub const ORIGINAL_EXPIRATION: &str = "x-redeliver-original-expiration";
/// Maximum size of [`DEAD_LETTER_ERROR`] in bytes.
pub const DEAD_LETTER_ERROR_MAX_BYTES: usize = 4096;
/// Set on a copy whose malformed `x-death` the worker removed before the broker could read it
/// (see [`sanitize_x_death`]); the value names what was removed.
pub const SANITIZED: &str = "x-redeliver-sanitized";
/// The queue a forwarded message was consumed from (the worker's `Forward` outcome).
pub const FORWARDED_FROM: &str = "x-redeliver-forwarded-from";
/// Why it was forwarded: `timeout` (the handler's time limit), `handler` (the handler asked
/// for it) or `classified` (the policy's classifier named the error).
pub const FORWARD_REASON: &str = "x-redeliver-forward-reason";
/// The error of the attempt that was forwarded, with its `source()` chain, truncated to
/// [`DEAD_LETTER_ERROR_MAX_BYTES`].
pub const FORWARD_ERROR: &str = "x-redeliver-forward-error";
/// Attempts made in the queue it came from (long-long int, 1 when forwarded at the first).
pub const FORWARD_ATTEMPTS: &str = "x-redeliver-forward-attempts";
/// When it was forwarded, RFC 3339.
pub const FORWARDED_AT: &str = "x-redeliver-forwarded-at";
/// The connection name of the worker that forwarded it.
pub const FORWARDED_BY: &str = "x-redeliver-forwarded-by";
/// Maximum size of [`LAST_ERROR`] in bytes.
pub const LAST_ERROR_MAX_BYTES: usize = 1024;

/// The broker's dead-letter history header (an array of tables).
pub const X_DEATH: &str = "x-death";
/// Prefix of the broker's `x-first-death-*` headers.
pub const X_FIRST_DEATH_PREFIX: &str = "x-first-death-";
/// Prefix of the broker's `x-last-death-*` headers.
pub const X_LAST_DEATH_PREFIX: &str = "x-last-death-";
/// Delivery counter a quorum queue sets on redelivered messages.
pub const X_DELIVERY_COUNT: &str = "x-delivery-count";
/// W3C trace context: the trace and parent span a message belongs to (written by the publisher
/// and read by the worker with the `otel` feature; kept on retry copies and dead letters).
pub const TRACEPARENT: &str = "traceparent";
/// W3C trace context: vendor-specific trace state, next to [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// AMQP short strings (exchange names, routing keys) cannot exceed 255 bytes.
const SHORT_STRING_MAX: usize = 255;

/// The retry bookkeeping carried on a retried copy in the `x-redeliver-*` headers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetryState {
    /// Retries so far: 0 on a fresh message, 1 on the first retried copy.
    pub attempt: u32,
    /// RFC 3339 time of the first failure.
    pub first_failed_at: Option<String>,
    /// The last error's message (at most [`LAST_ERROR_MAX_BYTES`]).
    pub last_error: Option<String>,
    /// Exchange of the original publish.
    pub original_exchange: Option<String>,
    /// Routing key of the original publish.
    pub original_routing_key: Option<String>,
    /// Delay applied to reach this copy.
    pub delay: Option<Duration>,
    /// [`NOT_BEFORE`]: the earliest time this retry may run, in Unix milliseconds.
    pub not_before_ms: Option<u64>,
}

impl RetryState {
    /// Reads the retry state from a delivery's headers.
    ///
    /// Never fails and never panics: a missing table or any malformed value gives the default
    /// for that field (attempt 0, `None` otherwise). Only integer types are accepted for
    /// [`ATTEMPT`] and [`DELAY_MS`]; negative values, attempts above `u32::MAX` and delays above
    /// `i64::MAX` milliseconds (more than [`write`](Self::write) can carry) count as garbage.
    /// Exchange and routing key longer than 255 bytes are dropped, as they could not be published to;
    /// so is a [`FIRST_FAILED_AT`] longer than 64 bytes (an RFC 3339 time is about 24), and
    /// [`LAST_ERROR`] is truncated to [`LAST_ERROR_MAX_BYTES`]. Strings must be valid UTF-8.
    ///
    /// ```
    /// use redeliver::amqp::headers::{RetryState, ATTEMPT};
    /// use redeliver::lapin::types::{AMQPValue, FieldTable};
    ///
    /// let mut t = FieldTable::default();
    /// t.insert(ATTEMPT.into(), AMQPValue::LongLongInt(2));
    /// assert_eq!(RetryState::read(Some(&t)).attempt, 2);
    /// t.insert(ATTEMPT.into(), AMQPValue::LongLongInt(-5));
    /// assert_eq!(RetryState::read(Some(&t)).attempt, 0);
    /// assert_eq!(RetryState::read(None), RetryState::default());
    /// ```
    pub fn read(headers: Option<&FieldTable>) -> Self {
        let Some(t) = headers else {
            return Self::default();
        };
        let get = |k: &str| lookup(t, k);
        Self {
            attempt: get(ATTEMPT)
                .and_then(as_u64)
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(0),
            first_failed_at: get(FIRST_FAILED_AT)
                .and_then(as_string)
                .filter(|s| !s.is_empty() && s.len() <= 64),
            last_error: get(LAST_ERROR)
                .and_then(as_string)
                .map(|s| truncate_error(&s)),
            original_exchange: get(ORIGINAL_EXCHANGE)
                .and_then(as_string)
                .filter(|s| s.len() <= SHORT_STRING_MAX),
            original_routing_key: get(ORIGINAL_ROUTING_KEY)
                .and_then(as_string)
                .filter(|s| s.len() <= SHORT_STRING_MAX),
            delay: get(DELAY_MS)
                .and_then(as_u64_long)
                .map(Duration::from_millis),
            not_before_ms: get(NOT_BEFORE).and_then(as_u64_long),
        }
    }

    /// How long before [`not_before_ms`](Self::not_before_ms) `now_ms` is: `None` when the retry
    /// is due (or carries no such time).
    pub fn early_by(&self, now_ms: u64) -> Option<Duration> {
        self.not_before_ms
            .filter(|&t| t > now_ms)
            .map(|t| Duration::from_millis(t - now_ms))
    }

    /// Writes the state into `headers`, replacing any previous `x-redeliver-*` value.
    ///
    /// A `None` field removes its header; the attempt is always written (long-long int).
    pub fn write(&self, headers: &mut FieldTable) {
        let mut map: BTreeMap<ShortString, AMQPValue> = headers.inner().clone();
        map.insert(
            ATTEMPT.into(),
            AMQPValue::LongLongInt(i64::from(self.attempt)),
        );
        let mut set = |k: &str, v: Option<AMQPValue>| match v {
            Some(v) => {
                map.insert(k.into(), v);
            }
            None => {
                map.remove(k);
            }
        };
        let text = |s: &Option<String>| {
            s.as_ref()
                .map(|s| AMQPValue::LongString(LongString::from(s.as_bytes())))
        };
        set(FIRST_FAILED_AT, text(&self.first_failed_at));
        set(
            LAST_ERROR,
            text(&self.last_error.as_deref().map(truncate_error)),
        );
        set(ORIGINAL_EXCHANGE, text(&self.original_exchange));
        set(ORIGINAL_ROUTING_KEY, text(&self.original_routing_key));
        set(
            DELAY_MS,
            self.delay
                .map(|d| AMQPValue::LongLongInt(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))),
        );
        set(
            NOT_BEFORE,
            self.not_before_ms
                .map(|t| AMQPValue::LongLongInt(i64::try_from(t).unwrap_or(i64::MAX))),
        );
        // A native retry's annotations, read above, are now written under their copy names.
        for k in [
            ATTEMPT,
            FIRST_FAILED_AT,
            LAST_ERROR,
            ORIGINAL_EXCHANGE,
            ORIGINAL_ROUTING_KEY,
            DELAY_MS,
            NOT_BEFORE,
        ] {
            if let Some(annotation) = annotation_name(k) {
                map.remove(annotation.as_str());
            }
        }
        *headers = FieldTable::from(map);
    }
}

/// One entry of the broker's `x-death` header: one (queue, reason) pair the message died in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XDeath {
    /// Queue the message was dead-lettered from.
    pub queue: String,
    /// `rejected`, `expired`, `maxlen` or `delivery_limit`.
    pub reason: String,
    /// How many times the message died in this queue for this reason.
    pub count: u64,
    /// Exchange the message had been published to before it died.
    pub exchange: String,
    /// Routing keys (including CC) the message had been published with.
    pub routing_keys: Vec<String>,
    /// When it died (first time), Unix seconds.
    pub time: Option<u64>,
}

/// Parses the `x-death` header, most recent death first (the broker's order).
///
/// Tolerant: entries that are not tables are skipped; missing or mistyped fields become empty
/// strings, 0 or `None`.
///
/// ```
/// use redeliver::amqp::headers::x_death;
/// assert!(x_death(None).is_empty());
/// ```
pub fn x_death(headers: Option<&FieldTable>) -> Vec<XDeath> {
    let Some(AMQPValue::FieldArray(entries)) = headers.and_then(|t| t.inner().get(X_DEATH)) else {
        return Vec::new();
    };
    entries
        .as_slice()
        .iter()
        .filter_map(|e| match e {
            AMQPValue::FieldTable(t) => Some(t),
            _ => None,
        })
        .map(|t| {
            let get = |k: &str| t.inner().get(k);
            let text = |k: &str| get(k).and_then(as_string).unwrap_or_default();
            XDeath {
                queue: text("queue"),
                reason: text("reason"),
                count: get("count").and_then(as_u64).unwrap_or(0),
                exchange: text("exchange"),
                routing_keys: match get("routing-keys") {
                    Some(AMQPValue::FieldArray(a)) => {
                        a.as_slice().iter().filter_map(as_string).collect()
                    }
                    Some(v) => as_string(v).into_iter().collect(),
                    None => Vec::new(),
                },
                time: get("time").and_then(as_u64),
            }
        })
        .collect()
}

/// The headers with a malformed `x-death` repaired, or `None` when there is nothing to repair.
///
/// RabbitMQ (3.10 at least) rewrites `x-death` whenever it dead-letters a message, and its code
/// crashes on an array element that is not a table or on a `count` that is not an integer: on a
/// quorum queue the crash takes down dead-lettering for every quorum queue of the node, on a
/// classic queue the message is lost. Any publisher can send such a header, so a worker must
/// never let the broker dead-letter a message carrying one.
///
/// Repair keeps the entries that are tables with an integer (or absent) `count`, drops the rest
/// (the whole header when nothing is left) and records [`SANITIZED`]. An `x-death` that is not an
/// array at all is left alone: the broker replaces it without reading it.
///
/// ```
/// use redeliver::amqp::headers::{sanitize_x_death, SANITIZED, X_DEATH};
/// use redeliver::lapin::types::{AMQPValue, FieldArray, FieldTable};
///
/// let mut h = FieldTable::default();
/// h.insert(X_DEATH.into(), AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongLongInt(7)])));
/// let repaired = sanitize_x_death(Some(&h)).expect("malformed");
/// assert!(!repaired.contains_key(X_DEATH));
/// assert!(repaired.contains_key(SANITIZED));
/// assert!(sanitize_x_death(None).is_none());
/// ```
pub fn sanitize_x_death(headers: Option<&FieldTable>) -> Option<FieldTable> {
    let headers = headers?;
    let Some(AMQPValue::FieldArray(entries)) = headers.inner().get(X_DEATH) else {
        return None;
    };
    let well_formed = |e: &AMQPValue| match e {
        AMQPValue::FieldTable(t) => t.inner().get("count").is_none_or(is_integer),
        _ => false,
    };
    if entries.as_slice().iter().all(well_formed) {
        return None;
    }
    let kept: Vec<AMQPValue> = entries
        .as_slice()
        .iter()
        .filter(|e| well_formed(e))
        .cloned()
        .collect();
    let mut map: BTreeMap<ShortString, AMQPValue> = headers.inner().clone();
    if kept.is_empty() {
        map.remove(X_DEATH);
    } else {
        map.insert(X_DEATH.into(), AMQPValue::FieldArray(kept.into()));
    }
    map.insert(
        SANITIZED.into(),
        AMQPValue::LongString(LongString::from("malformed x-death entries removed")),
    );
    Some(FieldTable::from(map))
}

/// The headers for a retried copy: every header of `original` except `x-death`,
/// `x-first-death-*`, `x-last-death-*`, `x-delivery-count` (all owned by the broker) and our own
/// `x-redeliver-*`, then `state` written on top.
///
/// ```
/// use redeliver::amqp::headers::{retry_copy_headers, RetryState, ATTEMPT};
/// use redeliver::lapin::types::{AMQPValue, FieldTable};
///
/// let mut orig = FieldTable::default();
/// orig.insert("tenant".into(), AMQPValue::LongString("acme".into()));
/// orig.insert("x-death".into(), AMQPValue::Void);
/// let copy = retry_copy_headers(Some(&orig), &RetryState { attempt: 1, ..Default::default() });
/// assert!(copy.contains_key("tenant"));
/// assert!(!copy.contains_key("x-death"));
/// assert_eq!(copy.inner().get(ATTEMPT), Some(&AMQPValue::LongLongInt(1)));
/// ```
pub fn retry_copy_headers(original: Option<&FieldTable>, state: &RetryState) -> FieldTable {
    let map: BTreeMap<ShortString, AMQPValue> = original
        .map(|t| {
            t.inner()
                .iter()
                .filter(|(k, _)| {
                    let k = k.as_str();
                    k != X_DEATH
                        && k != X_DELIVERY_COUNT
                        && !k.starts_with(X_FIRST_DEATH_PREFIX)
                        && !k.starts_with(X_LAST_DEATH_PREFIX)
                        && !k.starts_with(PREFIX)
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    let mut table = FieldTable::from(map);
    state.write(&mut table);
    table
}

/// What the worker wrote on a dead letter it published itself (`Annotate` mode), read back by
/// operators' tools.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterInfo {
    /// [`DEAD_LETTER_REASON`].
    pub reason: String,
    /// [`DEAD_LETTER_ERROR`].
    pub error: Option<String>,
    /// [`DEAD_LETTER_ATTEMPTS`].
    pub attempts: Option<u64>,
    /// [`DEAD_LETTERED_AT`].
    pub at: Option<String>,
    /// [`DEAD_LETTERED_BY`].
    pub by: Option<String>,
}

impl DeadLetterInfo {
    /// Reads the annotation; `None` when the message carries no [`DEAD_LETTER_REASON`] (it was
    /// dead-lettered by the broker: see its `x-death`). Tolerant like [`RetryState::read`].
    pub fn read(headers: Option<&FieldTable>) -> Option<Self> {
        let t = headers?;
        let get = |k: &str| lookup(t, k);
        let text = |k: &str| get(k).and_then(as_string).filter(|s| !s.is_empty());
        Some(Self {
            reason: text(DEAD_LETTER_REASON)?,
            error: text(DEAD_LETTER_ERROR).map(|e| truncate_to(&e, DEAD_LETTER_ERROR_MAX_BYTES)),
            attempts: get(DEAD_LETTER_ATTEMPTS).and_then(as_u64_long),
            at: text(DEAD_LETTERED_AT).filter(|s| s.len() <= 64),
            by: text(DEAD_LETTERED_BY),
        })
    }

    /// Writes the annotation into `headers` (strings and a long-long int, readable in the
    /// management UI).
    pub fn write(&self, headers: &mut FieldTable) {
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
        headers.insert(DEAD_LETTER_REASON.into(), text(&self.reason));
        if let Some(e) = &self.error {
            headers.insert(
                DEAD_LETTER_ERROR.into(),
                text(&truncate_to(e, DEAD_LETTER_ERROR_MAX_BYTES)),
            );
        }
        if let Some(n) = self.attempts {
            headers.insert(
                DEAD_LETTER_ATTEMPTS.into(),
                AMQPValue::LongLongInt(i64::try_from(n).unwrap_or(i64::MAX)),
            );
        }
        if let Some(at) = &self.at {
            headers.insert(DEAD_LETTERED_AT.into(), text(at));
        }
        if let Some(by) = &self.by {
            headers.insert(DEAD_LETTERED_BY.into(), text(by));
        }
    }
}

/// Headers of a dead letter the worker publishes itself (`Annotate` mode): the original's,
/// without the broker's delivery bookkeeping (`x-death` of the delay hops, `x-first-death-*`,
/// `x-last-death-*`, delivery counters), with the retry state kept, `x-redeliver-first-failed-at`
/// set if this is the first failure, the annotation, and the `expiration` the dead letter does not
/// keep.
pub fn dead_letter_headers(
    original: Option<&FieldTable>,
    info: &DeadLetterInfo,
    expiration: Option<&str>,
) -> FieldTable {
    let mut t: BTreeMap<ShortString, AMQPValue> = original
        .map(|t| {
            t.inner()
                .iter()
                .filter(|(k, _)| !is_broker_header(k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
    if !t.contains_key(FIRST_FAILED_AT) {
        let at = info.at.clone().unwrap_or_else(now_rfc3339);
        t.insert(FIRST_FAILED_AT.into(), text(&at));
    }
    if let Some(e) = expiration {
        t.insert(ORIGINAL_EXPIRATION.into(), text(e));
    }
    let mut table = FieldTable::from(t);
    info.write(&mut table);
    table
}

/// Where a forwarded message came from and why, written on the copy the worker forwards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForwardInfo {
    /// [`FORWARDED_FROM`].
    pub from: String,
    /// [`FORWARD_REASON`].
    pub reason: String,
    /// [`FORWARD_ERROR`].
    pub error: Option<String>,
    /// [`FORWARD_ATTEMPTS`].
    pub attempts: Option<u64>,
    /// [`FORWARDED_AT`].
    pub at: Option<String>,
    /// [`FORWARDED_BY`].
    pub by: Option<String>,
}

impl ForwardInfo {
    /// Reads it back; `None` when the message was not forwarded. Tolerant like
    /// [`RetryState::read`].
    pub fn read(headers: Option<&FieldTable>) -> Option<Self> {
        let t = headers?;
        let get = |k: &str| t.inner().get(k);
        let text = |k: &str| get(k).and_then(as_string).filter(|s| !s.is_empty());
        Some(Self {
            from: text(FORWARDED_FROM)?,
            reason: text(FORWARD_REASON).unwrap_or_default(),
            error: text(FORWARD_ERROR).map(|e| truncate_to(&e, DEAD_LETTER_ERROR_MAX_BYTES)),
            attempts: get(FORWARD_ATTEMPTS).and_then(as_u64_long),
            at: text(FORWARDED_AT).filter(|s| s.len() <= 64),
            by: text(FORWARDED_BY),
        })
    }

    /// Writes it into `headers` as strings and a long-long int, which the management UI shows.
    pub fn write(&self, headers: &mut FieldTable) {
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
        headers.insert(FORWARDED_FROM.into(), text(&self.from));
        headers.insert(FORWARD_REASON.into(), text(&self.reason));
        if let Some(e) = &self.error {
            headers.insert(
                FORWARD_ERROR.into(),
                text(&truncate_to(e, DEAD_LETTER_ERROR_MAX_BYTES)),
            );
        }
        if let Some(n) = self.attempts {
            headers.insert(
                FORWARD_ATTEMPTS.into(),
                AMQPValue::LongLongInt(i64::try_from(n).unwrap_or(i64::MAX)),
            );
        }
        if let Some(at) = &self.at {
            headers.insert(FORWARDED_AT.into(), text(at));
        }
        if let Some(by) = &self.by {
            headers.insert(FORWARDED_BY.into(), text(by));
        }
    }
}

/// Headers of a forwarded copy: the original's user headers (trace context included) without
/// the broker's delivery bookkeeping and without any `x-redeliver-*` header, so that the
/// destination starts the message's retries afresh under its own policy, then `info`.
///
/// ```
/// use redeliver::amqp::headers::{forward_headers, ForwardInfo, ATTEMPT, FORWARDED_FROM};
/// use redeliver::lapin::types::{AMQPValue, FieldTable};
///
/// let mut orig = FieldTable::default();
/// orig.insert("tenant".into(), AMQPValue::LongString("acme".into()));
/// orig.insert(ATTEMPT.into(), AMQPValue::LongLongInt(2));
/// orig.insert("x-death".into(), AMQPValue::Void);
/// let info = ForwardInfo { from: "images".into(), reason: "timeout".into(), ..Default::default() };
/// let copy = forward_headers(Some(&orig), &info);
/// assert!(copy.contains_key("tenant"));
/// assert!(!copy.contains_key(ATTEMPT) && !copy.contains_key("x-death"));
/// assert_eq!(ForwardInfo::read(Some(&copy)), Some(info));
/// ```
pub fn forward_headers(original: Option<&FieldTable>, info: &ForwardInfo) -> FieldTable {
    let map: BTreeMap<ShortString, AMQPValue> = original
        .map(|t| {
            t.inner()
                .iter()
                .filter(|(k, _)| !is_broker_header(k.as_str()) && !k.as_str().starts_with(PREFIX))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    let mut table = FieldTable::from(map);
    info.write(&mut table);
    table
}

/// Headers the broker writes about deliveries and dead-lettering.
fn is_broker_header(k: &str) -> bool {
    k == X_DEATH
        || k == X_DELIVERY_COUNT
        || k == "x-acquired-count"
        || k.starts_with(X_FIRST_DEATH_PREFIX)
        || k.starts_with(X_LAST_DEATH_PREFIX)
}

/// Truncates `s` to at most `max` bytes, cutting on a char boundary.
pub(crate) fn truncate_to(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The AMQP 1.0 annotation spelling of an `x-redeliver-*` header (`x-opt-redeliver-*`); `None`
/// for a name outside `x-`.
///
/// ```
/// use redeliver::amqp::headers::{annotation_name, ATTEMPT};
/// assert_eq!(annotation_name(ATTEMPT).as_deref(), Some("x-opt-redeliver-attempt"));
/// ```
pub fn annotation_name(header: &str) -> Option<String> {
    header
        .strip_prefix("x-")
        .map(|rest| format!("{ANNOTATION_PREFIX}{rest}"))
}

/// `k`'s annotation spelling (a native retry or dead letter read over AMQP 0-9-1), else `k`.
/// The annotation wins: a native retry adds it beside whatever plain header the message had (a
/// publisher's, an earlier copy's), which it cannot remove, so it is always the newer one.
fn lookup<'t>(t: &'t FieldTable, k: &str) -> Option<&'t AMQPValue> {
    annotation_name(k)
        .and_then(|a| t.inner().get(a.as_str()))
        .or_else(|| t.inner().get(k))
}

/// Truncates `s` to at most [`LAST_ERROR_MAX_BYTES`] bytes, cutting on a char boundary.
///
/// ```
/// use redeliver::amqp::headers::{truncate_error, LAST_ERROR_MAX_BYTES};
/// let long = "é".repeat(1000); // 2000 bytes
/// let t = truncate_error(&long);
/// assert!(t.len() <= LAST_ERROR_MAX_BYTES);
/// assert!(long.starts_with(&t));
/// ```
pub fn truncate_error(s: &str) -> String {
    truncate_to(s, LAST_ERROR_MAX_BYTES)
}

/// The current time as an RFC 3339 string with millisecond precision, UTC
/// (e.g. `2024-05-01T12:00:00.123Z`).
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// A non-negative integer of any AMQP integer type (or a timestamp); anything else is `None`.
fn as_u64(v: &AMQPValue) -> Option<u64> {
    match *v {
        AMQPValue::ShortShortInt(i) => u64::try_from(i).ok(),
        AMQPValue::ShortShortUInt(u) => Some(u64::from(u)),
        AMQPValue::ShortInt(i) => u64::try_from(i).ok(),
        AMQPValue::ShortUInt(u) => Some(u64::from(u)),
        AMQPValue::LongInt(i) => u64::try_from(i).ok(),
        AMQPValue::LongUInt(u) => Some(u64::from(u)),
        AMQPValue::LongLongInt(i) => u64::try_from(i).ok(),
        AMQPValue::Timestamp(t) => Some(t),
        _ => None,
    }
}

/// [`as_u64`], at most `i64::MAX`: what a long-long int header, as this module writes numbers,
/// can carry back. A larger value (only a `timestamp` holds one) is garbage: read, it would be
/// written back as another number.
fn as_u64_long(v: &AMQPValue) -> Option<u64> {
    as_u64(v).filter(|&n| i64::try_from(n).is_ok())
}

/// Any AMQP integer type: what the broker can add 1 to.
fn is_integer(v: &AMQPValue) -> bool {
    matches!(
        v,
        AMQPValue::ShortShortInt(_)
            | AMQPValue::ShortShortUInt(_)
            | AMQPValue::ShortInt(_)
            | AMQPValue::ShortUInt(_)
            | AMQPValue::LongInt(_)
            | AMQPValue::LongUInt(_)
            | AMQPValue::LongLongInt(_)
    )
}

/// A UTF-8 string value (long or short string); invalid UTF-8 and other types are `None`.
fn as_string(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_info_round_trip() {
        let info = DeadLetterInfo {
            reason: "retries_exhausted".into(),
            error: Some("timeout: connect: refused".into()),
            attempts: Some(4),
            at: Some("2026-12-03T08:00:00.000Z".into()),
            by: Some("redeliver-worker:images".into()),
        };
        let mut t = FieldTable::default();
        info.write(&mut t);
        assert_eq!(DeadLetterInfo::read(Some(&t)), Some(info));
        assert_eq!(DeadLetterInfo::read(Some(&FieldTable::default())), None);
        let mut long = FieldTable::default();
        DeadLetterInfo {
            reason: "permanent".into(),
            error: Some("é".repeat(5000)),
            ..Default::default()
        }
        .write(&mut long);
        let read = DeadLetterInfo::read(Some(&long)).unwrap();
        assert!(read.error.unwrap().len() <= DEAD_LETTER_ERROR_MAX_BYTES);
    }
    use lapin::types::FieldArray;

    fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(k.into(), v);
        }
        t
    }

    #[test]
    fn round_trip() {
        let s = RetryState {
            attempt: 3,
            first_failed_at: Some(now_rfc3339()),
            last_error: Some("boom: io: refused".into()),
            original_exchange: Some("ex".into()),
            original_routing_key: Some("rk.a".into()),
            delay: Some(Duration::from_millis(1234)),
            not_before_ms: Some(1_700_000_000_000),
        };
        let mut t = FieldTable::default();
        s.write(&mut t);
        assert_eq!(RetryState::read(Some(&t)), s);
        assert_eq!(s.early_by(1_699_999_999_000), Some(Duration::from_secs(1)));
        assert_eq!(s.early_by(1_700_000_000_000), None);
        let cleared = RetryState {
            attempt: 4,
            ..Default::default()
        };
        cleared.write(&mut t);
        assert_eq!(RetryState::read(Some(&t)), cleared);
        assert!(!t.contains_key(LAST_ERROR));
    }

    /// A native retry's annotations (`x-opt-redeliver-*`), seen as headers by an AMQP 0-9-1
    /// reader, are read as the copy's headers are; writing moves them to the copy's names.
    #[test]
    fn annotation_spellings_are_read_too() {
        let mut t = table(vec![
            ("x-opt-redeliver-attempt", AMQPValue::LongLongInt(2)),
            (
                "x-opt-redeliver-last-error",
                AMQPValue::LongString("boom".into()),
            ),
            ("x-opt-redeliver-not-before", AMQPValue::LongLongInt(5)),
            (
                "x-opt-redeliver-dead-letter-reason",
                AMQPValue::LongString("exhausted".into()),
            ),
        ]);
        let state = RetryState::read(Some(&t));
        assert_eq!(state.attempt, 2);
        assert_eq!(state.last_error.as_deref(), Some("boom"));
        assert_eq!(state.not_before_ms, Some(5));
        let info = DeadLetterInfo::read(Some(&t)).map(|i| i.reason);
        assert_eq!(info.as_deref(), Some("exhausted"));
        RetryState {
            attempt: 3,
            ..state
        }
        .write(&mut t);
        assert!(!t.contains_key("x-opt-redeliver-attempt"));
        assert_eq!(RetryState::read(Some(&t)).attempt, 3);
    }

    #[test]
    fn hostile_values() {
        let t = table(vec![
            (ATTEMPT, AMQPValue::LongString("7".into())),
            (DELAY_MS, AMQPValue::LongLongInt(-1)),
            (LAST_ERROR, AMQPValue::LongString(vec![0xff, 0xfe].into())),
            (
                ORIGINAL_EXCHANGE,
                AMQPValue::LongString("e".repeat(300).into()),
            ),
            (
                FIRST_FAILED_AT,
                AMQPValue::FieldArray(FieldArray::default()),
            ),
        ]);
        assert_eq!(RetryState::read(Some(&t)), RetryState::default());
        let t = table(vec![(ATTEMPT, AMQPValue::LongLongInt(i64::MAX))]);
        assert_eq!(RetryState::read(Some(&t)).attempt, 0);
        let t = table(vec![(ATTEMPT, AMQPValue::ShortShortUInt(9))]);
        assert_eq!(RetryState::read(Some(&t)).attempt, 9);
    }

    #[test]
    fn x_death_parses_broker_shape() {
        let entry = table(vec![
            ("count", AMQPValue::LongLongInt(1)),
            ("reason", AMQPValue::LongString("rejected".into())),
            ("queue", AMQPValue::LongString("q".into())),
            ("time", AMQPValue::Timestamp(1_700_000_000)),
            ("exchange", AMQPValue::LongString("".into())),
            (
                "routing-keys",
                AMQPValue::FieldArray(vec![AMQPValue::LongString("q".into())].into()),
            ),
        ]);
        let t = table(vec![(
            X_DEATH,
            AMQPValue::FieldArray(
                vec![AMQPValue::Boolean(true), AMQPValue::FieldTable(entry)].into(),
            ),
        )]);
        assert_eq!(
            x_death(Some(&t)),
            vec![XDeath {
                queue: "q".into(),
                reason: "rejected".into(),
                count: 1,
                exchange: String::new(),
                routing_keys: vec!["q".into()],
                time: Some(1_700_000_000),
            }]
        );
    }

    #[test]
    fn sanitize_keeps_good_entries_and_drops_the_rest() {
        let good = AMQPValue::FieldTable(table(vec![
            ("count", AMQPValue::LongLongInt(2)),
            ("queue", AMQPValue::LongString("q".into())),
        ]));
        let no_count =
            AMQPValue::FieldTable(table(vec![("queue", AMQPValue::LongString("q".into()))]));
        let text_count =
            AMQPValue::FieldTable(table(vec![("count", AMQPValue::LongString("many".into()))]));
        let arr = |v: Vec<AMQPValue>| {
            table(vec![
                (X_DEATH, AMQPValue::FieldArray(FieldArray::from(v))),
                ("tenant", AMQPValue::LongString("acme".into())),
            ])
        };
        // Well-formed, empty, or not an array: nothing to repair.
        assert!(sanitize_x_death(Some(&arr(vec![good.clone(), no_count.clone()]))).is_none());
        assert!(sanitize_x_death(Some(&arr(vec![]))).is_none());
        let not_array = table(vec![(X_DEATH, AMQPValue::LongString("x".into()))]);
        assert!(sanitize_x_death(Some(&not_array)).is_none());
        assert!(sanitize_x_death(Some(&FieldTable::default())).is_none());

        let fixed = sanitize_x_death(Some(&arr(vec![
            AMQPValue::LongLongInt(7),
            good.clone(),
            text_count,
            no_count.clone(),
        ])))
        .expect("malformed");
        assert_eq!(
            fixed.inner().get(X_DEATH),
            Some(&AMQPValue::FieldArray(FieldArray::from(vec![
                good, no_count
            ])))
        );
        assert!(fixed.contains_key("tenant"));
        assert!(fixed.contains_key(SANITIZED));
        assert!(sanitize_x_death(Some(&fixed)).is_none(), "repair is final");

        let only_junk = sanitize_x_death(Some(&arr(vec![AMQPValue::Void]))).expect("malformed");
        assert!(!only_junk.contains_key(X_DEATH));
    }

    #[test]
    fn truncation_on_char_boundary() {
        let s = format!("{}€", "a".repeat(1022)); // € is 3 bytes: 1022 + 3 > 1024
        assert_eq!(truncate_error(&s), "a".repeat(1022));
        assert_eq!(truncate_error("short"), "short");
    }

    #[test]
    fn copy_drops_broker_and_own_headers() {
        let orig = table(vec![
            ("user", AMQPValue::LongString("u".into())),
            (X_DEATH, AMQPValue::FieldArray(FieldArray::default())),
            ("x-first-death-queue", AMQPValue::LongString("q".into())),
            ("x-last-death-reason", AMQPValue::LongString("r".into())),
            (X_DELIVERY_COUNT, AMQPValue::LongLongInt(2)),
            (DEAD_LETTER_REASON, AMQPValue::LongString("r".into())),
            (LAST_ERROR, AMQPValue::LongString("old".into())),
        ]);
        let copy = retry_copy_headers(
            Some(&orig),
            &RetryState {
                attempt: 2,
                ..Default::default()
            },
        );
        let keys: Vec<&str> = copy.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(keys, vec!["user", ATTEMPT]);
    }

    /// Found by `fuzz/` (target `headers`): a delay or an attempt count above `i64::MAX` (a
    /// `timestamp` header can hold one) was read, then written back clamped to `i64::MAX`, so
    /// a copy carried another value than the one read.
    #[test]
    fn numbers_a_long_long_int_cannot_carry_are_garbage() {
        let huge = table(vec![
            (DELAY_MS, AMQPValue::Timestamp(u64::MAX)),
            (
                DEAD_LETTER_REASON,
                AMQPValue::LongString("permanent".into()),
            ),
            (DEAD_LETTER_ATTEMPTS, AMQPValue::Timestamp(1 << 63)),
        ]);
        let state = RetryState::read(Some(&huge));
        assert_eq!(state.delay, None);
        let info = DeadLetterInfo::read(Some(&huge)).unwrap();
        assert_eq!(info.attempts, None);
        let (mut again, mut info_again) = (huge.clone(), huge.clone());
        state.write(&mut again);
        info.write(&mut info_again);
        assert_eq!(RetryState::read(Some(&again)), state);
        assert_eq!(DeadLetterInfo::read(Some(&info_again)), Some(info));
        // The largest value a long-long int carries is read as it is.
        let max = table(vec![(DELAY_MS, AMQPValue::Timestamp(i64::MAX as u64))]);
        assert_eq!(
            RetryState::read(Some(&max)).delay,
            Some(Duration::from_millis(i64::MAX as u64))
        );
    }
}
