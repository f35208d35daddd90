//! Volume: conservation under random failures, and no delayed message held by the worker.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fixture.rs"]
mod fixture;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use fixture::fixture;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::mgmt::{connection_unacked, prefix_stats, queue_stats, QueueStats};
use redeliver_testkit::{amqp_url, connect, drain_queue, eventually, ready_count, Got};
use redeliver_worker::{Context, Json, Worker, WorkerState};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Job {
    id: u32,
}

const SEED: u64 = 0x5eed_2000;

/// Deterministic 30 % failure for (message, attempt), independent of scheduling order.
fn fails(id: u32, attempt: u32) -> bool {
    let mut rng = StdRng::seed_from_u64(SEED ^ (u64::from(id) << 8) ^ u64::from(attempt));
    rng.random_bool(0.3)
}

/// 2,000 messages, 30 % transient failures (seeded), concurrency 16: every message is either
/// processed exactly once or in the DLQ (exactly those that failed every attempt), none acked
/// twice, none lost, and the handler never ran more than 16 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_thousand_messages_with_random_failures_are_conserved() {
    init_tracing();
    const N: u32 = 2000;
    let max_retries = 3;
    let (_names, conn, topo, queue) =
        fixture("load", QueueType::Classic, 8, QueueType::Classic).await;
    let expected_dead: HashSet<u32> = (0..N)
        .filter(|&id| (0..=max_retries).all(|a| fails(id, a)))
        .collect();

    let successes: Arc<Mutex<HashMap<u32, u32>>> = Default::default();
    let calls: Arc<Mutex<HashMap<u32, Vec<u32>>>> = Default::default();
    let running = Arc::new(AtomicUsize::new(0));
    let max_running = Arc::new(AtomicUsize::new(0));
    let (s, c, r, mr) = (
        successes.clone(),
        calls.clone(),
        running.clone(),
        max_running.clone(),
    );
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .policy(
            RetryPolicy::fixed([10, 20, 40].map(Duration::from_millis))
                .jitter(Jitter::None)
                .max_retries(max_retries),
        )
        .prefetch(32)
        .concurrency(16)
        .handler(move |job: Json<Job>, ctx: Context| {
            let (s, c, r, mr) = (s.clone(), c.clone(), r.clone(), mr.clone());
            async move {
                let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                mr.fetch_max(now, Ordering::SeqCst);
                c.lock()
                    .unwrap()
                    .entry(job.id)
                    .or_default()
                    .push(ctx.attempt());
                // A little work, so that handlers overlap.
                tokio::time::sleep(Duration::from_millis(2)).await;
                r.fetch_sub(1, Ordering::SeqCst);
                if fails(job.id, ctx.attempt()) {
                    Err(HandlerError::transient("simulated outage"))
                } else {
                    *s.lock().unwrap().entry(job.id).or_default() += 1;
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
    let started = Instant::now();
    let messages = (0..N)
        .map(|id| {
            (
                format!(r#"{{"id":{id}}}"#).into_bytes(),
                props(&format!("job-{id}")),
            )
        })
        .collect();
    publish_all(&conn, &queue, messages).await;

    let dlq = topo.dlq_name();
    let mut dead: Vec<Got> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        dead.extend(drain_queue(&conn, &dlq).await);
        let ok = successes.lock().unwrap().len();
        if ok + dead.len() >= N as usize || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    // Let any stray duplicate surface before judging.
    tokio::time::sleep(Duration::from_millis(300)).await;
    token.cancel();
    run.await.unwrap().unwrap();
    dead.extend(drain_queue(&conn, &dlq).await);

    let successes = successes.lock().unwrap().clone();
    let calls = calls.lock().unwrap().clone();
    let dead_ids: Vec<u32> = dead
        .iter()
        .map(|m| m.message_id().trim_start_matches("job-").parse().unwrap())
        .collect();
    let dead_set: HashSet<u32> = dead_ids.iter().copied().collect();
    eprintln!(
        "{N} messages in {elapsed:?}: {} succeeded, {} dead-lettered, {} handler calls, max {} concurrent",
        successes.len(),
        dead_ids.len(),
        calls.values().map(Vec::len).sum::<usize>(),
        max_running.load(Ordering::SeqCst)
    );
    assert_eq!(
        dead_ids.len(),
        dead_set.len(),
        "a message dead-lettered twice"
    );
    assert_eq!(
        dead_set, expected_dead,
        "exactly the messages that failed every attempt"
    );
    assert!(
        successes.values().all(|&n| n == 1),
        "a message succeeded (was acked) twice"
    );
    assert!(dead_set.iter().all(|id| !successes.contains_key(id)));
    assert_eq!(
        successes.len() + dead_set.len(),
        N as usize,
        "count conserved"
    );
    for id in 0..N {
        // Attempts seen are 0, 1, ... in order, one call each, up to the first success.
        let seen = &calls[&id];
        let want: Vec<u32> = (0..=max_retries)
            .take_while(|&a| a == 0 || fails(id, a - 1))
            .collect();
        assert_eq!(seen, &want, "message {id}");
    }
    assert!(max_running.load(Ordering::SeqCst) <= 16);
    assert_eq!(ready_count(&conn, &queue).await, 0);
    assert_eq!(
        levels_ready_now(&conn, &topo).await,
        0,
        "delay levels empty"
    );
}

/// Ready messages over all delay levels of `topo`, right now.
async fn levels_ready_now(
    conn: &redeliver_amqp::lapin::Connection,
    topo: &redeliver_amqp::Topology,
) -> u32 {
    let cfg = topo.configured_delay();
    let mut total = 0;
    for k in 0..cfg.configured_levels() {
        total += ready_count(conn, &cfg.level_name(k)).await;
    }
    total
}

/// With 10,000 messages waiting in the delay levels the worker holds none of them: its queue
/// and its channels have 0 unacked messages (management API).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_delayed_messages_are_not_held_by_the_worker() {
    init_tracing();
    const N: usize = 10_000;
    let names = Names::new("held");
    let conn = connect().await;
    // 16 levels of 10 ms: a 120 s delay fits (max ~655 s).
    let topo = names.topology("q", QueueType::Classic, names.delay(16, QueueType::Classic));
    let queue = topo.queue_name();
    let conn_name = format!("{}worker", names.prefix);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let token = CancellationToken::new();
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .connection_name(conn_name.clone())
        .prefetch(200)
        .concurrency(100)
        .handler(move |_m: Json<serde_json::Value>, _ctx: Context| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                Err(HandlerError::retry_after(
                    Duration::from_secs(120),
                    "not yet",
                ))
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    let started = Instant::now();
    let messages = (0..N)
        .map(|i| {
            (
                format!(r#"{{"n":{i}}}"#).into_bytes(),
                props(&format!("d-{i}")),
            )
        })
        .collect();
    publish_all(&conn, &queue, messages).await;
    assert!(
        eventually(Duration::from_secs(60), || calls.load(Ordering::SeqCst)
            >= N)
        .await,
        "handler saw only {} of {N}",
        calls.load(Ordering::SeqCst)
    );
    eprintln!(
        "{N} messages moved into the delay levels in {:?}",
        started.elapsed()
    );

    // The management API's counters lag (statistics interval): wait for a sample in which all
    // 10,000 are accounted for in the delay levels, then judge that same sample.
    let level = topo.configured_delay().level_name(13); // 120 s = 12000 ticks: highest bit 13
    let mut sample = (QueueStats::default(), QueueStats::default(), 0);
    let ok = eventually(Duration::from_secs(30), || {
        let levels = prefix_stats(&format!("{}redeliver.delay.", names.prefix));
        let q = queue_stats(&queue);
        let held = connection_unacked(&conn_name);
        sample = (levels, q, held);
        levels.messages == N as u64 && q.messages == 0
    })
    .await;
    let (levels, q, held) = sample;
    assert!(
        ok,
        "delay levels never showed {N} messages: levels {levels:?}, queue {q:?}"
    );
    assert_eq!(q.unacked, 0, "queue {queue} has unacked messages");
    assert_eq!(held, 0, "the worker's channels hold unacked messages");
    assert_eq!(
        queue_stats(&level).messages,
        N as u64,
        "all wait in level 13 first"
    );
    assert!(status.is_ready());
    token.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), N, "each message handled once");
}
