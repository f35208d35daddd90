//! `outbox parked list|stats|peek|replay|purge`: the rows the outbox relay gave up on, read,
//! put back in the outbox or deleted through redeliver_postgres's [`ParkedRows`].
//!
//! The same contract as `dlq`: criteria combine with AND, a purge needs --yes (checked before
//! anything connects, exit code 2), --dry-run changes nothing, an --id or --message-id that
//! names no parked row fails the command after the rest was done, and everything a row holds
//! (written by any producer, or by hand) is escaped and bounded before it reaches a terminal.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redeliver_postgres::{ParkReason, ParkedFilter, ParkedRow, ParkedRows};
use serde::Serialize;
use serde_json::{json, Value};

use crate::cli::{ParkedCmd, ParkedFilterArgs, DRY_RUN_ROWS, PEEK_BODY_KIB, PEEK_VALUE_CHARS};
use crate::errors::UsageError;
use crate::message::{preview, truncate_chars, PREVIEW_CHARS};
use crate::outbox_db::{self as db, age_seconds, human_age, Db, Target};
use crate::output::{self, BodyView, Table};
use crate::text::{self, escape};

/// Runs one `outbox parked` command against the database of its options.
pub(crate) fn run(cmd: ParkedCmd, timeout: Duration) -> anyhow::Result<()> {
    let target = Target::of(cmd.db())?;
    if let ParkedCmd::Purge(a) = &cmd {
        // Refused before anything connects, as `dlq purge` is: deleted rows are gone for good.
        if !a.yes && !a.dry_run {
            let f = filter(&a.filter);
            let what = if f.is_empty() {
                format!(
                    "purging deletes every parked row of the outbox {} for good",
                    target.table()
                )
            } else {
                format!(
                    "purging deletes the parked rows of the outbox {} matching {} for good",
                    target.table(),
                    describe(&f)
                )
            };
            return Err(UsageError(format!(
                "{what}; nothing was changed. Add --yes to confirm (--dry-run shows what would \
                 be deleted)"
            ))
            .into());
        }
    }
    db::runtime()?.block_on(async {
        let db = db::connect(&target, timeout).await?;
        let result = dispatch(&db, cmd).await;
        db.close().await;
        result
    })
}

async fn dispatch(db: &Db, cmd: ParkedCmd) -> anyhow::Result<()> {
    match cmd {
        ParkedCmd::List(a) => list(db, &filter(&a.filter), a.limit, a.json).await,
        ParkedCmd::Stats(a) => stats(db, &filter(&a.filter), a.json).await,
        ParkedCmd::Peek(a) => peek(db, &filter(&a.filter), a.limit, a.json).await,
        ParkedCmd::Replay(a) => {
            act(db, Action::Replay, &filter(&a.filter), a.dry_run, a.json).await
        }
        ParkedCmd::Purge(a) => act(db, Action::Purge, &filter(&a.filter), a.dry_run, a.json).await,
    }
}

/// The library's filter of the command-line criteria.
fn filter(a: &ParkedFilterArgs) -> ParkedFilter {
    ParkedFilter {
        ids: a.ids.clone(),
        message_ids: a.message_ids.clone(),
        reason: a.reason.clone(),
        error_contains: a.error_contains.clone(),
        exchange: a.exchange.clone(),
        routing_key: a.routing_key.clone(),
        older_than: a.older_than,
    }
}

/// The criteria as command-line options, for reports ("matching --reason permanent"). Texts
/// that may be empty or hold spaces are quoted; callers escape the result for a terminal.
fn describe(f: &ParkedFilter) -> String {
    let mut parts = Vec::new();
    for id in &f.ids {
        parts.push(format!("--id {id}"));
    }
    for id in &f.message_ids {
        parts.push(format!("--message-id {id}"));
    }
    if let Some(r) = &f.reason {
        parts.push(format!("--reason {r}"));
    }
    if let Some(e) = &f.error_contains {
        parts.push(format!("--error-contains {e:?}"));
    }
    if let Some(x) = &f.exchange {
        parts.push(format!("--exchange {x:?}"));
    }
    if let Some(k) = &f.routing_key {
        parts.push(format!("--routing-key {k:?}"));
    }
    if let Some(d) = f.older_than {
        parts.push(format!("--older-than {}", humantime::format_duration(d)));
    }
    parts.join(" ")
}

/// " matching …", or nothing without criteria.
fn matching(f: &ParkedFilter) -> String {
    if f.is_empty() {
        String::new()
    } else {
        format!(" matching {}", escape(&describe(f)))
    }
}

/// A --reason no version of the relay parks rows for selects nothing: say so (on stderr, so
/// JSON output stays one document), since it is most likely a typo.
fn note_unknown_reason(f: &ParkedFilter) {
    if let Some(r) = &f.reason {
        if ParkReason::parse(r).is_none() {
            let known: Vec<&str> = ParkReason::ALL.iter().map(|r| r.as_str()).collect();
            eprintln!(
                "note: --reason '{}' is none of the reasons the relay parks rows for ({}): only \
                 rows parked by another version can match",
                escape(r),
                known.join(", ")
            );
        }
    }
}

fn parked(db: &Db) -> ParkedRows {
    ParkedRows::new(db.pool.clone(), db.schema.clone())
}

fn outbox_name(db: &Db) -> String {
    format!("{}.{}", db.schema.name(), db.schema.outbox_table())
}

fn read_error(db: &Db, e: redeliver_postgres::Error) -> anyhow::Error {
    db.error(
        e,
        &format!("read the parked rows of the outbox {}", outbox_name(db)),
    )
}

/// A time from the database as RFC 3339; one past year 9999 (a hand-edited row) as an expanded
/// year, without overflowing.
fn rfc3339(t: SystemTime) -> String {
    text::unix_time(t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()))
}

/// How long ago the row was parked, by this machine's clock (zero when its clock is behind the
/// database's).
fn parked_age(row: &ParkedRow, now: SystemTime) -> Duration {
    now.duration_since(row.parked_at).unwrap_or_default()
}

/// One row in `list --json` (and in the rows of a dry run); `peek --json` adds the rest.
#[derive(Debug, Serialize)]
struct RowJson<'a> {
    id: i64,
    message_id: &'a str,
    exchange: &'a str,
    routing_key: &'a str,
    reason: &'a str,
    attempts: u32,
    last_error: Option<&'a str>,
    created_at: String,
    parked_at: String,
    parked_age_seconds: Option<f64>,
    content_type: Option<&'a str>,
    /// Why the row cannot be read as a message; null when it can.
    unreadable: Option<&'a str>,
    body_bytes: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    body_preview: Option<String>,
}

impl<'a> RowJson<'a> {
    fn of(row: &'a ParkedRow, now: SystemTime, with_preview: bool) -> Self {
        Self {
            id: row.id,
            message_id: &row.message_id,
            exchange: &row.exchange,
            routing_key: &row.routing_key,
            reason: &row.reason,
            attempts: row.attempts,
            last_error: row.last_error.as_deref(),
            created_at: rfc3339(row.created_at),
            parked_at: rfc3339(row.parked_at),
            parked_age_seconds: age_seconds(Some(parked_age(row, now))),
            content_type: row.content_type.as_deref(),
            unreadable: row.headers.as_ref().err().map(String::as_str),
            body_bytes: row.body.len(),
            body_preview: with_preview.then(|| preview(&row.body, PREVIEW_CHARS)),
        }
    }
}

/// One row in full, for `peek --json`.
#[derive(Debug, Serialize)]
struct PeekJson<'a> {
    #[serde(flatten)]
    row: RowJson<'a>,
    /// The headers as read; null when the row is unreadable.
    headers: Option<&'a BTreeMap<String, String>>,
    /// The headers column as stored, when the row is unreadable (null otherwise).
    stored_headers: Option<&'a str>,
    body: Value,
}

fn exchange_shown(x: &str) -> &str {
    if x.is_empty() {
        "(default)"
    } else {
        x
    }
}

/// The table of `list` and of a dry run. [`Table`] escapes and cuts every cell.
fn rows_table(rows: &[ParkedRow], now: SystemTime) -> String {
    let mut t = Table::new(&[
        ("ID", 20),
        ("MESSAGE_ID", 36),
        ("EXCHANGE", 24),
        ("ROUTING_KEY", 32),
        ("REASON", 17),
        ("ATTEMPTS", 8),
        ("PARKED_FOR", 16),
        ("LAST_ERROR", 48),
    ]);
    for row in rows {
        t.row(vec![
            row.id.to_string(),
            row.message_id.clone(),
            exchange_shown(&row.exchange).to_owned(),
            row.routing_key.clone(),
            row.reason.clone(),
            row.attempts.to_string(),
            human_age(parked_age(row, now)),
            row.last_error.clone().unwrap_or_else(|| "-".to_owned()),
        ]);
    }
    t.render()
}

/// `list`: at most `limit` rows, lowest id first, after a line saying how many match.
async fn list(db: &Db, f: &ParkedFilter, limit: u32, json: bool) -> anyhow::Result<()> {
    note_unknown_reason(f);
    let parked = parked(db);
    let rows = parked.list(f, limit).await.map_err(|e| read_error(db, e))?;
    let now = SystemTime::now();
    if json {
        let rows: Vec<RowJson<'_>> = rows.iter().map(|r| RowJson::of(r, now, true)).collect();
        return output::print_json(&rows, "the listing");
    }
    let total = parked.stats(f).await.map_err(|e| read_error(db, e))?.count;
    let outbox = outbox_name(db);
    if rows.is_empty() {
        println!("outbox {outbox}: no parked row{}", matching(f));
        return Ok(());
    }
    println!(
        "outbox {outbox}: {total} parked row(s){}, showing {}, lowest id first",
        matching(f),
        rows.len()
    );
    print!("{}", rows_table(&rows, now));
    Ok(())
}

#[derive(Debug, Serialize)]
struct StatsJson {
    outbox: String,
    selection: Option<String>,
    parked: u64,
    by_reason: Vec<ReasonCount>,
    by_route: Vec<RouteCount>,
    oldest_age_seconds: Option<f64>,
}

#[derive(Debug, Serialize)]
struct ReasonCount {
    reason: String,
    count: u64,
}

#[derive(Debug, Serialize)]
struct RouteCount {
    exchange: String,
    routing_key: String,
    count: u64,
}

/// `stats`: counts by reason and by route, and the oldest's age.
async fn stats(db: &Db, f: &ParkedFilter, json: bool) -> anyhow::Result<()> {
    note_unknown_reason(f);
    let s = parked(db).stats(f).await.map_err(|e| read_error(db, e))?;
    let outbox = outbox_name(db);
    if json {
        return output::print_json(
            &StatsJson {
                outbox,
                selection: (!f.is_empty()).then(|| describe(f)),
                parked: s.count,
                by_reason: s
                    .by_reason
                    .into_iter()
                    .map(|(reason, count)| ReasonCount { reason, count })
                    .collect(),
                by_route: s
                    .by_route
                    .into_iter()
                    .map(|((exchange, routing_key), count)| RouteCount {
                        exchange,
                        routing_key,
                        count,
                    })
                    .collect(),
                oldest_age_seconds: age_seconds(s.oldest_age),
            },
            "the parked rows' stats",
        );
    }
    if s.count == 0 {
        println!("outbox {outbox}: no parked row{}", matching(f));
        return Ok(());
    }
    let oldest = s.oldest_age.map_or_else(String::new, |a| {
        format!(", the oldest parked {} ago", human_age(a))
    });
    println!(
        "outbox {outbox}: {} parked row(s){}{oldest}",
        s.count,
        matching(f)
    );
    let mut reasons = Table::new(&[("COUNT", 10), ("REASON", 40)]);
    for (reason, n) in &s.by_reason {
        reasons.row(vec![n.to_string(), reason.clone()]);
    }
    let mut routes = Table::new(&[("COUNT", 10), ("EXCHANGE", 60), ("ROUTING_KEY", 120)]);
    for ((exchange, key), n) in &s.by_route {
        routes.row(vec![
            n.to_string(),
            exchange_shown(exchange).to_owned(),
            key.clone(),
        ]);
    }
    print!("\n{}\n{}", reasons.render(), routes.render());
    Ok(())
}

/// `peek`: the matching rows in full.
async fn peek(db: &Db, f: &ParkedFilter, limit: u32, json: bool) -> anyhow::Result<()> {
    note_unknown_reason(f);
    let parked = parked(db);
    let rows = parked.list(f, limit).await.map_err(|e| read_error(db, e))?;
    let outbox = outbox_name(db);
    if rows.is_empty() {
        anyhow::bail!(
            "no parked row{} in the outbox {outbox}; list them with `redeliver outbox parked \
             list`",
            matching(f)
        );
    }
    let now = SystemTime::now();
    if json {
        let rows: Vec<PeekJson<'_>> = rows
            .iter()
            .map(|r| PeekJson {
                row: RowJson::of(r, now, false),
                headers: r.headers.as_ref().ok(),
                stored_headers: match &r.headers {
                    Ok(_) => None,
                    Err(_) => r.headers_json.as_deref(),
                },
                body: body_json(&r.body),
            })
            .collect();
        return output::print_json(&rows, "the parked rows");
    }
    let total = parked.stats(f).await.map_err(|e| read_error(db, e))?.count;
    println!(
        "outbox {outbox}: {total} parked row(s){}, showing {}, lowest id first",
        matching(f),
        rows.len()
    );
    for row in &rows {
        print!("\n{}", row_text(row, now));
    }
    Ok(())
}

/// The body for `peek --json`, exact, as `dlq peek --json` gives it.
fn body_json(body: &[u8]) -> Value {
    match output::body_view(body) {
        BodyView::Json(v) => json!({ "json": v }),
        BodyView::Text(s) => json!({ "text": s }),
        BodyView::Binary(b) => json!({ "bytes_hex": hex(&b) }),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A value on one line, escaped and cut after [`PEEK_VALUE_CHARS`] characters.
fn value_line(s: &str) -> String {
    truncate_chars(&escape(s), PEEK_VALUE_CHARS)
}

/// One row in full, for `peek`: every line escaped, every value bounded.
fn row_text(row: &ParkedRow, now: SystemTime) -> String {
    let mut out = format!("parked row {}\n", row.id);
    let mut field = |name: &str, value: String| {
        out.push_str(&format!("  {:<14}{value}\n", format!("{name}:")));
    };
    field("message id", value_line(&row.message_id));
    field(
        "exchange",
        value_line(if row.exchange.is_empty() {
            "(default exchange)"
        } else {
            &row.exchange
        }),
    );
    field("routing key", value_line(&row.routing_key));
    field("reason", value_line(&row.reason));
    field("attempts", row.attempts.to_string());
    field(
        "last error",
        row.last_error
            .as_deref()
            .map_or_else(|| "-".to_owned(), value_line),
    );
    field("stored at", rfc3339(row.created_at));
    field(
        "parked at",
        format!(
            "{} ({} ago)",
            rfc3339(row.parked_at),
            human_age(parked_age(row, now))
        ),
    );
    field(
        "content type",
        row.content_type
            .as_deref()
            .map_or_else(|| "-".to_owned(), value_line),
    );
    match &row.headers {
        Ok(headers) if headers.is_empty() => out.push_str("headers: (none)\n"),
        Ok(headers) => {
            out.push_str("headers:\n");
            for (k, v) in headers.iter().take(output::MAX_ITEMS) {
                out.push_str(&format!("  {}: {}\n", value_line(k), value_line(v)));
            }
            if headers.len() > output::MAX_ITEMS {
                out.push_str(&format!("  … {} more\n", headers.len() - output::MAX_ITEMS));
            }
        }
        Err(why) => {
            out.push_str(&format!("  {:<14}{}\n", "unreadable:", value_line(why)));
            match &row.headers_json {
                Some(stored) => {
                    out.push_str("headers (as stored, not a JSON object of strings):\n");
                    out.push_str(&format!("  {}\n", value_line(stored)));
                }
                None => out.push_str("headers: (none)\n"),
            }
        }
    }
    out.push_str(&body_text(&row.body));
    out
}

/// The body as `dlq peek` shows it (pretty JSON, escaped text, hex dump), cut after
/// [`PEEK_BODY_KIB`] KiB: its head is shown as text when it is UTF-8, as a hex dump otherwise.
fn body_text(body: &[u8]) -> String {
    let max = PEEK_BODY_KIB * 1024;
    let mut out = String::new();
    if body.len() <= max {
        match output::body_view(body) {
            BodyView::Json(v) => {
                out.push_str(&format!("body (JSON, {} bytes):\n", body.len()));
                let pretty = serde_json::to_string_pretty(&v).unwrap_or_default();
                out.push_str(&text::json_safe(&pretty));
                out.push('\n');
            }
            BodyView::Text(s) => {
                out.push_str(&format!("body (text, {} bytes):\n", body.len()));
                push_text(&mut out, &s);
            }
            BodyView::Binary(b) => {
                out.push_str(&format!("body (binary, {} bytes):\n", b.len()));
                out.push_str(&output::hexdump(&b));
            }
        }
        return out;
    }
    let head = &body[..max];
    let head_text = match std::str::from_utf8(head) {
        Ok(s) => Some(s),
        // Cut inside a character: what comes before the cut is text.
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&head[..e.valid_up_to()]).ok(),
        Err(_) => None,
    };
    let shown = match head_text {
        Some(s) => {
            out.push_str(&format!(
                "body (text, {} bytes, the first {} shown):\n",
                body.len(),
                s.len()
            ));
            push_text(&mut out, s);
            s.len()
        }
        None => {
            out.push_str(&format!(
                "body (binary, {} bytes, the first {max} shown):\n",
                body.len()
            ));
            out.push_str(&output::hexdump(head));
            max
        }
    };
    out.push_str(&format!(
        "… {} more bytes: `--json` shows the whole body\n",
        body.len() - shown
    ));
    out
}

fn push_text(out: &mut String, s: &str) {
    out.push_str(&text::escape_lines(s));
    if !s.ends_with('\n') {
        out.push('\n');
    }
}

/// What `replay` and `purge` do to the selected rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Replay,
    Purge,
}

impl Action {
    fn verb(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Purge => "purge",
        }
    }
}

/// What `replay --json` and `purge --json` print.
#[derive(Debug, Serialize)]
struct Report<'a> {
    outbox: String,
    dry_run: bool,
    /// The criteria as options; null without.
    selection: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    replayed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    purged: Option<u64>,
    /// Dry run: the rows that would be acted on (at most [`DRY_RUN_ROWS`]).
    rows: Vec<RowJson<'a>>,
    missing_ids: Vec<i64>,
    missing_message_ids: Vec<String>,
}

/// `replay` / `purge`: acts on every matching row in one statement (or, in a dry run, shows
/// them), then fails if an --id or --message-id named no parked row.
async fn act(
    db: &Db,
    action: Action,
    f: &ParkedFilter,
    dry_run: bool,
    json: bool,
) -> anyhow::Result<()> {
    note_unknown_reason(f);
    let parked = parked(db);
    let outbox = outbox_name(db);
    // Before acting: a purged row is gone, a replayed one no longer parked.
    let (missing_ids, missing_message_ids) =
        missing(&parked, f).await.map_err(|e| read_error(db, e))?;
    let now = SystemTime::now();
    let (count, rows) = if dry_run {
        let count = parked.stats(f).await.map_err(|e| read_error(db, e))?.count;
        let rows = parked
            .list(f, DRY_RUN_ROWS)
            .await
            .map_err(|e| read_error(db, e))?;
        (count, rows)
    } else {
        let done = match action {
            Action::Replay => parked.replay(f).await,
            Action::Purge => parked.purge(f).await,
        };
        let n = done.map_err(|e| {
            db.error(
                e,
                &format!("{} the parked rows of the outbox {outbox}", action.verb()),
            )
        })?;
        (n, Vec::new())
    };
    if json {
        output::print_json(
            &Report {
                outbox: outbox.clone(),
                dry_run,
                selection: (!f.is_empty()).then(|| describe(f)),
                replayed: (action == Action::Replay).then_some(count),
                purged: (action == Action::Purge).then_some(count),
                rows: rows.iter().map(|r| RowJson::of(r, now, true)).collect(),
                missing_ids: missing_ids.clone(),
                missing_message_ids: missing_message_ids.clone(),
            },
            "the report",
        )?;
    } else {
        print!(
            "{}",
            act_text(action, &outbox, f, dry_run, count, &rows, now)
        );
    }
    missing_error(&missing_ids, &missing_message_ids)
}

fn act_text(
    action: Action,
    outbox: &str,
    f: &ParkedFilter,
    dry_run: bool,
    count: u64,
    rows: &[ParkedRow],
    now: SystemTime,
) -> String {
    if count == 0 {
        return format!(
            "outbox {outbox}: no parked row{}, nothing to {}\n",
            matching(f),
            action.verb()
        );
    }
    let sel = matching(f);
    if !dry_run {
        return match action {
            Action::Replay => format!(
                "replayed {count} parked row(s) of the outbox {outbox}{sel}: they are pending \
                 again, and the relays were woken to publish them\n"
            ),
            Action::Purge => {
                format!("purged {count} parked row(s) of the outbox {outbox}{sel}\n")
            }
        };
    }
    let mut out = format!(
        "would {} {count} parked row(s) of the outbox {outbox}{sel} (dry run: nothing changed)\n",
        action.verb()
    );
    out.push_str(&rows_table(rows, now));
    let more = count.saturating_sub(rows.len() as u64);
    if more > 0 {
        out.push_str(&format!("… and {more} more\n"));
    }
    out
}

/// The requested ids and message ids that name no parked row at all (whether the other
/// criteria select it or not, as `dlq` counts a --message-id it met), each once, in the order
/// given.
async fn missing(
    parked: &ParkedRows,
    f: &ParkedFilter,
) -> Result<(Vec<i64>, Vec<String>), redeliver_postgres::Error> {
    let mut ids = Vec::new();
    for id in &f.ids {
        if ids.contains(id) {
            continue;
        }
        let only = ParkedFilter {
            ids: vec![*id],
            ..ParkedFilter::default()
        };
        if parked.stats(&only).await?.count == 0 {
            ids.push(*id);
        }
    }
    let mut message_ids: Vec<String> = Vec::new();
    for id in &f.message_ids {
        if message_ids.contains(id) {
            continue;
        }
        let only = ParkedFilter {
            message_ids: vec![id.clone()],
            ..ParkedFilter::default()
        };
        if parked.stats(&only).await?.count == 0 {
            message_ids.push(id.clone());
        }
    }
    Ok((ids, message_ids))
}

fn missing_error(ids: &[i64], message_ids: &[String]) -> anyhow::Result<()> {
    if ids.is_empty() && message_ids.is_empty() {
        return Ok(());
    }
    let named: Vec<String> = ids
        .iter()
        .map(|id| format!("id {id}"))
        .chain(message_ids.iter().map(|m| format!("message_id '{m}'")))
        .collect();
    anyhow::bail!("no parked row with {} was found", named.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selection_reads_like_the_command_line() {
        let f = ParkedFilter {
            ids: vec![3, 4],
            message_ids: vec!["m1".into()],
            reason: Some("permanent".into()),
            error_contains: Some("NOT_FOUND - no".into()),
            exchange: Some(String::new()),
            routing_key: Some("order.paid".into()),
            older_than: Some(Duration::from_secs(7 * 86_400)),
        };
        assert_eq!(
            describe(&f),
            "--id 3 --id 4 --message-id m1 --reason permanent --error-contains \"NOT_FOUND - \
             no\" --exchange \"\" --routing-key \"order.paid\" --older-than 7days"
        );
        assert_eq!(matching(&ParkedFilter::default()), "");
    }

    #[test]
    fn missing_ids_fail_naming_them() {
        assert!(missing_error(&[], &[]).is_ok());
        let err = missing_error(&[7], &["m\u{1b}".into()]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no parked row with id 7, message_id 'm\u{1b}' was found"
        );
    }

    #[test]
    fn long_bodies_are_cut_and_say_so() {
        let max = PEEK_BODY_KIB * 1024;
        let mut text = "é".repeat(max / 2 + 10).into_bytes();
        text.insert(0, b'a');
        let out = body_text(&text);
        assert!(out.starts_with(&format!("body (text, {} bytes, the first ", text.len())));
        assert!(
            out.ends_with("more bytes: `--json` shows the whole body\n"),
            "{out}"
        );
        let binary = vec![0xffu8; max + 1];
        let out = body_text(&binary);
        assert!(out.contains(&format!("the first {max} shown")));
        assert!(out.ends_with("… 1 more bytes: `--json` shows the whole body\n"));
        assert_eq!(
            body_text(b"{\"a\":1}"),
            "body (JSON, 7 bytes):\n{\n  \"a\": 1\n}\n"
        );
        assert_eq!(
            body_text(b"\x1b[2Jhi\r\n"),
            "body (text, 8 bytes):\n\\u{1b}[2Jhi\\r\\n\n"
        );
    }
}
