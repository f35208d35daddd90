//! Consumer runtime of redeliver: consume a RabbitMQ queue with bounded concurrency, retry
//! failures with backoff and jitter through broker-held delay levels, dead-letter what cannot
//! succeed through the broker's own DLX, reconnect on connection loss and drain on shutdown.
//!
//! ```no_run
//! use std::time::Duration;
//! use redeliver::{Context, HandlerError, Json, RetryPolicy, Worker};
//!
//! #[derive(serde::Deserialize)]
//! struct ImageJob { url: String }
//!
//! async fn fetch(_url: &str) -> anyhow::Result<Vec<u8>> { Ok(Vec::new()) }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), redeliver::WorkerError> {
//!     Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
//!         .queue("images")
//!         .policy(RetryPolicy::exponential(Duration::from_millis(500)).max_retries(5))
//!         .prefetch(64)
//!         .concurrency(16)
//!         .handler(|job: Json<ImageJob>, ctx: Context| async move {
//!             if job.url.is_empty() {
//!                 return Err(HandlerError::permanent("no url"));
//!             }
//!             // `?` works on anyhow errors (classified by the policy's Classifier: transient
//!             // unless registered as permanent) and on HandlerError.
//!             fetch(&job.url).await?;
//!             tracing::info!(url = %job.url, attempt = ctx.attempt(), "resized");
//!             Ok(())
//!         })
//!         .build()?
//!         .run(redeliver::shutdown_on_signal()?)
//!         .await
//! }
//! ```
//!
//! # What happens to one delivery
//!
//! 1. The body is decoded into the handler's message type ([`Json<T>`], [`Raw`], [`Text`] or
//!    any [`FromDelivery`]). A body that does not decode is rejected at once
//!    (`basic.reject(requeue = false)`): the broker dead-letters it to `Q.dlq`, the handler is
//!    never called.
//! 2. The handler runs, at most [`concurrency`](WorkerBuilder::concurrency) at a time, bounded by
//!    the optional [per-message timeout](WorkerBuilder::handler_timeout). A panic or a timeout is
//!    a transient error carrying the panic message.
//! 3. `Ok` acks. An error goes through the [`RetryPolicy`]: a retry publishes a copy (body and
//!    properties kept, `x-redeliver-*` headers updated, `x-death` dropped) through the delay
//!    levels, waits for the broker's confirm and only then acks the original; if the copy is not
//!    confirmed the original is requeued (`basic.reject(requeue = true)`, after a 1 s pause, at
//!    most [`requeue_limit`](WorkerBuilder::requeue_limit) times). A permanent error, or no
//!    retries left, or an exhausted retry budget: the message goes to `Q.dlq` the
//!    [`DeadLetterMode`] says (by default `basic.reject(requeue = false)`, and the broker
//!    dead-letters it with x-death reason `rejected`). The final error is logged with the message
//!    id (event "message dead-lettered").
//!
//! The worker never holds a delayed message: waiting happens in the broker's delay queues, or,
//! with [`RetryMode::Native`] on RabbitMQ 4.3+, in the quorum queue itself (the worker consumes
//! over AMQP 1.0, retries with `modified` + `x-opt-delivery-time` and dead-letters through the
//! queue's DLX with the reason; see [`RetryMode`]).
//!
//! # Every end of a delivery
//!
//! Each is tested on a scripted broker, without RabbitMQ, in `src/delivery/tests.rs` (whole
//! deliveries: builder, decoding, handler, policy, settling) and `src/settle/tests.rs` (the
//! settling rules):
//!
//! | end | what the broker sees |
//! |---|---|
//! | the handler succeeds | `basic.ack` (batched) |
//! | a transient error | a retry copy through the delay levels, confirmed, then the original acked |
//! | [`HandlerError::retry_after`] | the same, after exactly that delay |
//! | a permanent error, retries or budget exhausted | `basic.reject(requeue = false)` ([`DeadLetterMode::Reject`]) or an annotated copy to `Q.dlx`, confirmed, then an ack ([`DeadLetterMode::Annotate`]) |
//! | a body that does not decode, headers cut on receipt | dead-lettered at once (reason `undecodable`), the handler never called |
//! | the handler panics | a transient error carrying the panic message |
//! | the handler times out ([`WorkerBuilder::handler_timeout`]) | a transient error ([`TimedOut`]), unless the policy forwards it |
//! | a failure of the forward kind ([`Forward`]) | a copy to the destination, confirmed, then an ack; dead-lettered (`forward_unconfigured`) without a destination |
//! | a malformed `x-death` | a sanitized copy to the queue, confirmed, then an ack |
//! | the shutdown grace period ends (hard stop) | nothing: the broker requeues it when the channel closes |
//! | settling itself panics | `basic.reject(requeue = true)` after a pause |
//! | a copy not confirmed (nacked, returned, timed out) | `basic.reject(requeue = true)` after a 1 s pause |
//! | the publishing connection blocked (resource alarm) | the same, not counted toward the requeue limit |
//! | the requeue limit reached | `basic.reject(requeue = false)` (reason `requeue_limit`) |
//! | the delivery's channel closed | nothing: the broker redelivers it |
//!
//! A retry copy keeps every property of the original (`message_id`, `correlation_id`,
//! `content_type`, `delivery_mode`, user headers...) except `expiration` (a per-message TTL would
//! make the copy leave a delay level early) and a `user_id` other than the worker's own user
//! (the broker refuses those). A delay above the delay infrastructure's maximum is clamped to it
//! (logged). When a copy cannot be published the original is requeued after a 1 s pause, so a
//! broker refusing publishes does not become a hot redelivery loop.
//!
//! # Connection loss
//!
//! The worker runs its own reconnect loop (lapin's auto-recovery stays off): on a lost
//! connection, a closed consumer channel or a consumer cancelled by the broker, it closes the
//! session, waits out [`reconnect_backoff`](WorkerBuilder::reconnect_backoff) (exponential
//! 100 ms .. 30 s, full jitter), connects again, declares or verifies the topology, applies the
//! prefetch and consumes. Handlers still running for the lost session finish, but their
//! deliveries are never settled on the new channel (tags belong to their channel): the broker
//! redelivers them. Readiness ([`WorkerStatus::is_ready`]) is false meanwhile.
//!
//! # Delivery guarantees
//!
//! At least once. A message is acked only after success or after its retry copy is confirmed;
//! whatever was not settled when a channel died or the grace period ran out is redelivered by the
//! broker (`redelivered = true`), so a handler can see a message twice: use
//! [`Context::message_id`] for idempotency. Settlements that did not reach the broker are counted
//! in [`metrics_names::SETTLE_FAILURES`].
//!
//! # Observability
//!
//! A `delivery` tracing span per message (queue, message_id, attempt, outcome, duration_ms); an
//! event per retry ("retry scheduled": attempt, delay_ms, error) and per dead-letter ("message
//! dead-lettered": reason, error). Metrics go through the [`metrics`] facade (names in
//! [`metrics_names`]); readiness through [`WorkerStatus`].
//!
//! `outcome = acked` is recorded when the ack is handed to its channel's ack batch, not when the
//! frame reaches the broker: acks go out as one `multiple` ack per run of a tenth of the prefetch
//! or after a 2 ms linger. A worker killed in between has its message redelivered (at least once,
//! as for any ack the broker has not received).
//!
//! [`RetryPolicy`]: redeliver_core::RetryPolicy
//! [`HandlerError::retry_after`]: redeliver_core::HandlerError::retry_after
//! [`TimedOut`]: redeliver_core::TimedOut
//! [`Forward`]: redeliver_core::Forward

// Lints: `[workspace.lints]` in Cargo.toml.
// docs.rs marks the items of optional features with the feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The delivery path, top-down, each step calling only the ones below it: `runtime` (reconnect
// loop) -> `session` (one connection) -> `delivery` (decode, call the handler) -> `outcome`
// (what to do) -> `settle` (the rules) -> `copy` (the replacing copies) and `broker` (what
// settling needs of the broker), which `link` implements on lapin.
mod acks;
mod broker;
mod builder;
mod copy;
mod delivery;
pub mod env;
mod error;
#[cfg(test)]
mod fake;
mod handler;
#[cfg(feature = "health")]
#[cfg_attr(docsrs, doc(cfg(feature = "health")))]
pub mod health;
mod link;
mod meters;
pub mod metrics_names;
mod native;
mod outcome;
mod permits;
mod publishing;
mod requeue;
mod runtime;
mod session;
mod settings;
mod settle;
mod shared;
mod signal;
mod status;

pub use builder::WorkerBuilder;
pub use error::{SettingError, WorkerError};
pub use handler::{Context, DecodeError, FromDelivery, Handler, Json, Raw, Text};
pub use runtime::{run_all, Worker};
pub use settings::{DeadLetterMode, RetryMode, Settings};
pub use signal::shutdown_on_signal;
pub use status::{WorkerState, WorkerStatus};
