//! Publishing the messages the CLI then lists, replays or purges.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code); helpers are `pub` for the test files that include this module.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    unreachable_pub
)]

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};

/// Publishes with a confirm to `queue` through the default exchange.
pub async fn publish(conn: &Connection, queue: &str, id: &str, body: &[u8], headers: FieldTable) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let props = BasicProperties::default()
        .with_message_id(id.into())
        .with_correlation_id(format!("corr-{id}").as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(headers);
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        },
        body,
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    ch.close(200, "ok".into()).await.unwrap();
}

/// An application header the CLI must carry through: `tenant = acme`.
pub fn user_headers() -> FieldTable {
    let mut h = FieldTable::default();
    h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    h
}
