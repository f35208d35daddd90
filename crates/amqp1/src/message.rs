//! An AMQP 1.0 message as the rest of redeliver reads one: a lapin [`Delivery`], whatever the
//! transport, so a handler's decoder, the retry state and the settling rules see the same
//! delivery over AMQP 0-9-1 and AMQP 1.0.
//!
//! The mapping follows RabbitMQ 4's own between the protocols (its "AMQP 1.0" guide, "Message
//! format mapping"): `x-` headers of a 0-9-1 publish arrive as message annotations, other
//! headers as application properties, the exchange and routing key as the annotations
//! `x-exchange` and `x-routing-key`. Both become headers again here. What RabbitMQ drops on the
//! way, and no consumer over AMQP 1.0 can see, is a non-`x-` header holding an array or a table.
//! The `x-opt-redeliver-*` annotations a native retry leaves are read as the `x-redeliver-*`
//! headers they stand for.

use fe2o3_amqp::types::messaging::{Body, Message, MessageId};
use fe2o3_amqp::types::primitives::{SimpleValue, Value};
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use redeliver_amqp::headers::ANNOTATION_PREFIX;

/// Annotation with the exchange a 0-9-1 publisher used.
const X_EXCHANGE: &str = "x-exchange";
/// Annotation with the routing key a 0-9-1 publisher used.
const X_ROUTING_KEY: &str = "x-routing-key";
/// Where RabbitMQ keeps the 0-9-1 `type` property.
const X_BASIC_TYPE: &str = "x-basic-type";
/// Where RabbitMQ keeps the 0-9-1 `app-id` property.
const X_BASIC_APP_ID: &str = "x-basic-app-id";
/// Annotations of the broker's, not the message's: left out of the headers.
const BROKER_ONLY: &[&str] = &["x-opt-rabbitmq-received-time", "x-opt-deaths"];

/// The body of an AMQP 1.0 message as bytes: `data` sections joined, an `amqp-value` holding
/// binary or a string as its bytes, anything else (a list, a map, a number, a sequence) as its
/// AMQP encoding, which a [`FromDelivery`] decoder of the user's can read; `Err` only if that
/// encoding fails.
///
/// [`FromDelivery`]: https://docs.rs/redeliver/latest/redeliver/trait.FromDelivery.html
pub fn body_bytes(body: Body<Value>) -> Result<Vec<u8>, String> {
    match body {
        Body::Data(sections) => {
            let mut bytes = Vec::new();
            for data in sections {
                bytes.extend_from_slice(&data.0);
            }
            Ok(bytes)
        }
        Body::Value(v) => match v.0 {
            Value::Binary(b) => Ok(b.into_vec()),
            Value::String(s) => Ok(s.into_bytes()),
            other => serde_amqp::to_vec(&other).map_err(|e| e.to_string()),
        },
        Body::Sequence(seqs) => {
            let values: Vec<Value> = seqs.into_iter().flat_map(|s| s.0).collect();
            serde_amqp::to_vec(&Value::List(values)).map_err(|e| e.to_string())
        }
        Body::Empty => Ok(Vec::new()),
    }
}

/// `message` as a lapin delivery with tag `tag`: properties and headers mapped back as RabbitMQ
/// maps them, `redelivered` when the broker says this is not the first acquirer.
pub fn to_delivery(tag: u64, message: Message<Body<Value>>) -> Result<Delivery, String> {
    let Message {
        header,
        message_annotations,
        properties,
        application_properties,
        body,
        ..
    } = message;
    let mut headers = FieldTable::default();
    let mut exchange = String::new();
    let mut routing_key = String::new();
    let mut kind = None;
    let mut app_id = None;
    let mut native = Vec::new();
    if let Some(app) = application_properties {
        for (k, v) in app.0 {
            if k == redeliver_amqp::HEADERS_REMOVED {
                continue;
            }
            headers.insert(ShortString::from(k), simple(v));
        }
    }
    if let Some(annotations) = message_annotations {
        for (k, v) in annotations.0 {
            let key = match k {
                fe2o3_amqp::types::messaging::annotations::OwnedKey::Symbol(s) => s.0,
                fe2o3_amqp::types::messaging::annotations::OwnedKey::Ulong(_) => continue,
            };
            match key.as_str() {
                X_EXCHANGE => exchange = text(&v).unwrap_or_default(),
                X_ROUTING_KEY => routing_key = text(&v).unwrap_or_default(),
                X_BASIC_TYPE => kind = text(&v),
                X_BASIC_APP_ID => app_id = text(&v),
                // Only the worker may say a message was altered on receipt.
                k if BROKER_ONLY.contains(&k) || k == redeliver_amqp::HEADERS_REMOVED => {}
                k => match k.strip_prefix(ANNOTATION_PREFIX) {
                    // `x-opt-redeliver-*` is how a native retry spells `x-redeliver-*`; it is
                    // applied after the others, since it is always the newer value (a native
                    // retry cannot remove a publisher's or an earlier copy's plain header).
                    Some(rest) if rest.starts_with("redeliver-") => {
                        native.push((format!("x-{rest}"), value(v)));
                    }
                    _ => {
                        headers.insert(ShortString::from(k.to_owned()), value(v));
                    }
                },
            }
        }
    }
    for (k, v) in native {
        headers.insert(ShortString::from(k), v);
    }
    let mut props = BasicProperties::default();
    let mut redelivered = false;
    if let Some(h) = header {
        props = props
            .with_delivery_mode(if h.durable { 2 } else { 1 })
            .with_priority(h.priority.0);
        if let Some(ttl) = h.ttl {
            props = props.with_expiration(ShortString::from(ttl.to_string()));
        }
        redelivered = !h.first_acquirer || h.delivery_count > 0;
    }
    if let Some(p) = properties {
        if let Some(id) = p.message_id {
            props = props.with_message_id(ShortString::from(message_id(id)));
        }
        if let Some(id) = p.correlation_id {
            props = props.with_correlation_id(ShortString::from(message_id(id)));
        }
        if let Some(user) = p.user_id {
            props = props.with_user_id(ShortString::from(
                String::from_utf8_lossy(&user).into_owned(),
            ));
        }
        if let Some(to) = p.reply_to {
            props = props.with_reply_to(ShortString::from(reply_to(&to)));
        }
        // RabbitMQ 4 carries a 0-9-1 `app-id` as the AMQP 1.0 `group-id`.
        if app_id.is_none() {
            app_id = p.group_id;
        }
        if let Some(t) = p.content_type {
            props = props.with_content_type(ShortString::from(t.0));
        }
        if let Some(e) = p.content_encoding {
            props = props.with_content_encoding(ShortString::from(e.0));
        }
        if let Some(t) = p.creation_time {
            let secs = t.milliseconds().div_euclid(1000);
            props = props.with_timestamp(u64::try_from(secs).unwrap_or(0));
        }
    }
    if let Some(kind) = kind {
        props = props.with_type(ShortString::from(kind));
    }
    if let Some(app_id) = app_id {
        props = props.with_app_id(ShortString::from(app_id));
    }
    if !headers.inner().is_empty() {
        props = props.with_headers(headers);
    }
    let data = body_bytes(body)?;
    let mut delivery = Delivery::mock(
        tag,
        ShortString::from(exchange),
        ShortString::from(routing_key),
        redelivered,
        data,
    );
    delivery.properties = props;
    Ok(delivery)
}

/// An AMQP 1.0 reply address as the 0-9-1 `reply-to` it stands for: RabbitMQ 4 turns a 0-9-1
/// `reply-to` of `q` into `/queues/q` (percent-encoded), which a 0-9-1 publisher could not
/// route to; other addresses are kept.
fn reply_to(address: &str) -> String {
    match address.strip_prefix("/queues/") {
        Some(encoded) if !encoded.contains('/') => percent_decode(encoded),
        _ => address.to_owned(),
    }
}

/// `%XX` sequences as bytes (an invalid one is kept as written), the result as UTF-8 (lossy).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        match (bytes.get(i), bytes.get(i + 1), bytes.get(i + 2)) {
            (Some(b'%'), Some(&h), Some(&l)) => match (hex(h), hex(l)) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            (Some(&b), _, _) => out.push(b),
            (None, _, _) => break,
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A message id of any AMQP 1.0 type as the string a 0-9-1 property holds.
fn message_id(id: MessageId) -> String {
    match id {
        MessageId::String(s) => s,
        MessageId::Ulong(n) => n.to_string(),
        MessageId::Uuid(u) => uuid_text(u.as_ref()),
        MessageId::Binary(b) => String::from_utf8_lossy(&b).into_owned(),
    }
}

fn uuid_text(bytes: &[u8]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    if hex.len() == 32 {
        format!(
            "{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..]
        )
    } else {
        hex
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Symbol(s) => Some(s.0.clone()),
        _ => None,
    }
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes()))
}

fn simple(v: SimpleValue) -> AMQPValue {
    value(Value::from(v))
}

/// An AMQP 1.0 value as the 0-9-1 header value RabbitMQ would give a 0-9-1 consumer. Nesting is
/// bounded by the connection's guard ([`crate::guard`]), so the recursion is too.
fn value(v: Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(b),
        Value::Ubyte(n) => AMQPValue::ShortShortUInt(n),
        Value::Ushort(n) => AMQPValue::ShortUInt(n),
        Value::Uint(n) => AMQPValue::LongUInt(n),
        Value::Ulong(n) => match i64::try_from(n) {
            Ok(n) => AMQPValue::LongLongInt(n),
            Err(_) => long_string(&n.to_string()),
        },
        Value::Byte(n) => AMQPValue::ShortShortInt(n),
        Value::Short(n) => AMQPValue::ShortInt(n),
        Value::Int(n) => AMQPValue::LongInt(n),
        Value::Long(n) => AMQPValue::LongLongInt(n),
        Value::Float(f) => AMQPValue::Float(f.into_inner()),
        Value::Double(f) => AMQPValue::Double(f.into_inner()),
        Value::Char(c) => long_string(&c.to_string()),
        Value::Timestamp(t) => {
            AMQPValue::Timestamp(u64::try_from(t.milliseconds().div_euclid(1000)).unwrap_or(0))
        }
        Value::Uuid(u) => long_string(&uuid_text(u.as_ref())),
        Value::Binary(b) => AMQPValue::ByteArray(b.into_vec().into()),
        Value::String(s) => long_string(&s),
        Value::Symbol(s) => long_string(&s.0),
        Value::Described(d) => value(d.value),
        Value::List(items) => AMQPValue::FieldArray(FieldArray::from(
            items.into_iter().map(value).collect::<Vec<_>>(),
        )),
        Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
            items.0.into_iter().map(value).collect::<Vec<_>>(),
        )),
        Value::Map(map) => {
            let mut t = FieldTable::default();
            for (k, v) in map {
                let key = match k {
                    Value::String(s) => s,
                    Value::Symbol(s) => s.0,
                    other => format!("{other:?}"),
                };
                t.insert(ShortString::from(key), value(v));
            }
            AMQPValue::FieldTable(t)
        }
        // Decimals have no 0-9-1 counterpart RabbitMQ would use either: their text.
        other => long_string(&format!("{other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use fe2o3_amqp::types::messaging::{
        ApplicationProperties, Data, Header, MessageAnnotations, Properties,
    };
    use fe2o3_amqp::types::primitives::{Binary, OrderedMap, Symbol};
    use redeliver_amqp::headers::RetryState;

    use super::*;

    #[test]
    fn a_message_from_a_091_publisher_reads_as_it_was_sent() {
        let mut annotations = OrderedMap::new();
        for (k, v) in [
            ("x-exchange", Value::String("orders".into())),
            ("x-routing-key", Value::String("eu.new".into())),
            ("x-opt-redeliver-attempt", Value::Long(2)),
            ("x-opt-redeliver-not-before", Value::Long(1_700_000_000_000)),
            ("x-tenant", Value::String("t1".into())),
            ("x-opt-rabbitmq-received-time", Value::Long(1)),
        ] {
            annotations.insert(Symbol::from(k).into(), v);
        }
        let mut app = OrderedMap::new();
        app.insert("plain".to_owned(), SimpleValue::Int(7));
        let message = Message {
            header: Some(Header {
                durable: true,
                first_acquirer: false,
                ..Default::default()
            }),
            delivery_annotations: None,
            message_annotations: Some(MessageAnnotations(annotations)),
            properties: Some(Properties {
                message_id: Some(MessageId::String("m-1".into())),
                content_type: Some(Symbol::from("application/json")),
                ..Default::default()
            }),
            application_properties: Some(ApplicationProperties(app)),
            body: Body::Data(vec![Data(Binary::from(b"{\"a\":1}".to_vec()))].into()),
            footer: None,
        };
        let d = to_delivery(9, message).unwrap();
        assert_eq!(d.delivery_tag, 9);
        assert_eq!(d.exchange.as_str(), "orders");
        assert_eq!(d.routing_key.as_str(), "eu.new");
        assert!(d.redelivered);
        assert_eq!(d.data, b"{\"a\":1}");
        assert_eq!(d.properties.delivery_mode(), &Some(2));
        assert_eq!(
            d.properties.message_id().as_ref().map(|s| s.as_str()),
            Some("m-1")
        );
        let headers = d.properties.headers().as_ref().unwrap();
        assert_eq!(headers.inner().get("x-tenant"), Some(&long_string("t1")));
        assert_eq!(headers.inner().get("plain"), Some(&AMQPValue::LongInt(7)));
        assert!(!headers.contains_key("x-opt-rabbitmq-received-time"));
        let state = RetryState::read(Some(headers));
        assert_eq!(state.attempt, 2);
        assert_eq!(state.not_before_ms, Some(1_700_000_000_000));
    }

    #[test]
    fn a_native_retrys_state_wins_over_a_plain_header_in_any_order() {
        for order in [
            ["x-redeliver-attempt", "x-opt-redeliver-attempt"],
            ["x-opt-redeliver-attempt", "x-redeliver-attempt"],
        ] {
            let mut annotations = OrderedMap::new();
            for k in order {
                let v = if k.starts_with("x-opt-") { 2 } else { 0 };
                annotations.insert(Symbol::from(k).into(), Value::Long(v));
            }
            let message = Message {
                header: None,
                delivery_annotations: None,
                message_annotations: Some(MessageAnnotations(annotations)),
                properties: None,
                application_properties: None,
                body: Body::Empty,
                footer: None,
            };
            let d = to_delivery(1, message).unwrap();
            assert_eq!(
                RetryState::read(d.properties.headers().as_ref()).attempt,
                2,
                "{order:?}"
            );
        }
    }

    #[test]
    fn reply_addresses_read_as_queue_names() {
        assert_eq!(reply_to("/queues/replies"), "replies");
        assert_eq!(reply_to("/queues/a%20b%2Fc"), "a b/c");
        assert_eq!(reply_to("/exchanges/x/k"), "/exchanges/x/k");
        assert_eq!(reply_to("amq.rabbitmq.reply-to"), "amq.rabbitmq.reply-to");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }

    #[test]
    fn value_bodies_become_bytes() {
        let b = |v| body_bytes(Body::Value(fe2o3_amqp::types::messaging::AmqpValue(v)));
        assert_eq!(b(Value::String("hi".into())).unwrap(), b"hi");
        assert_eq!(b(Value::Binary(vec![1, 2].into())).unwrap(), [1, 2]);
        assert!(!b(Value::Long(5)).unwrap().is_empty());
        assert!(body_bytes(Body::Empty).unwrap().is_empty());
    }
}
