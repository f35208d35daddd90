//! The work queue's type a retry mode needs, for a case run on both transports
//! (`common/transport.rs`).

// Helpers are `pub` for the test files that include this module.
#![allow(unreachable_pub)]

use redeliver_amqp::QueueType;
use redeliver_worker::RetryMode;

/// The work queue's type a mode needs: native retries only on a quorum queue, `levels` on the
/// type the case was written for.
pub fn queue_type(mode: RetryMode, levels: QueueType) -> QueueType {
    match mode {
        RetryMode::Levels => levels,
        _ => QueueType::Quorum,
    }
}
