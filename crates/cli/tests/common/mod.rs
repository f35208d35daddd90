//! The CLI's broker tests: run the real binary against the real broker, with its own random
//! prefix for every object (delay levels included), deleted through `Cleanup` (`cleanup.rs`),
//! which runs even when the test panics; `declare.rs` declares a topology through the binary.
//! Connection, counting, draining and rejecting come from `redeliver-testkit`.

// Test code: helpers are `pub` for the test files that include this module.
#![allow(unreachable_pub)]

use std::process::Command;

use redeliver_testkit::process::Output;

/// Delay levels used by the tests: enough for their delays, and far fewer objects to declare.
pub const LEVELS: u8 = 10;

/// A fresh prefix such as "t3f9a0c1b2d4e-".
pub fn prefix() -> String {
    redeliver_testkit::unique_prefix("t", 12, "-")
}

/// Runs `redeliver ARGS` with exactly these extra environment variables (AMQP_URL removed
/// unless given).
pub fn cli_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redeliver"));
    cmd.args(args).env_remove("AMQP_URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Output::of(&mut cmd)
}
