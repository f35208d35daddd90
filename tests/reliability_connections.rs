//! Broker connections force-closed again and again (management API
//! `DELETE /api/connections/{name}`, as an operator or a broker-side failure would): the
//! workers reconnect on their own and nothing is lost.
//!
//! Each worker process has two connections: the consuming one (deliveries and acks) and the
//! publishing one (retry copies and dead letters, waiting for the broker's confirm before their
//! original is acked). Both are closed, in alternate rounds: the publishing connections alone,
//! while the handlers fail often enough that retry copies are awaiting their confirms (each
//! such copy's original must then be requeued on the live consuming channel, and the copy may
//! or may not have reached its delay level), then both kinds at once. The worker logs say how
//! many copies were cut off waiting for a confirm; the test requires some.
//!
//! Only this scenario's worker connections are closed (matched by their client-provided
//! connection names, which contain the scenario's unique prefix): other suites share the broker.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use redeliver_testkit::mgmt;
use reliability::{report, Scenario, Shape};

const N: usize = 3000;
/// Publishing is spread over this long so that connections are closed while messages flow.
const FLOW: Duration = Duration::from_secs(20);
/// Consuming connections closed, at least; publishing connections too.
const MIN_CLOSES: usize = 4;
const PREFETCH: usize = 40;
const CONCURRENCY: usize = 8;
/// Messages that fail every attempt, published just before each round's closes: for the next
/// second or so every handler is publishing retry copies, so the closes find copies awaiting
/// their confirms (a steady 40 % failure rate alone leaves one in flight at only about one
/// close in four).
const BURST: usize = 60;
/// What a worker logs when a retry copy's confirm never came because its publishing connection
/// went away (`crates/worker/src/settle.rs`): the original is requeued.
const COPY_CUT_OFF: &str = "retry copy not confirmed by the broker";

/// Lines of the worker's log that contain `needle`.
/// The management names of the connections named `name`.
async fn connections_named(name: &str) -> Vec<String> {
    let name = name.to_owned();
    mgmt::blocking(move || mgmt::connections_named(&name)).await
}

fn log_lines(w: &reliability::WorkerProc, needle: &str) -> usize {
    std::fs::read_to_string(w.log())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_connection_closes_lose_nothing() {
    let s = Scenario::new("conn", Shape::default()).await;
    s.run(|s| async move {
        let started = Instant::now();
        let mut ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        let set: HashSet<String> = ids.iter().cloned().collect();
        // 40 % of attempts fail: about a hundred retry copies a second wait for their confirm
        // (on quorum delay levels, a few ms each) while the connections are closed.
        let cmd = s
            .worker()
            .arg("fail-rate", 0.4)
            .arg("seed", 23)
            .arg("max-retries", 4)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 400)
            .arg("work-ms", 5)
            .arg("concurrency", CONCURRENCY)
            .arg("prefetch", PREFETCH);
        let mut a = cmd.spawn("a");
        let mut b = cmd.spawn("b");
        s.wait_consumers(2, Duration::from_secs(30)).await;

        // Messages flow during the whole fault.
        let chunks: Vec<Vec<String>> = ids
            .chunks(N / (FLOW.as_millis() as usize / 100))
            .map(<[String]>::to_vec)
            .collect();
        let publisher = {
            let s = std::sync::Arc::clone(&s);
            tokio::spawn(async move {
                for chunk in chunks {
                    s.publish_ids(&chunk, |_| None).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };

        let consuming = s.worker_connection_name();
        let publishing = s.worker_publishing_connection_name();
        let mut closed_names = HashSet::new();
        let (mut consuming_closed, mut publishing_closed) = (0, 0);
        let mut recoveries = Vec::new();
        // Rounds alternate: the publishing connections alone (the consumers stay and must
        // requeue the originals of the copies cut off), then both kinds.
        let mut with_consumers = false;
        let deadline = Instant::now() + Duration::from_secs(90);
        // The management API lists a new connection only at its next statistics emission (up
        // to 5 s), so each connection is closed as soon as it is listed, as often as that
        // allows while messages flow.
        while !publisher.is_finished()
            || consuming_closed < MIN_CLOSES
            || publishing_closed < MIN_CLOSES
        {
            assert!(
                Instant::now() < deadline,
                "only {consuming_closed} consuming and {publishing_closed} publishing \
                 connections closed in 90 s"
            );
            let fresh = |all: Vec<String>| -> Vec<String> {
                all.into_iter()
                    .filter(|c| !closed_names.contains(c))
                    .collect()
            };
            let fresh_publishing = fresh(connections_named(&publishing).await);
            let fresh_consuming = if with_consumers {
                fresh(connections_named(&consuming).await)
            } else {
                Vec::new()
            };
            if fresh_publishing.is_empty() && fresh_consuming.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let copies_before = log_lines(&a, COPY_CUT_OFF) + log_lines(&b, COPY_CUT_OFF);
            if !fresh_publishing.is_empty() {
                // Failing messages (to the DLQ after their retries): copies are being published
                // and confirmed on the connections about to be closed.
                let burst: Vec<String> = (0..BURST)
                    .map(|i| format!("{}burst{:03}-{i:03}", s.prefix, closed_names.len()))
                    .collect();
                s.publish_ids(&burst, |_| Some("fail")).await;
                ids.extend(burst);
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            let mut names = fresh_publishing.clone();
            names.extend(fresh_consuming.iter().cloned());
            let to_close = names.clone();
            let closed = mgmt::blocking(move || mgmt::close_connections(&to_close)).await;
            closed_names.extend(names);
            publishing_closed += fresh_publishing.len();
            consuming_closed += fresh_consuming.len();
            let t = Instant::now();
            if !fresh_consuming.is_empty() {
                // The broker drops the consumers with the connections; recovered = both back.
                tokio::time::sleep(Duration::from_millis(20)).await;
                s.wait_consumers(2, Duration::from_secs(30)).await;
                recoveries.push(t.elapsed());
            } else {
                // Long enough for the cut-off copies' originals to be requeued and logged.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            let c = s.counts().await;
            let copies_after = log_lines(&a, COPY_CUT_OFF) + log_lines(&b, COPY_CUT_OFF);
            report(format!(
                "closed {closed} connection(s) ({} publishing, {} consuming) with {} of {N} \
                 done, {} ready, {} in delay levels; {} retry copies cut off awaiting their \
                 confirm; {}",
                fresh_publishing.len(),
                fresh_consuming.len(),
                s.progress(&set),
                c.queue,
                c.delay,
                copies_after - copies_before,
                if fresh_consuming.is_empty() {
                    "consumers left alone".to_owned()
                } else {
                    format!("both consuming again after {:?}", t.elapsed())
                }
            ));
            with_consumers = !with_consumers;
        }
        publisher.await.expect("publisher task");
        let set: HashSet<String> = ids.iter().cloned().collect();
        let settled = s.wait_settled(&set, Duration::from_secs(120)).await;
        assert!(
            a.is_running() && b.is_running(),
            "a worker process exited:\n{}\n{}",
            a.log_tail(20),
            b.log_tail(20)
        );
        let cut_off = log_lines(&a, COPY_CUT_OFF) + log_lines(&b, COPY_CUT_OFF);
        a.terminate(Duration::from_secs(10)).await;
        b.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled("forced connection closes");
        recoveries.sort();
        // The workers' own view: from losing the consuming connection to consuming again.
        let mut outages: Vec<Duration> = a.outages().into_iter().chain(b.outages()).collect();
        outages.sort();
        report(format!(
            "connection closes: {consuming_closed} consuming and {publishing_closed} publishing \
             connections closed; {cut_off} retry copies cut off awaiting their confirm; worker \
             outages {} (median {:?}, max {:?}); both consumers back on the queue after median \
             {:?}, max {:?}; settled {settled:?} after the flow; total {:?}",
            outages.len(),
            outages.get(outages.len() / 2).copied().unwrap_or_default(),
            outages.last().copied().unwrap_or_default(),
            recoveries
                .get(recoveries.len() / 2)
                .copied()
                .unwrap_or_default(),
            recoveries.last().copied().unwrap_or_default(),
            started.elapsed()
        ));
        assert_eq!(
            outages.len(),
            consuming_closed,
            "every closed consuming connection should show as one outage and one recovery (a \
             publishing connection closed alone, none)"
        );
        assert!(
            cut_off > 0,
            "no retry copy was awaiting its confirm when a publishing connection closed: the \
             fault did not test what it is for"
        );
        // A closed consuming connection takes its unacked deliveries back: at most a prefetch
        // each. A closed publishing connection cuts off at most one copy per running handler,
        // whose original is requeued while the copy may have reached its delay level.
        acc.assert_duplicates_at_most(
            &format!(
                "forced connection closes, {consuming_closed} consuming + {publishing_closed} \
                 publishing"
            ),
            PREFETCH * consuming_closed + CONCURRENCY * publishing_closed,
            false,
        );
    })
    .await;
}
