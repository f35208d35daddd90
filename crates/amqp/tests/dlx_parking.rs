//! `Q.dlx` parks, through its alternate exchange, the dead letters `Q.dlq` cannot take; an
//! earlier version's `Q.dlx` without it is used as it is, with a warning.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use redeliver_amqp::lapin::options::{
    BasicPublishOptions, ExchangeDeclareOptions, QueueDeleteOptions,
};
use redeliver_amqp::lapin::types::FieldTable;
use redeliver_amqp::lapin::{BasicProperties, ExchangeKind};
use redeliver_amqp::{DelayConfig, Topology, TopologyWarning};

fn topo(prefix: &str) -> Topology {
    Topology::new("work")
        .prefix(prefix)
        .classic()
        .delay(DelayConfig::new().prefix(prefix).levels(4))
}

/// A classic work queue dead-letters at most once. One consumer rejects (requeue = false) a
/// stream of messages, and `Q.dlq` is deleted half-way through: the first half goes down with
/// `Q.dlq`, every message rejected after it is parked in the delay infrastructure's parking
/// queue. None is lost.
///
/// The consumer holds its next reject until the delete is done: a message the broker routes to
/// `Q.dlq` while the queue is being deleted goes down with it, whatever the alternate exchange
/// (measured on RabbitMQ 4.3.6 with rejects racing the delete: 14 of 400 uncounted, neither in
/// the deleted count nor parked). The alternate exchange is for the time `Q.dlq` is gone.
#[tokio::test]
async fn dead_letters_without_a_dlq_are_parked() {
    use futures::StreamExt as _;
    use redeliver_amqp::lapin::options::{
        BasicConsumeOptions, BasicQosOptions, BasicRejectOptions,
    };
    const N: u32 = 400;
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    let p = common::prefix();
    let _cleanup = redeliver_testkit::Cleanup(p.clone());
    let t = topo(&p);
    let warnings = t.declare_with_warnings(&conn).await.expect("declare");
    assert!(warnings.is_empty(), "{warnings:?}");
    let q = t.queue_name();
    let dlq = t.dlq_name();
    let parking = t.configured_delay().unroutable_name();

    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    for i in 0..N {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            BasicPublishOptions::default(),
            format!("{i}").as_bytes(),
            BasicProperties::default().with_message_id(format!("m{i}").into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }

    let consumer_ch = conn.create_channel().await.unwrap();
    consumer_ch
        .basic_qos(10, BasicQosOptions { global: false })
        .await
        .unwrap();
    let mut consumer = consumer_ch
        .basic_consume(
            q.as_str().into(),
            "rejecter".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut deleted = None;
    for i in 0..N {
        if i == N / 2 {
            // Dead-lettering of a classic queue is asynchronous to the reject.
            redeliver_testkit::wait_count(&conn, &dlq, N / 2, Duration::from_secs(10)).await;
            deleted = Some(
                ch.queue_delete(dlq.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .expect("delete Q.dlq"),
            );
        }
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery")
            .expect("consumer open")
            .expect("delivery");
        d.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .expect("reject");
    }
    let deleted = deleted.expect("deleted half-way");
    assert_eq!(deleted, N / 2);
    redeliver_testkit::wait_count(&conn, &parking, N - deleted, Duration::from_secs(10)).await;
    let got = redeliver_testkit::drain_queue(&conn, &parking).await;
    println!(
        "RabbitMQ {version}: {N} rejected, {deleted} deleted with {dlq}, {} parked",
        got.len()
    );
    let mut ids: Vec<&str> = got.iter().map(|g| g.message_id()).collect();
    ids.sort_by_key(|id| id[1..].parse::<u32>().unwrap_or(u32::MAX));
    ids.dedup();
    let expected: Vec<String> = (N / 2..N).map(|i| format!("m{i}")).collect();
    assert_eq!(
        ids, expected,
        "RabbitMQ {version}: every message rejected after the delete, once"
    );
    assert_eq!(
        got[0].header_str("x-first-death-reason").as_deref(),
        Some("rejected")
    );
}

/// A `Q.dlx` declared by an earlier version, without the alternate exchange: the declare goes
/// on (with a warning naming the migration), a second declare too, and deleting `Q.dlx` then
/// declaring again gives it the alternate exchange.
#[tokio::test]
async fn earlier_dlx_without_alternate_exchange_is_a_warning() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let _cleanup = redeliver_testkit::Cleanup(p.clone());
    let t = topo(&p);
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        t.dlx_name().as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    for _ in 0..2 {
        let warnings = t.declare_with_warnings(&conn).await.expect("declare");
        match warnings.as_slice() {
            [w @ TopologyWarning::DlxWithoutAlternateExchange { dlx, .. }] => {
                assert_eq!(dlx, &t.dlx_name());
                println!("{w}");
            }
            other => panic!("expected one warning, got {other:?}"),
        }
    }
    t.declare(&conn)
        .await
        .expect("declare logs the warning and goes on");
    t.verify(&conn).await.expect("verify");
    assert!(ch.status().connected(), "the caller's channel is untouched");

    ch.exchange_delete(t.dlx_name().as_str().into(), Default::default())
        .await
        .unwrap();
    let warnings = t.declare_with_warnings(&conn).await.expect("declare");
    assert!(warnings.is_empty(), "migrated: {warnings:?}");
}
