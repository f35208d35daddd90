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
//! without one it exits with status 1 within seconds and says how to start one. Quiet but for
//! a progress bar and the summary; `RUST_LOG=info` shows the worker's log.

#[path = "image_processing/job.rs"]
mod job;
#[path = "demo/run.rs"]
mod run;

use std::process::ExitCode;

use anyhow::bail;
use clap::Parser;
use redeliver::worker::env::ServiceSettings;
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
    let service = ServiceSettings::from_env()?;
    let cfg = WorkerBuilder::from_env()?.settings().clone();
    // Quiet unless asked: a newcomer sees a progress bar and the summary, not every delivery's
    // log line (the dead-lettered ones are in the summary); `RUST_LOG=info` shows them. lapin
    // logs the expected 404 of the worker's passive declares as errors: off by default, since
    // a real failure ends the demo with its own message.
    let directives = match std::env::var_os("RUST_LOG") {
        Some(_) => service.log_filter.clone(),
        None => "error,lapin=off".to_owned(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&directives)?)
        .with_writer(std::io::stderr)
        .init();
    // Drawn on stderr, and only on a terminal: piped output stays the summary alone.
    let bar = indicatif::ProgressBar::new(u64::from(args.count + args.poison)).with_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} {bar:30} {pos}/{len} messages acked or dead-lettered, {elapsed}",
        )?,
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(100));
    let summary = run::run_demo_with(&args, &cfg, &|settled, total| {
        bar.set_length(u64::from(total));
        bar.set_position(u64::from(settled));
    })
    .await;
    bar.finish_and_clear();
    let summary = summary?;
    print!("{}", summary.render());
    if !summary.adds_up() {
        bail!("the summary does not add up: a message was lost or processed twice");
    }
    Ok(())
}
