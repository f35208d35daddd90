//! AMQP 1.0 transport of redeliver, for RabbitMQ 4.3+ quorum queues: the queue itself holds a
//! retry's delay (`modified` with `x-opt-delivery-time`) and dead-letters with the reason
//! (`modified{undeliverable-here}` with `x-opt-redeliver-*` annotations).
//!
//! Every connection reads its socket through [`guard::GuardedStream`], which bounds how deep a
//! message may nest before fe2o3-amqp's recursive decoder sees it.

pub mod consumer;
pub mod guard;
pub mod message;
pub mod tls;

pub use consumer::{Annotation, Consumer, Endpoint, Error, Incoming, Modify, Settler};
pub use tls::Tls;
