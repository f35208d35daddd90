//! The worker's metric handles, resolved once per connection.
//!
//! A `metrics::counter!` call with a label builds its key and looks it up in the recorder every
//! time; on the per-message path that is an allocation and a hash lookup per metric. The handles
//! are resolved when a session starts, so install the recorder (for instance with
//! [`install_prometheus`](crate::health::install_prometheus)) before running the worker.

use metrics::{Counter, Gauge, Histogram};

use crate::metrics_names as m;

/// Handles for the metrics emitted once or more per delivery, labelled with the queue.
#[derive(Clone)]
pub(crate) struct Meters {
    pub(crate) received: Counter,
    pub(crate) succeeded: Counter,
    pub(crate) settle_failures: Counter,
    pub(crate) sanitized: Counter,
    pub(crate) handler_duration: Histogram,
    pub(crate) in_flight: Gauge,
}

impl Meters {
    pub(crate) fn new(queue: &str) -> Self {
        let q = || queue.to_owned();
        Self {
            received: metrics::counter!(m::MESSAGES_RECEIVED, m::LABEL_QUEUE => q()),
            succeeded: metrics::counter!(m::MESSAGES_SUCCEEDED, m::LABEL_QUEUE => q()),
            settle_failures: metrics::counter!(m::SETTLE_FAILURES, m::LABEL_QUEUE => q()),
            sanitized: metrics::counter!(m::MESSAGES_SANITIZED, m::LABEL_QUEUE => q()),
            handler_duration: metrics::histogram!(m::HANDLER_DURATION, m::LABEL_QUEUE => q()),
            in_flight: metrics::gauge!(m::HANDLERS_IN_FLIGHT, m::LABEL_QUEUE => q()),
        }
    }
}
