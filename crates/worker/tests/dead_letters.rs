//! What an operator reads on each kind of dead letter, fetched through the management HTTP API
//! (what the management UI's "Get messages" shows), in both dead-letter modes.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/consuming.rs"]
mod consuming;
#[path = "common/fixture.rs"]
mod fixture;

use std::time::Duration;

use common::*;
use consuming::run_consuming;
use fixture::fixture;
use redeliver_amqp::headers;
use redeliver_amqp::lapin::types::{AMQPValue, FieldTable};
use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, RetryPolicy};
use redeliver_testkit::{amqp_url, ready_count};
use redeliver_worker::{Context, DeadLetterMode, Json, Worker};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Job {
    mode: String,
}

const LIMIT: u32 = 2;

/// A message the broker dead-letters itself: returned by closed channels past the queue's
/// delivery limit, before any worker runs.
async fn poison_by_the_broker(conn: &redeliver_amqp::lapin::Connection, queue: &str) {
    for _ in 0..=LIMIT {
        let ch = conn.create_channel().await.unwrap();
        let got = redeliver_testkit::poll_get(&ch, queue, Duration::from_secs(5)).await;
        assert!(got.is_some(), "the poison came back");
        ch.close(200, "crash".into()).await.unwrap();
    }
}

fn user_props(id: &str) -> redeliver_amqp::lapin::BasicProperties {
    let mut h = FieldTable::default();
    h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    props(id)
        .with_correlation_id(format!("corr-{id}").as_str().into())
        .with_headers(h)
}

async fn dead_letters_in(mode: DeadLetterMode) -> (Vec<Value>, String) {
    init_tracing();
    let label = format!("{mode:?}").to_lowercase();
    let (names, conn, topo, queue) = fixture(
        &format!("dl{label}"),
        QueueType::Quorum,
        4,
        QueueType::Classic,
    )
    .await;
    let topo = topo.delivery_limit(Some(LIMIT));
    topo.declare(&conn).await.unwrap();
    publish_all(
        &conn,
        &queue,
        vec![(br#"{"mode":"ok"}"#.to_vec(), user_props("poison"))],
    )
    .await;
    poison_by_the_broker(&conn, &queue).await;

    let name = format!("{}worker", names.prefix);
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .dead_letter_mode(mode)
        .connection_name(name.clone())
        .policy(RetryPolicy::constant(Duration::from_millis(20)).max_retries(1))
        // Below the "big" message: its retry copy is refused (too_large); the dead letter, the
        // same body the broker already took, is not.
        .max_message_size(200)
        .handler(|job: Json<Job>, _ctx: Context| async move {
            match job.mode.as_str() {
                "permanent" => Err(HandlerError::permanent("width must be positive")),
                "transient" => Err(HandlerError::transient(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "timeout talking to storage",
                ))),
                _ => Ok(()),
            }
        });
    let (_status, run) = run_consuming(builder, &token).await;
    publish_all(
        &conn,
        &queue,
        vec![
            (br#"{"mode":"permanent"}"#.to_vec(), user_props("perm")),
            (br#"{"mode":"transient"}"#.to_vec(), user_props("exhausted")),
            (b"not json at all".to_vec(), user_props("garbage")),
            (
                format!(r#"{{"mode":"transient","pad":"{}"}}"#, "x".repeat(300)).into_bytes(),
                user_props("big"),
            ),
        ],
    )
    .await;
    let dlq = topo.dlq_name();
    let started = std::time::Instant::now();
    let mut ready = false;
    while !ready && started.elapsed() < Duration::from_secs(20) {
        ready = ready_count(&conn, &dlq).await >= 5;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let messages = redeliver_testkit::mgmt::blocking({
        let dlq = dlq.clone();
        move || redeliver_testkit::mgmt::get_messages(&dlq, 10)
    })
    .await
    .expect("get messages");
    token.cancel();
    run.await.unwrap().unwrap();
    assert!(
        ready,
        "5 dead letters expected, the API shows {}",
        messages.len()
    );
    drop(names);
    (messages, name)
}

fn find<'a>(messages: &'a [Value], id: &str) -> &'a Value {
    messages
        .iter()
        .find(|m| m["properties"]["message_id"] == id)
        .unwrap_or_else(|| panic!("{id} is not in the DLQ: {messages:#?}"))
}

fn header<'a>(m: &'a Value, name: &str) -> &'a Value {
    &m["properties"]["headers"][name]
}

fn death_reason(m: &Value) -> Option<&str> {
    header(m, "x-death")[0]["reason"].as_str()
}

/// Every header an operator reads is a string or a number (the broker's x-death aside), and the
/// message is the original: body, message_id, correlation_id, user headers.
fn readable_and_intact(m: &Value, id: &str) {
    let hdrs = m["properties"]["headers"].as_object().expect("headers");
    for (k, v) in hdrs {
        if k.starts_with("x-redeliver-") {
            assert!(v.is_string() || v.is_number(), "{id}: {k} = {v}");
        }
    }
    assert_eq!(header(m, "tenant"), "acme", "{id}");
    assert_eq!(
        m["properties"]["correlation_id"],
        format!("corr-{id}").as_str()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotate_mode_says_why_each_message_died() {
    let (messages, worker) = dead_letters_in(DeadLetterMode::Annotate).await;
    for (id, reason, error, attempts) in [
        ("perm", "permanent", "width must be positive", 1),
        (
            "exhausted",
            "retries_exhausted",
            "timeout talking to storage",
            2,
        ),
        ("garbage", "undecodable", "cannot decode message body", 1),
        (
            "big",
            "too_large",
            "exceeds the broker's max_message_size",
            1,
        ),
    ] {
        let m = find(&messages, id);
        readable_and_intact(m, id);
        assert_eq!(
            header(m, headers::DEAD_LETTER_REASON),
            reason,
            "{id}: {m:#}"
        );
        let shown = header(m, headers::DEAD_LETTER_ERROR)
            .as_str()
            .unwrap_or_default();
        assert!(shown.contains(error), "{id}: error {shown:?}");
        assert_eq!(header(m, headers::DEAD_LETTER_ATTEMPTS), attempts, "{id}");
        assert_eq!(
            header(m, headers::DEAD_LETTERED_BY),
            worker.as_str(),
            "{id}"
        );
        assert!(header(m, headers::DEAD_LETTERED_AT).is_string(), "{id}");
        assert!(header(m, headers::FIRST_FAILED_AT).is_string(), "{id}");
        assert_eq!(
            death_reason(m),
            None,
            "{id}: the worker, not the broker, moved it"
        );
    }
    assert_eq!(
        find(&messages, "perm")["payload"],
        r#"{"mode":"permanent"}"#
    );
    assert_eq!(find(&messages, "garbage")["payload"], "not json at all");
    // The earlier attempt's error is there too, from the retry copy.
    let last = header(find(&messages, "exhausted"), headers::LAST_ERROR);
    assert!(
        last.as_str().unwrap_or_default().contains("timeout"),
        "{last}"
    );
    // Dead-lettered by the broker: its own record, in both modes.
    let poison = find(&messages, "poison");
    assert_eq!(death_reason(poison), Some("delivery_limit"));
    assert!(header(poison, headers::DEAD_LETTER_REASON).is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_mode_leaves_the_brokers_record_and_the_last_retry_error() {
    let (messages, _) = dead_letters_in(DeadLetterMode::Reject).await;
    for id in ["perm", "exhausted", "garbage", "big"] {
        let m = find(&messages, id);
        readable_and_intact(m, id);
        assert_eq!(death_reason(m), Some("rejected"), "{id}: {m:#}");
        assert!(header(m, headers::DEAD_LETTER_REASON).is_null(), "{id}");
    }
    let last = header(find(&messages, "exhausted"), headers::LAST_ERROR);
    assert!(
        last.as_str()
            .unwrap_or_default()
            .contains("timeout talking to storage"),
        "{last}"
    );
    assert_eq!(header(find(&messages, "exhausted"), headers::ATTEMPT), 1);
    assert_eq!(
        death_reason(find(&messages, "poison")),
        Some("delivery_limit")
    );
}
