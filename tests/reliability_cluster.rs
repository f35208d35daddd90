//! A 3-node RabbitMQ cluster on this machine (`scripts/cluster.sh`: nodes
//! `rdcluster-{1,2,3}@localhost`, AMQP 5681-5683): quorum work queue and quorum delay levels
//! replicated on all three nodes, and a quorum DLQ. While messages flow, the node the worker is connected to is
//! stopped, twice (node 1, then node 2 after node 1 is back); the worker moves to a surviving
//! node (the worker's own failover: `WorkerBuilder::failover_urls`, the URLs tried in turn) and
//! nothing is lost.
//!
//! Part of the default run, on every broker CI tests (about 30 s, plus 20-40 s to form the
//! cluster when it is not running; with `RD_CLUSTER_CHROOT` the nodes are of that version):
//!
//! ```text
//! cargo test --test reliability_cluster -- --nocapture
//! ```
//!
//! The cluster is started if it is not running and left as it was found. The topology is
//! declared through node 3, which is never stopped, so the quorum queues' leaders are on node 3:
//! this exercises client failover and replicas going away, not leader elections.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redeliver::QueueType;
use redeliver_testkit::nodes::Nodes;
use reliability::{report, Scenario, Shape};

const N: usize = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_workers_node_loses_nothing() {
    let boot = Instant::now();
    let nodes = Nodes::start("rdcluster", 3, 5681, true).await;
    report(format!("cluster up after {:?}", boot.elapsed()));
    let urls = (1..=3)
        .map(|i| nodes.amqp_url(i))
        .collect::<Vec<_>>()
        .join(",");
    let shape = Shape {
        url: nodes.amqp_url(3),
        dlq_queue_type: QueueType::Quorum,
        ..Shape::default()
    };
    let s = Scenario::new("cluster", shape).await;
    let nodes = &nodes;
    s.run(|s| async move {
        let started = Instant::now();
        let ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        let set: HashSet<String> = ids.iter().cloned().collect();
        let mut w = s
            .worker()
            .urls(&urls)
            .arg("shutdown-grace-ms", 2000)
            .arg("fail-rate", 0.3)
            .arg("seed", 17)
            .arg("max-retries", 4)
            .arg("retry-base-ms", 50)
            .arg("retry-cap-ms", 1000)
            .arg("work-ms", 5)
            .arg("concurrency", 8)
            .arg("prefetch", 40)
            .spawn("w");
        s.wait_consumers(1, Duration::from_secs(30)).await;

        // Messages flow (through node 3) during both faults: 25 every 300 ms, about 24 s.
        let chunks: Vec<Vec<String>> = ids.chunks(25).map(<[String]>::to_vec).collect();
        let publisher = {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                for chunk in chunks {
                    s.publish_ids(&chunk, |_| None).await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            })
        };

        let mut recoveries = Vec::new();
        // The worker starts on node 1 (its first URL) and moves to node 2 when node 1 goes;
        // then node 2 is stopped and it moves on to node 3.
        for (node, at) in [(1u32, 0.15), (2u32, 0.6)] {
            s.wait_progress(&set, at, Duration::from_secs(120)).await;
            let c = s.counts().await;
            report(format!(
                "stopping node {node} with {} of {N} done, {} ready, {} in delay levels",
                s.progress(&set),
                c.queue,
                c.delay
            ));
            let t = Instant::now();
            let since = reliability::unix_ms();
            nodes.script(&["stop-node", &node.to_string()]).await;
            let stopped = t.elapsed();
            // Measured by the worker itself (its state changes): from losing the connection to
            // consuming through another node. The queue's consumer count is no use here: a
            // quorum queue keeps counting the consumer of a stopped node for a while.
            let o = w.wait_recovered(since, Duration::from_secs(60)).await;
            let (outage, url) = (o.duration(), o.url);
            assert_ne!(
                url + 1,
                node as usize,
                "the worker recovered on the stopped node"
            );
            recoveries.push(outage);
            // And work actually resumes (or everything left is already in the DLQ).
            let base = s.progress(&set);
            let resume = Instant::now() + Duration::from_secs(30);
            while s.progress(&set) == base && base + (s.counts().await.dlq as usize) < N {
                assert!(Instant::now() < resume, "no progress after failing over");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            report(format!(
                "node {node} stopped (the stop command took {stopped:?}); worker consuming via \
                 node {} after an outage of {outage:?}; {} of {N} done",
                url + 1,
                s.progress(&set)
            ));
            nodes.script(&["start-node", &node.to_string()]).await;
            report(format!("node {node} back after {:?}", t.elapsed()));
        }
        publisher.await.expect("publisher task");
        let settled = s.wait_settled(&set, Duration::from_secs(240)).await;
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(30));
        w.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled("cluster node stop");
        // Each stopped node drops the worker's connection with at most a prefetch (40) unacked.
        acc.assert_duplicates_at_most("cluster node stopped, 2", 40 * 2, false);
        report(format!(
            "cluster: 2 node stops, worker outages {recoveries:?}; settled {settled:?} after the \
             flow; total {:?}",
            started.elapsed()
        ));
    })
    .await;
}
