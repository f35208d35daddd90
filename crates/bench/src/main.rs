//! `redeliver-bench`: redeliver's Worker and Publisher against a minimal hand-written lapin
//! consumer, on the same broker, in one run. See BENCHMARKS.md at the repository root.
//!
//! The parent process declares the topology, publishes and reports; every consumer (raw or
//! redeliver) runs in a child process (this same binary, hidden `child` subcommand) so that the
//! RSS figures are the consumer's own and not polluted by the publisher or by earlier scenarios.

// Lints: `[workspace.lints]` in Cargo.toml, but the bench is a measuring tool, not library code:
// it stops with a panic on what it cannot measure, and its modules' items are `pub` to one
// another inside this binary.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    unreachable_pub
)]

mod broker;
mod child;
mod config;
mod payload;
mod pg;
mod proc_ctl;
mod publish;
mod report;
mod scenarios;
mod stats;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::config::{Scenario, DEFAULT_DATABASE_URL, DEFAULT_URL};

/// A log filter for the consumer children (diagnosis only: a subscriber costs CPU per message).
const CHILD_LOG_ENV: &str = "REDELIVER_BENCH_CHILD_LOG";

#[derive(Parser, Debug)]
#[command(
    name = "redeliver-bench",
    about = "redeliver vs a raw lapin consumer: throughput, latency, delay accuracy, memory, inbox and outbox"
)]
struct Cli {
    /// Small sizes (5,000 messages, 2 rounds, 100 delay probes over 0-1 s, 2,000 parked, 1,000
    /// inbox messages and outbox rows) that prove the benchmark works in a couple of minutes;
    /// the numbers are not meaningful.
    #[arg(long)]
    short: bool,
    /// Interleaved rounds per side of the throughput scenarios (happy, retry, scale, inbox;
    /// outbox runs once per round, outbox-refused its clean and refused backlogs once each)
    /// [default: 5; 2 with --short]. Fewer than 3 never give a conclusive ratio.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: Option<u32>,
    /// PID of the RabbitMQ node's beam.smp process, for the broker CPU figures [default: the
    /// `os_pid` the management API reports, if that process is on this host].
    #[arg(long)]
    broker_pid: Option<u32>,
    /// Broker URL [default: the local broker on 127.0.0.1:5672, guest account].
    // Neither the environment's value nor the default is shown in --help: both carry a password.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = DEFAULT_URL,
        hide_env_values = true,
        hide_default_value = true
    )]
    url: String,
    /// Management API base URL, used for the broker version and to sweep leftovers of this run
    /// at the end [default: http://127.0.0.1:15672, guest account].
    #[arg(
        long,
        env = "RABBITMQ_MANAGEMENT_URL",
        default_value = "http://guest:guest@127.0.0.1:15672",
        hide_env_values = true,
        hide_default_value = true
    )]
    management_url: String,
    /// PostgreSQL of the inbox and outbox scenarios (only used when they run): the run creates
    /// a schema of its own in it and drops it at the end (default:
    /// `postgres://postgres@127.0.0.1:5432/test`, trust authentication).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = DEFAULT_DATABASE_URL,
        hide_env_values = true,
        hide_default_value = true
    )]
    database_url: String,
    /// Run only these scenarios (comma separated).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Scenario>,
    /// Also write the Markdown report to this file.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Internal: one consumer process driven by the parent over stdin/stdout.
    #[command(hide = true)]
    Child(child::ChildArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Some(Command::Child(args)) => {
            // A service sets a subscriber; a consumer child sets one that keeps nothing. Without
            // any, tracing's `log` feature (turned on for the whole build by sqlx, which the
            // inbox scenario links) sends every span of lapin and the worker down its fallback
            // to the `log` crate: ~400 instructions per message that no deployed worker spends.
            // REDELIVER_BENCH_CHILD_LOG=<filter> (e.g. `redeliver_worker=info`) logs to stderr
            // instead, to see why a run misbehaves: never for the figures.
            match std::env::var(CHILD_LOG_ENV).ok().filter(|f| !f.is_empty()) {
                Some(filter) => tracing_subscriber::fmt()
                    .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                    .with_writer(std::io::stderr)
                    .try_init()
                    .map_err(|e| anyhow::anyhow!("{e}"))
                    .context("setting the consumer child's log subscriber")?,
                None => tracing::subscriber::set_global_default(
                    tracing::subscriber::NoSubscriber::default(),
                )
                .context("setting the consumer child's tracing subscriber")?,
            }
            rt.block_on(child::main(cli.url, cli.database_url, args))
        }
        None => {
            let mut sizes = if cli.short {
                config::Sizes::short()
            } else {
                config::Sizes::full()
            };
            if let Some(r) = cli.rounds {
                sizes.rounds = r;
            }
            let only = if cli.only.is_empty() {
                Scenario::all().to_vec()
            } else {
                cli.only
            };
            let opts = scenarios::RunOptions {
                url: cli.url,
                management_url: cli.management_url,
                database_url: cli.database_url,
                sizes,
                short: cli.short,
                only,
                out: cli.out,
                broker_pid: cli.broker_pid,
            };
            rt.block_on(scenarios::run_all(opts))
        }
    }
}
