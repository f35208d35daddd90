//! Shared helpers of the CLI's integration tests: run the real binary against the real broker.
//!
//! Every test uses its own random prefix for every object (delay levels included) and deletes
//! them through [`Cleanup`], which runs even when the test panics. Connection, counting and
//! draining come from `redeliver-testkit`.

#![allow(dead_code)] // each test file uses a different subset

use std::process::Command;
use std::time::Duration;

use futures::StreamExt as _;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};

#[allow(unused_imports)] // each test file uses a different subset
pub use redeliver_testkit::{
    amqp_url, connect, drain, message_id, ready_count as count, wait_count,
    DEFAULT_AMQP_URL as DEFAULT_URL,
};

/// Delay levels used by the tests: enough for their delays, and far fewer objects to declare.
pub const LEVELS: u8 = 10;

/// A fresh prefix such as "t3f9a0c1b2d4e-".
pub fn prefix() -> String {
    redeliver_testkit::unique_prefix("t", 12, "-")
}

/// What one run of the binary printed.
#[derive(Debug)]
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn ok(self) -> Self {
        assert_eq!(
            self.code, 0,
            "expected success\nstdout:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        self
    }
}

/// Runs `redeliver ARGS` with AMQP_URL set to the test broker.
pub fn cli(args: &[&str]) -> Out {
    cli_env(args, &[("AMQP_URL", &amqp_url())])
}

/// Runs `redeliver ARGS` with exactly these extra environment variables (AMQP_URL removed
/// unless given).
pub fn cli_env(args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redeliver"));
    cmd.args(args).env_remove("AMQP_URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("cannot run the redeliver binary");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
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
                args.push("--include-delay");
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

/// Publishes with a confirm to `queue` through the default exchange.
pub async fn publish(conn: &Connection, queue: &str, id: &str, body: &[u8], headers: FieldTable) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let props = BasicProperties::default()
        .with_message_id(id.into())
        .with_correlation_id(format!("corr-{id}").as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(headers);
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        },
        body,
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    ch.close(200, "ok".into()).await.unwrap();
}

pub fn user_headers() -> FieldTable {
    let mut h = FieldTable::default();
    h.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    h
}

/// Consumes `n` messages of `queue` and rejects each (requeue = false) in delivery order, so
/// the broker dead-letters them into the DLQ in that same order.
pub async fn reject_all(conn: &Connection, queue: &str, n: usize) {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(1, BasicQosOptions { global: false })
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "test-rejecter".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("no delivery to reject")
            .unwrap()
            .unwrap();
        d.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    ch.close(200, "ok".into()).await.unwrap();
}

/// Parses `dlq list --json` output and returns the message ids in order.
pub fn ids_of(json: &serde_json::Value) -> Vec<String> {
    json.as_array()
        .expect("a JSON array")
        .iter()
        .map(|m| m["message_id"].as_str().unwrap_or_default().to_owned())
        .collect()
}
