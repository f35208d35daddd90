//! Rendering: plain-text tables, full message dumps, AMQP values as JSON, progress bars.

use std::io::IsTerminal as _;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use serde_json::{json, Map, Value};

use crate::message::{truncate_chars, unix_to_rfc3339, Msg, Summary};
use crate::text::{self, escape};

/// Replays of more than this many messages (about a screenful of output) get a progress bar.
pub(crate) const PROGRESS_THRESHOLD: u64 = 20;

/// A left-aligned text table, laid out by comfy-table: columns two spaces apart, as wide as
/// their widest cell on screen (a CJK character takes two columns, a combining mark none), no
/// borders, no trailing spaces. Each column has a maximum length, longer cells are cut with "…".
/// Cells are escaped ([`text::escape`]) before they reach comfy-table: most of them come from
/// the broker, and a newline or an escape sequence in one would break the table or reach the
/// terminal.
pub(crate) struct Table {
    headers: Vec<&'static str>,
    max: Vec<usize>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// `columns`: (header, maximum length in characters).
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
        let mut table = comfy_table::Table::new();
        table.load_style(comfy_table::presets::NOTHING);
        table.set_header(self.headers.clone());
        for r in &self.rows {
            // Cut here rather than by comfy-table, which wraps at spaces first and so would
            // cut "payment service down" after "payment".
            let cells: Vec<String> = r
                .iter()
                .zip(&self.max)
                .map(|(c, m)| truncate_chars(&escape(c), *m))
                .collect();
            table.add_row(cells);
        }
        let last = self.headers.len().saturating_sub(1);
        for column in table.column_iter_mut() {
            let right = if column.index == last { 0 } else { 2 };
            column.set_padding((0, right));
        }
        let mut out = table.trim_fmt();
        out.push('\n');
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
            or_dash(&s.final_error),
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
            or_dash(&s.last_error),
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
            key.clone().unwrap_or_else(|| NONE_LABEL.to_owned()),
        ]);
    }
    t.render()
}

/// Nesting shown of a header value: x-death, the deepest header the broker writes, is 3 levels
/// (array, table, routing-keys array). Anything deeper is a publisher's doing, and a
/// frame-sized value can nest thousands of levels: rendering stops here instead of recursing
/// as deep as the value goes.
pub(crate) const MAX_DEPTH: usize = 32;
/// Items shown of one header array or table; the rest are counted.
pub(crate) const MAX_ITEMS: usize = 1000;

/// AMQP field value -> JSON. Byte strings that are UTF-8 become strings; other bytes become
/// {"bytes_hex": "..."} so nothing is silently mangled. Bounded: below [`MAX_DEPTH`] an array
/// shows as the string "[…]" and a table as "{…}"; past [`MAX_ITEMS`] items a container ends
/// with a "… N more" entry (`"…": N` in a table). `depth` is the nesting of `v` itself.
fn value_json_at(v: &AMQPValue, depth: usize) -> Value {
    match v {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(n) => json!(n),
        AMQPValue::ShortShortUInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::ShortUInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::LongUInt(n) => json!(n),
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::Float(f) => float_json(f64::from(*f)),
        AMQPValue::Double(f) => float_json(*f),
        AMQPValue::DecimalValue(d) => json!(format!("{d:?}")),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => bytes_json(s.as_bytes()),
        AMQPValue::ByteArray(b) => bytes_json(b.as_slice()),
        AMQPValue::FieldArray(_) if depth >= MAX_DEPTH => json!("[…]"),
        AMQPValue::FieldArray(a) => {
            let items = a.as_slice();
            let mut out: Vec<Value> = items
                .iter()
                .take(MAX_ITEMS)
                .map(|v| value_json_at(v, depth + 1))
                .collect();
            if items.len() > MAX_ITEMS {
                out.push(json!(format!("… {} more", items.len() - MAX_ITEMS)));
            }
            Value::Array(out)
        }
        AMQPValue::Timestamp(t) => json!(unix_to_rfc3339(*t)),
        AMQPValue::FieldTable(_) if depth >= MAX_DEPTH => json!("{…}"),
        AMQPValue::FieldTable(t) => table_json_at(t, depth),
        AMQPValue::Void => Value::Null,
    }
}

/// JSON has no NaN or infinity (serde_json would write null): they are shown as text.
fn float_json(f: f64) -> Value {
    if f.is_finite() {
        json!(f)
    } else {
        json!(f.to_string())
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
    table_json_at(t, 0)
}

fn table_json_at(t: &FieldTable, depth: usize) -> Value {
    let mut m = Map::new();
    for (k, v) in t.inner().iter().take(MAX_ITEMS) {
        m.insert(k.to_string(), value_json_at(v, depth + 1));
    }
    if t.inner().len() > MAX_ITEMS {
        m.insert("…".to_owned(), json!(t.inner().len() - MAX_ITEMS));
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
pub(crate) fn message_json(position: usize, queue: &str, d: Msg<'_>) -> Value {
    let mut props = Map::new();
    for (k, v) in properties_list(d.properties) {
        props.insert(k.to_owned(), v);
    }
    let body = match body_view(d.data) {
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
pub(crate) fn message_text(position: usize, queue: &str, d: Msg<'_>) -> String {
    let mut out = format!("message at position {position} of '{queue}'\n");
    out.push_str(&format!(
        "  exchange:     {}\n",
        escape(show_name(d.exchange.as_str()))
    ));
    out.push_str(&format!(
        "  routing key:  {}\n",
        escape(d.routing_key.as_str())
    ));
    out.push_str("properties:\n");
    for (k, v) in properties_list(d.properties) {
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
    match body_view(d.data) {
        BodyView::Json(v) => {
            out.push_str(&format!("body (JSON, {} bytes):\n", d.data.len()));
            let pretty = serde_json::to_string_pretty(&v).unwrap_or_default();
            out.push_str(&text::json_safe(&pretty));
            out.push('\n');
        }
        BodyView::Text(s) => {
            out.push_str(&format!("body (text, {} bytes):\n", d.data.len()));
            out.push_str(&text::escape_lines(&s));
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

/// A value on one line, escaped: strings as they are, anything else as compact JSON.
fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => escape(s).into_owned(),
        other => text::json_safe(&other.to_string()).into_owned(),
    }
}

/// Indented key: value lines; arrays of tables (x-death) as "- " items. `v` comes from
/// [`value_json_at`], whose depth is bounded, and so is this recursion.
fn yaml_like(v: &Value, depth: usize, out: &mut String) {
    let pad = "  ".repeat(depth);
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let k = escape(k);
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
    println!("{}", json_text(value, what)?);
    Ok(())
}

/// The text [`print_json`] prints: pretty JSON with no character a terminal would act on
/// ([`text::json_safe`]).
pub(crate) fn json_text(value: &impl serde::Serialize, what: &str) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let json = serde_json::to_string_pretty(value)
        .with_context(|| format!("cannot encode {what} as JSON"))?;
    Ok(text::json_safe(&json).into_owned())
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
    fn table_aligns_by_display_width() {
        let mut t = Table::new(&[("A", 3), ("B", 10)]);
        t.row(vec!["中文".into(), "x".into()]);
        t.row(vec!["e\u{301}".into(), "y".into()]);
        t.row(vec!["".into(), "".into()]);
        assert_eq!(t.render(), "A     B\n中文  x\ne\u{301}     y\n\n");
    }

    #[test]
    fn table_cells_are_escaped_before_layout() {
        let mut t = Table::new(&[("A", 20), ("B", 10)]);
        t.row(vec!["\u{1b}[2J\r\nx".into(), "\u{202e}y".into()]);
        assert_eq!(
            t.render(),
            "A               B\n\\u{1b}[2J\\r\\nx  \\u{202e}y\n"
        );
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

/// Every value a publisher can put in a message, through every renderer.
#[cfg(test)]
mod hostile {
    use super::*;
    use crate::message::{summarize, PREVIEW_CHARS};
    use crate::text::is_unsafe;
    use lapin::types::{ByteArray, DecimalValue, FieldArray, LongString, ShortString};
    use proptest::prelude::*;
    use redeliver_amqp::headers;

    /// Text output: nothing a terminal acts on but our own line breaks.
    fn assert_clean(what: &str, out: &str) {
        if let Some(c) = out.chars().find(|&c| is_unsafe(c) && c != '\n') {
            panic!("{what}: raw {c:?} in\n{out}");
        }
    }

    /// JSON output: nothing a terminal acts on, and valid JSON.
    fn assert_json(what: &str, value: &impl serde::Serialize) -> Value {
        let out = json_text(value, what).expect("encodes");
        assert_clean(what, &out);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{what}: not JSON ({e}):\n{out}"))
    }

    /// Renders `props`/`body` every way the CLI can: list (DLQ and parking tables, JSON),
    /// group tables, peek (text and JSON).
    fn render_all(routing_key: &str, props: &BasicProperties, body: &[u8]) {
        let exchange = ShortString::from("ex\u{1b}[2J");
        let rk = ShortString::from(routing_key.to_owned());
        let msg = Msg {
            exchange: &exchange,
            routing_key: &rk,
            redelivered: true,
            properties: props,
            data: body,
        };
        let dlq = summarize(1, msg, Some("home"), None);
        let parked = summarize(2, msg, None, Some(3));
        assert!(dlq.body_preview.chars().count() <= PREVIEW_CHARS + 1);
        let rows = [dlq.clone(), parked.clone()];
        assert_clean("dlq table", &summary_table(&rows, false));
        assert_clean("parked table", &summary_table(&rows, true));
        assert_json("list --json", &rows);
        let groups = [(dlq.reason.clone(), 1), (dlq.final_error.clone(), 2)];
        assert_clean("group table", &group_table("REASON", &groups));
        assert_clean("peek", &message_text(1, "q", msg));
        let peek = assert_json("peek --json", &message_json(1, "q", msg));
        assert_eq!(
            peek["routing_key"], routing_key,
            "JSON keeps the exact value"
        );
    }

    fn text(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s.as_bytes()))
    }

    /// `[[[ ... ]]]`, `depth` arrays deep, built without recursion.
    fn nested(depth: usize) -> AMQPValue {
        let mut v = AMQPValue::Void;
        for _ in 0..depth {
            v = AMQPValue::FieldArray(FieldArray::from(vec![v]));
        }
        v
    }

    #[test]
    fn the_poison_pill_of_issue_29_renders() {
        let mut entry = FieldTable::default();
        entry.insert("count".into(), AMQPValue::LongLongInt(-5));
        entry.insert("time".into(), AMQPValue::Timestamp(u64::MAX));
        entry.insert("reason".into(), text("\u{1b}]0;pwned\u{7}rejected\r"));
        entry.insert("queue".into(), text("home"));
        entry.insert("routing-keys".into(), AMQPValue::Boolean(true));
        let mut h = FieldTable::default();
        h.insert(
            headers::X_DEATH.into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::FieldTable(entry),
                AMQPValue::Float(f32::NAN),
                nested(3000),
            ])),
        );
        h.insert(headers::ATTEMPT.into(), text("seven"));
        h.insert(
            headers::DEAD_LETTER_REASON.into(),
            text("perm\u{202e}tnenam"),
        );
        h.insert(
            headers::DEAD_LETTER_ERROR.into(),
            text("line1\nline2\r\u{0}\u{9b}31m"),
        );
        h.insert(
            headers::DEAD_LETTERED_AT.into(),
            text("+99999-01-01T00:00:00Z"),
        );
        h.insert(
            headers::FIRST_FAILED_AT.into(),
            AMQPValue::Timestamp(u64::MAX),
        );
        h.insert(
            headers::LAST_ERROR.into(),
            AMQPValue::ByteArray(ByteArray::from(vec![0xff, 0x1b])),
        );
        h.insert(headers::X_DELIVERY_COUNT.into(), text("many"));
        h.insert("deep".into(), nested(3000));
        h.insert("inf".into(), AMQPValue::Double(f64::INFINITY));
        h.insert(
            "dec".into(),
            AMQPValue::DecimalValue(DecimalValue {
                scale: 255,
                value: u32::MAX,
            }),
        );
        h.insert("k\u{1b}[1m\r\n".into(), text("v\u{1b}[1m"));
        let wide: Vec<AMQPValue> = (0..5000).map(AMQPValue::LongLongInt).collect();
        h.insert("wide".into(), AMQPValue::FieldArray(FieldArray::from(wide)));
        let props = BasicProperties::default()
            .with_timestamp(u64::MAX)
            .with_message_id("id\u{1b}[31m\r".into())
            .with_correlation_id("\u{202e}".into())
            .with_content_type("text/plain\n".into())
            .with_headers(h);
        for body in [
            &b"\x1b[31mred\r\nfake line\0"[..],
            &[0xff, 0xfe, 0x1b, 0x00][..],
            "{\"a\":\"\u{9b}\u{202e}\"}".as_bytes(),
            b"",
        ] {
            render_all("rk\u{1b}[31m\r\u{202e}", &props, body);
        }
        let exchange = ShortString::from("");
        let rk = ShortString::from("rk");
        let msg = Msg {
            exchange: &exchange,
            routing_key: &rk,
            redelivered: false,
            properties: &props,
            data: b"",
        };
        let s = summarize(1, msg, Some("home"), None);
        assert_eq!(
            s.timestamp.as_deref(),
            Some("+584554051223-11-09T07:00:15Z")
        );
        assert_eq!(s.dead_lettered_time(), None, "beyond 9999: undated");
        let peek = message_text(1, "q", msg);
        assert!(peek.contains("[[[[[[[[[[[[[[["), "{peek}");
        assert!(peek.contains("[…]"), "depth-limited");
        assert!(peek.contains("… 4000 more"), "width-limited");
        assert!(peek.contains("id\\u{1b}[31m\\r"), "{peek}");
    }

    fn short(s: String) -> ShortString {
        // A short string holds at most 255 bytes: cut on a char boundary.
        let mut end = s.len().min(255);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        ShortString::from(s[..end].to_owned())
    }

    fn any_text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            proptest::collection::vec(any::<char>(), 0..40).prop_map(String::from_iter),
            Just("\u{1b}[31m\r\n\u{202e}\u{0}\u{9b}".to_owned()),
            Just("2024-05-01T12:00:00Z".to_owned()),
        ]
    }

    fn leaf() -> impl Strategy<Value = AMQPValue> {
        prop_oneof![
            any::<bool>().prop_map(AMQPValue::Boolean),
            any::<i8>().prop_map(AMQPValue::ShortShortInt),
            any::<u8>().prop_map(AMQPValue::ShortShortUInt),
            any::<i16>().prop_map(AMQPValue::ShortInt),
            any::<u16>().prop_map(AMQPValue::ShortUInt),
            any::<i32>().prop_map(AMQPValue::LongInt),
            any::<u32>().prop_map(AMQPValue::LongUInt),
            any::<i64>().prop_map(AMQPValue::LongLongInt),
            any::<f32>().prop_map(AMQPValue::Float),
            any::<f64>().prop_map(AMQPValue::Double),
            (any::<u8>(), any::<u32>())
                .prop_map(|(scale, value)| AMQPValue::DecimalValue(DecimalValue { scale, value })),
            any_text().prop_map(|s| AMQPValue::ShortString(short(s))),
            any_text().prop_map(|s| text(&s)),
            any::<Vec<u8>>().prop_map(|b| AMQPValue::LongString(LongString::from(b))),
            any::<Vec<u8>>().prop_map(|b| AMQPValue::ByteArray(ByteArray::from(b))),
            any::<u64>().prop_map(AMQPValue::Timestamp),
            Just(AMQPValue::Void),
        ]
    }

    fn key() -> impl Strategy<Value = ShortString> {
        prop_oneof![
            Just(headers::X_DEATH),
            Just(headers::ATTEMPT),
            Just(headers::FIRST_FAILED_AT),
            Just(headers::LAST_ERROR),
            Just(headers::DEAD_LETTER_REASON),
            Just(headers::DEAD_LETTER_ERROR),
            Just(headers::DEAD_LETTER_ATTEMPTS),
            Just(headers::DEAD_LETTERED_AT),
            Just(headers::DEAD_LETTERED_BY),
            Just(headers::X_DELIVERY_COUNT),
            Just("count"),
            Just("time"),
            Just("reason"),
            Just("queue"),
            Just("routing-keys"),
        ]
        .prop_map(ShortString::from)
        .boxed()
        .prop_union(any_text().prop_map(short).boxed())
    }

    fn value() -> impl Strategy<Value = AMQPValue> {
        leaf().prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6)
                    .prop_map(|v| AMQPValue::FieldArray(FieldArray::from(v))),
                proptest::collection::btree_map(key(), inner, 0..6)
                    .prop_map(|m| AMQPValue::FieldTable(FieldTable::from(m))),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_message_renders(
            headers in proptest::collection::btree_map(key(), value(), 0..8),
            timestamp in prop_oneof![
                any::<u64>(),
                Just(u64::MAX),
                Just(0u64),
                Just(253_402_300_800u64),
            ],
            id in any_text(),
            routing_key in any_text(),
            body in prop_oneof![
                any::<Vec<u8>>(),
                any_text().prop_map(String::into_bytes),
            ],
        ) {
            let props = BasicProperties::default()
                .with_timestamp(timestamp)
                .with_message_id(short(id))
                .with_headers(FieldTable::from(headers));
            render_all(short(routing_key).as_str(), &props, &body);
        }
    }
}
