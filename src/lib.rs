//! redeliver: retries with exponential backoff and jitter held in RabbitMQ's own TTL queues,
//! and dead-lettering through the broker's dead-letter exchange, for Rust consumers.
//!
//! This crate is the facade: it re-exports the three libraries so a service depends on one
//! crate.
//!
//! | module | crate | holds |
//! |---|---|---|
//! | [`policy`] | `redeliver-core` | backoff, jitter, max retries, error classification, retry budget (pure) |
//! | [`amqp`] | `redeliver-amqp` | topology, binary delay levels, confirmed publisher, header codec |
//! | [`worker`] | `redeliver-worker` | consumer runtime: concurrency, ack / delay / reject, shutdown, reconnect |
//!
//! # Features
//!
//! | feature | default | brings |
//! |---|---|---|
//! | `tls` | on | `amqps://` through rustls (ring provider); without it such a URL is refused before connecting |
//! | `health` | on | the health server and Prometheus exporter (`worker::health`; axum, metrics-exporter-prometheus) |
//! | `otel` | off | W3C trace context in message headers; each delivery span continues the message's trace (`amqp::trace_context`) |
//!
//! The items a service needs most are also at the top level:
//!
//! ```no_run
//! use std::time::Duration;
//! use redeliver::{Context, HandlerError, Jitter, Json, RetryPolicy, Worker};
//!
//! #[derive(serde::Deserialize)]
//! struct Resize { url: String, width: u32 }
//!
//! # async fn run() -> Result<(), redeliver::WorkerError> {
//! Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .queue("images")
//!     .policy(
//!         RetryPolicy::exponential(Duration::from_millis(200))
//!             .cap(Duration::from_secs(30))
//!             .jitter(Jitter::Full)
//!             .max_retries(5),
//!     )
//!     .prefetch(64)
//!     .concurrency(16)
//!     .handler(|job: Json<Resize>, ctx: Context| async move {
//!         if job.width == 0 {
//!             return Err(HandlerError::permanent("width must be positive"));
//!         }
//!         tracing::info!(url = %job.url, attempt = ctx.attempt(), "resizing");
//!         Ok(())
//!     })
//!     .run_until_signal()
//!     .await
//! # }
//! ```

#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![forbid(unsafe_code)]

pub use redeliver_amqp as amqp;
pub use redeliver_core as policy;
pub use redeliver_worker as worker;

// Each type is documented once, in the crate that defines it; these are shortcuts to it.
#[doc(no_inline)]
pub use redeliver_amqp::{lapin, DelayConfig, Publisher, QueueType, TlsConfig, Topology};
#[doc(no_inline)]
pub use redeliver_core::{
    Backoff, Classifier, DeadLetterReason, Decision, ErrorKind, Forward, HandlerError, Jitter,
    RetryBudget, RetryPolicy, TimedOut,
};
#[doc(no_inline)]
pub use redeliver_worker::{
    CancellationToken, Context, DeadLetterMode, FromDelivery, Handler, Json, Raw, Text, Worker,
    WorkerBuilder, WorkerError, WorkerStatus,
};

// The README's Rust examples are compiled as doctests so they cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
