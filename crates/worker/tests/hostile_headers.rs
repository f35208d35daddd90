//! A header nested as deep as the broker lets a publisher send (the whole content-header frame,
//! `frame_max` bytes, spent on `[[[...]]]` or `{k:{k:...}}`) used to abort the worker: lapin's
//! I/O thread overflowed its stack parsing it (issue 29). Now such a message is dead-lettered as
//! undecodable, and the worker goes on with the next one.
//!
//! Both transports: AMQP 0-9-1 (the delay levels) on every broker, and AMQP 1.0 (native
//! retries) on RabbitMQ 4.3+. Over AMQP 1.0 RabbitMQ itself drops a header that is not `x-` and
//! holds an array or a table (application properties hold only simple values), so such a deep
//! header never reaches the consumer and the message is handled without it; an `x-` header
//! arrives as a message annotation, which the AMQP 1.0 nesting guard cuts, and the message is
//! dead-lettered as undecodable, as over AMQP 0-9-1.

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
use redeliver_amqp::lapin::types::AMQPValue;
use redeliver_amqp::lapin::ConnectionProperties;
use redeliver_amqp::QueueType;
use redeliver_amqp::{headers_removed, TlsConfig};
use redeliver_testkit::{amqp_url, poll_get, raw_publish, wait_count};
use redeliver_worker::{Context, Json, RetryMode, Worker};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Job {
    /// Which message the body is, checked against its id: the body arrives whole.
    n: u32,
}

/// The deep messages: (message id, header name, kind).
const DEEP: [(&str, &str, u8); 4] = [
    ("deep-arrays", "h", b'A'),
    ("deep-tables", "h", b'F'),
    ("x-deep-arrays", "x-h", b'A'),
    ("x-deep-tables", "x-h", b'F'),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deepest_headers_the_broker_takes_are_dead_lettered_and_the_worker_goes_on() {
    deepest_headers(RetryMode::Levels).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deepest_headers_the_broker_takes_do_not_stop_a_native_worker() {
    if transport::native_or_skip("deepest headers, native").await {
        deepest_headers(RetryMode::Native).await;
    }
}

async fn deepest_headers(mode: RetryMode) {
    init_tracing();
    let (names, conn, topo, queue) = fixture(
        "hostile",
        mode_queue::queue_type(mode, QueueType::Quorum),
        2,
        QueueType::Classic,
    )
    .await;
    topo.declare(&conn).await.unwrap();
    let url = amqp_url();

    // Arrays and tables, each as deep as one frame of the broker's size holds, in a header
    // that is not `x-` and in one that is.
    let mut sent = Vec::new();
    for (id, key, kind) in DEEP {
        let (url, queue) = (url.clone(), queue.clone());
        let (depth, published) = tokio::task::spawn_blocking(move || {
            // The broker's frame size first (a shallow message), then the deepest that fits it.
            let probe = raw_publish::publish(&url, &queue, b"V", b"{\"n\":0}", "probe")?;
            let depth = raw_publish::deepest_named(kind, probe.frame_max, key, id);
            let value = raw_publish::nested(kind, depth);
            raw_publish::publish_named(&url, &queue, key, &value, b"{\"n\":1}", id)
                .map(|p| (depth, p))
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("publishing {id}: {e}"));
        assert!(
            published.header_frame <= published.frame_max as usize
                && published.header_frame + 7 > published.frame_max as usize,
            "the header frame ({} bytes) fills the broker's frame size ({})",
            published.header_frame,
            published.frame_max
        );
        eprintln!(
            "{id}: {depth} levels in a {}-byte header frame (frame_max {})",
            published.header_frame, published.frame_max
        );
        sent.push((id, depth));
    }
    publish_all(
        &conn,
        &queue,
        vec![(b"{\"n\":2}".to_vec(), props("after-the-poison"))],
    )
    .await;

    // Message id, body's `n` -> the names of the headers the handler saw.
    let handled = Arc::new(Mutex::new(Vec::<(String, u32, Vec<String>)>::new()));
    let seen = Arc::clone(&handled);
    let token = CancellationToken::new();
    let builder = Worker::builder(url.clone())
        .topology(topo.clone())
        .retry_mode(mode)
        .connection_name(format!("{}worker", names.prefix))
        .handler(move |job: Json<Job>, ctx: Context| {
            let seen = Arc::clone(&seen);
            async move {
                let id = ctx.message_id().unwrap_or_default().to_owned();
                let headers = ctx
                    .headers()
                    .map(|h| h.inner().keys().map(|k| k.to_string()).collect())
                    .unwrap_or_default();
                seen.lock().unwrap().push((id, job.n, headers));
                Ok(())
            }
        });
    let (status, run) = run_consuming(builder, &token).await;

    // Which deep messages each transport dead-letters, and which it hands to the handler.
    let (dead_ids, handled_deep): (Vec<&str>, Vec<&str>) = match mode {
        // The frame guard cuts every deep header, `x-` or not.
        RetryMode::Levels => (DEEP.iter().map(|d| d.0).collect(), Vec::new()),
        // RabbitMQ drops the deep header that is not `x-` on its way to AMQP 1.0: that message
        // is handled, without it; the nesting guard cuts the `x-` one.
        _ => (
            vec!["x-deep-arrays", "x-deep-tables"],
            vec!["deep-arrays", "deep-tables"],
        ),
    };

    // The probes, the message after the poison and what the transport lets through are handled;
    // the rest are dead letters.
    wait_count(
        &conn,
        &topo.dlq_name(),
        dead_ids.len() as u32,
        Duration::from_secs(60),
    )
    .await;
    let all_handled = || {
        let h = handled.lock().unwrap();
        std::iter::once("after-the-poison")
            .chain(handled_deep.iter().copied())
            .all(|want| h.iter().any(|(id, _, _)| id == want))
    };
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(30), all_handled).await,
        "the message after the poison (and over AMQP 1.0 those whose deep header RabbitMQ \
         dropped: {handled_deep:?}) were not handled: {:?}",
        handled.lock().unwrap()
    );
    let handled_now = handled.lock().unwrap().clone();
    for (id, n, headers) in &handled_now {
        let body = match id.as_str() {
            "probe" => 0,
            "after-the-poison" => 2,
            _ => 1,
        };
        assert_eq!(*n, body, "{id}: the handler saw another message's body");
        assert!(
            !dead_ids.contains(&id.as_str()),
            "a handler saw a message whose headers were cut: {id} {headers:?}"
        );
        if handled_deep.contains(&id.as_str()) {
            assert!(
                !headers.iter().any(|h| h == "h"),
                "{id}: RabbitMQ drops a deep header that is not `x-` for an AMQP 1.0 consumer, \
                 yet the handler saw one: {headers:?}"
            );
        }
    }
    assert_eq!(
        status.state(),
        redeliver_worker::WorkerState::Consuming,
        "the worker still consumes"
    );
    assert_eq!(redeliver_testkit::ready_count(&conn, &queue).await, 0);

    // The dead letters, read through redeliver's own (guarded) connection: the broker kept the
    // original header, cut again on this receipt, and says why.
    let reader = redeliver_amqp::connect(&url, ConnectionProperties::default(), &TlsConfig::new())
        .await
        .unwrap();
    let ch = reader.create_channel().await.unwrap();
    let mut dead = Vec::new();
    for _ in 0..dead_ids.len() {
        let d = poll_get(&ch, &topo.dlq_name(), Duration::from_secs(10))
            .await
            .expect("a dead letter");
        let id = d.properties.message_id().as_ref().unwrap().to_string();
        let key = if id.starts_with("x-") { "x-h" } else { "h" };
        let h = d.properties.headers().clone().unwrap_or_default();
        let why = headers_removed(Some(&h)).expect("marked as cut").0;
        assert!(why.contains("deeper than 32 levels"), "{id}: {why}");
        assert!(
            matches!(h.inner().get(key), Some(AMQPValue::LongString(s)) if String::from_utf8_lossy(s.as_bytes()).starts_with("removed by redeliver")),
            "{id}: {h:?}"
        );
        let reason = redeliver_amqp::headers::x_death(Some(&h));
        assert!(
            format!("{reason:?}").contains("rejected"),
            "{id}: {reason:?}"
        );
        if mode == RetryMode::Native {
            // The worker's reason travels as an annotation of the `modified` outcome.
            let info = redeliver_amqp::headers::DeadLetterInfo::read(Some(&h))
                .unwrap_or_else(|| panic!("{id}: no dead-letter reason: {h:?}"));
            assert_eq!(info.reason, "undecodable", "{id}");
        }
        dead.push(id);
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    dead.sort();
    let mut want = dead_ids.clone();
    want.sort();
    assert_eq!(dead, want);

    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
    eprintln!("{mode}: sent {sent:?}");
}
