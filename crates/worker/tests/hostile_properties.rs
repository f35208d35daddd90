//! Short-string properties and routing keys are not checked for UTF-8 by RabbitMQ, but lapin's
//! parser refuses them and closes the connection: the message went back to the head of the
//! queue and closed the next connection too, so one message stopped every replica (issue 29).
//! Now the frame guard repairs them on receipt: a message whose properties were repaired is
//! dead-lettered as undecodable (its identity is not what was sent), one whose routing key was
//! repaired is handled, and the worker goes on.
//!
//! Over AMQP 1.0 (native retries, RabbitMQ 4.3+) RabbitMQ hands the same bytes on inside AMQP
//! strings and symbols that are not UTF-8, which fe2o3-amqp refuses to decode: each of the three
//! is dead-lettered as undecodable, the one with only a bad routing key included, and the
//! worker goes on.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/consuming.rs"]
mod consuming;
#[path = "common/fixture.rs"]
mod fixture;
#[path = "common/mode_queue.rs"]
mod mode_queue;
#[path = "common/transport.rs"]
mod transport;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use consuming::run_consuming;
use fixture::fixture;
use redeliver_amqp::lapin::options::BasicAckOptions;
use redeliver_amqp::lapin::ConnectionProperties;
use redeliver_amqp::QueueType;
use redeliver_amqp::{headers_removed, TlsConfig};
use redeliver_testkit::{amqp_url, poll_get, raw_publish, wait_count};
use redeliver_worker::{Context, Json, RetryMode, Worker};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Job {
    /// Checked: the handler gets the body as published, `{"n":1}`.
    n: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn properties_and_routing_keys_that_are_not_utf8_do_not_stop_the_worker() {
    not_utf8(RetryMode::Levels).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn properties_and_routing_keys_that_are_not_utf8_do_not_stop_a_native_worker() {
    if transport::native_or_skip("not UTF-8, native").await {
        not_utf8(RetryMode::Native).await;
    }
}

async fn not_utf8(mode: RetryMode) {
    init_tracing();
    let (names, conn, topo, queue) = fixture(
        "badutf8",
        mode_queue::queue_type(mode, QueueType::Classic),
        1,
        QueueType::Classic,
    )
    .await;
    topo.declare(&conn).await.unwrap();
    let url = amqp_url();
    // A fanout exchange takes any routing key, bytes that are not UTF-8 included.
    let fanout = format!("{}fanout", names.prefix);
    redeliver_testkit::fanout_to(&conn, &fanout, &queue).await;

    let body = b"{\"n\":1}";
    let json = b"application/json";
    let sends: [(&str, &[u8], Vec<u8>); 3] = [
        (
            "",
            queue.as_bytes(),
            raw_publish::raw_properties(body.len(), json, b"bad-id-\xff\xfe"),
        ),
        (
            "",
            queue.as_bytes(),
            raw_publish::raw_properties(body.len(), b"application/json\xc3", b"bad-ct"),
        ),
        (
            &fanout,
            b"rk.\xff.x",
            raw_publish::raw_properties(body.len(), json, b"bad-rk"),
        ),
    ];
    for (exchange, key, header) in sends {
        let (url, exchange, key) = (url.clone(), exchange.to_owned(), key.to_vec());
        tokio::task::spawn_blocking(move || {
            raw_publish::publish_raw(&url, &exchange, &key, &header, body)
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("the broker refused a raw publish: {e}"));
    }
    publish_all(
        &conn,
        &queue,
        vec![(body.to_vec(), props("after-the-poison"))],
    )
    .await;

    let handled = Arc::new(Mutex::new(Vec::<(String, u32)>::new()));
    let seen = Arc::clone(&handled);
    let token = CancellationToken::new();
    let builder = Worker::builder(url.clone())
        .topology(topo.clone())
        .connection_name(format!("{}worker", names.prefix))
        .retry_mode(mode)
        .handler(move |job: Json<Job>, ctx: Context| {
            let seen = Arc::clone(&seen);
            async move {
                let id = ctx.message_id().unwrap_or_default().to_owned();
                seen.lock().unwrap().push((id, job.n));
                Ok(())
            }
        });
    let (status, run) = run_consuming(builder, &token).await;

    // Over AMQP 0-9-1 the frame guard repairs the bytes: the message with a bad routing key is
    // handled. Over AMQP 1.0 RabbitMQ passes them on inside AMQP strings (the message id, the
    // `x-routing-key` annotation) and symbols (the content type) that are not UTF-8, so the
    // whole message does not decode: all three are dead-lettered as undecodable.
    let native = mode == RetryMode::Native;
    let (dead_count, handled_ids_wanted): (usize, &[&str]) = if native {
        (3, &["after-the-poison"])
    } else {
        (2, &["after-the-poison", "bad-rk"])
    };
    wait_count(
        &conn,
        &topo.dlq_name(),
        dead_count as u32,
        Duration::from_secs(30),
    )
    .await;
    let all_handled = || {
        let h = handled.lock().unwrap();
        handled_ids_wanted
            .iter()
            .all(|want| h.iter().any(|(id, _)| id == want))
    };
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(30), all_handled).await,
        "{handled_ids_wanted:?} were not all handled: {:?}",
        handled.lock().unwrap()
    );
    let handled_now = handled.lock().unwrap().clone();
    assert!(
        handled_now.iter().all(|(_, n)| *n == 1),
        "every body is {{\"n\":1}}, yet a handler saw another: {handled_now:?}"
    );
    let handled_ids: Vec<String> = handled_now.into_iter().map(|(id, _)| id).collect();
    assert!(
        !handled_ids
            .iter()
            .any(|id| id.starts_with("bad-id") || id == "bad-ct" || (native && id == "bad-rk")),
        "a handler saw a message whose properties were repaired (or, over AMQP 1.0, that \
         did not decode): {handled_ids:?}"
    );
    assert_eq!(status.state(), redeliver_worker::WorkerState::Consuming);
    assert_eq!(redeliver_testkit::ready_count(&conn, &queue).await, 0);

    // The dead letters, read through redeliver's own (guarded) connection, say what was repaired.
    let reader = redeliver_amqp::connect(&url, ConnectionProperties::default(), &TlsConfig::new())
        .await
        .unwrap();
    let rch = reader.create_channel().await.unwrap();
    let mut dead = Vec::new();
    for _ in 0..dead_count {
        let d = poll_get(&rch, &topo.dlq_name(), Duration::from_secs(10))
            .await
            .expect("a dead letter");
        let h = d.properties.headers().clone().unwrap_or_default();
        let id = d.properties.message_id().as_ref().map(|s| s.to_string());
        let ct = d.properties.content_type().as_ref().map(|s| s.to_string());
        if native {
            // The worker's reason travels as an annotation of the `modified` outcome.
            let info = redeliver_amqp::headers::DeadLetterInfo::read(Some(&h))
                .unwrap_or_else(|| panic!("{id:?}: no dead-letter reason: {h:?}"));
            assert_eq!(info.reason, "undecodable", "{id:?}");
            assert!(
                info.error.as_deref().unwrap_or_default().contains("UTF-8"),
                "{id:?}: {info:?}"
            );
        }
        if id.as_deref() == Some("bad-rk") {
            // Only its routing key was bad: no property to repair; the broker kept the key.
            assert!(native, "over AMQP 0-9-1 bad-rk is handled");
            assert!(headers_removed(Some(&h)).is_none(), "{h:?}");
            dead.push((id, ct, String::new()));
        } else {
            let why = headers_removed(Some(&h)).expect("marked as repaired").0;
            assert!(why.contains("not UTF-8"), "{why}");
            dead.push((id, ct, why));
        }
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    dead.sort();
    assert_eq!(dead[0].0.as_deref(), Some("bad-ct"));
    assert_eq!(dead[0].1.as_deref(), Some("application/json?"));
    assert!(dead[0].2.contains("content_type"), "{:?}", dead[0]);
    assert_eq!(dead[1].0.as_deref(), Some("bad-id-??"));
    assert!(dead[1].2.contains("message_id"), "{:?}", dead[1]);
    if native {
        assert_eq!(dead[2].0.as_deref(), Some("bad-rk"));
    }

    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
}
