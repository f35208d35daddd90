//! Entry points for the fuzz targets in `fuzz/` (not a stable API): the CLI's message summary
//! and rendering, called as its commands call them. The modules they reach stay private.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::types::ShortString;
use lapin::BasicProperties;

use crate::message::{self, Msg};
use crate::{output, select, text};

/// Everything the CLI prints about one message, in every output mode.
#[derive(Debug)]
pub struct Rendered {
    /// `dlq list` (the DLQ's triage table).
    pub dlq_table: String,
    /// `unroutable list` (the parking queue's table).
    pub parked_table: String,
    /// `dlq stats`' group tables (by reason, by final error).
    pub group_tables: Vec<String>,
    /// `dlq peek`.
    pub peek_text: String,
    /// `dlq list --json` and `dlq peek --json`, as printed, and the same documents as
    /// serde_json wrote them before the CLI escaped them.
    pub json: Vec<(String, String)>,
    /// The one-line body preview of `list`.
    pub preview: String,
}

/// A delivery as the CLI receives it.
#[derive(Debug)]
pub struct Delivery {
    /// Exchange it was published to.
    pub exchange: ShortString,
    /// Its routing key.
    pub routing_key: ShortString,
    /// The redelivered flag.
    pub redelivered: bool,
    /// Its properties, headers included.
    pub properties: BasicProperties,
    /// Its body.
    pub body: Vec<u8>,
}

/// Renders `d` read at `position` of `queue` in every way the CLI does.
pub fn render(d: &Delivery, position: usize, queue: &str, levels: Option<u8>) -> Rendered {
    let msg = Msg {
        exchange: &d.exchange,
        routing_key: &d.routing_key,
        redelivered: d.redelivered,
        properties: &d.properties,
        data: &d.body,
    };
    let summary = message::summarize(position, msg, Some(queue), levels);
    let rows = std::slice::from_ref(&summary);
    let groups = [
        (summary.reason.clone(), 1),
        (summary.final_error.clone(), u64::MAX),
        (None, 0),
    ];
    let mut json = Vec::new();
    let doc = output::message_json(position, queue, msg);
    if let Ok(raw) = serde_json::to_string_pretty(&doc) {
        if let Ok(printed) = output::json_text(&doc, "message") {
            json.push((printed, raw));
        }
    }
    if let Ok(raw) = serde_json::to_string_pretty(&rows) {
        if let Ok(printed) = output::json_text(&rows, "messages") {
            json.push((printed, raw));
        }
    }
    Rendered {
        dlq_table: output::summary_table(rows, false),
        parked_table: output::summary_table(rows, true),
        group_tables: vec![
            output::group_table("REASON", &groups),
            output::group_table("FINAL_ERROR", &groups),
        ],
        peek_text: output::message_text(position, queue, msg),
        json,
        preview: summary.body_preview.clone(),
    }
}

/// Length of the body preview in `list`.
pub const PREVIEW_CHARS: usize = message::PREVIEW_CHARS;

/// Whether the CLI counts `c` as unsafe to print raw (control, bidi, invisible).
pub fn is_unsafe(c: char) -> bool {
    text::is_unsafe(c)
}

/// The CLI's RFC 3339 reader (`--older-than` compares the times it gives).
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    message::parse_rfc3339(s)
}

/// The CLI's writer of AMQP timestamps.
pub fn unix_time(secs: u64) -> String {
    text::unix_time(secs)
}

/// The last second RFC 3339 can write.
pub const RFC3339_MAX_SECS: u64 = text::RFC3339_MAX_SECS;

/// A `replay`/`purge` selection, as the options give it.
#[derive(Debug, Default)]
pub struct Selection {
    /// `--message-id`.
    pub message_ids: Vec<String>,
    /// `--reason`.
    pub reason: Option<String>,
    /// `--error-contains`.
    pub error_contains: Option<String>,
    /// `--older-than`.
    pub older_than: Option<Duration>,
}

/// Whether the selection takes `d`, at `now_secs`, and the selection described as the reports
/// describe it.
pub fn select(sel: &Selection, d: &Delivery, now_secs: u64) -> (bool, String) {
    let filter = select::Filter {
        message_ids: sel.message_ids.clone(),
        reason: sel.reason.clone(),
        error_contains: sel.error_contains.clone(),
        older_than: sel.older_than,
    };
    let msg = Msg {
        exchange: &d.exchange,
        routing_key: &d.routing_key,
        redelivered: d.redelivered,
        properties: &d.properties,
        data: &d.body,
    };
    let summary = message::summarize(1, msg, None, None);
    let now = UNIX_EPOCH
        .checked_add(Duration::from_secs(now_secs))
        .unwrap_or(UNIX_EPOCH);
    let _ = filter.missing_ids(&[]);
    (filter.matches(&summary, now), filter.describe())
}

/// The properties `replay` publishes the copy with.
pub fn replay_properties(p: &BasicProperties, reset_retry_state: bool) -> BasicProperties {
    message::replay_properties(p, reset_retry_state)
}
