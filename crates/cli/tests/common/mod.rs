//! The CLI's broker tests: run the real binary against the real broker, with its own random
//! prefix for every object (delay levels included), deleted through [`Cleanup`], which runs
//! even when the test panics. Connection, counting, draining and rejecting come from
//! `redeliver-testkit`.

// Test code: helpers are `pub` for the test files that include this module.
#![allow(unreachable_pub)]

use std::process::Command;

use redeliver_testkit::amqp_url;
use redeliver_testkit::process::Output;

/// Delay levels used by the tests: enough for their delays, and far fewer objects to declare.
pub const LEVELS: u8 = 10;

/// A fresh prefix such as "t3f9a0c1b2d4e-".
pub fn prefix() -> String {
    redeliver_testkit::unique_prefix("t", 12, "-")
}

/// Runs `redeliver ARGS` with AMQP_URL set to the test broker.
pub fn cli(args: &[&str]) -> Output {
    cli_env(args, &[("AMQP_URL", &amqp_url())])
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

/// Deletes the topologies of `queues` and the delay infrastructure of `prefix` when dropped,
/// through the binary itself (synchronous, so it also runs while a test unwinds).
pub struct Cleanup {
    pub prefix: String,
    pub queues: Vec<String>,
}

impl Cleanup {
    pub fn new(prefix: &str, queues: &[&str]) -> Self {
        Self {
            prefix: prefix.to_owned(),
            queues: queues.iter().map(|q| (*q).to_owned()).collect(),
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let levels = LEVELS.to_string();
        let queues = if self.queues.is_empty() {
            vec!["none".to_owned()]
        } else {
            self.queues.clone()
        };
        for (i, q) in queues.iter().enumerate() {
            let mut args = vec![
                "topology",
                "delete",
                q,
                "--prefix",
                &self.prefix,
                "--levels",
                &levels,
                "--yes",
            ];
            if i == 0 {
                // --force: tests may leave retries in the levels or parked messages.
                args.extend(["--include-delay", "--force"]);
            }
            let out = cli(&args);
            if out.code != 0 {
                eprintln!("cleanup of {q} failed: {}", out.stderr);
            }
        }
    }
}

/// Declares `queue`'s topology (and the delay levels) through the binary.
pub fn declare(queue: &str, prefix: &str, extra: &[&str]) {
    let levels = LEVELS.to_string();
    let mut args = vec![
        "topology", "declare", queue, "--prefix", prefix, "--levels", &levels,
    ];
    args.extend_from_slice(extra);
    cli(&args).ok();
}
