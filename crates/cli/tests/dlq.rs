//! `dlq list|peek|replay|purge` against the real broker.

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

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleanup::{cli, Cleanup};
use common::*;
use declare::declare;
use lapin::types::AMQPValue;
use messages::*;
use redeliver_amqp::headers;
use redeliver_amqp::{DelayConfig, Topology};
use redeliver_core::{HandlerError, RetryPolicy};
use redeliver_testkit::{
    amqp_url, connect, drain, message_id, message_ids, ready_count as count, reject_all, wait_count,
};
use redeliver_worker::{Context, Json, Worker};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

fn list_json(queue: &str, prefix: &str, extra: &[&str]) -> Value {
    let mut args = vec!["dlq", "list", queue, "--prefix", prefix, "--json"];
    args.extend_from_slice(extra);
    let out = cli(&args).ok();
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", out.stdout))
}

fn body(i: usize) -> Vec<u8> {
    json!({ "order": i, "note": "keep me" })
        .to_string()
        .into_bytes()
}

/// Dead-letters 5 messages through the worker (transient failures, 2 retries through the delay
/// levels, then the broker's DLX), lists and peeks them without removing anything, replays one
/// by message_id, then the rest, and lets a worker process the replayed copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_dead_letters_then_list_peek_replay() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["orders"]);
    declare("orders", &p, &[]);
    let q = format!("{p}orders");
    let dlq = format!("{q}.dlq");

    let ids: Vec<String> = (0..5).map(|i| format!("order-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        publish(&conn, &q, id, &body(i), user_headers()).await;
    }

    let topology = Topology::new("orders")
        .prefix(p.clone())
        .delay(DelayConfig::new().prefix(p.clone()).levels(LEVELS));
    let token = CancellationToken::new();
    let failing = Worker::builder(amqp_url())
        .topology(topology.clone())
        .policy(RetryPolicy::constant(Duration::from_millis(20)).max_retries(2))
        .handler(|_m: Json<Value>, _c: Context| async move {
            Err::<(), _>(HandlerError::transient("payment service down"))
        })
        .build()
        .unwrap();
    let running = tokio::spawn(failing.run(token.clone()));
    wait_count(&conn, &dlq, 5, Duration::from_secs(30)).await;
    token.cancel();
    running.await.unwrap().unwrap();

    // --- list: all 5 with the right fields, nothing removed, same order twice.
    let listed = list_json("orders", &p, &[]);
    let order = message_ids(&listed);
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(sorted, ids, "every dead-lettered message is listed once");
    for m in listed.as_array().unwrap() {
        let id = m["message_id"].as_str().unwrap();
        let i: usize = id.trim_start_matches("order-").parse().unwrap();
        assert_eq!(m["attempts"], 2, "{m}");
        assert_eq!(m["death_reason"], "rejected", "{m}");
        assert_eq!(m["death_count"], 1, "{m}");
        assert!(
            m["last_error"]
                .as_str()
                .unwrap()
                .contains("payment service down"),
            "{m}"
        );
        assert!(m["first_failed_at"].as_str().is_some(), "{m}");
        assert_eq!(m["correlation_id"], format!("corr-{id}"));
        assert_eq!(m["content_type"], "application/json");
        assert_eq!(
            m["body_preview"].as_str().unwrap(),
            String::from_utf8(body(i)).unwrap()
        );
        assert_eq!(m["body_bytes"], body(i).len());
        assert_eq!(m["x_death"][0]["queue"], q.as_str());
    }
    assert_eq!(count(&conn, &dlq).await, 5, "listing removed nothing");
    assert_eq!(
        message_ids(&list_json("orders", &p, &[])),
        order,
        "a second listing sees the same order"
    );

    let table = cli(&["dlq", "list", "orders", "--prefix", &p]).ok();
    for id in &ids {
        assert!(table.stdout.contains(id.as_str()), "{}", table.stdout);
    }
    assert!(table.stdout.contains("rejected"), "{}", table.stdout);
    assert!(table.stdout.contains("MESSAGE_ID"), "{}", table.stdout);

    // --- peek: one message in full.
    let peek = cli(&["dlq", "peek", "orders", "order-2", "--prefix", &p]).ok();
    assert!(
        peek.stdout.contains("message_id: order-2"),
        "{}",
        peek.stdout
    );
    assert!(
        peek.stdout.contains("\"order\": 2"),
        "pretty JSON body:\n{}",
        peek.stdout
    );
    assert!(peek.stdout.contains("x-death:"), "{}", peek.stdout);
    assert!(peek.stdout.contains("tenant: acme"), "{}", peek.stdout);
    assert!(peek.stdout.contains(headers::ATTEMPT), "{}", peek.stdout);
    let missing = cli(&["dlq", "peek", "orders", "nope", "--prefix", &p]);
    assert_eq!(missing.code, 1);
    assert!(missing.stderr.contains("no message with message_id 'nope'"));
    assert_eq!(count(&conn, &dlq).await, 5, "peeking removed nothing");

    // --- replay one by message_id: exactly that one moves; the others keep their order.
    let chosen = order[2].clone();
    let one = cli(&[
        "dlq",
        "replay",
        "orders",
        "--prefix",
        &p,
        "--message-id",
        &chosen,
    ])
    .ok();
    assert!(
        one.stdout
            .contains(&format!("moved 1 message(s) from '{dlq}' to '{q}'")),
        "{}",
        one.stdout
    );
    assert_eq!(count(&conn, &dlq).await, 4);
    assert_eq!(count(&conn, &q).await, 1);
    let rest: Vec<String> = order.iter().filter(|i| **i != chosen).cloned().collect();
    assert_eq!(message_ids(&list_json("orders", &p, &[])), rest);

    // --- dry run changes nothing.
    let dry = cli(&["dlq", "replay", "orders", "--prefix", &p, "--dry-run"]).ok();
    assert!(
        dry.stdout.contains("would move 4 message(s)"),
        "{}",
        dry.stdout
    );
    assert_eq!(count(&conn, &dlq).await, 4);

    // --- replay the rest: the DLQ drains.
    let all = cli(&["dlq", "replay", "orders", "--prefix", &p]).ok();
    assert!(all.stdout.contains("moved 4 message(s)"), "{}", all.stdout);
    assert_eq!(count(&conn, &dlq).await, 0);
    assert_eq!(count(&conn, &q).await, 5);

    // --- a worker processes them as fresh messages: same body and id, attempt reset.
    type Seen = (String, Vec<u8>, u32, bool, bool, Option<String>);
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let sink = seen.clone();
    let token = CancellationToken::new();
    let ok = Worker::builder(amqp_url())
        .topology(topology)
        .handler(move |m: Json<Value>, c: Context| {
            let sink = sink.clone();
            async move {
                let tenant = match c.header("tenant") {
                    Some(AMQPValue::LongString(s)) => {
                        Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                    }
                    other => other.map(|v| format!("{v:?}")),
                };
                sink.lock().unwrap().push((
                    c.message_id().unwrap_or_default().to_owned(),
                    serde_json::to_vec(&m.into_inner()).unwrap(),
                    c.attempt(),
                    c.header(headers::ATTEMPT).is_some(),
                    c.header("x-death").is_some(),
                    tenant,
                ));
                Ok::<(), HandlerError>(())
            }
        })
        .build()
        .unwrap();
    let running = tokio::spawn(ok.run(token.clone()));
    let start = std::time::Instant::now();
    while seen.lock().unwrap().len() < 5 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "worker did not process 5"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    token.cancel();
    running.await.unwrap().unwrap();
    let seen = seen.lock().unwrap().clone();
    // The worker runs handlers concurrently, so completion order is not queue order (the
    // order test below checks that on the queue itself).
    let mut got_ids: Vec<String> = seen.iter().map(|s| s.0.clone()).collect();
    got_ids.sort();
    assert_eq!(got_ids, ids, "each replayed message processed once");
    for (id, got, attempt, has_attempt, has_death, tenant) in &seen {
        let i: usize = id.trim_start_matches("order-").parse().unwrap();
        let want: Value = serde_json::from_slice(&body(i)).unwrap();
        assert_eq!(serde_json::from_slice::<Value>(got).unwrap(), want);
        assert_eq!(*attempt, 0, "attempt count reset for {id}");
        assert!(!has_attempt, "x-redeliver-attempt stripped on {id}");
        assert!(!has_death, "x-death stripped on {id}");
        assert_eq!(tenant.as_deref(), Some("acme"), "user header kept on {id}");
    }
    assert_eq!(count(&conn, &dlq).await, 0);
}

/// The listing method's promise: 30 messages dead-lettered in a known order are listed in that
/// order (whole and limited), are all still there afterwards in the same order, and a replay
/// moves them to Q in that order too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_and_replay_preserve_order() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["jobs"]);
    declare("jobs", &p, &["--classic"]);
    let q = format!("{p}jobs");
    let dlq = format!("{q}.dlq");
    let ids: Vec<String> = (0..30).map(|i| format!("job-{i:02}")).collect();
    for (i, id) in ids.iter().enumerate() {
        publish(&conn, &q, id, &body(i), user_headers()).await;
    }
    // Rejected one at a time in queue order: the DLQ order is the publish order.
    reject_all(&conn, &q, ids.len()).await;
    wait_count(&conn, &dlq, 30, Duration::from_secs(10)).await;

    assert_eq!(
        message_ids(&list_json("jobs", &p, &["--limit", "10"])),
        ids[..10]
    );
    assert_eq!(message_ids(&list_json("jobs", &p, &[])), ids);
    assert_eq!(
        message_ids(&list_json("jobs", &p, &["--limit", "7"])),
        ids[..7]
    );
    assert_eq!(message_ids(&list_json("jobs", &p, &[])), ids);
    assert_eq!(count(&conn, &dlq).await, 30);

    // More than a screenful, but stdout is a pipe: no progress bar in the output.
    let out = cli(&["dlq", "replay", "jobs", "--prefix", &p]).ok();
    assert!(out.stdout.contains("moved 30 message(s)"), "{}", out.stdout);
    assert!(
        !out.stderr.contains('\r') && !out.stderr.contains('\u{1b}'),
        "no progress bar when not a terminal: {:?}",
        out.stderr
    );
    assert_eq!(count(&conn, &dlq).await, 0);
    let moved: Vec<String> = drain(&conn, &q)
        .await
        .iter()
        .map(|m| message_id(&m.delivery.properties))
        .collect();
    assert_eq!(moved, ids, "replay keeps the DLQ order");
}

/// `replay --limit` moves the head only; the tail stays in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_limit_moves_the_head() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["lim"]);
    declare("lim", &p, &[]);
    let q = format!("{p}lim");
    let dlq = format!("{q}.dlq");
    let ids: Vec<String> = (0..6).map(|i| format!("m{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        publish(&conn, &q, id, &body(i), user_headers()).await;
    }
    reject_all(&conn, &q, ids.len()).await;
    wait_count(&conn, &dlq, 6, Duration::from_secs(10)).await;
    let out = cli(&["dlq", "replay", "lim", "--prefix", &p, "--limit", "2"]).ok();
    assert!(out.stdout.contains("moved 2 message(s)"), "{}", out.stdout);
    assert_eq!(message_ids(&list_json("lim", &p, &[])), ids[2..]);
    let moved: Vec<String> = drain(&conn, &q)
        .await
        .iter()
        .map(|m| message_id(&m.delivery.properties))
        .collect();
    assert_eq!(moved, ids[..2]);

    // An id that is not there: nothing moves, exit code 1, the id is named.
    let out = cli(&[
        "dlq",
        "replay",
        "lim",
        "--prefix",
        &p,
        "--message-id",
        "zzz",
    ]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("'zzz'"), "{}", out.stderr);
    assert_eq!(count(&conn, &dlq).await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_requires_yes() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["pq"]);
    declare("pq", &p, &[]);
    let q = format!("{p}pq");
    let dlq = format!("{q}.dlq");
    for i in 0..3 {
        publish(&conn, &q, &format!("p{i}"), &body(i), user_headers()).await;
    }
    reject_all(&conn, &q, 3).await;
    wait_count(&conn, &dlq, 3, Duration::from_secs(10)).await;

    let refused = cli(&["dlq", "purge", "pq", "--prefix", &p]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("--yes"), "{}", refused.stderr);
    assert_eq!(count(&conn, &dlq).await, 3, "nothing purged without --yes");

    let done = cli(&["dlq", "purge", "pq", "--prefix", &p, "--yes"]).ok();
    assert!(
        done.stdout
            .contains(&format!("purged 3 message(s) from '{dlq}'")),
        "{}",
        done.stdout
    );
    assert_eq!(count(&conn, &dlq).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_queue_says_how_to_declare() {
    let _conn = connect().await;
    let p = prefix();
    let out = cli(&["dlq", "list", "ghost", "--prefix", &p]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr
            .contains(&format!("queue '{p}ghost.dlq' does not exist")),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains(&format!("redeliver topology declare ghost --prefix {p}")),
        "{}",
        out.stderr
    );
}

/// Every listing returns what it read, and a quorum queue counts each return as a delivery
/// attempt; from RabbitMQ 4.0 a quorum queue without its own limit drops a message after 20.
/// 100 listings of a quorum DLQ and of the parking queue leave every message in place, in
/// order, on every broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_listings_keep_every_operator_message() {
    let conn = connect().await;
    let version = redeliver_testkit::broker_version().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["keep"]);
    declare("keep", &p, &["--quorum-dlq"]);
    let q = format!("{p}keep");
    let dlq = format!("{q}.dlq");
    let ids: Vec<String> = (0..3).map(|i| format!("keep-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        publish(&conn, &q, id, &body(i), user_headers()).await;
    }
    reject_all(&conn, &q, ids.len()).await;
    wait_count(&conn, &dlq, 3, Duration::from_secs(10)).await;

    // Parked: delayed copies for a queue that was never declared.
    let cfg = DelayConfig::new().prefix(p.clone()).levels(LEVELS);
    let parking = cfg.unroutable_name();
    let publisher = redeliver_amqp::Publisher::new(&conn, cfg.clone())
        .await
        .unwrap();
    for id in &ids {
        let props = lapin::BasicProperties::default().with_message_id(id.as_str().into());
        publisher
            .publish_delayed(&format!("{p}nowhere"), Duration::ZERO, b"parked", props)
            .await
            .unwrap();
    }
    wait_count(&conn, &parking, 3, Duration::from_secs(10)).await;

    let levels = LEVELS.to_string();
    for round in 1..=100 {
        assert_eq!(
            message_ids(&list_json("keep", &p, &[])),
            ids,
            "RabbitMQ {version}: quorum DLQ after {round} listings"
        );
        let parked = cli(&[
            "unroutable",
            "list",
            "--prefix",
            &p,
            "--levels",
            &levels,
            "--json",
        ])
        .ok();
        let parked: Value = serde_json::from_str(&parked.stdout).unwrap();
        assert_eq!(
            message_ids(&parked),
            ids,
            "RabbitMQ {version}: parking queue after {round} listings"
        );
    }
    assert_eq!(count(&conn, &dlq).await, 3);
    assert_eq!(count(&conn, &parking).await, 3);
    println!("RabbitMQ {version}: 100 listings of {dlq} and {parking}: 3 + 3 messages kept");
}

/// A dead letter without a message_id is replayed without one (not with a new random id):
/// duplicates of a message must share its identity, absent or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_keeps_a_missing_message_id() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["anon"]);
    declare("anon", &p, &["--classic"]);
    let q = format!("{p}anon");
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        Default::default(),
        b"no id",
        lapin::BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    reject_all(&conn, &q, 1).await;
    wait_count(&conn, &format!("{q}.dlq"), 1, Duration::from_secs(10)).await;
    cli(&["dlq", "replay", "anon", "--prefix", &p]).ok();
    let back = drain(&conn, &q).await;
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].delivery.data, b"no id");
    assert_eq!(
        back[0].delivery.properties.message_id(),
        &None,
        "no id invented"
    );
    assert_eq!(
        back[0].delivery.properties.content_type(),
        &None,
        "nothing filled in"
    );
}

/// Native dead letters (RabbitMQ 4.3+: the queue's DLX moved them, the reason travels as
/// `x-opt-redeliver-*`): listed with the worker's reason and error as annotated ones are, and a
/// replay with the retry state reset gives the message its retries back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_dead_letters_are_listed_with_their_reason_and_replayed() {
    let conn = connect().await;
    let version = redeliver_testkit::broker_version().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["native"]);
    declare("native", &p, &[]);
    let q = format!("{p}native");
    let dlq = format!("{q}.dlq");
    publish(&conn, &q, "n-1", &body(1), user_headers()).await;
    let topology = Topology::new("native")
        .prefix(p.clone())
        .delay(DelayConfig::new().prefix(p.clone()).levels(LEVELS));
    let token = CancellationToken::new();
    let failing = Worker::builder(amqp_url())
        .topology(topology.clone())
        .retry_mode(redeliver_worker::RetryMode::Auto)
        .policy(RetryPolicy::constant(Duration::from_millis(20)).max_retries(1))
        .handler(|_m: Json<Value>, _c: Context| async move {
            Err::<(), _>(HandlerError::transient("payment service down"))
        })
        .build()
        .unwrap();
    let running = tokio::spawn(failing.run(token.clone()));
    wait_count(&conn, &dlq, 1, Duration::from_secs(30)).await;
    token.cancel();
    running.await.unwrap().unwrap();

    let listed = list_json("native", &p, &[]);
    let m = &listed.as_array().unwrap()[0];
    assert_eq!(m["message_id"], "n-1", "{m}");
    assert_eq!(m["attempts"], 1, "{m}");
    assert!(
        m["last_error"]
            .as_str()
            .unwrap()
            .contains("payment service down"),
        "{m}"
    );
    assert_eq!(m["death_reason"], "rejected", "{m}");
    if version.holds_native_retries() {
        // The worker's own reason, with no republish: the broker's DLX carried it.
        assert_eq!(m["reason"], "retries_exhausted", "{m}");
        assert!(
            m["final_error"]
                .as_str()
                .unwrap()
                .contains("payment service down"),
            "{m}"
        );
        assert_eq!(m["dead_letter_attempts"], 2, "{m}");
        let peek = cli(&["dlq", "peek", "native", "n-1", "--prefix", &p]).ok();
        assert!(
            peek.stdout.contains("x-opt-redeliver-dead-letter-reason"),
            "{}",
            peek.stdout
        );
    } else {
        // Before 4.3 `auto` retried through the levels and rejected: the broker's reason.
        assert_eq!(m["reason"], "rejected", "{m}");
    }
    let out = cli(&["dlq", "replay", "native", "--prefix", &p]).ok();
    assert!(out.stdout.contains('1'), "{}", out.stdout);
    assert_eq!(count(&conn, &dlq).await, 0);
    let got = drain(&conn, &q).await;
    assert_eq!(got.len(), 1);
    let h = got[0].properties.headers().clone().unwrap_or_default();
    assert!(
        !h.inner().keys().any(|k| k.as_str().contains("redeliver-")),
        "the retry state is reset: {h:?}"
    );
}
