//! The conservation harness shared by the reliability suite (`tests/reliability_*.rs`).
//!
//! A [`Scenario`] owns one uniquely prefixed topology (work queue, DLX, DLQ and its own delay
//! levels) on one broker. The test publishes messages with unique ids ([`Scenario::publish`]),
//! runs `reliability_worker` processes against it ([`Scenario::worker`]), injects its fault, and
//! then [`Scenario::account`]s for every id, one [`IdAccount`] each: acked after a success (gone
//! from every queue of the scenario, with the successes its handlers recorded before the ack,
//! and which worker process recorded each), in the DLQ (with each copy's headers), still in the
//! work queue or the delay levels, parked in the unroutable queue, or *lost* (found nowhere and
//! never recorded as a success; the suite requires none). Every id settled or handled more than
//! once is named with its count ([`Accounting::duplicates`]), so a failure says which ids were
//! lost or duplicated, not only how many. Beside the per-id account, the workers' own success
//! counter (observed after each ack frame is written) says how many success acks left the
//! processes: acks written beyond the ids acked are acks the broker never acted on (a
//! *duplicate* in the totals, as opposed to a handler that ran again without a second ack,
//! *re-handled*). Both are allowed by at-least-once, and each fault test bounds them.
//!
//! Broker URLs hold passwords: the harness hands them to worker processes through the
//! environment (`AMQP_URL`), never on a command line, and prints them redacted.
//!
//! A broker that cannot be reached fails the test with instructions, never skips it.
//!
//! The harness is split by concern: [`Scenario`] and its [`Shape`] (the topology, publishing,
//! observing the broker and the workers' files), the [`Accounting`] of every id, and the
//! [`WorkerCmd`] / [`WorkerProc`] worker processes, the inbox workers and the end of an inbox
//! scenario ([`assert_inbox_end`]), and the outbox's end checks ([`assert_published`]). The extra broker nodes of the disruptive
//! tests are [`crate::nodes`], the management API [`crate::mgmt`]. The fault suite in native
//! retry mode (`tests/native_*.rs`) adds [`native`]: the retry mode each broker gets, and when
//! every retry ran against its earliest time.

use std::path::Path;

mod accounting;
mod inbox;
pub mod native;
mod outbox;
mod scenario;
mod worker;

pub use accounting::{Accounting, Ending, IdAccount, Observed};
pub use inbox::{assert_inbox_end, Delivery, End};
pub use outbox::{assert_published, wait_relayed, Copies};
pub use scenario::{Counts, Scenario, Shape};
pub use worker::{unix_ms, worker_binary, Outage, WorkerCmd, WorkerProc};

/// Prints a line the suite's report is built from (`cargo test -- --nocapture` shows it).
pub fn report(line: impl AsRef<str>) {
    println!("[reliability] {}", line.as_ref());
}

/// The non-empty lines of a file the workers write; none when it does not exist yet.
fn read_lines(path: &Path) -> Vec<String> {
    match std::fs::read_to_string(path) {
        Ok(s) => s
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("read {}: {e}", path.display()),
    }
}
