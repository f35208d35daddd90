//! A returned (unroutable) mandatory publish is reported as returned to the publish it belongs
//! to, also while many publishes share one [`Publisher`] and confirms come back in batches.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use futures::future::join_all;
use redeliver_amqp::lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
use redeliver_amqp::lapin::types::FieldTable;
use redeliver_amqp::lapin::{BasicProperties, ExchangeKind};
use redeliver_amqp::{DelayConfig, PublishError, Publisher};

/// Declares exchange `ex` of `kind` and queue `q`, bound with `key` and `arguments`.
async fn bind_queue(
    conn: &redeliver_amqp::lapin::Connection,
    ex: &str,
    kind: ExchangeKind,
    q: &str,
    key: &str,
    arguments: FieldTable,
) {
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        ex.into(),
        kind,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(q.into(), Default::default(), Default::default())
        .await
        .unwrap();
    ch.queue_bind(
        q.into(),
        ex.into(),
        key.into(),
        QueueBindOptions::default(),
        arguments,
    )
    .await
    .unwrap();
}

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
    bind_queue(
        &conn,
        &ex,
        ExchangeKind::Direct,
        &q,
        "routable",
        FieldTable::default(),
    )
    .await;

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

/// The same through a headers exchange, where one exchange and one routing key route some
/// messages and return others, by a header: the publisher must tell the returned ones by the
/// whole message (properties included), not by exchange and key. Identical bodies, so that only
/// the properties tell them apart.
#[tokio::test]
async fn returns_are_told_apart_by_their_properties() {
    use redeliver_amqp::lapin::types::AMQPValue;
    const N: usize = 300;
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    let p = common::prefix();
    let _cleanup = redeliver_testkit::Cleanup(p.clone());
    let ex = format!("{p}headers");
    let q = format!("{p}wanted");
    let mut binding = FieldTable::default();
    binding.insert("x-match".into(), AMQPValue::LongString("all".into()));
    binding.insert("route".into(), AMQPValue::LongString("yes".into()));
    bind_queue(&conn, &ex, ExchangeKind::Headers, &q, "", binding).await;

    let publisher = Publisher::new(&conn, DelayConfig::new().prefix(p.clone()))
        .await
        .unwrap();
    let results = join_all((0..N).map(|i| {
        let publisher = publisher.clone();
        let ex = ex.clone();
        async move {
            let mut headers = FieldTable::default();
            let route = if i % 3 == 0 { "no" } else { "yes" };
            headers.insert("route".into(), AMQPValue::LongString(route.into()));
            let props = BasicProperties::default()
                .with_message_id(format!("m{i}").into())
                .with_headers(headers);
            (
                i,
                publisher.publish_copy(&ex, "", b"same body", props).await,
            )
        }
    }))
    .await;
    let wrong: Vec<String> = results
        .iter()
        .filter(|(i, r)| {
            !matches!(
                (i % 3 == 0, r),
                (true, Err(PublishError::Returned { .. })) | (false, Ok(()))
            )
        })
        .map(|(i, r)| format!("#{i}: {r:?}"))
        .collect();
    assert!(
        wrong.is_empty(),
        "RabbitMQ {version}: {} of {N} publishes reported wrongly, e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    let depth = redeliver_testkit::queue_depth(&conn, &q).await.unwrap();
    assert_eq!(
        depth.ready as usize,
        N - N.div_ceil(3),
        "every routed one arrived once"
    );
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
    // The same with raw lapin: one confirm channel, every publish awaiting its own confirm.
    let raw = conn.create_channel().await.unwrap();
    raw.confirm_select(Default::default()).await.unwrap();
    let started = Instant::now();
    let failed = stream::iter(0..TOTAL)
        .map(|i| {
            let raw = raw.clone();
            let q = q.clone();
            async move {
                let confirm = raw
                    .basic_publish(
                        "".into(),
                        q.as_str().into(),
                        redeliver_amqp::lapin::options::BasicPublishOptions {
                            mandatory: true,
                            immediate: false,
                        },
                        format!("{i}").as_bytes(),
                        BasicProperties::default().with_delivery_mode(2),
                    )
                    .await;
                match confirm {
                    Ok(c) => !matches!(c.await, Ok(redeliver_amqp::lapin::Confirmation::Ack(None))),
                    Err(_) => true,
                }
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .filter(|failed| std::future::ready(*failed))
        .count()
        .await;
    let raw_elapsed = started.elapsed();
    assert_eq!(failed, 0);
    eprintln!(
        "RabbitMQ {version}: raw lapin, one channel: {TOTAL} in {raw_elapsed:?} ({:.0}/s)",
        TOTAL as f64 / raw_elapsed.as_secs_f64()
    );

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
