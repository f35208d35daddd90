//! Broker connections force-closed again and again (management API
//! `DELETE /api/connections/{name}`, as an operator or a broker-side failure would): the
//! workers reconnect on their own and nothing is lost.
//!
//! Only this scenario's worker connections are closed (matched by their client-provided
//! connection name, which contains the scenario's unique prefix): other suites share the broker.

use redeliver_testkit::reliability;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use reliability::{close_connections, connections_named, mgmt_url, report, Scenario, Shape};

const N: usize = 3000;
/// Publishing is spread over this long so that connections are closed while messages flow.
const FLOW: Duration = Duration::from_secs(12);
const MIN_CLOSES: usize = 6;
const PREFETCH: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_connection_closes_lose_nothing() {
    let s = Scenario::new("conn", Shape::default()).await;
    s.run(|s| async move {
        let started = Instant::now();
        let ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        let set: HashSet<String> = ids.iter().cloned().collect();
        let cmd = s
            .worker()
            .arg("fail-rate", 0.3)
            .arg("seed", 23)
            .arg("max-retries", 4)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 400)
            .arg("work-ms", 5)
            .arg("concurrency", 8)
            .arg("prefetch", PREFETCH);
        let mut a = cmd.spawn("a");
        let mut b = cmd.spawn("b");
        s.wait_consumers(2, Duration::from_secs(30)).await;

        // Messages flow during the whole fault: 25 every 100 ms.
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

        let name = s.worker_connection_name();
        let mgmt = mgmt_url();
        let mut closed_names = HashSet::new();
        let mut recoveries = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        // The management API lists a new connection only at its next statistics emission (up
        // to 5 s), so each connection is closed as soon as it is listed, as often as that
        // allows while messages flow.
        while !publisher.is_finished() || closed_names.len() < MIN_CLOSES {
            assert!(
                Instant::now() < deadline,
                "only {} connections closed in 60 s",
                closed_names.len()
            );
            let fresh: Vec<String> = connections_named(&mgmt, &name)
                .await
                .into_iter()
                .filter(|c| !closed_names.contains(c))
                .collect();
            if fresh.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let closed = close_connections(&mgmt, fresh.clone()).await;
            closed_names.extend(fresh);
            let t = Instant::now();
            // The broker drops the consumers with the connections; recovered = both back.
            tokio::time::sleep(Duration::from_millis(20)).await;
            s.wait_consumers(2, Duration::from_secs(30)).await;
            recoveries.push(t.elapsed());
            let c = s.counts().await;
            report(format!(
                "closed {closed} connection(s) with {} of {N} done, {} ready, {} in delay levels; \
                 both consuming again after {:?}",
                s.progress(&set),
                c.queue,
                c.delay,
                t.elapsed()
            ));
        }
        publisher.await.expect("publisher task");
        let settled = s.wait_settled(&set, Duration::from_secs(120)).await;
        assert!(
            a.is_running() && b.is_running(),
            "a worker process exited:\n{}\n{}",
            a.log_tail(20),
            b.log_tail(20)
        );
        a.terminate(Duration::from_secs(10)).await;
        b.terminate(Duration::from_secs(10)).await;
        let acc = s.account(&ids).await;
        acc.assert_settled("forced connection closes");
        recoveries.sort();
        // The workers' own view: from losing the connection to consuming again.
        let mut outages: Vec<Duration> = a.outages().into_iter().chain(b.outages()).collect();
        outages.sort();
        report(format!(
            "connection closes: {} connections closed; worker outages {} (median {:?}, max {:?}); \
             both consumers back on the queue after median {:?}, max {:?}; settled {settled:?} \
             after the flow; total {:?}",
            closed_names.len(),
            outages.len(),
            outages.get(outages.len() / 2).copied().unwrap_or_default(),
            outages.last().copied().unwrap_or_default(),
            recoveries[recoveries.len() / 2],
            recoveries.last().copied().unwrap_or_default(),
            started.elapsed()
        ));
        assert_eq!(
            outages.len(),
            closed_names.len(),
            "every closed connection should show as one outage and one recovery"
        );
        // A closed connection takes its unacked deliveries back: at most a prefetch each.
        acc.assert_duplicates_at_most(
            &format!("forced connection closes, {}", closed_names.len()),
            PREFETCH * closed_names.len(),
            false,
        );
    })
    .await;
}
