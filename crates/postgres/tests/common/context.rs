//! The context of a handler called directly by the test, without a worker.

// Helpers are `pub` for the test files that include this module.
#![allow(unreachable_pub)]

use redeliver_amqp::lapin::message::Delivery;
use redeliver_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use redeliver_amqp::lapin::BasicProperties;
use redeliver_worker::Context;

/// A context for a direct call of a handler, as the worker would give it.
pub fn context(message_id: Option<&str>, headers: &[(&str, &str)]) -> Context {
    let mut props = BasicProperties::default();
    if let Some(id) = message_id {
        props = props.with_message_id(id.into());
    }
    if !headers.is_empty() {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert((*k).into(), AMQPValue::LongString(LongString::from(*v)));
        }
        props = props.with_headers(table);
    }
    let mut delivery = Delivery::mock(1, "".into(), "q".into(), false, b"body".to_vec());
    delivery.properties = props;
    Context::detached("q", delivery)
}
