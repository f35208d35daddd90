//! The confirmed publisher against bodies near the broker's `max_message_size`.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use redeliver_amqp::lapin::BasicProperties;
use redeliver_amqp::{DelayConfig, PublishError, Publisher};

/// Over the limit the publisher knows, a body is refused before it is sent, with a typed error,
/// and the channel stays usable; a body the broker itself refuses (no limit set here) is the same
/// typed error with the broker's limit. At the limit, the broker takes it.
#[tokio::test]
async fn bodies_over_max_message_size_are_a_typed_error() {
    let conn = redeliver_testkit::connect().await;
    let version = redeliver_testkit::broker_version().await;
    let limit = version.default_max_message_size();
    let p = common::prefix();
    let q = format!("{p}big");
    let _cleanup = redeliver_testkit::Cleanup(p.clone());
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(q.as_str().into(), Default::default(), Default::default())
        .await
        .unwrap();

    let checked = Publisher::new(&conn, DelayConfig::new().prefix(p.clone()))
        .await
        .unwrap()
        .with_max_message_size(limit);
    let over = vec![b'x'; limit + 1];
    match checked
        .publish_bytes("", &q, &over, BasicProperties::default())
        .await
    {
        Err(PublishError::TooLarge { size, limit: l, .. }) => {
            assert_eq!(size, limit + 1);
            assert_eq!(l, Some(limit));
        }
        other => panic!("RabbitMQ {version}: expected TooLarge, got {other:?}"),
    }
    assert!(checked.channel().status().connected(), "nothing was sent");
    checked
        .publish_bytes("", &q, &vec![b'y'; limit], BasicProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ {version}: a body of exactly {limit} bytes: {e}"));

    let unchecked = Publisher::new(&conn, DelayConfig::new().prefix(p.clone()))
        .await
        .unwrap();
    match unchecked
        .publish_bytes("", &q, &over, BasicProperties::default())
        .await
    {
        Err(PublishError::TooLarge { size, limit: l, .. }) => {
            assert_eq!(size, limit + 1);
            assert_eq!(l, Some(limit), "the broker's message names its limit");
            let text = PublishError::TooLarge {
                exchange: String::new(),
                routing_key: q.clone(),
                size,
                limit: l,
            }
            .to_string();
            assert!(text.contains("max_message_size"), "{text}");
        }
        other => panic!("RabbitMQ {version}: expected TooLarge from the broker, got {other:?}"),
    }
    println!("RabbitMQ {version}: max_message_size {limit}: over it refused, at it accepted");
}
