//! redeliver: retries with exponential backoff and jitter held in RabbitMQ's own TTL queues,
//! and dead-lettering through the broker's dead-letter exchange, for Rust consumers.
//!
//! This crate is the facade: it re-exports the three libraries so a service depends on one
//! crate.
//!
//! # Where to find what
//!
//! **Every type a service names is at the root, and documented there**: `redeliver::Worker`,
//! `redeliver::RetryPolicy`, `redeliver::HandlerError`, `redeliver::Json`... — the worker and its
//! builder, settings, status and errors; what a handler takes and returns; the retry policy with
//! its backoff, jitter, classifier and budget; the topology, TLS and publisher settings. Use these
//! paths; the README, the examples and these docs do.
//!
//! The three modules below are the whole libraries, for advanced use. They hold what the root
//! does not: namespaces of functions and constants (`worker::health`, `worker::env`,
//! `worker::metrics_names`, `amqp::headers`, `amqp::properties`, `amqp::url`,
//! `amqp::trace_context`), the building blocks under the worker (`amqp::connect`,
//! `amqp::ServerInfo`, the delay routing) and the rarer types (`policy::Clock`, error types of
//! the pieces). Each is the whole crate, so a root type is also found in the module of the crate
//! that defines it (and the worker crate repeats the policy and AMQP types it takes), but its
//! documentation is at the root.
//!
//! | module | crate | holds |
//! |---|---|---|
//! | [`policy`] | `redeliver-core` | backoff, jitter, max retries, error classification, retry budget (pure) |
//! | [`amqp`] | `redeliver-amqp` | topology, binary delay levels, confirmed publisher, header codec |
//! | [`worker`] | `redeliver-worker` | consumer runtime: concurrency, ack / delay / reject, shutdown, reconnect |
//! | [`lapin`] | `lapin` | the AMQP client underneath, for its property and option types |
//!
//! # Features
//!
//! | feature | default | brings |
//! |---|---|---|
//! | `tls` | on | `amqps://` through rustls (ring provider); without it such a URL is refused before connecting |
//! | `health` | on | the health server and Prometheus exporter (`worker::health`; axum, metrics-exporter-prometheus) |
//! | `otel` | off | W3C trace context in message headers; each delivery span continues the message's trace (`amqp::trace_context`) |
//! | `postgres` | off | the `postgres` module: the PostgreSQL inbox (exactly-once database effects per message id) and outbox (publish after commit), on sqlx |
//!
//! A worker, with root paths only:
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
//!     .build()?
//!     .run(redeliver::shutdown_on_signal()?)
//!     .await
//! # }
//! ```
//!
//! # Naming
//!
//! Settings are chained setters named after the setting (`RetryPolicy::max_retries(n)`,
//! `Topology::delay(cfg)`, `TlsConfig::sasl_external(yes)`). On such a type the getter of a
//! setting is `configured_` and the setter's name: `configured_max_retries()`,
//! `configured_delay()`, `configured_sasl_external()` (`configured_bindings()` for the
//! bindings that `bind` adds one by one). A value worked out from the settings, or read from a
//! type that has no setter of that name, keeps a plain name: `Topology::queue_name()`,
//! `DelayConfig::max_delay()`, `Context::attempt()`, `Settings::policy()`. A backoff's own
//! parameters (an exponential factor) are given where the backoff is chosen, never by a setter
//! that other backoffs would ignore.

// Lints: `[workspace.lints]` in Cargo.toml.
// docs.rs marks the items of optional features with the feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod policy {
    //! Advanced: the whole `redeliver-core` crate, the retry policy. Its everyday types are
    //! documented at the [root](crate): `RetryPolicy`, `Backoff`, `Jitter`, `HandlerError`...
    #[doc(no_inline)]
    pub use redeliver_core::*;
}

pub mod amqp {
    //! Advanced: the whole `redeliver-amqp` crate, the RabbitMQ building blocks. Its everyday
    //! types are documented at the [root](crate): `Topology`, `QueueType`, `DelayConfig`,
    //! `TlsConfig`, `Publisher`.
    #[doc(no_inline)]
    pub use redeliver_amqp::*;
}

pub mod worker {
    //! Advanced: the whole `redeliver-worker` crate, the consumer runtime, with its `health`,
    //! `env` and `metrics_names` modules. Its everyday types are documented at the
    //! [root](crate): `Worker`, `WorkerBuilder`, `Context`, `Json`...
    #[doc(no_inline)]
    pub use redeliver_worker::*;
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres {
    //! The whole `redeliver-postgres` crate (feature `postgres`): the transactional inbox and
    //! outbox. See [`Inbox`], [`Outbox`] and [`Relay`].
    #[doc(no_inline)]
    pub use redeliver_postgres::*;
}

// A crate of its own, documented on its own: not inlined.
#[doc(no_inline)]
pub use redeliver_amqp::lapin;

// The everyday types, documented here (inlined) rather than in the crates that define them.
pub use redeliver_amqp::{DelayConfig, Publisher, QueueType, TlsConfig, Topology};
pub use redeliver_core::{
    Backoff, BudgetConfig, Classifier, DeadLetterReason, Decision, ErrorKind, Forward,
    HandlerError, Jitter, RetryBudget, RetryPolicy, TimedOut,
};
pub use redeliver_worker::{
    run_all, shutdown_on_signal, Context, DeadLetterMode, DecodeError, FromDelivery, Handler, Json,
    Raw, RetryMode, Settings, Text, Worker, WorkerBuilder, WorkerError, WorkerState, WorkerStatus,
};
pub use tokio_util::sync::CancellationToken;

// The README's Rust examples are compiled as doctests so they cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
