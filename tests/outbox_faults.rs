//! The outbox relay killed mid-round (issue 37, item 5), on a real PostgreSQL and RabbitMQ:
//! its task aborted while a large round is open, then its database sessions terminated, as a
//! crashed process's would be. A relay started afterwards publishes what the dead one left, so
//! every committed row ends in the destination queue, each message id at least once, and only
//! the rows of the killed round more than once (at-least-once: published by the dead relay,
//! never deleted, published again).
//!
//! - killed while publishing: the round's publishes half done when the task goes;
//! - killed after the confirms: every publish of the round confirmed, its `DELETE` held by a
//!   trigger until the kill, so every row of the round is published twice.
//!
//! Each test has a schema (`rdfx_<hex>`) and a topology (`rel-outbox-…`) of its own, dropped
//! at the end, also when it fails. PostgreSQL at DATABASE_URL (default
//! `postgres://postgres@127.0.0.1:5432/test`), RabbitMQ at AMQP_URL (default 127.0.0.1:5672);
//! without them the tests fail saying how to start them.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "inbox_support/commit_outbox.rs"]
mod commit_outbox;
#[path = "inbox_support/effects_db.rs"]
mod effects_db;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use commit_outbox::commit_outbox;
use effects_db::{effects_db, schema};
use redeliver::lapin::options::QueueDeclareOptions;
use redeliver::lapin::types::FieldTable;
use redeliver::postgres::Relay;
use redeliver::CancellationToken;
use redeliver_testkit::drain_message_ids;
use redeliver_testkit::postgres::pool_named;
use redeliver_testkit::reliability::{assert_published, report, wait_relayed, Scenario, Shape};
use sqlx::PgPool;

/// Rows committed before the first relay starts.
const N: usize = 6000;
/// Rows per round: the killed round is a large one.
const BATCH: u32 = 1500;

/// Terminates every backend of the pool whose sessions are named `app` (the killed relay's),
/// until none is left.
async fn terminate_backends(pool: &PgPool, app: &str) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut terminated = 0;
    loop {
        let killed: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE application_name = $1 AND pid <> pg_backend_pid()",
        )
        .bind(app)
        .fetch_all(pool)
        .await
        .expect("terminate the relay's backends");
        if killed.is_empty() {
            return terminated;
        }
        terminated += killed.iter().filter(|k| **k).count();
        assert!(
            Instant::now() < deadline,
            "the backends of {app} are still there after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How the first relay dies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kill {
    /// Once the queue shows half of its second round published.
    WhilePublishing,
    /// In its first round's `DELETE`, held by a trigger, after every confirm.
    AfterTheConfirms,
}

async fn killed_relay_then_a_new_one(name: &str, kill: Kill) {
    let db = effects_db().await;
    let s = Scenario::new(name, Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        let started = Instant::now();
        let queue = s.queue();
        let ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        commit_outbox(db, &queue, &ids, 200).await;
        let stored_in = started.elapsed();
        if kill == Kill::AfterTheConfirms {
            // The first relay's DELETE, which follows the broker's confirms, waits here until
            // it is killed.
            sqlx::raw_sql(&format!(
                "CREATE FUNCTION \"{s}\".hold() RETURNS trigger LANGUAGE plpgsql AS
                     $$ BEGIN PERFORM pg_sleep(60); RETURN OLD; END $$;
                 CREATE TRIGGER hold BEFORE DELETE ON \"{s}\".outbox
                     FOR EACH ROW EXECUTE FUNCTION \"{s}\".hold();",
                s = db.name
            ))
            .execute(&db.pool)
            .await
            .expect("create the trigger holding the relay's DELETE");
        }

        // The first relay, with a pool of its own whose sessions carry its name.
        let app_a = format!("{}-relay-a", db.name);
        let pool_a = pool_named(&app_a, 4, Duration::from_secs(30)).await;
        let token = CancellationToken::new();
        let relay_a = tokio::spawn(
            Relay::new(pool_a.clone(), s.shape.url.clone())
                .schema(schema(db))
                .connection_name(format!("{}relay-a", s.prefix))
                .batch_size(BATCH)
                .poll_interval(Duration::from_millis(200))
                .run(token.clone()),
        );

        // Wait for the moment to kill it.
        let ch = s.connection().create_channel().await.expect("a channel");
        let depth = |ch: redeliver::lapin::Channel, queue: String| async move {
            ch.queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("passive declare of {queue}: {e}"))
            .message_count() as usize
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let at_kill = loop {
            assert!(
                !relay_a.is_finished(),
                "the first relay stopped on its own: {:?}",
                relay_a.await
            );
            let ready = match kill {
                // Half of the second round in the queue: the round is publishing.
                Kill::WhilePublishing => {
                    let d = depth(ch.clone(), queue.clone()).await;
                    (d >= BATCH as usize * 3 / 2).then_some(d)
                }
                Kill::AfterTheConfirms => {
                    let deleting: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity
                          WHERE application_name = $1 AND state = 'active'
                            AND query LIKE 'DELETE%'",
                    )
                    .bind(&app_a)
                    .fetch_one(&db.pool)
                    .await
                    .expect("pg_stat_activity");
                    if deleting > 0 {
                        Some(depth(ch.clone(), queue.clone()).await)
                    } else {
                        None
                    }
                }
            };
            if let Some(d) = ready {
                break d;
            }
            assert!(
                Instant::now() < deadline,
                "the first relay never reached the point of the kill"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        // Killed as a crashed process is: its task gone first (it starts nothing more), then
        // its sessions, still in the round's transaction, terminated.
        relay_a.abort();
        let _ = relay_a.await;
        let terminated = terminate_backends(&db.pool, &app_a).await;
        pool_a.close().await;
        let _ = ch.close(200, "measured".into()).await;

        // What the killed round held: the first BATCH rows left, in id order (the earlier
        // rounds deleted theirs, and a round takes the due rows in id order). Killed between
        // two rounds, nothing was in flight, and this overestimates it.
        let left = db.outbox_message_ids().await;
        assert!(
            left.len() < N || kill == Kill::AfterTheConfirms,
            "the first relay deleted nothing"
        );
        let killed_round: HashSet<String> = left.iter().take(BATCH as usize).cloned().collect();
        if kill == Kill::AfterTheConfirms {
            assert_eq!(left.len(), N, "a row was deleted despite the trigger");
            sqlx::raw_sql(&format!("DROP TRIGGER hold ON \"{}\".outbox", db.name))
                .execute(&db.pool)
                .await
                .expect("drop the trigger");
        }
        // Copies the dead relay left in the queue of rows it never deleted.
        let deleted = N - left.len();
        let (depth_now, _) = s.queue_state(&queue).await;
        let orphans = depth_now as usize - deleted.min(depth_now as usize);
        report(format!(
            "outbox kill ({name}): killed with {at_kill} messages in the queue, {} rows left \
             ({deleted} deleted), {orphans} published but not deleted; {terminated} sessions \
             terminated",
            left.len()
        ));
        assert!(
            orphans > 0,
            "the kill did not land inside a round: no message of the rows left was published \
             ({depth_now} in the queue, {deleted} rows deleted)"
        );

        // A new relay, as a restarted process would run.
        let pool_b = pool_named(&format!("{}-relay-b", db.name), 4, Duration::from_secs(30)).await;
        let relay_b = tokio::spawn(
            Relay::new(pool_b.clone(), s.shape.url.clone())
                .schema(schema(db))
                .connection_name(format!("{}relay-b", s.prefix))
                .batch_size(BATCH)
                .poll_interval(Duration::from_millis(200))
                .run(token.clone()),
        );
        let took = wait_relayed(db, &s, &queue, N, Duration::from_secs(60)).await;
        // A few more polls: nothing is published again.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!relay_b.is_finished(), "the new relay stopped on its own");
        token.cancel();
        relay_b
            .await
            .expect("relay task")
            .expect("the new relay stopped with an error");
        pool_b.close().await;

        let drain = Instant::now();
        let received = drain_message_ids(&s.connection(), &queue).await;
        let drained = drain.elapsed();
        let copies = assert_published(
            "relay killed mid-round",
            &ids,
            &received,
            |id| killed_round.contains(id),
            2,
        );
        assert_eq!(db.outbox_rows().await, 0, "rows left in the outbox");
        assert!(
            !copies.duplicated.is_empty(),
            "no row of the killed round was published twice ({orphans} copies were left by \
             the dead relay)"
        );
        if kill == Kill::AfterTheConfirms {
            // Every publish of the held round was confirmed: each of its rows went out twice.
            let twice: HashSet<String> = copies.duplicated.keys().cloned().collect();
            assert_eq!(
                twice.len(),
                killed_round.len(),
                "every row of the killed round should be published twice"
            );
            assert!(
                twice == killed_round,
                "the duplicates are not the killed round"
            );
        }
        report(format!(
            "RESULT fault=\"outbox: relay killed {}\" broker=\"{}\" N={N} batch={BATCH} {}; \
             every duplicate a row of the killed round ({} rows); the new relay emptied the \
             outbox in {took:?}; total {:?} ({stored_in:?} to commit the rows, {drained:?} to \
             drain the queue)",
            match kill {
                Kill::WhilePublishing => "while publishing a round",
                Kill::AfterTheConfirms => "after the confirms of a round, before its commit",
            },
            s.broker,
            copies.line,
            killed_round.len(),
            started.elapsed()
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_while_publishing_a_round_loses_nothing_and_repeats_only_that_round() {
    killed_relay_then_a_new_one("outbox-kill-mid", Kill::WhilePublishing).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_after_the_confirms_of_a_round_publishes_exactly_that_round_again() {
    killed_relay_then_a_new_one("outbox-kill-held", Kill::AfterTheConfirms).await;
}
