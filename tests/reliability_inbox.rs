//! Exactly-once effects through the PostgreSQL inbox under the reliability suite's fault mix
//! (issue 31, item 5): messages flow while worker processes abort on their own right after a
//! commit (before the ack) and inside a transaction (before the commit), are SIGKILLed by the
//! test, and have their broker connections force-closed, with transient failures rolling back
//! one attempt in five. At-least-once delivery then hands many messages over more than once;
//! the business table `effects` (no unique constraint) must end with exactly one row per id,
//! nothing lost and nothing in the DLQ.
//!
//! A second test force-closes the workers' connections alone (management API
//! `DELETE /api/connections/{name}`): retry copies cut off before their confirm send a message
//! twice, and the inbox keeps one effect.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "inbox_support/effects_db.rs"]
mod effects_db;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use effects_db::effects_db;
use redeliver_testkit::mgmt;
use redeliver_testkit::reliability::{
    assert_inbox_end, report, End, Scenario, Shape, WorkerCmd, WorkerProc,
};
use tokio::sync::Mutex;

/// Worker processes restarted as soon as they die (an injected abort, a SIGKILL).
struct Fleet {
    cmd: WorkerCmd,
    workers: Mutex<Vec<WorkerProc>>,
    restarts: AtomicUsize,
}

impl Fleet {
    fn start(cmd: WorkerCmd, n: usize) -> Arc<Fleet> {
        let workers = (0..n).map(|i| cmd.spawn(&format!("w{i}-0"))).collect();
        Arc::new(Fleet {
            cmd,
            workers: Mutex::new(workers),
            restarts: Default::default(),
        })
    }

    /// Respawns dead workers every 50 ms until `stop` is cancelled.
    fn supervise(self: &Arc<Self>, stop: Stop) -> tokio::task::JoinHandle<()> {
        let fleet = Arc::clone(self);
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                {
                    let mut ws = fleet.workers.lock().await;
                    for (i, w) in ws.iter_mut().enumerate() {
                        if !w.is_running() {
                            let n = fleet.restarts.fetch_add(1, Ordering::SeqCst) + 1;
                            *w = fleet.cmd.spawn(&format!("w{i}-{n}"));
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    }

    async fn kill(&self, which: &[usize]) {
        let mut ws = self.workers.lock().await;
        for &i in which {
            ws[i].kill();
        }
    }

    async fn stop(&self) {
        for w in self.workers.lock().await.iter_mut() {
            w.terminate(Duration::from_secs(10)).await;
        }
    }
}

/// Stops the supervisor.
#[derive(Clone, Default)]
struct Stop(Arc<AtomicBool>);

impl Stop {
    fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Lines containing `needle` in every worker log of the scenario.
fn log_count(s: &Scenario, needle: &str) -> usize {
    std::fs::read_dir(&s.dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
                .map(|e| {
                    std::fs::read_to_string(e.path())
                        .unwrap_or_default()
                        .lines()
                        .filter(|l| l.contains(needle))
                        .count()
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Publishes `ids` in chunks spread over `flow`.
fn publish_over(s: &Arc<Scenario>, ids: &[String], flow: Duration) -> tokio::task::JoinHandle<()> {
    let chunks: Vec<Vec<String>> = ids
        .chunks((ids.len() / (flow.as_millis() as usize / 100)).max(1))
        .map(<[String]>::to_vec)
        .collect();
    let s = Arc::clone(s);
    tokio::spawn(async move {
        for chunk in chunks {
            s.publish_ids(&chunk, |_| None).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// Closes every listed connection of the scenario's workers (consuming and publishing); returns
/// how many.
async fn close_worker_connections(s: &Scenario) -> usize {
    let names = [
        s.worker_connection_name(),
        s.worker_publishing_connection_name(),
    ];
    mgmt::blocking(move || {
        let listed: Vec<String> = names
            .iter()
            .flat_map(|n| mgmt::connections_named(n))
            .collect();
        mgmt::close_connections(&listed)
    })
    .await
}

const N: usize = 3000;
const FLOW: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_effects_under_the_fault_mix() {
    let db = effects_db().await;
    let s = Scenario::new("inbox-mix", Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        let started = Instant::now();
        let ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        let set: HashSet<String> = ids.iter().cloned().collect();
        // Retries enough that no message runs out of them (nothing may reach the DLQ): 10, the
        // delays capped at 400 ms.
        let cmd = s
            .inbox_worker(&db.name)
            .arg("fail-rate", 0.2)
            .arg("seed", 31)
            .arg("max-retries", 10)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 400)
            .arg("work-ms", 2)
            .arg("concurrency", 8)
            .arg("prefetch", 40)
            .arg("abort-after-commit-rate", 0.002)
            .arg("abort-before-commit-rate", 0.002);
        let fleet = Fleet::start(cmd, 2);
        s.wait_consumers(2, Duration::from_secs(30)).await;
        let stop = Stop::default();
        let supervisor = fleet.supervise(stop.clone());
        let publisher = publish_over(&s, &ids, FLOW);

        let (mut kills, mut closed) = (0, 0);
        for (fraction, fault) in [
            (0.2, "kill w0"),
            (0.4, "close"),
            (0.6, "kill both"),
            (0.8, "close"),
        ] {
            s.wait_progress(&set, fraction, Duration::from_secs(120))
                .await;
            match fault {
                "kill w0" => {
                    fleet.kill(&[0]).await;
                    kills += 1;
                }
                "kill both" => {
                    fleet.kill(&[0, 1]).await;
                    kills += 2;
                }
                _ => closed += close_worker_connections(&s).await,
            }
            report(format!(
                "inbox mix: {fault} at {} of {N} done",
                s.progress(&set)
            ));
        }
        publisher.await.expect("publisher task");
        let settled = s.try_wait_settled(&set, Duration::from_secs(120)).await;
        stop.cancel();
        supervisor.await.expect("supervisor task");
        fleet.stop().await;
        settled.unwrap_or_else(|e| panic!("{e}"));
        let End {
            acc,
            line,
            duplicates: dups,
            ..
        } = assert_inbox_end(&s, db, &ids, "inbox under the fault mix").await;
        let after = log_count(&s, "injected abort after the commit");
        let before = log_count(&s, "injected abort before the commit");
        let restarts = fleet.restarts.load(Ordering::SeqCst);
        let calls = s.calls().len();
        report(format!(
            "RESULT fault=\"exactly-once effects: {after} aborts after a commit, {before} before, \
             {kills} SIGKILLs, {closed} connections closed, fail rate 0.2\" broker=\"{}\" N={N} \
             lost={} dlq={} {line}; {restarts} worker restarts; {calls} handler calls; {dups} \
             deliveries found duplicate by the inbox and acked without the handler; harness \
             re-handled={} duplicates={}; total {:?}",
            s.broker,
            acc.lost.len(),
            acc.dead_lettered,
            acc.rehandled,
            acc.settled_twice,
            started.elapsed()
        ));
        assert!(
            after > 0 && before > 0,
            "the seeded aborts did not fire ({after} after, {before} before a commit): the \
             test did not test what it is for"
        );
        assert!(
            dups > 0,
            "no delivery was a duplicate: the faults never redelivered a commit"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_connection_closes_keep_effects_exactly_once() {
    const N: usize = 1000;
    let db = effects_db().await;
    let s = Scenario::new("inbox-conn", Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        let started = Instant::now();
        let ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        let set: HashSet<String> = ids.iter().cloned().collect();
        let cmd = s
            .inbox_worker(&db.name)
            .arg("fail-rate", 0.3)
            .arg("seed", 37)
            .arg("max-retries", 10)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 400)
            .arg("work-ms", 3)
            .arg("concurrency", 8)
            .arg("prefetch", 40);
        let mut a = cmd.spawn("a");
        let mut b = cmd.spawn("b");
        s.wait_consumers(2, Duration::from_secs(30)).await;
        let publisher = publish_over(&s, &ids, Duration::from_secs(8));
        let mut closed = 0;
        let mut rounds = 0;
        let deadline = Instant::now() + Duration::from_secs(60);
        // Every listed connection of the workers, as soon as it is listed (the management API
        // lists a new one only at its next statistics emission, up to 5 s).
        while !publisher.is_finished() || rounds < 3 {
            assert!(
                Instant::now() < deadline,
                "only {rounds} rounds of closes in 60 s"
            );
            let n = close_worker_connections(&s).await;
            if n > 0 {
                rounds += 1;
                closed += n;
                report(format!(
                    "inbox conn: closed {n} connection(s) at {} of {N} done",
                    s.progress(&set)
                ));
                s.wait_consumers(2, Duration::from_secs(30)).await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        publisher.await.expect("publisher task");
        s.wait_settled(&set, Duration::from_secs(120)).await;
        assert!(
            a.is_running() && b.is_running(),
            "a worker process exited:\n{}\n{}",
            a.log_tail(20),
            b.log_tail(20)
        );
        a.terminate(Duration::from_secs(10)).await;
        b.terminate(Duration::from_secs(10)).await;
        let End {
            acc,
            line,
            duplicates: dups,
            ..
        } = assert_inbox_end(&s, db, &ids, "inbox, connections force-closed").await;
        report(format!(
            "RESULT fault=\"inbox: {closed} broker connections force-closed in {rounds} rounds, \
             fail rate 0.3\" broker=\"{}\" N={N} lost={} dlq={} {line}; {dups} deliveries found \
             duplicate by the inbox; harness re-handled={} duplicates={}; total {:?}",
            s.broker,
            acc.lost.len(),
            acc.dead_lettered,
            acc.rehandled,
            acc.settled_twice,
            started.elapsed()
        ));
    })
    .await;
}
