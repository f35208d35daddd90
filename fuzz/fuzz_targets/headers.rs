//! The header codec (`redeliver_amqp::headers`): retry state, `x-death` records, dead-letter
//! annotations and the copies' header tables, read from tables a publisher chose, and the same
//! tables through the AMQP wire format and the frame guard.
//!
//! Checked, beyond "no panic":
//! - reading is stable: what `RetryState::read` / `DeadLetterInfo::read` give, written back
//!   into the table, reads back the same; any state written reads back as written (within the
//!   documented bounds: 255-byte names, 64-byte times, truncated errors, whole milliseconds);
//! - `sanitize_x_death` leaves only entries the broker can handle, marks the table, keeps every
//!   other header, and has nothing left to repair in its own output;
//! - retry copies and dead letters carry none of the broker's bookkeeping headers, every other
//!   header of the original, and the state or annotation written;
//! - a table nested at most `MAX_HEADER_DEPTH` levels (what the frame guard lets through)
//!   encodes as lapin sends it, parses back to the same bytes and the same `x-death`, and a
//!   frame with it passes the frame guard unchanged.
#![no_main]

use std::time::Duration;

use amq_protocol::frame::{parse_frame, AMQPFrame};
use arbitrary::Unstructured;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use libfuzzer_sys::fuzz_target;
use redeliver_amqp::headers::{
    self, dead_letter_headers, retry_copy_headers, sanitize_x_death, x_death, DeadLetterInfo,
    RetryState, DEAD_LETTER_ERROR_MAX_BYTES, LAST_ERROR_MAX_BYTES,
};
use redeliver_amqp::{fuzzing::guard_stream, headers_removed, HEADERS_REMOVED, MAX_HEADER_DEPTH};
use redeliver_fuzz::amqp::{self, depth, header_frame};

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(input) = Input::new(&mut u) else {
        return;
    };
    let t = &input.table;

    // Reading is stable under writing back.
    let state = RetryState::read(Some(t));
    let mut again = t.clone();
    state.write(&mut again);
    assert_eq!(RetryState::read(Some(&again)), state);
    if let Some(info) = DeadLetterInfo::read(Some(t)) {
        let mut again = t.clone();
        info.write(&mut again);
        assert_eq!(DeadLetterInfo::read(Some(&again)), Some(info));
    }
    let _ = headers_removed(Some(t));

    // Any state written reads back as written.
    let mut written = t.clone();
    input.state.write(&mut written);
    assert_eq!(
        RetryState::read(Some(&written)),
        expected_state(&input.state)
    );

    // x-death: one record per table entry; repair leaves nothing to repair.
    let deaths = x_death(Some(t));
    if let Some(AMQPValue::FieldArray(a)) = t.inner().get(headers::X_DEATH) {
        let tables = a
            .as_slice()
            .iter()
            .filter(|e| matches!(e, AMQPValue::FieldTable(_)))
            .count();
        assert_eq!(deaths.len(), tables);
    } else {
        assert!(deaths.is_empty());
    }
    if let Some(repaired) = sanitize_x_death(Some(t)) {
        assert!(repaired.contains_key(headers::SANITIZED));
        assert!(
            sanitize_x_death(Some(&repaired)).is_none(),
            "repair is not final"
        );
        if let Some(v) = repaired.inner().get(headers::X_DEATH) {
            let AMQPValue::FieldArray(a) = v else {
                panic!("x-death became {v:?}");
            };
            assert!(!a.as_slice().is_empty());
        }
        for (k, v) in t.inner() {
            if k.as_str() != headers::X_DEATH && k.as_str() != headers::SANITIZED {
                let now = repaired.inner().get(k);
                assert_eq!(
                    format!("{now:?}"),
                    format!("{:?}", Some(v)),
                    "{k:?} changed"
                );
            }
        }
    }

    // Retry copies and dead letters.
    let broker = |k: &str| {
        k == headers::X_DEATH
            || k == headers::X_DELIVERY_COUNT
            || k.starts_with(headers::X_FIRST_DEATH_PREFIX)
            || k.starts_with(headers::X_LAST_DEATH_PREFIX)
    };
    let copy = retry_copy_headers(Some(t), &input.state);
    assert_eq!(RetryState::read(Some(&copy)), expected_state(&input.state));
    for (k, v) in t.inner() {
        let k = k.as_str();
        if broker(k) {
            assert!(!copy.contains_key(k), "{k} kept on a retry copy");
        } else if !k.starts_with(headers::PREFIX) && !k.starts_with("x-opt-redeliver-") {
            // (`x-opt-redeliver-*`: a native retry's spelling of the retry state, replaced.)
            let now = copy.inner().get(k);
            assert_eq!(
                format!("{now:?}"),
                format!("{:?}", Some(v)),
                "{k:?} changed"
            );
        }
    }
    let dead = dead_letter_headers(Some(t), &input.info, input.expiration.as_deref());
    for k in dead.inner().keys() {
        assert!(
            !broker(k.as_str()) && k.as_str() != "x-acquired-count",
            "{k:?} on a dead letter"
        );
    }
    assert!(dead.contains_key(headers::FIRST_FAILED_AT));
    if !input.info.reason.is_empty() {
        assert_eq!(
            DeadLetterInfo::read(Some(&dead)),
            Some(expected_info(&input.info, t))
        );
    }

    // The wire: what lapin sends parses back the same, and the guard lets it through. Only for
    // what the guard lets through to lapin's parser: it recurses once per level, without a
    // limit (the reason for the guard), and a table of a few hundred levels overflows even
    // this thread's stack (a SIGSEGV of the whole fuzzer, found in the first long run).
    let deepest = t.inner().values().map(depth).max().unwrap_or(0);
    if deepest > MAX_HEADER_DEPTH {
        return;
    }
    let t = &amqp::wire_table(t);
    let deaths = x_death(Some(t));
    let properties = BasicProperties::default().with_headers(t.clone());
    let Some(frame) = header_frame(1, 0, &properties) else {
        return;
    };
    let Ok((rest, AMQPFrame::Header(_, h))) = parse_frame(&frame[..]) else {
        panic!("a header frame lapin encoded does not parse");
    };
    assert!(rest.is_empty());
    assert_eq!(
        header_frame(1, 0, &h.properties),
        Some(frame.clone()),
        "wire round trip"
    );
    assert_eq!(
        format!("{:?}", x_death(h.properties.headers().as_ref())),
        format!("{deaths:?}")
    );
    if !t.contains_key(HEADERS_REMOVED) {
        assert_eq!(
            guard_stream(&frame, 4096, 0),
            frame,
            "the guard changed a valid frame"
        );
    }
});

struct Input {
    table: FieldTable,
    state: RetryState,
    info: DeadLetterInfo,
    expiration: Option<String>,
}

impl Input {
    fn new(u: &mut Unstructured<'_>) -> arbitrary::Result<Self> {
        Ok(Self {
            table: amqp::table(u, amqp::MAX_DEPTH)?,
            state: RetryState {
                attempt: u.arbitrary()?,
                first_failed_at: opt_text(u)?,
                last_error: opt_text(u)?,
                original_exchange: opt_text(u)?,
                original_routing_key: opt_text(u)?,
                delay: u.arbitrary::<Option<Duration>>()?,
                not_before_ms: u.arbitrary()?,
            },
            info: DeadLetterInfo {
                reason: amqp::text(u)?,
                error: opt_text(u)?,
                attempts: u.arbitrary()?,
                at: opt_text(u)?,
                by: opt_text(u)?,
            },
            expiration: opt_text(u)?,
        })
    }
}

fn opt_text(u: &mut Unstructured<'_>) -> arbitrary::Result<Option<String>> {
    Ok(if u.arbitrary()? {
        Some(amqp::text(u)?)
    } else {
        None
    })
}

/// Truncated to `max` bytes on a char boundary.
fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// What `RetryState::read` documents it gives back for a state written with `write`.
fn expected_state(s: &RetryState) -> RetryState {
    RetryState {
        attempt: s.attempt,
        first_failed_at: s
            .first_failed_at
            .clone()
            .filter(|t| !t.is_empty() && t.len() <= 64),
        last_error: s
            .last_error
            .as_deref()
            .map(|e| cut(e, LAST_ERROR_MAX_BYTES)),
        original_exchange: s.original_exchange.clone().filter(|t| t.len() <= 255),
        original_routing_key: s.original_routing_key.clone().filter(|t| t.len() <= 255),
        delay: s
            .delay
            .map(|d| Duration::from_millis(d.as_millis().min(i64::MAX as u128) as u64)),
        not_before_ms: s.not_before_ms.map(|n| n.min(i64::MAX as u64)),
    }
}

/// What `DeadLetterInfo::read` gives back for `info` written over `original`'s headers: fields
/// the annotation leaves out keep what the original had.
fn expected_info(info: &DeadLetterInfo, original: &FieldTable) -> DeadLetterInfo {
    let mut with_reason = original.clone();
    with_reason.insert(
        headers::DEAD_LETTER_REASON.into(),
        AMQPValue::LongString("r".into()),
    );
    let before = DeadLetterInfo::read(Some(&with_reason)).unwrap_or_default();
    let nonempty = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
    DeadLetterInfo {
        reason: info.reason.clone(),
        error: match &info.error {
            Some(e) => nonempty(&Some(cut(e, DEAD_LETTER_ERROR_MAX_BYTES))),
            None => before.error,
        },
        attempts: match info.attempts {
            Some(n) => Some(n.min(i64::MAX as u64)),
            None => before.attempts,
        },
        at: match &info.at {
            Some(at) => nonempty(&Some(at.clone())).filter(|s| s.len() <= 64),
            None => before.at,
        },
        by: match &info.by {
            Some(b) => nonempty(&Some(b.clone())),
            None => before.by,
        },
    }
}
