//! The CLI's message summary and rendering (`redeliver_cli::fuzzing`, over
//! `crates/cli/src/{message,output,text,select}.rs`):
//! `dlq list`, `stats`, `peek` in text and JSON, the `replay`/`purge` selection, and the
//! properties of a replayed copy, for a delivery whose every part the publisher chose:
//! exchange, routing key, every property, headers of any type nested up to 40 levels and up
//! to 200 through a chain, any body.
//!
//! Checked, beyond "no panic":
//! - no text output holds a control character (other than its own line breaks) or any other
//!   character the CLI counts as unsafe for a terminal (bidi, invisible);
//! - every JSON document is valid JSON, holds no such character raw either, and means exactly
//!   what serde_json wrote before the CLI escaped it;
//! - the body preview stays within its width;
//! - timestamps: any u64 is written, and read back exactly up to the end of year 9999;
//! - a replayed copy carries none of the broker's dead-lettering headers, and (with
//!   `--reset-retry-state`) none of redeliver's.
#![no_main]

use std::time::{Duration, UNIX_EPOCH};

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use redeliver_cli::fuzzing::{self as cli, Delivery, Selection};
use redeliver_fuzz::amqp;

fn check_text(what: &str, s: &str) {
    if let Some(c) = s
        .chars()
        .find(|&c| c != '\n' && (c.is_control() || cli::is_unsafe(c)))
    {
        panic!("{what} holds {c:?} raw:\n{s}");
    }
}

fn delivery(u: &mut Unstructured<'_>) -> arbitrary::Result<Delivery> {
    Ok(Delivery {
        exchange: amqp::short_string(u)?,
        routing_key: if u.ratio(1, 4)? {
            // A parking queue's routing key: bit words, then the destination.
            let bits: u32 = u.arbitrary()?;
            let words: Vec<String> = (0..u.int_in_range(0..=24)?)
                .map(|i| ((bits >> i) & 1).to_string())
                .collect();
            amqp::short(format!("{}.{}", words.join("."), amqp::text(u)?))
        } else {
            amqp::short_string(u)?
        },
        redelivered: u.arbitrary()?,
        properties: amqp::properties(u)?,
        body: match u.int_in_range(0u8..=3)? {
            0 => amqp::text(u)?.into_bytes(),
            1 => {
                // JSON, so that the JSON paths are taken often.
                let v = amqp::value(u, 6)?;
                serde_json::to_vec(&format!("{v:?}")).unwrap_or_default()
            }
            _ => u.arbitrary()?,
        },
    })
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(d) = delivery(&mut u) else {
        return;
    };
    let queue: String = u.arbitrary().unwrap_or_default();
    let levels: Option<u8> = u.arbitrary().unwrap_or_default();
    let position: usize = u.arbitrary().unwrap_or_default();

    let r = cli::render(&d, position, &queue, levels);
    check_text("dlq list", &r.dlq_table);
    check_text("unroutable list", &r.parked_table);
    for t in &r.group_tables {
        check_text("dlq stats", t);
    }
    // The queue name is the operator's own text, quoted as given; everything else is escaped.
    if !queue.chars().any(|c| c.is_control() || cli::is_unsafe(c)) {
        check_text("dlq peek", &r.peek_text);
    }
    for (printed, raw) in &r.json {
        check_text("JSON output", printed);
        let shown: serde_json::Value = serde_json::from_str(printed)
            .unwrap_or_else(|e| panic!("invalid JSON ({e}):\n{printed}"));
        let meant: serde_json::Value = serde_json::from_str(raw).expect("serde_json's own output");
        assert_eq!(shown, meant, "escaping changed the document");
    }
    check_text("the body preview", &r.preview);
    assert!(
        r.preview.chars().count() <= cli::PREVIEW_CHARS || r.preview.starts_with('<'),
        "preview of {} chars: {}",
        r.preview.chars().count(),
        r.preview
    );

    // Times: written for any value, read back exactly up to the year 9999, never beyond.
    let secs: u64 = u.arbitrary().unwrap_or_default();
    let written = cli::unix_time(secs);
    check_text("a time", &written);
    let read = cli::parse_rfc3339(&written);
    if secs <= cli::RFC3339_MAX_SECS {
        assert_eq!(
            read,
            Some(UNIX_EPOCH + Duration::from_secs(secs)),
            "{written}"
        );
    } else {
        assert_eq!(read, None, "{written}");
    }
    let text = amqp::text(&mut u).unwrap_or_default();
    let _ = cli::parse_rfc3339(&text);

    // The selection of replay and purge.
    let sel = Selection {
        message_ids: u.arbitrary().unwrap_or_default(),
        reason: u.arbitrary().unwrap_or_default(),
        error_contains: u.arbitrary().unwrap_or_default(),
        older_than: u.arbitrary().unwrap_or_default(),
    };
    let (_, _) = cli::select(&sel, &d, u.arbitrary().unwrap_or_default());

    // Replay: the copy leaves the broker's bookkeeping behind.
    let reset: bool = u.arbitrary().unwrap_or_default();
    let copy = cli::replay_properties(&d.properties, reset);
    if let Some(h) = copy.headers() {
        for k in h.inner().keys() {
            let k = k.as_str();
            assert!(
                k != "x-death"
                    && k != "x-delivery-count"
                    && !k.starts_with("x-first-death-")
                    && !k.starts_with("x-last-death-"),
                "{k} kept on a replayed copy"
            );
            assert!(
                !(reset && k.starts_with("x-redeliver-")),
                "{k} kept with reset"
            );
        }
    }
    assert!(copy.user_id().is_none(), "user_id kept on a replayed copy");
});
