//! Forwarding on a real broker: handler timeouts of a queue are retried once, then sent on to
//! another queue (Celery's time-limited task sent to a bigger queue), with their body,
//! `message_id` and user headers and the headers that say where they came from; while the
//! destination does not exist the worker does not consume.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/consuming.rs"]
mod consuming;
#[path = "common/fixture.rs"]
mod fixture;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use consuming::run_consuming;
use fixture::fixture;
use redeliver_amqp::headers::{self, ForwardInfo, RetryState};
use redeliver_amqp::lapin::options::QueueDeclareOptions;
use redeliver_amqp::lapin::types::{AMQPValue, FieldTable};
use redeliver_amqp::QueueType;
use redeliver_core::{Classifier, Forward, Jitter, RetryPolicy, TimedOut};
use redeliver_testkit::{drain, ready_count, wait_count};
use redeliver_worker::{Context, Raw, Worker, WorkerState};
use tokio_util::sync::CancellationToken;

const MESSAGES: usize = 3;

fn forwarding(to: &str) -> RetryPolicy {
    RetryPolicy::constant(Duration::from_millis(50))
        .jitter(Jitter::None)
        .max_retries(5)
        .classifier(Classifier::default().forward_on::<TimedOut>())
        .forward(Forward::to_queue(to).after_attempts(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_are_retried_then_forwarded_with_their_identity_and_origin() {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("forward", QueueType::Quorum, 1, QueueType::Classic).await;
    topo.declare(&conn).await.unwrap();
    let heavy = format!("{}heavy", names.prefix);
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        heavy.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let messages = (0..MESSAGES)
        .map(|i| {
            let mut h = FieldTable::default();
            h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
            let body = format!(r#"{{"image":{i}}}"#).into_bytes();
            (body, props(&format!("img-{i}")).with_headers(h))
        })
        .collect();
    publish_all(&conn, &queue, messages).await;

    // message id -> the attempts the handler saw.
    let calls = Arc::new(Mutex::new(BTreeMap::<String, Vec<u32>>::new()));
    let seen = Arc::clone(&calls);
    let token = CancellationToken::new();
    let builder = Worker::builder(redeliver_testkit::amqp_url())
        .topology(topo.clone())
        .connection_name(format!("{}worker", names.prefix))
        .policy(forwarding(&heavy))
        .handler_timeout(Duration::from_millis(200))
        .handler(move |_: Raw, ctx: Context| {
            let seen = Arc::clone(&seen);
            async move {
                let id = ctx.message_id().unwrap_or_default().to_owned();
                seen.lock()
                    .unwrap()
                    .entry(id)
                    .or_default()
                    .push(ctx.attempt());
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(())
            }
        });
    let (_status, run) = run_consuming(builder, &token).await;

    wait_count(&conn, &heavy, MESSAGES as u32, Duration::from_secs(30)).await;
    // A duplicate forward or a further call would show within the next moments.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let forwarded = drain(&conn, &heavy).await;
    assert_eq!(forwarded.len(), MESSAGES);
    let seen = calls.lock().unwrap().clone();
    for i in 0..MESSAGES {
        let id = format!("img-{i}");
        assert_eq!(seen.get(&id), Some(&vec![0, 1]), "{id}: {seen:?}");
        let m = forwarded
            .iter()
            .find(|m| redeliver_testkit::message_id(&m.delivery.properties) == id)
            .unwrap_or_else(|| panic!("{id} not forwarded"));
        assert_eq!(m.delivery.data, format!(r#"{{"image":{i}}}"#).into_bytes());
        let h = m.delivery.properties.headers().as_ref();
        let info = ForwardInfo::read(h).expect("forward headers");
        assert_eq!(info.from, queue);
        assert_eq!(info.reason, "timeout");
        assert_eq!(info.attempts, Some(2));
        assert_eq!(info.by, Some(format!("{}worker", names.prefix)));
        assert!(
            info.error
                .as_deref()
                .is_some_and(|e| e.contains("timed out after 200ms")),
            "{info:?}"
        );
        assert!(info.at.is_some());
        let h = h.expect("headers");
        assert_eq!(
            h.inner().get("tenant"),
            Some(&AMQPValue::LongString("acme".into()))
        );
        // The destination starts afresh: no retry state, none of the delay hops' x-death.
        assert_eq!(RetryState::read(Some(h)).attempt, 0);
        assert!(!h.contains_key(headers::X_DEATH), "{h:?}");
    }
    assert_eq!(ready_count(&conn, &queue).await, 0);
    assert_eq!(ready_count(&conn, &topo.dlq_name()).await, 0);

    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_does_not_consume_until_its_forward_destination_exists() {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("forward-missing", QueueType::Classic, 1, QueueType::Classic).await;
    topo.declare(&conn).await.unwrap();
    let later = format!("{}later", names.prefix);
    let token = CancellationToken::new();
    let builder = Worker::builder(redeliver_testkit::amqp_url())
        .topology(topo.clone())
        .policy(forwarding(&later))
        .handler(|_: Raw, _: Context| async { Ok(()) });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    // Several connection rounds: never consuming, never ready, still running.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(status.state(), WorkerState::Connecting);
    assert!(!status.is_ready());
    assert!(
        !run.is_finished(),
        "a missing destination must be waited for"
    );
    let depth = redeliver_testkit::queue_depth(&conn, &queue).await.unwrap();
    assert_eq!(depth.consumers, 0);

    // Its own worker declares it (here: the test): the next round consumes.
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        later.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    status
        .wait_for_timeout(Duration::from_secs(40), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming once the destination exists");
    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);
}
