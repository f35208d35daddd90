//! A retry storm: every message fails at once (a downstream outage). Without a budget each
//! message is retried `max_retries` times; with the retry budget the retries are capped at the
//! budget's share of first attempts, the rest goes straight to the DLQ, and nothing is lost.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use redeliver::amqp::headers::ATTEMPT;
use reliability::{report, Accounting, Scenario, Shape};

const MAX_RETRIES: u32 = 3;

/// Retries done, from the worker's calls file (a call with attempt > 0 is a retried copy being
/// handled) and from the DLQ (each dead-lettered copy carries how many retries it had).
fn retries(s: &Scenario, acc: &Accounting) -> (usize, i64) {
    let from_calls = s.calls().iter().filter(|c| c.1 > 0).count();
    let from_dlq = acc
        .dlq
        .iter()
        .map(|g| g.header_int(ATTEMPT).unwrap_or(0))
        .sum();
    (from_calls, from_dlq)
}

async fn storm(name: &str, n: usize, budget: Option<f64>) -> (Accounting, usize, i64, Duration) {
    let s = Scenario::new(name, Shape::default()).await;
    let result = std::sync::Arc::new(std::sync::Mutex::new(None));
    let out = std::sync::Arc::clone(&result);
    s.run(|s| async move {
        let ids = s.publish(n).await;
        let set: HashSet<String> = ids.iter().cloned().collect();
        let mut cmd = s
            .worker()
            .arg("fail-rate", 1.0)
            .arg("max-retries", MAX_RETRIES)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 200)
            .arg("concurrency", 20)
            .arg("prefetch", 100);
        if let Some(pct) = budget {
            // No reserve and a window longer than the test: the cap is exactly pct * n.
            cmd = cmd
                .arg("budget-percent", pct)
                .arg("budget-reserve-per-sec", 0)
                .arg("budget-ttl-secs", 300);
        }
        let started = Instant::now();
        let mut w = cmd.spawn("w");
        s.wait_settled(&set, Duration::from_secs(120)).await;
        let took = started.elapsed();
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(30));
        w.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled(name);
        acc.assert_duplicates_at_most(name, 0, false);
        acc.assert_dead_lettered_once(name);
        assert_eq!(
            acc.dead_lettered, n,
            "{name}: every message fails, so all end in the DLQ"
        );
        let (calls, dlq) = retries(&s, &acc);
        *out.lock().unwrap_or_else(|p| p.into_inner()) = Some((acc, calls, dlq, took));
    })
    .await;
    let taken = result.lock().unwrap_or_else(|p| p.into_inner()).take();
    taken.expect("storm result")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_storm_is_capped_by_the_retry_budget() {
    const N: usize = 1000;
    const PCT: f64 = 0.2;
    // Side by side: the same storm with and without a budget.
    let (with, without) = tokio::join!(
        storm("storm-budget", N, Some(PCT)),
        storm("storm-free", 200, None)
    );

    let (acc, calls, dlq, took) = with;
    let cap = (N as f64 * PCT).floor() as usize;
    report(format!(
        "retry storm with budget {PCT}: N={N}, retries handled {calls}, retries on DLQ copies \
         {dlq}, cap {cap} (unbudgeted would be {}), lost {}, settled in {took:?}",
        N * MAX_RETRIES as usize,
        acc.lost.len()
    ));
    assert!(calls <= cap, "{calls} retries exceed the budget's {cap}");
    assert_eq!(
        calls as i64, dlq,
        "retries handled and retries recorded on DLQ copies differ"
    );
    assert!(calls > 0, "the budget allowed no retry at all");

    let (acc, calls, dlq, took) = without;
    report(format!(
        "retry storm without budget: N=200, retries handled {calls}, on DLQ copies {dlq}, lost {}, \
         settled in {took:?}",
        acc.lost.len()
    ));
    assert_eq!(
        calls,
        200 * MAX_RETRIES as usize,
        "without a budget every message gets every retry"
    );
}
