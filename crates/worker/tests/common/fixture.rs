//! The objects most broker tests of the worker start from, on the test broker (the TLS tests
//! start from their own broker).

// Helpers are `pub` for the test files that include this module.
#![allow(unreachable_pub)]

use redeliver_amqp::lapin::Connection;
use redeliver_amqp::{QueueType, Topology};

use crate::common::Names;

/// The objects most tests start from: unique names (their objects are deleted when they drop, so
/// keep the binding), a connection, and queue `q`'s topology with its own delay levels, and its
/// full name.
pub async fn fixture(
    test: &str,
    queue_type: QueueType,
    levels: u8,
    level_type: QueueType,
) -> (Names, Connection, Topology, String) {
    let names = Names::new(test);
    let conn = redeliver_testkit::connect().await;
    let topo = names.topology("q", queue_type, names.delay(levels, level_type));
    let queue = topo.queue_name();
    (names, conn, topo, queue)
}
