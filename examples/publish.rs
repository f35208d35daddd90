//! Sends image jobs to the queue `examples/image_processing.rs` consumes.
//!
//! ```text
//! cargo run --example image_processing                 # the worker, in one terminal
//! cargo run --example publish -- --count 20 --fail-rate 0.5 --poison 2
//! ```
//!
//! Reads `AMQP_URL`, `REDELIVER_QUEUE` and `REDELIVER_PREFIX` like the worker, and declares the
//! same topology first (idempotent) so jobs can be sent before the worker ever ran; `--no-declare`
//! skips that where an operator owns the topology. Each job carries the failure rate and seed,
//! so the worker's simulated failures are reproducible: the same `--seed` fails the same
//! attempts.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Parser;
use futures::future::try_join_all;
use redeliver::lapin::{BasicProperties, ConnectionProperties};
use redeliver::{Publisher, Settings, Topology, WorkerBuilder};
use serde::Serialize;

/// Queue of the example worker when `REDELIVER_QUEUE` is not set.
const DEFAULT_QUEUE: &str = "images";

#[derive(Parser, Debug)]
#[command(about = "Publish image jobs for the image_processing example worker")]
struct Args {
    /// Jobs to send.
    #[arg(long, default_value_t = 10)]
    count: u32,
    /// Chance that one fetch of a job fails with a simulated connection error (0 to 1).
    #[arg(long, default_value_t = 0.5)]
    fail_rate: f64,
    /// Malformed bodies to send as well (dead-lettered at once, never retried).
    #[arg(long, default_value_t = 0)]
    poison: u32,
    /// Jobs with width 0 to send as well (a permanent error: dead-lettered without retry).
    #[arg(long, default_value_t = 0)]
    invalid: u32,
    /// Large images to send as well (width 8000): each runs past the worker's time limit on the
    /// standard queue and is forwarded to its heavy queue, where it succeeds.
    #[arg(long, default_value_t = 0)]
    large: u32,
    /// Seed of the simulated failures (random when not given).
    #[arg(long)]
    seed: Option<u64>,
    /// Queue to send to (default: REDELIVER_QUEUE, else `images`), before the prefix.
    #[arg(long)]
    queue: Option<String>,
    /// Do not declare the topology first.
    #[arg(long)]
    no_declare: bool,
}

/// The job format of `examples/image_processing/job.rs` (kept in step with its `ImageJob`).
#[derive(Serialize)]
struct ImageJob {
    id: u64,
    url: String,
    width: u32,
    fail_rate: f64,
    seed: u64,
}

async fn run(args: Args) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&args.fail_rate) {
        bail!(
            "--fail-rate must be between 0 and 1, got {}",
            args.fail_rate
        );
    }
    let cfg = WorkerBuilder::from_env()?.settings().clone();
    let seed = args.seed.unwrap_or_else(rand::random);
    let queue = args
        .queue
        .clone()
        .or_else(|| cfg.queue().map(str::to_owned))
        .unwrap_or_else(|| DEFAULT_QUEUE.to_owned());
    let mut topology = Topology::new(queue);
    if let Some(prefix) = cfg.prefix() {
        topology = topology.prefix(prefix);
    }
    let props = ConnectionProperties::default().with_connection_name("redeliver-publish".into());
    let conn = match tokio::time::timeout(
        Duration::from_secs(5),
        redeliver::amqp::connect(cfg.url(), props, cfg.tls()),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => bail!(no_broker(&cfg, &e)),
        Err(_) => bail!(no_broker(&cfg, &"no answer within 5 s")),
    };
    if !args.no_declare {
        topology
            .declare(&conn)
            .await
            .context("declaring the topology (use --no-declare if an operator owns it)")?;
    }
    let publisher = Publisher::new(&conn, topology.configured_delay().clone()).await?;
    let queue = topology.queue_name();

    let mut messages: Vec<(String, Vec<u8>)> = Vec::new();
    for id in 1..=u64::from(args.count) {
        let job = ImageJob {
            id,
            url: format!("https://images.example/{id}.jpg"),
            width: 640,
            fail_rate: args.fail_rate,
            seed,
        };
        messages.push((format!("job-{seed:x}-{id}"), serde_json::to_vec(&job)?));
    }
    for i in 0..u64::from(args.invalid) {
        let id = u64::from(args.count) + 1 + i;
        let job = ImageJob {
            id,
            url: format!("https://images.example/{id}.jpg"),
            width: 0,
            fail_rate: 0.0,
            seed,
        };
        messages.push((format!("invalid-{seed:x}-{i}"), serde_json::to_vec(&job)?));
    }
    for i in 0..u64::from(args.large) {
        let id = u64::from(args.count) + u64::from(args.invalid) + 1 + i;
        let job = ImageJob {
            id,
            url: format!("https://images.example/{id}-large.jpg"),
            width: 8000,
            fail_rate: 0.0,
            seed,
        };
        messages.push((format!("large-{seed:x}-{i}"), serde_json::to_vec(&job)?));
    }
    for i in 0..args.poison {
        // Truncated JSON: undecodable, so the worker dead-letters it without calling the handler.
        messages.push((
            format!("poison-{seed:x}-{i}"),
            br#"{"id": 1, "url": "https://images.example/bro"#.to_vec(),
        ));
    }
    // Confirms in flight together: one round trip for the batch, not one per message.
    let sends = messages.iter().map(|(id, body)| {
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_content_type("application/json".into());
        publisher.publish_bytes("", &queue, body, props)
    });
    try_join_all(sends)
        .await
        .with_context(|| format!("publishing to {queue}"))?;
    println!(
        "published {} jobs, {} invalid, {} malformed and {} large to {queue} (fail rate {:.0}%, \
         seed {seed}); watch the worker's log, and `{}` in the management UI",
        args.count,
        args.invalid,
        args.poison,
        args.large,
        args.fail_rate * 100.0,
        topology.dlq_name()
    );
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

fn no_broker(cfg: &Settings, error: &dyn std::fmt::Display) -> String {
    format!(
        "cannot reach RabbitMQ at {}: {error}\n\
         Start a local broker with one of:\n  \
         rabbitmq-server -detached\n  \
         docker compose -f compose/docker-compose.yml up rabbitmq\n\
         or set AMQP_URL to a reachable broker.",
        redeliver::amqp::url::redact(cfg.url())
    )
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
