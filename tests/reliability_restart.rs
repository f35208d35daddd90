//! The broker's app restarted (`rabbitmqctl stop_app` / `start_app`) while retries wait in the
//! delay levels: the worker reconnects on its own, the delayed messages come out of the levels
//! after the restart, and nothing is lost.
//!
//! A restart disconnects every client of the node, so this runs against a dedicated node
//! (`rdsolo-1@localhost`, AMQP port 5691) that the test starts with `scripts/cluster.sh` and
//! removes afterwards; the default broker other suites use is not touched. Starting the node
//! takes about 12 s.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use redeliver_testkit::nodes::Nodes;
use reliability::{report, Scenario, Shape};

const N: usize = 1000;
const RESTARTS: usize = 2;
/// The worker's default prefetch (the example's `--prefetch`).
const PREFETCH: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_with_messages_in_the_delay_levels_loses_nothing() {
    let boot = Instant::now();
    let nodes = Nodes::start("rdsolo", 1, 5691, false).await;
    report(format!("dedicated node up after {:?}", boot.elapsed()));
    let shape = Shape {
        url: nodes.amqp_url(1),
        ..Shape::default()
    };
    let s = Scenario::new("restart", shape).await;
    let nodes = &nodes;
    s.run(|s| async move {
        let started = Instant::now();
        let ids = s.publish(N).await;
        let set: HashSet<String> = ids.iter().cloned().collect();
        // Most first attempts fail and wait up to 1.5 s (then 3 s) in the delay levels: a restart always finds
        // hundreds of messages there.
        let mut w = s
            .worker()
            .arg("fail-rate", 0.6)
            .arg("seed", 3)
            .arg("max-retries", 4)
            .arg("retry-base-ms", 1500)
            .arg("retry-cap-ms", 3000)
            .arg("work-ms", 2)
            .arg("concurrency", 10)
            .spawn("w");
        s.wait_consumers(1, Duration::from_secs(30)).await;
        let mut recoveries = Vec::new();
        for round in 0..RESTARTS {
            let deadline = Instant::now() + Duration::from_secs(30);
            let before = loop {
                let c = s.counts().await;
                if c.delay >= 100 {
                    break c;
                }
                assert!(
                    Instant::now() < deadline,
                    "the delay levels never filled: {c:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            report(format!(
                "restart {round}: stop_app with {} in the delay levels, {} ready, {} of {N} done",
                before.delay,
                before.queue,
                s.progress(&set)
            ));
            let since = reliability::unix_ms();
            nodes.rabbitmqctl(1, &["stop_app"]).await;
            // Down long enough for level TTLs (up to 2.56 s here) to run out meanwhile: those
            // messages are dead-lettered onward when the queues come back.
            tokio::time::sleep(Duration::from_secs(3)).await;
            nodes.rabbitmqctl(1, &["start_app"]).await;
            let up = reliability::unix_ms();
            // The worker's own account: when it lost the connection and when it consumed again.
            let o = w.wait_recovered(since, Duration::from_secs(60)).await;
            let outage = o.duration();
            // Negative when the worker was back before rabbitmqctl returned.
            let after_start = o.back_at as i128 - up as i128;
            recoveries.push(after_start);
            s.reconnect(Duration::from_secs(30)).await;
            s.wait_consumers(1, Duration::from_secs(60)).await;
            let c = s.counts().await;
            report(format!(
                "restart {round}: worker outage {outage:?} (app down ~3 s), consuming again \
                 {after_start} ms after start_app returned; now {} in the delay levels",
                c.delay
            ));
        }
        let settled = s.wait_settled(&set, Duration::from_secs(120)).await;
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(30));
        w.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled("broker app restart");
        // Each restart drops the worker's connection with at most a prefetch unacked.
        acc.assert_duplicates_at_most(
            &format!("broker app restart, {RESTARTS}"),
            PREFETCH * RESTARTS,
            false,
        );
        report(format!(
            "broker restart: {RESTARTS} restarts, worker consuming again {:?} ms after start_app; \
             settled {settled:?} after the last; total {:?} (plus {:?} to boot the node)",
            recoveries,
            started.elapsed(),
            boot.elapsed() - started.elapsed()
        ));
    })
    .await;
}
