//! What a session checks on the broker besides consuming: the policy's forward destination
//! before it starts, and its own topology while it runs.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::Connection;
use redeliver_amqp::{Topology, TopologyError};
use redeliver_core::Forward;
use tracing::{debug, error, info, warn};

use crate::error::WorkerError;
use crate::metrics_names as m;

/// Checks, passively, that the policy's forward destination exists, on a channel of its own (a
/// missing object closes the channel). Forwarding to a missing queue would only requeue every
/// forwarded message until the requeue limit dead-letters it.
pub(super) async fn verify_forward(
    connection: &Connection,
    to: &Forward,
) -> Result<(), WorkerError> {
    let failed = |source| WorkerError::ForwardDestination {
        destination: to.to_string(),
        source,
    };
    let channel = connection.create_channel().await.map_err(failed)?;
    let checked = match to.queue() {
        Some(queue) => channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map(drop),
        None => {
            channel
                .exchange_declare(
                    to.exchange().into(),
                    lapin::ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
        }
    };
    if channel.status().connected() {
        let _ = channel
            .close(200, "forward destination checked".into())
            .await;
    }
    checked.map_err(failed)
}

/// Checks, every `every`, that the topology is still there, re-declares what was deleted
/// unless the worker only verifies, and measures the parking queue.
///
/// What is checked, and why each deletion matters while the worker runs:
/// - the delay infrastructure: a deleted parking queue turns the unroutable exchange into a
///   black hole, so retries whose queue is gone would be dropped; a deleted level drops retries;
/// - `Q.dlx` and `Q.dlq`: the broker dead-letters into a missing exchange without telling
///   anyone (a classic `Q` drops the message; a quorum `Q` with at-least-once dead-lettering
///   holds it and retries only every few minutes), and with `Q.dlq` gone `Q.dlx` sends dead
///   letters to the parking queue through its alternate exchange, out of the operator's sight.
///
/// A periodic passive check is the one signal that covers every case. The worker consumes `Q`,
/// not `Q.dlq`, so no consumer-cancel notification arrives when `Q.dlq` is deleted; and
/// `basic.reject` succeeds whether or not the dead letter was routed, so the dead-letter path
/// itself learns nothing in the default [`DeadLetterMode::Reject`](crate::DeadLetterMode)
/// (only an annotated publish would come back returned). The cost is one passive declare per
/// object per interval on a channel of its own; a dead letter between a deletion and the next
/// check can still be lost on a classic `Q`, which is what the interval bounds.
pub(super) async fn watch_topology(
    connection: Arc<Connection>,
    topology: Topology,
    verify_only: bool,
    every: Duration,
) {
    let name = topology.configured_delay().unroutable_name();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !connection.status().connected() {
            return;
        }
        // Checks the delay infrastructure, Q.dlx, Q.dlq and Q; declaring is idempotent, so the
        // whole topology is declared again, binding Q.dlq to Q.dlx anew with it.
        match topology.verify(&connection).await {
            Ok(()) => {}
            Err(TopologyError::Missing { object }) if !verify_only => {
                warn!(missing = %object, "part of the topology was deleted while running; declaring it again");
                match topology.declare(&connection).await {
                    Ok(()) => info!(missing = %object, "topology declared again"),
                    Err(e) => warn!(error = %e, "cannot declare the topology again"),
                }
            }
            Err(TopologyError::Missing { object }) => {
                error!(missing = %object, "part of the topology was deleted and this worker only verifies: retries or dead letters may be dropped until it is declared again (redeliver topology declare)");
            }
            Err(e) => debug!(error = %e, "cannot check the topology"),
        }
        measure_parking(&connection, &name).await;
    }
}

/// Measures the parking queue (passive declare on a throwaway channel: a 404 closes it).
async fn measure_parking(connection: &Connection, name: &str) {
    let Ok(channel) = connection.create_channel().await else {
        return;
    };
    let declared = redeliver_amqp::passive_queue(&channel, name).await;
    match declared {
        Ok(Some(q)) => {
            metrics::gauge!(m::DELAY_UNROUTABLE_MESSAGES, m::LABEL_PARKING_QUEUE => name.to_owned())
                .set(f64::from(q.message_count()));
            if q.message_count() > 0 {
                warn!(queue = %name, messages = q.message_count(), "messages parked in the delay infrastructure's unroutable queue");
            }
        }
        Ok(None) => debug!(queue = %name, "the unroutable queue is missing: not measured"),
        Err(e) => debug!(queue = %name, error = %e, "cannot measure the unroutable queue"),
    }
    if channel.status().connected() {
        let _ = channel.close(200, "done".into()).await;
    }
}
