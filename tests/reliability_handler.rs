//! Handler faults: panics and hangs past the per-message timeout. The worker process survives
//! both, retries the message like any transient failure, and dead-letters what keeps failing;
//! nothing is lost.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use reliability::{report, Scenario, Shape};

const MAX_RETRIES: u32 = 3;

/// Calls per id and attempt, from the worker's calls file.
fn calls_per_id(s: &Scenario) -> HashMap<String, Vec<(u32, String)>> {
    let mut m: HashMap<String, Vec<(u32, String)>> = HashMap::new();
    for (id, attempt, what) in s.calls() {
        m.entry(id).or_default().push((attempt, what));
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panics_are_retried_and_the_worker_survives() {
    const N: usize = 600;
    let s = Scenario::new("panic", Shape::default()).await;
    s.run(|s| async move {
        let started = Instant::now();
        let mut ids = s.publish(N).await;
        // Plus messages that panic on every attempt: they must end in the DLQ after
        // MAX_RETRIES retries, with the worker still serving.
        let always: Vec<String> = (0..10).map(|i| format!("{}always-{i}", s.prefix)).collect();
        s.publish_ids(&always, |_| Some("panic")).await;
        ids.extend(always.iter().cloned());
        let set: HashSet<String> = ids.iter().cloned().collect();
        let mut w = s
            .worker()
            .arg("panic-rate", 0.3)
            .arg("seed", 5)
            .arg("max-retries", MAX_RETRIES)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 200)
            .arg("concurrency", 10)
            .spawn("w");
        let settled = s.wait_settled(&set, Duration::from_secs(90)).await;
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(30));
        w.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled("handler panics");
        // No connection or process is lost: nothing may be handled or settled twice.
        acc.assert_duplicates_at_most("handler panics", 0, false);
        acc.assert_dead_lettered_once("handler panics");

        let calls = calls_per_id(&s);
        let panics = s.calls().iter().filter(|c| c.2 == "panic").count();
        for id in &always {
            let attempts: Vec<u32> = calls[id].iter().map(|c| c.0).collect();
            assert_eq!(
                attempts.len() as u32,
                MAX_RETRIES + 1,
                "{id} should be tried exactly {} times, was tried at attempts {attempts:?}",
                MAX_RETRIES + 1
            );
            let dead = acc.dlq.iter().find(|g| g.message_id() == id.as_str());
            let dead = dead.unwrap_or_else(|| panic!("{id} is not in the DLQ"));
            assert_eq!(dead.death_reason().as_deref(), Some("rejected"));
            // The copy that was rejected carries the previous attempt's error.
            let last = dead
                .header_str(redeliver::amqp::headers::LAST_ERROR)
                .unwrap_or_default();
            assert!(last.contains("panicked"), "last error of {id}: {last}");
        }
        report(format!(
            "handler panics: {panics} panics in {} calls, worker alive; DLQ reasons {:?}; settled \
             in {settled:?}, total {:?}",
            s.calls().len(),
            acc.dlq_reasons(),
            started.elapsed()
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_hanging_past_the_timeout_are_retried() {
    const N: usize = 300;
    const TIMEOUT_MS: u64 = 300;
    let s = Scenario::new("hang", Shape::default()).await;
    s.run(|s| async move {
        let started = Instant::now();
        let mut ids = s.publish(N).await;
        let always: Vec<String> = (0..5).map(|i| format!("{}always-{i}", s.prefix)).collect();
        s.publish_ids(&always, |_| Some("hang")).await;
        ids.extend(always.iter().cloned());
        let set: HashSet<String> = ids.iter().cloned().collect();
        // A hang lasts 10 minutes: only the timeout can end it.
        let mut w = s
            .worker()
            .arg("hang-rate", 0.2)
            .arg("hang-ms", 600_000)
            .arg("handler-timeout-ms", TIMEOUT_MS)
            .arg("seed", 9)
            .arg("max-retries", MAX_RETRIES)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 200)
            .arg("concurrency", 20)
            .arg("prefetch", 40)
            .spawn("w");
        let settled = s.wait_settled(&set, Duration::from_secs(90)).await;
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(30));
        w.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled("handler hangs");
        acc.assert_duplicates_at_most("handler hangs past the timeout", 0, false);
        acc.assert_dead_lettered_once("handler hangs");
        let calls = calls_per_id(&s);
        for id in &always {
            assert_eq!(
                calls[id].len() as u32,
                MAX_RETRIES + 1,
                "{id}: {:?}",
                calls[id]
            );
            assert!(
                acc.dlq.iter().any(|g| g.message_id() == id.as_str()),
                "{id} is not in the DLQ"
            );
        }
        let hangs = s.calls().iter().filter(|c| c.2 == "hang").count();
        report(format!(
            "handler hangs: {hangs} hangs cut at {TIMEOUT_MS} ms in {} calls, worker alive; \
             settled in {settled:?}, total {:?}",
            s.calls().len(),
            started.elapsed()
        ));
        // Ten hangs of 10 minutes each: finishing at all proves the timeout cut them.
        assert!(settled < Duration::from_secs(90));
    })
    .await;
}

/// The poison guard: a message that kills the worker process every time it is delivered ends in
/// the DLQ, dead-lettered by the quorum queue itself (x-death reason `delivery_limit`) once it was
/// returned `x-delivery-limit` times, on every broker (a return by a dropped connection counts on
/// RabbitMQ 4.3 too). The worker is restarted after each crash; the other messages all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_the_worker_ends_in_the_dlq() {
    const LIMIT: u32 = 3;
    let version = redeliver_testkit::broker_version().await;
    let shape = Shape {
        delivery_limit: LIMIT,
        ..Shape::default()
    };
    let s = Scenario::new("poison", shape).await;
    s.run(|s| async move {
        let mut ids = s.publish(20).await;
        let poison = vec![format!("{}poison", s.prefix)];
        s.publish_ids(&poison, |_| Some("abort")).await;
        ids.extend(poison.iter().cloned());
        let set: HashSet<String> = ids.iter().cloned().collect();
        let cmd = s.worker().arg("concurrency", 1).arg("prefetch", 1);
        let mut crashes = 0;
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut w = cmd.spawn("w-0");
        while s.progress(&set) + (s.counts().await.dlq as usize) < set.len() {
            assert!(Instant::now() < deadline, "not settled after {crashes} crashes");
            if !w.is_running() {
                crashes += 1;
                assert!(crashes <= LIMIT + 1, "the broker never dead-lettered the poison");
                w = cmd.spawn(&format!("w-{crashes}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        s.wait_settled(&set, Duration::from_secs(30)).await;
        w.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled("poison message");
        // Each crash is a kill with one delivery (prefetch 1) in flight: the poison itself,
        // never handled, so a crash may cost at most one settlement of an earlier message.
        acc.assert_duplicates_at_most("message that crashes the worker", crashes as usize, true);
        let dead = acc.dlq.iter().find(|g| g.message_id() == poison[0]);
        let dead = dead.unwrap_or_else(|| panic!("the poison is not in the DLQ"));
        assert_eq!(dead.death_reason().as_deref(), Some("delivery_limit"));
        let deliveries = s.calls().iter().filter(|c| c.2 == "abort").count();
        assert_eq!(deliveries, LIMIT as usize + 1, "delivered until past the limit");
        report(format!(
            "RabbitMQ {version}: poison message: {deliveries} deliveries, each a worker crash, then \
             dead-lettered by the broker (x-delivery-limit {LIMIT}); DLQ reasons {:?}",
            acc.dlq_reasons()
        ));
    })
    .await;
}
