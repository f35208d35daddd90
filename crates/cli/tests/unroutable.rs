//! `unroutable list|replay|purge`: the parking queue of the delay infrastructure (a quorum
//! queue, so these tests also check that listing keeps a quorum queue's order).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/cleanup.rs"]
mod cleanup;
mod common;
#[path = "common/declare.rs"]
mod declare;

use std::time::Duration;

use cleanup::{cli, Cleanup};
use common::*;
use declare::declare;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use redeliver_amqp::headers::{self, RetryState};
use redeliver_amqp::{DelayConfig, Publisher};
use redeliver_testkit::{
    connect, drain, message_id, message_ids, ready_count as count, wait_count,
};
use serde_json::Value;

fn list(prefix: &str, extra: &[&str]) -> Value {
    let levels = LEVELS.to_string();
    let mut args = vec![
        "unroutable",
        "list",
        "--prefix",
        prefix,
        "--levels",
        &levels,
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = cli(&args).ok();
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", out.stdout))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_messages_are_listed_and_replayed_to_their_destination() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["home", "gone"]);
    // Declares the delay infrastructure; "gone" is not declared yet, so delayed copies for it
    // reach the deliver exchange, match no binding and are parked by the alternate exchange.
    declare("home", &p, &[]);
    let cfg = DelayConfig::new().prefix(p.clone()).levels(LEVELS);
    let parking = cfg.unroutable_name();
    let gone = format!("{p}gone");
    let publisher = Publisher::new(&conn, cfg.clone()).await.unwrap();
    let ids: Vec<String> = (0..4).map(|i| format!("parked-{i}")).collect();
    for id in &ids {
        let mut h = FieldTable::default();
        RetryState {
            attempt: 1,
            last_error: Some("flaky".into()),
            ..RetryState::default()
        }
        .write(&mut h);
        h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_headers(h);
        publisher
            .publish_delayed(&gone, Duration::from_millis(30), id.as_bytes(), props)
            .await
            .unwrap();
    }
    wait_count(&conn, &parking, 4, Duration::from_secs(10)).await;

    let listed = list(&p, &[]);
    assert_eq!(message_ids(&listed), ids, "parking order kept");
    for m in listed.as_array().unwrap() {
        assert_eq!(m["destination"], gone.as_str(), "{m}");
        assert_eq!(m["attempts"], 1, "{m}");
    }
    assert_eq!(
        message_ids(&list(&p, &[])),
        ids,
        "quorum queue order kept after a listing"
    );
    assert_eq!(
        message_ids(&list(&p, &["--queue", "nobody"])),
        Vec::<String>::new()
    );
    assert_eq!(count(&conn, &parking).await, 4);

    let levels = LEVELS.to_string();
    let base = ["unroutable", "replay", "--prefix", &p, "--levels", &levels];

    // The destination still does not exist: nothing moves, exit 1, the queue is named.
    let out = cli(&base);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr
            .contains(&format!("queue '{gone}' does not exist")),
        "{}",
        out.stderr
    );
    assert_eq!(count(&conn, &parking).await, 4);
    assert_eq!(
        message_ids(&list(&p, &[])),
        ids,
        "order kept after a failed replay"
    );

    declare("gone", &p, &[]);
    let mut one = base.to_vec();
    one.extend_from_slice(&["--message-id", "parked-1"]);
    let out = cli(&one).ok();
    assert!(out.stdout.contains("moved 1 message(s)"), "{}", out.stdout);
    let out = cli(&base).ok();
    assert!(out.stdout.contains("moved 3 message(s)"), "{}", out.stdout);
    assert_eq!(count(&conn, &parking).await, 0);

    let arrived = drain(&conn, &gone).await;
    let got: Vec<String> = arrived
        .iter()
        .map(|m| message_id(&m.delivery.properties))
        .collect();
    assert_eq!(got, ["parked-1", "parked-0", "parked-2", "parked-3"]);
    for m in &arrived {
        let h = m.delivery.properties.headers().as_ref();
        // Parked copies were mid-retry: their retry state is kept, the hops' x-death is not.
        assert_eq!(RetryState::read(h).attempt, 1);
        assert!(headers::x_death(h).is_empty());
        assert_eq!(
            m.delivery.data,
            message_id(&m.delivery.properties).into_bytes()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_of_the_parking_queue_requires_yes() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["home"]);
    declare("home", &p, &[]);
    let cfg = DelayConfig::new().prefix(p.clone()).levels(LEVELS);
    let publisher = Publisher::new(&conn, cfg.clone()).await.unwrap();
    publisher
        .publish_delayed(
            &format!("{p}nowhere"),
            Duration::ZERO,
            b"x",
            BasicProperties::default(),
        )
        .await
        .unwrap();
    wait_count(&conn, &cfg.unroutable_name(), 1, Duration::from_secs(10)).await;
    let levels = LEVELS.to_string();
    let out = cli(&["unroutable", "purge", "--prefix", &p, "--levels", &levels]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("--yes"));
    assert_eq!(count(&conn, &cfg.unroutable_name()).await, 1);
    let out = cli(&[
        "unroutable",
        "purge",
        "--prefix",
        &p,
        "--levels",
        &levels,
        "--yes",
    ])
    .ok();
    assert!(out.stdout.contains("purged 1 message(s)"), "{}", out.stdout);
}

/// `unroutable purge --queue Q` removes only the messages parked for Q; the others stay, in
/// their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_with_a_queue_filter_removes_only_that_destination() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["home"]);
    declare("home", &p, &[]);
    let cfg = DelayConfig::new().prefix(p.clone()).levels(LEVELS);
    let parking = cfg.unroutable_name();
    let publisher = Publisher::new(&conn, cfg.clone()).await.unwrap();
    let parked = [
        ("a-0", "gone-a"),
        ("b-0", "gone-b"),
        ("a-1", "gone-a"),
        ("b-1", "gone-b"),
        ("b-2", "gone-b"),
    ];
    for (id, dest) in parked {
        let props = BasicProperties::default().with_message_id(id.into());
        publisher
            .publish_delayed(&format!("{p}{dest}"), Duration::ZERO, id.as_bytes(), props)
            .await
            .unwrap();
    }
    wait_count(&conn, &parking, 5, Duration::from_secs(10)).await;
    let levels = LEVELS.to_string();
    let gone_a = format!("{p}gone-a");
    let out = cli(&[
        "unroutable",
        "purge",
        "--prefix",
        &p,
        "--levels",
        &levels,
        "--queue",
        &gone_a,
        "--yes",
    ])
    .ok();
    assert!(out.stdout.contains("purged 2 message(s)"), "{}", out.stdout);
    assert!(out.stdout.contains("kept 3"), "{}", out.stdout);
    assert_eq!(
        message_ids(&list(&p, &[])),
        ["b-0", "b-1", "b-2"],
        "the rest, in order"
    );
    let nobody = format!("{p}nobody");
    let out = cli(&[
        "unroutable",
        "purge",
        "--prefix",
        &p,
        "--levels",
        &levels,
        "--queue",
        &nobody,
        "--yes",
    ])
    .ok();
    assert!(out.stdout.contains("purged 0 message(s)"), "{}", out.stdout);
    assert_eq!(count(&conn, &parking).await, 3);
}
