//! A panic in user code that runs while the worker decides what to do with a failure (here a
//! classifier rule) is a transient failure of that delivery, never the worker's: the message is
//! retried and the worker keeps serving. The handler returns without waiting, so the delivery is
//! decided inside the consume loop itself (the path that used to unwind and stop the worker).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fixture.rs"]
mod fixture;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use fixture::fixture;
#[path = "common/consuming.rs"]
mod consuming;

use redeliver_amqp::QueueType;
use redeliver_core::{Classifier, HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::{eventually, ready_count};
use redeliver_worker::{Context, Raw, Worker, WorkerState};
use tokio_util::sync::CancellationToken;

const N: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_classifier_rule_is_a_transient_failure() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("panics", QueueType::Classic, 4, QueueType::Classic).await;
    let attempts: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let seen = Arc::clone(&attempts);
    let token = CancellationToken::new();
    let builder = Worker::builder(redeliver_testkit::amqp_url())
        .topology(topo.clone())
        .policy(
            RetryPolicy::constant(Duration::from_millis(20))
                .jitter(Jitter::None)
                .max_retries(3)
                .classifier(Classifier::default().with_fn(|e| {
                    if e.to_string().contains("boom") {
                        panic!("a classifier rule that panics");
                    }
                    None
                })),
        )
        .handler(move |m: Raw, ctx: Context| {
            let id = String::from_utf8_lossy(&m).into_owned();
            seen.lock()
                .unwrap()
                .entry(id.clone())
                .or_default()
                .push(ctx.attempt());
            // No await: decided inline, in the consume loop.
            let result = if id.starts_with("boom") && ctx.attempt() == 0 {
                Err(HandlerError::from(anyhow::anyhow!("boom")))
            } else {
                Ok(())
            };
            std::future::ready(result)
        });
    let (status, run) = consuming::run_consuming(builder, &token).await;
    publish_all(
        &conn,
        &queue,
        (0..N)
            .map(|i| {
                let id = if i % 2 == 0 {
                    format!("boom-{i}")
                } else {
                    format!("ok-{i}")
                };
                (id.clone().into_bytes(), props(&id))
            })
            .collect(),
    )
    .await;
    let done = || {
        let a = attempts.lock().unwrap();
        a.len() == N
            && a.iter()
                .all(|(id, at)| at.contains(&if id.starts_with("boom") { 1 } else { 0 }))
    };
    assert!(
        eventually(Duration::from_secs(20), done).await,
        "{:?}",
        attempts.lock().unwrap()
    );
    assert_eq!(
        status.state(),
        WorkerState::Consuming,
        "the worker kept serving"
    );
    assert!(!run.is_finished(), "the worker stopped");
    // Each panicking decision became one retry: attempt 0 then 1, nothing dead-lettered.
    for (id, at) in attempts.lock().unwrap().iter() {
        if id.starts_with("boom") {
            assert_eq!(at, &[0, 1], "{id}");
        }
    }
    assert_eq!(ready_count(&conn, &topo.dlq_name()).await, 0);
    token.cancel();
    run.await.expect("join").expect("clean stop");
}
