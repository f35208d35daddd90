//! Two delay configurations on one prefix: the same settings declare again and again, other
//! levels, granularity or level queue type are refused before anything changes, and delay levels
//! declared by an earlier version (which recorded no settings) keep working.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use redeliver_amqp::lapin::Connection;
use redeliver_amqp::{passive_exchange, DelayConfig, QueueType, Topology, TopologyError};

fn cfg(prefix: &str) -> DelayConfig {
    DelayConfig::new().prefix(prefix).levels(4)
}

async fn exchange_exists(conn: &Connection, name: &str) -> bool {
    let ch = conn.create_channel().await.unwrap();
    let exists = passive_exchange(&ch, name)
        .await
        .unwrap_or_else(|e| panic!("passive declare of exchange {name}: {e}"));
    if exists {
        let _ = ch.close(200, "ok".into()).await;
    }
    exists
}

/// The error must name the existing and the requested settings.
fn assert_mismatch(err: TopologyError, existing: &str, requested: &str) {
    let text = err.to_string();
    println!("{text}");
    match &err {
        TopologyError::DelaySettingsMismatch {
            existing: e,
            requested: r,
            ..
        } => {
            assert!(
                e.contains(existing),
                "existing {e:?} should contain {existing:?}"
            );
            assert_eq!(r, requested);
        }
        other => panic!("expected DelaySettingsMismatch, got {other:?}"),
    }
    assert!(
        text.contains(existing) && text.contains(requested),
        "{text}"
    );
}

#[tokio::test]
async fn other_settings_on_one_prefix_are_refused() {
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    let p = common::prefix();
    let _cleanup = redeliver_testkit::Cleanup(p.clone());
    let first = cfg(&p);
    first.declare(&conn).await.expect("first declare");
    first.declare(&conn).await.expect("the same settings again");
    Topology::new("q")
        .prefix(&p)
        .delay(cfg(&p))
        .declare(&conn)
        .await
        .expect("a topology with the same settings");
    let recorded = "levels=4 granularity=10ms queue-type=quorum";
    assert_eq!(first.settings(), recorded);

    let more = cfg(&p).levels(5);
    assert_mismatch(
        more.declare(&conn).await.expect_err("other levels"),
        recorded,
        "levels=5 granularity=10ms queue-type=quorum",
    );
    assert!(
        !redeliver_testkit::queue_exists(&conn, &more.level_name(4)).await,
        "RabbitMQ {version}: nothing declared after the refusal"
    );
    assert_mismatch(
        cfg(&p)
            .levels(3)
            .declare(&conn)
            .await
            .expect_err("fewer levels"),
        recorded,
        "levels=3 granularity=10ms queue-type=quorum",
    );
    assert_mismatch(
        cfg(&p)
            .granularity(Duration::from_millis(20))
            .declare(&conn)
            .await
            .expect_err("other granularity"),
        recorded,
        "levels=4 granularity=20ms queue-type=quorum",
    );
    assert_mismatch(
        cfg(&p)
            .queue_type(QueueType::Classic)
            .declare(&conn)
            .await
            .expect_err("other queue type"),
        recorded,
        "levels=4 granularity=10ms queue-type=classic",
    );
    // Through a topology, as a worker declares.
    let err = Topology::new("r")
        .prefix(&p)
        .delay(cfg(&p).levels(6))
        .declare(&conn)
        .await
        .expect_err("a topology with other levels");
    assert_mismatch(err, recorded, "levels=6 granularity=10ms queue-type=quorum");
    first
        .declare(&conn)
        .await
        .expect("still fine for the first");
    first.delete(&conn).await.expect("delete");
    assert!(!exchange_exists(&conn, &first.settings_name()).await);
}

/// Delay levels of an earlier version: the same objects without the settings exchange.
async fn earlier_version(conn: &Connection, c: &DelayConfig) {
    c.declare(conn).await.expect("declare");
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_delete(c.settings_name().as_str().into(), Default::default())
        .await
        .unwrap();
    assert!(!exchange_exists(conn, &c.settings_name()).await);
}

#[tokio::test]
async fn delay_levels_of_an_earlier_version_keep_working() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let _cleanup = redeliver_testkit::Cleanup(p.clone());
    let c = cfg(&p);
    earlier_version(&conn, &c).await;

    // Other settings are refused, as far as the broker can tell, and nothing is recorded.
    assert_mismatch(
        cfg(&p)
            .levels(5)
            .declare(&conn)
            .await
            .expect_err("more levels"),
        "levels=4",
        "levels=5 granularity=10ms queue-type=quorum",
    );
    assert_mismatch(
        cfg(&p)
            .levels(3)
            .declare(&conn)
            .await
            .expect_err("fewer levels"),
        "levels=4",
        "levels=3 granularity=10ms queue-type=quorum",
    );
    assert_mismatch(
        cfg(&p)
            .granularity(Duration::from_millis(20))
            .declare(&conn)
            .await
            .expect_err("other granularity"),
        "granularity=10ms, from x-message-ttl = 10",
        "levels=4 granularity=20ms queue-type=quorum",
    );
    assert!(
        !exchange_exists(&conn, &c.settings_name()).await,
        "a refused declare records nothing"
    );

    // The same settings: works, and records them from now on.
    c.declare(&conn)
        .await
        .expect("the upgraded deployment starts");
    assert!(exchange_exists(&conn, &c.settings_name()).await);
    c.declare(&conn).await.expect("and again");
    assert_mismatch(
        cfg(&p)
            .levels(5)
            .declare(&conn)
            .await
            .expect_err("recorded now"),
        "levels=4 granularity=10ms queue-type=quorum",
        "levels=5 granularity=10ms queue-type=quorum",
    );
}
