//! Fuzz-style tests of the header codec on hostile header tables: it must never panic, and what it
//! reads must respect its documented bounds.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use proptest::prelude::*;
use redeliver_amqp::headers::{self, RetryState};
use redeliver_amqp::lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};
use std::time::Duration;

const KEYS: &[&str] = &[
    headers::ATTEMPT,
    headers::FIRST_FAILED_AT,
    headers::LAST_ERROR,
    headers::ORIGINAL_EXCHANGE,
    headers::ORIGINAL_ROUTING_KEY,
    headers::DELAY_MS,
    headers::DEAD_LETTER_REASON,
    "x-death",
    "x-first-death-queue",
    "x-last-death-reason",
    "x-delivery-count",
    "queue",
    "reason",
    "count",
    "exchange",
    "routing-keys",
    "time",
    "user",
];

fn key() -> impl Strategy<Value = ShortString> {
    prop_oneof![
        4 => proptest::sample::select(KEYS).prop_map(ShortString::from),
        1 => "[a-z\\-]{0,12}".prop_map(ShortString::from),
    ]
}

fn scalar() -> impl Strategy<Value = AMQPValue> {
    prop_oneof![
        any::<bool>().prop_map(AMQPValue::Boolean),
        any::<i8>().prop_map(AMQPValue::ShortShortInt),
        any::<u8>().prop_map(AMQPValue::ShortShortUInt),
        any::<i16>().prop_map(AMQPValue::ShortInt),
        any::<u16>().prop_map(AMQPValue::ShortUInt),
        any::<i32>().prop_map(AMQPValue::LongInt),
        any::<u32>().prop_map(AMQPValue::LongUInt),
        prop_oneof![
            Just(i64::MIN),
            Just(-1i64),
            Just(0),
            Just(i64::from(u32::MAX) + 1),
            Just(i64::MAX),
            any::<i64>()
        ]
        .prop_map(AMQPValue::LongLongInt),
        any::<f32>().prop_map(AMQPValue::Float),
        any::<f64>().prop_map(AMQPValue::Double),
        (any::<u8>(), any::<u32>())
            .prop_map(|(scale, value)| AMQPValue::DecimalValue(DecimalValue { scale, value })),
        ".{0,40}".prop_map(|s| AMQPValue::ShortString(ShortString::from(
            s.chars().take(60).collect::<String>()
        ))),
        proptest::collection::vec(any::<u8>(), 0..64)
            .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
        (0usize..3000, any::<char>())
            .prop_map(|(n, c)| AMQPValue::LongString(c.to_string().repeat(n).into())),
        any::<u64>().prop_map(AMQPValue::Timestamp),
        proptest::collection::vec(any::<u8>(), 0..16)
            .prop_map(|b| AMQPValue::ByteArray(ByteArray::from(b))),
        Just(AMQPValue::Void),
    ]
}

fn value() -> impl Strategy<Value = AMQPValue> {
    scalar().prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6)
                .prop_map(|v| AMQPValue::FieldArray(FieldArray::from(v))),
            proptest::collection::btree_map(key(), inner, 0..8)
                .prop_map(|m| AMQPValue::FieldTable(FieldTable::from(m))),
        ]
    })
}

fn table() -> impl Strategy<Value = FieldTable> {
    proptest::collection::btree_map(key(), value(), 0..12).prop_map(FieldTable::from)
}

/// An `x-death` array whose entries are tables of random (often wrong) field types.
fn x_death_table() -> impl Strategy<Value = FieldTable> {
    let entry = proptest::collection::btree_map(key(), value(), 0..8)
        .prop_map(|m| AMQPValue::FieldTable(FieldTable::from(m)));
    (
        proptest::collection::vec(prop_oneof![3 => entry, 1 => value()], 0..6),
        table(),
    )
        .prop_map(|(entries, mut t)| {
            t.insert("x-death".into(), AMQPValue::FieldArray(entries.into()));
            t
        })
}

fn state() -> impl Strategy<Value = RetryState> {
    (
        any::<u32>(),
        proptest::option::of("[0-9T:.Z-]{1,40}"),
        proptest::option::of(".{0,1100}"),
        proptest::option::of(".{0,80}"),
        proptest::option::of(".{0,80}"),
        proptest::option::of(0u64..(1 << 40)),
        proptest::option::of(0u64..(1 << 62)),
    )
        .prop_map(|(attempt, f, e, x, r, d, n)| RetryState {
            attempt,
            first_failed_at: f,
            last_error: e.map(|e| headers::truncate_error(&e)),
            original_exchange: x.filter(|s| s.len() <= 255),
            original_routing_key: r.filter(|s| s.len() <= 255),
            delay: d.map(Duration::from_millis),
            not_before_ms: n,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn read_never_panics_and_respects_bounds(t in table()) {
        let s = RetryState::read(Some(&t));
        prop_assert!(s.last_error.as_ref().is_none_or(|e| e.len() <= headers::LAST_ERROR_MAX_BYTES));
        prop_assert!(s.original_exchange.as_ref().is_none_or(|e| e.len() <= 255));
        prop_assert!(s.original_routing_key.as_ref().is_none_or(|e| e.len() <= 255));
        // A wrong type for the attempt is the default, never a guess.
        match t.inner().get(headers::ATTEMPT) {
            Some(AMQPValue::LongLongInt(n)) if (0..=i64::from(u32::MAX)).contains(n) => {
                prop_assert_eq!(i64::from(s.attempt), *n)
            }
            Some(AMQPValue::LongLongInt(_)) | Some(AMQPValue::LongString(_))
            | Some(AMQPValue::FieldArray(_)) | Some(AMQPValue::FieldTable(_)) | None => {
                prop_assert_eq!(s.attempt, 0)
            }
            _ => {}
        }
    }

    #[test]
    fn x_death_never_panics(t in x_death_table()) {
        let deaths = headers::x_death(Some(&t));
        let Some(AMQPValue::FieldArray(a)) = t.inner().get("x-death") else { unreachable!() };
        let tables = a.as_slice().iter().filter(|v| matches!(v, AMQPValue::FieldTable(_))).count();
        prop_assert_eq!(deaths.len(), tables);
    }

    #[test]
    fn x_death_of_arbitrary_tables(t in table()) {
        let _ = headers::x_death(Some(&t));
    }

    #[test]
    fn copy_headers_drop_broker_and_own_and_keep_the_rest(t in x_death_table(), s in state()) {
        let copy = headers::retry_copy_headers(Some(&t), &s);
        prop_assert_eq!(RetryState::read(Some(&copy)), s);
        prop_assert!(!copy.contains_key("x-death"));
        prop_assert!(!copy.contains_key("x-delivery-count"));
        for (k, v) in t.inner() {
            let k = k.as_str();
            let broker = k == "x-death" || k == "x-delivery-count"
                || k.starts_with("x-first-death-") || k.starts_with("x-last-death-");
            if broker {
                prop_assert!(!copy.contains_key(k), "{} kept", k);
            } else if k.starts_with(headers::PREFIX) {
                // Ours: replaced by `s` (checked by the round trip above), or dropped.
                prop_assert!(k != headers::DEAD_LETTER_REASON || !copy.contains_key(k));
            } else {
                prop_assert_eq!(copy.inner().get(k), Some(v));
            }
        }
    }

    #[test]
    fn write_then_read_round_trips_over_garbage(t in table(), s in state()) {
        let mut t = t;
        s.write(&mut t);
        prop_assert_eq!(RetryState::read(Some(&t)), s);
    }

    #[test]
    fn truncate_is_a_prefix_on_a_char_boundary(s in ".{0,1500}") {
        let t = headers::truncate_error(&s);
        prop_assert!(t.len() <= headers::LAST_ERROR_MAX_BYTES);
        prop_assert!(s.starts_with(&t));
        if s.len() <= headers::LAST_ERROR_MAX_BYTES { prop_assert_eq!(t, s); }
    }
}
