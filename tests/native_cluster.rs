//! The leader of the work queue killed (SIGKILL of its node's VM) while 1,000 retries wait, on
//! the 3-node cluster of `reliability_cluster` (`scripts/cluster.sh`: `rdcluster-{1,2,3}`, AMQP
//! 5681-5683, of `RD_CLUSTER_CHROOT`'s version).
//!
//! On RabbitMQ 4.3+ the retries are native: all 1,000 messages fail their first attempt and the
//! quorum queue holds each for 10 s (`x-opt-delivery-time`) when its leader dies; a new leader
//! must hold them on, hand each out at its time, never before, and lose none. Before 4.3 the
//! worker runs with `auto`, which must choose the delay levels: the retries then wait in the
//! quorum delay levels, declared through the same node, whose leaders die too. The worker
//! consumes through the leader's node first, so it also fails over to a surviving node.
//!
//! The cluster is started if it is not running and left as it was found; the killed node is
//! started again before the test ends.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use redeliver::QueueType;
use redeliver_testkit::mgmt;
use redeliver_testkit::nodes::Nodes;
use reliability::native::{self, RetryPlan};
use reliability::{report, unix_ms, Scenario, Shape};

const N: usize = 1000;
/// How long each retry waits: long enough for the leader to die and another to be elected
/// while all of them wait.
const DELAY_MS: u64 = 10_000;
const MAX_RETRIES: u32 = 3;
const PREFETCH: usize = 50;

/// The node (1-based) the management API of node `via` says leads `queue`.
async fn leader_of(nodes: &Nodes, via: u32, queue: &str) -> Option<u32> {
    let client = mgmt::Client::new(&nodes.mgmt_url(via));
    let path = format!("/api/queues/%2f/{}", mgmt::pct(queue));
    let q = mgmt::blocking(move || client.get_json(&path)).await.ok()?;
    let leader = q["leader"].as_str()?.to_owned();
    (1..=nodes.count).find(|i| nodes.node_name(*i) == leader)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_leader_killed_while_retries_wait_loses_nothing() {
    let boot = Instant::now();
    let nodes = Nodes::start("rdcluster", 3, 5681, true).await;
    report(format!("cluster up after {:?}", boot.elapsed()));
    let shape = Shape {
        url: nodes.amqp_url(3),
        dlq_queue_type: QueueType::Quorum,
        ..Shape::default()
    };
    let s = Scenario::new("ncluster", shape).await;
    let plan = RetryPlan::probe(&s.shape.url).await;
    let nodes = &nodes;
    s.run(|s| async move {
        let started = Instant::now();
        plan.assert_explicit_native_refused(&s.worker()).await;
        let leader = leader_of(nodes, 3, &s.queue())
            .await
            .expect("the management API names the work queue's leader");
        let others: Vec<u32> = (1..=3).filter(|i| *i != leader).collect();
        // The leader's node first: the worker loses its connections with the leader.
        let urls = std::iter::once(leader)
            .chain(others.iter().copied())
            .map(|i| nodes.amqp_url(i))
            .collect::<Vec<_>>()
            .join(",");
        let mut w = plan
            .worker(&s)
            .urls(&urls)
            .arg("shutdown-grace-ms", 2000)
            .arg("max-retries", MAX_RETRIES)
            .arg("retry-base-ms", DELAY_MS)
            .arg("retry-cap-ms", DELAY_MS)
            .flag("no-jitter")
            .arg("concurrency", 10)
            .arg("prefetch", PREFETCH)
            .spawn("w");
        s.wait_consumers(1, Duration::from_secs(30)).await;
        let ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        let set: HashSet<String> = ids.iter().cloned().collect();
        // Every message fails its first attempt and succeeds on its retry.
        s.publish_ids(&ids, |_| Some("flaky")).await;
        let deadline = Instant::now() + Duration::from_secs(DELAY_MS / 1000 - 2);
        loop {
            let pending = native::pending_retries(&s.runs(), MAX_RETRIES);
            if pending >= N {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "only {pending} of {N} first attempts failed before the first retries fall due"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pid = nodes.eval(leader, "os:getpid().").await;
        let pid = pid.trim_matches('"');
        report(format!(
            "all {N} retries waiting {:?} after the publish; SIGKILL of the leader, node \
             {leader} (pid {pid})",
            started.elapsed()
        ));
        let killed_at = unix_ms();
        let t = Instant::now();
        let status = std::process::Command::new("kill")
            .args(["-KILL", pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -KILL {pid}: {status}");
        // The harness's connection may have been on that node.
        s.reconnect_to(&nodes.amqp_url(others[0]), Duration::from_secs(30))
            .await;
        let o = w.wait_recovered(killed_at, Duration::from_secs(60)).await;
        assert_ne!(o.url, 0, "the worker recovered on the killed node");
        let new_leader = leader_of(nodes, others[0], &s.queue()).await;
        report(format!(
            "worker consuming via node {} after an outage of {:?}; leader now {new_leader:?}",
            others[o.url - 1],
            o.duration()
        ));
        let settled = s.wait_settled(&set, Duration::from_secs(120)).await;
        report(format!(
            "settled {settled:?} after the kill ({:?} since)",
            t.elapsed()
        ));
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(30));
        nodes.script(&["start-node", &leader.to_string()]).await;
        report(format!("node {leader} back after {:?}", t.elapsed()));
        w.terminate(Duration::from_secs(10)).await;
        plan.assert_chosen(&w);
        let waiting = native::waiting_at(&s.runs(), u64::try_from(killed_at).unwrap());
        report(format!(
            "leader killed with {waiting} of {N} retries waiting; total {:?} (plus {:?} to form \
             the cluster)",
            started.elapsed(),
            boot.elapsed() - started.elapsed()
        ));
        assert_eq!(
            waiting, N,
            "every retry should have been waiting at the kill"
        );
        let acc = s.account(&ids).await;
        acc.assert_settled("native leader killed");
        plan.assert_on_time(&s, &acc, "native leader killed");
        assert_eq!(
            acc.succeeded,
            N,
            "every message succeeds on its retry: {}",
            acc.summary()
        );
        // Nothing was in flight at the kill: all of it waited in the queue.
        acc.assert_duplicates_at_most("native leader killed", PREFETCH, false);
    })
    .await;
}
