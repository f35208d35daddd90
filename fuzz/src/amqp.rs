//! AMQP field values and properties from fuzz input, with a bounded nesting depth: the
//! generator recurses, the code under test must not need to.

use arbitrary::{Result, Unstructured};
use lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};
use lapin::BasicProperties;
use std::collections::BTreeMap;

/// Header names the code under test looks for: a key is one of these half the time, so that the
/// fuzzer reaches `x-death` records, retry state and annotations without guessing their names.
pub const KNOWN_KEYS: &[&str] = &[
    "x-death",
    "count",
    "time",
    "queue",
    "reason",
    "exchange",
    "routing-keys",
    "x-delivery-count",
    "x-first-death-queue",
    "x-last-death-reason",
    "x-redeliver-attempt",
    "x-redeliver-first-failed-at",
    "x-redeliver-last-error",
    "x-redeliver-original-exchange",
    "x-redeliver-original-routing-key",
    "x-redeliver-delay-ms",
    "x-redeliver-dead-letter-reason",
    "x-redeliver-dead-letter-error",
    "x-redeliver-dead-letter-attempts",
    "x-redeliver-dead-lettered-at",
    "x-redeliver-dead-lettered-by",
    "x-redeliver-original-expiration",
    "x-redeliver-sanitized",
    "x-redeliver-headers-removed",
    "traceparent",
    "tracestate",
];

/// How deep generated containers nest at most (the frame guard lets 32 levels through; a bit
/// more checks the CLI's own rendering bound).
pub const MAX_DEPTH: usize = 40;

/// A short string (at most 255 bytes, as AMQP allows; longer input is cut on a char boundary).
pub fn short_string(u: &mut Unstructured<'_>) -> Result<ShortString> {
    let s: String = u.arbitrary()?;
    Ok(short(s))
}

/// `s` cut to 255 bytes on a char boundary.
pub fn short(mut s: String) -> ShortString {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    ShortString::try_new(s).unwrap_or_default()
}

/// A table key: a known header name, an arbitrary short string, or one of the timestamp texts.
pub fn key(u: &mut Unstructured<'_>) -> Result<ShortString> {
    if u.ratio(1, 2)? {
        Ok(ShortString::from(*u.choose(KNOWN_KEYS)?))
    } else {
        short_string(u)
    }
}

/// Text that is sometimes a plausible RFC 3339 time, sometimes anything.
pub fn text(u: &mut Unstructured<'_>) -> Result<String> {
    if u.ratio(1, 4)? {
        let secs: u64 = u.arbitrary()?;
        let (y, rest) = (secs % 12000, secs / 12000);
        Ok(format!(
            "{y:04}-{:02}-{:02}T{:02}:{:02}:{:02}{}",
            rest % 14,
            rest / 14 % 33,
            rest / 462 % 25,
            rest / 11550 % 61,
            rest / 704550 % 61,
            *u.choose(&["Z", "z", "", ".123Z", "+02:00", "-23:59", "+24:00", ".Z", "Zjunk"])?
        ))
    } else {
        u.arbitrary()
    }
}

/// Any field value, containers nesting at most `depth` more levels.
pub fn value(u: &mut Unstructured<'_>, depth: usize) -> Result<AMQPValue> {
    let kind: u8 = u.int_in_range(0..=20)?;
    Ok(match kind {
        0 => AMQPValue::Boolean(u.arbitrary()?),
        1 => AMQPValue::ShortShortInt(u.arbitrary()?),
        2 => AMQPValue::ShortShortUInt(u.arbitrary()?),
        3 => AMQPValue::ShortInt(u.arbitrary()?),
        4 => AMQPValue::ShortUInt(u.arbitrary()?),
        5 => AMQPValue::LongInt(u.arbitrary()?),
        6 => AMQPValue::LongUInt(u.arbitrary()?),
        7 => AMQPValue::LongLongInt(u.arbitrary()?),
        8 => AMQPValue::Float(u.arbitrary()?),
        9 => AMQPValue::Double(u.arbitrary()?),
        10 => AMQPValue::DecimalValue(DecimalValue {
            scale: u.arbitrary()?,
            value: u.arbitrary()?,
        }),
        11 => AMQPValue::ShortString(short_string(u)?),
        12 => AMQPValue::LongString(LongString::from(text(u)?.into_bytes())),
        13 => AMQPValue::LongString(LongString::from(u.arbitrary::<Vec<u8>>()?)),
        14 => AMQPValue::ByteArray(ByteArray::from(u.arbitrary::<Vec<u8>>()?)),
        15 => AMQPValue::Timestamp(u.arbitrary()?),
        16 if depth > 0 => AMQPValue::FieldArray(array(u, depth - 1)?),
        17 if depth > 0 => AMQPValue::FieldTable(table(u, depth - 1)?),
        18 if depth > 0 => x_death(u, depth - 1)?,
        19 => nested(u)?,
        _ => AMQPValue::Void,
    })
}

/// An array of values nesting at most `depth` more levels.
pub fn array(u: &mut Unstructured<'_>, depth: usize) -> Result<FieldArray> {
    let mut items = Vec::new();
    u.arbitrary_loop(None, Some(64), |u| {
        items.push(value(u, depth)?);
        Ok(std::ops::ControlFlow::Continue(()))
    })?;
    Ok(FieldArray::from(items))
}

/// A table of values nesting at most `depth` more levels.
pub fn table(u: &mut Unstructured<'_>, depth: usize) -> Result<FieldTable> {
    let mut map = BTreeMap::new();
    u.arbitrary_loop(None, Some(64), |u| {
        map.insert(key(u)?, value(u, depth)?);
        Ok(std::ops::ControlFlow::Continue(()))
    })?;
    Ok(FieldTable::from(map))
}

/// An `x-death`-like array: tables of the broker's fields, each of any type.
fn x_death(u: &mut Unstructured<'_>, depth: usize) -> Result<AMQPValue> {
    let mut entries = Vec::new();
    u.arbitrary_loop(None, Some(8), |u| {
        let mut t = BTreeMap::new();
        for k in [
            "queue",
            "reason",
            "count",
            "exchange",
            "routing-keys",
            "time",
        ] {
            if u.ratio(7, 8)? {
                let v = match (k, u.ratio(3, 4)?) {
                    ("count", true) => AMQPValue::LongLongInt(u.arbitrary()?),
                    ("time", true) => AMQPValue::Timestamp(u.arbitrary()?),
                    ("routing-keys", true) => {
                        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                            LongString::from(text(u)?.into_bytes()),
                        )]))
                    }
                    (_, true) => AMQPValue::LongString(LongString::from(text(u)?.into_bytes())),
                    (_, false) => value(u, depth.saturating_sub(1))?,
                };
                t.insert(ShortString::from(k), v);
            }
        }
        entries.push(if u.ratio(1, 8)? {
            value(u, depth.saturating_sub(1))?
        } else {
            AMQPValue::FieldTable(FieldTable::from(t))
        });
        Ok(std::ops::ControlFlow::Continue(()))
    })?;
    Ok(AMQPValue::FieldArray(FieldArray::from(entries)))
}

/// Arrays and tables nested up to 200 levels, built without recursion (the fuzzer would rarely
/// get there one level at a time). Dropping it recurses in lapin's types: 200 levels is far
/// below what a thread's stack holds.
fn nested(u: &mut Unstructured<'_>) -> Result<AMQPValue> {
    let levels: usize = u.int_in_range(1..=200)?;
    let tables: u64 = u.arbitrary()?;
    let mut v = value(u, 0)?;
    for i in 0..levels {
        v = if tables >> (i % 64) & 1 == 1 {
            let mut t = BTreeMap::new();
            t.insert(ShortString::from("k"), v);
            AMQPValue::FieldTable(FieldTable::from(t))
        } else {
            AMQPValue::FieldArray(FieldArray::from(vec![v]))
        };
    }
    Ok(v)
}

/// Message properties with every field optional and arbitrary, headers included.
pub fn properties(u: &mut Unstructured<'_>) -> Result<BasicProperties> {
    let mut p = BasicProperties::default();
    macro_rules! maybe {
        ($with:ident, $v:expr) => {
            if u.arbitrary()? {
                p = p.$with($v);
            }
        };
    }
    maybe!(with_content_type, short_string(u)?);
    maybe!(with_content_encoding, short_string(u)?);
    maybe!(with_headers, table(u, MAX_DEPTH)?);
    maybe!(with_delivery_mode, u.arbitrary()?);
    maybe!(with_priority, u.arbitrary()?);
    maybe!(with_correlation_id, short_string(u)?);
    maybe!(with_reply_to, short_string(u)?);
    maybe!(with_expiration, short_string(u)?);
    maybe!(with_message_id, short_string(u)?);
    maybe!(with_timestamp, u.arbitrary()?);
    maybe!(with_type, short_string(u)?);
    maybe!(with_user_id, short_string(u)?);
    maybe!(with_app_id, short_string(u)?);
    maybe!(with_cluster_id, short_string(u)?);
    Ok(p)
}

/// How deep `v` nests (a scalar 0, `[]` 1), counted without recursion.
pub fn depth(v: &AMQPValue) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        match v {
            AMQPValue::FieldArray(a) => {
                deepest = deepest.max(d + 1);
                stack.extend(a.as_slice().iter().map(|x| (x, d + 1)));
            }
            AMQPValue::FieldTable(t) => {
                deepest = deepest.max(d + 1);
                stack.extend(t.inner().values().map(|x| (x, d + 1)));
            }
            _ => {}
        }
    }
    deepest
}

/// A content-header frame carrying `properties` on `channel`, encoded as lapin's protocol crate
/// (and so the broker) writes it; `None` if it cannot be encoded.
pub fn header_frame(channel: u16, body_size: u64, properties: &BasicProperties) -> Option<Vec<u8>> {
    use amq_protocol::frame::{gen_frame, AMQPContentHeader, AMQPFrame, WriteContext};
    let frame = AMQPFrame::Header(
        channel,
        AMQPContentHeader {
            class_id: 60,
            body_size,
            properties: properties.clone(),
        },
    );
    let ctx = gen_frame(&frame)(WriteContext::from(Vec::new())).ok()?;
    Some(ctx.write)
}

/// The frames of `bytes` one by one: (type, channel, whole frame), up to the first that is
/// incomplete (AMQP framing: type, channel, u32 size, payload, end byte).
pub fn split_frames(mut bytes: &[u8]) -> Vec<(u8, u16, &[u8])> {
    let mut out = Vec::new();
    while bytes.len() >= 7 {
        let size = u32::from_be_bytes([bytes[3], bytes[4], bytes[5], bytes[6]]) as usize;
        let Some(total) = size.checked_add(8).filter(|&t| t <= bytes.len()) else {
            break;
        };
        out.push((
            bytes[0],
            u16::from_be_bytes([bytes[1], bytes[2]]),
            &bytes[..total],
        ));
        bytes = &bytes[total..];
    }
    out
}

/// The frames of `frames` that lapin parses: those before the first it refuses (a type other
/// than method, header, body and heartbeat, or no frame-end byte). lapin 4.12.3 treats a
/// parse error as critical and closes the connection (`IoLoop::parse`), so nothing after such
/// a frame reaches its parser, whatever it holds.
pub fn lapin_reads<'a>(frames: &[(u8, u16, &'a [u8])]) -> Vec<(u8, u16, &'a [u8])> {
    frames
        .iter()
        .take_while(|(kind, _, frame)| matches!(kind, 1 | 2 | 3 | 8) && frame.last() == Some(&0xCE))
        .copied()
        .collect()
}

/// `v` as it can travel: lapin's encoder writes a `ShortString` value with the type tag `_`,
/// which no parser reads (amq-protocol-types: "ShortString only exists for internal usage"),
/// and a value received never is one. Each becomes the `LongString` a broker would deliver.
pub fn wire_value(v: &AMQPValue) -> AMQPValue {
    match v {
        AMQPValue::ShortString(s) => {
            AMQPValue::LongString(LongString::from(s.as_str().as_bytes().to_vec()))
        }
        AMQPValue::FieldArray(a) => AMQPValue::FieldArray(FieldArray::from(
            a.as_slice().iter().map(wire_value).collect::<Vec<_>>(),
        )),
        AMQPValue::FieldTable(t) => AMQPValue::FieldTable(wire_table(t)),
        other => other.clone(),
    }
}

/// [`wire_value`] of every value of `t`.
pub fn wire_table(t: &FieldTable) -> FieldTable {
    FieldTable::from(
        t.inner()
            .iter()
            .map(|(k, v)| (k.clone(), wire_value(v)))
            .collect::<BTreeMap<_, _>>(),
    )
}

/// `p` with [`wire_table`] headers.
pub fn wire_properties(p: &BasicProperties) -> BasicProperties {
    match p.headers() {
        Some(h) => p.clone().with_headers(wire_table(h)),
        None => p.clone(),
    }
}
