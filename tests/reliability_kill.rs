//! Worker processes killed with SIGKILL mid-batch and restarted: nothing is lost.
//!
//! A SIGKILL runs no shutdown code: handlers are cut off mid-work, settlements never leave the
//! process, and retry copies may be confirmed by the broker while their originals are never
//! acked. The broker requeues every unacked delivery when the TCP connection drops, so each id
//! must still end acked after a success or in the DLQ. A kill between a handler's success and
//! the broker receiving its ack makes the handler run again (re-handled); an ack written but cut
//! off by the kill makes the broker deliver it again (a duplicate). Each kill can cost at most
//! the deliveries in flight, so both are bounded by prefetch x kills.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use reliability::{report, Scenario, Shape};

const N: usize = 3000;
const PREFETCH: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_batch_and_restart_loses_nothing() {
    let s = Scenario::new("kill", Shape::default()).await;
    s.run(|s| async move {
        let started = Instant::now();
        let ids = s.publish(N).await;
        let set: HashSet<String> = ids.iter().cloned().collect();
        // Transient failures put part of the batch in the delay levels at any moment, so kills
        // also hit retries in flight (copy confirmed, original not yet acked).
        let cmd = s
            .worker()
            .arg("fail-rate", 0.3)
            .arg("seed", 11)
            .arg("max-retries", 4)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 400)
            .arg("work-ms", 4)
            .arg("concurrency", 8)
            .arg("prefetch", PREFETCH);
        let mut a = cmd.spawn("a-1");
        let mut b = cmd.spawn("b-1");
        s.wait_consumers(2, Duration::from_secs(30)).await;

        let mut kills = 0;
        let mut recoveries = Vec::new();
        // One worker killed, then both at once, then one again; each restarted at once.
        for (round, (fraction, both)) in [(0.15, false), (0.35, true), (0.6, false), (0.8, true)]
            .into_iter()
            .enumerate()
        {
            s.wait_progress(&set, fraction, Duration::from_secs(120))
                .await;
            let c = s.counts().await;
            report(format!(
                "kill round {round}: {} of {N} done, {} ready, {} in delay levels; SIGKILL {}",
                s.progress(&set),
                c.queue,
                c.delay,
                if both { "both workers" } else { "worker a" }
            ));
            a.kill();
            kills += 1;
            if both {
                b.kill();
                kills += 1;
                // Nobody consumes for a moment: what leaves the delay levels waits in the queue.
                tokio::time::sleep(Duration::from_millis(300)).await;
                b = cmd.spawn(&format!("b-{}", round + 2));
            }
            let restart = Instant::now();
            a = cmd.spawn(&format!("a-{}", round + 2));
            s.wait_consumers(2, Duration::from_secs(30)).await;
            recoveries.push(restart.elapsed());
        }
        let settled = s.wait_settled(&set, Duration::from_secs(120)).await;
        a.terminate(Duration::from_secs(10)).await;
        b.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled("SIGKILL mid-batch");
        let worst = recoveries.iter().max().copied().unwrap_or_default();
        report(format!(
            "SIGKILL: {kills} kills, restart to consuming max {worst:?}; settled {settled:?} after \
             the last restart; total {:?}",
            started.elapsed()
        ));
        // Every kill happened with work in flight: duplicates are expected, but bounded by
        // what one process can hold unacked (prefetch) times the processes killed.
        acc.assert_duplicates_at_most(
            &format!("SIGKILL mid-batch, {kills} kills"),
            PREFETCH * kills,
            true,
        );
    })
    .await;
}
