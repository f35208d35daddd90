//! The binary on the default test broker, and the cleanup of a test's topologies through it.

use redeliver_testkit::amqp_url;
use redeliver_testkit::process::Output;

use crate::common::{cli_env, LEVELS};

/// Runs `redeliver ARGS` with AMQP_URL set to the test broker.
pub(crate) fn cli(args: &[&str]) -> Output {
    cli_env(args, &[("AMQP_URL", &amqp_url())])
}

/// Deletes the topologies of `queues` and the delay infrastructure of `prefix` when dropped,
/// through the binary itself (synchronous, so it also runs while a test unwinds).
pub(crate) struct Cleanup {
    pub(crate) prefix: String,
    pub(crate) queues: Vec<String>,
}

impl Cleanup {
    pub(crate) fn new(prefix: &str, queues: &[&str]) -> Self {
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
