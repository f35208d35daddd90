//! Short-string properties and routing keys are not checked for UTF-8 by RabbitMQ, but lapin's
//! parser refuses them and closes the connection: the message went back to the head of the
//! queue and closed the next connection too, so one message stopped every replica (issue 29).
//! Now the frame guard repairs them on receipt: a message whose properties were repaired is
//! dead-lettered as undecodable (its identity is not what was sent), one whose routing key was
//! repaired is handled, and the worker goes on.

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
use redeliver_worker::lapin::ConnectionProperties;
use redeliver_worker::{CancellationToken, Context, Json, QueueType, Worker};

#[derive(serde::Deserialize)]
struct Job {
    #[allow(dead_code)]
    n: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn properties_and_routing_keys_that_are_not_utf8_do_not_stop_the_worker() {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("badutf8", QueueType::Classic, 1, QueueType::Classic).await;
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

    wait_count(&conn, &topo.dlq_name(), 2, Duration::from_secs(30)).await;
    let all_handled = || {
        let h = handled.lock().unwrap();
        h.contains(&"after-the-poison".to_owned()) && h.contains(&"bad-rk".to_owned())
    };
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(30), all_handled).await,
        "the message with a repaired routing key and the one after were not both handled: {:?}",
        handled.lock().unwrap()
    );
    let handled_ids = handled.lock().unwrap().clone();
    assert!(
        !handled_ids
            .iter()
            .any(|id| id.starts_with("bad-id") || id == "bad-ct"),
        "a handler saw a message whose properties were repaired: {handled_ids:?}"
    );
    assert_eq!(status.state(), redeliver_worker::WorkerState::Consuming);
    assert_eq!(redeliver_testkit::ready_count(&conn, &queue).await, 0);

    // The dead letters, read through redeliver's own (guarded) connection, say what was repaired.
    let reader = redeliver_amqp::connect(&url, ConnectionProperties::default(), &TlsConfig::new())
        .await
        .unwrap();
    let rch = reader.create_channel().await.unwrap();
    let mut dead = Vec::new();
    for _ in 0..2 {
        let d = poll_get(&rch, &topo.dlq_name(), Duration::from_secs(10))
            .await
            .expect("a dead letter");
        let h = d.properties.headers().clone().unwrap_or_default();
        let why = headers_removed(Some(&h)).expect("marked as repaired").0;
        assert!(why.contains("not UTF-8"), "{why}");
        let id = d.properties.message_id().as_ref().map(|s| s.to_string());
        let ct = d.properties.content_type().as_ref().map(|s| s.to_string());
        dead.push((id, ct, why));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    dead.sort();
    assert_eq!(dead[0].0.as_deref(), Some("bad-ct"));
    assert_eq!(dead[0].1.as_deref(), Some("application/json?"));
    assert!(dead[0].2.contains("content_type"), "{:?}", dead[0]);
    assert_eq!(dead[1].0.as_deref(), Some("bad-id-??"));
    assert!(dead[1].2.contains("message_id"), "{:?}", dead[1]);

    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
}
