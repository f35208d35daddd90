//! Triage of a DLQ against the real broker: the reason / final error / time of every dead
//! letter, `dlq list --group-by`, `dlq stats`, replay and purge by `--reason`,
//! `--error-contains`, `--older-than` and `--message-id`, and `--json` on every command.
//!
//! The DLQs hold both kinds of dead letter: "Reject" mode ones, dead-lettered by the broker (a
//! reject, an expiry: x-death reasons `rejected` and `expired`), and "Annotate" mode ones,
//! published straight to Q.dlq with the headers a worker writes (`DeadLetterInfo`), some with
//! an old dead-lettering time so that `--older-than` is deterministic.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/cleanup.rs"]
mod cleanup;
mod common;
#[path = "common/declare.rs"]
mod declare;
#[path = "common/messages.rs"]
mod messages;

use std::time::{Duration, SystemTime};

use cleanup::{cli, Cleanup};
use common::*;
use declare::declare;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use messages::*;
use redeliver_amqp::headers::{self, DeadLetterInfo, RetryState};
use redeliver_amqp::{DelayConfig, Publisher};
use redeliver_testkit::process::Output;
use redeliver_testkit::{
    connect, drain, message_id, message_ids, ready_count as count, reject_all, wait_count,
};
use serde_json::{json, Value};

/// Runs the command with `--prefix P --json` and parses stdout, which must be one JSON
/// document and nothing else.
fn run_json(args: &[&str], prefix: &str) -> Value {
    let mut all = args.to_vec();
    all.extend(["--prefix", prefix, "--json"]);
    let out = cli(&all).ok();
    parse(&out.stdout)
}

fn parse(stdout: &str) -> Value {
    serde_json::from_str(stdout)
        .unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{stdout}"))
}

fn list_ids(queue: &str, prefix: &str) -> Vec<String> {
    message_ids(&run_json(&["dlq", "list", queue], prefix))
}

/// Headers of an Annotate-mode dead letter, plus a user header.
fn annotated(reason: &str, error: Option<&str>, at: &str) -> FieldTable {
    let mut h = user_headers();
    DeadLetterInfo {
        reason: reason.to_owned(),
        error: error.map(str::to_owned),
        attempts: Some(4),
        at: Some(at.to_owned()),
        by: Some("redeliver-worker:test".to_owned()),
    }
    .write(&mut h);
    h
}

/// Publishes with a confirm and a per-message TTL, so the broker dead-letters the message
/// (x-death reason `expired`) as soon as it reaches the head of the (classic) queue.
async fn publish_expiring(conn: &Connection, queue: &str, id: &str) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let props = BasicProperties::default()
        .with_message_id(id.into())
        .with_expiration("1".into())
        .with_delivery_mode(2);
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        b"{}",
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    ch.close(200, "ok".into()).await.unwrap();
}

fn now() -> String {
    headers::now_rfc3339()
}

const OLD_0: &str = "2020-01-01T00:00:00.000Z";
const OLD_3: &str = "2021-06-01T00:00:00.000Z";
const OLD_4: &str = "2022-01-01T00:00:00Z";

/// The DLQ of `queue` (declared classic so that an expired message is dead-lettered at once),
/// holding, in this order:
/// rej-0 (rejected, last retry error "upstream timeout after 30s"), rej-1 (rejected, no
/// error), exp-0 (expired), ann-0 (retries_exhausted, "connect timeout: db", 2020), ann-1
/// (permanent, now), ann-2 (retries_exhausted, "HTTP 503 from payments", now), ann-3
/// (retries_exhausted, "read timeout", 2021), ann-4 (undecodable, 2022).
async fn fill(conn: &Connection, queue: &str, p: &str) -> Vec<String> {
    declare(queue, p, &["--classic"]);
    let q = format!("{p}{queue}");
    let dlq = format!("{q}.dlq");

    let mut retried = user_headers();
    RetryState {
        attempt: 3,
        first_failed_at: Some(now()),
        last_error: Some("upstream timeout after 30s".into()),
        ..RetryState::default()
    }
    .write(&mut retried);
    publish(conn, &q, "rej-0", b"{\"n\":0}", retried).await;
    publish(conn, &q, "rej-1", b"{\"n\":1}", user_headers()).await;
    reject_all(conn, &q, 2).await;
    wait_count(conn, &dlq, 2, Duration::from_secs(10)).await;

    publish_expiring(conn, &q, "exp-0").await;
    wait_count(conn, &dlq, 3, Duration::from_secs(10)).await;

    let annotated_ones = [
        (
            "ann-0",
            "retries_exhausted",
            Some("connect timeout: db"),
            OLD_0.to_owned(),
        ),
        (
            "ann-1",
            "permanent",
            Some("invalid order: missing sku"),
            now(),
        ),
        (
            "ann-2",
            "retries_exhausted",
            Some("HTTP 503 from payments"),
            now(),
        ),
        (
            "ann-3",
            "retries_exhausted",
            Some("read timeout"),
            OLD_3.to_owned(),
        ),
        (
            "ann-4",
            "undecodable",
            Some("expected value at line 1"),
            OLD_4.to_owned(),
        ),
    ];
    for (id, reason, error, at) in &annotated_ones {
        publish(conn, &dlq, id, b"{\"n\":9}", annotated(reason, *error, at)).await;
    }
    wait_count(conn, &dlq, 8, Duration::from_secs(10)).await;
    [
        "rej-0", "rej-1", "exp-0", "ann-0", "ann-1", "ann-2", "ann-3", "ann-4",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

fn by_id<'a>(listed: &'a Value, id: &str) -> &'a Value {
    listed
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["message_id"] == id)
        .unwrap_or_else(|| panic!("{id} not listed: {listed}"))
}

fn recent(at: &Value) -> bool {
    let at = at.as_str().unwrap_or_default();
    humantime::parse_rfc3339_weak(at.trim_end_matches('Z'))
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .is_some_and(|age| age < Duration::from_secs(600))
}

/// Every dead letter says why it died: the triage fields of `dlq list --json` for both modes,
/// the DLQ table, and the counts of `--group-by reason|error` (table and JSON, --limit
/// respected), all without removing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_shows_reasons_and_groups_them() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["tri"]);
    let ids = fill(&conn, "tri", &p).await;
    let dlq = format!("{p}tri.dlq");

    let listed = run_json(&["dlq", "list", "tri"], &p);
    assert_eq!(message_ids(&listed), ids);
    let rej0 = by_id(&listed, "rej-0");
    assert_eq!(rej0["reason"], "rejected", "{rej0}");
    assert_eq!(
        rej0["death_reason"], "rejected",
        "existing key kept: {rej0}"
    );
    assert_eq!(rej0["final_error"], "upstream timeout after 30s", "{rej0}");
    assert_eq!(rej0["last_error"], "upstream timeout after 30s", "{rej0}");
    assert!(recent(&rej0["dead_lettered_at"]), "x-death time: {rej0}");
    assert_eq!(rej0["dead_lettered_by"], Value::Null);
    let rej1 = by_id(&listed, "rej-1");
    assert_eq!(rej1["final_error"], Value::Null, "{rej1}");
    assert_eq!(by_id(&listed, "exp-0")["reason"], "expired");
    let ann0 = by_id(&listed, "ann-0");
    assert_eq!(ann0["reason"], "retries_exhausted", "{ann0}");
    assert_eq!(ann0["final_error"], "connect timeout: db", "{ann0}");
    assert_eq!(ann0["dead_lettered_at"], OLD_0, "{ann0}");
    assert_eq!(ann0["dead_letter_attempts"], 4, "{ann0}");
    assert_eq!(ann0["dead_lettered_by"], "redeliver-worker:test", "{ann0}");
    assert_eq!(ann0["death_reason"], Value::Null, "no x-death: {ann0}");

    let table = cli(&["dlq", "list", "tri", "--prefix", &p]).ok();
    for want in [
        "DEAD_LETTERED_AT",
        "ERROR",
        "retries_exhausted",
        "upstream timeout after 30s",
        OLD_0,
    ] {
        assert!(table.stdout.contains(want), "{want}:\n{}", table.stdout);
    }

    // Group by reason: most frequent first, ties by name.
    let groups = run_json(&["dlq", "list", "tri", "--group-by", "reason"], &p);
    assert_eq!(
        groups,
        json!([
            {"reason": "retries_exhausted", "count": 3},
            {"reason": "rejected", "count": 2},
            {"reason": "expired", "count": 1},
            {"reason": "permanent", "count": 1},
            {"reason": "undecodable", "count": 1},
        ])
    );
    // Group by final error: the two without one under null (JSON) / (none) (table).
    let errors = run_json(&["dlq", "list", "tri", "--group-by", "error"], &p);
    assert_eq!(errors[0], json!({"error": null, "count": 2}), "{errors}");
    let mut named: Vec<&str> = errors
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .map(|g| {
            assert_eq!(g["count"], 1, "{g}");
            g["error"].as_str().unwrap()
        })
        .collect();
    named.sort_unstable();
    assert_eq!(
        named,
        [
            "HTTP 503 from payments",
            "connect timeout: db",
            "expected value at line 1",
            "invalid order: missing sku",
            "read timeout",
            "upstream timeout after 30s",
        ]
    );
    let table = cli(&["dlq", "list", "tri", "--prefix", &p, "--group-by", "error"]).ok();
    assert!(table.stdout.contains("COUNT"), "{}", table.stdout);
    assert!(table.stdout.contains("(none)"), "{}", table.stdout);
    let table = cli(&["dlq", "list", "tri", "--prefix", &p, "--group-by", "reason"]).ok();
    let rows: Vec<Vec<&str>> = table
        .stdout
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows[0], ["3", "retries_exhausted"], "{}", table.stdout);
    assert_eq!(rows[1], ["2", "rejected"], "{}", table.stdout);

    // --limit: only the head is counted.
    assert_eq!(
        run_json(
            &["dlq", "list", "tri", "--group-by", "reason", "--limit", "3"],
            &p
        ),
        json!([{"reason": "rejected", "count": 2}, {"reason": "expired", "count": 1}])
    );
    assert_eq!(count(&conn, &dlq).await, 8, "nothing removed");
    assert_eq!(list_ids("tri", &p), ids, "order kept");
}

/// `dlq stats`: ready count, counts by reason, oldest and newest time, body bytes (text and
/// JSON); an empty DLQ says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_summarise_the_dlq() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["st", "empty"]);
    let ids = fill(&conn, "st", &p).await;

    let s = run_json(&["dlq", "stats", "st"], &p);
    assert_eq!(s["queue"], format!("{p}st.dlq"));
    assert_eq!(s["ready"], 8, "{s}");
    assert_eq!(s["read"], 8, "{s}");
    assert_eq!(
        s["by_reason"][0],
        json!({"reason": "retries_exhausted", "count": 3})
    );
    assert_eq!(s["by_reason"][1], json!({"reason": "rejected", "count": 2}));
    assert_eq!(s["by_reason"].as_array().unwrap().len(), 5, "{s}");
    assert_eq!(s["oldest_dead_lettered_at"], OLD_0, "{s}");
    assert!(recent(&s["newest_dead_lettered_at"]), "{s}");
    assert_eq!(s["undated"], 0, "{s}");
    // 2 x 7 bytes (rej), 2 (exp), 5 x 7 (ann).
    assert_eq!(s["body_bytes"], 2 * 7 + 2 + 5 * 7, "{s}");
    assert!(s["read_at"].is_string(), "{s}");

    let text = cli(&["dlq", "stats", "st", "--prefix", &p]).ok();
    for want in [
        "ready:       8",
        "oldest:      2020-01-01T00:00:00.000Z (",
        "body bytes:  51",
    ] {
        assert!(text.stdout.contains(want), "{want}:\n{}", text.stdout);
    }
    assert!(text.stdout.contains("retries_exhausted"), "{}", text.stdout);
    assert!(
        text.stdout.contains("less than a minute ago"),
        "{}",
        text.stdout
    );
    assert_eq!(list_ids("st", &p), ids, "nothing removed, order kept");

    // --limit: partial figures, said so.
    let s = run_json(&["dlq", "stats", "st", "--limit", "2"], &p);
    assert_eq!(
        (s["ready"].clone(), s["read"].clone()),
        (json!(8), json!(2))
    );
    assert_eq!(s["by_reason"], json!([{"reason": "rejected", "count": 2}]));
    let text = cli(&["dlq", "stats", "st", "--prefix", &p, "--limit", "2"]).ok();
    assert!(
        text.stdout.contains("head of the queue only"),
        "{}",
        text.stdout
    );

    declare("empty", &p, &[]);
    let s = run_json(&["dlq", "stats", "empty"], &p);
    assert_eq!(s["ready"], 0);
    assert_eq!(s["by_reason"], json!([]));
    assert_eq!(s["oldest_dead_lettered_at"], Value::Null);
    let text = cli(&["dlq", "stats", "empty", "--prefix", &p]).ok();
    assert!(text.stdout.contains("is empty"), "{}", text.stdout);
}

/// The example: replay by --reason and --error-contains moves exactly the matching
/// messages, in order, without their dead-letter annotation; the rest stay, in order. Then
/// purge by --reason, --older-than and --message-id, each removing only its matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_and_purge_select_by_reason_error_and_age() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["sel"]);
    fill(&conn, "sel", &p).await;
    let q = format!("{p}sel");
    let dlq = format!("{q}.dlq");
    let select = [
        "--reason",
        "retries_exhausted",
        "--error-contains",
        "timeout",
    ];

    // Dry run first: the report names the two matches, nothing moves.
    let mut args = vec!["dlq", "replay", "sel", "--dry-run"];
    args.extend(select);
    let dry = run_json(&args, &p);
    assert_eq!(dry["dry_run"], true, "{dry}");
    assert_eq!(dry["moved"], 2, "{dry}");
    assert_eq!(dry["examined"], 8, "{dry}");
    assert_eq!(dry["destination"], q.as_str());
    let moved_ids: Vec<&str> = dry["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(moved_ids, ["ann-0", "ann-3"], "{dry}");
    assert_eq!(count(&conn, &dlq).await, 8);
    let mut text_args = vec!["dlq", "replay", "sel", "--prefix", &p, "--dry-run"];
    text_args.extend(select);
    let text = cli(&text_args).ok();
    assert!(
        text.stdout.contains("would move #4 message_id ann-0"),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout.contains("would move 2 message(s)"),
        "{}",
        text.stdout
    );

    // The replay itself.
    let mut args = vec!["dlq", "replay", "sel"];
    args.extend(select);
    let done = run_json(&args, &p);
    assert_eq!(done["moved"], 2, "{done}");
    assert_eq!(done["dry_run"], false, "{done}");
    assert_eq!(done["skipped"], json!([]), "{done}");
    assert_eq!(done["missing_message_ids"], json!([]), "{done}");
    assert_eq!(
        list_ids("sel", &p),
        ["rej-0", "rej-1", "exp-0", "ann-1", "ann-2", "ann-4"],
        "the rest, in order"
    );
    let back = drain(&conn, &q).await;
    let back_ids: Vec<String> = back
        .iter()
        .map(|m| message_id(&m.delivery.properties))
        .collect();
    assert_eq!(back_ids, ["ann-0", "ann-3"], "moved in DLQ order");
    for m in &back {
        let h = m.delivery.properties.headers().as_ref();
        assert_eq!(DeadLetterInfo::read(h), None, "annotation removed");
        let h = h.unwrap();
        assert!(!h.contains_key(headers::DEAD_LETTERED_AT));
        assert_eq!(
            h.inner().get("tenant"),
            Some(&AMQPValue::LongString("acme".into()))
        );
    }

    // Purge by reason: refused without --yes (naming the selection), then only the rejected go.
    let refused = cli(&[
        "dlq", "purge", "sel", "--prefix", &p, "--reason", "rejected",
    ]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("--yes"), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("matching --reason rejected"),
        "{}",
        refused.stderr
    );
    assert_eq!(count(&conn, &dlq).await, 6);
    let purged = run_json(
        &["dlq", "purge", "sel", "--reason", "rejected", "--yes"],
        &p,
    );
    assert_eq!(
        purged,
        json!({
            "queue": dlq,
            "purged": 2,
            "kept": 4,
            "not_examined": 0,
            "selection": "--reason rejected",
            "missing_message_ids": [],
        })
    );
    assert_eq!(list_ids("sel", &p), ["exp-0", "ann-1", "ann-2", "ann-4"]);

    // --older-than: only ann-4 (2022) is older than 30 days; exp-0 (x-death time) and the
    // annotated ann-1 / ann-2 died just now.
    let dry = run_json(
        &["dlq", "replay", "sel", "--older-than", "30d", "--dry-run"],
        &p,
    );
    assert_eq!(dry["moved"], 1, "{dry}");
    assert_eq!(dry["messages"][0]["message_id"], "ann-4", "{dry}");
    let text = cli(&[
        "dlq",
        "purge",
        "sel",
        "--prefix",
        &p,
        "--older-than",
        "1h",
        "--yes",
    ])
    .ok();
    assert!(
        text.stdout
            .contains("purged 1 message(s) matching --older-than 1h"),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout.contains("kept 3 in their order"),
        "{}",
        text.stdout
    );
    assert_eq!(list_ids("sel", &p), ["exp-0", "ann-1", "ann-2"]);

    // --message-id (repeatable) AND --reason; an id that is not there fails the command after
    // the rest was done.
    let out = cli(&[
        "dlq",
        "purge",
        "sel",
        "--prefix",
        &p,
        "--message-id",
        "ann-1",
        "--message-id",
        "ann-2",
        "--message-id",
        "nope",
        "--reason",
        "permanent",
        "--yes",
        "--json",
    ]);
    assert_eq!(out.code, 1, "{out:?}");
    let report = parse(&out.stdout);
    assert_eq!(report["purged"], 1, "{report}");
    assert_eq!(report["missing_message_ids"], json!(["nope"]), "{report}");
    assert!(out.stderr.contains("'nope'"), "{}", out.stderr);
    assert!(
        !out.stderr.contains("'ann-2'"),
        "found, just not selected: {}",
        out.stderr
    );
    assert_eq!(list_ids("sel", &p), ["exp-0", "ann-2"]);

    // Without a selection, purge still takes everything.
    let all = run_json(&["dlq", "purge", "sel", "--yes"], &p);
    assert_eq!(all["purged"], 2, "{all}");
    assert_eq!(all["kept"], 0, "{all}");
    assert_eq!(all["selection"], Value::Null, "{all}");
    assert_eq!(count(&conn, &dlq).await, 0);
}

/// More than a screenful of messages, output piped: stats, group-by, a filtered purge and a
/// filtered replay show no progress bar (no carriage return, no escape code) on either stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_progress_bar_when_not_a_terminal() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["bulk"]);
    declare("bulk", &p, &[]);
    let dlq = format!("{p}bulk.dlq");
    for i in 0..30 {
        let reason = if i % 3 == 0 {
            "permanent"
        } else {
            "retries_exhausted"
        };
        let h = annotated(reason, Some("boom"), OLD_0);
        publish(&conn, &dlq, &format!("b{i:02}"), b"{}", h).await;
    }
    wait_count(&conn, &dlq, 30, Duration::from_secs(10)).await;
    let clean = |out: &Output| {
        for s in [&out.stdout, &out.stderr] {
            assert!(!s.contains('\r') && !s.contains('\u{1b}'), "{s:?}");
        }
    };
    clean(&cli(&["dlq", "stats", "bulk", "--prefix", &p]).ok());
    clean(
        &cli(&[
            "dlq",
            "list",
            "bulk",
            "--prefix",
            &p,
            "--group-by",
            "reason",
        ])
        .ok(),
    );
    clean(
        &cli(&[
            "dlq",
            "replay",
            "bulk",
            "--prefix",
            &p,
            "--reason",
            "permanent",
            "--dry-run",
        ])
        .ok(),
    );
    let out = cli(&[
        "dlq",
        "purge",
        "bulk",
        "--prefix",
        &p,
        "--reason",
        "permanent",
        "--yes",
    ])
    .ok();
    clean(&out);
    assert!(
        out.stdout.contains("purged 10 message(s)"),
        "{}",
        out.stdout
    );
    assert_eq!(count(&conn, &dlq).await, 20);
}

/// `--json` on the remaining commands: peek, topology declare / verify / show / delete, delay
/// probe (also when it fails), and unroutable list / peek / replay / purge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_on_every_command() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["js", "gone"]);
    let levels = LEVELS.to_string();
    let lv = ["--levels", levels.as_str()];
    let with_levels = |args: &[&'static str]| -> Vec<String> {
        args.iter()
            .chain(lv.iter())
            .map(|s| (*s).to_owned())
            .collect()
    };
    let json_of = |args: &[&'static str]| -> Value {
        let args = with_levels(args);
        run_json(&args.iter().map(String::as_str).collect::<Vec<_>>(), &p)
    };

    let declared = json_of(&["topology", "declare", "js", "--classic"]);
    assert_eq!(declared["declared"], true, "{declared}");
    assert_eq!(declared["queue"], format!("{p}js"));
    assert_eq!(declared["queue_type"], "classic");
    assert_eq!(declared["dlq"], format!("{p}js.dlq"));
    assert_eq!(declared["delay"]["levels"], LEVELS);
    assert_eq!(declared["delay"]["granularity_ms"], 10);
    let verified = json_of(&["topology", "verify", "js", "--classic"]);
    assert_eq!(verified["ok"], true, "{verified}");
    assert_eq!(verified["dlx"], format!("{p}js.dlx"));
    let shown = json_of(&["topology", "show", "js", "--classic"]);
    assert!(shown["objects"].is_array(), "{shown}");
    // A failed verify prints nothing on stdout.
    let mut bad = with_levels(&["topology", "verify", "nothere"]);
    bad.extend(["--prefix".to_owned(), p.clone(), "--json".to_owned()]);
    let out = cli(&bad.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stdout.is_empty(), "{}", out.stdout);

    // peek --json.
    let dlq = format!("{p}js.dlq");
    publish(
        &conn,
        &dlq,
        "pk",
        b"{\"a\":1}",
        annotated("permanent", Some("bad"), OLD_0),
    )
    .await;
    wait_count(&conn, &dlq, 1, Duration::from_secs(10)).await;
    let peeked = run_json(&["dlq", "peek", "js", "pk"], &p);
    assert_eq!(peeked["properties"]["message_id"], "pk", "{peeked}");
    assert_eq!(peeked["headers"][headers::DEAD_LETTER_REASON], "permanent");

    // delay probe --json, ok and failed.
    let probe = json_of(&["delay", "probe", "--delays", "0ms,30ms"]);
    assert_eq!(probe["lost"], 0, "{probe}");
    assert_eq!(probe["probes"][1]["status"], "ok", "{probe}");
    assert!(
        probe["probes"][1]["observed_ms"].as_f64().unwrap() >= 30.0,
        "{probe}"
    );
    let mut too_long = with_levels(&["delay", "probe", "--delays", "1h"]);
    too_long.extend(["--prefix".to_owned(), p.clone(), "--json".to_owned()]);
    let out = cli(&too_long.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.code, 1, "{out:?}");
    let failed = parse(&out.stdout);
    assert_eq!(failed["not_sent"], 1, "{failed}");
    assert_eq!(failed["probes"][0]["status"], "not_sent", "{failed}");
    assert!(failed["probes"][0]["error"].is_string(), "{failed}");

    // The parking queue: two copies for a queue that is not declared yet.
    let cfg = DelayConfig::new().prefix(p.clone()).levels(LEVELS);
    let parking = cfg.unroutable_name();
    let gone = format!("{p}gone");
    let publisher = Publisher::new(&conn, cfg.clone()).await.unwrap();
    for id in ["u0", "u1", "u2"] {
        let props = BasicProperties::default().with_message_id(id.into());
        publisher
            .publish_delayed(&gone, Duration::ZERO, id.as_bytes(), props)
            .await
            .unwrap();
    }
    wait_count(&conn, &parking, 3, Duration::from_secs(10)).await;
    let listed = json_of(&["unroutable", "list"]);
    assert_eq!(message_ids(&listed), ["u0", "u1", "u2"]);
    let peeked = json_of(&["unroutable", "peek", "u1"]);
    assert_eq!(peeked["properties"]["message_id"], "u1", "{peeked}");
    let dry = json_of(&["unroutable", "replay", "--dry-run"]);
    assert_eq!(dry["moved"], 3, "{dry}");
    assert_eq!(dry["destination"], Value::Null, "{dry}");
    assert_eq!(dry["messages"][0]["destination"], gone.as_str(), "{dry}");
    // The destination does not exist: each copy is skipped, reported, exit 1, still JSON.
    let mut replay = with_levels(&["unroutable", "replay", "--message-id", "u0"]);
    replay.extend(["--prefix".to_owned(), p.clone(), "--json".to_owned()]);
    let out = cli(&replay.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.code, 1, "{out:?}");
    let report = parse(&out.stdout);
    assert_eq!(report["moved"], 0, "{report}");
    assert_eq!(report["skipped"][0]["message_id"], "u0", "{report}");
    assert!(
        report["skipped"][0]["error"]
            .as_str()
            .unwrap()
            .contains("does not exist"),
        "{report}"
    );
    declare("gone", &p, &[]);
    let moved = json_of(&["unroutable", "replay", "--message-id", "u0"]);
    assert_eq!(moved["moved"], 1, "{moved}");
    assert_eq!(drain(&conn, &gone).await.len(), 1);
    let nobody = format!("{p}nobody");
    let mut purge = with_levels(&["unroutable", "purge", "--yes"]);
    purge.extend([
        "--queue".to_owned(),
        nobody,
        "--prefix".to_owned(),
        p.clone(),
    ]);
    purge.push("--json".to_owned());
    let out = cli(&purge.iter().map(String::as_str).collect::<Vec<_>>()).ok();
    let report = parse(&out.stdout);
    assert_eq!(
        report["selection"],
        format!("--queue {p}nobody"),
        "{report}"
    );
    assert_eq!(
        (report["purged"].clone(), report["kept"].clone()),
        (json!(0), json!(2))
    );
    let all = json_of(&["unroutable", "purge", "--yes"]);
    assert_eq!(all["purged"], 2, "{all}");
    assert_eq!(count(&conn, &parking).await, 0);

    // delete --json last (the cleanup then finds nothing of "js" left, which is fine).
    let deleted = json_of(&["topology", "delete", "js", "--yes"]);
    assert_eq!(deleted["deleted"], true, "{deleted}");
    assert_eq!(deleted["delay_deleted"], false, "{deleted}");
    assert_eq!(deleted["delay"], Value::Null, "{deleted}");
}
