//! A returned (unroutable) mandatory publish is reported as returned to the publish it belongs
//! to, also while many publishes share one [`Publisher`] and confirms come back in batches.
mod common;

use std::time::{Duration, Instant};

use futures::future::join_all;
use redeliver_amqp::lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
use redeliver_amqp::lapin::types::FieldTable;
use redeliver_amqp::lapin::{BasicProperties, ExchangeKind};
use redeliver_amqp::{DelayConfig, PublishError, Publisher};

/// One publisher, `N` concurrent mandatory publishes to an exchange without an alternate
/// exchange: the odd ones use a key bound to nothing, the even ones a bound key. Every odd one
/// must fail with `Returned`, every even one succeed, several rounds in a row (the mismatch of a
/// return with another publish's confirm depends on how the broker batches its acks).
#[tokio::test]
async fn returns_reach_their_own_publish_under_concurrency() {
    const N: usize = 400;
    const ROUNDS: usize = 5;
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    let p = common::prefix();
    let _cleanup = redeliver_testkit::Cleanup(p.clone());
    let ex = format!("{p}direct");
    let q = format!("{p}bound");
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        ex.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(q.as_str().into(), Default::default(), Default::default())
        .await
        .unwrap();
    ch.queue_bind(
        q.as_str().into(),
        ex.as_str().into(),
        "routable".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();

    let publisher = Publisher::new(&conn, DelayConfig::new().prefix(p.clone()))
        .await
        .unwrap();
    let started = Instant::now();
    for round in 0..ROUNDS {
        let results = join_all((0..N).map(|i| {
            let publisher = publisher.clone();
            let ex = ex.clone();
            async move {
                let key = if i % 2 == 1 { "nowhere" } else { "routable" };
                let body = format!("{round}-{i}");
                let r = publisher
                    .publish_bytes(&ex, key, body.as_bytes(), BasicProperties::default())
                    .await;
                (i, r)
            }
        }))
        .await;
        let mut wrong = Vec::new();
        for (i, r) in &results {
            match (i % 2 == 1, r) {
                (true, Err(PublishError::Returned { routing_key, .. })) => {
                    assert_eq!(routing_key, "nowhere");
                }
                (false, Ok(())) => {}
                (unroutable, other) => {
                    wrong.push(format!("#{i} unroutable={unroutable}: {other:?}"))
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "RabbitMQ {version}, round {round}: {} of {N} publishes reported wrongly, e.g. {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
    }
    let elapsed = started.elapsed();
    eprintln!(
        "RabbitMQ {version}: {} mandatory publishes (half returned) in {elapsed:?}",
        N * ROUNDS
    );
    let depth = redeliver_testkit::queue_depth(&conn, &q).await.unwrap();
    assert_eq!(
        depth.ready as usize,
        N / 2 * ROUNDS,
        "every routable one arrived once"
    );
    let _ = Duration::ZERO;
}

/// Throughput of one shared publisher with many confirms in flight (`--ignored`; prints the
/// rate): 5000 persistent messages to a quorum queue, 200 publishes at a time.
#[tokio::test]
#[ignore = "a measurement, not a check"]
async fn shared_publisher_throughput() {
    use futures::stream::{self, StreamExt as _};
    const TOTAL: usize = 5000;
    const IN_FLIGHT: usize = 200;
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    let p = common::prefix();
    let _cleanup = redeliver_testkit::Cleanup(p.clone());
    let q = format!("{p}quorum");
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        redeliver_amqp::lapin::types::AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare(
        q.as_str().into(),
        redeliver_amqp::lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    let publisher = Publisher::new(&conn, DelayConfig::new().prefix(p.clone()))
        .await
        .unwrap();
    let started = Instant::now();
    let failed = stream::iter(0..TOTAL)
        .map(|i| {
            let publisher = publisher.clone();
            let q = q.clone();
            async move {
                publisher
                    .publish_bytes(
                        "",
                        &q,
                        format!("{i}").as_bytes(),
                        BasicProperties::default(),
                    )
                    .await
                    .is_err()
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .filter(|failed| std::future::ready(*failed))
        .count()
        .await;
    let elapsed = started.elapsed();
    assert_eq!(failed, 0);
    eprintln!(
        "RabbitMQ {version}: {TOTAL} confirmed publishes, {IN_FLIGHT} in flight, in {elapsed:?} ({:.0}/s)",
        TOTAL as f64 / elapsed.as_secs_f64()
    );
}
