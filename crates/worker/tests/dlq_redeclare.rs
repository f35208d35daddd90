//! `Q.dlx` and `Q.dlq` deleted while the worker runs: the worker notices within its check
//! interval and declares them again (with the `Q.dlx` -> `Q.dlq` binding), so a message that
//! must be dead-lettered afterwards reaches `Q.dlq` with its headers instead of being dropped
//! (a classic queue dead-lettering to a missing exchange loses the message silently).

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

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use redeliver_amqp::headers;
use redeliver_amqp::QueueType;
use redeliver_core::HandlerError;
use redeliver_testkit::{drain_queue, queue_depth, queue_exists, wait_count};
use redeliver_worker::{Context, DeadLetterMode, Raw, Worker};
use tokio_util::sync::CancellationToken;

/// Whether exchange `name` exists (passive declare on a throwaway channel: a 404 closes it).
async fn exchange_exists(conn: &lapin::Connection, name: &str) -> bool {
    let ch = conn.create_channel().await.expect("channel");
    let exists = redeliver_amqp::passive_exchange(&ch, name)
        .await
        .unwrap_or_else(|e| panic!("cannot inspect exchange {name}: {e}"));
    if exists {
        let _ = ch.close(200, "ok".into()).await;
    }
    exists
}

async fn dead_letter_after_redeclare(test: &str, mode: DeadLetterMode) {
    init_tracing();
    // A classic Q: its dead-lettering into a missing exchange drops the message, so without
    // the re-declaration the message is lost, not merely late.
    let (_names, conn, topo, queue) =
        fixture(test, QueueType::Classic, 4, QueueType::Classic).await;
    let (dlx, dlq) = (topo.dlx_name(), topo.dlq_name());
    let token = CancellationToken::new();
    let builder = Worker::builder(redeliver_testkit::amqp_url())
        .topology(topo.clone())
        .dead_letter_mode(mode)
        .topology_check_interval(Duration::from_millis(200))
        .handler(|_m: Raw, _c: Context| async {
            Err::<(), HandlerError>(HandlerError::permanent("cannot be done"))
        });
    let (_status, run) = consuming::run_consuming(builder, &token).await;

    let ch = conn.create_channel().await.expect("channel");
    ch.queue_delete(dlq.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete Q.dlq");
    ch.exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .expect("delete Q.dlx");
    assert!(!queue_exists(&conn, &dlq).await && !exchange_exists(&conn, &dlx).await);

    let start = Instant::now();
    while !(queue_exists(&conn, &dlq).await && exchange_exists(&conn, &dlx).await) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the worker never declared {dlx} and {dlq} again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    publish_all(&conn, &queue, vec![(b"x".to_vec(), props("doomed"))]).await;
    wait_count(&conn, &dlq, 1, Duration::from_secs(10)).await;
    token.cancel();
    run.await.expect("join").expect("clean stop");

    assert_eq!(queue_depth(&conn, &queue).await.expect("queue").ready, 0);
    let got = drain_queue(&conn, &dlq).await;
    assert_eq!(got.len(), 1, "{got:?}");
    let m = &got[0];
    assert_eq!(m.message_id(), "doomed");
    assert_eq!(m.body, b"x");
    if mode == DeadLetterMode::Reject {
        {
            assert_eq!(
                m.header_str("x-first-death-reason").as_deref(),
                Some("rejected"),
                "{m:?}"
            );
            assert_eq!(
                m.header_str("x-first-death-queue").as_deref(),
                Some(queue.as_str()),
                "{m:?}"
            );
            assert_eq!(
                m.header_str("x-first-death-exchange").as_deref(),
                Some(""),
                "{m:?}"
            );
        }
    } else {
        {
            assert!(m.header_str(headers::DEAD_LETTER_REASON).is_some(), "{m:?}");
            assert!(
                m.header_str(headers::DEAD_LETTER_ERROR)
                    .is_some_and(|e| e.contains("cannot be done")),
                "{m:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_dlx_and_dlq_are_declared_again_reject_mode() {
    dead_letter_after_redeclare("dlqre", DeadLetterMode::Reject).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_dlx_and_dlq_are_declared_again_annotate_mode() {
    dead_letter_after_redeclare("dlqra", DeadLetterMode::Annotate).await;
}
