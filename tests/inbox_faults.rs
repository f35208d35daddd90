//! The PostgreSQL inbox and outbox under process faults, on a real PostgreSQL and RabbitMQ
//! (issue 31, item 5): the reliability worker's `--inbox-schema` mode writes one row per handled
//! message to a business table `effects` that has no unique constraint, so only the inbox can
//! keep a second row out, and each test asserts exactly one row per message id.
//!
//! - killed after the commit, before the ack: the redelivery finds the inbox row, the handler
//!   is not called again, the message is acked;
//! - killed before the commit: the effect is rolled back, the redelivery runs the handler again,
//!   one effect;
//! - the same message id delivered to two worker processes at the same moment: one effect;
//! - an outbox row committed by a process killed before any relay ran is published exactly
//!   once by a relay started later; a rolled-back transaction publishes nothing.
//!
//! PostgreSQL at DATABASE_URL (default `postgres://postgres@127.0.0.1:5432/test`); each test has
//! a schema of its own, dropped at the end. Without PostgreSQL or RabbitMQ the tests fail
//! saying how to start them.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "inbox_support/effects_db.rs"]
mod effects_db;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use effects_db::{effects_db, schema};
use redeliver::lapin::options::QueueDeclareOptions;
use redeliver::lapin::types::FieldTable;
use redeliver::postgres::{Outbox, OutboxMessage, Relay};
use redeliver::CancellationToken;
use redeliver_testkit::reliability::{assert_inbox_end, report, Scenario, Shape, WorkerProc};

/// Waits until the process exited on its own (the injected abort).
async fn wait_exit(w: &mut WorkerProc, timeout: Duration) {
    let start = Instant::now();
    while w.is_running() {
        assert!(
            start.elapsed() < timeout,
            "{} did not abort within {timeout:?}:\n{}",
            w.label(),
            w.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_commit_before_the_ack_is_acked_without_running_again() {
    let db = effects_db().await;
    let s = Scenario::new("inbox-after", Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        let ids = s.publish(20).await;
        let target = ids[7].clone();
        let cmd = s
            .inbox_worker(&db.name)
            .arg("abort-after-commit", &target)
            .arg("concurrency", 4)
            .arg("prefetch", 10);
        let mut a = cmd.spawn("a");
        wait_exit(&mut a, Duration::from_secs(30)).await;
        // Committed: the effect and the inbox row are there, but the broker never got the ack.
        assert_eq!(
            db.effects().await.get(&target),
            Some(&1),
            "effect of {target}"
        );
        assert_eq!(db.inbox_rows().await.get(&target), Some(&1));
        assert_eq!(s.handler_calls(&target), 1);

        // The same command line: the fault fires on a first delivery only.
        let mut b = cmd.spawn("b");
        let set: HashSet<String> = ids.iter().cloned().collect();
        s.wait_settled(&set, Duration::from_secs(60)).await;
        b.terminate(Duration::from_secs(10)).await;
        let line = assert_inbox_end(&s, db, &ids, "killed after the commit")
            .await
            .line;
        assert_eq!(
            s.handler_calls(&target),
            1,
            "the handler ran again for {target}, whose effect was committed"
        );
        let again: Vec<_> = s
            .deliveries()
            .into_iter()
            .filter(|d| d.id == target)
            .collect();
        assert!(
            again.len() == 1 && again[0].label == "b" && again[0].outcome == "duplicate",
            "{target} should be delivered to b once, found a duplicate by the inbox and acked: \
             {again:?}"
        );
        report(format!(
            "RESULT fault=\"inbox: killed after the commit, before the ack\" broker=\"{}\" {line}; \
             {target}: 1 handler call, redelivered to b, acked as a duplicate",
            s.broker
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_commit_runs_the_handler_again_with_one_effect() {
    let db = effects_db().await;
    let s = Scenario::new("inbox-before", Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        let ids = s.publish(20).await;
        let target = ids[7].clone();
        let cmd = s
            .inbox_worker(&db.name)
            .arg("abort-before-commit", &target)
            .arg("concurrency", 4)
            .arg("prefetch", 10);
        let mut a = cmd.spawn("a");
        wait_exit(&mut a, Duration::from_secs(30)).await;
        // The INSERT was made, then the process died inside the transaction: rolled back.
        assert_eq!(db.effects().await.get(&target), None, "effect of {target}");
        assert_eq!(db.inbox_rows().await.get(&target), None);
        assert_eq!(s.handler_calls(&target), 1);

        let mut b = cmd.spawn("b");
        let set: HashSet<String> = ids.iter().cloned().collect();
        s.wait_settled(&set, Duration::from_secs(60)).await;
        b.terminate(Duration::from_secs(10)).await;
        let line = assert_inbox_end(&s, db, &ids, "killed before the commit")
            .await
            .line;
        assert_eq!(
            s.handler_calls(&target),
            2,
            "the handler should run again for {target}, rolled back the first time"
        );
        let again: Vec<_> = s
            .deliveries()
            .into_iter()
            .filter(|d| d.id == target)
            .collect();
        assert!(
            again.len() == 1 && again[0].label == "b" && again[0].outcome == "handled",
            "{target} should be handled by b: {again:?}"
        );
        report(format!(
            "RESULT fault=\"inbox: killed before the commit\" broker=\"{}\" {line}; {target}: 2 \
             handler calls, the second committed",
            s.broker
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_to_two_workers_at_once_has_one_effect() {
    const IDS: usize = 20;
    let db = effects_db().await;
    let s = Scenario::new("inbox-twice", Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        // One delivery at a time per process, 300 ms inside the transaction: the broker hands
        // the two copies of an id to the two processes, and the second inbox INSERT waits on
        // the first's uncommitted row.
        let cmd = s
            .inbox_worker(&db.name)
            .arg("work-ms", 300)
            .arg("concurrency", 1)
            .arg("prefetch", 1);
        let mut a = cmd.spawn("a");
        let mut b = cmd.spawn("b");
        s.wait_consumers(2, Duration::from_secs(30)).await;
        let ids: Vec<String> = (0..IDS).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        // One pair at a time, each published once both processes are idle: with a prefetch of
        // 1, the broker can only hand the second copy to the other process. Published all at
        // once, a process that falls behind on a loaded host lets the other take both copies
        // of an id one after the other, and nothing races.
        for (i, id) in ids.iter().enumerate() {
            s.publish_ids(&[id.clone(), id.clone()], |_| None).await;
            let start = Instant::now();
            while s.deliveries().len() < 2 * (i + 1) {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "{} deliveries recorded, {} expected",
                    s.deliveries().len(),
                    2 * (i + 1)
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let set: HashSet<String> = ids.iter().cloned().collect();
        s.wait_settled(&set, Duration::from_secs(60)).await;
        a.terminate(Duration::from_secs(10)).await;
        b.terminate(Duration::from_secs(10)).await;
        let line = assert_inbox_end(&s, db, &ids, "the same message to two workers")
            .await
            .line;
        let mut per_id: BTreeMap<String, Vec<redeliver_testkit::reliability::Delivery>> =
            BTreeMap::new();
        for d in s.deliveries() {
            per_id.entry(d.id.clone()).or_default().push(d);
        }
        let mut concurrent = 0;
        for id in &ids {
            let ds = per_id.get(id).cloned().unwrap_or_default();
            let handled = ds.iter().filter(|d| d.outcome == "handled").count();
            let dup = ds.iter().filter(|d| d.outcome == "duplicate").count();
            assert!(
                ds.len() == 2 && handled == 1 && dup == 1,
                "{id}: two deliveries expected, one handled and one duplicate: {ds:?}"
            );
            assert_eq!(s.handler_calls(id), 1, "{id}: handler calls");
            if ds[0].label != ds[1].label
                && ds[0].start_ms < ds[1].end_ms
                && ds[1].start_ms < ds[0].end_ms
            {
                concurrent += 1;
            }
        }
        assert!(
            concurrent >= IDS / 2,
            "only {concurrent} of {IDS} ids had their two deliveries in both processes at once: \
             the test did not race them"
        );
        report(format!(
            "RESULT fault=\"inbox: the same message id to two workers at once\" broker=\"{}\" \
             {line}; {concurrent} of {IDS} pairs handled by both processes at the same time, \
             every second one a duplicate",
            s.broker
        ));
    })
    .await;
}

/// Declares `queue` (classic, durable) on the scenario's broker.
async fn declare(s: &Scenario, queue: &str) {
    let ch = s.connection().create_channel().await.expect("a channel");
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declare {queue}: {e}"));
    let _ = ch.close(200, "declared".into()).await;
}

/// Message ids of everything in `queue`, removed.
async fn drain_ids(s: &Scenario, queue: &str) -> Vec<String> {
    let mut ids: Vec<String> = s
        .drain(queue)
        .await
        .into_iter()
        .map(|g| g.message_id().to_owned())
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_row_committed_by_a_killed_process_is_published_once_by_a_later_relay() {
    let db = effects_db().await;
    let s = Scenario::new("outbox-kill", Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        let out = format!("{}out", s.prefix);
        declare(&s, &out).await;
        let ids = s.publish(10).await;
        // Rolled back every time (a permanent error after the writes): dead-lettered, its
        // outbox message never stored.
        let rejected = format!("{}rejected", s.prefix);
        s.publish_ids(std::slice::from_ref(&rejected), |_| Some("permanent"))
            .await;
        let target = ids[4].clone();
        // No relay runs: every committed outbox row waits in the table.
        let cmd = s
            .inbox_worker(&db.name)
            .arg("outbox-queue", &out)
            .arg("abort-after-commit", &target)
            .arg("concurrency", 2)
            .arg("prefetch", 4);
        let mut a = cmd.spawn("a");
        wait_exit(&mut a, Duration::from_secs(30)).await;
        let stored_by_a = db.outbox_rows().await;
        assert!(
            stored_by_a >= 1,
            "the killed process committed no outbox row"
        );
        let mut b = cmd.spawn("b");
        let mut all = ids.clone();
        all.push(rejected.clone());
        let set: HashSet<String> = all.iter().cloned().collect();
        s.wait_settled(&set, Duration::from_secs(60)).await;
        b.terminate(Duration::from_secs(10)).await;
        assert_eq!(
            db.outbox_rows().await,
            ids.len() as i64,
            "one outbox row per handled id (none for the redelivered {target}, none for the \
             rolled-back one)"
        );
        assert_eq!(s.queue_state(&out).await.0, 0, "published without a relay");

        // A relay started now publishes what the dead process committed, and the rest.
        let token = CancellationToken::new();
        let relay = tokio::spawn(
            Relay::new(db.pool.clone(), s.shape.url.clone())
                .schema(schema(db))
                .poll_interval(Duration::from_millis(200))
                .run(token.clone()),
        );
        let start = Instant::now();
        while db.outbox_rows().await > 0 || s.queue_state(&out).await.0 < ids.len() as u32 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "relay: {} rows left, {} published",
                db.outbox_rows().await,
                s.queue_state(&out).await.0
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A few more polls: nothing is published twice.
        tokio::time::sleep(Duration::from_secs(1)).await;
        token.cancel();
        relay
            .await
            .expect("relay task")
            .expect("the relay stopped with an error");
        let mut want = ids.clone();
        want.sort();
        assert_eq!(
            drain_ids(&s, &out).await,
            want,
            "every handled id published exactly once, the rolled-back one never"
        );
        let acc = s.account(&all).await;
        acc.assert_nothing_lost("outbox after a kill");
        assert_eq!(
            acc.dead_lettered, 1,
            "the rolled-back message is dead-lettered"
        );
        db.assert_exactly_once("outbox after a kill", &ids).await;
        report(format!(
            "RESULT fault=\"outbox: killed after the commit, before any relay\" broker=\"{}\" \
             {} rows committed by the killed process, {} published once each by a relay \
             started afterwards; the rolled-back message stored nothing",
            s.broker,
            stored_by_a,
            ids.len()
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_publishes_nothing() {
    let db = effects_db().await;
    let s = Scenario::new("outbox-rollback", Shape::default()).await;
    let db = &db;
    s.run(|s| async move {
        let out = format!("{}out", s.prefix);
        declare(&s, &out).await;
        let outbox = Outbox::new(schema(db));
        let mut tx = db.pool.begin().await.expect("begin");
        outbox
            .store(
                &mut tx,
                &OutboxMessage::new("", out.as_str(), b"no".to_vec())
                    .with_message_id("rolled-back"),
            )
            .await
            .expect("store");
        tx.rollback().await.expect("rollback");
        // A whole relay run (its rounds, its LISTEN, its poll).
        let token = CancellationToken::new();
        let run = tokio::spawn(
            Relay::new(db.pool.clone(), s.shape.url.clone())
                .schema(schema(db))
                .poll_interval(Duration::from_millis(100))
                .run(token.clone()),
        );
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(
            s.queue_state(&out).await.0,
            0,
            "a rolled-back message was published"
        );
        // The relay works: a committed message arrives, alone.
        let mut tx = db.pool.begin().await.expect("begin");
        outbox
            .store(
                &mut tx,
                &OutboxMessage::new("", out.as_str(), b"yes".to_vec()).with_message_id("committed"),
            )
            .await
            .expect("store");
        tx.commit().await.expect("commit");
        redeliver_testkit::wait_count(&s.connection(), &out, 1, Duration::from_secs(10)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        token.cancel();
        run.await.expect("relay task").expect("relay run");
        assert_eq!(drain_ids(&s, &out).await, vec!["committed".to_owned()]);
        assert_eq!(db.outbox_rows().await, 0);
        report(format!(
            "RESULT fault=\"outbox: rolled-back transaction\" broker=\"{}\" nothing published \
             after 800 ms of a running relay; the committed control message \
             published once",
            s.broker
        ));
    })
    .await;
}
