//! `shutdown_on_signal`: SIGTERM cancels its token, so a worker run with it stops gracefully and
//! returns Ok (exit code 0).
//! Its own test binary, because the signal goes to the whole process.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fixture.rs"]
mod fixture;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use fixture::fixture;
use redeliver_amqp::QueueType;
use redeliver_core::HandlerError;
use redeliver_testkit::{amqp_url, eventually, ready_count};
use redeliver_worker::{shutdown_on_signal, Context, Raw, Worker, WorkerState};

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_returns_ok() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("sig", QueueType::Classic, 4, QueueType::Classic).await;
    let started = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicUsize::new(0));
    let (s, f) = (started.clone(), finished.clone());
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .concurrency(1)
        .prefetch(1)
        .handler(move |_m: Raw, _c: Context| {
            let (s, f) = (s.clone(), f.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(500)).await;
                f.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let token = shutdown_on_signal().expect("signal handlers");
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    publish_all(
        &conn,
        &queue,
        (0..3)
            .map(|i| (b"x".to_vec(), props(&format!("t-{i}"))))
            .collect(),
    )
    .await;
    assert!(
        eventually(Duration::from_secs(5), || started.load(Ordering::SeqCst)
            == 1)
        .await
    );
    let pid = std::process::id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let result = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("stops")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    assert!(token.is_cancelled(), "the signal cancelled the token");
    assert_eq!(
        finished.load(Ordering::SeqCst),
        1,
        "the in-flight handler finished"
    );
    assert_eq!(
        ready_count(&conn, &queue).await,
        2,
        "the other two wait in the queue"
    );
}
