//! Declare / verify / mismatch against the real broker.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use redeliver_amqp::lapin::options::QueueDeclareOptions;
use redeliver_amqp::lapin::types::FieldTable;
use redeliver_amqp::{DelayConfig, Topology, TopologyError};
use std::time::Instant;

/// Small delay infrastructure: these tests are about declaring, not delaying.
fn topo(prefix: &str, queue: &str) -> Topology {
    Topology::new(queue)
        .prefix(prefix)
        .delay(DelayConfig::new().prefix(prefix).levels(4))
}

#[tokio::test]
async fn declare_twice_is_a_no_op() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = Topology::new("orders").prefix(&p); // default 24 levels
    with_cleanup_topo(&conn, &t, async {
        let start = Instant::now();
        t.declare(&conn).await.expect("first declare");
        println!("first declare (24 quorum levels): {:?}", start.elapsed());
        let start = Instant::now();
        t.declare(&conn).await.expect("second declare");
        println!("second declare: {:?}", start.elapsed());
        t.verify(&conn).await.expect("verify after declare");
        t.configured_delay()
            .verify(&conn)
            .await
            .expect("verify delay");
    })
    .await;
}

#[tokio::test]
async fn mismatch_is_typed_and_callers_channel_survives() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = topo(&p, "q");
    let user_channel = conn.create_channel().await.unwrap();
    with_cleanup_topo(&conn, &t, async {
        // Someone created the queue before, without our arguments.
        user_channel
            .queue_declare(
                t.queue_name().as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();

        let err = t.declare(&conn).await.expect_err("must mismatch");
        println!("{err}");
        match &err {
            TopologyError::Mismatch {
                object,
                argument,
                requested,
                broker_message,
            } => {
                assert_eq!(object, &format!("queue '{}'", t.queue_name()));
                assert!(
                    argument.as_deref().is_some_and(|a| a.starts_with("x-")),
                    "{argument:?}"
                );
                assert!(requested.contains("x-dead-letter-exchange"), "{requested}");
                assert!(
                    broker_message.contains("PRECONDITION_FAILED"),
                    "{broker_message}"
                );
            }
            other => panic!("expected Mismatch, got {other:?}"),
        }

        // The caller's channel and the connection are untouched by the 406.
        assert!(user_channel.status().connected());
        redeliver_amqp::passive_queue(&user_channel, &t.queue_name())
            .await
            .expect("original channel still usable")
            .expect("the queue exists");
        assert!(conn.status().connected());
    })
    .await;
}

#[tokio::test]
async fn mismatch_names_the_differing_argument() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = topo(&p, "q");
    with_cleanup_topo(&conn, &t, async {
        t.declare(&conn).await.unwrap();
        let other = t.clone().delivery_limit(Some(5));
        match other.declare(&conn).await {
            Err(TopologyError::Mismatch {
                object, argument, ..
            }) => {
                assert_eq!(object, format!("queue '{}'", t.queue_name()));
                assert_eq!(argument.as_deref(), Some("x-delivery-limit"));
            }
            other => panic!("expected Mismatch, got {other:?}"),
        }
        // Delay levels with another granularity are refused too, by their recorded settings.
        let delay = t
            .configured_delay()
            .clone()
            .granularity(std::time::Duration::from_millis(20));
        match delay.declare(&conn).await {
            Err(TopologyError::DelaySettingsMismatch {
                existing,
                requested,
                ..
            }) => {
                assert_eq!(existing, "levels=4 granularity=10ms queue-type=quorum");
                assert_eq!(requested, "levels=4 granularity=20ms queue-type=quorum");
            }
            other => panic!("expected DelaySettingsMismatch, got {other:?}"),
        }
        // And the original declaration is still fine.
        t.declare(&conn).await.expect("redeclare as before");
    })
    .await;
}

#[tokio::test]
async fn verify_is_passive() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = topo(&p, "v");
    with_cleanup_topo(&conn, &t, async {
        match t.verify(&conn).await {
            Err(TopologyError::Missing { object }) => {
                assert!(object.contains("redeliver.delay.unroutable"), "{object}")
            }
            other => panic!("expected Missing, got {other:?}"),
        }
        t.configured_delay().declare(&conn).await.unwrap();
        match t.verify(&conn).await {
            Err(TopologyError::Missing { object }) => {
                assert_eq!(object, format!("exchange '{}'", t.dlx_name()))
            }
            other => panic!("expected Missing, got {other:?}"),
        }
        t.declare(&conn).await.unwrap();
        t.verify(&conn).await.unwrap();
        t.delete(&conn).await.unwrap();
        assert!(matches!(
            t.verify(&conn).await,
            Err(TopologyError::Missing { .. })
        ));
        t.delete(&conn).await.expect("deleting twice is fine");
    })
    .await;
}

#[tokio::test]
async fn binding_to_missing_user_exchange_is_missing() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let exchange = format!("{p}no-such-exchange");
    let t = topo(&p, "b").bind(&exchange, "k");
    with_cleanup_topo(&conn, &t, async {
        match t.declare(&conn).await {
            Err(TopologyError::Missing { object }) => {
                assert_eq!(object, format!("exchange '{exchange}'"))
            }
            other => panic!("expected Missing, got {other:?}"),
        }
    })
    .await;
}

#[tokio::test]
async fn invalid_names_are_refused_before_the_broker() {
    let conn = redeliver_testkit::connect().await;
    for q in ["a.*", "a..b", ".a", "#"] {
        assert!(
            matches!(
                Topology::new(q).declare(&conn).await,
                Err(TopologyError::InvalidName(_))
            ),
            "{q}"
        );
    }
}

async fn with_cleanup_topo(
    conn: &redeliver_amqp::lapin::Connection,
    t: &Topology,
    body: impl std::future::Future<Output = ()>,
) {
    redeliver_testkit::with_cleanup(body, async {
        t.delete(conn).await.expect("delete topology");
        t.configured_delay()
            .delete(conn)
            .await
            .expect("delete delay");
    })
    .await;
}
