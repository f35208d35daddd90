//! A publish its caller gave up on (a confirm timeout: the future dropped) while the broker
//! blocks the connection is never sent afterwards: once the alarm clears, it does not reach its
//! queue, and the caller, who already treated it as not taken, does not get a duplicate.
//!
//! An alarm stops every publisher of the node, so this runs against a dedicated node
//! (`rddeadline-1@localhost`, AMQP port 5699) started with `scripts/cluster.sh` and removed
//! afterwards; `RD_CLUSTER_CHROOT` picks another RabbitMQ version, as for the other node tests.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use redeliver_amqp::lapin::options::{BasicGetOptions, QueueDeclareOptions};
use redeliver_amqp::lapin::BasicProperties;
use redeliver_amqp::{DelayConfig, Publisher};
use redeliver_testkit::nodes::Nodes;
use redeliver_testkit::reliability::report;
use redeliver_testkit::{connect_guarded, queue_depth, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_abandoned_while_blocked_is_never_sent() {
    let nodes = Nodes::start("rddeadline", 1, 5699, false).await;
    let url = nodes.amqp_url(1);
    let conn = connect_guarded(&url).await;
    // The queue lives on a connection of its own, which publishes nothing, so the alarm does
    // not stop it from counting.
    let observer = connect_guarded(&url).await;
    let queue = format!("{}q", common::prefix());
    let ch = observer.create_channel().await.expect("channel");
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions::default(),
        Default::default(),
    )
    .await
    .expect("declare");

    // Several channels: an abandoned publish may be one a free channel would hand to the
    // connection at once, or one queued behind a channel awaiting its confirms.
    let publisher = Publisher::new(&conn, DelayConfig::new())
        .await
        .expect("publisher");
    // Before the alarm: one publish goes through.
    publisher
        .publish_bytes("", &queue, b"before", BasicProperties::default())
        .await
        .expect("publish before the alarm");

    nodes
        .rabbitmqctl(1, &["set_vm_memory_high_watermark", "0"])
        .await;
    // RabbitMQ blocks a connection (and says so) once it publishes during the alarm: this
    // first publish is written before the notice can arrive, so it may be routed, now or once
    // the alarm clears, whatever its caller decides meanwhile.
    let trigger = tokio::time::timeout(
        Duration::from_secs(2),
        publisher.publish_bytes("", &queue, b"trigger", BasicProperties::default()),
    )
    .await;
    report(format!("the publish that meets the alarm: {trigger:?}"));
    wait_until(
        Duration::from_secs(30),
        "the broker blocks the connection",
        || conn.status().blocked(),
    )
    .await;

    // Abandoned: the caller's deadline passes while the broker blocks the connection.
    for i in 0..6 {
        let body = format!("abandoned-{i}");
        let abandoned = tokio::time::timeout(
            Duration::from_millis(500),
            publisher.publish_bytes("", &queue, body.as_bytes(), BasicProperties::default()),
        )
        .await;
        assert!(abandoned.is_err(), "confirmed while blocked: {abandoned:?}");
    }

    nodes
        .rabbitmqctl(1, &["set_vm_memory_high_watermark", "0.4"])
        .await;
    wait_until(
        Duration::from_secs(30),
        "the broker unblocks the connection",
        || !conn.status().blocked(),
    )
    .await;
    // Whatever lapin still held for the connection is written after the alarm, before this
    // publish; a moment more lets the broker route it on whichever channel it came.
    tokio::time::timeout(
        Duration::from_secs(20),
        publisher.publish_bytes("", &queue, b"after", BasicProperties::default()),
    )
    .await
    .expect("confirmed after the alarm")
    .expect("publish after the alarm");
    tokio::time::sleep(Duration::from_secs(1)).await;

    let depth = queue_depth(&observer, &queue).await.expect("depth").ready;
    let mut bodies = Vec::new();
    for _ in 0..depth {
        match ch
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .expect("get")
        {
            Some(m) => bodies.push(String::from_utf8_lossy(&m.delivery.data).into_owned()),
            None => break,
        }
    }
    report(format!("in the queue after the alarm: {bodies:?}"));
    assert!(
        !bodies.iter().any(|b| b.starts_with("abandoned")),
        "a publish was sent after its caller gave up on it: {bodies:?}"
    );
    assert!(bodies.iter().any(|b| b == "before") && bodies.iter().any(|b| b == "after"));
    ch.queue_delete(queue.as_str().into(), Default::default())
        .await
        .expect("delete");
}
