//! PostgreSQL stopped and started again while the outbox relay publishes thousands of rows
//! (issue 37, item 5): the round in flight loses its transaction (its publishes may be
//! repeated), the relay's pooled connections and its `LISTEN` break, and the relay waits it
//! out: it does not return, it reports itself not ready while the database is unreachable,
//! and afterwards publishes every committed row, those committed after the restart too. End:
//! each message id at least once, more than once only within the one round cut (at most a
//! batch), none parked, the outbox empty.
//!
//! A test binary of its own: the restart breaks every PostgreSQL connection on the machine, so
//! no other test of this binary may run beside it. PostgreSQL is left running whatever
//! happens: a guard starts it again when the test fails between the stop and the start.

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
use redeliver::postgres::Relay;
use redeliver::{Backoff, CancellationToken, Jitter};
use redeliver_testkit::drain_message_ids;
use redeliver_testkit::postgres::{pg_ctlcluster, pool_named, KeepRunning};
use redeliver_testkit::reliability::{assert_published, report, wait_relayed, Scenario, Shape};

/// Rows committed before the relay starts.
const N: usize = 12000;
/// Rows committed once PostgreSQL is back.
const AFTER: usize = 500;
const BATCH: u32 = 100;

async fn ctl(action: &'static str) {
    tokio::task::spawn_blocking(move || pg_ctlcluster(action))
        .await
        .expect("pg_ctlcluster task")
        .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_mid_round_loses_no_outbox_row_and_the_relay_keeps_running() {
    let db = effects_db().await;
    // Fails here, not half-way, when the cluster cannot be managed from this process.
    pg_ctlcluster("status").unwrap_or_else(|e| panic!("{e}"));
    let _running = KeepRunning;
    // The outbox of a second relay, empty: it is cancelled while PostgreSQL is down.
    let idle = effects_db().await;
    let s = Scenario::new("outbox-pg", Shape::default()).await;
    let (db, idle) = (&db, &idle);
    s.run(|s| async move {
        let started = Instant::now();
        let queue = s.queue();
        let ids: Vec<String> = (0..N + AFTER)
            .map(|i| format!("{}m{i:06}", s.prefix))
            .collect();
        commit_outbox(db, &queue, &ids[..N], 200).await;
        let stored_in = started.elapsed();

        // A short acquire timeout: a round fails (and the relay says it is not ready) within
        // 2 s of the database going away.
        let relay_pool = pool_named(&format!("{}-relay", db.name), 4, Duration::from_secs(2)).await;
        let token = CancellationToken::new();
        let relay = Relay::new(relay_pool, s.shape.url.clone())
            .schema(schema(db))
            .connection_name(format!("{}relay", s.prefix))
            .batch_size(BATCH)
            .poll_interval(Duration::from_millis(200))
            .reconnect_backoff(
                Backoff::Exponential {
                    base: Duration::from_millis(100),
                    factor: 2.0,
                    cap: Duration::from_secs(1),
                },
                Jitter::Full,
            );
        let status = relay.status_handle();
        let mut run = tokio::spawn(relay.run(token.clone()));
        // A relay with nothing to publish, on a pool with sqlx's default acquire timeout (30 s),
        // polling: while the database is down its rounds wait for a connection, and it must
        // still stop at once when cancelled (a shutdown's grace period is shorter than that).
        let idle_token = CancellationToken::new();
        let mut idle_run = tokio::spawn(
            Relay::new(
                pool_named(&format!("{}-relay", idle.name), 4, Duration::from_secs(30)).await,
                s.shape.url.clone(),
            )
            .schema(schema(idle))
            .connection_name(format!("{}idle-relay", s.prefix))
            .poll_interval(Duration::from_millis(200))
            .run(idle_token.clone()),
        );

        // Mid-run: a sixth of the rows in the queue (`pg_ctlcluster stop` takes a moment to act).
        let deadline = Instant::now() + Duration::from_secs(30);
        let before = loop {
            let (depth, _) = s.queue_state(&queue).await;
            if depth as usize >= N / 6 {
                break depth;
            }
            assert!(
                Instant::now() < deadline,
                "only {depth} of {N} rows published after 30 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(
            status.is_ready(),
            "not ready while relaying ({})",
            status.state()
        );
        let stop = Instant::now();
        ctl("stop").await;
        let stopped = stop.elapsed();
        let (depth_stopped, _) = s.queue_state(&queue).await;
        assert!(
            (depth_stopped as usize) < N,
            "the restart did not land while the relay was publishing: all {N} rows were in the \
             queue when PostgreSQL stopped"
        );
        // The relay notices (a round fails), and goes on waiting.
        let deadline = Instant::now() + Duration::from_secs(15);
        while status.is_ready() {
            assert!(
                Instant::now() < deadline,
                "the relay is still ready 15 s after PostgreSQL stopped"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let noticed = stop.elapsed();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !run.is_finished(),
            "the relay returned while PostgreSQL was down: {:?}",
            (&mut run).await
        );
        let still_down = tokio::task::spawn_blocking(|| pg_ctlcluster("status"))
            .await
            .expect("pg_ctlcluster task");
        assert!(
            still_down.is_err(),
            "PostgreSQL runs again although this test stopped it: another process started it \
             (a test of another binary whose pool starts the local cluster when it cannot \
             connect?); run this test alone"
        );
        assert!(!status.is_ready(), "ready while PostgreSQL is down");
        let cancel = Instant::now();
        idle_token.cancel();
        let idle_end = tokio::time::timeout(Duration::from_secs(2), &mut idle_run).await;
        let idle_stopped = cancel.elapsed();
        ctl("start").await;
        idle_end
            .unwrap_or_else(|_| {
                panic!("a relay cancelled while PostgreSQL is down did not stop within 2 s")
            })
            .expect("idle relay task")
            .expect("the idle relay stopped with an error");
        let up = stop.elapsed();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !status.is_ready() {
            assert!(
                Instant::now() < deadline,
                "the relay is not ready 30 s after PostgreSQL started again ({})",
                status.state()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let ready = stop.elapsed();
        report(format!(
            "outbox pg: stopping PostgreSQL with {before} of {N} rows in the queue, \
             {depth_stopped} once stopped ({stopped:?}); the relay not ready {noticed:?} after \
             the stop, PostgreSQL up after {up:?}, the relay ready after {ready:?}; a relay cancelled \
             meanwhile stopped in {idle_stopped:?}"
        ));
        // Committed after the restart: the relay's LISTEN (or its poll) finds them.
        commit_outbox(db, &queue, &ids[N..], 200).await;

        let took = wait_relayed(db, &s, &queue, N + AFTER, Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !run.is_finished(),
            "the relay stopped on its own: {:?}",
            (&mut run).await
        );
        token.cancel();
        run.await
            .expect("relay task")
            .expect("the relay stopped with an error");

        let drain = Instant::now();
        let received = drain_message_ids(&s.connection(), &queue).await;
        let drained = drain.elapsed();
        let copies = assert_published(
            "PostgreSQL restarted mid-round",
            &ids,
            &received,
            |_| true,
            2,
        );
        assert!(
            copies.duplicated.len() <= BATCH as usize,
            "{}: more duplicates than the one round the restart cut ({BATCH} rows)",
            copies.line
        );
        assert_eq!(db.outbox_rows().await, 0, "rows left in the outbox");
        report(format!(
            "RESULT fault=\"outbox: PostgreSQL restarted mid-round\" broker=\"{}\" N={} \
             batch={BATCH} {}; relay not ready {noticed:?} after the stop, ready again {:?} \
             after the start, never returned; outbox emptied {took:?} after; total {:?} \
             ({stored_in:?} to commit the rows, {drained:?} to drain the queue)",
            s.broker,
            N + AFTER,
            copies.line,
            ready.saturating_sub(up),
            started.elapsed()
        ));
    })
    .await;
}
