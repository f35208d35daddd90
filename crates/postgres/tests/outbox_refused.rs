//! Rows the broker refuses (issue 37): retried with backoff, then parked, never a wall in front
//! of the rows behind them; a row that closes the publishing channel costs the others nothing.
//! Real PostgreSQL and RabbitMQ.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/outbox_rows.rs"]
mod outbox_rows;
#[path = "common/test_db.rs"]
mod test_db;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use redeliver_amqp::lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
use redeliver_amqp::lapin::types::FieldTable;
use redeliver_amqp::lapin::{Connection, ExchangeKind};
use redeliver_core::{Jitter, RetryPolicy};
use redeliver_postgres::{
    pending, Error, OutboxMessage, ParkedFilter, ParkedRows, Relay, RelayState, OUTBOX_PARKED,
    OUTBOX_PARKED_TOTAL,
};
use redeliver_testkit::recorder::recorder;
use redeliver_testkit::{declare_queue, drain_queue, Cleanup};
use sqlx::Row;
use test_db::TestDb;
use tokio_util::sync::CancellationToken;

/// A broker connection and a unique prefix (everything under it deleted when the guard drops).
async fn broker() -> (Cleanup, Connection, String) {
    let prefix = redeliver_testkit::unique_prefix("rdpgr-", 8, "-");
    let conn = redeliver_testkit::connect().await;
    (Cleanup(prefix.clone()), conn, prefix)
}

/// A relay of `db`'s outbox on the test broker, polling every 100 ms.
fn relay(db: &TestDb) -> Relay {
    Relay::new(db.pool.clone(), redeliver_testkit::amqp_url())
        .schema(db.schema.clone())
        .poll_interval(Duration::from_millis(100))
}

/// A policy whose first retry is a minute away: a refused row is tried once in a test.
fn once() -> RetryPolicy {
    RetryPolicy::exponential(Duration::from_secs(60)).jitter(Jitter::None)
}

/// `n` messages to `queue`, each with a body naming it.
fn good(queue: &str, n: usize) -> Vec<OutboxMessage> {
    (0..n)
        .map(|i| OutboxMessage::new("", queue, format!("good {i}")))
        .collect()
}

/// The state columns of every row left in the outbox, by message id.
async fn rows(db: &TestDb) -> BTreeMap<String, (i32, Option<String>, bool, Option<String>)> {
    sqlx::query(&format!(
        "SELECT message_id, attempts, last_error, next_attempt_at > now() AS later, parked_reason
           FROM {}.outbox",
        db.name
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .iter()
    .map(|r| {
        (
            r.get::<String, _>(0),
            (
                r.get::<i32, _>(1),
                r.get::<Option<String>, _>(2),
                r.get::<Option<bool>, _>(3).unwrap_or(false),
                r.get::<Option<String>, _>(4),
            ),
        )
    })
    .collect()
}

/// Waits until the queue holds `n` ready messages, then drains them; returns their message ids
/// with how often each came.
async fn receive(conn: &Connection, queue: &str, n: u32) -> BTreeMap<String, usize> {
    redeliver_testkit::wait_count(conn, queue, n, Duration::from_secs(60)).await;
    let mut ids = BTreeMap::new();
    for got in drain_queue(conn, queue).await {
        *ids.entry(got.message_id().to_owned()).or_insert(0) += 1;
    }
    ids
}

async fn until(what: &str, within: Duration, mut check: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < within, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The first reproduction of issue 37: a whole batch of unroutable rows, plus one, in front of
/// good ones. They used to be taken again round after round, without pause, and the good rows
/// behind them never went out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_rows_filling_a_batch_do_not_stop_the_rows_behind_them() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, prefix) = broker().await;
    let queue = format!("{prefix}out");
    declare_queue(&conn, &queue).await;
    let bad: Vec<OutboxMessage> = (0..21)
        .map(|i| OutboxMessage::new("", format!("{prefix}nobody"), format!("bad {i}")))
        .collect();
    let good = good(&queue, 5);
    db.store_committed(&bad).await;
    db.store_committed(&good).await;

    let token = CancellationToken::new();
    let run = tokio::spawn(relay(&db).batch_size(20).policy(once()).run(token.clone()));
    let got = receive(&conn, &queue, 5).await;
    let want: BTreeMap<String, usize> = good.iter().map(|m| (m.message_id.clone(), 1)).collect();
    assert_eq!(got, want, "each good row once");
    // No hot loop: each refused row was tried once, and waits its backoff.
    tokio::time::sleep(Duration::from_millis(500)).await;
    token.cancel();
    run.await.unwrap().expect("relay");
    let left = rows(&db).await;
    assert_eq!(left.len(), 21, "the refused rows stay: {left:?}");
    for (id, (attempts, error, later, parked)) in &left {
        assert_eq!(*attempts, 1, "{id} tried once");
        assert!(*later, "{id} waits for its next attempt");
        assert_eq!(parked, &None);
        let error = error.as_deref().unwrap_or_default();
        assert!(
            error.contains("unroutable") && error.contains("312"),
            "{error}"
        );
    }
    let p = pending(&db.pool, &db.schema).await.unwrap();
    assert_eq!((p.count, p.retrying, p.parked), (21, 21, 0));
}

/// The second reproduction: one row for an exchange that does not exist. Its 404 used to close
/// the relay's channel, and every restarted relay stopped at the same row. The relay now checks
/// the exchange first, so its connection and channels stay up; once the exchange exists the
/// row goes out at its next attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_for_a_missing_exchange_costs_the_others_nothing_and_goes_out_once_it_exists() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, prefix) = broker().await;
    let queue = format!("{prefix}out");
    declare_queue(&conn, &queue).await;
    let exchange = format!("{prefix}x");
    let late = OutboxMessage::new(exchange.as_str(), "late", b"late".to_vec());
    db.store_committed(std::slice::from_ref(&late)).await;
    let good = good(&queue, 5);
    db.store_committed(&good).await;

    let token = CancellationToken::new();
    let relay = relay(&db).policy(
        RetryPolicy::exponential(Duration::from_millis(300))
            .jitter(Jitter::None)
            .max_retries(50),
    );
    let mut status = relay.status_handle();
    let run = tokio::spawn(relay.run(token.clone()));
    let got = receive(&conn, &queue, 5).await;
    assert_eq!(got.len(), 5, "{got:?}");
    until(
        "the missing exchange recorded",
        Duration::from_secs(10),
        async || {
            rows(&db)
                .await
                .get(&late.message_id)
                .is_some_and(|(a, e, _, _)| {
                    *a >= 1 && e.as_deref().is_some_and(|e| e.contains("does not exist"))
                })
        },
    )
    .await;
    assert_eq!(status.state(), RelayState::Relaying, "never reconnected");
    assert!(status.is_ready());

    // The exchange appears: the row goes out at its next attempt.
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "late".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let got = receive(&conn, &queue, 1).await;
    assert_eq!(got, BTreeMap::from([(late.message_id.clone(), 1)]));
    until("the outbox empty", Duration::from_secs(10), async || {
        db.count("outbox").await == 0
    })
    .await;
    assert!(status
        .wait_for_timeout(Duration::from_millis(10), |s| *s == RelayState::Relaying)
        .await
        .is_some());
    token.cancel();
    run.await.unwrap().expect("relay");
    assert_eq!(status.state(), RelayState::Stopped);
}

/// A row whose publish the broker answers by closing the channel although its exchange exists
/// (an internal exchange: 403 ACCESS_REFUSED). The round it was in costs no row an attempt;
/// its rows go out one at a time next, which finds the one refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_closes_the_channel_is_found_and_the_others_go_out() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, prefix) = broker().await;
    let queue = format!("{prefix}out");
    declare_queue(&conn, &queue).await;
    let internal = format!("{prefix}internal");
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        internal.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            internal: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let forbidden = OutboxMessage::new(internal.as_str(), "k", b"forbidden".to_vec());
    let mut messages = good(&queue, 10);
    messages.insert(5, forbidden.clone());
    db.store_committed(&messages).await;

    let token = CancellationToken::new();
    let run = tokio::spawn(relay(&db).policy(once()).run(token.clone()));
    until(
        "the forbidden row recorded",
        Duration::from_secs(20),
        async || {
            db.count("outbox").await == 1
                && rows(&db)
                    .await
                    .get(&forbidden.message_id)
                    .is_some_and(|(a, _, later, _)| *a == 1 && *later)
        },
    )
    .await;
    // Publishes whose confirm the closed channel took with it may have reached the queue: they
    // go out again (at least once), with their message ids, at most once more.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut got = BTreeMap::new();
    for m in drain_queue(&conn, &queue).await {
        *got.entry(m.message_id().to_owned()).or_insert(0) += 1;
    }
    let want: BTreeSet<&String> = messages
        .iter()
        .filter(|m| m.message_id != forbidden.message_id)
        .map(|m| &m.message_id)
        .collect();
    assert_eq!(got.keys().collect::<BTreeSet<_>>(), want);
    assert!(got.values().all(|n| (1..=2).contains(n)), "{got:?}");
    let left = rows(&db).await;
    let error = left[&forbidden.message_id].1.clone().unwrap_or_default();
    assert!(error.contains("closed the publishing channel"), "{error}");
    token.cancel();
    run.await.unwrap().expect("relay");
}

/// After the policy's last retry a row is parked, with its reason and error, counted in the
/// gauges; replayed, it is published once the broker takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_refused_to_the_end_is_parked_and_a_replay_publishes_it() {
    let recorded = recorder();
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, prefix) = broker().await;
    let queue = format!("{prefix}later");
    let stuck = OutboxMessage::new("", queue.as_str(), b"stuck".to_vec());
    db.store_committed(std::slice::from_ref(&stuck)).await;

    let token = CancellationToken::new();
    let run = tokio::spawn(
        relay(&db)
            .policy(
                RetryPolicy::exponential(Duration::from_millis(100))
                    .jitter(Jitter::None)
                    .max_retries(2),
            )
            .run(token.clone()),
    );
    let parked = ParkedRows::new(db.pool.clone(), db.schema.clone());
    until("the row parked", Duration::from_secs(20), async || {
        parked.stats(&ParkedFilter::default()).await.unwrap().count == 1
    })
    .await;
    let label = format!("outbox={}.outbox", db.name);
    until("the parked gauge", Duration::from_secs(10), async || {
        recorded.gauge(OUTBOX_PARKED, &label) == Some(1.0)
    })
    .await;
    assert_eq!(
        recorded.counter(
            OUTBOX_PARKED_TOTAL,
            &format!("{label},reason=retries_exhausted")
        ),
        1
    );
    let row = parked
        .list(&ParkedFilter::default(), 10)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(row.message().unwrap(), stuck);
    assert_eq!(row.attempts, 3, "the first publish and 2 retries");
    assert_eq!(row.reason, "retries_exhausted");
    assert!(row.last_error.unwrap().contains("unroutable"));
    let p = pending(&db.pool, &db.schema).await.unwrap();
    assert_eq!((p.count, p.parked), (0, 1));
    assert!(p.oldest_parked_age.is_some());
    // Parked stays parked: no more attempts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(rows(&db).await[&stuck.message_id].0, 3);

    // The queue exists now: an operator replays.
    declare_queue(&conn, &queue).await;
    let filter = ParkedFilter {
        message_ids: vec![stuck.message_id.clone()],
        ..Default::default()
    };
    assert_eq!(parked.replay(&filter).await.unwrap(), 1);
    let got = receive(&conn, &queue, 1).await;
    assert_eq!(got, BTreeMap::from([(stuck.message_id.clone(), 1)]));
    until("the outbox empty", Duration::from_secs(10), async || {
        db.count("outbox").await == 0
    })
    .await;
    token.cancel();
    run.await.unwrap().expect("relay");
}

/// Rows that can never be published as they are (written by something else than
/// `Outbox::store`, or over the broker's size limit) are parked at once with a reason, and the
/// relay goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_can_never_be_published_are_parked_at_once() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, prefix) = broker().await;
    let queue = format!("{prefix}out");
    declare_queue(&conn, &queue).await;
    let long = "k".repeat(300);
    sqlx::raw_sql(&format!(
        "INSERT INTO {s}.outbox (message_id, exchange, routing_key, body, headers) VALUES
           ('not-strings', '', '{queue}', 'x', '{{\"n\": 1}}'),
           ('an-array', '', '{queue}', 'x', '[1, 2]'),
           ('nested', '', '{queue}', 'x', '{{\"a\": {{\"b\": [[[[[]]]]]}}}}'),
           ('long-key', '', '{long}', 'x', NULL),
           ('{long}', '', '{queue}', 'x', NULL),
           ('too-large', '', '{queue}', repeat('z', 5000)::bytea, NULL)",
        s = db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let good = good(&queue, 3);
    db.store_committed(&good).await;

    let token = CancellationToken::new();
    let run = tokio::spawn(relay(&db).max_message_size(4096).run(token.clone()));
    let got = receive(&conn, &queue, 3).await;
    assert_eq!(got.len(), 3, "only the good rows: {got:?}");
    let parked = ParkedRows::new(db.pool.clone(), db.schema.clone());
    until("all parked", Duration::from_secs(10), async || {
        parked.stats(&ParkedFilter::default()).await.unwrap().count == 6
    })
    .await;
    token.cancel();
    run.await.unwrap().expect("relay");
    let reasons: BTreeMap<String, String> = parked
        .list(&ParkedFilter::default(), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.message_id.chars().take(20).collect(), r.reason))
        .collect();
    let want: BTreeMap<String, String> = [
        ("not-strings", "unreadable"),
        ("an-array", "unreadable"),
        ("nested", "unreadable"),
        ("long-key", "permanent"),
        ("kkkkkkkkkkkkkkkkkkkk", "permanent"),
        ("too-large", "permanent"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b.to_owned()))
    .collect();
    assert_eq!(reasons, want);
    let stats = parked.stats(&ParkedFilter::default()).await.unwrap();
    assert_eq!(stats.count, 6);
    let too_large = parked
        .list(
            &ParkedFilter {
                message_ids: vec!["too-large".into()],
                ..Default::default()
            },
            1,
        )
        .await
        .unwrap();
    assert!(
        too_large[0]
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("exceeds")),
        "{too_large:?}"
    );
    // Purged, they are gone; nothing else is.
    let purged = parked
        .purge(&ParkedFilter {
            reason: Some("unreadable".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(purged, 3);
    assert_eq!(db.count("outbox").await, 3);
}

/// One bad row among 10,000 good ones: every good one is published exactly once (no fault, so
/// no duplicate), the bad one waits for its next attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_row_among_ten_thousand_good_ones() {
    const N: usize = 10_000;
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, prefix) = broker().await;
    let queue = format!("{prefix}out");
    declare_queue(&conn, &queue).await;
    let mut messages = good(&queue, N);
    let bad = OutboxMessage::new("", format!("{prefix}nobody"), b"bad".to_vec());
    messages.insert(N / 2, bad.clone());
    db.store_committed(&messages).await;

    let token = CancellationToken::new();
    let run = tokio::spawn(relay(&db).policy(once()).run(token.clone()));
    let got = receive(&conn, &queue, N as u32).await;
    let want: BTreeSet<&String> = messages
        .iter()
        .filter(|m| m.message_id != bad.message_id)
        .map(|m| &m.message_id)
        .collect();
    assert_eq!(got.keys().collect::<BTreeSet<_>>(), want);
    assert!(got.values().all(|n| *n == 1), "a duplicate without a fault");
    until(
        "only the bad row left",
        Duration::from_secs(10),
        async || db.count("outbox").await == 1,
    )
    .await;
    token.cancel();
    run.await.unwrap().expect("relay");
    let left = rows(&db).await;
    assert_eq!(left[&bad.message_id].0, 1);
}

/// `run` ends on what waiting cannot fix (a URL that is not one), and waits out a broker that
/// does not answer, not ready, until cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_url_ends_the_relay_and_an_unreachable_broker_does_not() {
    let db = TestDb::new().await;
    let err = Relay::new(db.pool.clone(), "http://127.0.0.1:5672/")
        .schema(db.schema.clone())
        .run(CancellationToken::new())
        .await
        .expect_err("not an AMQP URL");
    assert!(matches!(err, Error::Broker(_)), "{err:?}");

    // Nothing listens on port 9 (discard) here: connecting is refused at once, again and again.
    let relay =
        Relay::new(db.pool.clone(), "amqp://guest:guest@127.0.0.1:9/%2f").schema(db.schema.clone());
    let mut status = relay.status_handle();
    let token = CancellationToken::new();
    let run = tokio::spawn(relay.run(token.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !run.is_finished(),
        "the relay gave up on an unreachable broker"
    );
    assert!(!status.is_ready());
    assert_eq!(status.state(), RelayState::Connecting);
    token.cancel();
    run.await.unwrap().expect("cancelled: Ok");
    assert!(status
        .wait_for_timeout(Duration::from_secs(1), |s| *s == RelayState::Stopped)
        .await
        .is_some());
}

/// The relay connects over TLS (amqps://, the test CA) as the worker does, and publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_over_tls() {
    use redeliver_amqp::TlsConfig;
    use redeliver_testkit::{amqps_url, tls_broker, tls_file, TlsCleanup};

    let broker = tls_broker();
    let prefix = redeliver_testkit::unique_prefix("rdpgt-", 8, "-");
    let _cleanup = TlsCleanup(prefix.clone());
    let conn = redeliver_testkit::connect_to(&broker.amqp_url).await;
    let queue = format!("{prefix}out");
    declare_queue(&conn, &queue).await;
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let messages = good(&queue, 3);
    db.store_committed(&messages).await;

    let token = CancellationToken::new();
    let relay = Relay::new(db.pool.clone(), amqps_url())
        .tls(TlsConfig::new().ca_file(tls_file("ca.pem")))
        .schema(db.schema.clone())
        .poll_interval(Duration::from_millis(100));
    let status = relay.status_handle();
    let run = tokio::spawn(relay.run(token.clone()));
    let got = receive(&conn, &queue, 3).await;
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(status.is_ready());
    token.cancel();
    run.await.unwrap().expect("relay");
}

/// A first URL that refuses connections is passed over for the next of the failover list, as
/// the worker does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_fails_over_to_the_next_url() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.unwrap();
    let (_cleanup, conn, prefix) = broker().await;
    let queue = format!("{prefix}out");
    declare_queue(&conn, &queue).await;
    let messages = good(&queue, 3);
    db.store_committed(&messages).await;

    let token = CancellationToken::new();
    // Nothing listens on port 9 here: refused at once.
    let run = tokio::spawn(
        Relay::new(db.pool.clone(), "amqp://guest:guest@127.0.0.1:9/%2f")
            .failover_urls([redeliver_testkit::amqp_url()])
            .schema(db.schema.clone())
            .poll_interval(Duration::from_millis(100))
            .run(token.clone()),
    );
    let got = receive(&conn, &queue, 3).await;
    assert_eq!(got.len(), 3, "{got:?}");
    token.cancel();
    run.await.unwrap().expect("relay");
}
