//! `redeliver`: the operator CLI of the redeliver framework.
//!
//! Kept thin: argument parsing is in `cli`, each command in its own module, error texts and
//! exit codes in `errors`.

// Lints: `[workspace.lints]` in Cargo.toml.

mod app;
mod browse;
mod cli;
mod conn;
mod dlq;
mod errors;
mod message;
mod outbox;
mod output;
#[cfg(feature = "postgres")]
mod parked;
mod probe;
mod select;
mod text;
mod topology;
mod triage;

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    // clap prints usage errors itself and exits with code 2.
    let cli = cli::Cli::parse();
    // The outbox is in PostgreSQL: no broker URL to read, no broker to connect to.
    if let cli::Command::Outbox(cmd) = cli.command {
        return outbox::main(cmd, cli.connect_timeout);
    }
    let (inv, checked) = app::prepare(&cli);
    let result = checked.and_then(|()| {
        // Two worker threads are plenty for one connection; the CLI is I/O bound.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)?;
        rt.block_on(app::run(cli, &inv.urls))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("{}", errors::render(&e, &inv.urls, &inv.hints));
            ExitCode::from(errors::exit_code(&e))
        }
    }
}
