//! `redeliver outbox parked list|stats|peek|replay|purge` against a real PostgreSQL: parked
//! rows written with SQL (as the relay parks them) in a schema of their own, dropped at the
//! end. No broker is involved: `AMQP_URL` is set to garbage to prove it is not read.
//!
//! PostgreSQL comes from `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`);
//! without it the tests fail, saying what to start (`bash scripts/postgres.sh up`).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![cfg(feature = "postgres")]

use std::process::Command;

use redeliver_postgres::Schema;
use redeliver_testkit::postgres::database_url;
use redeliver_testkit::process::Output;
use serde_json::Value;
use sqlx::{PgPool, Row};

/// Runs `redeliver outbox parked ARGS --schema S` with DATABASE_URL set to the test database.
fn parked(schema: &str, args: &[&str]) -> Output {
    let mut all = vec!["outbox", "parked"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--schema", schema]);
    cli(&all, &[("DATABASE_URL", &database_url())])
}

/// Runs `redeliver ARGS` with exactly these variables of its own.
fn cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redeliver"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDELIVER_PG_SCHEMA")
        .env("AMQP_URL", "not a broker URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Output::of(&mut cmd)
}

fn json(out: &Output) -> Value {
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {out:?}"))
}

/// The ids of a JSON array of rows (`list --json`, `peek --json`, a dry run's rows).
fn ids(rows: &Value) -> Vec<i64> {
    rows.as_array()
        .unwrap_or_else(|| panic!("not an array: {rows}"))
        .iter()
        .map(|r| r["id"].as_i64().expect("an id"))
        .collect()
}

fn list_ids(schema: &str, args: &[&str]) -> Vec<i64> {
    let mut all = vec!["list", "--json"];
    all.extend_from_slice(args);
    let out = parked(schema, &all);
    assert_eq!(out.code, 0, "{args:?}: {out:?}");
    ids(&json(&out))
}

/// What a terminal acts on, as the CLI counts it (its `text::is_unsafe`): every control
/// character, bidi controls, zero-width characters, separators, the BOM, tag characters.
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00AD}'
                | '\u{061C}'
                | '\u{180E}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{206F}'
                | '\u{FEFF}'
                | '\u{FFF9}'..='\u{FFFB}'
                | '\u{E0000}'..='\u{E007F}'
        )
}

fn assert_clean(what: &str, text: &str) {
    if let Some(c) = text.chars().find(|&c| is_unsafe(c) && c != '\n') {
        panic!("{what}: raw {c:?} in\n{text}");
    }
}

/// A migrated schema of its own, dropped with everything in it when this is dropped.
struct TestSchema {
    pool: PgPool,
    name: String,
}

impl TestSchema {
    /// A schema with nothing in it (not migrated).
    async fn empty() -> Self {
        let pool = redeliver_testkit::postgres::pool(2).await;
        let name = format!("rdpk_{}", redeliver_testkit::unique_id(12));
        Self { pool, name }
    }

    async fn new() -> Self {
        let db = Self::empty().await;
        Schema::named(&db.name)
            .expect("schema name")
            .migrate(&db.pool)
            .await
            .expect("migrate");
        db
    }

    fn table(&self) -> String {
        format!("\"{}\".outbox", self.name)
    }

    /// Inserts a row as the relay leaves it, parked `parked_secs_ago` ago (`None`: not
    /// parked, waiting for its next attempt); returns its id.
    async fn insert(&self, row: NewRow<'_>) -> i64 {
        sqlx::query(&format!(
            "INSERT INTO {} (message_id, exchange, routing_key, body, content_type, headers,
                             attempts, last_error, parked_at, parked_reason)
             VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8,
                     CASE WHEN $9::float8 IS NULL THEN NULL
                          ELSE now() - make_interval(secs => $9::float8) END,
                     $10)
             RETURNING id",
            self.table()
        ))
        .bind(row.message_id)
        .bind(row.exchange)
        .bind(row.routing_key)
        .bind(row.body)
        .bind(row.content_type)
        .bind(row.headers)
        .bind(row.attempts)
        .bind(row.last_error)
        .bind(row.parked_secs_ago)
        .bind(row.reason)
        .fetch_one(&self.pool)
        .await
        .expect("insert a row")
        .get(0)
    }

    /// (id, parked, attempts, reason) of every row, by id.
    async fn rows(&self) -> Vec<(i64, bool, i32, Option<String>)> {
        sqlx::query(&format!(
            "SELECT id, parked_at IS NOT NULL, attempts, parked_reason FROM {} ORDER BY id",
            self.table()
        ))
        .fetch_all(&self.pool)
        .await
        .expect("read the rows")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
    }

    async fn parked_ids(&self) -> Vec<i64> {
        self.rows()
            .await
            .into_iter()
            .filter(|r| r.1)
            .map(|r| r.0)
            .collect()
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        redeliver_testkit::postgres::drop_schema(&self.name);
    }
}

/// One outbox row to insert.
#[derive(Clone)]
struct NewRow<'a> {
    message_id: &'a str,
    exchange: &'a str,
    routing_key: &'a str,
    body: Vec<u8>,
    content_type: Option<&'a str>,
    headers: Option<&'a str>,
    attempts: i32,
    last_error: Option<&'a str>,
    parked_secs_ago: Option<f64>,
    reason: Option<&'a str>,
}

impl<'a> NewRow<'a> {
    fn parked(message_id: &'a str, reason: &'a str, secs_ago: f64) -> Self {
        Self {
            message_id,
            exchange: "orders",
            routing_key: "order.paid",
            body: b"{\"order\":7}".to_vec(),
            content_type: Some("application/json"),
            headers: Some(r#"{"tenant":"acme"}"#),
            attempts: 5,
            last_error: Some("NOT_FOUND - no exchange 'orders' in vhost '/'"),
            parked_secs_ago: Some(secs_ago),
            reason: Some(reason),
        }
    }

    fn pending(message_id: &'a str) -> Self {
        Self {
            parked_secs_ago: None,
            reason: None,
            attempts: 2,
            ..Self::parked(message_id, "", 0.0)
        }
    }
}

/// The fixture most tests share: four parked rows and one retrying row (never selected).
struct Fixture {
    db: TestSchema,
    /// retries_exhausted, orders/order.paid, 2 h.
    a: i64,
    /// permanent, default exchange/images, 10 min, no headers, text body.
    b: i64,
    /// retries_exhausted, orders/order.new, 30 s, an error with `%`.
    c: i64,
    /// unreadable, orders/order.paid, 3 days.
    d: i64,
    /// retrying, not parked.
    pending: i64,
}

async fn fixture() -> Fixture {
    let db = TestSchema::new().await;
    let a = db
        .insert(NewRow::parked("m-a", "retries_exhausted", 7200.0))
        .await;
    let b = db
        .insert(NewRow {
            exchange: "",
            routing_key: "images",
            body: b"resize 1.jpg\nplease".to_vec(),
            content_type: Some("text/plain"),
            headers: None,
            attempts: 0,
            last_error: Some(
                "the message has 500000 bytes, more than the broker takes (max_message_size 131072)",
            ),
            ..NewRow::parked("m-b", "permanent", 600.0)
        })
        .await;
    let c = db
        .insert(NewRow {
            routing_key: "order.new",
            last_error: Some("nacked: 100% of the queue is full"),
            ..NewRow::parked("m-c", "retries_exhausted", 30.0)
        })
        .await;
    let d = db
        .insert(NewRow {
            headers: Some(r#"{"tenant": 1}"#),
            attempts: 0,
            last_error: Some("outbox row: headers are not a JSON object of strings"),
            ..NewRow::parked("m-d", "unreadable", 3.0 * 86_400.0)
        })
        .await;
    let pending = db.insert(NewRow::pending("m-pending")).await;
    Fixture {
        db,
        a,
        b,
        c,
        d,
        pending,
    }
}

#[tokio::test]
async fn list_and_stats_show_the_parked_rows_only() {
    let f = fixture().await;
    let s = f.db.name.as_str();

    let out = parked(s, &["list"]);
    assert_eq!(out.code, 0, "{out:?}");
    let mut lines = out.stdout.lines();
    assert_eq!(
        lines.next(),
        Some(format!("outbox {s}.outbox: 4 parked row(s), showing 4, lowest id first").as_str())
    );
    let header = lines.next().expect("a header");
    for column in [
        "ID",
        "MESSAGE_ID",
        "EXCHANGE",
        "ROUTING_KEY",
        "REASON",
        "ATTEMPTS",
        "PARKED_FOR",
        "LAST_ERROR",
    ] {
        assert!(header.contains(column), "{header}");
    }
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), 4, "{out:?}");
    assert!(rows[0].starts_with(&format!("{}  ", f.a)), "{rows:?}");
    assert!(rows[0].contains("retries_exhausted") && rows[0].contains("2h"));
    assert!(rows[1].contains("(default)") && rows[1].contains("permanent"));
    assert!(rows[1].contains("10m"), "{rows:?}");
    // The last error is cut short in the table.
    assert!(rows[0].contains("NOT_FOUND - no exchange"), "{rows:?}");
    assert!(rows[1].contains('…'), "{rows:?}");
    assert!(!out.stdout.contains("m-pending"), "{out:?}");

    let out = parked(s, &["list", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(ids(&v), vec![f.a, f.b, f.c, f.d]);
    let a = &v[0];
    assert_eq!(a["message_id"], "m-a");
    assert_eq!(a["exchange"], "orders");
    assert_eq!(a["routing_key"], "order.paid");
    assert_eq!(a["reason"], "retries_exhausted");
    assert_eq!(a["attempts"], 5);
    assert_eq!(
        a["last_error"],
        "NOT_FOUND - no exchange 'orders' in vhost '/'"
    );
    assert_eq!(a["content_type"], "application/json");
    assert!(a["unreadable"].is_null(), "{a}");
    assert_eq!(a["body_bytes"], 11);
    assert_eq!(a["body_preview"], "{\"order\":7}");
    let age = a["parked_age_seconds"].as_f64().expect("an age");
    assert!((7100.0..7400.0).contains(&age), "{age}");
    for key in ["created_at", "parked_at"] {
        let t = a[key].as_str().expect("a time");
        assert!(humantime::parse_rfc3339(t).is_ok(), "{key}: {t}");
    }
    assert_eq!(v[1]["exchange"], "");
    assert!(v[3]["unreadable"]
        .as_str()
        .is_some_and(|e| e.contains("not a JSON object of strings")));

    // --limit: the lowest ids, the first line still counts them all.
    assert_eq!(list_ids(s, &["--limit", "2"]), vec![f.a, f.b]);
    let out = parked(s, &["list", "--limit", "1"]);
    assert!(
        out.stdout
            .starts_with(&format!("outbox {s}.outbox: 4 parked row(s), showing 1,")),
        "{out:?}"
    );

    let out = parked(s, &["stats", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(v["outbox"], format!("{s}.outbox"));
    assert!(v["selection"].is_null(), "{v}");
    assert_eq!(v["parked"], 4);
    assert_eq!(
        v["by_reason"],
        serde_json::json!([
            {"reason": "retries_exhausted", "count": 2},
            {"reason": "permanent", "count": 1},
            {"reason": "unreadable", "count": 1},
        ])
    );
    assert_eq!(
        v["by_route"],
        serde_json::json!([
            {"exchange": "orders", "routing_key": "order.paid", "count": 2},
            {"exchange": "", "routing_key": "images", "count": 1},
            {"exchange": "orders", "routing_key": "order.new", "count": 1},
        ])
    );
    let oldest = v["oldest_age_seconds"].as_f64().expect("an age");
    assert!((259_000.0..260_000.0).contains(&oldest), "{oldest}");

    let out = parked(s, &["stats"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout.starts_with(&format!(
            "outbox {s}.outbox: 4 parked row(s), the oldest parked 3days "
        )),
        "{out:?}"
    );
    assert!(out
        .stdout
        .contains("\nCOUNT  REASON\n2      retries_exhausted\n"));
    assert!(out.stdout.contains("COUNT  EXCHANGE"), "{out:?}");
    assert!(out.stdout.contains("(default)"), "{out:?}");

    let out = parked(s, &["stats", "--reason", "permanent", "--json"]);
    let v = json(&out);
    assert_eq!(v["selection"], "--reason permanent");
    assert_eq!(v["parked"], 1);

    // Nothing matches: said, not an error.
    let out = parked(s, &["list", "--routing-key", "nothing.here"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.stdout,
        format!("outbox {s}.outbox: no parked row matching --routing-key \"nothing.here\"\n")
    );
    let out = parked(s, &["stats", "--routing-key", "nothing.here", "--json"]);
    let v = json(&out);
    assert_eq!(v["parked"], 0);
    assert!(v["oldest_age_seconds"].is_null(), "{v}");
}

#[tokio::test]
async fn status_shows_the_retrying_and_parked_rows() {
    let f = fixture().await;
    let s = f.db.name.as_str();
    let url = database_url();
    let env = [("DATABASE_URL", url.as_str())];
    let out = cli(&["outbox", "status", "--schema", s, "--json"], &env);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(v["pending"], 1);
    assert_eq!(v["retrying"], 1);
    assert_eq!(v["parked"], 4);
    let age = v["oldest_parked_age_seconds"].as_f64().expect("an age");
    assert!((259_000.0..260_000.0).contains(&age), "{age}");

    let out = cli(&["outbox", "status", "--schema", s], &env);
    assert_eq!(out.code, 0, "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{out:?}");
    assert!(
        lines[0].starts_with(&format!("outbox {s}.outbox: 1 pending, the oldest for ")),
        "{out:?}"
    );
    assert!(
        lines[0].ends_with(" (1 of them retrying after the broker refused them)"),
        "{out:?}"
    );
    assert!(
        lines[1].starts_with(&format!(
            "outbox {s}.outbox: 4 parked (the relay gave up on them), the oldest for 3days"
        )),
        "{out:?}"
    );
}

#[tokio::test]
async fn each_criterion_selects_and_they_combine_with_and() {
    let f = fixture().await;
    let s = f.db.name.as_str();
    let (a, b, c, d) = (f.a, f.b, f.c, f.d);
    let (a_id, c_id) = (a.to_string(), c.to_string());
    let pending_id = f.pending.to_string();
    let cases: &[(&[&str], Vec<i64>)] = &[
        (&[], vec![a, b, c, d]),
        (&["--id", &a_id], vec![a]),
        (&["--id", &a_id, "--id", &c_id], vec![a, c]),
        // A row that is not parked is never selected.
        (&["--id", &pending_id], vec![]),
        (&["--message-id", "m-b"], vec![b]),
        (&["--message-id", "m-b", "--message-id", "m-d"], vec![b, d]),
        (&["--message-id", "m-pending"], vec![]),
        (&["--reason", "retries_exhausted"], vec![a, c]),
        (&["--reason", "unreadable"], vec![d]),
        (&["--error-contains", "NOT_FOUND"], vec![a]),
        (&["--error-contains", "not_found"], vec![]),
        // Matched as it is: `%` is no wildcard.
        (&["--error-contains", "100%"], vec![c]),
        (&["--error-contains", "%"], vec![c]),
        (&["--exchange", "orders"], vec![a, c, d]),
        (&["--exchange", ""], vec![b]),
        (&["--routing-key", "order.paid"], vec![a, d]),
        (&["--older-than", "1h"], vec![a, d]),
        (&["--older-than", "5m"], vec![a, b, d]),
        (&["--older-than", "7d"], vec![]),
        (
            &[
                "--reason",
                "retries_exhausted",
                "--routing-key",
                "order.paid",
            ],
            vec![a],
        ),
        (&["--exchange", "orders", "--older-than", "1h"], vec![a, d]),
        (&["--id", &a_id, "--message-id", "m-c"], vec![]),
    ];
    for (args, expected) in cases {
        assert_eq!(&list_ids(s, args), expected, "{args:?}");
        // stats and peek select the same rows.
        let mut stats = vec!["stats", "--json"];
        stats.extend_from_slice(args);
        let out = parked(s, &stats);
        assert_eq!(json(&out)["parked"], expected.len(), "stats {args:?}");
    }

    // A reason no relay parks for is most likely a typo: said on stderr.
    let out = parked(s, &["list", "--json", "--reason", "retry_exhausted"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(json(&out), serde_json::json!([]));
    assert!(
        out.stderr
            .contains("note: --reason 'retry_exhausted' is none of the reasons"),
        "{out:?}"
    );

    // Bad values are usage errors.
    for args in [
        &["list", "--id", "seven"][..],
        &["list", "--older-than", "soon"],
        &["list", "--reason", ""],
        &["list", "--limit", "0"],
        &["peek", "--limit", "1001"],
    ] {
        let out = parked(s, args);
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
    }
}

#[tokio::test]
async fn peek_prints_whole_rows() {
    let f = fixture().await;
    let s = f.db.name.as_str();
    let a_id = f.a.to_string();
    let b_id = f.b.to_string();

    let out = parked(s, &["peek", "--id", &a_id, "--id", &b_id]);
    assert_eq!(out.code, 0, "{out:?}");
    let text = &out.stdout;
    assert!(
        text.starts_with(&format!(
            "outbox {s}.outbox: 2 parked row(s) matching --id {a_id} --id {b_id}, showing 2"
        )),
        "{text}"
    );
    for expected in [
        format!("parked row {a_id}\n"),
        "  message id:   m-a\n".to_owned(),
        "  exchange:     orders\n".to_owned(),
        "  routing key:  order.paid\n".to_owned(),
        "  reason:       retries_exhausted\n".to_owned(),
        "  attempts:     5\n".to_owned(),
        "  last error:   NOT_FOUND - no exchange 'orders' in vhost '/'\n".to_owned(),
        "  content type: application/json\n".to_owned(),
        "headers:\n  tenant: acme\n".to_owned(),
        "body (JSON, 11 bytes):\n{\n  \"order\": 7\n}\n".to_owned(),
        format!("parked row {b_id}\n"),
        "  exchange:     (default exchange)\n".to_owned(),
        "headers: (none)\n".to_owned(),
        "body (text, 19 bytes):\nresize 1.jpg\\n\nplease\n".to_owned(),
    ] {
        assert!(text.contains(&expected), "missing {expected:?} in\n{text}");
    }
    assert!(!text.contains("m-c"), "{text}");

    let out = parked(s, &["peek", "--json", "--limit", "2"]);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(ids(&v), vec![f.a, f.b]);
    assert_eq!(v[0]["headers"], serde_json::json!({"tenant": "acme"}));
    assert!(v[0]["stored_headers"].is_null(), "{v}");
    assert_eq!(v[0]["body"], serde_json::json!({"json": {"order": 7}}));
    assert_eq!(v[0]["content_type"], "application/json");
    assert!(v[0].get("body_preview").is_none(), "{v}");
    assert_eq!(v[1]["headers"], serde_json::json!({}));
    assert_eq!(
        v[1]["body"],
        serde_json::json!({"text": "resize 1.jpg\nplease"})
    );

    // The unreadable row: its headers as stored.
    let out = parked(s, &["peek", "--reason", "unreadable"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("  unreadable:   "), "{out:?}");
    assert!(
        out.stdout
            .contains("headers (as stored, not a JSON object of strings):\n  {\"tenant\": 1}\n"),
        "{out:?}"
    );
    let out = parked(s, &["peek", "--reason", "unreadable", "--json"]);
    let v = json(&out);
    assert!(v[0]["headers"].is_null(), "{v}");
    assert_eq!(v[0]["stored_headers"], "{\"tenant\": 1}");
    assert!(v[0]["unreadable"].is_string(), "{v}");

    // Nothing to peek at is an error, as `dlq peek` of an unknown message is.
    let out = parked(s, &["peek", "--message-id", "nope"]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(
        out.stderr.starts_with(&format!(
            "error: no parked row matching --message-id nope in the outbox {s}.outbox"
        )),
        "{out:?}"
    );
}

#[tokio::test]
async fn replay_puts_the_selected_rows_back_and_a_dry_run_changes_nothing() {
    let f = fixture().await;
    let s = f.db.name.as_str();
    let before = f.db.rows().await;

    let out = parked(s, &["replay", "--reason", "retries_exhausted", "--dry-run"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout.starts_with(&format!(
            "would replay 2 parked row(s) of the outbox {s}.outbox matching --reason \
             retries_exhausted (dry run: nothing changed)\n"
        )),
        "{out:?}"
    );
    assert!(out.stdout.contains("m-a") && out.stdout.contains("m-c"));
    assert!(!out.stdout.contains("m-b"), "{out:?}");
    let out = parked(
        s,
        &[
            "replay",
            "--reason",
            "retries_exhausted",
            "--dry-run",
            "--json",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(v["dry_run"], true);
    assert_eq!(v["replayed"], 2);
    assert_eq!(v["selection"], "--reason retries_exhausted");
    assert_eq!(ids(&v["rows"]), vec![f.a, f.c]);
    assert_eq!(v["missing_ids"], serde_json::json!([]));
    assert_eq!(f.db.rows().await, before, "a dry run changes nothing");

    let out = parked(s, &["replay", "--reason", "retries_exhausted", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(v["dry_run"], false);
    assert_eq!(v["replayed"], 2);
    assert_eq!(v["rows"], serde_json::json!([]));
    let rows = f.db.rows().await;
    for (id, parked, attempts, reason) in &rows {
        if *id == f.a || *id == f.c {
            assert!(!parked && *attempts == 0 && reason.is_none(), "{rows:?}");
        }
    }
    assert_eq!(f.db.parked_ids().await, vec![f.b, f.d]);
    // The retrying row kept its attempts.
    assert!(rows.contains(&(f.pending, false, 2, None)), "{rows:?}");

    // Text, with an --id that is not parked: the rest is done, then exit code 1.
    let b_id = f.b.to_string();
    let pending_id = f.pending.to_string();
    let out = parked(s, &["replay", "--id", &b_id, "--id", &pending_id]);
    assert_eq!(out.code, 1, "{out:?}");
    assert_eq!(
        out.stdout,
        format!(
            "replayed 1 parked row(s) of the outbox {s}.outbox matching --id {b_id} --id \
             {pending_id}: they are pending again, and the relays were woken to publish them\n"
        )
    );
    assert_eq!(
        out.stderr,
        format!("error: no parked row with id {pending_id} was found\n")
    );
    assert_eq!(f.db.parked_ids().await, vec![f.d]);

    // A missing --message-id in JSON: the report, then exit code 1.
    let out = parked(s, &["replay", "--message-id", "typo", "--json"]);
    assert_eq!(out.code, 1, "{out:?}");
    let v = json(&out);
    assert_eq!(v["replayed"], 0);
    assert_eq!(v["missing_message_ids"], serde_json::json!(["typo"]));

    // Without a selection, every parked row goes back, as `dlq replay` moves every message.
    let out = parked(s, &["replay"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout.starts_with("replayed 1 parked row(s)"),
        "{out:?}"
    );
    assert_eq!(f.db.parked_ids().await, Vec::<i64>::new());
    let out = parked(s, &["replay"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.stdout,
        format!("outbox {s}.outbox: no parked row, nothing to replay\n")
    );
}

#[tokio::test]
async fn purge_needs_yes_and_deletes_only_the_matching_parked_rows() {
    let f = fixture().await;
    let s = f.db.name.as_str();
    let before = f.db.rows().await;

    for args in [
        &["purge"][..],
        &["purge", "--reason", "permanent", "--json"],
    ] {
        let out = parked(s, args);
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stdout.is_empty(), "{out:?}");
        assert!(
            out.stderr
                .contains("nothing was changed. Add --yes to confirm"),
            "{out:?}"
        );
    }
    let out = parked(s, &["purge", "--reason", "permanent"]);
    assert_eq!(
        out.stderr,
        format!(
            "error: purging deletes the parked rows of the outbox {s}.outbox matching --reason \
             permanent for good; nothing was changed. Add --yes to confirm (--dry-run shows \
             what would be deleted)\n"
        )
    );
    assert_eq!(f.db.rows().await, before);

    // A dry run needs no --yes and changes nothing.
    let out = parked(s, &["purge", "--older-than", "1h", "--dry-run", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(v["purged"], 2);
    assert!(v.get("replayed").is_none(), "{v}");
    assert_eq!(ids(&v["rows"]), vec![f.a, f.d]);
    assert_eq!(f.db.rows().await, before);

    let out = parked(s, &["purge", "--older-than", "1h", "--yes"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.stdout,
        format!("purged 2 parked row(s) of the outbox {s}.outbox matching --older-than 1h\n")
    );
    assert_eq!(f.db.parked_ids().await, vec![f.b, f.c]);

    let out = parked(s, &["purge", "--message-id", "m-c", "--yes", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(v["purged"], 1);
    assert_eq!(v["selection"], "--message-id m-c");
    assert_eq!(f.db.parked_ids().await, vec![f.b]);

    // Everything parked; the retrying row stays.
    let out = parked(s, &["purge", "--yes"]);
    assert_eq!(out.code, 0, "{out:?}");
    let rows = f.db.rows().await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].0, f.pending);
}

#[tokio::test]
async fn hostile_rows_render_escaped_and_bounded() {
    let db = TestSchema::new().await;
    let s = db.name.as_str();
    let huge_value = format!("\u{1b}[2J{}", "v".repeat(1_000_000));
    let huge_headers = serde_json::json!({ "big": huge_value, "k\u{202e}\r": "x\u{9b}" });
    let huge_headers = huge_headers.to_string();
    let mut big_body = b"\x1b]0;pwned\x07".to_vec();
    big_body.extend(std::iter::repeat_n(b'x', 200_000));
    let evil = NewRow {
        exchange: "ex\u{1b}[31m",
        routing_key: "rk\r\nerror: forged",
        body: b"\x1b[2Jred\r\nfake line\0\xff\xfe".to_vec(),
        content_type: Some("text/plain\u{1b}[1m"),
        last_error: Some("boom\u{1b}]0;title\u{7}\u{202e}"),
        ..NewRow::parked("id\u{1b}[31m\u{200b}", "retries_exhausted", 60.0)
    };
    let mut ids_ = Vec::new();
    ids_.push(db.insert(evil.clone()).await);
    ids_.push(
        db.insert(NewRow {
            headers: Some(&huge_headers),
            body: big_body.clone(),
            ..evil.clone()
        })
        .await,
    );
    // Headers that are not an object of strings: unreadable rows.
    for headers in [
        r#"{"a": 1}"#,
        "[1, 2]",
        r#""text""#,
        r#"{"a": {"b": null}}"#,
    ] {
        ids_.push(
            db.insert(NewRow {
                headers: Some(headers),
                body: "{\"a\":\"\u{9b}\u{202e}\"}".as_bytes().to_vec(),
                ..NewRow::parked("m-unreadable", "unreadable\u{1b}[5m", 5.0)
            })
            .await,
        );
    }
    // An invalid UTF-8 body a little over the bound, a valid JSON body far over it.
    let mut binary = vec![0xffu8; 17 * 1024];
    binary[0] = 0x1b;
    ids_.push(
        db.insert(NewRow {
            body: binary,
            ..evil.clone()
        })
        .await,
    );
    let mut json_body = b"{\"pad\": \"".to_vec();
    json_body.extend(std::iter::repeat_n(b'y', 100_000));
    json_body.extend(b"\"}");
    ids_.push(
        db.insert(NewRow {
            body: json_body,
            ..evil.clone()
        })
        .await,
    );

    for args in [&["list"][..], &["stats"], &["peek", "--limit", "100"]] {
        let out = parked(s, args);
        assert_eq!(out.code, 0, "{args:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{out:?}");
        assert_clean(&format!("{args:?}"), &out.stdout);
        assert_clean(&format!("{args:?} stderr"), &out.stderr);
    }
    let out = parked(s, &["peek", "--limit", "100"]);
    let text = &out.stdout;
    assert!(
        text.contains("  message id:   id\\u{1b}[31m\\u{200b}\n"),
        "peek"
    );
    assert!(
        text.contains("  routing key:  rk\\r\\nerror: forged\n"),
        "peek"
    );
    // Text bodies escaped, binary ones as a hex dump.
    assert!(text.contains("\\u{1b}]0;pwned\\u{7}xxxx"), "peek");
    assert!(text.contains("  .[2Jred..fake li\n"), "peek");
    assert!(!text.lines().any(|l| l.starts_with("error: forged")));
    // A megabyte header value and a 200 kB body are cut, and say so.
    assert!(text.len() < 400_000, "peek printed {} bytes", text.len());
    assert!(text.contains("… 183"), "the cut of the 200 kB body");
    assert!(text.contains("more bytes: `--json` shows the whole body"));
    let big = text
        .lines()
        .find(|l| l.starts_with("  big: \\u{1b}[2Jvvvv"))
        .expect("the big header");
    assert!(
        big.ends_with('…') && big.chars().count() < 2100,
        "{}",
        big.len()
    );
    assert!(text.contains("the first 16384 shown"), "the binary head");
    // Unreadable rows: every shape of headers, shown as stored.
    for stored in [
        r#"{"a": 1}"#,
        "[1, 2]",
        r#""text""#,
        r#"{"a": {"b": null}}"#,
    ] {
        assert!(text.contains(&format!("  {stored}\n")), "{stored}");
    }

    for args in [
        &["list", "--json"][..],
        &["stats", "--json"],
        &["peek", "--json", "--limit", "100"],
        &["replay", "--dry-run", "--json"],
    ] {
        let out = parked(s, args);
        assert_eq!(out.code, 0, "{args:?}: {}", out.stderr);
        assert_clean(&format!("{args:?}"), &out.stdout);
        json(&out);
    }
    // JSON keeps the exact values.
    let v = json(&parked(s, &["peek", "--json", "--limit", "100"]));
    assert_eq!(ids(&v), ids_);
    assert_eq!(v[0]["message_id"], "id\u{1b}[31m\u{200b}");
    assert_eq!(v[0]["routing_key"], "rk\r\nerror: forged");
    assert_eq!(
        v[0]["body"]["bytes_hex"],
        "1b5b324a7265640d0a66616b65206c696e6500fffe"
    );
    assert_eq!(v[1]["headers"]["big"], huge_value.as_str());
    assert_eq!(v[1]["body_bytes"], big_body.len());
    assert_eq!(
        v[1]["body"]["text"].as_str().map(str::len),
        Some(big_body.len())
    );
    for row in &v.as_array().expect("rows")[2..6] {
        assert!(row["headers"].is_null(), "{row}");
        assert!(row["unreadable"].is_string(), "{row}");
        assert_eq!(
            row["body"],
            serde_json::json!({"json": {"a": "\u{9b}\u{202e}"}})
        );
    }
    let v = json(&parked(s, &["list", "--json"]));
    let preview = v[1]["body_preview"].as_str().expect("a preview");
    assert!(preview.chars().count() <= 61, "{preview}");
}

#[tokio::test]
async fn a_missing_table_or_column_is_a_clear_error() {
    let db = TestSchema::empty().await;
    let s = db.name.as_str();
    for args in [
        &["list"][..],
        &["stats", "--json"],
        &["peek"],
        &["replay"],
        &["purge", "--yes"],
    ] {
        let out = parked(s, args);
        assert_eq!(out.code, 1, "{args:?}: {out:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
        assert!(
            out.stderr.contains(&format!(
                "the outbox table {s}.outbox does not exist\nhint: the services create it"
            )),
            "{args:?}: {out:?}"
        );
    }

    // A table from before the retry columns: the hint names the migration.
    Schema::named(s)
        .expect("schema name")
        .migrate(&db.pool)
        .await
        .expect("migrate");
    sqlx::query(&format!("ALTER TABLE {} DROP COLUMN parked_at", db.table()))
        .execute(&db.pool)
        .await
        .expect("drop a column");
    let out = parked(s, &["list"]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("parked_at"), "{out:?}");
    assert!(out.stderr.contains("outbox_0002_retry.sql"), "{out:?}");
}

#[test]
fn a_purge_without_yes_is_refused_before_connecting() {
    // Nothing listens on port 1: the refusal comes first, exit code 2.
    let out = cli(
        &["outbox", "parked", "purge", "--reason", "permanent"],
        &[("DATABASE_URL", "postgres://app:s3cret@127.0.0.1:1/shop")],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.starts_with(
            "error: purging deletes the parked rows of the outbox redeliver.outbox matching \
             --reason permanent for good"
        ),
        "{out:?}"
    );
    // With --yes it connects, and fails as `outbox status` does, without the password.
    let out = cli(
        &["outbox", "parked", "purge", "--yes"],
        &[("DATABASE_URL", "postgres://app:s3cret@127.0.0.1:1/shop")],
    );
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr
            .starts_with("error: cannot connect to PostgreSQL at postgres://app@127.0.0.1:1/shop"),
        "{out:?}"
    );
    assert!(
        out.stderr.contains("hint: is PostgreSQL running"),
        "{out:?}"
    );
    assert!(!out.stderr.contains("s3cret"), "{out:?}");
    // No database at all.
    let out = cli(&["outbox", "parked", "list"], &[]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("--database-url or set DATABASE_URL"),
        "{out:?}"
    );
}
