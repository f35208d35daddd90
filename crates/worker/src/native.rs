//! The broker under settling over AMQP 1.0, where the queue holds retries (RabbitMQ 4.3+ quorum
//! queues): each delivery's outcome is a disposition of the consumer's link, and copies
//! (forwarded, repaired, an early retry's rest) go through the same confirmed publisher as on
//! AMQP 0-9-1 ([`Copies`]).
//!
//! | settling asks | AMQP 1.0 |
//! |---|---|
//! | ack | `accepted` (batched) |
//! | retry after `d` | `modified{delivery-failed}` with `x-opt-delivery-time = now + d` and the retry state as `x-opt-redeliver-*` |
//! | dead-letter | `modified{delivery-failed, undeliverable-here}` with the reason, error, attempts, time and worker |
//! | requeue | `released` (not a failed delivery) |

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use redeliver_amqp::headers::{self, DeadLetterInfo, RetryState};
use redeliver_amqp1::{Annotation, Modify, Settler};
use tracing::debug;

use crate::broker::{Broker, Link};
use crate::link::Copies;

/// The annotation that makes a quorum queue of RabbitMQ 4.3+ hold a `modified` message until
/// then (Unix milliseconds).
const DELIVERY_TIME: &str = "x-opt-delivery-time";

/// [`Link`] over AMQP 1.0: one per session.
pub(crate) struct NativeLink {
    pub(crate) copies: Copies,
    pub(crate) settler: Settler,
    /// `redeliver_messages_succeeded_total` counts each `accepted` of a success when it is
    /// handed to the link (as the 0-9-1 batched acks count theirs when they are sent).
    pub(crate) succeeded: metrics::Counter,
}

impl Link for NativeLink {
    type Broker<'a> = NativeBroker<'a>;

    fn register(&self, _delivery_tag: u64) {}

    fn broker<'a>(&'a self, delivery: &'a Delivery) -> NativeBroker<'a> {
        NativeBroker {
            link: self,
            tag: delivery.delivery_tag,
        }
    }
}

/// [`Broker`] over AMQP 1.0: the link's settler for this delivery's tag.
pub(crate) struct NativeBroker<'a> {
    link: &'a NativeLink,
    tag: u64,
}

impl NativeBroker<'_> {
    async fn modify(&self, modify: Modify) -> Result<bool, lapin::Error> {
        Ok(self.link.settler.modify(self.tag, modify).await)
    }
}

impl Broker for NativeBroker<'_> {
    type Copies = Copies;

    fn is_open(&self) -> bool {
        self.link.settler.is_open()
    }

    fn ack(&self, success: bool) -> bool {
        let sent = self.link.settler.accept(self.tag);
        if sent && success {
            self.link.succeeded.increment(1);
        }
        sent
    }

    async fn reject(&self, requeue: bool) -> Result<bool, lapin::Error> {
        if requeue {
            return Ok(self.link.settler.release(self.tag));
        }
        self.modify(Modify {
            delivery_failed: true,
            undeliverable_here: true,
            annotations: Vec::new(),
        })
        .await
    }

    // Dispositions carry no tag range: nothing batched waits on them.
    fn released(&self) {}

    async fn abandon_channel(&self, why: &'static str) {
        // A disposition that did not go out means the link is gone: the broker gives back
        // every unsettled delivery of it.
        debug!(
            why,
            "AMQP 1.0 settlement failed; the link's deliveries go back to the queue"
        );
    }

    fn holds_retries(&self) -> bool {
        true
    }

    async fn hold(&self, until_ms: u64, state: &RetryState) -> Result<bool, lapin::Error> {
        let mut annotations = retry_annotations(state);
        annotations.push((
            DELIVERY_TIME.to_owned(),
            Annotation::Long(i64::try_from(until_ms).unwrap_or(i64::MAX)),
        ));
        self.modify(Modify {
            delivery_failed: true,
            undeliverable_here: false,
            annotations,
        })
        .await
    }

    async fn dead_letter(
        &self,
        info: &DeadLetterInfo,
        state: &RetryState,
    ) -> Result<bool, lapin::Error> {
        let mut table = FieldTable::default();
        info.write(&mut table);
        let mut annotations = annotations_of(&table);
        // The retry state stays readable on the dead letter (first failure, last error).
        annotations.extend(retry_annotations(state));
        self.modify(Modify {
            delivery_failed: true,
            undeliverable_here: true,
            annotations,
        })
        .await
    }

    fn copies(&self) -> &Copies {
        &self.link.copies
    }
}

/// `state` as `x-opt-redeliver-*` annotations.
fn retry_annotations(state: &RetryState) -> Vec<(String, Annotation)> {
    let mut table = FieldTable::default();
    state.write(&mut table);
    annotations_of(&table)
}

/// The `x-redeliver-*` entries of `table` as annotations (RabbitMQ takes only `x-opt-` keys),
/// strings and integers as a copy's headers carry them.
fn annotations_of(table: &FieldTable) -> Vec<(String, Annotation)> {
    table
        .inner()
        .iter()
        .filter(|(k, _)| k.as_str().starts_with(headers::PREFIX))
        .filter_map(|(k, v)| {
            let name = headers::annotation_name(k.as_str())?;
            let value = match v {
                AMQPValue::LongLongInt(n) => Annotation::Long(*n),
                AMQPValue::LongString(s) => {
                    Annotation::Text(String::from_utf8_lossy(s.as_bytes()).into_owned())
                }
                _ => return None,
            };
            Some((name, value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_state_becomes_x_opt_annotations() {
        let state = RetryState {
            attempt: 2,
            last_error: Some("503".into()),
            not_before_ms: Some(7),
            ..Default::default()
        };
        let a = retry_annotations(&state);
        assert!(a.contains(&("x-opt-redeliver-attempt".into(), Annotation::Long(2))));
        assert!(a.contains(&(
            "x-opt-redeliver-last-error".into(),
            Annotation::Text("503".into())
        )));
        assert!(a.contains(&("x-opt-redeliver-not-before".into(), Annotation::Long(7))));
        assert!(a.iter().all(|(k, _)| k.starts_with("x-opt-")));
    }
}
