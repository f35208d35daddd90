//! The parking queue of the delay infrastructure deleted while the worker runs: the worker
//! notices within its check interval and declares it again, so a retry whose queue is gone
//! is parked, not dropped (an alternate exchange with no queue routes nowhere).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fixture.rs"]
mod fixture;

use std::time::{Duration, Instant};

use common::*;
use fixture::fixture;
#[path = "common/consuming.rs"]
mod consuming;

use lapin::options::QueueDeleteOptions;
use redeliver_amqp::Publisher;
use redeliver_amqp::QueueType;
use redeliver_core::HandlerError;
use redeliver_testkit::{queue_depth, queue_exists, wait_count};
use redeliver_worker::{Context, Raw, Worker};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_parking_queue_is_declared_again_while_running() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("parking", QueueType::Classic, 4, QueueType::Classic).await;
    let delay = topo.configured_delay().clone();
    let parking = delay.unroutable_name();
    let token = CancellationToken::new();
    let builder = Worker::builder(redeliver_testkit::amqp_url())
        .topology(topo.clone())
        .topology_check_interval(Duration::from_millis(200))
        .handler(|_m: Raw, _c: Context| async { Ok::<(), HandlerError>(()) });
    let (_status, run) = consuming::run_consuming(builder, &token).await;
    // Messages keep flowing meanwhile.
    publish_all(&conn, &queue, vec![(b"a".to_vec(), props("a"))]).await;

    let ch = conn.create_channel().await.expect("channel");
    ch.queue_delete(parking.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete the parking queue");
    let start = Instant::now();
    while !queue_exists(&conn, &parking).await {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the worker never declared {parking} again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    publish_all(&conn, &queue, vec![(b"b".to_vec(), props("b"))]).await;

    // A retry for a queue that does not exist reaches the parking queue: nothing dropped.
    let publisher = Publisher::new(&conn, delay.clone())
        .await
        .expect("publisher");
    let gone = format!("{}-gone", queue);
    publisher
        .publish_delayed(
            &gone,
            Duration::from_millis(100),
            b"orphan",
            props("orphan"),
        )
        .await
        .expect("publish");
    wait_count(&conn, &parking, 1, Duration::from_secs(10)).await;
    assert_eq!(queue_depth(&conn, &queue).await.expect("queue").ready, 0);
    token.cancel();
    run.await.expect("join").expect("clean stop");
}
