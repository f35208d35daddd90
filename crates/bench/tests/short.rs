//! Runs the benchmark binary in `--short` mode against the local broker (AMQP_URL) and the local
//! PostgreSQL (DATABASE_URL) and checks that it completes and prints every table. No timing
//! assertions: CI machines vary; this only proves the benchmark still works. Needs a running
//! RabbitMQ (`rabbitmq-server -detached`) and PostgreSQL (`bash scripts/postgres.sh up`).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

#[test]
fn short_mode_completes_and_prints_the_tables() {
    // The test broker's management API (RABBITMQ_MGMT_URL), made to answer, not the bench's
    // default: a management API of another node gives the bench that node's version.
    let management =
        redeliver_testkit::fixtures::management_url().unwrap_or_else(|e| panic!("{e}"));
    let version = tokio::runtime::Runtime::new()
        .expect("a tokio runtime")
        .block_on(redeliver_testkit::broker_version());
    let out = Command::new(env!("CARGO_BIN_EXE_redeliver-bench"))
        .args(["--short", "--management-url", &management])
        .output()
        .expect("running redeliver-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "redeliver-bench --short failed ({}).\nIf it cannot reach the broker, start one with \
         `rabbitmq-server -detached` (or set AMQP_URL); if it cannot reach PostgreSQL, \
         `bash scripts/postgres.sh up` (or set DATABASE_URL).\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for needle in [
        "| scenario | queue | side |",
        "| happy | quorum | raw lapin |",
        "| happy | quorum | redeliver |",
        "| happy | classic | redeliver |",
        "| retry | quorum | redeliver |",
        "#### redeliver / raw, per round pair",
        "| happy | quorum | rawb | 2 |",
        "#### Retry round trip (scenario 2): where the CPU goes",
        "#### Scale-out (scenario 5)",
        "| 4 | 200 | 800 | 2 |",
        "#### Memory with the prefetch in flight (scenario 6)",
        "#### Delay accuracy",
        "#### Memory under waiting retries",
        "| inbox | quorum | raw lapin | 2 |",
        "| inbox | quorum | redeliver | 2 |",
        "| inbox | quorum | raw | 2 |",
        "#### Exactly-once effects (scenario 7)",
        "#### Outbox relay (scenario 8)",
        "| **median of 2** |",
        "#### Outbox relay with refused rows (scenario 9)",
        "| **median of 2** | refused |",
        "| 1 % refused | 2 |",
        "| outbox relay, 1 % of rows refused: good rows/s |",
        "#### Native retries (scenario 11)",
        "| retry | worker, Levels (AMQP 0-9-1) | 2 |",
        "#### Targets",
        "| inbox (an INSERT per message, exactly once): msg/s |",
        "| conclusive |",
    ] {
        assert!(
            stdout.contains(needle),
            "missing {needle:?} in the report:\n{stdout}\nstderr:\n{stderr}"
        );
    }
    // Scenario 11 runs its native side where the queue holds retries (RabbitMQ 4.3+) and says
    // why it did not elsewhere.
    let native_rows = [
        "| retry | worker, Native (AMQP 1.0) | 2 |",
        "| happy | worker, Native (AMQP 1.0) | 2 |",
        "retry: retries/s, native / levels",
    ];
    for needle in native_rows {
        assert_eq!(
            stdout.contains(needle),
            version.holds_native_retries(),
            "RabbitMQ {version}: {needle:?} should be in the report only from 4.3 on:\n{stdout}\n\
             stderr:\n{stderr}"
        );
    }
    if !version.holds_native_retries() {
        assert!(
            stdout.contains("holds no retries in a queue"),
            "RabbitMQ {version}: the report should say why scenario 11 ran no native side:\n\
             {stdout}"
        );
    }
}

#[test]
fn unreachable_database_fails_at_once_with_instructions() {
    let out = Command::new(env!("CARGO_BIN_EXE_redeliver-bench"))
        .args(["--short", "--only", "happy,inbox"])
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/test")
        .output()
        .expect("running redeliver-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot connect to PostgreSQL")
            && stderr.contains("scripts/postgres.sh up"),
        "no hint on how to start PostgreSQL:\n{stderr}"
    );
    // Before any scenario ran.
    assert!(!stderr.contains("== scenario"), "{stderr}");
}

#[test]
fn unreachable_broker_fails_with_instructions() {
    let out = Command::new(env!("CARGO_BIN_EXE_redeliver-bench"))
        .args(["--short", "--url", "amqp://guest:guest@127.0.0.1:1/%2f"])
        .output()
        .expect("running redeliver-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rabbitmq-server -detached"),
        "no hint on how to start a broker:\n{stderr}"
    );
}
