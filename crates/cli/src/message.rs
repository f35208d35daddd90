//! What the CLI reads out of a dead-lettered or parked message, and how it rebuilds one for
//! replay.

use std::time::{Duration, SystemTime};

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;
use redeliver_amqp::headers::{self, DeadLetterInfo, RetryState, XDeath};
use redeliver_amqp::properties::copy_properties;
use serde::Serialize;

use crate::text;

/// Headers the broker writes when it dead-letters or redelivers. From RabbitMQ 3.13 the broker
/// owns `x-*` headers and ignores them on republished messages, and on older brokers a stale
/// `x-death` would make the replayed copy look like it already died: both reasons to drop them.
const BROKER_HEADERS: &[&str] = &[headers::X_DEATH, headers::X_DELIVERY_COUNT];
const BROKER_HEADER_PREFIXES: &[&str] =
    &[headers::X_FIRST_DEATH_PREFIX, headers::X_LAST_DEATH_PREFIX];

/// Length of the body preview in `list` tables and JSON.
pub(crate) const PREVIEW_CHARS: usize = 60;

/// The parts of a delivery the CLI reads, all chosen by the publisher or the broker, without
/// the acker (which only lapin can make), so the rendering can be tested on any value.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Msg<'a> {
    pub exchange: &'a ShortString,
    pub routing_key: &'a ShortString,
    pub redelivered: bool,
    pub properties: &'a BasicProperties,
    pub data: &'a [u8],
}

impl<'a> From<&'a Delivery> for Msg<'a> {
    fn from(d: &'a Delivery) -> Self {
        Self {
            exchange: &d.exchange,
            routing_key: &d.routing_key,
            redelivered: d.redelivered,
            properties: &d.properties,
            data: &d.data,
        }
    }
}

/// One x-death entry, as shown to operators.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct DeathView {
    pub queue: String,
    pub reason: String,
    pub count: u64,
    pub exchange: String,
    pub routing_keys: Vec<String>,
    pub time: Option<String>,
}

impl From<&XDeath> for DeathView {
    fn from(d: &XDeath) -> Self {
        Self {
            queue: d.queue.clone(),
            reason: d.reason.clone(),
            count: d.count,
            exchange: d.exchange.clone(),
            routing_keys: d.routing_keys.clone(),
            time: d.time.map(unix_to_rfc3339),
        }
    }
}

/// The summary row of one message (`dlq list`, `unroutable list`). Field names are the JSON
/// keys of `--json`, a stable interface for scripts.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Summary {
    /// 1-based position from the head of the queue when it was read.
    pub position: usize,
    pub message_id: Option<String>,
    pub correlation_id: Option<String>,
    pub content_type: Option<String>,
    /// The `timestamp` property (RFC 3339), set by the publisher.
    pub timestamp: Option<String>,
    pub exchange: String,
    pub routing_key: String,
    pub redelivered: bool,
    /// `x-redeliver-first-failed-at`, or for a message dead-lettered on its first failure
    /// (never retried, so no such header) the time of its first x-death.
    pub first_failed_at: Option<String>,
    /// Retries already made (`x-redeliver-attempt`; 0 when never retried).
    pub attempts: u32,
    pub last_error: Option<String>,
    pub original_exchange: Option<String>,
    pub original_routing_key: Option<String>,
    /// Reason and count of the x-death entry that put the message here (the one naming the
    /// source queue when there is one, else the most recent).
    pub death_reason: Option<String>,
    pub death_count: Option<u64>,
    pub x_death: Vec<DeathView>,
    /// Why the message is here: the worker's annotation (`x-redeliver-dead-letter-reason`: a
    /// `DeadLetterReason` name, permanent, retries_exhausted, ..., kept as written: a handler's
    /// or a later version's name is shown too) when it published the dead letter itself, else the
    /// broker's reason in the relevant x-death entry (rejected, expired, maxlen,
    /// delivery_limit), else null.
    pub reason: Option<String>,
    /// The error that made the message die: the annotation's final error, else the last retry's
    /// error (`x-redeliver-last-error`), else null.
    pub final_error: Option<String>,
    /// When it was dead-lettered (RFC 3339): the annotation's time, else the time of the
    /// relevant x-death entry, else null.
    pub dead_lettered_at: Option<String>,
    /// Annotation only: deliveries the worker handled before it gave up.
    pub dead_letter_attempts: Option<u64>,
    /// Annotation only: the connection name of the worker that dead-lettered it.
    pub dead_lettered_by: Option<String>,
    /// Quorum queues' `x-delivery-count` (how often the broker handed the message out).
    pub delivery_count: Option<i64>,
    /// Unroutable parking queue only: the queue the delayed copy was on its way to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination: Option<String>,
    pub body_bytes: usize,
    pub body_preview: String,
}

/// Builds the summary of `d`, read at `position`. `source_queue` picks the relevant x-death
/// entry; `levels` (unroutable only) lets the destination be read from the routing key.
pub(crate) fn summarize(
    position: usize,
    d: Msg<'_>,
    source_queue: Option<&str>,
    levels: Option<u8>,
) -> Summary {
    let p = d.properties;
    let hdrs = p.headers().as_ref();
    let state = RetryState::read(hdrs);
    let deaths = headers::x_death(hdrs);
    let relevant = source_queue
        .and_then(|q| deaths.iter().find(|x| x.queue == q))
        .or_else(|| deaths.first());
    let annotation = DeadLetterInfo::read(hdrs);
    let first_failed_at = state.first_failed_at.clone().or_else(|| {
        deaths
            .iter()
            .filter_map(|x| x.time)
            .min()
            .map(unix_to_rfc3339)
    });
    Summary {
        position,
        message_id: short(p.message_id()),
        correlation_id: short(p.correlation_id()),
        content_type: short(p.content_type()),
        timestamp: p.timestamp().map(unix_to_rfc3339),
        exchange: d.exchange.to_string(),
        routing_key: d.routing_key.to_string(),
        redelivered: d.redelivered,
        first_failed_at,
        attempts: state.attempt,
        last_error: state.last_error.clone(),
        original_exchange: state.original_exchange.clone(),
        original_routing_key: state.original_routing_key.clone(),
        death_reason: relevant.map(|x| x.reason.clone()),
        death_count: relevant.map(|x| x.count),
        x_death: deaths.iter().map(DeathView::from).collect(),
        reason: triage_reason(annotation.as_ref(), relevant),
        final_error: annotation
            .as_ref()
            .and_then(|a| a.error.clone())
            .or_else(|| state.last_error.clone()),
        dead_lettered_at: annotation
            .as_ref()
            .and_then(|a| a.at.clone())
            .or_else(|| relevant.and_then(|x| x.time).map(unix_to_rfc3339)),
        dead_letter_attempts: annotation.as_ref().and_then(|a| a.attempts),
        dead_lettered_by: annotation.as_ref().and_then(|a| a.by.clone()),
        delivery_count: hdrs
            .and_then(|h| h.inner().get(headers::X_DELIVERY_COUNT))
            .and_then(as_i64),
        destination: levels.and_then(|l| destination_from_routing_key(d.routing_key.as_str(), l)),
        body_bytes: d.data.len(),
        body_preview: preview(d.data, PREVIEW_CHARS),
    }
}

/// The worker's own reason wins: it knows why it gave up (retries exhausted, undecodable...),
/// where the broker only saw a reject. An empty x-death reason (a malformed entry) counts as none.
fn triage_reason(annotation: Option<&DeadLetterInfo>, relevant: Option<&XDeath>) -> Option<String> {
    annotation
        .map(|a| a.reason.clone())
        .or_else(|| relevant.map(|x| x.reason.clone()).filter(|r| !r.is_empty()))
}

impl Summary {
    /// [`Summary::dead_lettered_at`] as a time; `None` when absent or not RFC 3339.
    pub(crate) fn dead_lettered_time(&self) -> Option<SystemTime> {
        self.dead_lettered_at.as_deref().and_then(parse_rfc3339)
    }
}

/// Parses an RFC 3339 time: `2024-05-01T12:00:00Z`, with or without fractional seconds, with
/// `Z` or a numeric offset (`+02:00`). The worker writes UTC with `Z`, but the header can come
/// from any publisher, so an offset is honoured rather than misread; anything else is `None`.
pub(crate) fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let s = s.trim();
    if let Some(utc) = s.strip_suffix(['Z', 'z']) {
        return local_time(utc);
    }
    // "...+HH:MM" / "...-HH:MM": the last six characters, after the seconds.
    let split = s.len().checked_sub(6).filter(|&i| s.is_char_boundary(i))?;
    let (local, offset) = s.split_at(split);
    let sign = match offset.as_bytes().first() {
        Some(b'+') => 1i64,
        Some(b'-') => -1i64,
        _ => return local_time(s),
    };
    let (h, m) = offset[1..].split_once(':')?;
    let (h, m): (u64, u64) = (h.parse().ok()?, m.parse().ok()?);
    if h > 23 || m > 59 {
        return None;
    }
    let local = local_time(local)?;
    let shift = Duration::from_secs(h * 3600 + m * 60);
    // Local time = UTC + offset, so UTC = local - offset.
    if sign > 0 {
        local.checked_sub(shift)
    } else {
        local.checked_add(shift)
    }
}

/// `YYYY-MM-DDTHH:MM:SS[.fraction]` as UTC. The shape is checked here because humantime's weak
/// parser ignores some trailing characters ("...00Zjunk" is not a time, and must not count as
/// one for `--older-than`).
fn local_time(s: &str) -> Option<SystemTime> {
    let b = s.as_bytes();
    let digits =
        |r: std::ops::Range<usize>| b.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
    let shape = b.len() >= 19
        && digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && matches!(b[10], b'T' | b't' | b' ')
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
        && match b.get(19) {
            None => true,
            Some(b'.') => b.len() > 20 && digits(20..b.len()),
            Some(_) => false,
        };
    if !shape {
        return None;
    }
    humantime::parse_rfc3339_weak(s).ok()
}

fn short(v: &Option<ShortString>) -> Option<String> {
    v.as_ref().map(ShortString::to_string)
}

fn as_i64(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        _ => None,
    }
}

/// Seconds since the epoch -> "2024-05-01T12:00:00Z", for any value a publisher chose (see
/// [`text::unix_time`]).
pub(crate) fn unix_to_rfc3339(secs: u64) -> String {
    text::unix_time(secs)
}

/// Now, for "read at" lines.
pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// Bodies up to this size are parsed as JSON for their preview. Beyond it only the head is
/// read: listing thousands of 16 MiB messages must not parse (and hold the tree of) each one.
const PREVIEW_PARSE_MAX: usize = 64 * 1024;
/// Bytes of a body the text preview looks at: plenty for [`PREVIEW_CHARS`] characters, even
/// of pretty-printed JSON.
const PREVIEW_HEAD: usize = 4 * 1024;

/// A one-line preview: JSON compacted, UTF-8 text with control characters escaped, binary as a
/// byte count and hex head. Truncated on a char boundary with "…". Reads at most
/// [`PREVIEW_PARSE_MAX`] bytes of the body, so its cost does not grow with the body.
pub(crate) fn preview(body: &[u8], max_chars: usize) -> String {
    if body.len() <= PREVIEW_PARSE_MAX {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
            return truncate_chars(&text::escape(&v.to_string()), max_chars);
        }
    }
    let head = &body[..body.len().min(PREVIEW_HEAD)];
    let head_text = match std::str::from_utf8(head) {
        Ok(s) => Some(s),
        // A head cut inside a character: what comes before the cut is text.
        Err(e) if e.error_len().is_none() && head.len() < body.len() => {
            std::str::from_utf8(&head[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    };
    let Some(head_text) = head_text else {
        let hex: String = body.iter().take(16).map(|b| format!("{b:02x}")).collect();
        return format!("<{} bytes binary: {hex}>", body.len());
    };
    let shown = if body.len() > PREVIEW_PARSE_MAX && looks_like_json(head_text) {
        compact_json_text(head_text)
    } else {
        head_text.to_owned()
    };
    if head.len() == body.len() {
        return truncate_chars(&text::escape(&shown), max_chars);
    }
    // Only the head was read: the preview says there is more.
    let mut out = truncate_chars(&text::escape(&shown), max_chars.saturating_sub(1));
    if !out.ends_with('…') {
        out.push('…');
    }
    out
}

fn looks_like_json(s: &str) -> bool {
    matches!(s.trim_start().as_bytes().first(), Some(b'{' | b'['))
}

/// The head of a JSON document without the whitespace between its tokens, as a parse and
/// re-serialization would give, without needing the whole document.
fn compact_json_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in s.chars() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if !matches!(c, ' ' | '\n' | '\r' | '\t') {
            out.push(c);
        }
    }
    out
}

/// Cuts `s` to at most `max` characters, marking the cut with "…".
pub(crate) fn truncate_chars(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// The parking queue receives delayed copies with routing key `b(L-1). ... .b0.QUEUE`: the
/// destination is what follows the L bit words. None when the key does not have that shape.
pub(crate) fn destination_from_routing_key(key: &str, levels: u8) -> Option<String> {
    let mut words = key.split('.');
    for _ in 0..levels {
        match words.next() {
            Some("0") | Some("1") => {}
            _ => return None,
        }
    }
    let rest: Vec<&str> = words.collect();
    if rest.is_empty() || rest.iter().any(|w| w.is_empty()) {
        return None;
    }
    Some(rest.join("."))
}

/// Properties for the copy published on replay.
///
/// Everything is kept (body, message_id, content_type, correlation_id, timestamp, priority,
/// reply_to, expiration, type, app_id, user headers...) except:
/// - the broker's dead-lettering headers (x-death, x-first-death-*, x-last-death-*,
///   x-delivery-count): they describe the old life of the message;
/// - with `reset_retry_state`, every `x-redeliver-*` header, so the attempt count starts again;
/// - `user_id`: the broker rejects a publish whose user_id is not the connection's user (a 406
///   that would close the publishing channel), and the copy is now published by the operator.
pub(crate) fn replay_properties(p: &BasicProperties, reset_retry_state: bool) -> BasicProperties {
    // No connection user: the operator's (a URL's, or a certificate's with SASL EXTERNAL) is
    // not the publisher's the message names.
    let mut out = copy_properties(p, None);
    if let Some(h) = p.headers() {
        out = out.with_headers(replay_headers(h, reset_retry_state));
    }
    // Unlike a retry copy this one goes straight back to a consumer queue, where the sender's
    // TTL still means what it meant.
    if let Some(v) = p.expiration() {
        out = out.with_expiration(v.clone());
    }
    out
}

/// The header table for a replayed copy (see [`replay_properties`]).
pub(crate) fn replay_headers(h: &FieldTable, reset_retry_state: bool) -> FieldTable {
    let mut out = FieldTable::default();
    for (k, v) in h.inner() {
        let key = k.as_str();
        let broker = BROKER_HEADERS.contains(&key)
            || BROKER_HEADER_PREFIXES.iter().any(|p| key.starts_with(p));
        // `x-opt-redeliver-*`: a native retry's or dead letter's spelling of the same state.
        let ours = reset_retry_state
            && (key.starts_with(headers::PREFIX)
                || headers::annotation_name(headers::PREFIX).is_some_and(|a| key.starts_with(&a)));
        if !broker && !ours {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn destination_is_after_the_bit_words() {
        assert_eq!(
            destination_from_routing_key("0.1.1.orders.eu", 3).as_deref(),
            Some("orders.eu")
        );
        assert_eq!(destination_from_routing_key("0.1.orders", 3), None);
        assert_eq!(destination_from_routing_key("0.1.0", 3), None);
        assert_eq!(destination_from_routing_key("0.1.0.a..b", 3), None);
        assert_eq!(destination_from_routing_key("orders", 3), None);
    }

    #[test]
    fn rfc3339_times_parse_with_z_or_offset() {
        let utc = parse_rfc3339("2024-05-01T12:00:00Z").unwrap();
        assert_eq!(
            utc.duration_since(UNIX_EPOCH).unwrap().as_secs(),
            1_714_564_800
        );
        assert_eq!(
            parse_rfc3339("2024-05-01T12:00:00.250Z").map(|t| t > utc),
            Some(true)
        );
        assert_eq!(parse_rfc3339("2024-05-01T14:00:00+02:00"), Some(utc));
        assert_eq!(parse_rfc3339("2024-05-01T10:30:00-01:30"), Some(utc));
        assert_eq!(parse_rfc3339("yesterday"), None);
        assert_eq!(parse_rfc3339("2024-05-01T14:00:00+2x:00"), None);
        assert_eq!(parse_rfc3339(""), None);
        // Trailing junk that humantime's weak parser would skip.
        assert_eq!(parse_rfc3339("2024-05-01T12:00:00Z\u{1b}[2J"), None);
        assert_eq!(parse_rfc3339("2024-05-01T12:00:00Zjunk"), None);
        assert_eq!(parse_rfc3339("2024-05-01X12:00:00Z"), None);
        assert_eq!(parse_rfc3339("2024-05-01T12:00:00.Z"), None);
        assert_eq!(parse_rfc3339("é024-05-01T12:00:00Z"), None);
        assert_eq!(parse_rfc3339("2024Z"), None);
        assert_eq!(parse_rfc3339("2024-+01:00"), None);
        assert_eq!(parse_rfc3339("+10000-01-01T00:00:00Z"), None);
        assert_eq!(parse_rfc3339(" 2024-05-01T12:00:00Z\r\n"), Some(utc));
    }

    #[test]
    fn annotation_wins_over_x_death() {
        let death = XDeath {
            queue: "q".into(),
            reason: "rejected".into(),
            count: 1,
            exchange: String::new(),
            routing_keys: Vec::new(),
            time: Some(1),
        };
        let info = DeadLetterInfo {
            reason: "undecodable".into(),
            ..Default::default()
        };
        assert_eq!(
            triage_reason(Some(&info), Some(&death)).as_deref(),
            Some("undecodable")
        );
        assert_eq!(
            triage_reason(None, Some(&death)).as_deref(),
            Some("rejected")
        );
        let blank = XDeath {
            reason: String::new(),
            ..death
        };
        assert_eq!(triage_reason(None, Some(&blank)), None);
        assert_eq!(triage_reason(None, None), None);
    }

    #[test]
    fn preview_compacts_json_and_truncates() {
        assert_eq!(preview(b"{ \"a\" : 1 }", 60), r#"{"a":1}"#);
        assert_eq!(preview(b"line1\nline2", 60), "line1\\nline2");
        assert_eq!(preview("ééééé".as_bytes(), 3), "éé…");
        assert!(preview(&[0xff, 0xfe, 0x00], 60).starts_with("<3 bytes binary: fffe00"));
    }

    #[test]
    fn replay_headers_strip_broker_and_retry_headers() {
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::Boolean(true));
        h.insert("x-first-death-queue".into(), AMQPValue::Boolean(true));
        h.insert("x-last-death-reason".into(), AMQPValue::Boolean(true));
        h.insert("x-delivery-count".into(), AMQPValue::LongLongInt(3));
        h.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(3));
        h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let reset = replay_headers(&h, true);
        assert_eq!(
            reset.inner().keys().map(|k| k.as_str()).collect::<Vec<_>>(),
            vec!["tenant"]
        );
        let kept = replay_headers(&h, false);
        assert!(kept.contains_key(headers::ATTEMPT));
        assert!(!kept.contains_key("x-death"));
    }

    #[test]
    fn replay_properties_keep_identity_and_drop_user_id() {
        let p = BasicProperties::default()
            .with_message_id("m1".into())
            .with_correlation_id("c1".into())
            .with_content_type("application/json".into())
            .with_user_id("someone".into());
        let r = replay_properties(&p, true);
        assert_eq!(r.message_id().as_ref().map(|s| s.as_str()), Some("m1"));
        assert_eq!(r.correlation_id().as_ref().map(|s| s.as_str()), Some("c1"));
        assert_eq!(
            r.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert!(r.user_id().is_none());
    }

    #[test]
    fn replay_properties_keep_expiration_and_absent_headers() {
        let p = BasicProperties::default()
            .with_expiration("60000".into())
            .with_priority(4);
        let r = replay_properties(&p, true);
        assert_eq!(r.expiration().as_ref().map(|s| s.as_str()), Some("60000"));
        assert_eq!(r.priority(), &Some(4));
        assert!(r.headers().is_none());
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::Boolean(true));
        let r = replay_properties(&p.with_headers(h), true);
        assert_eq!(r.headers(), &Some(FieldTable::default()));
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_text_parses_or_not_without_panicking(s in "\\PC{0,40}") {
            let _ = parse_rfc3339(&s);
        }

        #[test]
        fn times_round_trip_up_to_9999(secs in 0..=crate::text::RFC3339_MAX_SECS) {
            let t = std::time::UNIX_EPOCH + Duration::from_secs(secs);
            prop_assert_eq!(parse_rfc3339(&unix_to_rfc3339(secs)), Some(t));
        }

        #[test]
        fn previews_are_bounded(body in proptest::collection::vec(any::<u8>(), 0..6000)) {
            let p = preview(&body, PREVIEW_CHARS);
            prop_assert!(p.chars().count() <= PREVIEW_CHARS.max(40));
            prop_assert!(!p.chars().any(crate::text::is_unsafe));
        }
    }

    #[test]
    fn large_bodies_are_previewed_from_their_head() {
        let mut big = b"{\n  \"order\": 1,\n  \"note\": \"a \\\" b\",\n  \"pad\": \"".to_vec();
        big.extend(std::iter::repeat_n(b'x', PREVIEW_PARSE_MAX));
        big.extend(b"\"\n}");
        assert_eq!(
            preview(&big, 40),
            r#"{"order":1,"note":"a \" b","pad":"xxxx…"#
        );
        // Cut inside a character: still text.
        let mut utf8 = "é".repeat(PREVIEW_PARSE_MAX).into_bytes();
        utf8.insert(0, b'a');
        assert!(preview(&utf8, 10).starts_with("aééé"));
        let mut binary = vec![0xffu8; 10];
        binary.extend(std::iter::repeat_n(b'a', PREVIEW_PARSE_MAX));
        assert!(preview(&binary, 60).starts_with(&format!("<{} bytes binary: ffff", binary.len())));
    }
}
