//! Outcome mapping against a real broker: ack, retry through the delay levels, dead-letter.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/consuming.rs"]
mod consuming;
#[path = "common/fixture.rs"]
mod fixture;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use consuming::run_consuming;
use fixture::fixture;
use redeliver_amqp::headers;
use redeliver_amqp::lapin::types::{AMQPValue, FieldTable};
use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::{
    amqp_url, connect, drain_queue, eventually, ready_count, record, Calls, Got,
};
use redeliver_worker::{Context, Json, Raw, Worker, WorkerState};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Job {
    id: u32,
}

/// Fails transiently twice, then succeeds: three calls, spaced like the policy's delays, the
/// message acked and the DLQ empty. Also: readiness goes Starting -> Consuming -> Stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_twice_then_success() {
    init_tracing();
    let names = Names::new("twice");
    let conn = connect().await;
    // 32 and 64 ticks of 10 ms: one delay level each, so the broker's per-hop latency (which
    // grows when other tests load the broker) is paid once per retry.
    let delays = [Duration::from_millis(320), Duration::from_millis(640)];
    let topo = names.topology("q", QueueType::Classic, names.delay(10, QueueType::Classic));
    let queue = topo.queue_name();
    let calls: Calls = Default::default();
    let c = calls.clone();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .policy(
            RetryPolicy::fixed(delays)
                .jitter(Jitter::None)
                .max_retries(5),
        )
        .concurrency(2)
        .handler(move |job: Json<Job>, ctx: Context| {
            let c = c.clone();
            async move {
                assert_eq!(job.id, 1);
                let n = record(&c, ctx.message_id().unwrap_or(""), ctx.attempt());
                if n <= 2 {
                    Err(HandlerError::transient(format!("flaky #{n}")))
                } else {
                    Ok(())
                }
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    assert_eq!(status.state(), WorkerState::Starting);
    assert!(!status.is_ready());
    let token = CancellationToken::new();
    let run = tokio::spawn(worker.run(token.clone()));
    assert!(
        status
            .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
            .await
            .is_some(),
        "worker never started consuming"
    );
    assert!(status.is_ready());
    assert_eq!(status.queue(), Some(queue.as_str()));

    publish_all(&conn, &queue, vec![(br#"{"id":1}"#.to_vec(), props("m-1"))]).await;
    assert!(
        eventually(Duration::from_secs(10), || calls
            .lock()
            .unwrap()
            .get("m-1")
            .is_some_and(|v| v.len() >= 3))
        .await,
        "handler not called three times"
    );
    // Give a wrong fourth call (or a late ack) the time to show up.
    tokio::time::sleep(Duration::from_millis(300)).await;
    token.cancel();
    run.await.unwrap().expect("run returns Ok on a clean stop");
    assert_eq!(status.state(), WorkerState::Stopped);
    assert!(!status.is_ready());

    let log = calls.lock().unwrap().get("m-1").cloned().unwrap();
    assert_eq!(log.len(), 3, "exactly three handler calls");
    assert_eq!(log.iter().map(|(a, _)| *a).collect::<Vec<_>>(), [0, 1, 2]);
    for (i, want) in delays.iter().enumerate() {
        let got = log[i + 1].1 - log[i].1;
        let tolerance = Duration::from_millis(50) + want.mul_f64(0.02);
        let diff = got.abs_diff(*want);
        eprintln!("gap {i}: observed {got:?}, policy {want:?}");
        assert!(
            diff <= tolerance,
            "gap {i}: observed {got:?}, policy {want:?}, tolerance {tolerance:?}"
        );
    }
    // Acked: nothing left anywhere once the worker's channel is gone.
    assert_eq!(ready_count(&conn, &queue).await, 0);
    assert_eq!(ready_count(&conn, &topo.dlq_name()).await, 0);
}

/// Always transient: max_retries + 1 calls, then the message is in Q.dlq with the
/// x-redeliver-* headers, an x-death `rejected` entry for Q, and body and properties unchanged.
/// Uses the default quorum queues for Q and the delay levels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_transient_ends_in_dlq() {
    init_tracing();
    let names = Names::new("always");
    let conn = connect().await;
    let topo = names.topology("q", QueueType::Quorum, names.delay(8, QueueType::Quorum));
    let queue = topo.queue_name();
    let max_retries = 3;
    let calls = Arc::new(AtomicUsize::new(0));
    let last_errors: Arc<std::sync::Mutex<Vec<Option<String>>>> = Default::default();
    let (c, le) = (calls.clone(), last_errors.clone());
    let token = CancellationToken::new();
    let worker = Worker::builder(amqp_url())
        .topology(topo.clone())
        .policy(
            RetryPolicy::constant(Duration::from_millis(50))
                .jitter(Jitter::None)
                .max_retries(max_retries),
        )
        .handler(move |_m: Raw, ctx: Context| {
            let (c, le) = (c.clone(), le.clone());
            async move {
                let n = c.fetch_add(1, Ordering::SeqCst);
                le.lock().unwrap().push(ctx.last_error().map(str::to_owned));
                Err(HandlerError::transient(format!("upstream down (call {n})")))
            }
        })
        .build()
        .unwrap();
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(30), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");

    let body = br#"{"image":"cat.png","bytes":[1,2,3]}"#.to_vec();
    let mut user_headers = FieldTable::default();
    user_headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    let p = props("m-always")
        .with_correlation_id("corr-7".into())
        .with_headers(user_headers);
    publish_all(&conn, &queue, vec![(body.clone(), p)]).await;

    let dlq = topo.dlq_name();
    let mut dead = Vec::new();
    let start = Instant::now();
    while dead.is_empty() && start.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        dead = drain_queue(&conn, &dlq).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    token.cancel();
    run.await.unwrap().unwrap();

    assert_eq!(calls.load(Ordering::SeqCst), max_retries as usize + 1);
    assert_eq!(dead.len(), 1, "exactly one message in the DLQ");
    let m = &dead[0];
    assert_eq!(m.body, body, "body unchanged");
    assert_eq!(m.message_id(), "m-always");
    assert_eq!(
        m.properties.correlation_id().as_ref().map(|s| s.as_str()),
        Some("corr-7")
    );
    assert_eq!(
        m.properties.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(
        m.header_str("tenant").as_deref(),
        Some("acme"),
        "user header kept"
    );
    assert_eq!(m.header_int(headers::ATTEMPT), Some(i64::from(max_retries)));
    let last = m.header_str(headers::LAST_ERROR).unwrap();
    assert!(last.contains("upstream down (call 2)"), "{last}");
    assert!(m.header_str(headers::FIRST_FAILED_AT).is_some());
    assert_eq!(
        m.header_str(headers::ORIGINAL_EXCHANGE).as_deref(),
        Some("")
    );
    assert_eq!(
        m.header_str(headers::ORIGINAL_ROUTING_KEY).as_deref(),
        Some(queue.as_str())
    );
    let deaths = headers::x_death(m.properties.headers().as_ref());
    assert!(
        deaths
            .iter()
            .any(|d| d.queue == queue && d.reason == "rejected"),
        "x-death has a rejected entry for {queue}: {deaths:?}"
    );
    // The handler saw the previous error on every retry.
    let seen = last_errors.lock().unwrap().clone();
    assert_eq!(seen[0], None);
    assert!(seen[1].as_deref().unwrap().contains("call 0"));
    assert!(seen[3].as_deref().unwrap().contains("call 2"));
    assert_eq!(ready_count(&conn, &queue).await, 0);
}

/// A permanent error is dead-lettered after one call; a body that is not JSON after none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_and_malformed_go_straight_to_dlq() {
    init_tracing();
    let names = Names::new("perm");
    let conn = connect().await;
    let topo = names.topology("q", QueueType::Classic, names.delay(8, QueueType::Classic));
    let queue = topo.queue_name();
    let calls: Calls = Default::default();
    let c = calls.clone();
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .policy(RetryPolicy::constant(Duration::from_millis(20)).max_retries(5))
        .handler(move |job: Json<Job>, ctx: Context| {
            let c = c.clone();
            async move {
                record(&c, ctx.message_id().unwrap_or(""), ctx.attempt());
                if job.id == 13 {
                    Err(HandlerError::permanent("13 is cursed"))
                } else {
                    Ok(())
                }
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    publish_all(
        &conn,
        &queue,
        vec![
            (br#"{"id":13}"#.to_vec(), props("perm")),
            (b"{this is not json".to_vec(), props("garbage")),
            (br#"{"id":1}"#.to_vec(), props("fine")),
        ],
    )
    .await;
    let mut dead = Vec::new();
    let start = Instant::now();
    while dead.len() < 2 && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        dead.extend(drain_queue(&conn, &topo.dlq_name()).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    token.cancel();
    run.await.unwrap().unwrap();

    let mut ids: Vec<&str> = dead.iter().map(Got::message_id).collect();
    ids.sort();
    assert_eq!(ids, ["garbage", "perm"]);
    let calls = calls.lock().unwrap().clone();
    assert_eq!(
        calls.get("perm").map(Vec::len),
        Some(1),
        "permanent: exactly one call"
    );
    assert_eq!(
        calls.get("garbage").map(Vec::len),
        None,
        "malformed: zero calls"
    );
    assert_eq!(calls.get("fine").map(Vec::len), Some(1));
    let garbage = dead.iter().find(|m| m.message_id() == "garbage").unwrap();
    assert_eq!(
        garbage.body, b"{this is not json",
        "poison body kept for inspection"
    );
    let deaths = headers::x_death(garbage.properties.headers().as_ref());
    assert_eq!(deaths.first().map(|d| d.reason.as_str()), Some("rejected"));
    assert_eq!(ready_count(&conn, &queue).await, 0);
}

/// A panic and a timeout are transient errors: retried with their message in
/// x-redeliver-last-error; `retry_after` sets the delay exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_timeout_and_retry_after() {
    init_tracing();
    let names = Names::new("panic");
    let conn = connect().await;
    let topo = names.topology("q", QueueType::Classic, names.delay(10, QueueType::Classic));
    let queue = topo.queue_name();
    type Seen = Vec<(u32, Option<String>, Instant)>;
    let seen: Arc<std::sync::Mutex<Seen>> = Default::default();
    let s = seen.clone();
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .policy(
            RetryPolicy::constant(Duration::from_millis(10))
                .jitter(Jitter::None)
                .max_retries(5),
        )
        .handler_timeout(Duration::from_millis(200))
        .handler(move |_m: Raw, ctx: Context| {
            let s = s.clone();
            async move {
                s.lock().unwrap().push((
                    ctx.attempt(),
                    ctx.last_error().map(str::to_owned),
                    Instant::now(),
                ));
                match ctx.attempt() {
                    0 => panic!("kaboom in the handler"),
                    1 => {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        Ok(())
                    }
                    2 => Err(HandlerError::retry_after(
                        Duration::from_millis(500),
                        "come back later",
                    )),
                    _ => Ok(()),
                }
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    publish_all(&conn, &queue, vec![(b"x".to_vec(), props("p"))]).await;
    assert!(eventually(Duration::from_secs(10), || seen.lock().unwrap().len() >= 4).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    token.cancel();
    run.await.unwrap().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 4);
    assert!(
        seen[1]
            .1
            .as_deref()
            .unwrap()
            .contains("kaboom in the handler"),
        "{:?}",
        seen[1].1
    );
    assert!(
        seen[2].1.as_deref().unwrap().contains("timed out"),
        "{:?}",
        seen[2].1
    );
    assert!(seen[3].1.as_deref().unwrap().contains("come back later"));
    let gap = seen[3].2 - seen[2].2;
    assert!(
        gap >= Duration::from_millis(480) && gap <= Duration::from_millis(600),
        "retry_after(500ms) observed {gap:?}"
    );
    assert_eq!(ready_count(&conn, &queue).await, 0);
    assert_eq!(ready_count(&conn, &topo.dlq_name()).await, 0);
}

/// A retry copy the broker cannot take: bounded by the worker itself on every broker (RabbitMQ
/// 4.3 no longer counts a nack toward the quorum queue's delivery limit). With the copy's level
/// queue and the parking exchange deleted, every copy comes back unroutable; the worker requeues
/// the original `requeue_limit` times, then dead-letters it. A copy over `max_message_size` is dead-lettered at once, never
/// requeued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmable_and_too_large_retry_copies_end_in_the_dlq() {
    init_tracing();
    let version = redeliver_testkit::broker_version().await;
    let (names, conn, topo, queue) =
        fixture("requeue", QueueType::Quorum, 4, QueueType::Classic).await;
    let calls: Calls = Default::default();
    let c = calls.clone();
    let token = CancellationToken::new();
    let requeue_limit = 2;
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .policy(RetryPolicy::constant(Duration::from_millis(20)).max_retries(5))
        .requeue_limit(requeue_limit)
        .max_message_size(1000)
        .handler(move |_body: Raw, ctx: Context| {
            let c = c.clone();
            async move {
                record(&c, ctx.message_id().unwrap_or(""), ctx.attempt());
                Err::<(), _>(HandlerError::transient("downstream unavailable"))
            }
        });
    let (status, run) = run_consuming(builder, &token).await;

    // Too large first, while the delay levels still exist: refused before it is sent.
    publish_all(&conn, &queue, vec![(vec![b'x'; 2000], props("big"))]).await;
    let mut dead = Vec::new();
    let start = Instant::now();
    while dead.is_empty() && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        dead.extend(drain_queue(&conn, &topo.dlq_name()).await);
    }
    assert_eq!(
        dead.iter().map(Got::message_id).collect::<Vec<_>>(),
        ["big"]
    );
    assert_eq!(calls.lock().unwrap().get("big").map(Vec::len), Some(1));

    // A 20 ms delay is 2 ticks: the copy goes to level 1's exchange. With level 1's queue and
    // the parking exchange (the alternate exchange) gone, it routes nowhere and comes back.
    let delay = topo.configured_delay();
    let pct = redeliver_testkit::mgmt::pct;
    // Each object must exist: a 404 here would mean the test no longer tests anything.
    let delete = |path: String, what: &str| {
        let deleted = redeliver_testkit::mgmt::delete(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(deleted, "{what} does not exist");
    };
    delete(
        format!("/api/queues/%2f/{}", pct(&delay.level_name(1))),
        "level 1's queue",
    );
    delete(
        format!("/api/exchanges/%2f/{}", pct(&delay.unroutable_name())),
        "the parking exchange",
    );
    publish_all(&conn, &queue, vec![(b"small".to_vec(), props("stuck"))]).await;
    let start = Instant::now();
    while dead.len() < 2 && start.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        dead.extend(drain_queue(&conn, &topo.dlq_name()).await);
    }
    // Level 1's exchange gone too: each copy is now refused with a 404, which closes the
    // publisher's channel. That must not cost the consuming session (no reconnect, which would
    // also declare the exchange again): the same bound applies.
    delete(
        format!("/api/exchanges/%2f/{}", pct(&delay.level_name(1))),
        "level 1's exchange",
    );
    publish_all(&conn, &queue, vec![(b"closing".to_vec(), props("404"))]).await;
    let start = Instant::now();
    let mut left_consuming = false;
    while dead.len() < 3 && start.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        left_consuming |= status.state() != WorkerState::Consuming;
        dead.extend(drain_queue(&conn, &topo.dlq_name()).await);
    }
    token.cancel();
    run.await.unwrap().unwrap();
    drop(names);

    assert_eq!(
        dead.iter().map(Got::message_id).collect::<Vec<_>>(),
        ["big", "stuck", "404"],
        "RabbitMQ {version}"
    );
    assert!(
        !left_consuming,
        "a closed publisher channel made the worker reconnect"
    );
    assert_eq!(
        calls.lock().unwrap().get("404").map(Vec::len),
        Some(requeue_limit as usize + 1),
        "RabbitMQ {version}: refused by a closed channel, bounded the same way"
    );
    let stuck_calls = calls.lock().unwrap().get("stuck").map(Vec::len);
    assert_eq!(
        stuck_calls,
        Some(requeue_limit as usize + 1),
        "RabbitMQ {version}: one call, then one per requeue"
    );
    for m in &dead {
        let deaths = headers::x_death(m.properties.headers().as_ref());
        assert_eq!(deaths.first().map(|d| d.reason.as_str()), Some("rejected"));
    }
    println!(
        "RabbitMQ {version}: too large: 1 call; unconfirmable: {stuck_calls:?} calls, then the DLQ"
    );
}

/// A message without a message_id is retried without one: every attempt sees the same (absent)
/// identity, no random id per copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_copies_keep_a_missing_message_id() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("anon", QueueType::Classic, 4, QueueType::Classic).await;
    let seen: Arc<std::sync::Mutex<Vec<Option<String>>>> = Default::default();
    let s = seen.clone();
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .policy(RetryPolicy::constant(Duration::from_millis(20)).max_retries(3))
        .handler(move |_m: Raw, ctx: Context| {
            let s = s.clone();
            async move {
                let mut seen = s.lock().unwrap();
                seen.push(ctx.message_id().map(str::to_owned));
                if seen.len() < 3 {
                    Err(HandlerError::transient("again"))
                } else {
                    Ok(())
                }
            }
        });
    let (_status, run) = run_consuming(builder, &token).await;
    let props = redeliver_amqp::lapin::BasicProperties::default().with_delivery_mode(2);
    publish_all(&conn, &queue, vec![(b"anonymous".to_vec(), props)]).await;
    assert!(
        eventually(Duration::from_secs(10), || seen.lock().unwrap().len() >= 3).await,
        "not retried twice"
    );
    token.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![None, None, None]);
}
