//! The `image_processing` example's worker in one process, to see redeliver work: publishes
//! jobs (some malformed), consumes them with retries, prints a summary, deletes what it
//! declared and exits 0 when every message ended acked or in the DLQ as the seed predicts.
//!
//! ```text
//! cargo run --example demo
//! cargo run --example demo -- --count 200 --fail-rate 0.7 --seed 3
//! ```
//!
//! Needs a RabbitMQ broker (`AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`);
//! without one it exits with status 1 and says how to start one.

#[path = "image_processing/job.rs"]
mod job;
#[path = "demo/run.rs"]
mod run;

use std::process::ExitCode;

use anyhow::bail;
use clap::Parser;
use redeliver::worker::env::ServiceConfig;
use redeliver::WorkerBuilder;

#[tokio::main]
async fn main() -> ExitCode {
    match demo(run::Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn demo(args: run::Args) -> anyhow::Result<()> {
    let service = ServiceConfig::from_env()?;
    let cfg = WorkerBuilder::from_env()?.settings().clone();
    // Without RUST_LOG: our info lines, but not lapin's chatter.
    let directives = match std::env::var_os("RUST_LOG") {
        Some(_) => service.log_filter.clone(),
        None => format!("{},lapin=warn", service.log_filter),
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&directives)?)
        .with_writer(std::io::stderr)
        .init();
    let summary = run::run_demo(&args, &cfg).await?;
    print!("{}", summary.render());
    if !summary.adds_up() {
        bail!("the summary does not add up: a message was lost or processed twice");
    }
    Ok(())
}
