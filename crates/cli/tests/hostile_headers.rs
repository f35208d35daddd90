//! A DLQ holding messages whose one header nests as deep as a frame of the broker's size allows
//! (`[[[...]]]`, `{k:{k:...}}`): every `dlq` command used to abort on it (lapin's I/O thread
//! overflowed its stack, issue 29). Now each command reads it with the header cut and marked,
//! and exits 0.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/cleanup.rs"]
mod cleanup;
mod common;
#[path = "common/declare.rs"]
mod declare;

use cleanup::{cli, Cleanup};
use common::*;
use declare::declare;
use redeliver_amqp::HEADERS_REMOVED;
use redeliver_testkit::{amqp_url, connect, message_ids, raw_publish, ready_count as count};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_commands_survive_the_deepest_headers() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["hq"]);
    declare("hq", &p, &[]);
    let q = format!("{p}hq");
    let dlq = format!("{q}.dlq");

    let (url, target) = (amqp_url(), dlq.clone());
    tokio::task::spawn_blocking(move || {
        let probe = raw_publish::publish(&url, &target, b"V", b"{}", "shallow")?;
        for (kind, id) in [(b'A', "deep-arrays"), (b'F', "deep-tables")] {
            let depth = raw_publish::deepest(kind, probe.frame_max, id);
            let value = raw_publish::nested(kind, depth);
            raw_publish::publish(&url, &target, &value, b"{\"n\":1}", id)?;
        }
        Ok::<_, String>(())
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("publishing: {e}"));
    assert_eq!(count(&conn, &dlq).await, 3);

    // list, in both output modes. RabbitMQ 4.x takes seconds to hand out each deep message
    // (it converts the header on delivery): the CLI waits for them rather than stop short.
    let table = cli(&["dlq", "list", "hq", "--prefix", &p]).ok();
    assert!(
        table.stdout.contains("deep-arrays"),
        "{}\n{}",
        table.stdout,
        table.stderr
    );
    let json = cli(&["dlq", "list", "hq", "--prefix", &p, "--json"]).ok();
    let listed: Value = serde_json::from_str(&json.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", json.stdout));
    assert_eq!(
        message_ids(&listed),
        ["shallow", "deep-arrays", "deep-tables"]
    );
    assert_eq!(count(&conn, &dlq).await, 3, "listing removed nothing");

    // peek: the cut header and why, bounded output.
    for id in ["deep-arrays", "deep-tables"] {
        let peek = cli(&["dlq", "peek", "hq", id, "--prefix", &p]).ok();
        assert!(peek.stdout.contains(HEADERS_REMOVED), "{}", peek.stdout);
        assert!(
            peek.stdout.contains("removed by redeliver"),
            "{}",
            peek.stdout
        );
        assert!(peek.stdout.len() < 16 * 1024, "{} bytes", peek.stdout.len());
    }

    // replay one: the copy in the queue carries the cut header, no longer deep.
    let one = cli(&[
        "dlq",
        "replay",
        "hq",
        "--prefix",
        &p,
        "--message-id",
        "deep-arrays",
    ])
    .ok();
    assert!(one.stdout.contains("moved 1 message(s)"), "{}", one.stdout);
    assert_eq!(count(&conn, &q).await, 1);
    assert_eq!(count(&conn, &dlq).await, 2);

    // purge the rest.
    let done = cli(&["dlq", "purge", "hq", "--prefix", &p, "--yes"]).ok();
    assert!(
        done.stdout
            .contains(&format!("purged 2 message(s) from '{dlq}'")),
        "{}",
        done.stdout
    );
    assert_eq!(count(&conn, &dlq).await, 0);
}

/// Short strings that are not UTF-8 (properties, a routing key) used to close the CLI's
/// connection at the first such dead letter, so no command got past it. Now they are repaired on
/// receipt and marked, and every command goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_commands_survive_properties_and_routing_keys_that_are_not_utf8() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["uq"]);
    declare("uq", &p, &[]);
    let q = format!("{p}uq");
    let dlq = format!("{q}.dlq");
    let fanout = format!("{p}fanout");
    redeliver_testkit::fanout_to(&conn, &fanout, &dlq).await;

    let (url, target, fan) = (amqp_url(), dlq.clone(), fanout.clone());
    tokio::task::spawn_blocking(move || {
        let json = b"application/json";
        let body = b"{\"n\":1}";
        let id = raw_publish::raw_properties(body.len(), json, b"bad-id-\xff");
        raw_publish::publish_raw(&url, "", target.as_bytes(), &id, body)?;
        let ct = raw_publish::raw_properties(body.len(), b"text/\xc3", b"bad-ct");
        raw_publish::publish_raw(&url, "", target.as_bytes(), &ct, body)?;
        let rk = raw_publish::raw_properties(body.len(), json, b"bad-rk");
        raw_publish::publish_raw(&url, &fan, b"rk.\xfe", &rk, body)?;
        Ok::<_, String>(())
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("publishing: {e}"));
    assert_eq!(count(&conn, &dlq).await, 3);

    let json = cli(&["dlq", "list", "uq", "--prefix", &p, "--json"]).ok();
    let listed: Value = serde_json::from_str(&json.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", json.stdout));
    assert_eq!(message_ids(&listed), ["bad-id-?", "bad-ct", "bad-rk"]);
    let table = cli(&["dlq", "list", "uq", "--prefix", &p]).ok();
    assert!(table.stdout.contains("bad-rk"), "{}", table.stdout);
    let peek = cli(&["dlq", "peek", "uq", "bad-ct", "--prefix", &p]).ok();
    assert!(peek.stdout.contains(HEADERS_REMOVED), "{}", peek.stdout);
    assert!(peek.stdout.contains("content_type"), "{}", peek.stdout);
    assert_eq!(
        count(&conn, &dlq).await,
        3,
        "listing and peeking removed nothing"
    );

    let one = cli(&[
        "dlq",
        "replay",
        "uq",
        "--prefix",
        &p,
        "--message-id",
        "bad-rk",
    ])
    .ok();
    assert!(one.stdout.contains("moved 1 message(s)"), "{}", one.stdout);
    assert_eq!(count(&conn, &q).await, 1);
    let done = cli(&["dlq", "purge", "uq", "--prefix", &p, "--yes"]).ok();
    assert!(
        done.stdout.contains("purged 2 message(s)"),
        "{}",
        done.stdout
    );
    assert_eq!(count(&conn, &dlq).await, 0);
}
