//! The broker's app restarted (`rabbitmqctl stop_app` / `start_app`) while the outbox relay
//! publishes thousands of rows (issue 37, item 5): the relay notices the lost connection, is
//! not ready while the broker is down, reconnects by itself (nothing in the test recreates
//! it), is ready again, and every committed row (those committed while the broker was down
//! too) ends in the queue: each message id at least once, more than once only for rows of the
//! round the restart cut (at most one round), none parked, the outbox empty.
//!
//! As `tests/inbox_broker_restart.rs`, on a dedicated node started with `scripts/cluster.sh`
//! (of the `RD_CLUSTER_CHROOT` version when set) and removed afterwards: the default broker
//! other suites use is not restarted. The node is `rdrelay-1@localhost` on AMQP port 5701, not
//! the `rdsolo` node of the inbox and reliability restart tests, so this test never restarts
//! or removes a node another test is using.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "inbox_support/commit_outbox.rs"]
mod commit_outbox;
#[path = "inbox_support/effects_db.rs"]
mod effects_db;

use std::time::{Duration, Instant};

use commit_outbox::commit_outbox;
use effects_db::{effects_db, schema};
use redeliver::postgres::{Relay, RelayState};
use redeliver::{Backoff, CancellationToken, Jitter, RetryPolicy};
use redeliver_testkit::drain_message_ids;
use redeliver_testkit::nodes::Nodes;
use redeliver_testkit::postgres::pool;
use redeliver_testkit::reliability::{assert_published, report, wait_relayed, Scenario, Shape};

/// Rows committed before the relay starts.
const N: usize = 24000;
/// Rows committed while the broker is down.
const DURING: usize = 200;
const BATCH: u32 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_mid_round_loses_no_outbox_row_and_the_relay_reconnects_itself() {
    let db = effects_db().await;
    let boot = Instant::now();
    let nodes = Nodes::start("rdrelay", 1, 5701, false).await;
    let booted = boot.elapsed();
    let shape = Shape {
        url: nodes.amqp_url(1),
        ..Shape::default()
    };
    let s = Scenario::new("outbox-restart", shape).await;
    // A node left running by an earlier run with another RD_CLUSTER_CHROOT would test the
    // wrong version.
    let version = redeliver_testkit::broker_version().await;
    assert!(
        s.broker.ends_with(&version.to_string()),
        "the dedicated node runs {}, the broker at AMQP_URL {version}: remove the node \
         (RD_CLUSTER_NAME=rdrelay RD_CLUSTER_NODES=1 RD_CLUSTER_BASE_PORT=5701 bash \
         scripts/cluster.sh clean) and set RD_CLUSTER_CHROOT for that version",
        s.broker
    );
    let (db, nodes) = (&db, &nodes);
    s.run(|s| async move {
        let started = Instant::now();
        let queue = s.queue();
        let ids: Vec<String> = (0..N + DURING)
            .map(|i| format!("{}m{i:06}", s.prefix))
            .collect();
        commit_outbox(db, &queue, &ids[..N], 200).await;
        let stored_in = started.elapsed();

        let token = CancellationToken::new();
        let relay = Relay::new(pool(4).await, s.shape.url.clone())
            .schema(schema(db))
            .connection_name(format!("{}relay", s.prefix))
            .batch_size(BATCH)
            .poll_interval(Duration::from_millis(200))
            // A refusal while the node comes back (a queue not yet available) is retried
            // soon, and never parked within the test.
            .policy(
                RetryPolicy::exponential(Duration::from_millis(200))
                    .cap(Duration::from_secs(2))
                    .max_retries(40),
            )
            .reconnect_backoff(
                Backoff::Exponential {
                    base: Duration::from_millis(100),
                    factor: 2.0,
                    cap: Duration::from_secs(1),
                },
                Jitter::Full,
            );
        let mut status = relay.status_handle();
        let run = tokio::spawn(relay.run(token.clone()));
        status
            .wait_for_timeout(Duration::from_secs(30), |st| *st == RelayState::Relaying)
            .await
            .expect("the relay never connected");

        // Early in the run: the relay publishes about ten thousand rows a second.
        let deadline = Instant::now() + Duration::from_secs(30);
        let before = loop {
            let (depth, _) = s.queue_state(&queue).await;
            if depth as usize >= N / 24 {
                break depth;
            }
            assert!(
                Instant::now() < deadline,
                "only {depth} of {N} rows published after 30 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        // `stop_app` takes up to seconds to act, time enough, on a fast host, for the relay to
        // publish every row. The memory alarm freezes the relay where it is first: its
        // publishes are no longer read, so its round stays unconfirmed and its rows stay in the
        // outbox until the stop cuts the round.
        nodes
            .rabbitmqctl(1, &["set_vm_memory_high_watermark", "0"])
            .await;
        let frozen = db.outbox_rows().await;
        assert!(
            frozen > 0,
            "the relay published all {N} rows before the memory alarm froze it"
        );
        let stop = Instant::now();
        nodes.rabbitmqctl(1, &["stop_app"]).await;
        let down = status
            .wait_for_timeout(Duration::from_secs(15), |st| *st != RelayState::Relaying)
            .await
            .expect("the relay still says it relays 15 s after the broker stopped");
        let noticed = stop.elapsed();
        assert!(
            !status.is_ready(),
            "ready while the broker is down ({down})"
        );
        // Rows committed while the broker is down wait for it.
        commit_outbox(db, &queue, &ids[N..], 200).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            !status.is_ready(),
            "ready while the broker is down ({})",
            status.state()
        );
        let left_while_down = db.outbox_rows().await;
        assert!(
            left_while_down as usize > DURING,
            "the restart did not land while the relay was publishing: only the {DURING} rows \
             committed during it wait"
        );
        nodes.rabbitmqctl(1, &["start_app"]).await;
        // The alarm's threshold is the node's runtime setting: cleared explicitly, whether or
        // not the app's restart reset it.
        nodes
            .rabbitmqctl(1, &["set_vm_memory_high_watermark", "0.4"])
            .await;
        let app_up = stop.elapsed();
        status
            .wait_for_timeout(Duration::from_secs(60), |st| *st == RelayState::Relaying)
            .await
            .expect("the relay did not reconnect within 60 s of the broker's start");
        let back = stop.elapsed();
        assert!(
            status.is_ready(),
            "not ready after reconnecting ({})",
            status.state()
        );
        report(format!(
            "outbox restart: the memory alarm with {before} of {N} rows in the queue and \
             {frozen} in the outbox, then stop_app; the relay left \
             `relaying` ({down}) {noticed:?} after the stop, the app was up again after \
             {app_up:?}, the relay ready after {back:?}; {left_while_down} rows waited"
        ));
        // The harness's own connection died with the app.
        s.reconnect(Duration::from_secs(30)).await;

        let took = wait_relayed(db, &s, &queue, N + DURING, Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !run.is_finished(),
            "the relay stopped on its own: {:?}",
            run.await
        );
        assert!(
            status.is_ready(),
            "not ready at the end ({})",
            status.state()
        );
        token.cancel();
        run.await
            .expect("relay task")
            .expect("the relay stopped with an error");

        let drain = Instant::now();
        let received = drain_message_ids(&s.connection(), &queue).await;
        let drained = drain.elapsed();
        let copies = assert_published("broker restarted mid-round", &ids, &received, |_| true, 2);
        assert!(
            copies.duplicated.len() <= BATCH as usize,
            "{}: more duplicates than the one round the restart cut ({BATCH} rows)",
            copies.line
        );
        assert_eq!(db.outbox_rows().await, 0, "rows left in the outbox");
        report(format!(
            "RESULT fault=\"outbox: broker app restarted mid-round\" broker=\"{}\" N={} \
             batch={BATCH} {}; relay not ready {noticed:?} after the stop, ready again {:?} \
             after the app's start; outbox emptied {took:?} after; total {:?} ({stored_in:?} \
             to commit the rows, {drained:?} to drain the queue; plus {booted:?} to boot the \
             node)",
            s.broker,
            N + DURING,
            copies.line,
            back.saturating_sub(app_up),
            started.elapsed()
        ));
    })
    .await;
}
