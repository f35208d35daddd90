//! What a handler sees of each AMQP 0-9-1 header type and property published over AMQP 0-9-1,
//! when the worker consumes over AMQP 0-9-1 (delay levels, every broker) and over AMQP 1.0
//! (native retries, RabbitMQ 4.3+), where RabbitMQ converts the message to AMQP 1.0 and
//! `redeliver-amqp1` maps it back (`crates/amqp1/src/message.rs`). Differences measured on
//! 4.3.6 are asserted as such and listed in RELIABILITY.md ("Hostile input, class by class").
//! Also: a header RabbitMQ cannot convert at all (a decimal), and a publisher's own
//! `x-redeliver-attempt` beside the one a native retry writes.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/consuming.rs"]
mod consuming;
#[path = "common/fixture.rs"]
mod fixture;
#[path = "common/transport.rs"]
mod transport;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use consuming::run_consuming;
use fixture::fixture;
use redeliver_amqp::headers;
use redeliver_amqp::lapin::types::{AMQPValue, DecimalValue, FieldArray, FieldTable, LongString};
use redeliver_amqp::lapin::BasicProperties;
use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::{amqp_url, drain_queue, ready_count};
use redeliver_worker::{Context, Raw, RetryMode, Worker, WorkerState};
use tokio_util::sync::CancellationToken;

/// What the handler saw of each message: exchange, routing key, properties.
type View = (String, String, BasicProperties);
type Seen = Arc<Mutex<BTreeMap<String, View>>>;

/// Non-`x-` headers that hold an array or a table: RabbitMQ drops them for an AMQP 1.0
/// consumer (application properties hold only simple values).
const DROPPED: [&str; 4] = ["array", "empty-array", "table", "empty-table"];

/// One header of every AMQP 0-9-1 field type RabbitMQ takes (but decimals, which get their own
/// test below), each name with `prefix`.
fn every_type(prefix: &str) -> FieldTable {
    let mut t = FieldTable::default();
    let mut put = |k: &str, v: AMQPValue| {
        t.insert(format!("{prefix}{k}").into(), v);
    };
    put("bool", AMQPValue::Boolean(true));
    put("i8", AMQPValue::ShortShortInt(-8));
    put("u8", AMQPValue::ShortShortUInt(200));
    put("i16", AMQPValue::ShortInt(-16_000));
    put("u16", AMQPValue::ShortUInt(60_000));
    put("i32", AMQPValue::LongInt(-2_000_000_000));
    put("u32", AMQPValue::LongUInt(4_000_000_000));
    put("i64-max", AMQPValue::LongLongInt(i64::MAX));
    put("i64-min", AMQPValue::LongLongInt(i64::MIN));
    put("f32", AMQPValue::Float(1.5));
    put("f64", AMQPValue::Double(-2.25));
    put("text", AMQPValue::LongString("héllo".into()));
    put(
        "not-utf8",
        AMQPValue::LongString(LongString::from(b"\xff\xfeok".to_vec())),
    );
    put("bytes", AMQPValue::ByteArray(vec![0u8, 1, 255].into()));
    put("timestamp", AMQPValue::Timestamp(1_700_000_000));
    put("void", AMQPValue::Void);
    put(
        "array",
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongInt(1),
            AMQPValue::LongString("two".into()),
        ])),
    );
    put("empty-array", AMQPValue::FieldArray(FieldArray::default()));
    let mut inner = FieldTable::default();
    inner.insert("k".into(), AMQPValue::LongString("v".into()));
    put("table", AMQPValue::FieldTable(inner));
    put("empty-table", AMQPValue::FieldTable(FieldTable::default()));
    t
}

/// `plain-headers` and `x-headers`: every type as a header that is not `x-` and as one that is;
/// `all-properties`: every property set; `no-properties`: only a message id.
fn messages() -> Vec<(Vec<u8>, BasicProperties)> {
    let body = b"{}".to_vec();
    vec![
        (
            body.clone(),
            BasicProperties::default()
                .with_message_id("plain-headers".into())
                .with_headers(every_type("")),
        ),
        (
            body.clone(),
            BasicProperties::default()
                .with_message_id("x-headers".into())
                .with_headers(every_type("x-")),
        ),
        (
            body.clone(),
            BasicProperties::default()
                .with_message_id("all-properties".into())
                .with_content_type("application/json".into())
                .with_content_encoding("gzip".into())
                .with_delivery_mode(1)
                .with_priority(9)
                .with_correlation_id("corr".into())
                .with_reply_to("replies".into())
                .with_expiration("600000".into())
                .with_timestamp(1_700_000_000)
                .with_type("order.created".into())
                .with_user_id("guest".into())
                .with_app_id("shop".into())
                .with_cluster_id("cluster".into()),
        ),
        (
            body,
            BasicProperties::default().with_message_id("no-properties".into()),
        ),
    ]
}

/// Publishes [`messages`], runs a worker in `mode` until it handled them all, and returns what
/// its handler saw of each.
async fn handled_views(mode: RetryMode) -> BTreeMap<String, View> {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("mapping", QueueType::Quorum, 1, QueueType::Classic).await;
    topo.declare(&conn).await.unwrap();
    let msgs = messages();
    let n = msgs.len();
    publish_all(&conn, &queue, msgs).await;
    let seen: Seen = Arc::default();
    let s = Arc::clone(&seen);
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .retry_mode(mode)
        .connection_name(format!("{}worker", names.prefix))
        .handler(move |_b: Raw, ctx: Context| {
            let s = Arc::clone(&s);
            async move {
                s.lock().unwrap().insert(
                    ctx.message_id().unwrap_or_default().to_owned(),
                    (
                        ctx.exchange().to_owned(),
                        ctx.routing_key().to_owned(),
                        ctx.properties().clone(),
                    ),
                );
                Ok(())
            }
        });
    let (status, run) = run_consuming(builder, &token).await;
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(30), || seen.lock().unwrap().len() == n)
            .await,
        "{mode}: not all handled: {:?}",
        seen.lock().unwrap().keys()
    );
    assert_eq!(status.state(), WorkerState::Consuming);
    assert_eq!(ready_count(&conn, &topo.dlq_name()).await, 0);
    token.cancel();
    run.await.unwrap().unwrap();
    for (_, (exchange, routing_key, _)) in seen.lock().unwrap().iter() {
        assert_eq!(exchange, "", "{mode}");
        assert_eq!(routing_key, &queue, "{mode}");
    }
    drop(names);
    let out = seen.lock().unwrap().clone();
    out
}

fn headers_of(views: &BTreeMap<String, View>, id: &str) -> FieldTable {
    views[id].2.headers().clone().unwrap_or_default()
}

/// Over AMQP 0-9-1 the handler sees every header and property as it was published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_amqp_091_a_handler_sees_every_header_and_property_as_sent() {
    let views = handled_views(RetryMode::Levels).await;
    let sent: BTreeMap<String, BasicProperties> = messages()
        .into_iter()
        .map(|(_, p)| (p.message_id().as_ref().unwrap().to_string(), p))
        .collect();
    for (id, props) in &sent {
        assert_eq!(&views[id].2, props, "{id}");
    }
}

/// Over AMQP 1.0 the handler sees what RabbitMQ 4.3's conversion keeps, mapped back: each
/// difference from AMQP 0-9-1 asserted here is listed in RELIABILITY.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_amqp_1_a_handler_sees_the_headers_rabbitmq_converts() {
    if !transport::native_or_skip("header types, native").await {
        return;
    }
    let views = handled_views(RetryMode::Native).await;
    for prefix in ["", "x-"] {
        let id = if prefix.is_empty() {
            "plain-headers"
        } else {
            "x-headers"
        };
        let got = headers_of(&views, id);
        // Application properties hold only simple values: RabbitMQ drops the rest.
        let mut want = FieldTable::default();
        for (k, v) in every_type(prefix).inner() {
            if !(prefix.is_empty() && DROPPED.contains(&k.as_str())) {
                want.insert(k.clone(), v.clone());
            }
        }
        // A long string that is not UTF-8 becomes AMQP binary, read back as a byte array.
        let key = format!("{prefix}not-utf8");
        want.insert(
            key.as_str().into(),
            AMQPValue::ByteArray(b"\xff\xfeok".to_vec().into()),
        );
        // Everything else, x- arrays and tables, large integers, timestamps, voids and byte
        // arrays included, reads as it was sent.
        assert_eq!(got, want, "{id}");
    }
    // AMQP 1.0's header always carries `durable` and `priority` (default 4): a message
    // published without them reads as delivery mode 1 and priority 4.
    let bare = &views["no-properties"].2;
    assert_eq!(bare.delivery_mode(), &Some(1));
    assert_eq!(bare.priority(), &Some(4));
    assert_eq!(bare.headers(), &None);
    // The properties RabbitMQ converts and the worker reads back as they were sent.
    let p = &views["all-properties"].2;
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(p.content_encoding().as_ref().unwrap().as_str(), "gzip");
    assert_eq!(p.delivery_mode(), &Some(1));
    assert_eq!(p.priority(), &Some(9));
    assert_eq!(p.correlation_id().as_ref().unwrap().as_str(), "corr");
    assert_eq!(p.expiration().as_ref().unwrap().as_str(), "600000");
    assert_eq!(p.timestamp(), &Some(1_700_000_000));
    assert_eq!(p.kind().as_ref().unwrap().as_str(), "order.created");
    assert_eq!(p.user_id().as_ref().unwrap().as_str(), "guest");
    // `cluster_id` (deprecated in AMQP 0-9-1) has no AMQP 1.0 counterpart: gone.
    assert_eq!(p.cluster_id(), &None);
}

/// `app_id` and `reply_to` over AMQP 1.0. RabbitMQ 4.3.6 converts `app_id` to the AMQP 1.0
/// property `group-id` and `reply_to` `replies` to the address `/queues/replies`; the worker
/// reads neither back (`crates/amqp1/src/message.rs` looks for an `x-basic-app-id` annotation
/// RabbitMQ does not send, and copies `reply-to` as it is). So a handler over AMQP 1.0 sees no
/// app id, and a reply published to the `reply_to` it sees (through the default exchange) is
/// unroutable. Fails until the mapping reads them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_amqp_1_a_handler_sees_the_app_id_and_reply_to_that_were_sent() {
    if !transport::native_or_skip("app_id and reply_to, native").await {
        return;
    }
    let views = handled_views(RetryMode::Native).await;
    let p = &views["all-properties"].2;
    let got = (
        p.app_id().as_ref().map(|s| s.to_string()),
        p.reply_to().as_ref().map(|s| s.to_string()),
    );
    assert_eq!(
        got,
        (Some("shop".to_owned()), Some("replies".to_owned())),
        "(app_id, reply_to) a native handler sees"
    );
}

/// A header holding a decimal. Over AMQP 0-9-1 it is handled like any. RabbitMQ 4.3.6 cannot
/// convert it for an AMQP 1.0 consumer: `mc_amqpl:from_091/2` has no clause for `decimal`, the
/// broker's AMQP 1.0 session crashes (`function_clause`) and closes the connection with
/// `amqp:internal-error` each time it tries to deliver the message. The worker reconnects and
/// is handed the same message again, about once a second; each time every message checked out
/// with it goes back too, counting toward the quorum queue's delivery limit (20): after about
/// 20 s the decimal message and the innocent messages behind it are all dead-lettered by the
/// broker (`delivery_limit`), none handled. The native worker should hand the message after it
/// to its handler as the 0-9-1 worker does; this fails on 4.3.6 until it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decimal_header_does_not_stop_the_worker() {
    decimal_header(RetryMode::Levels).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decimal_header_does_not_stop_a_native_worker() {
    if transport::native_or_skip("decimal, native").await {
        decimal_header(RetryMode::Native).await;
    }
}

async fn decimal_header(mode: RetryMode) {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("decimal", QueueType::Quorum, 1, QueueType::Classic).await;
    topo.declare(&conn).await.unwrap();
    let decimal = AMQPValue::DecimalValue(DecimalValue {
        scale: 2,
        value: 12345,
    });
    let mut plain = FieldTable::default();
    plain.insert("price".into(), decimal.clone());
    let mut x = FieldTable::default();
    x.insert("x-price".into(), decimal);
    publish_all(
        &conn,
        &queue,
        vec![
            (b"{}".to_vec(), props("decimal").with_headers(plain)),
            (b"{}".to_vec(), props("x-decimal").with_headers(x)),
            (b"{}".to_vec(), props("after")),
        ],
    )
    .await;
    let seen: Seen = Arc::default();
    let s = Arc::clone(&seen);
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .retry_mode(mode)
        .connection_name(format!("{}worker", names.prefix))
        .handler(move |_b: Raw, ctx: Context| {
            let s = Arc::clone(&s);
            async move {
                s.lock().unwrap().insert(
                    ctx.message_id().unwrap_or_default().to_owned(),
                    (String::new(), String::new(), ctx.properties().clone()),
                );
                Ok(())
            }
        });
    let (status, run) = run_consuming(builder, &token).await;
    // The message after the decimals is handled; each decimal is handled or dead-lettered. The
    // wait ends early once the broker dead-lettered the message after them.
    let settled = || async {
        let handled = seen.lock().unwrap().contains_key("after");
        handled || ready_count(&conn, &topo.dlq_name()).await == 3
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !settled().await && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let handled: Vec<String> = seen.lock().unwrap().keys().cloned().collect();
    let dead: Vec<(String, Option<String>)> = drain_queue(&conn, &topo.dlq_name())
        .await
        .iter()
        .map(|g| (g.message_id().to_owned(), g.death_reason()))
        .collect();
    let state = status.state();
    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
    assert!(
        handled.contains(&"after".to_owned()),
        "{mode}: the message after the decimal headers was not handled; handled {handled:?}, \
         dead-lettered {dead:?}"
    );
    if mode == RetryMode::Levels {
        assert_eq!(handled, ["after", "decimal", "x-decimal"], "{mode}");
        let got = &seen.lock().unwrap()["decimal"].2;
        assert!(
            matches!(got.headers().as_ref().and_then(|h| h.inner().get("price")), Some(AMQPValue::DecimalValue(d)) if d.value == 12345),
            "{got:?}"
        );
    }
    assert_eq!(state, WorkerState::Consuming, "{mode}");
}

/// A publisher's own `x-redeliver-attempt` (0) on a message that always fails: the retries
/// stop after the policy's two, on either transport. Over AMQP 1.0 a native retry's count
/// travels as `x-opt-redeliver-attempt` beside the publisher's `x-redeliver-attempt`; both read
/// as the header `x-redeliver-attempt`, and the worker's must win, or the retries never end
/// (until the queue's delivery limit dead-letters the message with another reason).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_attempt_header_does_not_extend_the_retries() {
    forged_attempt(RetryMode::Levels).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_attempt_header_does_not_extend_native_retries() {
    if transport::native_or_skip("forged attempt, native").await {
        forged_attempt(RetryMode::Native).await;
    }
}

async fn forged_attempt(mode: RetryMode) {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("forged", QueueType::Quorum, 1, QueueType::Classic).await;
    topo.declare(&conn).await.unwrap();
    let mut h = FieldTable::default();
    h.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(0));
    h.insert(
        headers::LAST_ERROR.into(),
        AMQPValue::LongString("forged".into()),
    );
    publish_all(
        &conn,
        &queue,
        vec![(b"{}".to_vec(), props("forged").with_headers(h))],
    )
    .await;
    let attempts = Arc::new(Mutex::new(Vec::<u32>::new()));
    let a = Arc::clone(&attempts);
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .retry_mode(mode)
        .connection_name(format!("{}worker", names.prefix))
        .policy(
            RetryPolicy::constant(Duration::from_millis(50))
                .jitter(Jitter::None)
                .max_retries(2),
        )
        .handler(move |_b: Raw, ctx: Context| {
            let a = Arc::clone(&a);
            async move {
                a.lock().unwrap().push(ctx.attempt());
                Err(HandlerError::transient("always fails"))
            }
        });
    let (_status, run) = run_consuming(builder, &token).await;
    redeliver_testkit::wait_count(&conn, &topo.dlq_name(), 1, Duration::from_secs(30)).await;
    let dead = drain_queue(&conn, &topo.dlq_name()).await;
    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
    let info = headers::DeadLetterInfo::read(dead[0].headers());
    assert_eq!(
        attempts.lock().unwrap().as_slice(),
        [0, 1, 2],
        "{mode}: attempts the handler saw; dead letter {info:?}, x-death reason {:?}",
        dead[0].death_reason()
    );
    if mode == RetryMode::Native {
        // A native dead letter carries the worker's reason as an annotation.
        assert_eq!(
            info.map(|i| i.reason).as_deref(),
            Some("retries_exhausted"),
            "{mode}"
        );
    } else {
        // The worker rejects; the broker's dead-lettering says so.
        assert_eq!(
            dead[0].death_reason().as_deref(),
            Some("rejected"),
            "{mode}"
        );
    }
}
