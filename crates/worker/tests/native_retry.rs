//! Native retry (RabbitMQ 4.3+): the quorum queue holds a retry's delay and dead-letters with the
//! reason, over AMQP 1.0. On an older broker, an explicit `native` is refused at start and
//! `auto` uses the delay levels. Each test reads the broker's version and asserts that
//! version's behaviour.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/consuming.rs"]
mod consuming;
#[path = "common/fixture.rs"]
mod fixture;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use consuming::run_consuming;
use fixture::fixture;
use redeliver_amqp::headers;
use redeliver_amqp::lapin::types::{AMQPValue, FieldTable};
use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::{amqp_url, broker_version, drain_queue, wait_count};
use redeliver_testkit::{record, times_of, Calls};
use redeliver_worker::{Context, Raw, RetryMode, Worker, WorkerError};
use tokio_util::sync::CancellationToken;

/// The handler: `ok` succeeds, `perm` fails permanently, `flaky` fails twice then succeeds,
/// anything else fails transiently.
fn builder(
    topology: redeliver_amqp::Topology,
    mode: RetryMode,
    calls: &Calls,
) -> redeliver_worker::WorkerBuilder {
    let calls = Arc::clone(calls);
    Worker::builder(amqp_url())
        .topology(topology)
        .retry_mode(mode)
        .policy(
            RetryPolicy::exponential(Duration::from_millis(400))
                .jitter(Jitter::None)
                .max_retries(2),
        )
        .handler(move |_body: Raw, ctx: Context| {
            let calls = Arc::clone(&calls);
            async move {
                let id = ctx.message_id().unwrap_or_default().to_owned();
                record(&calls, &id, ctx.attempt());
                match id.as_str() {
                    "ok" => Ok(()),
                    "perm" => Err(HandlerError::permanent("width must be positive")),
                    "flaky" if ctx.attempt() >= 2 => Ok(()),
                    _ => Err(HandlerError::transient(std::io::Error::other(
                        "503 from storage",
                    ))),
                }
            }
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_holds_retries_and_dead_letters_with_the_reason() {
    init_tracing();
    let version = broker_version().await;
    let (_names, conn, topo, queue) =
        fixture("native", QueueType::Quorum, 2, QueueType::Classic).await;
    let calls: Calls = Arc::default();
    if !version.holds_native_retries() {
        // Before 4.3 the queue ignores the delivery time: native is refused at start...
        let token = CancellationToken::new();
        let run = builder(topo.clone(), RetryMode::Native, &calls)
            .build()
            .expect("build")
            .run(token.clone());
        let result = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("an explicit native retry mode is refused at once");
        assert!(
            matches!(result, Err(WorkerError::RetryMode(ref why)) if why.contains("4.3")),
            "{result:?}"
        );
        // ...and auto retries through the delay levels.
        let (status, run) =
            run_consuming(builder(topo.clone(), RetryMode::Auto, &calls), &token).await;
        assert_eq!(status.retry_mode(), Some(RetryMode::Levels));
        publish_all(&conn, &queue, vec![(b"{}".to_vec(), props("flaky"))]).await;
        assert!(
            redeliver_testkit::eventually(Duration::from_secs(20), || times_of(&calls, "flaky")
                .len()
                == 3)
            .await,
            "flaky retried twice through the levels"
        );
        token.cancel();
        run.await.unwrap().unwrap();
        return;
    }
    let token = CancellationToken::new();
    let (status, run) =
        run_consuming(builder(topo.clone(), RetryMode::Native, &calls), &token).await;
    assert_eq!(status.retry_mode(), Some(RetryMode::Native));
    publish_all(
        &conn,
        &queue,
        vec![
            (b"{}".to_vec(), props("ok")),
            (b"{}".to_vec(), props("perm")),
            (b"{}".to_vec(), props("flaky")),
            (b"{}".to_vec(), props("exhausted")),
        ],
    )
    .await;
    let dlq = topo.dlq_name();
    wait_count(&conn, &dlq, 2, Duration::from_secs(30)).await;
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(10), || times_of(&calls, "flaky").len()
            == 3)
        .await,
        "flaky succeeded on its third attempt"
    );
    // The delays the queue held: 400 ms then 800 ms, within 50 ms + 2 %.
    for id in ["flaky", "exhausted"] {
        let times = times_of(&calls, id);
        assert_eq!(times.len(), 3, "{id}: one call and two retries");
        for (i, asked) in [400u64, 800].into_iter().enumerate() {
            let observed = times[i + 1].duration_since(times[i]).as_millis() as u64;
            assert!(
                observed + 5 >= asked && observed <= asked + 50 + asked / 50,
                "{id}: retry {} asked {asked} ms, observed {observed} ms",
                i + 1
            );
        }
    }
    assert_eq!(times_of(&calls, "ok").len(), 1);
    assert_eq!(
        times_of(&calls, "perm").len(),
        1,
        "a permanent error is never retried"
    );
    assert!(!status.native_retry_ignored());
    // The dead letters, read over AMQP 0-9-1: the broker's x-death and our reason.
    let dead = drain_queue(&conn, &dlq).await;
    let mut reasons: Vec<(String, String)> = dead
        .iter()
        .map(|g| {
            let info = headers::DeadLetterInfo::read(g.headers())
                .expect("the reason travels with the dead letter");
            (g.message_id().to_owned(), info.reason)
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            ("exhausted".to_owned(), "retries_exhausted".to_owned()),
            ("perm".to_owned(), "permanent".to_owned())
        ]
    );
    for g in &dead {
        assert!(
            g.death_reason().is_some(),
            "moved by the broker's DLX: x-death is there"
        );
        let info = headers::DeadLetterInfo::read(g.headers()).unwrap();
        assert!(info.error.is_some() && info.by.is_some() && info.at.is_some());
        if g.message_id() == "exhausted" {
            assert_eq!(info.attempts, Some(3));
            assert_eq!(
                headers::RetryState::read(g.headers()).last_error.as_deref(),
                Some("503 from storage")
            );
        }
    }
    token.cancel();
    run.await.unwrap().unwrap();
}

/// A retry handed out before its time (as a broker that ignores `x-opt-delivery-time` does:
/// simulated with a message whose earliest time is in the future) never runs early: it waits
/// the rest in the delay levels, and the worker says the broker ignored the time. Natively on
/// 4.3+ (the rest comes back through the levels with `x-opt-deaths`, which the guard makes
/// decodable), over AMQP 0-9-1 before: a worker of either mode checks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_delivered_early_never_runs_early() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("early", QueueType::Quorum, 8, QueueType::Classic).await;
    let calls: Calls = Arc::default();
    let mode = RetryMode::Levels;
    let token = CancellationToken::new();
    let (status, run) = run_consuming(builder(topo.clone(), mode, &calls), &token).await;
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let mut h = FieldTable::default();
    h.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(1));
    h.insert(
        headers::annotation_name(headers::NOT_BEFORE)
            .unwrap()
            .as_str()
            .into(),
        AMQPValue::LongLongInt(now_ms + 1500),
    );
    let published = Instant::now();
    publish_all(
        &conn,
        &queue,
        vec![(b"{}".to_vec(), props("ok").with_headers(h))],
    )
    .await;
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(10), || times_of(&calls, "ok").len()
            == 1)
        .await,
        "the early retry ran once it was due"
    );
    let waited = times_of(&calls, "ok")[0].duration_since(published);
    assert!(
        waited >= Duration::from_millis(1400),
        "ran after {waited:?}, before its time"
    );
    assert!(status.native_retry_ignored());
    token.cancel();
    run.await.unwrap().unwrap();
}

/// The other ends over AMQP 1.0: a body that does not decode is dead-lettered at once (reason
/// `undecodable`, the handler never called), a forwarded message is a confirmed copy then an
/// accept, and a graceful stop with a handler in flight settles it (nothing lost, nothing left
/// unsettled). On brokers before 4.3 the same ends run through the levels (`auto`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_forwarded_and_in_flight_at_shutdown() {
    use redeliver_core::{Classifier, Forward, TimedOut};
    use redeliver_worker::Json;
    init_tracing();
    let version = broker_version().await;
    let (names, conn, topo, queue) =
        fixture("nativeends", QueueType::Quorum, 2, QueueType::Classic).await;
    topo.declare(&conn).await.unwrap();
    let heavy = format!("{}heavy", names.prefix);
    redeliver_testkit::declare_queue(&conn, &heavy).await;
    let calls: Calls = Arc::default();
    let seen = Arc::clone(&calls);
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .retry_mode(RetryMode::Auto)
        .handler_timeout(Duration::from_millis(300))
        .shutdown_grace(Duration::from_secs(10))
        .policy(
            RetryPolicy::constant(Duration::from_millis(100))
                .jitter(Jitter::None)
                .max_retries(3)
                .classifier(Classifier::default().forward_on::<TimedOut>())
                .forward(Forward::to_queue(&heavy).after_attempts(1)),
        )
        .handler(move |_body: Json<serde_json::Value>, ctx: Context| {
            let calls = Arc::clone(&seen);
            async move {
                let id = ctx.message_id().unwrap_or_default().to_owned();
                record(&calls, &id, ctx.attempt());
                match id.as_str() {
                    "slow" => tokio::time::sleep(Duration::from_secs(2)).await,
                    "timeout" => tokio::time::sleep(Duration::from_secs(5)).await,
                    _ => {}
                }
                Ok::<(), HandlerError>(())
            }
        });
    let (status, run) = run_consuming(builder, &token).await;
    let native = version.holds_native_retries();
    assert_eq!(
        status.retry_mode(),
        Some(if native {
            RetryMode::Native
        } else {
            RetryMode::Levels
        })
    );
    publish_all(
        &conn,
        &queue,
        vec![
            (b"not json".to_vec(), props("garbage")),
            (b"{}".to_vec(), props("timeout")),
        ],
    )
    .await;
    let dlq = topo.dlq_name();
    wait_count(&conn, &dlq, 1, Duration::from_secs(20)).await;
    wait_count(&conn, &heavy, 1, Duration::from_secs(20)).await;
    assert!(
        times_of(&calls, "garbage").is_empty(),
        "the handler never sees what does not decode"
    );
    let dead = drain_queue(&conn, &dlq).await;
    assert_eq!(dead.len(), 1);
    let reason = headers::DeadLetterInfo::read(dead[0].headers()).map(|i| i.reason);
    if native {
        // The reason travels with the broker's own dead letter.
        assert_eq!(reason.as_deref(), Some("undecodable"));
    } else {
        assert_eq!(dead[0].death_reason().as_deref(), Some("rejected"));
    }
    let forwarded = drain_queue(&conn, &heavy).await;
    assert_eq!(forwarded.len(), 1);
    assert_eq!(forwarded[0].message_id(), "timeout");
    assert_eq!(
        forwarded[0].header_str(headers::FORWARD_REASON).as_deref(),
        Some("timeout")
    );
    // A stop with a handler in flight: it finishes within the grace period and is settled.
    publish_all(&conn, &queue, vec![(b"{}".to_vec(), props("slow"))]).await;
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(10), || times_of(&calls, "slow").len()
            == 1)
        .await,
        "slow started"
    );
    token.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(times_of(&calls, "slow").len(), 1);
    let depth = redeliver_testkit::queue_depth(&conn, &queue).await.unwrap();
    assert_eq!(
        depth.ready, 0,
        "the in-flight message was settled before the stop: {depth:?}"
    );
}

/// A rolling change of retry mode: a retry the queue holds natively is handled by a worker in
/// levels mode (AMQP 0-9-1) at its time, with its attempt count; and a retry copy that came
/// through the delay levels (carrying the broker's deaths) is handled by a native worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_retry_is_handled_by_a_levels_worker() {
    init_tracing();
    let version = broker_version().await;
    if !version.holds_native_retries() {
        // No native retries exist before 4.3: what a levels worker does with an early retry is
        // `a_retry_delivered_early_never_runs_early`.
        return;
    }
    let (_names, conn, topo, queue) =
        fixture("nativemix", QueueType::Quorum, 2, QueueType::Classic).await;
    let calls: Calls = Arc::default();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let first = {
        let calls = Arc::clone(&calls);
        Worker::builder(amqp_url())
            .topology(topo.clone())
            .retry_mode(RetryMode::Native)
            .policy(
                RetryPolicy::constant(Duration::from_millis(1500))
                    .jitter(Jitter::None)
                    .max_retries(3),
            )
            .handler(move |_: Raw, ctx: Context| {
                let calls = Arc::clone(&calls);
                async move {
                    record(&calls, ctx.message_id().unwrap_or_default(), ctx.attempt());
                    Err::<(), _>(HandlerError::transient(std::io::Error::other("503")))
                }
            })
    };
    let token = CancellationToken::new();
    let (_status, run) = run_consuming(first, &token).await;
    publish_all(&conn, &queue, vec![(b"{}".to_vec(), props("mix"))]).await;
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(10), || times_of(&calls, "mix").len()
            == 1)
        .await,
        "first attempt"
    );
    let failed_at = times_of(&calls, "mix")[0];
    // Let the outcome reach the broker, then stop: the retry waits in the queue.
    tokio::time::sleep(Duration::from_millis(200)).await;
    token.cancel();
    run.await.unwrap().unwrap();
    let second = {
        let calls = Arc::clone(&calls);
        let attempts = Arc::clone(&attempts);
        Worker::builder(amqp_url())
            .topology(topo.clone())
            .retry_mode(RetryMode::Levels)
            .handler(move |_: Raw, ctx: Context| {
                let calls = Arc::clone(&calls);
                let attempts = Arc::clone(&attempts);
                async move {
                    record(&calls, ctx.message_id().unwrap_or_default(), ctx.attempt());
                    attempts.lock().unwrap().push(ctx.attempt());
                    Ok::<(), HandlerError>(())
                }
            })
    };
    let token = CancellationToken::new();
    let (_status, run) = run_consuming(second, &token).await;
    assert!(
        redeliver_testkit::eventually(Duration::from_secs(10), || times_of(&calls, "mix").len()
            == 2)
        .await,
        "the levels worker handled the native retry"
    );
    let waited = times_of(&calls, "mix")[1].duration_since(failed_at);
    assert!(
        waited >= Duration::from_millis(1450),
        "handled after {waited:?}, before its time"
    );
    assert_eq!(
        *attempts.lock().unwrap(),
        [1],
        "the retry state read from x-opt-redeliver-*"
    );
    token.cancel();
    run.await.unwrap().unwrap();
}
