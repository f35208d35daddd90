//! The properties of a copy of a message: what a retry copy, a repaired copy or a replayed
//! message keeps of the original it was made from.

use lapin::BasicProperties;

/// Every property of `original` for a copy of it that this client publishes, except
///
/// - `headers`: every copy rewrites them (retry state, `x-death`), so the caller adds its own
///   table with [`BasicProperties::with_headers`];
/// - `expiration`: a per-message TTL shorter than a delay level's TTL would make a retry copy
///   leave that level early and arrive too soon. A caller putting the copy straight back into a
///   consumer queue, where the sender's TTL still means what it meant, adds it back;
/// - `user_id`, unless it equals `connection_user`: RabbitMQ refuses (406, closing the
///   publishing channel) a publish whose `user_id` is not the connection's user. `None` (the
///   user is not known, e.g. with SASL EXTERNAL) drops it always.
///
/// ```
/// use redeliver::lapin::types::{AMQPValue, FieldTable};
/// use redeliver::lapin::BasicProperties;
/// use redeliver::amqp::properties::copy_properties;
///
/// let original = BasicProperties::default()
///     .with_message_id("order-17".into())
///     .with_expiration("60000".into())
///     .with_user_id("shop".into());
/// let mut headers = FieldTable::default();
/// headers.insert("x-redeliver-attempt".into(), AMQPValue::LongLongInt(1));
///
/// let copy = copy_properties(&original, Some("worker")).with_headers(headers);
/// assert_eq!(copy.message_id().as_ref().map(|id| id.as_str()), Some("order-17"));
/// assert!(copy.expiration().is_none());
/// assert!(copy.user_id().is_none()); // "shop" is not the connection's user
/// assert!(copy.headers().is_some());
///
/// let copy = copy_properties(&original, Some("shop"));
/// assert_eq!(copy.user_id().as_ref().map(|u| u.as_str()), Some("shop"));
/// ```
pub fn copy_properties(
    original: &BasicProperties,
    connection_user: Option<&str>,
) -> BasicProperties {
    let mut p = BasicProperties::default();
    if let Some(v) = original.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(v) = original.delivery_mode() {
        p = p.with_delivery_mode(*v);
    }
    if let Some(v) = original.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = original.user_id() {
        if connection_user == Some(v.as_str()) {
            p = p.with_user_id(v.clone());
        }
    }
    if let Some(v) = original.app_id() {
        p = p.with_app_id(v.clone());
    }
    if let Some(v) = original.cluster_id() {
        p = p.with_cluster_id(v.clone());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{AMQPValue, FieldTable, ShortString};

    fn short(s: &str) -> Option<ShortString> {
        Some(ShortString::from(s))
    }

    #[test]
    fn copy_keeps_properties_but_expiration_and_foreign_user() {
        let mut h = FieldTable::default();
        h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        let original = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_content_type("application/json".into())
            .with_correlation_id("c-9".into())
            .with_delivery_mode(2)
            .with_priority(3)
            .with_expiration("60000".into())
            .with_user_id("alice".into())
            .with_app_id("shop".into())
            .with_headers(h.clone());
        let copy = copy_properties(&original, Some("guest")).with_headers(h.clone());
        assert_eq!(copy.message_id(), &short("m-1"));
        assert_eq!(copy.content_type(), &short("application/json"));
        assert_eq!(copy.correlation_id(), &short("c-9"));
        assert_eq!(copy.delivery_mode(), &Some(2));
        assert_eq!(copy.priority(), &Some(3));
        assert_eq!(copy.app_id(), &short("shop"));
        assert_eq!(copy.expiration(), &None);
        assert_eq!(copy.user_id(), &None);
        assert_eq!(copy.headers(), &Some(h));
        let copy = copy_properties(&original, Some("alice"));
        assert_eq!(copy.user_id(), &short("alice"));
        // An unknown connection user keeps no user_id at all.
        assert_eq!(copy_properties(&original, None).user_id(), &None);
    }

    #[test]
    fn headers_are_the_callers() {
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::Boolean(true));
        let original = BasicProperties::default().with_headers(h);
        assert_eq!(copy_properties(&original, None).headers(), &None);
    }

    #[test]
    fn every_other_property_is_kept() {
        let original = BasicProperties::default()
            .with_content_encoding("gzip".into())
            .with_reply_to("answers".into())
            .with_timestamp(1_700_000_000)
            .with_type("order.created".into())
            .with_cluster_id("eu".into());
        assert_eq!(copy_properties(&original, None), original);
        assert_eq!(
            copy_properties(&BasicProperties::default(), Some("guest")),
            BasicProperties::default()
        );
    }
}
