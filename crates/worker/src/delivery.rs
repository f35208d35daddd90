//! One delivery, from the consume loop to its settlement: decode, call the handler, decide the
//! [`Outcome`], [settle](crate::settle) it. Generic over the session's [`Link`] to the broker,
//! so that every end of a delivery is tested without one (`delivery/tests.rs`).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use lapin::message::Delivery;
use redeliver_amqp::headers::{self, RetryState};
use redeliver_core::HandlerError;
use tracing::{debug, error, info_span, Instrument, Span};

use crate::broker::Link;
use crate::handler::{Context, HandlerFuture};
use crate::meters::Meters;
use crate::outcome::{self, Outcome, Settled};
use crate::permits::Permit;
use crate::settle::{Message, Rules, Settle};
use crate::shared::Shared;

#[cfg(test)]
mod tests;

/// How much earlier than its time a native retry may arrive and still run: the clocks of the
/// worker that scheduled it and of the one that receives it may differ by this much (NTP keeps
/// hosts within a few milliseconds). A broker that ignores the delivery time hands the message
/// out again within about a millisecond, so any real delay above this is caught.
const EARLY_TOLERANCE: std::time::Duration = std::time::Duration::from_millis(50);

/// What a session gives each of its deliveries: its link to the broker, the settling rules,
/// the metric handles and the queue's name.
pub(crate) struct Deliveries<L> {
    pub(crate) link: L,
    pub(crate) rules: Rules,
    pub(crate) meters: Meters,
    /// Shared with every handler's [`Context`] without a copy.
    pub(crate) queue: Arc<str>,
}

impl<L> Deliveries<L> {
    pub(crate) fn new(link: L, rules: Rules, meters: Meters) -> Self {
        Self {
            link,
            meters,
            queue: Arc::clone(&rules.queue),
            rules,
        }
    }
}

/// Starts handling `delivery`, which holds one of the worker's concurrency permits until it is
/// settled.
///
/// The task is polled once here before it becomes a task: a delivery whose handler finishes
/// without waiting (a filter, an in-memory update) is settled on the spot, which spares a task
/// and often a wake-up of another runtime thread to steal it. One that waits is spawned, and
/// its first poll as a task registers the real waker.
pub(crate) fn start<L: Link>(
    worker: &Arc<Shared>,
    session: &Arc<Deliveries<L>>,
    delivery: Delivery,
    permit: Permit,
) {
    session.link.register(delivery.delivery_tag);
    let retry = RetryState::read(delivery.properties.headers().as_ref());
    let task = DeliveryTask {
        worker: Arc::clone(worker),
        session: Arc::clone(session),
        ctx: Context::new(
            Arc::clone(&session.queue),
            delivery,
            retry,
            Arc::clone(&worker.draining),
        ),
        _permit: permit,
    };
    // Nothing of a delivery may unwind into the consume loop (polled inline) or silently end
    // its task: each step catches its own panics; this is the last line.
    let mut run = Box::pin(AssertUnwindSafe(task.run()).catch_unwind().map(|r| {
        if let Err(panic) = r {
            error!(error = %outcome::panicked(&*panic).message(), "a delivery task panicked; the broker redelivers its message when the channel closes");
        }
    }));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if run.as_mut().poll(&mut cx).is_pending() {
        worker.tracker.spawn(run);
    }
}

struct DeliveryTask<L> {
    worker: Arc<Shared>,
    session: Arc<Deliveries<L>>,
    /// The handler gets a clone: the delivery and its retry state are read through it, without
    /// a copy, for as long as either side needs them.
    ctx: Context,
    _permit: Permit,
}

impl<L: Link> DeliveryTask<L> {
    async fn run(self) {
        let delivery = self.ctx.delivery();
        let state = self.ctx.retry();
        let span = info_span!(
            "delivery",
            queue = %self.worker.config.queue,
            message_id = %Message::of(delivery, state).message_id,
            attempt = state.attempt,
            redelivered = delivery.redelivered,
            retry_mode = %self.session.rules.retry_mode,
            delivery_tag = delivery.delivery_tag,
            outcome = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
            reason = tracing::field::Empty,
            error = tracing::field::Empty,
            // Set by an inbox that found the message already processed (acked, handler not run).
            duplicate = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        {
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            // Each attempt is a child of the context the message carries: the publisher's span
            // for a first delivery, the same one again for its retry copies.
            let parent =
                redeliver_amqp::trace_context::extract(delivery.properties.headers().as_ref());
            let _ = span.set_parent(parent);
        }
        self.process(span.clone()).instrument(span).await;
    }

    /// Runs inside `span`, which it records the outcome on.
    async fn process(self, span: Span) {
        let meters = &self.session.meters;
        let _in_flight = InFlight::enter(&meters.in_flight);
        // The clock is read for the total only if something records it.
        let started =
            (!span.is_disabled() || tracing::enabled!(tracing::Level::DEBUG)).then(Instant::now);
        meters.received.increment(1);
        let outcome = self.outcome().await;
        let delivery = self.ctx.delivery();
        let settle = Settle {
            broker: self.session.link.broker(delivery),
            rules: &self.session.rules,
            message: Message::of(delivery, self.ctx.retry()),
            meters,
            requeues: &self.worker.requeues,
            hard_stop: &self.worker.hard_stop,
        };
        let settled = match AssertUnwindSafe(settle.run(outcome)).catch_unwind().await {
            Ok(settled) => settled,
            Err(panic) => {
                let error = outcome::panicked(&*panic).message();
                error!(error = %error, "settling the delivery panicked; requeueing it");
                let requeue = Outcome::Requeue {
                    reason: redeliver_core::DeadLetterReason::SettlePanicked,
                    error,
                };
                AssertUnwindSafe(settle.run(requeue))
                    .catch_unwind()
                    .await
                    .unwrap_or(Settled::Failed)
            }
        };
        if let Some(started) = started {
            let elapsed_ms = started.elapsed().as_millis() as u64;
            span.record("outcome", tracing::field::display(settled));
            span.record("duration_ms", elapsed_ms);
            debug!(outcome = %settled, duration_ms = elapsed_ms, "delivery done");
        }
    }

    /// What to do with the delivery.
    async fn outcome(&self) -> Outcome {
        let delivery = self.ctx.delivery();
        let state = self.ctx.retry();
        if let Some(sanitized) = headers::sanitize_x_death(delivery.properties.headers().as_ref()) {
            // Before anything can make the broker dead-letter it (a reject, or a quorum queue's
            // delivery limit): RabbitMQ crashes reading such a header.
            return Outcome::Sanitize(sanitized);
        }
        if let Some(removed) =
            redeliver_amqp::headers_removed(delivery.properties.headers().as_ref())
        {
            // Headers nested too deep for lapin's parser were cut on receipt (the amqp crate's
            // frame guard): no handler sees a message that is not what was sent. A poison pill,
            // never retried; the broker's dead letter (reject mode) keeps the original headers.
            return Outcome::undecodable(&removed);
        }
        if let Some(early) = state.early_by(crate::settle::now_ms()) {
            if early > EARLY_TOLERANCE {
                // A native retry the broker handed out before its time: never run it early.
                return Outcome::Early { remaining: early };
            }
        }
        let config = &self.worker.config;
        if state.attempt == 0 {
            // Fresh message: a deposit in the retry budget (retries withdraw).
            config.settings.policy.record_attempt();
        }
        // A user decoder may panic too; the task must survive to settle the delivery.
        let prepared = std::panic::catch_unwind(AssertUnwindSafe(|| {
            config.handler.prepare(self.ctx.clone())
        }));
        let result = match prepared {
            Ok(Err(decode)) => return Outcome::undecodable(&decode),
            Ok(Ok(fut)) => {
                let handler_started = Instant::now();
                let result = self.call(fut).await;
                self.session
                    .meters
                    .handler_duration
                    .record(handler_started.elapsed().as_secs_f64());
                result
            }
            Err(panic) => Some(Err(outcome::panicked(&*panic))),
        };
        // User code runs here too (classifier rules, the error's Display): a panic is a
        // transient failure of this delivery, decided without the rules.
        let policy = &config.settings.policy;
        match std::panic::catch_unwind(AssertUnwindSafe(|| Outcome::decide(policy, state, result)))
        {
            Ok(outcome) => outcome,
            Err(panic) => {
                let error = HandlerError::transient(format!(
                    "classifying the handler's result panicked: {}",
                    outcome::panicked(&*panic).message()
                ));
                Outcome::decide(policy, state, Some(Err(error)))
            }
        }
    }

    /// Runs the handler future with panic catching, the optional timeout, and the hard stop;
    /// `None` when the shutdown grace period ended it.
    async fn call(&self, fut: HandlerFuture) -> Option<Result<(), HandlerError>> {
        let timeout = self.worker.config.settings.handler_timeout;
        let guarded = async move {
            let caught = AssertUnwindSafe(fut).catch_unwind();
            let caught = match timeout {
                Some(d) => match tokio::time::timeout(d, caught).await {
                    Ok(r) => r,
                    Err(_) => return Err(outcome::timed_out(d)),
                },
                None => caught.await,
            };
            caught.unwrap_or_else(|panic| Err(outcome::panicked(&*panic)))
        };
        tokio::select! {
            biased;
            r = guarded => Some(r),
            _ = self.worker.hard_stop.cancelled() => None,
        }
    }
}

/// Keeps the in-flight gauge right on every exit path, panics included.
struct InFlight<'a>(&'a metrics::Gauge);

impl<'a> InFlight<'a> {
    fn enter(gauge: &'a metrics::Gauge) -> Self {
        gauge.increment(1.0);
        Self(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}
