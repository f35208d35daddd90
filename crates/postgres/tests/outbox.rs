//! The outbox and its relay on a real PostgreSQL and RabbitMQ.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/context.rs"]
mod context;
#[path = "common/effects.rs"]
mod effects;
#[path = "common/outbox_rows.rs"]
mod outbox_rows;
#[path = "common/test_db.rs"]
mod test_db;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use context::context;
use redeliver_amqp::lapin::Connection;
use redeliver_core::HandlerError;
use redeliver_postgres::{
    pending, Inbox, Outbox, OutboxMessage, Relay, Tx, OUTBOX_OLDEST_AGE_SECONDS, OUTBOX_PENDING,
};
use redeliver_testkit::recorder::recorder;
use redeliver_testkit::{drain_queue, eventually, Cleanup};
use redeliver_worker::{Context, Handler, Raw};
use sqlx::postgres::PgListener;
use test_db::TestDb;
use tokio_util::sync::CancellationToken;

/// A relay of `db`'s outbox on the test broker.
fn relay(db: &TestDb) -> Relay {
    Relay::new(db.pool.clone(), redeliver_testkit::amqp_url()).schema(db.schema.clone())
}

/// A broker connection and a unique queue (deleted when the guard drops).
async fn broker() -> (Cleanup, Connection, String) {
    let prefix = redeliver_testkit::unique_prefix("rdpg-", 8, "-");
    let cleanup = Cleanup(prefix.clone());
    let conn = redeliver_testkit::connect().await;
    let queue = format!("{prefix}out");
    redeliver_testkit::declare_queue(&conn, &queue).await;
    (cleanup, conn, queue)
}

async fn wait_for(conn: &Connection, queue: &str, n: u32) {
    redeliver_testkit::wait_count(conn, queue, n, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_stores_and_notifies_nothing() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let outbox = Outbox::new(db.schema.clone());
    let mut listener = PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen(&db.schema.notify_channel()).await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .store(&mut tx, &OutboxMessage::new("", "q", b"no".to_vec()))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(db.count("outbox").await, 0);
    let none = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(none.is_err(), "a rolled-back store notified: {none:?}");

    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .store(&mut tx, &OutboxMessage::new("", "q", b"yes".to_vec()))
        .await
        .unwrap();
    // Not before the commit...
    let early = tokio::time::timeout(Duration::from_millis(200), listener.recv()).await;
    assert!(early.is_err(), "notified before the commit");
    tx.commit().await.unwrap();
    // ...but at once after it.
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("no notification after the commit")
        .unwrap();
    assert_eq!(n.channel(), db.schema.notify_channel());
    assert_eq!(db.count("outbox").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_message_is_published_as_stored_then_deleted() {
    let db = TestDb::new().await;
    let (_cleanup, conn, queue) = broker().await;
    let token = CancellationToken::new();
    // A long poll: only the notification can make the relay publish quickly.
    let relay = tokio::spawn(
        relay(&db)
            .poll_interval(Duration::from_secs(60))
            .run(token.clone()),
    );
    // The relay migrates, then listens; rows stored before are found by its first round.
    let deadline = Instant::now() + Duration::from_secs(10);
    while db.schema.verify(&db.pool).await.is_err() {
        assert!(Instant::now() < deadline, "the relay did not migrate");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let rolled_back = OutboxMessage::new("", queue.as_str(), b"never".to_vec());
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::new(db.schema.clone())
        .store(&mut tx, &rolled_back)
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let message = OutboxMessage::new("", queue.as_str(), b"\x00body\xff".to_vec())
        .with_content_type("application/x-test")
        .with_header("tenant", "acme")
        .with_header("trace", "t-1");
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::new(db.schema.clone())
        .store(&mut tx, &message)
        .await
        .unwrap();
    let committed = Instant::now();
    tx.commit().await.unwrap();
    wait_for(&conn, &queue, 1).await;
    assert!(
        committed.elapsed() < Duration::from_secs(10),
        "published by the poll, not the notification"
    );
    let got = drain_queue(&conn, &queue).await;
    assert_eq!(got.len(), 1, "only the committed message");
    let got = &got[0];
    assert_eq!(got.body, message.body);
    assert_eq!(got.message_id(), message.message_id);
    assert_eq!(
        got.properties.content_type().as_ref().map(|s| s.as_str()),
        Some("application/x-test")
    );
    assert_eq!(got.header_str("tenant").as_deref(), Some("acme"));
    assert_eq!(got.header_str("trace").as_deref(), Some("t-1"));
    assert_eq!(got.properties.delivery_mode(), &Some(2));
    let deadline = Instant::now() + Duration::from_secs(10);
    while db.count("outbox").await != 0 {
        assert!(
            Instant::now() < deadline,
            "the published row was not deleted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    token.cancel();
    relay.await.unwrap().expect("relay");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_left_by_a_crash_are_published_when_a_relay_starts() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, queue) = broker().await;
    // Stored and committed while no relay ran (the one that would have published them died).
    let mut ids = BTreeSet::new();
    for i in 0..5 {
        let m = OutboxMessage::new("", queue.as_str(), format!("{i}"));
        ids.insert(m.message_id.clone());
        db.store_committed(&[m]).await;
    }
    let p = pending(&db.pool, &db.schema).await.unwrap();
    assert_eq!(p.count, 5);
    assert!(p.oldest_age.is_some());

    let token = CancellationToken::new();
    let relay = tokio::spawn(relay(&db).run(token.clone()));
    wait_for(&conn, &queue, 5).await;
    token.cancel();
    relay.await.unwrap().expect("relay");
    let got: BTreeSet<String> = drain_queue(&conn, &queue)
        .await
        .iter()
        .map(|g| g.message_id().to_owned())
        .collect();
    assert_eq!(got, ids);
    let p = pending(&db.pool, &db.schema).await.unwrap();
    assert_eq!((p.count, p.oldest_age), (0, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_publish_every_row() {
    const N: usize = 200;
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, queue) = broker().await;
    let messages: Vec<OutboxMessage> = (0..N)
        .map(|i| OutboxMessage::new("", queue.as_str(), format!("{i}")))
        .collect();
    let ids: BTreeSet<String> = messages.iter().map(|m| m.message_id.clone()).collect();
    db.store_committed(&messages).await;
    let token = CancellationToken::new();
    let relays: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(
                relay(&db)
                    .batch_size(20)
                    .poll_interval(Duration::from_millis(100))
                    .run(token.clone()),
            )
        })
        .collect();
    wait_for(&conn, &queue, N as u32).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while db.count("outbox").await != 0 {
        assert!(Instant::now() < deadline, "rows left in the outbox");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing more comes: each row was published once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    token.cancel();
    for r in relays {
        r.await.unwrap().expect("relay");
    }
    let got = drain_queue(&conn, &queue).await;
    assert_eq!(got.len(), N);
    let got: BTreeSet<String> = got.iter().map(|g| g.message_id().to_owned()).collect();
    assert_eq!(got, ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_amqp_cannot_carry_is_refused_when_stored() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    for bad in [
        OutboxMessage::new("", "q".repeat(256), b"x".to_vec()),
        OutboxMessage::new("", "q", b"x".to_vec()).with_header("h".repeat(256), "v"),
        OutboxMessage::new("", "q", b"x".to_vec()).with_message_id("m".repeat(256)),
    ] {
        let e = outbox.store(&mut tx, &bad).await.expect_err("refused");
        assert!(
            matches!(e, redeliver_postgres::Error::InvalidMessage(_)),
            "{e}"
        );
        assert!(e.to_string().contains("at most 255"), "{e}");
    }
    tx.commit().await.unwrap();
    assert_eq!(db.count("outbox").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_names_a_missing_outbox_table() {
    // Nothing migrated this schema: the caller learns which table is missing, not a SQLSTATE.
    let db = TestDb::new().await;
    let err = pending(&db.pool, &db.schema).await.unwrap_err();
    let table = format!("{}.{}", db.schema.name(), db.schema.outbox_table());
    match &err {
        redeliver_postgres::Error::MissingTable { table: t } => assert_eq!(t, &table),
        other => panic!("expected MissingTable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_reports_what_waits_in_its_gauges() {
    let recorded = recorder(); // installed before the relay registers its gauges
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, queue) = broker().await;
    // One the broker cannot route stays in the outbox round after round; one is published.
    db.store_committed(&[
        OutboxMessage::new("", format!("{queue}-missing"), b"stuck".to_vec()),
        OutboxMessage::new("", queue.as_str(), b"sent".to_vec()),
    ])
    .await;
    tokio::time::sleep(Duration::from_millis(1100)).await; // the stuck row ages

    let labels = format!("outbox={}.{}", db.schema.name(), db.schema.outbox_table());
    let token = CancellationToken::new();
    let relay = tokio::spawn(
        relay(&db)
            .poll_interval(Duration::from_millis(100))
            .run(token.clone()),
    );
    wait_for(&conn, &queue, 1).await;
    eventually(Duration::from_secs(10), || {
        recorded.gauge(OUTBOX_PENDING, &labels) == Some(1.0)
    })
    .await;
    let count = recorded.gauge(OUTBOX_PENDING, &labels);
    let age = recorded.gauge(OUTBOX_OLDEST_AGE_SECONDS, &labels);
    token.cancel();
    relay.await.unwrap().expect("relay");
    assert_eq!(count, Some(1.0), "pending gauge: the unroutable row waits");
    let age = age.expect("oldest age gauge");
    assert!((1.0..60.0).contains(&age), "oldest age {age} s");
}

/// A relay that dies after the broker confirmed its publish and before its transaction deleted
/// the row: the row comes back, a later relay publishes it again under the same message id, and
/// the consumer's inbox runs the handler for one of the two copies only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_after_the_confirm_publishes_again_and_the_inbox_runs_once() {
    let db = TestDb::with_effects().await;
    let (_cleanup, conn, queue) = broker().await;
    db.store_committed(&[OutboxMessage::new("", queue.as_str(), b"once".to_vec())])
        .await;
    // The relay's DELETE, which follows the broker's confirm, waits here until it is killed.
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {s}.hold() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_sleep(60); RETURN OLD; END $$;
         CREATE TRIGGER hold BEFORE DELETE ON {s}.outbox FOR EACH ROW EXECUTE FUNCTION {s}.hold();",
        s = db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();

    let token = CancellationToken::new();
    let first = tokio::spawn(relay(&db).run(token.clone()));
    // The relay sends its DELETE only once the broker has confirmed the publish; the trigger
    // holds it there. Waiting for the message in the queue instead would race the confirm: a
    // relay aborted between the two never sends its DELETE at all.
    let deadline = Instant::now() + Duration::from_secs(20);
    let pid = loop {
        let held: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
              WHERE state = 'active' AND query LIKE 'DELETE%' AND query LIKE '%' || $1 || '%'
                AND pid <> pg_backend_pid()",
        )
        .bind(&db.name)
        .fetch_optional(&db.pool)
        .await
        .unwrap();
        if let Some(pid) = held {
            break pid;
        }
        assert!(
            Instant::now() < deadline,
            "the relay never reached its DELETE"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Killed as a crashed process is: its task gone first (so it cannot start another round),
    // then its backend, still in the transaction, terminated.
    first.abort();
    let _ = first.await;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(killed, "the relay's backend {pid} was terminated");
    wait_for(&conn, &queue, 1).await;
    assert_eq!(db.count("outbox").await, 1, "the row survives the relay");

    sqlx::raw_sql(&format!("DROP TRIGGER hold ON {}.outbox", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let second = tokio::spawn(relay(&db).run(token.clone()));
    wait_for(&conn, &queue, 2).await;
    token.cancel();
    second.await.unwrap().expect("relay");
    assert_eq!(db.count("outbox").await, 0);

    let copies = drain_queue(&conn, &queue).await;
    assert_eq!(copies.len(), 2, "published twice: at least once");
    let id = copies[0].message_id();
    assert!(!id.is_empty());
    assert_eq!(copies[1].message_id(), id, "one message id for both copies");
    let table = db.effects();
    let inbox = Inbox::new(db.pool.clone(), "relay-killed")
        .schema(db.schema.clone())
        .handler_fn(move |m: Raw, ctx: Context, mut tx: Tx| {
            let table = table.clone();
            async move {
                sqlx::query(&format!("INSERT INTO {table} (key, note) VALUES ($1, $2)"))
                    .bind(ctx.message_id())
                    .bind(String::from_utf8_lossy(&m))
                    .execute(&mut *tx)
                    .await
                    .map_err(HandlerError::transient)?;
                Ok(tx)
            }
        });
    for copy in &copies {
        inbox
            .handle(Raw(copy.body.clone()), context(Some(id), &[]))
            .await
            .expect("handled");
    }
    assert_eq!(
        db.count("effects").await,
        1,
        "one effect for the two copies"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storing_before_the_schema_is_prepared_says_what_to_call() {
    let db = TestDb::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    let err = Outbox::new(db.schema.clone())
        .store(&mut tx, &OutboxMessage::new("", "q", b"x".to_vec()))
        .await
        .expect_err("no table yet");
    assert!(
        matches!(err, redeliver_postgres::Error::MissingTable { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("Schema::prepare"), "{err}");
}

/// An inbox whose schema's outbox holds rows nobody ever tried to publish (its relay runs on
/// another schema, or not at all) says so when it is prepared.
// One thread: the subscriber set for this test sees everything logged while it runs.
#[tokio::test(flavor = "current_thread")]
async fn an_inbox_warns_when_its_outbox_is_not_relayed() {
    let (captured, _guard) = redeliver_testkit::logs::capture(tracing::Level::WARN);
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    // Fresh rows are no sign of anything: no warning.
    db.store_committed(&[OutboxMessage::new("", "q", b"new".to_vec())])
        .await;
    Inbox::new(db.pool.clone(), "fresh")
        .schema(db.schema.clone())
        .prepare()
        .await
        .unwrap();
    assert!(captured.text().is_empty());
    sqlx::query(&format!(
        "UPDATE {}.outbox SET created_at = now() - interval '5 minutes'",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    Inbox::new(db.pool.clone(), "stale")
        .schema(db.schema.clone())
        .prepare()
        .await
        .unwrap();
    let log = captured.text();
    assert!(
        log.contains("is a Relay running") && log.contains(&db.name),
        "{log}"
    );
}
