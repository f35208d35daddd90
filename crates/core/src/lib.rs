//! The retry policy of redeliver: backoff, jitter, cap, max retries, error classification and a
//! retry budget, turned into a [`Decision`] for each failed delivery.
//!
//! This crate is pure: no I/O, no async runtime, no broker client. The worker crate asks a
//! [`RetryPolicy`] what to do with a failed delivery and then publishes a delayed copy or
//! dead-letters the message; everything here is deterministic given a seed and a clock.
//!
//! ```
//! use std::time::Duration;
//! use redeliver::{Classifier, DeadLetterReason, Decision, HandlerError, Jitter, RetryPolicy};
//!
//! #[derive(Debug, thiserror::Error)]
//! #[error("malformed order")]
//! struct Malformed;
//!
//! let policy = RetryPolicy::exponential(Duration::from_millis(100))
//!     .cap(Duration::from_secs(60))
//!     .jitter(Jitter::None)
//!     .max_retries(5)
//!     .classifier(Classifier::default().permanent_on::<Malformed>());
//!
//! // A transient failure on the third delivery (two retries so far): retry in 400 ms.
//! let err = HandlerError::transient("connection reset");
//! assert_eq!(
//!     policy.decide(2, None, &err),
//!     Decision::Retry { delay: Duration::from_millis(400), attempt: 3 }
//! );
//!
//! // An anyhow error wrapping a Malformed, under context: permanent, dead-letter at once.
//! let err: HandlerError = anyhow::Error::new(Malformed).context("order 17").into();
//! assert_eq!(policy.decide(0, None, &err), Decision::DeadLetter(DeadLetterReason::Permanent));
//!
//! // Out of retries.
//! let err = HandlerError::transient("still down");
//! assert_eq!(
//!     policy.decide(5, None, &err),
//!     Decision::DeadLetter(DeadLetterReason::RetriesExhausted { retries: 5 })
//! );
//! ```
//!
//! # Error classification
//!
//! A handler returns a [`HandlerError`]: [`transient`](HandlerError::transient) (retry with
//! backoff), [`permanent`](HandlerError::permanent) (dead-letter now),
//! [`retry_after`](HandlerError::retry_after) (retry after exactly this delay), or an
//! [`anyhow::Error`] converted with `?`/`into()`, which is *unclassified*. The policy's
//! [`Classifier`] decides unclassified errors by looking for registered error types in the
//! error, its `source()` chain and its `anyhow` context layers.
//!
//! **Default: an unclassified error is transient** — retried within `max_retries` and the
//! budget — because a failure not known to be permanent deserves bounded retries. Use
//! [`Classifier::permanent_by_default`] for Celery's behaviour (retry only what
//! `autoretry_for` lists).
//!
//! # Delays
//!
//! [`Backoff`] gives the un-jittered delay of retry `n` (0 = first retry): constant, linear,
//! exponential `min(cap, base * factor^n)`, or a fixed schedule. A policy takes a backoff's
//! parameters where it chooses the backoff: [`RetryPolicy::exponential`] (factor 2),
//! [`RetryPolicy::linear`], [`RetryPolicy::constant`], [`RetryPolicy::fixed`], or any
//! [`Backoff`] given whole to [`RetryPolicy::from_backoff`]. [`Jitter`] then randomises it:
//! none, full `rand(0, d)`, equal `d/2 + rand(0, d/2)` or decorrelated
//! `min(cap, rand(base, prev * 3))`. All arithmetic saturates: any attempt up to `u32::MAX` and
//! any factor give a delay between zero and the cap, never a panic. Randomness comes from a
//! seedable RNG ([`RetryPolicy::seed`]) so that tests are reproducible.
//!
//! Something retried in place rather than through the broker (the worker's reconnect loop) takes
//! its pacing from [`Backoff::delays`]: the same backoff and jitter as an iterator of delays,
//! reset after a success.
//!
//! # Retry budget
//!
//! A [`RetryBudget`] (Finagle's `RetryBudget`, the idea behind gRPC retry throttling) allows
//! retries up to `percent_can_retry` (20 %) of the first attempts seen over the last `ttl`
//! (10 s), plus a reserve of `min_retries_per_sec` (10). When it is empty the decision is
//! [`DeadLetterReason::BudgetExhausted`] or a later retry, as [`BudgetExhausted`] says. Time
//! comes from a [`Clock`]; [`ManualClock`] makes budget tests deterministic.
//!
//! ```
//! use std::time::Duration;
//! use redeliver::policy::ManualClock;
//! use redeliver::{BudgetConfig, DeadLetterReason, Decision, HandlerError, RetryBudget, RetryPolicy};
//!
//! let budget = RetryBudget::with_clock(
//!     BudgetConfig { min_retries_per_sec: 0, ..BudgetConfig::default() },
//!     ManualClock::new(),
//! );
//! let policy = RetryPolicy::constant(Duration::from_secs(1)).budget(budget);
//! for _ in 0..5 {
//!     policy.record_attempt(); // 5 first attempts * 20 % = 1 retry
//! }
//! let err = HandlerError::transient("boom");
//! assert!(matches!(policy.decide(0, None, &err), Decision::Retry { .. }));
//! assert_eq!(policy.decide(0, None, &err), Decision::DeadLetter(DeadLetterReason::BudgetExhausted));
//! ```
//!
//! # Coming from Celery
//!
//! [`RetryPolicy::celery`] reproduces Celery 5's `get_exponential_backoff_interval(factor,
//! retries, maximum, full_jitter)`:
//! `countdown = min(maximum, factor * 2 ** retries)`, then `random.randrange(countdown + 1)`
//! when jitter is on, then `max(0, countdown)`, in whole seconds, with Celery's defaults
//! (factor 1, maximum 600, jitter on, `max_retries` 3). Celery's `retries` is this crate's
//! `retries_so_far` (0 on the first retry).
//!
//! The option-by-option mapping (`autoretry_for`, `retry_backoff_max`, `countdown`, …) is the
//! table "Coming from Celery" of the `redeliver` crate's front page (its README).
//!
//! ```
//! use std::time::Duration;
//! use redeliver::RetryPolicy;
//!
//! let p = RetryPolicy::celery().seed(1);
//! for retries in 0..12 {
//!     let countdown = 600u64.min(1 << retries);
//!     let d = p.delay_for(retries, None);
//!     assert_eq!(d.subsec_nanos(), 0); // whole seconds
//!     assert!(d.as_secs() <= countdown); // randrange(countdown + 1)
//! }
//! ```

// Lints: `[workspace.lints]` in Cargo.toml.
// docs.rs marks the items of optional features with the feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backoff;
mod budget;
mod clock;
mod error;
mod forward;
mod jitter;
mod nanos;
mod policy;
mod reason;

pub use backoff::{Backoff, Delays};
pub use budget::{BudgetConfig, BudgetExhausted, RetryBudget};
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{error_chain, BoxError, Classifier, ErrorKind, HandlerError};
pub use forward::{Forward, TimedOut};
pub use jitter::Jitter;
pub use policy::{Decision, RetryPolicy, DEFAULT_CAP, DEFAULT_MAX_RETRIES};
pub use reason::DeadLetterReason;
