//! Messages a publisher can send that are well-formed AMQP but hostile to whoever reads them:
//! timestamps 0 and `u64::MAX`, control characters and bidi overrides in every string property,
//! redeliver's own headers with the wrong AMQP types, a table of 5,000 headers, binary and
//! invalid UTF-8 bodies. Each goes through a retry (the worker copies it to a delay level and
//! back) and is then handled; nothing crashes, nothing reaches the DLQ, nothing is left behind.
//!
//! Both transports: AMQP 0-9-1 (a retry is a copy through a delay level) on every broker, and
//! AMQP 1.0 on RabbitMQ 4.3+ (the quorum queue holds the retry itself: `modified` with a
//! delivery time), where RabbitMQ maps each message to AMQP 1.0 and the worker maps it back.

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
use redeliver_amqp::lapin::types::{AMQPValue, FieldArray, FieldTable};
use redeliver_amqp::lapin::BasicProperties;
use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::{amqp_url, ready_count};
use redeliver_worker::{Context, Raw, RetryMode, WorkerState};
use tokio_util::sync::CancellationToken;

const NASTY: &str = "\u{1b}[31m\u{202e}\u{0}\u{7}\r\n\u{2066}x";

fn hostile_messages() -> Vec<(Vec<u8>, BasicProperties)> {
    let json = br#"{"n":1}"#.to_vec();
    let mut out = Vec::new();
    for (id, ts) in [("ts-zero", 0), ("ts-max", u64::MAX)] {
        out.push((json.clone(), props(id).with_timestamp(ts)));
    }
    out.push((
        json.clone(),
        props(&format!("ctrl-{NASTY}"))
            .with_correlation_id(NASTY.into())
            .with_app_id(NASTY.into())
            .with_type(NASTY.into())
            .with_reply_to(NASTY.into())
            .with_expiration("600000".into()),
    ));
    let mut wrong = FieldTable::default();
    let table = {
        let mut t = FieldTable::default();
        t.insert("k".into(), AMQPValue::Boolean(true));
        AMQPValue::FieldTable(t)
    };
    wrong.insert(headers::FIRST_FAILED_AT.into(), AMQPValue::LongLongInt(-1));
    wrong.insert(headers::LAST_ERROR.into(), table.clone());
    wrong.insert(headers::ORIGINAL_EXCHANGE.into(), AMQPValue::Boolean(false));
    wrong.insert(
        headers::ORIGINAL_ROUTING_KEY.into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Void])),
    );
    // Not NaN: no RabbitMQ takes a NaN double (the publishing connection closes with
    // INTERNAL_ERROR on 3.10.8, 4.0.5 and 4.3.6), so no consumer ever receives one.
    wrong.insert(headers::DELAY_MS.into(), AMQPValue::Double(2.5));
    wrong.insert(headers::ORIGINAL_EXPIRATION.into(), table);
    wrong.insert(
        headers::DEAD_LETTER_REASON.into(),
        AMQPValue::LongString(NASTY.into()),
    );
    out.push((json.clone(), props("wrong-types").with_headers(wrong)));
    let mut wide = FieldTable::default();
    for i in 0..5_000 {
        wide.insert(format!("h{i:04}").into(), AMQPValue::LongInt(i));
    }
    out.push((json, props("wide-5000").with_headers(wide)));
    out.push((
        (0..=255u8).collect(),
        props("binary").with_content_type("application/octet-stream".into()),
    ));
    out.push((
        b"\xff\xfe\xc3(not utf-8".to_vec(),
        props("not-utf8").with_content_type("text/plain".into()),
    ));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_but_well_formed_messages_are_retried_and_handled() {
    retried_and_handled(RetryMode::Levels).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_but_well_formed_messages_are_retried_natively_and_handled() {
    if transport::native_or_skip("hostile messages, native").await {
        retried_and_handled(RetryMode::Native).await;
    }
}

async fn retried_and_handled(mode: RetryMode) {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("hostile", QueueType::Quorum, 1, QueueType::Classic).await;
    topo.declare(&conn).await.unwrap();
    let messages = hostile_messages();
    let ids: Vec<String> = messages
        .iter()
        .map(|(_, p)| p.message_id().as_ref().unwrap().to_string())
        .collect();
    let sent: BTreeMap<String, (Vec<u8>, BasicProperties)> = messages
        .iter()
        .map(|(b, p)| {
            let id = p.message_id().as_ref().unwrap().to_string();
            (id, (b.clone(), p.clone()))
        })
        .collect();
    publish_all(&conn, &queue, messages).await;

    // message id -> the attempts the handler saw.
    let calls = Arc::new(Mutex::new(BTreeMap::<String, Vec<u32>>::new()));
    let seen = Arc::clone(&calls);
    // message id -> the body and properties of each call.
    let views = Arc::new(Mutex::new(
        Vec::<(String, u32, Vec<u8>, BasicProperties)>::new(),
    ));
    let viewed = Arc::clone(&views);
    let token = CancellationToken::new();
    let builder = redeliver_worker::Worker::builder(amqp_url())
        .topology(topo.clone())
        .connection_name(format!("{}worker", names.prefix))
        .retry_mode(mode)
        .policy(
            RetryPolicy::constant(Duration::from_millis(50))
                .jitter(Jitter::None)
                .max_retries(3),
        )
        .handler(move |body: Raw, ctx: Context| {
            let seen = Arc::clone(&seen);
            let viewed = Arc::clone(&viewed);
            async move {
                let id = ctx.message_id().unwrap_or_default().to_owned();
                viewed.lock().unwrap().push((
                    id.clone(),
                    ctx.attempt(),
                    body.0,
                    ctx.properties().clone(),
                ));
                seen.lock()
                    .unwrap()
                    .entry(id)
                    .or_default()
                    .push(ctx.attempt());
                if ctx.attempt() == 0 {
                    return Err(HandlerError::transient(format!("first try fails: {NASTY}")));
                }
                Ok(())
            }
        });
    let (status, run) = run_consuming(builder, &token).await;

    let done = || {
        let c = calls.lock().unwrap();
        ids.iter().all(|id| c.get(id).is_some_and(|a| a.len() >= 2))
    };
    let finished = redeliver_testkit::eventually(Duration::from_secs(60), done).await;
    // Anything more (a duplicate, a third call) would show within the next moments.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = calls.lock().unwrap().clone();
    assert!(
        finished,
        "not every message was retried and handled: {seen:?}"
    );
    for id in &ids {
        assert_eq!(seen.get(id), Some(&vec![0, 1]), "{id:?}: {seen:?}");
    }
    assert_eq!(seen.len(), ids.len(), "{seen:?}");
    // Every call saw the body and the identity that was sent, on either transport and on the
    // retry as on the first try.
    for (id, attempt, body, p) in views.lock().unwrap().iter() {
        let (sent_body, sent_props) = &sent[id];
        assert_eq!(body, sent_body, "{id:?}: body");
        assert_eq!(p.correlation_id(), sent_props.correlation_id(), "{id:?}");
        assert_eq!(p.kind(), sent_props.kind(), "{id:?}: type");
        assert_eq!(p.content_type(), sent_props.content_type(), "{id:?}");
        let timestamp = match (mode, id.as_str()) {
            // AMQP 1.0 keeps a creation time in milliseconds, an i64: RabbitMQ cannot carry
            // u64::MAX seconds, and the worker reads what it sends as 0.
            (RetryMode::Native, "ts-max") => Some(0),
            _ => *sent_props.timestamp(),
        };
        assert_eq!(
            *p.timestamp(),
            timestamp,
            "{id:?} attempt {attempt}: timestamp"
        );
        // A retry copy through a delay level carries no expiration (the level's own TTL holds
        // it); a native retry is the same message, expiration included.
        if *attempt == 0 || mode == RetryMode::Native {
            assert_eq!(
                p.expiration(),
                sent_props.expiration(),
                "{id:?} attempt {attempt}"
            );
        }
    }
    assert_eq!(status.state(), WorkerState::Consuming);
    assert_eq!(ready_count(&conn, &queue).await, 0);
    assert_eq!(ready_count(&conn, &topo.dlq_name()).await, 0);

    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
}
