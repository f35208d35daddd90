//! Dead-lettering through `Q.dlx` -> `Q.dlq`, and the broker's `x-death` record of it.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use redeliver_amqp::headers::x_death;
use redeliver_amqp::lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use redeliver_amqp::lapin::{BasicProperties, Connection};
use redeliver_amqp::QueueType;
use redeliver_amqp::{DelayConfig, Publisher, Topology, TopologyError};
use std::time::Duration;

fn topo(prefix: &str, queue: &str) -> Topology {
    Topology::new(queue)
        .prefix(prefix)
        .delay(DelayConfig::new().prefix(prefix).levels(4))
}

async fn cleanup(conn: &redeliver_amqp::lapin::Connection, t: &Topology) {
    t.delete(conn).await.expect("delete topology");
    t.configured_delay()
        .delete(conn)
        .await
        .expect("delete delay");
}

#[tokio::test]
async fn reject_goes_to_dlq_with_x_death() {
    let p = common::prefix();
    reject_to_dlq(topo(&p, "rej")).await;
}

/// A quorum DLQ gets the same dead letters, and the broker really holds it as quorum: asking for
/// a classic one on top is a typed mismatch.
#[tokio::test]
async fn quorum_dlq_gets_the_dead_letters() {
    let p = common::prefix();
    let t = topo(&p, "qdlq").dlq_queue_type(QueueType::Quorum);
    reject_to_dlq(t.clone()).await;
    let conn = redeliver_testkit::connect().await;
    redeliver_testkit::with_cleanup(
        async {
            t.declare(&conn).await.expect("declare");
            let classic = t.clone().dlq_queue_type(QueueType::Classic);
            match classic.declare(&conn).await {
                Err(TopologyError::Mismatch { object, .. }) => {
                    assert!(object.contains(&t.dlq_name()), "{object}")
                }
                other => panic!("expected a mismatch on {}, got {other:?}", t.dlq_name()),
            }
        },
        cleanup(&conn, &t),
    )
    .await;
}

/// Rejects one message of `t`'s queue and checks it in the DLQ with the broker's `x-death`.
async fn reject_to_dlq(t: Topology) {
    let conn = redeliver_testkit::connect().await;
    redeliver_testkit::with_cleanup(
        async {
            t.declare(&conn).await.unwrap();
            let publisher = Publisher::new(&conn, t.configured_delay().clone())
                .await
                .unwrap();
            let q = t.queue_name();
            publisher
                .publish_bytes(
                    "",
                    &q,
                    b"poison",
                    BasicProperties::default().with_message_id("m-rej".into()),
                )
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            let m = redeliver_testkit::poll_get(&ch, &q, Duration::from_secs(5))
                .await
                .expect("in Q");
            m.reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();

            let dead = redeliver_testkit::poll_get(&ch, &t.dlq_name(), Duration::from_secs(5))
                .await
                .expect("in Q.dlq");
            assert_eq!(dead.data, b"poison");
            assert_eq!(
                dead.properties.message_id().as_ref().unwrap().as_str(),
                "m-rej"
            );
            let deaths = x_death(dead.properties.headers().as_ref());
            println!("{deaths:?}");
            assert_eq!(deaths.len(), 1);
            let d = &deaths[0];
            assert_eq!(d.reason, "rejected");
            assert_eq!(d.queue, q);
            assert_eq!(d.count, 1);
            assert_eq!(d.exchange, "");
            assert_eq!(d.routing_keys, vec![q.clone()]);
            assert!(d.time.is_some());
            dead.ack(BasicAckOptions::default()).await.unwrap();
        },
        cleanup(&conn, &t),
    )
    .await;
}

/// Returns the one message of `q` until it stops coming back: by `basic.nack(requeue)` when
/// `nack`, else by closing the channel it was delivered on (what a crashing worker does). Gives
/// up after `max` deliveries; returns how many there were.
async fn return_until_gone(conn: &Connection, q: &str, nack: bool, max: u32) -> u32 {
    let mut deliveries = 0;
    let mut ch = conn.create_channel().await.unwrap();
    while deliveries < max {
        let Some(m) = redeliver_testkit::poll_get(&ch, q, Duration::from_millis(1500)).await else {
            break;
        };
        deliveries += 1;
        if nack {
            m.nack(BasicNackOptions {
                requeue: true,
                multiple: false,
            })
            .await
            .unwrap();
        } else {
            ch.close(200, "returning".into()).await.unwrap();
            ch = conn.create_channel().await.unwrap();
        }
    }
    let _ = ch.close(200, "done".into()).await;
    deliveries
}

/// The poison guard: a quorum queue dead-letters a message returned more often than
/// `x-delivery-limit`, with x-death reason `delivery_limit`. A return by a closed channel (a
/// crashing worker) counts on every version; a `basic.nack(requeue = true)` counts before 4.3
/// and not from 4.3 (measured: RabbitMQ 3.10.8 and 4.0.5 count it, 4.3.6 does not).
#[tokio::test]
async fn quorum_delivery_limit_dead_letters() {
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    let p = common::prefix();
    let limit = 3;
    let t = topo(&p, "lim").delivery_limit(Some(limit));
    redeliver_testkit::with_cleanup(
        async {
            t.declare(&conn).await.unwrap();
            let publisher = Publisher::new(&conn, t.configured_delay().clone())
                .await
                .unwrap();
            let q = t.queue_name();
            for (nack, body) in [(true, &b"nacked"[..]), (false, &b"crash"[..])] {
                publisher
                    .publish_bytes("", &q, body, BasicProperties::default())
                    .await
                    .unwrap();
                let deliveries = return_until_gone(&conn, &q, nack, 2 * limit + 2).await;
                let how = if nack { "nack(requeue)" } else { "channel close" };
                println!("RabbitMQ {version}: {how}: delivered {deliveries} times with x-delivery-limit = {limit}");
                if nack && !version.requeue_counts_toward_delivery_limit() {
                    assert_eq!(deliveries, 2 * limit + 2, "{version}: nack must not count");
                    // Still there: take it so the close test starts from an empty queue.
                    let ch = ch_for(&conn).await;
                    let m = redeliver_testkit::poll_get(&ch, &q, Duration::from_secs(5))
                        .await
                        .expect("the nacked message is still in Q");
                    assert_eq!(m.data, b"nacked");
                    m.ack(BasicAckOptions::default()).await.unwrap();
                    continue;
                }
                assert_eq!(deliveries, limit + 1, "{version}: {how} must count");
                let ch = ch_for(&conn).await;
                let dead = redeliver_testkit::poll_get(&ch, &t.dlq_name(), Duration::from_secs(5))
                    .await
                    .expect("in Q.dlq");
                let deaths = x_death(dead.properties.headers().as_ref());
                println!("{deaths:?}");
                assert_eq!(deaths[0].reason, "delivery_limit");
                assert_eq!(deaths[0].queue, q);
                assert_eq!(dead.data, body);
                dead.ack(BasicAckOptions::default()).await.unwrap();
            }
        },
        cleanup(&conn, &t),
    )
    .await;
}

async fn ch_for(conn: &Connection) -> redeliver_amqp::lapin::Channel {
    conn.create_channel().await.unwrap()
}

#[tokio::test]
async fn classic_queue_dead_letters_too() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = topo(&p, "cls").classic();
    redeliver_testkit::with_cleanup(
        async {
            t.declare(&conn).await.unwrap();
            t.declare(&conn).await.expect("idempotent");
            let publisher = Publisher::new(&conn, t.configured_delay().clone())
                .await
                .unwrap();
            publisher
                .publish_bytes("", &t.queue_name(), b"c", BasicProperties::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            let m = redeliver_testkit::poll_get(&ch, &t.queue_name(), Duration::from_secs(5))
                .await
                .unwrap();
            m.reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();
            let dead = redeliver_testkit::poll_get(&ch, &t.dlq_name(), Duration::from_secs(5))
                .await
                .unwrap();
            assert_eq!(
                x_death(dead.properties.headers().as_ref())[0].reason,
                "rejected"
            );
        },
        cleanup(&conn, &t),
    )
    .await;
}
