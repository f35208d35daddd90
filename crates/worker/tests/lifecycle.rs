//! Shutdown, connection loss, verify-only mode, several queues in one process.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fixture.rs"]
mod fixture;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use fixture::fixture;
use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::mgmt::{await_listed_connection, force_close_connection};
use redeliver_testkit::{amqp_url, connect, eventually, ready_count};
use redeliver_worker::{run_all, Context, Json, Raw, Worker, WorkerError, WorkerState};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Job {
    id: u32,
}

/// Stop requested while handlers run: they finish and are acked, nothing else is started, the
/// messages not processed are back in Q, and `run` returns Ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_batch_finishes_in_flight_and_keeps_the_rest() {
    init_tracing();
    const N: usize = 40;
    let (_names, conn, topo, queue) =
        fixture("stop", QueueType::Quorum, 6, QueueType::Classic).await;
    let started = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicUsize::new(0));
    let saw_shutdown = Arc::new(AtomicUsize::new(0));
    let (s, f, sd) = (started.clone(), finished.clone(), saw_shutdown.clone());
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .prefetch(8)
        .concurrency(4)
        .shutdown_grace(Duration::from_secs(10))
        .handler(move |_m: Raw, ctx: Context| {
            let (s, f, sd) = (s.clone(), f.clone(), sd.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(600)).await;
                if ctx.is_shutting_down() {
                    sd.fetch_add(1, Ordering::SeqCst);
                }
                f.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(30), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    let messages = (0..N)
        .map(|i| (b"{}".to_vec(), props(&format!("s-{i}"))))
        .collect();
    publish_all(&conn, &queue, messages).await;
    assert!(
        eventually(Duration::from_secs(5), || started.load(Ordering::SeqCst)
            >= 4)
        .await
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before_stop = started.load(Ordering::SeqCst);
    let stop_at = Instant::now();
    token.cancel();
    let mut s2 = status.clone();
    assert!(s2
        .wait_for_timeout(Duration::from_secs(2), |s| *s == WorkerState::Draining
            || *s == WorkerState::Stopped)
        .await
        .is_some());
    let result = run.await.unwrap();
    let took = stop_at.elapsed();
    assert!(result.is_ok(), "clean stop returns Ok: {result:?}");
    let started = started.load(Ordering::SeqCst);
    let finished = finished.load(Ordering::SeqCst);
    assert_eq!(started, before_stop, "nothing new started after the stop");
    assert_eq!(finished, started, "every in-flight handler finished");
    assert!(
        saw_shutdown.load(Ordering::SeqCst) >= 1,
        "handlers could see the shutdown"
    );
    assert!(took < Duration::from_secs(5), "stop took {took:?}");
    // The broker returns a closed channel's unacked deliveries asynchronously (a quorum queue
    // through its Raft log on 4.x), so the count is awaited, not read once.
    redeliver_testkit::wait_count(&conn, &queue, (N - finished) as u32, Duration::from_secs(5))
        .await;
    assert_eq!(ready_count(&conn, &topo.dlq_name()).await, 0);
}

/// A handler longer than the grace period is dropped unsettled: its message returns to the
/// queue, and `run` still returns Ok soon after the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grace_period_over_returns_messages_to_the_queue() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("grace", QueueType::Classic, 6, QueueType::Classic).await;
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .concurrency(2)
        .shutdown_grace(Duration::from_millis(300))
        .handler(move |_m: Raw, _ctx: Context| {
            let s = s.clone();
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok::<(), HandlerError>(())
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    let messages = (0..5)
        .map(|i| (b"x".to_vec(), props(&format!("g-{i}"))))
        .collect();
    publish_all(&conn, &queue, messages).await;
    assert!(
        eventually(Duration::from_secs(5), || started.load(Ordering::SeqCst)
            == 2)
        .await
    );
    let t = Instant::now();
    token.cancel();
    run.await.unwrap().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "stop took {:?}",
        t.elapsed()
    );
    assert_eq!(
        ready_count(&conn, &queue).await,
        5,
        "all five back in the queue"
    );
}

/// The broker force-closes the worker's connection while messages flow: the worker reports
/// Reconnecting, comes back, and every message is processed; none is lost or dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_killed_by_the_broker_recovers_and_loses_nothing() {
    init_tracing();
    const N: u32 = 600;
    let (names, conn, topo, queue) =
        fixture("kill", QueueType::Quorum, 8, QueueType::Classic).await;
    let conn_name = format!("{}worker", names.prefix);
    let done: Arc<Mutex<HashMap<u32, u32>>> = Default::default();
    let redelivered = Arc::new(AtomicUsize::new(0));
    let (d, rd) = (done.clone(), redelivered.clone());
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .connection_name(conn_name.clone())
        .reconnect_backoff(
            redeliver_core::Backoff::Exponential {
                base: Duration::from_millis(100),
                factor: 2.0,
                cap: Duration::from_secs(2),
            },
            Jitter::Full,
        )
        .policy(RetryPolicy::constant(Duration::from_millis(20)).max_retries(5))
        .prefetch(16)
        .concurrency(8)
        .handler(move |job: Json<Job>, ctx: Context| {
            let (d, rd) = (d.clone(), rd.clone());
            async move {
                if ctx.redelivered() {
                    rd.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                *d.lock().unwrap().entry(job.id).or_default() += 1;
                Ok::<(), HandlerError>(())
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let states: Arc<Mutex<Vec<WorkerState>>> = Default::default();
    let st = states.clone();
    let mut watcher = status.clone();
    tokio::spawn(async move {
        while let Some(s) = watcher.changed().await {
            st.lock().unwrap().push(s);
        }
    });
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(30), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    await_listed_connection(&conn_name).await;
    let messages = (0..N)
        .map(|id| {
            (
                format!(r#"{{"id":{id}}}"#).into_bytes(),
                props(&format!("k-{id}")),
            )
        })
        .collect();
    publish_all(&conn, &queue, messages).await;
    assert!(
        eventually(Duration::from_secs(10), || done.lock().unwrap().len()
            >= 100)
        .await
    );
    force_close_connection(&conn_name).await;
    let processed_at_kill = done.lock().unwrap().len();
    assert!(
        status
            .wait_for_timeout(Duration::from_secs(5), |s| *s != WorkerState::Consuming)
            .await
            .is_some(),
        "worker did not notice the lost connection"
    );
    assert!(
        status
            .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
            .await
            .is_some(),
        "worker did not recover"
    );
    assert!(
        eventually(Duration::from_secs(30), || done.lock().unwrap().len()
            == N as usize)
        .await,
        "only {} of {N} processed",
        done.lock().unwrap().len()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    token.cancel();
    run.await.unwrap().unwrap();
    let done = done.lock().unwrap().clone();
    let duplicates: u32 = done.values().map(|n| n - 1).sum();
    eprintln!(
        "killed after {processed_at_kill} processed; {duplicates} duplicates, {} redelivered deliveries; states {:?}",
        redelivered.load(Ordering::SeqCst),
        states.lock().unwrap()
    );
    assert_eq!(done.len(), N as usize, "every message processed");
    assert!(states.lock().unwrap().contains(&WorkerState::Reconnecting));
    assert_eq!(
        ready_count(&conn, &queue).await,
        0,
        "nothing left in the queue"
    );
    assert_eq!(
        ready_count(&conn, &topo.dlq_name()).await,
        0,
        "nothing dead-lettered"
    );
}

/// The broker cancels the consumer (its queue is deleted under it, channel still open): the
/// worker treats the session as lost, re-declares the topology and consumes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_cancelled_by_the_broker_redeclares_and_resumes() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("cancel", QueueType::Classic, 4, QueueType::Classic).await;
    let got = Arc::new(AtomicUsize::new(0));
    let g = got.clone();
    let token = CancellationToken::new();
    let builder =
        Worker::builder(amqp_url())
            .topology(topo.clone())
            .handler(move |_m: Raw, _c: Context| {
                let g = g.clone();
                async move {
                    g.fetch_add(1, Ordering::SeqCst);
                    Ok::<(), HandlerError>(())
                }
            });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    assert!(
        status
            .wait_for_timeout(Duration::from_secs(5), |s| *s != WorkerState::Consuming)
            .await
            .is_some(),
        "consumer cancellation not noticed"
    );
    assert!(status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .is_some());
    publish_all(&conn, &queue, vec![(b"x".to_vec(), props("after"))]).await;
    assert!(eventually(Duration::from_secs(5), || got.load(Ordering::SeqCst) == 1).await);
    token.cancel();
    run.await.unwrap().unwrap();
}

/// Verify-only mode against a topology that does not exist: `run` fails with a topology error
/// instead of reconnecting forever; with the topology declared it consumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_only_fails_fast_on_missing_topology() {
    init_tracing();
    let names = Names::new("verify");
    let conn = connect().await;
    let topo = names.topology("q", QueueType::Classic, names.delay(4, QueueType::Classic));
    let handler = |_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) };
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        Worker::builder(amqp_url())
            .topology(topo.clone())
            .verify_only(true)
            .handler(handler)
            .build()
            .expect("build")
            .run(CancellationToken::new()),
    )
    .await
    .expect("verify-only must not retry forever");
    match result {
        Err(WorkerError::Topology(e)) => eprintln!("as expected: {e}"),
        other => panic!("expected a topology error, got {other:?}"),
    }
    topo.declare(&conn).await.unwrap();
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .verify_only(true)
        .handler(handler);
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    assert!(status
        .wait_for_timeout(Duration::from_secs(10), |s| *s == WorkerState::Consuming)
        .await
        .is_some());
    token.cancel();
    run.await.unwrap().unwrap();
}

/// Two queues with different message types in one process through `run_all`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_queues_in_one_process() {
    init_tracing();
    let names = Names::new("multi");
    let conn = connect().await;
    let delay = names.delay(6, QueueType::Classic);
    let a = names.topology("a", QueueType::Classic, delay.clone());
    let b = names.topology("b", QueueType::Classic, delay);
    let got_a = Arc::new(AtomicUsize::new(0));
    let got_b = Arc::new(AtomicUsize::new(0));
    let (ga, gb) = (got_a.clone(), got_b.clone());
    let wa = Worker::builder(amqp_url())
        .topology(a.clone())
        .handler(move |job: Json<Job>, _c: Context| {
            let ga = ga.clone();
            async move {
                assert_eq!(job.id, 7);
                ga.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        })
        .build()
        .unwrap();
    let wb = Worker::builder(amqp_url())
        .topology(b.clone())
        .handler(move |text: redeliver_worker::Text, _c: Context| {
            let gb = gb.clone();
            async move {
                assert_eq!(&*text, "hello");
                gb.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        })
        .build()
        .unwrap();
    let (mut sa, mut sb) = (wa.status_handle(), wb.status_handle());
    let token = CancellationToken::new();
    let run = tokio::spawn(run_all([wa, wb], token.clone()));
    for s in [&mut sa, &mut sb] {
        s.wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
            .await
            .expect("both consuming");
    }
    publish_all(
        &conn,
        &a.queue_name(),
        vec![(br#"{"id":7}"#.to_vec(), props("a1"))],
    )
    .await;
    publish_all(
        &conn,
        &b.queue_name(),
        vec![(b"hello".to_vec(), props("b1"))],
    )
    .await;
    assert!(
        eventually(Duration::from_secs(5), || got_a.load(Ordering::SeqCst) == 1
            && got_b.load(Ordering::SeqCst) == 1)
        .await
    );
    token.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(sa.state(), WorkerState::Stopped);
    assert_eq!(sb.state(), WorkerState::Stopped);
}

/// No broker at the address: the worker keeps trying (not ready, state Connecting) instead of
/// failing, and a cancel while disconnected still returns Ok promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_broker_keeps_retrying_until_cancelled() {
    // Port 1 on localhost: nothing listens, connects are refused at once.
    let attempts_window = Duration::from_millis(800);
    let builder = Worker::builder("amqp://guest:guest@127.0.0.1:1/%2f")
        .queue("never")
        .reconnect_backoff(
            redeliver_core::Backoff::Constant(Duration::from_millis(50)),
            Jitter::None,
        )
        .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) });
    let worker = builder.build().expect("build");
    let status = worker.status_handle();
    let token = CancellationToken::new();
    let run = tokio::spawn(worker.run(token.clone()));
    tokio::time::sleep(attempts_window).await;
    assert_eq!(status.state(), WorkerState::Connecting);
    assert!(!status.is_ready());
    assert!(!run.is_finished(), "connection failures are not fatal");
    let t = Instant::now();
    token.cancel();
    run.await.unwrap().unwrap();
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(status.state(), WorkerState::Stopped);
}

/// Configuration mistakes are reported by `build`, before any connection.
#[test]
fn build_rejects_bad_configuration() {
    let h = |_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) };
    let err = |b: redeliver_worker::WorkerBuilder| match b.build() {
        Err(e) => e.to_string(),
        Ok(_) => panic!("expected an error"),
    };
    assert!(err(Worker::builder("amqp://x").handler(h)).contains("no queue"));
    assert!(err(Worker::builder("amqp://x").queue("q")).contains("no handler"));
    assert!(err(Worker::builder("amqp://x")
        .queue("q")
        .prefetch(0)
        .handler(h))
    .contains("prefetch"));
    assert!(err(Worker::builder("amqp://x")
        .queue("q")
        .concurrency(0)
        .handler(h))
    .contains("concurrency"));
    assert!(err(Worker::builder("amqp://x").queue("a.*.b").handler(h)).contains("a.*.b"));
    assert!(err(Worker::builder("nope://x").queue("q").handler(h)).contains("URL"));
    let w = Worker::builder("amqp://x")
        .queue("q")
        .prefix("eu-")
        .concurrency(3)
        .handler(h)
        .build()
        .unwrap();
    assert_eq!(w.queue_name(), "eu-q");
    assert_eq!(w.status_handle().state(), WorkerState::Starting);
}

/// Several URLs: the first points at a port where no broker listens, so the worker goes on with
/// its failover URL at once, consumes there, says which URL it uses, and after a forced close it
/// skips the dead URL again within one round (no backoff pause between the two).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_urls_are_tried_in_turn() {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("failover", QueueType::Classic, 4, QueueType::Classic).await;
    let conn_name = format!("{}worker", names.prefix);
    const PAUSE: Duration = Duration::from_secs(5);
    // Port 1 on loopback: nothing listens there, the connect is refused at once.
    let dead = "amqp://guest:guest@127.0.0.1:1/%2f";
    let got = Arc::new(AtomicUsize::new(0));
    let g = got.clone();
    let token = CancellationToken::new();
    let builder = Worker::builder(dead)
        .failover_urls([amqp_url()])
        .topology(topo.clone())
        .connection_name(conn_name.clone())
        // Pauses of 5 s (after a lost connection, or after a whole round failed): consuming
        // sooner than that proves there was no pause between the dead URL and the live one.
        .reconnect_backoff(
            redeliver_core::Backoff::Exponential {
                base: PAUSE,
                factor: 2.0,
                cap: Duration::from_secs(20),
            },
            Jitter::None,
        )
        .handler(move |_m: Raw, _c: Context| {
            let g = g.clone();
            async move {
                g.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    assert_eq!(status.broker(), None, "not connected yet");
    let started = Instant::now();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(10), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming through the failover URL");
    assert!(
        started.elapsed() < PAUSE - Duration::from_secs(1),
        "no pause between the URLs of one round, yet consuming took {:?}",
        started.elapsed()
    );
    assert_eq!(
        status.broker(),
        Some(1),
        "connected through failover URL #1"
    );
    publish_all(&conn, &queue, vec![(b"a".to_vec(), props("f-1"))]).await;
    assert!(eventually(Duration::from_secs(10), || got.load(Ordering::SeqCst) == 1).await);

    await_listed_connection(&conn_name).await;
    force_close_connection(&conn_name).await;
    let lost_at = Instant::now();
    status
        .wait_for_timeout(Duration::from_secs(5), |s| *s != WorkerState::Consuming)
        .await
        .expect("noticed the forced close");
    status
        .wait_for_timeout(Duration::from_secs(15), |s| *s == WorkerState::Consuming)
        .await
        .expect("recovered through the failover URL");
    // One pause after the loss, then the dead URL and the live one without another.
    assert!(
        lost_at.elapsed() < 2 * PAUSE - Duration::from_secs(1),
        "recovery took {:?}",
        lost_at.elapsed()
    );
    assert_eq!(status.broker(), Some(1));
    publish_all(&conn, &queue, vec![(b"b".to_vec(), props("f-2"))]).await;
    assert!(eventually(Duration::from_secs(10), || got.load(Ordering::SeqCst) == 2).await);
    token.cancel();
    run.await.unwrap().unwrap();
}

/// Every failover URL is validated when the worker is built, with the password masked.
#[test]
fn a_bad_failover_url_is_a_configuration_error() {
    let err = Worker::builder(amqp_url())
        .failover_urls(["http://user:hunter2@rabbit-1/"])
        .queue("q")
        .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
        .build()
        .unwrap_err();
    assert!(matches!(err, WorkerError::Config(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("rabbit-1") && !text.contains("hunter2"),
        "{text}"
    );
}

/// Batched acks never cover a delivery whose handler still runs, and a slow one at the front does
/// not hold back the acks of the finished ones behind it: with the oldest delivery stuck in its
/// handler, the others are acked (alone) within a few ticks. Proven by force-closing the
/// connection then: the stuck message comes back (redelivered), none of the others does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_skip_a_running_delivery_and_do_not_wait_for_it() {
    init_tracing();
    let (names, conn, topo, queue) =
        fixture("acks", QueueType::Classic, 4, QueueType::Classic).await;
    let conn_name = format!("{}worker", names.prefix);
    // (message id, redelivered) of every handler call.
    let calls: Arc<Mutex<Vec<(String, bool)>>> = Default::default();
    let release = Arc::new(tokio::sync::Notify::new());
    let (c, r) = (calls.clone(), release.clone());
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .connection_name(conn_name.clone())
        .prefetch(8)
        .concurrency(4)
        .shutdown_grace(Duration::from_secs(2))
        .handler(move |_m: Raw, ctx: Context| {
            let (c, r) = (c.clone(), r.clone());
            async move {
                let id = ctx.message_id().unwrap_or_default().to_owned();
                c.lock().unwrap().push((id.clone(), ctx.redelivered()));
                if id == "slow" && !ctx.redelivered() {
                    // Stuck until the end of the test.
                    r.notified().await;
                }
                Ok::<(), HandlerError>(())
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(30), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    await_listed_connection(&conn_name).await;
    // "slow" first, so it has the oldest delivery tag and sits at the front of the ack window.
    let ids = ["slow", "f1", "f2", "f3", "f4"];
    for id in ids {
        publish_all(&conn, &queue, vec![(b"x".to_vec(), props(id))]).await;
    }
    assert!(
        eventually(Duration::from_secs(10), || calls.lock().unwrap().len() == 5).await,
        "calls: {:?}",
        calls.lock().unwrap()
    );
    // Longer than a finished delivery may wait behind a running one (two 25 ms ticks).
    tokio::time::sleep(Duration::from_millis(300)).await;
    force_close_connection(&conn_name).await;
    assert!(
        eventually(Duration::from_secs(20), || calls.lock().unwrap().len() >= 6).await,
        "the stuck message never came back: {:?}",
        calls.lock().unwrap()
    );
    // Nothing else may still be on its way back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    release.notify_waiters();
    token.cancel();
    run.await.unwrap().unwrap();
    let calls = calls.lock().unwrap().clone();
    for id in &ids[1..] {
        assert_eq!(
            calls.iter().filter(|(i, _)| i == id).count(),
            1,
            "{id} was acked while the slow one ran, so it is not redelivered: {calls:?}"
        );
    }
    let slow: Vec<bool> = calls
        .iter()
        .filter(|(i, _)| i == "slow")
        .map(|(_, r)| *r)
        .collect();
    assert_eq!(
        slow,
        [false, true],
        "the running one was never acked: {calls:?}"
    );
    assert_eq!(ready_count(&conn, &queue).await, 0);
    assert_eq!(ready_count(&conn, &topo.dlq_name()).await, 0);
}
