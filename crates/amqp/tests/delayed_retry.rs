//! RabbitMQ 4.3's delayed retry of failed deliveries (`x-delayed-retry-type`), which native
//! retry mode declares so that a crash loop backs off too; and queues declared earlier, with
//! or without it, keep working.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use redeliver_amqp::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use redeliver_amqp::lapin::BasicProperties;
use redeliver_amqp::{DelayConfig, Topology, TopologyWarning};

fn topo(prefix: &str) -> Topology {
    Topology::new("orders").prefix(prefix).delay(
        DelayConfig::new()
            .prefix(prefix)
            .levels(2)
            .queue_type(redeliver_amqp::QueueType::Classic),
    )
}

async fn cleanup(conn: &redeliver_amqp::lapin::Connection, t: &Topology) {
    t.delete(conn).await.expect("delete topology");
    t.configured_delay()
        .delete(conn)
        .await
        .expect("delete delay");
}

/// Delivers the queue's one message over AMQP 0-9-1 and closes the channel without settling it
/// (what a crashed consumer does), then times how long until the broker delivers it again.
async fn crash_and_time_redelivery(
    conn: &redeliver_amqp::lapin::Connection,
    queue: &str,
) -> Duration {
    let ch = conn.create_channel().await.unwrap();
    let got = redeliver_testkit::poll_get(&ch, queue, Duration::from_secs(5)).await;
    assert!(got.is_some(), "the message is there");
    ch.close(200, "crash".into()).await.unwrap();
    let crashed = Instant::now();
    let ch = conn.create_channel().await.unwrap();
    let again = redeliver_testkit::poll_get(&ch, queue, Duration::from_secs(10)).await;
    assert!(again.is_some(), "the message came back");
    let _ = ch.close(200, "ok".into()).await;
    crashed.elapsed()
}

async fn publish_one(conn: &redeliver_amqp::lapin::Connection, queue: &str) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        b"crash me",
        BasicProperties::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let _ = ch.close(200, "ok".into()).await;
}

#[tokio::test]
async fn a_crash_loop_backs_off_where_the_queue_is_declared_for_it() {
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    if !version.holds_native_retries() {
        // Before 4.3 native retry is never chosen, so the worker never declares the argument.
        return assert!(version < redeliver_amqp::BrokerVersion::new(4, 3, 0));
    }
    let p = common::prefix();
    let t = topo(&p).delayed_retry(Duration::from_millis(700), Duration::from_secs(5));
    redeliver_testkit::with_cleanup(
        async {
            assert!(t.declare_with_warnings(&conn).await.unwrap().is_empty());
            let q = t.queue_name();
            publish_one(&conn, &q).await;
            let backoff = crash_and_time_redelivery(&conn, &q).await;
            assert!(
                backoff >= Duration::from_millis(600),
                "a failed delivery came back after {backoff:?}, not min x delivery count"
            );
        },
        cleanup(&conn, &t),
    )
    .await;
}

#[tokio::test]
async fn existing_queues_keep_their_delayed_retry_arguments_in_both_directions() {
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    if !version.holds_native_retries() {
        return assert!(version < redeliver_amqp::BrokerVersion::new(4, 3, 0));
    }
    // Declared without, then with: native retry on a queue of an earlier version.
    let p = common::prefix();
    let plain = topo(&p);
    let native = plain
        .clone()
        .delayed_retry(Duration::from_secs(1), Duration::from_secs(60));
    redeliver_testkit::with_cleanup(
        async {
            plain.declare(&conn).await.unwrap();
            let warnings = native.declare_with_warnings(&conn).await.unwrap();
            assert!(
                matches!(&warnings[..], [TopologyWarning::QueueWithoutDelayedRetry { queue }] if *queue == plain.queue_name()),
                "{warnings:?}"
            );
            assert!(warnings[0].to_string().contains("set_policy"));
            native.verify(&conn).await.unwrap();
        },
        cleanup(&conn, &plain),
    )
    .await;
    // Declared with, then without: a worker in levels mode, or the CLI, on a native queue.
    let p = common::prefix();
    let plain = topo(&p);
    let native = plain
        .clone()
        .delayed_retry(Duration::from_secs(1), Duration::from_secs(60));
    redeliver_testkit::with_cleanup(
        async {
            native.declare(&conn).await.unwrap();
            assert!(plain.declare_with_warnings(&conn).await.unwrap().is_empty());
            let q = plain.queue_name();
            publish_one(&conn, &q).await;
            // Still the queue with the arguments: a crash backs off.
            assert!(crash_and_time_redelivery(&conn, &q).await >= Duration::from_millis(900));
        },
        cleanup(&conn, &plain),
    )
    .await;
}
