//! The `demo` example runs to completion against the local broker and its summary adds up.
//!
//! The example's modules are compiled into this test (`#[path]`), so the test runs the very
//! code `cargo run --example demo` runs. The binary itself (exit codes, the no-broker message)
//! is checked too: `cargo test --workspace` builds it next to this test, and a narrower run
//! builds it first.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../examples/image_processing/job.rs"]
mod job;
#[path = "../examples/demo/run.rs"]
mod run;

use std::process::Command;
use std::time::Duration;

use clap::Parser;
use job::ImageJob;
use redeliver::{Settings, Worker};
use redeliver_testkit::{amqp_url, START_BROKER};
use run::Args;

fn config(url: &str) -> Settings {
    Worker::builder(url).settings().clone()
}

fn demo_args(extra: &[&str]) -> Args {
    let mut argv = vec!["demo"];
    argv.extend_from_slice(extra);
    Args::try_parse_from(argv).expect("demo arguments")
}

#[tokio::test]
async fn demo_runs_to_completion_and_adds_up() {
    let args = demo_args(&["--count", "40", "--poison", "4", "--seed", "7"]);
    let cfg = config(&amqp_url());
    let summary = match run::run_demo_with(&args, &cfg, &|_, _| {}).await {
        Ok(s) => s,
        Err(e) => panic!("the demo failed: {e:#}\n{}", START_BROKER),
    };
    println!("{}", summary.render());

    assert_eq!(summary.published(), 44);
    assert!(summary.adds_up(), "{summary:#?}");
    assert_eq!(summary.processed + summary.dead_lettered, 44);
    assert_eq!(
        summary.dead_lettered_poison, 4,
        "every malformed body in the DLQ"
    );
    // The failures are seeded: what happened is what the seed predicts, exactly.
    assert_eq!(summary.processed, summary.expected_processed);
    assert_eq!(summary.retried, summary.expected_retried);
    assert_eq!(
        summary.dead_lettered_exhausted,
        40 - summary.expected_processed
    );
    assert_eq!(summary.handler_calls, 40 + summary.retried);
    // About half fail on each attempt: there are retries, and they are spread over attempts.
    assert!(summary.retried > 10, "{summary:#?}");
    assert_eq!(
        summary.delays.iter().map(|d| d.deliveries).sum::<u32>(),
        summary.retried
    );
    for d in &summary.delays {
        // Full jitter below min(cap, base * 2^(attempt-1)).
        let bound = Duration::from_millis((100u64 << (d.attempt - 1)).min(1000));
        assert!(
            d.scheduled[2] <= bound,
            "attempt {}: {:?} > {bound:?}",
            d.attempt,
            d.scheduled
        );
        assert!(d.scheduled[0] <= d.scheduled[1] && d.scheduled[1] <= d.scheduled[2]);
        // A copy cannot arrive before its delay: each observed delay is at least its scheduled
        // one, so the minimum and the mean are too (a few ms of clock slack).
        let slack = Duration::from_millis(5);
        assert!(
            d.observed[0] + slack >= d.scheduled[0],
            "attempt {}: {d:?}",
            d.attempt
        );
        assert!(
            d.observed[1] + slack >= d.scheduled[1],
            "attempt {}: {d:?}",
            d.attempt
        );
    }
    assert!(
        summary.elapsed < Duration::from_secs(20),
        "{:?}",
        summary.elapsed
    );
    let rendered = summary.render();
    for word in ["processed", "retried", "dead-lettered", "adds up"] {
        assert!(rendered.contains(word), "{rendered}");
    }
}

#[test]
fn simulated_failures_are_seeded_and_about_half() {
    let job = |id| ImageJob {
        id,
        url: String::new(),
        width: 1,
        fail_rate: 0.5,
        seed: 42,
    };
    let fails = (0..2000)
        .filter(|&id| job::fetch_fails(&job(id), 0))
        .count();
    assert!((850..1150).contains(&fails), "{fails} of 2000 failed");
    // Reproducible, and independent across attempts.
    assert_eq!(job::fetch_fails(&job(5), 1), job::fetch_fails(&job(5), 1));
    let differs = (0..200).any(|id| job::fetch_fails(&job(id), 0) != job::fetch_fails(&job(id), 1));
    assert!(differs);
    let never = ImageJob {
        fail_rate: 0.0,
        ..job(1)
    };
    assert_eq!(run::failures_before_success(&never, 3), Some(0));
    let always = ImageJob {
        fail_rate: 1.0,
        ..job(1)
    };
    assert_eq!(run::failures_before_success(&always, 3), None);
}

#[tokio::test]
async fn without_a_broker_the_demo_says_how_to_start_one() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let cfg = config(&format!("amqp://guest:secret@127.0.0.1:{port}/%2f"));
    let err = run::run_demo_with(&demo_args(&[]), &cfg, &|_, _| {})
        .await
        .expect_err("no broker on that port");
    let text = format!("{err:#}");
    assert!(text.contains("rabbitmq-server -detached"), "{text}");
    assert!(text.contains("apt-get install rabbitmq-server"), "{text}");
    assert!(
        text.contains("docker compose -f compose/docker-compose.yml up -d rabbitmq"),
        "{text}"
    );
    assert!(
        !text.contains("secret"),
        "the password must not be printed: {text}"
    );
}

/// What a newcomer sees with `cargo run --example demo`: the summary on stdout and nothing else
/// (no log lines: quiet unless RUST_LOG is set, and the progress bar is drawn only on a
/// terminal); without a broker, exit 1 within seconds, saying what to run.
#[test]
fn the_example_binary_exits_0_on_a_demo_and_1_without_a_broker() {
    // Built first when `cargo test` did not (a narrow `--test demo`): never a pass without it.
    let bin = redeliver_testkit::examples::example_binary(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")),
        "demo",
    );
    let out = Command::new(&bin)
        .args(["--count", "20", "--poison", "2"])
        .env("AMQP_URL", amqp_url())
        .env_remove("RUST_LOG")
        .output()
        .expect("run the example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed ({}):\n{stdout}\n{stderr}\n{}",
        out.status,
        START_BROKER
    );
    assert!(stdout.contains("adds up"), "{stdout}");
    assert!(stdout.contains("published"), "{stdout}");
    assert!(
        stdout.lines().count() < 25,
        "the summary, not a log:\n{stdout}"
    );
    assert_eq!(stderr, "", "nothing but the summary by default");

    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let started = std::time::Instant::now();
    let out = Command::new(&bin)
        .env(
            "AMQP_URL",
            format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
        )
        .output()
        .expect("run the example");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "a missing broker is reported within seconds, took {:?}",
        started.elapsed()
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rabbitmq-server -detached"), "{stderr}");
    assert!(
        stderr.contains("apt-get install rabbitmq-server"),
        "{stderr}"
    );
}
