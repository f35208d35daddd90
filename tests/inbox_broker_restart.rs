//! The broker's app restarted (`rabbitmqctl stop_app` / `start_app`) while messages flow
//! through the inbox (issue 31, item 5): every delivery in flight is redelivered, retry copies
//! may be confirmed while their originals are not acked, and the business table still ends with
//! exactly one effect per message id, nothing in the DLQ.
//!
//! As `tests/reliability_restart.rs`, on a dedicated node (`rdsolo-1@localhost`, AMQP port
//! 5691, of the `RD_CLUSTER_CHROOT` version when set) started with `scripts/cluster.sh` and
//! removed afterwards: the default broker other suites use is not restarted.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "inbox_support/effects_db.rs"]
mod effects_db;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use effects_db::effects_db;
use redeliver_testkit::nodes::Nodes;
use redeliver_testkit::reliability::{self, assert_inbox_end, report, End, Scenario, Shape};

const N: usize = 1000;
const RESTARTS: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_keeps_effects_exactly_once() {
    let db = effects_db().await;
    let boot = Instant::now();
    let nodes = Nodes::start("rdsolo", 1, 5691, false).await;
    let booted = boot.elapsed();
    let shape = Shape {
        url: nodes.amqp_url(1),
        ..Shape::default()
    };
    let s = Scenario::new("inbox-restart", shape).await;
    let (db, nodes) = (&db, &nodes);
    s.run(|s| async move {
        let started = Instant::now();
        let ids = s.publish(N).await;
        let set: HashSet<String> = ids.iter().cloned().collect();
        // Slow enough (5 ms a message, retries waiting up to 1.5 s) that each restart finds
        // deliveries in flight and copies in the delay levels.
        let mut w = s
            .inbox_worker(&db.name)
            .arg("fail-rate", 0.3)
            .arg("seed", 43)
            .arg("max-retries", 8)
            .arg("retry-base-ms", 300)
            .arg("retry-cap-ms", 1500)
            .arg("work-ms", 5)
            .arg("concurrency", 8)
            .spawn("w");
        s.wait_consumers(1, Duration::from_secs(30)).await;
        let mut outages = Vec::new();
        for (round, fraction) in [0.2, 0.5].into_iter().enumerate().take(RESTARTS) {
            s.wait_progress(&set, fraction, Duration::from_secs(120))
                .await;
            let c = s.counts().await;
            report(format!(
                "inbox restart {round}: stop_app with {} of {N} done, {} ready, {} in the delay \
                 levels",
                s.progress(&set),
                c.queue,
                c.delay
            ));
            let since = reliability::unix_ms();
            nodes.rabbitmqctl(1, &["stop_app"]).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            nodes.rabbitmqctl(1, &["start_app"]).await;
            let o = w.wait_recovered(since, Duration::from_secs(60)).await;
            outages.push(o.duration());
            s.reconnect(Duration::from_secs(30)).await;
            s.wait_consumers(1, Duration::from_secs(60)).await;
        }
        s.wait_settled(&set, Duration::from_secs(120)).await;
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(30));
        w.terminate(Duration::from_secs(10)).await;
        let End {
            acc,
            line,
            duplicates: dups,
            ..
        } = assert_inbox_end(&s, db, &ids, "inbox, broker app restarted").await;
        report(format!(
            "RESULT fault=\"inbox: broker app restarted {RESTARTS} times\" broker=\"{}\" N={N} \
             lost={} dlq={} {line}; worker outages {outages:?}; {dups} deliveries found \
             duplicate by the inbox; harness re-handled={} duplicates={}; total {:?} (plus \
             {booted:?} to boot the node)",
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
