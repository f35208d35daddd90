//! The metrics the worker emits, observed through the testkit's in-memory recorder (own test
//! binary: the recorder is process-global).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fixture.rs"]
mod fixture;

use std::time::Duration;

use common::*;
use fixture::fixture;
use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::mgmt::{await_listed_connection, force_close_connection};
use redeliver_testkit::recorder::recorder;
use redeliver_testkit::{amqp_url, eventually};
use redeliver_worker::metrics_names as m;
use redeliver_worker::{Context, Json, Worker, WorkerState};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Job {
    kind: String,
}

/// One success, one retry-then-success, one permanent failure, one undecodable body: each
/// counter, the duration histogram and the gauges show exactly that, labelled by queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_match_what_happened() {
    init_tracing();
    let rec = recorder();
    let (_names, conn, topo, queue) =
        fixture("metrics", QueueType::Classic, 6, QueueType::Classic).await;
    let token = CancellationToken::new();
    let conn_name = format!("metrics-{queue}");
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .connection_name(conn_name.clone())
        .policy(
            RetryPolicy::constant(Duration::from_millis(20))
                .jitter(Jitter::None)
                .max_retries(3),
        )
        .handler(|job: Json<Job>, ctx: Context| async move {
            match (job.kind.as_str(), ctx.attempt()) {
                ("flaky", 0) => Err(HandlerError::transient("once")),
                ("bad", _) => Err(HandlerError::permanent("never")),
                _ => Ok(()),
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    let q = format!("queue={queue}");
    for (state, value) in [("consuming", 1.0), ("connecting", 0.0), ("draining", 0.0)] {
        let gauge = rec.gauge(m::CONNECTION_STATE, &format!("{q},state={state}"));
        assert_eq!(gauge, Some(value), "{state}");
    }

    publish_all(
        &conn,
        &queue,
        vec![
            (br#"{"kind":"ok"}"#.to_vec(), props("1")),
            (br#"{"kind":"flaky"}"#.to_vec(), props("2")),
            (br#"{"kind":"bad"}"#.to_vec(), props("3")),
            (b"<xml/>".to_vec(), props("4")),
        ],
    )
    .await;
    let count = |name: &str, labels: &str| rec.counter(name, labels);
    assert!(
        eventually(Duration::from_secs(10), || count(m::MESSAGES_SUCCEEDED, &q)
            == 2)
        .await
    );
    let undecodable = format!("{q},reason=undecodable");
    assert!(
        eventually(Duration::from_secs(5), || count(
            m::MESSAGES_DEAD_LETTERED,
            &undecodable
        ) == 1)
        .await
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        count(m::MESSAGES_RECEIVED, &q),
        5,
        "4 messages + 1 retry copy"
    );
    assert_eq!(count(m::MESSAGES_RETRIED, &format!("attempt=1,{q}")), 1);
    assert_eq!(
        count(m::MESSAGES_DEAD_LETTERED, &format!("{q},reason=permanent")),
        1
    );
    assert_eq!(count(m::SETTLE_FAILURES, &q), 0);
    assert_eq!(
        rec.samples(m::HANDLER_DURATION, &q).len(),
        4,
        "one per handler call (not for the undecodable body)"
    );
    assert_eq!(rec.gauge(m::HANDLERS_IN_FLIGHT, &q), Some(0.0));

    // A lost connection counts as a reconnect once the worker consumes again.
    assert_eq!(count(m::RECONNECTS, &q), 0);
    await_listed_connection(&conn_name).await;
    force_close_connection(&conn_name).await;
    assert!(
        eventually(Duration::from_secs(20), || count(m::RECONNECTS, &q) == 1).await,
        "one reconnect counted"
    );
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming again");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(count(m::RECONNECTS, &q), 1);

    token.cancel();
    run.await.unwrap().unwrap();
    for (state, value) in [("stopped", 1.0), ("consuming", 0.0)] {
        let gauge = rec.gauge(m::CONNECTION_STATE, &format!("{q},state={state}"));
        assert_eq!(gauge, Some(value), "{state}");
    }
}
