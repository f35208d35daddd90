//! A header nested as deep as the broker lets a publisher send (the whole content-header frame,
//! `frame_max` bytes, spent on `[[[...]]]` or `{k:{k:...}}`) used to abort the worker: lapin's
//! I/O thread overflowed its stack parsing it (issue 29). Now such a message is dead-lettered as
//! undecodable, and the worker goes on with the next one.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/consuming.rs"]
mod consuming;
#[path = "common/raw_publish.rs"]
mod raw_publish;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use consuming::run_consuming;
use redeliver_amqp::{headers_removed, TlsConfig};
use redeliver_testkit::{amqp_url, poll_get, wait_count};
use redeliver_worker::lapin::options::BasicAckOptions;
use redeliver_worker::lapin::types::AMQPValue;
use redeliver_worker::lapin::ConnectionProperties;
use redeliver_worker::{CancellationToken, Context, Json, QueueType, Worker};

#[derive(serde::Deserialize)]
struct Job {
    #[allow(dead_code)]
    n: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deepest_headers_the_broker_takes_are_dead_lettered_and_the_worker_goes_on() {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("hostile", QueueType::Quorum, 2, QueueType::Classic).await;
    topo.declare(&conn).await.unwrap();
    let url = amqp_url();

    // Arrays and tables, each as deep as one frame of the broker's size holds.
    let mut sent = Vec::new();
    for (kind, id) in [(b'A', "deep-arrays"), (b'F', "deep-tables")] {
        let (url, queue) = (url.clone(), queue.clone());
        let (depth, published) = tokio::task::spawn_blocking(move || {
            // The broker's frame size first (a shallow message), then the deepest that fits it.
            let probe = raw_publish::publish(&url, &queue, b"V", b"{\"n\":0}", "probe")?;
            let depth = raw_publish::deepest(kind, probe.frame_max, id);
            let value = raw_publish::nested(kind, depth);
            raw_publish::publish(&url, &queue, &value, b"{\"n\":1}", id).map(|p| (depth, p))
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

    let handled = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = Arc::clone(&handled);
    let token = CancellationToken::new();
    let builder = Worker::builder(url.clone())
        .topology(topo.clone())
        .connection_name(format!("{}worker", names.prefix))
        .handler(move |_job: Json<Job>, ctx: Context| {
            let seen = Arc::clone(&seen);
            async move {
                let id = ctx.message_id().unwrap_or_default().to_owned();
                seen.lock().unwrap().push(id);
                Ok(())
            }
        });
    let (status, run) = run_consuming(builder, &token).await;

    // The probes and the message after the poison are handled; both poisons are dead letters.
    wait_count(&conn, &topo.dlq_name(), 2, Duration::from_secs(30)).await;
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(30), || handled
            .lock()
            .unwrap()
            .contains(&"after-the-poison".to_owned()))
        .await,
        "the message after the poison was not handled: {:?}",
        handled.lock().unwrap()
    );
    let handled_ids = handled.lock().unwrap().clone();
    assert!(
        !handled_ids.iter().any(|id| id.starts_with("deep-")),
        "a handler saw a message whose headers were cut: {handled_ids:?}"
    );
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
    for _ in 0..2 {
        let d = poll_get(&ch, &topo.dlq_name(), Duration::from_secs(10))
            .await
            .expect("a dead letter");
        let h = d.properties.headers().clone().unwrap_or_default();
        let why = headers_removed(Some(&h)).expect("marked as cut").0;
        assert!(why.contains("deeper than 32 levels"), "{why}");
        assert!(
            matches!(h.inner().get("h"), Some(AMQPValue::LongString(s)) if String::from_utf8_lossy(s.as_bytes()).starts_with("removed by redeliver")),
            "{h:?}"
        );
        let reason = redeliver_amqp::headers::x_death(Some(&h));
        assert!(format!("{reason:?}").contains("rejected"), "{reason:?}");
        dead.push(d.properties.message_id().as_ref().unwrap().to_string());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    dead.sort();
    assert_eq!(dead, ["deep-arrays", "deep-tables"]);

    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
    eprintln!("sent {sent:?}");
}
