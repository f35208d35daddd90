//! Rendering: plain-text tables, full message dumps, AMQP values as JSON, progress bars.

use std::io::IsTerminal as _;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use serde_json::{json, Map, Value};

use crate::message::{truncate_chars, unix_to_rfc3339, Summary};

/// Replays of more than this many messages (about a screenful of output) get a progress bar.
pub(crate) const PROGRESS_THRESHOLD: u64 = 20;

/// A left-aligned text table; each column has a maximum width, longer cells are cut with "…".
pub(crate) struct Table {
    headers: Vec<&'static str>,
    max: Vec<usize>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// `columns`: (header, maximum width).
    pub(crate) fn new(columns: &[(&'static str, usize)]) -> Self {
        Self {
            headers: columns.iter().map(|c| c.0).collect(),
            max: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(crate) fn render(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                r.iter()
                    .zip(&self.max)
                    .map(|(c, m)| truncate_chars(c, *m))
                    .collect()
            })
            .collect();
        let mut width: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &rows {
            for (w, c) in width.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, (c, w)) in cells.iter().zip(&width).enumerate() {
                if i + 1 == cells.len() {
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    s.push_str(&" ".repeat(w - c.chars().count() + 2));
                }
            }
            s.trim_end().to_owned()
        };
        let mut out = line(
            &self
                .headers
                .iter()
                .map(|h| (*h).to_owned())
                .collect::<Vec<_>>(),
        );
        out.push('\n');
        for r in &rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }
}

fn or_dash(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "-".to_owned())
}

/// The `list` table. A DLQ shows the triage view (when and why each message died, its final
/// error); the parking queue (`parked`) shows the retry in progress and its DESTINATION.
pub(crate) fn summary_table(rows: &[Summary], parked: bool) -> String {
    if parked {
        parked_table(rows)
    } else {
        dlq_table(rows)
    }
}

fn dlq_table(rows: &[Summary]) -> String {
    let mut t = Table::new(&[
        ("#", 6),
        ("MESSAGE_ID", 36),
        ("DEAD_LETTERED_AT", 25),
        ("ATTEMPTS", 8),
        ("REASON", 18),
        ("COUNT", 6),
        ("ERROR", 40),
        ("BODY", 40),
    ]);
    for s in rows {
        t.row(vec![
            s.position.to_string(),
            or_dash(&s.message_id),
            or_dash(&s.dead_lettered_at),
            s.attempts.to_string(),
            or_dash(&s.reason),
            s.death_count
                .map_or_else(|| "-".to_owned(), |c| c.to_string()),
            s.final_error
                .as_deref()
                .map_or_else(|| "-".to_owned(), one_line),
            s.body_preview.clone(),
        ]);
    }
    t.render()
}

fn parked_table(rows: &[Summary]) -> String {
    let mut t = Table::new(&[
        ("#", 6),
        ("MESSAGE_ID", 36),
        ("FIRST_FAILED_AT", 25),
        ("ATTEMPTS", 8),
        ("REASON", 16),
        ("COUNT", 6),
        ("DESTINATION", 32),
        ("LAST_ERROR", 40),
        ("BODY", 40),
    ]);
    for s in rows {
        t.row(vec![
            s.position.to_string(),
            or_dash(&s.message_id),
            or_dash(&s.first_failed_at),
            s.attempts.to_string(),
            or_dash(&s.death_reason),
            s.death_count
                .map_or_else(|| "-".to_owned(), |c| c.to_string()),
            or_dash(&s.destination),
            s.last_error
                .as_deref()
                .map_or_else(|| "-".to_owned(), one_line),
            s.body_preview.clone(),
        ]);
    }
    t.render()
}

/// What a group without a value (no reason, no final error) is called in tables.
pub(crate) const NONE_LABEL: &str = "(none)";

/// A COUNT / `header` table of groups, most frequent first (the caller's order).
pub(crate) fn group_table(header: &'static str, groups: &[(Option<String>, u64)]) -> String {
    let mut t = Table::new(&[("COUNT", 10), (header, 120)]);
    for (key, n) in groups {
        t.row(vec![
            n.to_string(),
            key.as_deref()
                .map_or_else(|| NONE_LABEL.to_owned(), one_line),
        ]);
    }
    t.render()
}

/// Newlines and tabs in error messages would break table rows.
pub(crate) fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// AMQP field value -> JSON. Byte strings that are UTF-8 become strings; other bytes become
/// {"bytes_hex": "..."} so nothing is silently mangled.
pub(crate) fn value_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(n) => json!(n),
        AMQPValue::ShortShortUInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::ShortUInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::LongUInt(n) => json!(n),
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::Float(f) => json!(f),
        AMQPValue::Double(f) => json!(f),
        AMQPValue::DecimalValue(d) => json!(format!("{d:?}")),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => bytes_json(s.as_bytes()),
        AMQPValue::ByteArray(b) => bytes_json(b.as_slice()),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_json).collect()),
        AMQPValue::Timestamp(t) => json!(unix_to_rfc3339(*t)),
        AMQPValue::FieldTable(t) => table_json(t),
        AMQPValue::Void => Value::Null,
    }
}

fn bytes_json(b: &[u8]) -> Value {
    match std::str::from_utf8(b) {
        Ok(s) => json!(s),
        Err(_) => json!({ "bytes_hex": hex(b) }),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Header table -> JSON object (keys sorted, as AMQP tables are).
pub(crate) fn table_json(t: &FieldTable) -> Value {
    let mut m = Map::new();
    for (k, v) in t.inner() {
        m.insert(k.to_string(), value_json(v));
    }
    Value::Object(m)
}

/// Every property that is set, as (name, JSON value), in AMQP order; headers excluded.
pub(crate) fn properties_list(p: &BasicProperties) -> Vec<(&'static str, Value)> {
    let mut out = Vec::new();
    let mut s = |name: &'static str, v: &Option<lapin::types::ShortString>| {
        if let Some(v) = v {
            out.push((name, json!(v.as_str())));
        }
    };
    s("content_type", p.content_type());
    s("content_encoding", p.content_encoding());
    s("correlation_id", p.correlation_id());
    s("reply_to", p.reply_to());
    s("expiration", p.expiration());
    s("message_id", p.message_id());
    s("type", p.kind());
    s("user_id", p.user_id());
    s("app_id", p.app_id());
    s("cluster_id", p.cluster_id());
    if let Some(v) = p.delivery_mode() {
        out.push(("delivery_mode", json!(v)));
    }
    if let Some(v) = p.priority() {
        out.push(("priority", json!(v)));
    }
    if let Some(v) = p.timestamp() {
        out.push(("timestamp", json!(unix_to_rfc3339(*v))));
    }
    out
}

/// How a body is shown in full.
pub(crate) enum BodyView {
    Json(Value),
    Text(String),
    Binary(Vec<u8>),
}

pub(crate) fn body_view(body: &[u8]) -> BodyView {
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        BodyView::Json(v)
    } else if let Ok(s) = std::str::from_utf8(body) {
        BodyView::Text(s.to_owned())
    } else {
        BodyView::Binary(body.to_vec())
    }
}

/// One message in full, for `peek --json`.
pub(crate) fn message_json(position: usize, queue: &str, d: &Delivery) -> Value {
    let mut props = Map::new();
    for (k, v) in properties_list(&d.properties) {
        props.insert(k.to_owned(), v);
    }
    let body = match body_view(&d.data) {
        BodyView::Json(v) => json!({ "json": v }),
        BodyView::Text(s) => json!({ "text": s }),
        BodyView::Binary(b) => json!({ "bytes_hex": hex(&b) }),
    };
    json!({
        "queue": queue,
        "position": position,
        "exchange": d.exchange.as_str(),
        "routing_key": d.routing_key.as_str(),
        "redelivered": d.redelivered,
        "properties": props,
        "headers": d.properties.headers().as_ref().map_or(Value::Null, table_json),
        "body_bytes": d.data.len(),
        "body": body,
    })
}

/// One message in full, for `peek`.
pub(crate) fn message_text(position: usize, queue: &str, d: &Delivery) -> String {
    let mut out = format!("message at position {position} of '{queue}'\n");
    out.push_str(&format!(
        "  exchange:     {}\n",
        show_name(d.exchange.as_str())
    ));
    out.push_str(&format!("  routing key:  {}\n", d.routing_key.as_str()));
    out.push_str("properties:\n");
    for (k, v) in properties_list(&d.properties) {
        out.push_str(&format!("  {k}: {}\n", scalar_text(&v)));
    }
    out.push_str("headers:");
    match d.properties.headers() {
        Some(h) if !h.inner().is_empty() => {
            out.push('\n');
            yaml_like(&table_json(h), 1, &mut out);
        }
        _ => out.push_str(" (none)\n"),
    }
    match body_view(&d.data) {
        BodyView::Json(v) => {
            out.push_str(&format!("body (JSON, {} bytes):\n", d.data.len()));
            out.push_str(&serde_json::to_string_pretty(&v).unwrap_or_default());
            out.push('\n');
        }
        BodyView::Text(s) => {
            out.push_str(&format!("body (text, {} bytes):\n", d.data.len()));
            out.push_str(&s);
            if !s.ends_with('\n') {
                out.push('\n');
            }
        }
        BodyView::Binary(b) => {
            out.push_str(&format!("body (binary, {} bytes):\n", b.len()));
            out.push_str(&hexdump(&b));
        }
    }
    out
}

fn show_name(s: &str) -> &str {
    if s.is_empty() {
        "(default exchange)"
    } else {
        s
    }
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Indented key: value lines; arrays of tables (x-death) as "- " items.
fn yaml_like(v: &Value, depth: usize, out: &mut String) {
    let pad = "  ".repeat(depth);
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match v {
                    Value::Object(inner) if !inner.is_empty() => {
                        out.push_str(&format!("{pad}{k}:\n"));
                        yaml_like(v, depth + 1, out);
                    }
                    Value::Array(a) if !a.is_empty() => {
                        out.push_str(&format!("{pad}{k}:\n"));
                        yaml_like(v, depth + 1, out);
                    }
                    _ => out.push_str(&format!("{pad}{k}: {}\n", scalar_text(v))),
                }
            }
        }
        Value::Array(a) => {
            for item in a {
                match item {
                    Value::Object(m) if !m.is_empty() => {
                        // First key on the "- " line, the rest aligned under it.
                        let mut lines = String::new();
                        yaml_like(item, depth + 1, &mut lines);
                        let inner_pad = "  ".repeat(depth + 1);
                        for (i, l) in lines.lines().enumerate() {
                            let l = l.strip_prefix(&inner_pad).unwrap_or(l);
                            if i == 0 {
                                out.push_str(&format!("{pad}- {l}\n"));
                            } else {
                                out.push_str(&format!("{pad}  {l}\n"));
                            }
                        }
                    }
                    _ => out.push_str(&format!("{pad}- {}\n", scalar_text(item))),
                }
            }
        }
        other => out.push_str(&format!("{pad}{}\n", scalar_text(other))),
    }
}

/// Classic 16-bytes-a-line hex dump with an ASCII column.
pub(crate) fn hexdump(b: &[u8]) -> String {
    let mut out = String::new();
    for (i, chunk) in b.chunks(16).enumerate() {
        let hexes: Vec<String> = chunk.iter().map(|x| format!("{x:02x}")).collect();
        let ascii: String = chunk
            .iter()
            .map(|&x| {
                if x.is_ascii_graphic() || x == b' ' {
                    x as char
                } else {
                    '.'
                }
            })
            .collect();
        out.push_str(&format!(
            "{:08x}  {:<47}  {ascii}\n",
            i * 16,
            hexes.join(" ")
        ));
    }
    out
}

/// A progress bar on stderr for `total` items, hidden unless there are more than a screenful
/// and stdout is a terminal (scripts capturing the output get no control characters).
pub(crate) fn progress(total: u64, what: &str) -> ProgressBar {
    let visible = total > PROGRESS_THRESHOLD
        && std::io::stdout().is_terminal()
        && std::io::stderr().is_terminal();
    let target = if visible {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({eta})") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_owned());
    bar
}

/// A bar for `total` items that are slow one by one (probes waiting for their delay): shown on
/// a terminal whatever the count, with the elapsed time ticking, hidden otherwise.
pub(crate) fn waiting(total: u64, what: &str) -> ProgressBar {
    let target = if std::io::stdout().is_terminal() && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({elapsed})") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_owned());
    if !bar.is_hidden() {
        // Without ticks the elapsed time only moves when a probe arrives.
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
    }
    bar
}

/// Prints `value` as the single pretty JSON document of a `--json` run.
pub(crate) fn print_json(value: &impl serde::Serialize, what: &str) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let text = serde_json::to_string_pretty(value)
        .with_context(|| format!("cannot encode {what} as JSON"))?;
    println!("{text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_and_truncates() {
        let mut t = Table::new(&[("A", 3), ("B", 10)]);
        t.row(vec!["abcdef".into(), "x".into()]);
        t.row(vec!["a".into(), "yy".into()]);
        assert_eq!(t.render(), "A    B\nab…  x\na    yy\n");
    }

    #[test]
    fn x_death_renders_as_items() {
        let v = json!({"x-death": [{"count": 1, "queue": "q"}], "tenant": "acme"});
        let mut out = String::new();
        yaml_like(&v, 1, &mut out);
        assert_eq!(
            out,
            "  tenant: acme\n  x-death:\n    - count: 1\n      queue: q\n"
        );
    }

    #[test]
    fn groups_name_the_missing_value() {
        let t = group_table("REASON", &[(Some("rejected".into()), 3), (None, 1)]);
        assert_eq!(t, "COUNT  REASON\n3      rejected\n1      (none)\n");
    }

    #[test]
    fn hexdump_has_offsets() {
        assert_eq!(
            hexdump(b"AB\x00"),
            format!("00000000  {:<47}  AB.\n", "41 42 00")
        );
    }
}
