//! RabbitMQ building blocks of redeliver: consumer topology, binary TTL delay levels, a
//! confirmed publisher and the header codec.
//!
//! # Retries without holding messages
//!
//! A retried message is republished into broker-held delay queues and comes back to its queue
//! when the delay has passed, so a worker never keeps a delayed message in memory. The delay
//! infrastructure is the NServiceBus RabbitMQ transport's: `L` levels (default 24) with
//! granularity `g` (default 10 ms). Level `k` is a topic exchange and a queue with TTL `2^k * g`;
//! a delay of `n = ceil(d / g)` ticks is written in binary into the routing key
//! (`b(L-1). ... .b0.{queue}`), and the message waits in exactly the levels of its set bits.
//! Delays are exact per message (so jitter is real) with a fixed number of queues, and since all
//! messages of a level share one TTL, nothing waits behind a longer delay. See [`DelayConfig`].
//!
//! # Dead letters through the broker
//!
//! Each consumer queue `Q` dead-letters into `Q.dlx` -> `Q.dlq` (see [`Topology`]): a worker
//! rejects with `requeue = false` and the broker records why in `x-death` (see [`headers`]).
//! Quorum queues also dead-letter poison messages themselves after `x-delivery-limit`
//! redeliveries.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use redeliver::lapin::{Connection, ConnectionProperties};
//! use redeliver::{Publisher, Topology};
//! use std::time::Duration;
//!
//! let conn = Connection::connect("amqp://guest:guest@127.0.0.1:5672/%2f", ConnectionProperties::default()).await?;
//! let topo = Topology::new("images");
//! topo.declare(&conn).await?;
//! let publisher = Publisher::new(&conn, topo.configured_delay().clone()).await?;
//! publisher
//!     .publish_delayed(&topo.queue_name(), Duration::from_millis(1500), b"{}", Default::default())
//!     .await?;
//! # Ok(()) }
//! ```

// Lints: `[workspace.lints]` in Cargo.toml.
// docs.rs marks the items of optional features with the feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]

// One path per item: `headers`, `properties` and `url` are namespaces of constants and free
// functions and stay public, with their types, as does `framing` (the frame filter under both
// frame guards, this crate's and redeliver-amqp1's); every other module is private and its public
// items are re-exported here.
pub mod framing;
pub mod headers;
pub mod properties;
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub mod trace_context;
pub mod url;

mod declare;
mod delay;
mod delete;
mod error;
mod frame_guard;
mod names;
mod publisher;
mod server;
mod tls;
mod topology;

pub use lapin;

pub use declare::{passive_exchange, passive_queue, QueueType, OPERATOR_DELIVERY_LIMIT};
pub use delay::{DelayConfig, DelayRoute, DEFAULT_JITTERED_HOPS};
pub use delete::{HeldMessages, QueueMessages};
pub use error::{is_not_found, DelayConfigError, DelayError, TopologyError};
pub use frame_guard::{headers_removed, HeadersRemoved, HEADERS_REMOVED, MAX_HEADER_DEPTH};
pub use names::{validate_queue_name, validate_routed_queue_name, NameError, MAX_NAME_BYTES};
pub use publisher::{OutgoingMessage, PublishError, Publisher, DEFAULT_PUBLISH_CHANNELS};
pub use server::{BrokerVersion, ProbeError, ServerInfo, StartFrameError, PROBE_TIMEOUT};
pub use tls::{connect, connect_url, ConnectError, TlsConfig, TlsError};
pub use topology::{Binding, Topology, TopologyWarning};

/// Entry points for the fuzz targets in `fuzz/` (not a stable API): the frame guard is private.
#[doc(hidden)]
pub mod fuzzing {
    /// What lapin's parser receives when the broker sends `input` through the frame guard of a
    /// client asking for `client_frame_max`, read from the socket `chunk` bytes (at least 1) at
    /// a time, the way `GuardedStream::poll_read` reads
    /// ([`crate::framing::FrameFilter::read_through`]).
    pub fn guard_stream(input: &[u8], chunk: usize, client_frame_max: u32) -> Vec<u8> {
        crate::frame_guard::frame_guard(client_frame_max).read_through(input, chunk)
    }
}
