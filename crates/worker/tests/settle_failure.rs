//! The connection force-closed between a handler's end and the settling of its delivery: the
//! reject cannot reach the broker, the worker reconnects, the broker redelivers the message and
//! it ends in the DLQ on the new connection; the deliveries around it are not lost.

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
#[path = "common/consuming.rs"]
mod consuming;

use redeliver_amqp::QueueType;
use redeliver_core::HandlerError;
use redeliver_testkit::mgmt::{await_listed_connection, force_close_connection};
use redeliver_testkit::{eventually, ready_count, wait_count};
use redeliver_worker::{Context, Raw, Worker, WorkerState};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

const OTHERS: usize = 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reject_lost_with_its_connection_is_redelivered_and_dead_lettered() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("settlefail", QueueType::Quorum, 2, QueueType::Classic).await;
    let conn_name = format!("settlefail-{queue}");
    let (entered_tx, mut entered) = mpsc::unbounded_channel::<bool>();
    let release = Arc::new(Notify::new());
    let ok = Arc::new(AtomicUsize::new(0));
    let (release2, ok2) = (Arc::clone(&release), Arc::clone(&ok));
    let token = CancellationToken::new();
    let builder = Worker::builder(redeliver_testkit::amqp_url())
        .topology(topo.clone())
        .connection_name(conn_name.clone())
        .handler(move |m: Raw, ctx: Context| {
            let (entered, release, ok) =
                (entered_tx.clone(), Arc::clone(&release2), Arc::clone(&ok2));
            async move {
                if &m[..] != b"poison" {
                    ok.fetch_add(1, Ordering::SeqCst);
                    return Ok(());
                }
                let _ = entered.send(ctx.redelivered());
                if !ctx.redelivered() {
                    // Held until the test has closed the connection under it.
                    release.notified().await;
                }
                Err(HandlerError::permanent("poison"))
            }
        });
    let (mut status, run) = consuming::run_consuming(builder, &token).await;
    await_listed_connection(&conn_name).await;
    publish_all(&conn, &queue, vec![(b"poison".to_vec(), props("poison"))]).await;
    assert_eq!(entered.recv().await, Some(false), "first delivery");
    force_close_connection(&conn_name).await;
    status
        .wait_for_timeout(Duration::from_secs(10), |s| *s != WorkerState::Consuming)
        .await
        .expect("the worker noticed the closed connection");
    release.notify_one();
    publish_all(
        &conn,
        &queue,
        (0..OTHERS)
            .map(|i| (format!("m{i}").into_bytes(), props(&format!("m{i}"))))
            .collect(),
    )
    .await;
    // Redelivered on the new connection, then rejected for good.
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(20), entered.recv())
            .await
            .expect("redelivered"),
        Some(true)
    );
    wait_count(&conn, &topo.dlq_name(), 1, Duration::from_secs(10)).await;
    assert!(
        eventually(Duration::from_secs(10), || ok.load(Ordering::SeqCst)
            == OTHERS)
        .await
    );
    assert_eq!(ready_count(&conn, &queue).await, 0);
    token.cancel();
    run.await.expect("join").expect("clean stop");
}
