//! PostgreSQL restarted while messages flow through the inbox (issue 31, item 5): every
//! transaction cut off, every pooled connection broken, commits failing. Those failures are
//! transient errors, retried through the delay levels, and a commit whose outcome the worker
//! never saw is found by the inbox on the retry. End: N messages, N effects, none twice, none
//! in the DLQ.
//!
//! A test binary of its own: the restart breaks every PostgreSQL connection on the machine, so
//! no other test of this binary may run beside it. PostgreSQL is left running whatever
//! happens: a guard starts it again when the test fails between the stop and the start.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "inbox_support/effects_db.rs"]
mod effects_db;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use effects_db::effects_db;
use redeliver_testkit::postgres::{pg_ctlcluster, KeepRunning};
use redeliver_testkit::reliability::{assert_inbox_end, report, End, Scenario, Shape};

const N: usize = 2000;
const RESTARTS: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_mid_run_keeps_effects_exactly_once() {
    let db = effects_db().await;
    // Fails here, not half-way, when the cluster cannot be managed from this process.
    pg_ctlcluster("status").unwrap_or_else(|e| panic!("{e}"));
    let _running = KeepRunning;
    let s = Scenario::new("inbox-pg", Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        let started = Instant::now();
        let ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        let set: HashSet<String> = ids.iter().cloned().collect();
        // 12 retries, delays from 100 ms capped at 2 s: a message keeps trying for about 9 s on
        // average (full jitter), much longer than a restart takes.
        let cmd = s
            .inbox_worker(&db.name)
            .arg("seed", 41)
            .arg("max-retries", 12)
            .arg("retry-base-ms", 100)
            .arg("retry-cap-ms", 2000)
            // 20 ms of work inside each transaction: at 200 messages/s about 4 are open at any
            // instant, so a restart finds none open with a probability of about 1 % (e^-4.4),
            // against 25 % at 5 ms, where both restarts missed once (RabbitMQ 4.3.6, CI).
            .arg("work-ms", 20)
            .arg("concurrency", 8)
            .arg("prefetch", 40);
        let mut a = cmd.spawn("a");
        let mut b = cmd.spawn("b");
        s.wait_consumers(2, Duration::from_secs(30)).await;
        let chunks: Vec<Vec<String>> = ids.chunks(N / 100).map(<[String]>::to_vec).collect();
        let publisher = {
            let s = std::sync::Arc::clone(&s);
            tokio::spawn(async move {
                for chunk in chunks {
                    s.publish_ids(&chunk, |_| None).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        let mut took = Vec::new();
        for (round, fraction) in [0.25, 0.6].into_iter().enumerate().take(RESTARTS) {
            s.wait_progress(&set, fraction, Duration::from_secs(120))
                .await;
            let done = s.progress(&set);
            let t = Instant::now();
            let restarted = tokio::task::spawn_blocking(|| pg_ctlcluster("restart"))
                .await
                .expect("pg_ctlcluster task");
            restarted.unwrap_or_else(|e| panic!("{e}"));
            took.push(t.elapsed());
            report(format!(
                "inbox pg: restart {round} at {done} of {N} done took {:?}",
                t.elapsed()
            ));
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
            errors,
        } = assert_inbox_end(&s, db, &ids, "PostgreSQL restarted").await;
        assert!(
            errors > 0,
            "no delivery failed: the restarts did not hit a transaction"
        );
        report(format!(
            "RESULT fault=\"PostgreSQL restarted {RESTARTS} times mid-run\" broker=\"{}\" N={N} \
             lost={} dlq={} {line}; restarts took {took:?}; {errors} deliveries failed on the \
             database and were retried; {dups} found duplicate by the inbox; total {:?}",
            s.broker,
            acc.lost.len(),
            acc.dead_lettered,
            started.elapsed()
        ));
    })
    .await;
}
