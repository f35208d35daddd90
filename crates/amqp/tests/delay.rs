//! The binary delay levels against the real broker: accuracy, no head-of-line blocking,
//! properties kept, unroutable parking.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use futures::StreamExt;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use redeliver_amqp::headers::{self, RetryState};
use redeliver_amqp::lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicRejectOptions};
use redeliver_amqp::lapin::types::{AMQPValue, ByteArray, FieldArray, FieldTable, LongString};
use redeliver_amqp::lapin::{BasicProperties, Channel, Connection, Consumer};
use redeliver_amqp::{DelayConfig, PublishError, Publisher, Topology};
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Declaring and deleting dozens of quorum queues loads a small broker; timing measurements
/// (read) never overlap it (write) within this test binary.
static BROKER_BUSY: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

async fn setup(conn: &Connection, t: &Topology) -> Publisher {
    let _busy = BROKER_BUSY.write().await;
    t.declare(conn).await.expect("declare");
    Publisher::new(conn, t.configured_delay().clone())
        .await
        .expect("publisher")
}

async fn cleanup(conn: &Connection, t: &Topology) {
    let _busy = BROKER_BUSY.write().await;
    t.delete(conn).await.expect("delete topology");
    t.configured_delay()
        .delete(conn)
        .await
        .expect("delete delay");
}

/// Publishes `delays` (in the given order) with the index as message_id; returns, per index,
/// arrival time minus publish start.
async fn run_batch(conn: &Connection, t: &Topology, delays: &[Duration]) -> Vec<(usize, Duration)> {
    let publisher = setup(conn, t).await;
    let ch = conn.create_channel().await.unwrap();
    let mut consumer = consume(&ch, &t.queue_name()).await;
    let _measuring = BROKER_BUSY.read().await;
    // Arrivals are timed by a task of their own, running while the publishes below still wait
    // for their confirms: timed after the publish loop instead, a message due before the loop
    // ends (the 0 ms one) looked 60-100 ms late on a busy broker.
    let expected = delays.len();
    let longest = delays.iter().max().copied().unwrap_or_default();
    let receiver = tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + longest + Duration::from_secs(10);
        let mut received = Vec::with_capacity(expected);
        while received.len() < expected {
            let next = tokio::time::timeout_at(deadline, consumer.next())
                .await
                .unwrap_or_else(|_| panic!("only {} of {expected} arrived", received.len()))
                .expect("consumer ended")
                .expect("delivery");
            let now = Instant::now();
            let id = next
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .as_str()
                .to_owned();
            received.push((id, now));
            next.ack(BasicAckOptions::default()).await.unwrap();
        }
        received
    });
    let mut sent = HashMap::new();
    for (i, d) in delays.iter().enumerate() {
        let props = BasicProperties::default().with_message_id(i.to_string().into());
        sent.insert(i.to_string(), Instant::now());
        publisher
            .publish_delayed(&t.queue_name(), *d, b"x", props)
            .await
            .expect("publish_delayed");
    }
    let received = match receiver.await {
        Ok(received) => received,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    let arrivals = received
        .into_iter()
        .map(|(id, at)| (id.parse().unwrap(), at - sent[&id]))
        .collect();
    // A later batch on the same queue must not lose deliveries to this consumer.
    ch.close(200, "batch done".into())
        .await
        .expect("close channel");
    arrivals
}

/// The delays of one measured batch: the level boundaries plus ten random ones, shuffled.
fn accuracy_delays(rng: &mut rand::rngs::StdRng) -> Vec<Duration> {
    let mut delays: Vec<Duration> = [0, 30, 250, 1000, 3300].into_iter().map(ms).collect();
    for _ in 0..10 {
        delays.push(Duration::from_micros(rng.random_range(0..3_300_000)));
    }
    delays.shuffle(rng);
    delays
}

/// Messages outside the bound, as (intended delay, observed delay).
type Misses = Vec<(Duration, Duration)>;

/// Prints one line per message and returns the messages that came early and those that came
/// later than the bound (50 ms + 2 % of the delay).
fn judge(delays: &[Duration], arrivals: &[(usize, Duration)]) -> (Misses, Misses) {
    let mut errors = Vec::new();
    let (mut early, mut late) = (Vec::new(), Vec::new());
    for (i, took) in arrivals {
        let d = delays[*i];
        let bound = d + ms(50) + d / 50;
        let err_ms = took.as_secs_f64() * 1e3 - d.as_secs_f64() * 1e3;
        println!(
            "delay {:>9.3} ms  arrived after {:>9.3} ms  error {:+7.3} ms (bound +{:.1} ms)",
            d.as_secs_f64() * 1e3,
            took.as_secs_f64() * 1e3,
            err_ms,
            (bound - d).as_secs_f64() * 1e3
        );
        errors.push(err_ms);
        if *took < d {
            early.push((d, *took));
        } else if *took > bound {
            late.push((d, *took));
        }
    }
    errors.sort_by(f64::total_cmp);
    println!(
        "{} messages, error min {:.1} ms, p50 {:.1} ms, max {:.1} ms",
        errors.len(),
        errors[0],
        errors[errors.len() / 2],
        errors[errors.len() - 1]
    );
    (early, late)
}

/// Runs batches of `next_delays()` until one arrives entirely within the bound and in the
/// order `in_order` accepts; three at most.
///
/// An early message is a wrong level or TTL, whatever the host does: it fails at once. A late
/// one (or an order shuffled by a burst) can also be the host: with three brokers and the tests
/// on two cores, a broker node was seen to stall for 350 ms, holding back every message due in
/// that window (CI, RabbitMQ 4.3.6), and a busy host was seen to stall two batches in a row
/// (RabbitMQ 4.0.5, another build running). Further batches tell the two apart: a stall does
/// not repeat on demand, a wrong delay or a head-of-line block does.
async fn until_a_batch_passes(
    conn: &Connection,
    t: &Topology,
    mut next_delays: impl FnMut() -> Vec<Duration>,
    in_order: impl Fn(&[usize]) -> bool,
) {
    let mut failed_batches = Vec::new();
    for batch in 1..=3 {
        let delays = next_delays();
        let arrivals = run_batch(conn, t, &delays).await;
        let order: Vec<usize> = arrivals.iter().map(|(i, _)| *i).collect();
        println!("batch {batch}: arrival order (indices into {delays:?}): {order:?}");
        let (early, late) = judge(&delays, &arrivals);
        assert!(
            early.is_empty(),
            "batch {batch}: came early (delay, took): {early:?}"
        );
        if late.is_empty() && in_order(&order) {
            return;
        }
        println!("batch {batch}: {} late beyond the bound", late.len());
        failed_batches.push((order, late));
    }
    panic!(
        "late beyond the bound or out of order in every batch (order, late as (delay, took)): \
         {failed_batches:?}"
    );
}

#[tokio::test]
async fn delays_are_accurate() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = Topology::new("acc").prefix(&p);
    // DELAY_SEED reproduces a run; the seed is printed either way.
    let seed: u64 = std::env::var("DELAY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| uuid::Uuid::new_v4().as_u64_pair().0);
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    redeliver_testkit::with_cleanup(
        async {
            until_a_batch_passes(&conn, &t, || accuracy_delays(&mut rng), |_| true).await;
        },
        cleanup(&conn, &t),
    )
    .await;
}

#[tokio::test]
async fn short_delays_overtake_long_ones() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = Topology::new("hol").prefix(&p);
    // Long ones first, sharing low levels (bit 0 set) with the short ones that follow.
    let delays: Vec<Duration> = [2550, 2010, 2000, 10, 30, 100, 250]
        .into_iter()
        .map(ms)
        .collect();
    redeliver_testkit::with_cleanup(
        async {
            until_a_batch_passes(
                &conn,
                &t,
                || delays.clone(),
                |order| order == [3, 4, 5, 6, 2, 1, 0],
            )
            .await;
        },
        cleanup(&conn, &t),
    )
    .await;
}

fn user_headers() -> FieldTable {
    let mut nested = FieldTable::default();
    nested.insert("inner".into(), AMQPValue::LongString("v".into()));
    let mut h = FieldTable::default();
    h.insert(
        "tenant".into(),
        AMQPValue::LongString("acme ünï \u{1F600}".into()),
    );
    h.insert(
        "raw".into(),
        AMQPValue::LongString(LongString::from(vec![0u8, 255, 1, 254])),
    );
    h.insert("n".into(), AMQPValue::LongLongInt(-42));
    h.insert("i".into(), AMQPValue::LongInt(7));
    h.insert("flag".into(), AMQPValue::Boolean(true));
    h.insert("when".into(), AMQPValue::Timestamp(1_700_000_000));
    h.insert("nested".into(), AMQPValue::FieldTable(nested));
    h.insert(
        "list".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongString("a".into()),
            AMQPValue::LongLongInt(1),
        ])),
    );
    h.insert(
        "bytes".into(),
        AMQPValue::ByteArray(ByteArray::from(vec![1u8, 2, 3])),
    );
    h
}

#[tokio::test]
async fn properties_and_headers_survive_the_levels_and_reach_the_dlq() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = Topology::new("props")
        .prefix(&p)
        .delay(DelayConfig::new().prefix(&p).levels(8));
    redeliver_testkit::with_cleanup(
        async {
            let publisher = setup(&conn, &t).await;
            let state = RetryState {
                attempt: 2,
                first_failed_at: Some(headers::now_rfc3339()),
                last_error: Some("db: connection refused".into()),
                original_exchange: Some("uploads".into()),
                original_routing_key: Some("image.png".into()),
                delay: Some(ms(70)),
                not_before_ms: None,
            };
            let mut h = user_headers();
            state.write(&mut h);
            let body: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
            let props = BasicProperties::default()
                .with_message_id("mid-1".into())
                .with_content_type("application/x-test".into())
                .with_content_encoding("identity".into())
                .with_correlation_id("corr-9".into())
                .with_timestamp(1_600_000_000)
                .with_headers(h.clone());
            // 70 ms = 7 ticks: three levels, three dead-letter hops.
            publisher
                .publish_delayed(&t.queue_name(), ms(70), &body, props)
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            let got = redeliver_testkit::poll_get(&ch, &t.queue_name(), Duration::from_secs(5))
                .await
                .expect("arrived");
            assert_eq!(got.data, body);
            let gp = &got.properties;
            assert_eq!(gp.message_id().as_ref().unwrap().as_str(), "mid-1");
            assert_eq!(
                gp.content_type().as_ref().unwrap().as_str(),
                "application/x-test"
            );
            assert_eq!(gp.content_encoding().as_ref().unwrap().as_str(), "identity");
            assert_eq!(gp.correlation_id().as_ref().unwrap().as_str(), "corr-9");
            assert_eq!(*gp.timestamp(), Some(1_600_000_000));
            assert_eq!(*gp.delivery_mode(), Some(2));
            let gh = gp.headers().as_ref().expect("headers");
            for (k, v) in h.inner() {
                assert_eq!(gh.inner().get(k), Some(v), "header {k}");
            }
            assert_eq!(RetryState::read(Some(gh)), state);
            let deaths = headers::x_death(Some(gh));
            println!("x-death after the levels: {deaths:?}");
            assert_eq!(deaths.len(), 3, "one entry per level passed");
            assert!(deaths.iter().all(|d| d.reason == "expired"));

            // A retry copy built from it drops the broker's history but keeps the rest.
            let copy = headers::retry_copy_headers(Some(gh), &state);
            assert!(!copy.contains_key("x-death"));
            assert_eq!(RetryState::read(Some(&copy)), state);

            // Rejected, it reaches the DLQ with our headers intact.
            got.reject(BasicRejectOptions { requeue: false })
                .await
                .unwrap();
            let dead = redeliver_testkit::poll_get(&ch, &t.dlq_name(), Duration::from_secs(5))
                .await
                .expect("in dlq");
            let dh = dead.properties.headers().as_ref().unwrap();
            assert_eq!(RetryState::read(Some(dh)), state);
            assert_eq!(dead.data, body);
            for (k, v) in user_headers().inner() {
                assert_eq!(dh.inner().get(k), Some(v), "header {k} in dlq");
            }
            dead.ack(BasicAckOptions::default()).await.unwrap();
        },
        cleanup(&conn, &t),
    )
    .await;
}

#[tokio::test]
async fn unroutable_destination_is_parked_and_mandatory_publish_returns() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = Topology::new("park")
        .prefix(&p)
        .delay(DelayConfig::new().prefix(&p).levels(6));
    redeliver_testkit::with_cleanup(
        async {
            let publisher = setup(&conn, &t).await;
            let ghost = format!("{p}no-such-queue");
            // Confirmed: the broker holds it in the levels.
            for d in [0, 50] {
                publisher
                    .publish_delayed(&ghost, ms(d), b"lost?", BasicProperties::default())
                    .await
                    .expect("publish_delayed to a missing queue is still confirmed");
            }
            let ch = conn.create_channel().await.unwrap();
            for _ in 0..2 {
                let parked = redeliver_testkit::poll_get(
                    &ch,
                    &t.configured_delay().unroutable_name(),
                    Duration::from_secs(5),
                )
                .await
                .expect("parked in the unroutable queue");
                assert_eq!(parked.data, b"lost?");
                parked.ack(BasicAckOptions::default()).await.unwrap();
            }

            // A direct publish nobody receives is an error, not a silent ack.
            match publisher
                .publish_bytes("", &ghost, b"x", BasicProperties::default())
                .await
            {
                Err(PublishError::Returned { reply_code, .. }) => assert_eq!(reply_code, 312),
                other => panic!("expected Returned, got {other:?}"),
            }
            // Over-max delays are refused before publishing.
            let too_long = t.configured_delay().max_delay() + ms(10);
            assert!(matches!(
                publisher
                    .publish_delayed(&t.queue_name(), too_long, b"x", BasicProperties::default())
                    .await,
                Err(PublishError::Delay(_))
            ));
            // The publisher is still usable after all that.
            let id = publisher
                .publish_json("", &t.queue_name(), &serde_json::json!({"ok": true}))
                .await
                .unwrap();
            let got = redeliver_testkit::poll_get(&ch, &t.queue_name(), Duration::from_secs(5))
                .await
                .unwrap();
            assert_eq!(got.properties.message_id().as_ref().unwrap().as_str(), id);
            assert_eq!(
                got.properties.content_type().as_ref().unwrap().as_str(),
                "application/json"
            );
            got.ack(BasicAckOptions::default()).await.unwrap();
        },
        cleanup(&conn, &t),
    )
    .await;
}

#[tokio::test]
async fn concurrent_publishes_share_one_publisher() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = Topology::new("conc")
        .prefix(&p)
        .delay(DelayConfig::new().prefix(&p).levels(4));
    redeliver_testkit::with_cleanup(
        async {
            let publisher = setup(&conn, &t).await;
            let q = t.queue_name();
            let tasks: Vec<_> = (0..50)
                .map(|i| {
                    let publisher = publisher.clone();
                    let q = q.clone();
                    tokio::spawn(async move {
                        publisher
                            .publish_delayed(&q, ms(i % 3 * 10), b"c", BasicProperties::default())
                            .await
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap().unwrap();
            }
            let ch = conn.create_channel().await.unwrap();
            for _ in 0..50 {
                let m = redeliver_testkit::poll_get(&ch, &q, Duration::from_secs(5))
                    .await
                    .expect("all arrive");
                m.ack(BasicAckOptions::default()).await.unwrap();
            }
        },
        cleanup(&conn, &t),
    )
    .await;
}

#[tokio::test]
async fn classic_levels_work() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = Topology::new("clsdelay").prefix(&p).delay(
        DelayConfig::new()
            .prefix(&p)
            .levels(5)
            .queue_type(redeliver_amqp::QueueType::Classic),
    );
    redeliver_testkit::with_cleanup(
        async {
            let arrivals = run_batch(&conn, &t, &[ms(120), ms(30), ms(0)]).await;
            let order: Vec<usize> = arrivals.iter().map(|(i, _)| *i).collect();
            assert_eq!(order, vec![2, 1, 0]);
            for (i, took) in arrivals {
                let d = [ms(120), ms(30), ms(0)][i];
                assert!(
                    took >= d && took <= d + ms(50) + d / 50,
                    "{d:?} took {took:?}"
                );
            }
        },
        cleanup(&conn, &t),
    )
    .await;
}

async fn consume(ch: &Channel, queue: &str) -> Consumer {
    ch.basic_consume(
        queue.into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("basic_consume")
}
