//! PostgreSQL for redeliver consumers: an **inbox** that makes a handler's database effects
//! happen once per message, and an **outbox** that publishes messages only after the
//! transaction that decided them commits.
//!
//! The worker delivers at least once: a message may be handled twice (a worker killed after
//! its handler succeeded but before the ack, a retry copy confirmed twice). The [`Inbox`]
//! records each processed (consumer, message id) in the same transaction as the handler's
//! writes, and skips a message it has seen. The [`Outbox`] stores outgoing messages in that
//! transaction (or any other), and a [`Relay`] publishes them through the confirmed
//! [`Publisher`](redeliver_amqp::Publisher) once committed.
//!
//! # Guarantees
//!
//! - **Effects written through the handler's transaction ([`Tx`]) happen exactly once per
//!   (consumer, message id)**, as long as the inbox row is kept ([`Inbox`]'s retention):
//!   the inbox row and the effects commit together or not at all, and a second delivery, even
//!   a concurrent one, finds the row and is acked without running the handler.
//! - **Outbox messages are published after the commit, at least once, and never without it.**
//!   A rolled-back transaction stores nothing and wakes no relay. A relay that dies between
//!   the broker's confirm and its own commit publishes the message again, with the same
//!   `message_id`, which a consumer behind an inbox then skips.
//! - **Every committed outbox row ends published or parked.** A row the broker refuses
//!   (unroutable, nacked, a missing exchange, no confirm in time) is tried again with backoff
//!   ([`Relay::policy`]) while the rows behind it go on, and after the policy's last retry it
//!   is parked in its table for an operator ([`ParkedRows`], `redeliver outbox parked`), never
//!   deleted unpublished.
//! - **Effects outside the database** (an HTTP call, an email) stay at least once: the
//!   handler may run again after a rollback or a failed commit. Give such calls an
//!   idempotency key (the message id).
//!
//! # Pool size
//!
//! Every connection the crate uses comes from the pool you pass, so size it with this rule:
//!
//! | who | connections |
//! |---|---|
//! | an [`Inbox`]'s handler | one per delivery in flight: the worker's `concurrency` (a copy waiting on a concurrent duplicate holds its connection too) |
//! | a [`Relay`] | 2: its `LISTEN`, held for as long as it runs, and its rounds |
//! | [`Inbox::spawn_cleanup`] | 1 while a cleanup runs |
//! | your own queries outside the handler | what they need |
//!
//! `max_connections >= concurrency + 2 × relays + 1 + your own`: a worker of concurrency 10
//! with a relay and the cleanup in the same process needs 13, more than sqlx's default of 10.
//! A pool that is too small does not fail: deliveries wait for a connection, up to the pool's
//! `acquire_timeout`, and then fail as transient errors (retried).
//!
//! # Schema
//!
//! Tables live in a [`Schema`] (default `redeliver.inbox` and `redeliver.outbox`), created by
//! the crate's versioned migrations ([`Schema::migrate`]), safe to run from several workers at
//! once; or managed by the team ([`Schema::without_migrations`]), then only checked.
//!
//! Queries are built at run time (sqlx without its `macros` feature): building needs no
//! database. TLS to the database is the application's: enable one of sqlx's `tls-*`
//! features and pass the pool.
//!
//! ```no_run
//! use redeliver::postgres::{Inbox, Relay, Schema, TransactionalHandler, Tx};
//! use redeliver::{Context, HandlerError, Raw, Worker};
//! use redeliver::postgres::sqlx;
//!
//! struct Record;
//!
//! impl TransactionalHandler<Raw> for Record {
//!     async fn handle(&self, m: Raw, ctx: Context, tx: &mut Tx) -> Result<(), HandlerError> {
//!         sqlx::query("INSERT INTO seen (id, body) VALUES ($1, $2)")
//!             .bind(ctx.message_id())
//!             .bind(&m.0)
//!             .execute(&mut **tx)
//!             .await
//!             .map_err(HandlerError::transient)?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // Concurrency 10, a relay and the cleanup: 10 + 2 + 1 connections (see "Pool size").
//! let pool = sqlx::postgres::PgPoolOptions::new()
//!     .max_connections(13)
//!     .connect("postgres://app@127.0.0.1/app")
//!     .await?;
//! let inbox = Inbox::new(pool.clone(), "recorder");
//! inbox.prepare().await?;
//! // One token for the whole service: SIGTERM or SIGINT stops the cleanup, the relay and the
//! // worker.
//! let token = redeliver::shutdown_on_signal()?;
//! inbox.spawn_cleanup(token.clone());
//!
//! // Publishes what handlers store with `Tx::publish`, after their commit; it connects to the
//! // broker itself and reconnects. A row the broker refuses is retried, then parked.
//! tokio::spawn(
//!     Relay::new(pool, "amqp://127.0.0.1:5672/%2f")
//!         .schema(Schema::default())
//!         .run(token.clone()),
//! );
//!
//! Worker::builder("amqp://127.0.0.1:5672/%2f")
//!     .queue("records")
//!     .handler(inbox.handler(Record))
//!     .build()?
//!     .run(token)
//!     .await?;
//! # Ok(()) }
//! ```

// Lints: `[workspace.lints]` in Cargo.toml.
// docs.rs marks the items of optional features with the feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod inbox;
mod outbox;
mod parked;
mod relay;
mod schema;

pub use error::{Error, IdentifierError};
pub use inbox::{
    Cleaned, Inbox, InboxFnHandler, InboxHandler, TransactionalHandler, Tx, INBOX_DUPLICATES_TOTAL,
    NO_IDEMPOTENCY_KEY, NO_MESSAGE_ID,
};
pub use outbox::{pending, Outbox, OutboxMessage, Pending};
pub use parked::{ParkReason, ParkedFilter, ParkedRow, ParkedRows, ParkedStats};
pub use relay::{
    default_relay_policy, Relay, RelayState, RelayStatus, OUTBOX_OLDEST_AGE_SECONDS, OUTBOX_PARKED,
    OUTBOX_PARKED_OLDEST_AGE_SECONDS, OUTBOX_PARKED_TOTAL, OUTBOX_PENDING, OUTBOX_PUBLISHED_TOTAL,
    OUTBOX_REFUSED_TOTAL,
};

pub use schema::Schema;

/// The sqlx this crate is built with: the pool and transaction types of its API are sqlx's, so
/// a service that uses this re-export never ends up with two versions.
pub use sqlx;
