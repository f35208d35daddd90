//! The fault suite in native retry mode: worker processes SIGKILLed, connections force-closed,
//! the broker's app restarted, while retries wait in the quorum queue itself (RabbitMQ 4.3+:
//! `modified{delivery-failed}` with `x-opt-delivery-time`, over AMQP 1.0).
//!
//! Each test reads the broker's version. On 4.3+ the workers run with `--retry-mode native` and
//! every session must choose it. Before 4.3 there is no native retry to fault: each test asserts
//! that an explicit `native` stops the worker at start and that `--retry-mode auto` chooses the
//! delay levels, and ends there (`RetryPlan::native_or_refused`); the same faults through the
//! delay levels are the `reliability_kill`, `reliability_connections` and `reliability_restart`
//! suites', which run on every version. Never skipped.
//!
//! Per-id conservation as in the `reliability_*` suite (every published id ends acked after a
//! success or in the DLQ, none lost, duplicates bounded), and no handler before its time: the
//! workers record every handler call with its time and the `x-redeliver-not-before` it carried
//! (`reliability::native`); no run may start more than 50 ms before it, nor before the previous
//! attempt's first run plus the delay that led to it.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redeliver_testkit::mgmt;
use redeliver_testkit::nodes::Nodes;
use reliability::native::{self, RetryPlan};
use reliability::{report, unix_ms, Scenario, Shape, WorkerProc};

const PREFETCH: usize = 40;
const CONCURRENCY: usize = 8;
const MAX_RETRIES: u32 = 4;

/// Retries the faults found waiting, from the handlers' runs: one count per fault time.
fn waiting_at_faults(s: &Scenario, times: &[u128]) -> Vec<usize> {
    let runs = s.runs();
    times
        .iter()
        .map(|t| native::waiting_at(&runs, u64::try_from(*t).unwrap_or(u64::MAX)))
        .collect()
}

/// SIGKILL, one worker then both, four rounds, with transient failures: native retries wait in
/// the queue (up to 1.5 s) while the processes die, and the broker must hold them for whoever
/// consumes next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_sigkill_mid_batch_and_restart_loses_nothing() {
    const N: usize = 1500;
    let s = Scenario::new("nkill", Shape::default()).await;
    let plan = RetryPlan::probe(&s.shape.url).await;
    s.run(|s| async move {
        if !plan.native_or_refused(&s).await {
            return;
        }
        let started = Instant::now();
        let ids = s.publish(N).await;
        let set: HashSet<String> = ids.iter().cloned().collect();
        let cmd = plan
            .worker(&s)
            .arg("fail-rate", 0.3)
            .arg("seed", 11)
            .arg("max-retries", MAX_RETRIES)
            .arg("retry-base-ms", 300)
            .arg("retry-cap-ms", 1500)
            .arg("work-ms", 4)
            .arg("concurrency", CONCURRENCY)
            .arg("prefetch", PREFETCH);
        let mut a = cmd.spawn("a-1");
        let mut b = cmd.spawn("b-1");
        s.wait_consumers(2, Duration::from_secs(30)).await;
        let mut gone: Vec<WorkerProc> = Vec::new();
        let mut kills = 0;
        let mut kill_times = Vec::new();
        for (round, (fraction, both)) in [(0.15, false), (0.35, true), (0.6, false), (0.8, true)]
            .into_iter()
            .enumerate()
        {
            s.wait_progress(&set, fraction, Duration::from_secs(120))
                .await;
            let pending = native::pending_retries(&s.runs(), MAX_RETRIES);
            report(format!(
                "kill round {round}: {} of {N} done, {pending} retries pending; SIGKILL {}",
                s.progress(&set),
                if both { "both workers" } else { "worker a" }
            ));
            kill_times.push(unix_ms());
            a.kill();
            kills += 1;
            if both {
                b.kill();
                kills += 1;
                // Nobody consumes for a moment: retries fall due with no consumer.
                tokio::time::sleep(Duration::from_millis(300)).await;
                gone.push(std::mem::replace(
                    &mut b,
                    cmd.spawn(&format!("b-{}", round + 2)),
                ));
            }
            gone.push(std::mem::replace(
                &mut a,
                cmd.spawn(&format!("a-{}", round + 2)),
            ));
            s.wait_consumers(2, Duration::from_secs(30)).await;
        }
        let settled = s.wait_settled(&set, Duration::from_secs(120)).await;
        a.terminate(Duration::from_secs(10)).await;
        b.terminate(Duration::from_secs(10)).await;
        gone.push(a);
        gone.push(b);
        for w in &gone {
            plan.assert_chosen(w);
        }
        let waiting = waiting_at_faults(&s, &kill_times);
        report(format!(
            "SIGKILL: {kills} kills, retries waiting at each {waiting:?}; settled {settled:?} \
             after the last restart; total {:?}",
            started.elapsed()
        ));
        assert!(
            waiting.iter().sum::<usize>() > 0,
            "no retry was waiting when a worker was killed: the fault did not test what it is for"
        );
        let acc = s.account(&ids).await;
        acc.assert_settled("native SIGKILL mid-batch");
        plan.assert_on_time(&s, &acc, "native SIGKILL mid-batch");
        acc.assert_duplicates_at_most(
            &format!("native SIGKILL mid-batch, {kills} kills"),
            PREFETCH * kills,
            true,
        );
    })
    .await;
}

/// The workers' connections force-closed through the management API while messages flow and
/// fail: in rounds, the AMQP 1.0 connections alone (they consume, and their `modified`
/// dispositions carry the retries), then every connection of the workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_forced_connection_closes_lose_nothing() {
    const N: usize = 1500;
    const FLOW: Duration = Duration::from_secs(12);
    const MIN_ROUNDS: usize = 4;
    /// Messages failing every attempt, published before each round: retries (dispositions) are
    /// in flight when the connections close.
    const BURST: usize = 40;
    let s = Scenario::new("nconn", Shape::default()).await;
    let plan = RetryPlan::probe(&s.shape.url).await;
    s.run(|s| async move {
        if !plan.native_or_refused(&s).await {
            return;
        }
        let started = Instant::now();
        let mut ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        let set: HashSet<String> = ids.iter().cloned().collect();
        let cmd = plan
            .worker(&s)
            .arg("fail-rate", 0.4)
            .arg("seed", 23)
            .arg("max-retries", MAX_RETRIES)
            .arg("retry-base-ms", 100)
            .arg("retry-cap-ms", 800)
            .arg("work-ms", 5)
            .arg("concurrency", CONCURRENCY)
            .arg("prefetch", PREFETCH);
        let a = cmd.spawn("a");
        let b = cmd.spawn("b");
        s.wait_consumers(2, Duration::from_secs(30)).await;
        let chunks: Vec<Vec<String>> = ids
            .chunks(N / (FLOW.as_millis() as usize / 100))
            .map(<[String]>::to_vec)
            .collect();
        let publisher = {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                for chunk in chunks {
                    s.publish_ids(&chunk, |_| None).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        let consuming = s.worker_connection_name();
        let publishing = s.worker_publishing_connection_name();
        let client = mgmt::Client::from_env();
        // The AMQP 1.0 consumer's container id is the worker's connection name.
        let list = move |native_only: bool| {
            let client = client.clone();
            let (consuming, publishing) = (consuming.clone(), publishing.clone());
            async move {
                mgmt::blocking(move || {
                    let mut names = native::amqp1_connections(&client, &consuming);
                    if !native_only {
                        names.extend(client.connections_named(&consuming).unwrap());
                        names.extend(client.connections_named(&publishing).unwrap());
                    }
                    names
                })
                .await
            }
        };
        let mut closed_names: HashSet<String> = HashSet::new();
        let (mut rounds, mut closed_total) = (0, 0);
        let mut close_times = Vec::new();
        let mut all = false;
        let deadline = Instant::now() + Duration::from_secs(90);
        while !publisher.is_finished() || rounds < MIN_ROUNDS {
            assert!(
                Instant::now() < deadline,
                "only {rounds} rounds of closes in 90 s"
            );
            // The settling connection is the AMQP 1.0 one, which also consumes.
            let names: Vec<String> = list(!all).await;
            let fresh: Vec<String> = names
                .into_iter()
                .filter(|c| !closed_names.contains(c))
                .collect();
            // Both workers' connections of the round's kinds, listed (the management API shows
            // a new connection at its next statistics emission, up to 5 s).
            let want = if all { 6 } else { 2 };
            if fresh.len() < want {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let burst: Vec<String> = (0..BURST)
                .map(|i| format!("{}burst{rounds:02}-{i:03}", s.prefix))
                .collect();
            s.publish_ids(&burst, |_| Some("fail")).await;
            ids.extend(burst);
            tokio::time::sleep(Duration::from_millis(30)).await;
            let to_close = fresh.clone();
            close_times.push(unix_ms());
            let closed = mgmt::blocking(move || mgmt::close_connections(&to_close)).await;
            closed_names.extend(fresh);
            closed_total += closed;
            // Every round closes the consumers' connections.
            tokio::time::sleep(Duration::from_millis(20)).await;
            s.wait_consumers(2, Duration::from_secs(30)).await;
            report(format!(
                "round {rounds}: closed {closed} connection(s) ({}) with {} of {N} done, {} \
                 retries pending",
                if all {
                    "all of the workers'"
                } else {
                    "AMQP 1.0"
                },
                s.progress(&set),
                native::pending_retries(&s.runs(), MAX_RETRIES)
            ));
            rounds += 1;
            all = !all;
        }
        publisher.await.expect("publisher task");
        let set: HashSet<String> = ids.iter().cloned().collect();
        let settled = s.wait_settled(&set, Duration::from_secs(120)).await;
        let (mut a, mut b) = (a, b);
        assert!(
            a.is_running() && b.is_running(),
            "a worker process exited:\n{}\n{}",
            a.log_tail(20),
            b.log_tail(20)
        );
        a.terminate(Duration::from_secs(10)).await;
        b.terminate(Duration::from_secs(10)).await;
        plan.assert_chosen(&a);
        plan.assert_chosen(&b);
        let outages: Vec<Duration> = a.outages().into_iter().chain(b.outages()).collect();
        let waiting = waiting_at_faults(&s, &close_times);
        report(format!(
            "connection closes: {rounds} rounds, {closed_total} connections closed; worker \
             outages {} (max {:?}); retries waiting at each close {waiting:?}; settled \
             {settled:?} after the flow; total {:?}",
            outages.len(),
            outages.iter().max().copied().unwrap_or_default(),
            started.elapsed()
        ));
        assert!(
            outages.len() >= rounds,
            "{rounds} rounds closed the workers' consuming connections, but the \
             workers saw {} outages",
            outages.len()
        );
        assert!(
            waiting.iter().sum::<usize>() > 0,
            "no retry was waiting when the connections closed"
        );
        let acc = s.account(&ids).await;
        acc.assert_settled("native forced connection closes");
        plan.assert_on_time(&s, &acc, "native forced connection closes");
        // Each worker's consuming connection closed takes back its unacked deliveries (a
        // prefetch) and cuts off at most one retry per handler.
        acc.assert_duplicates_at_most(
            &format!("native forced connection closes, {rounds} rounds"),
            2 * (PREFETCH + CONCURRENCY) * rounds,
            false,
        );
    })
    .await;
}

/// The broker's app restarted twice (`stop_app`, 3 s down, `start_app`) with hundreds of retries
/// waiting: natively in the quorum queue, which must hold them across the restart (and not
/// hand them out early afterwards). On the dedicated node of
/// `reliability_restart` (`rdsolo-1@localhost`, 5691, of `RD_CLUSTER_CHROOT`'s version).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_broker_restart_with_retries_waiting_loses_nothing() {
    const N: usize = 1000;
    const RESTARTS: usize = 2;
    const PREFETCH: usize = 50;
    let boot = Instant::now();
    let nodes = Nodes::start("rdsolo", 1, 5691, false).await;
    report(format!("dedicated node up after {:?}", boot.elapsed()));
    let shape = Shape {
        url: nodes.amqp_url(1),
        ..Shape::default()
    };
    let s = Scenario::new("nrestart", shape).await;
    let plan = RetryPlan::probe(&s.shape.url).await;
    let nodes = &nodes;
    s.run(|s| async move {
        if !plan.native_or_refused(&s).await {
            return;
        }
        let started = Instant::now();
        let ids = s.publish(N).await;
        let set: HashSet<String> = ids.iter().cloned().collect();
        let mut w = plan
            .worker(&s)
            .arg("fail-rate", 0.6)
            .arg("seed", 3)
            .arg("max-retries", MAX_RETRIES)
            .arg("retry-base-ms", 1500)
            .arg("retry-cap-ms", 3000)
            .arg("work-ms", 2)
            .arg("concurrency", 10)
            .spawn("w");
        s.wait_consumers(1, Duration::from_secs(30)).await;
        let mut stops = Vec::new();
        for round in 0..RESTARTS {
            let deadline = Instant::now() + Duration::from_secs(30);
            let pending = loop {
                let p = native::pending_retries(&s.runs(), MAX_RETRIES);
                if p >= 100 {
                    break p;
                }
                assert!(Instant::now() < deadline, "retries never piled up: {p}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            report(format!(
                "restart {round}: stop_app with {pending} retries pending, {} of {N} done",
                s.progress(&set)
            ));
            let since = unix_ms();
            stops.push(since);
            nodes.rabbitmqctl(1, &["stop_app"]).await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            nodes.rabbitmqctl(1, &["start_app"]).await;
            let o = w.wait_recovered(since, Duration::from_secs(60)).await;
            s.reconnect(Duration::from_secs(30)).await;
            s.wait_consumers(1, Duration::from_secs(60)).await;
            report(format!(
                "restart {round}: worker outage {:?}; {} retries pending",
                o.duration(),
                native::pending_retries(&s.runs(), MAX_RETRIES)
            ));
        }
        let settled = s.wait_settled(&set, Duration::from_secs(120)).await;
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(30));
        w.terminate(Duration::from_secs(10)).await;
        plan.assert_chosen(&w);
        let waiting = waiting_at_faults(&s, &stops);
        report(format!(
            "broker restart: {RESTARTS} restarts, retries waiting at each stop_app {waiting:?}; \
             settled {settled:?} after the last; total {:?} (plus {:?} to boot the node)",
            started.elapsed(),
            boot.elapsed() - started.elapsed()
        ));
        assert!(
            waiting.iter().all(|n| *n > 0),
            "a restart found no retry waiting: {waiting:?}"
        );
        let acc = s.account(&ids).await;
        acc.assert_settled("native broker app restart");
        plan.assert_on_time(&s, &acc, "native broker app restart");
        acc.assert_duplicates_at_most(
            &format!("native broker app restart, {RESTARTS}"),
            PREFETCH * RESTARTS,
            false,
        );
    })
    .await;
}
