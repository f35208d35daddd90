//! Deleting a topology with its delay infrastructure against the real broker: delay queues
//! that hold messages are kept unless discarded, and nothing else goes either; passive
//! declares of missing and impossible names. (`redeliver topology delete --include-delay`
//! runs the same code end to end, with publishers racing it: crates/cli/tests/topology_delete.rs.)

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use redeliver_amqp::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use redeliver_amqp::lapin::{BasicProperties, Connection};
use redeliver_amqp::{
    passive_exchange, passive_queue, DelayConfig, HeldMessages, QueueMessages, Topology,
    TopologyError,
};
use redeliver_testkit::{queue_exists, ready_count, wait_count};

/// Few levels with a long tick, so a message put in a level queue stays there for the test.
fn topo(prefix: &str, queue: &str) -> Topology {
    Topology::new(queue).prefix(prefix).delay(
        DelayConfig::new()
            .prefix(prefix)
            .levels(4)
            .granularity(Duration::from_secs(600)),
    )
}

/// Publishes `n` messages straight into `queue` (default exchange), confirmed.
async fn put(conn: &Connection, queue: &str, n: u32) {
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    for _ in 0..n {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                b"{}",
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "{queue}: {confirm:?}");
    }
    let _ = ch.close(200, "ok".into()).await;
}

async fn exchange_exists(conn: &Connection, name: &str) -> bool {
    let ch = conn.create_channel().await.expect("channel");
    passive_exchange(&ch, name)
        .await
        .unwrap_or_else(|e| panic!("passive declare of exchange {name}: {e}"))
}

/// Every delay exchange (the settings exchange included) and queue: whether it exists.
async fn delay_objects(conn: &Connection, cfg: &DelayConfig) -> Vec<(String, bool)> {
    let mut v = Vec::new();
    for k in 0..cfg.configured_levels() {
        let name = cfg.level_name(k);
        v.push((
            format!("exchange {name}"),
            exchange_exists(conn, &name).await,
        ));
        v.push((format!("queue {name}"), queue_exists(conn, &name).await));
    }
    for e in [
        cfg.deliver_exchange(),
        cfg.unroutable_name(),
        cfg.settings_name(),
    ] {
        v.push((format!("exchange {e}"), exchange_exists(conn, &e).await));
    }
    let parking = cfg.unroutable_name();
    v.push((
        format!("queue {parking}"),
        queue_exists(conn, &parking).await,
    ));
    v
}

async fn with_cleanup_topo(
    conn: &Connection,
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

#[tokio::test]
async fn refused_while_delay_queues_hold_messages_then_discarded() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = topo(&p, "keep");
    let cfg = t.configured_delay().clone();
    with_cleanup_topo(&conn, &t, async {
        t.declare(&conn).await.expect("declare");
        // Other services' retries waiting in level 2, one parked message, one in Q.
        put(&conn, &cfg.level_name(2), 2).await;
        put(&conn, &cfg.unroutable_name(), 1).await;
        put(&conn, &t.queue_name(), 1).await;
        wait_count(&conn, &cfg.level_name(2), 2, Duration::from_secs(5)).await;
        wait_count(&conn, &cfg.unroutable_name(), 1, Duration::from_secs(5)).await;

        let held = vec![
            QueueMessages {
                queue: cfg.level_name(2),
                messages: 2,
            },
            QueueMessages {
                queue: cfg.unroutable_name(),
                messages: 1,
            },
        ];
        let err = t
            .delete_with_delay(&conn, HeldMessages::Refuse)
            .await
            .expect_err("refused");
        println!("{err}");
        match &err {
            TopologyError::DelayNotEmpty {
                prefix,
                non_empty,
                already_deleted,
            } => {
                assert_eq!(prefix, &p);
                assert_eq!(non_empty, &held);
                assert!(already_deleted.is_empty(), "{already_deleted:?}");
            }
            other => panic!("expected DelayNotEmpty, got {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains("(2 message(s))"), "{text}");
        assert!(text.contains("nothing was deleted"), "{text}");
        // Nothing went: Q's objects, every delay object, every message.
        t.verify(&conn).await.expect("the topology is in place");
        assert!(
            delay_objects(&conn, &cfg).await.iter().all(|(_, e)| *e),
            "{:?}",
            delay_objects(&conn, &cfg).await
        );
        assert_eq!(ready_count(&conn, &cfg.level_name(2)).await, 2);
        assert_eq!(ready_count(&conn, &cfg.unroutable_name()).await, 1);
        assert_eq!(ready_count(&conn, &t.queue_name()).await, 1);

        // Discarded: everything goes, and the report names what held messages.
        let discarded = t
            .delete_with_delay(&conn, HeldMessages::Discard)
            .await
            .expect("discard");
        assert_eq!(discarded, held);
        let left = delay_objects(&conn, &cfg).await;
        assert!(left.iter().all(|(_, e)| !*e), "{left:?}");
        for q in [t.queue_name(), t.dlq_name()] {
            assert!(!queue_exists(&conn, &q).await, "{q}");
        }
        assert!(!exchange_exists(&conn, &t.dlx_name()).await);
    })
    .await;
}

#[tokio::test]
async fn empty_delay_infrastructure_is_deleted_and_deleting_again_is_fine() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = topo(&p, "empty");
    let cfg = t.configured_delay().clone();
    with_cleanup_topo(&conn, &t, async {
        t.declare(&conn).await.expect("declare");
        let discarded = t
            .delete_with_delay(&conn, HeldMessages::Refuse)
            .await
            .expect("nothing held, nothing refused");
        assert!(discarded.is_empty(), "{discarded:?}");
        let left = delay_objects(&conn, &cfg).await;
        assert!(left.iter().all(|(_, e)| !*e), "{left:?}");
        assert!(matches!(
            t.verify(&conn).await,
            Err(TopologyError::Missing { .. })
        ));
        // Missing objects are skipped, with either choice.
        for held in [HeldMessages::Refuse, HeldMessages::Discard] {
            let again = t.delete_with_delay(&conn, held).await.expect("again");
            assert!(again.is_empty(), "{again:?}");
        }
        // The settings exchange went too: other settings can be declared on the prefix now.
        let other = Topology::new("empty")
            .prefix(&p)
            .delay(DelayConfig::new().prefix(&p).levels(3));
        other.declare(&conn).await.expect("other settings");
        other
            .delete_with_delay(&conn, HeldMessages::Refuse)
            .await
            .expect("delete the other settings");
    })
    .await;
}

#[tokio::test]
async fn passive_declares_tell_missing_from_present() {
    let conn = redeliver_testkit::connect().await;
    let p = common::prefix();
    let t = topo(&p, "probe");
    with_cleanup_topo(&conn, &t, async {
        t.declare(&conn).await.expect("declare");
        let ch = conn.create_channel().await.expect("channel");
        // A name no object can have is missing, without asking the broker: the channel stays.
        let long = "x".repeat(300);
        assert!(passive_queue(&ch, &long).await.expect("long").is_none());
        assert!(!passive_exchange(&ch, &long).await.expect("long"));
        assert!(ch.status().connected());
        let q = passive_queue(&ch, &t.queue_name())
            .await
            .expect("queue")
            .expect("exists");
        assert_eq!(q.message_count(), 0);
        assert!(passive_exchange(&ch, &t.dlx_name()).await.expect("dlx"));
        // A missing object is a 404, which closes the channel it happens on.
        let missing = format!("{p}no-such-queue");
        assert!(passive_queue(&ch, &missing).await.expect("404").is_none());
        assert!(!ch.status().connected());
        let ch = conn.create_channel().await.expect("channel");
        assert!(!passive_exchange(&ch, &missing).await.expect("404"));
        assert!(conn.status().connected());
    })
    .await;
}
