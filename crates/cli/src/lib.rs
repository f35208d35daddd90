//! `redeliver`: the operator CLI of the redeliver framework, as a library. The binary
//! (`src/main.rs`) calls [`run`]; [`fuzzing`] (hidden) is for the fuzz targets in `fuzz/`.
//! Nothing else is public: the commands are the interface.
//!
//! Argument parsing is in `cli`, each command in its own module, error texts and exit codes in
//! `errors`.

#![warn(missing_debug_implementations, unreachable_pub)]
#![forbid(unsafe_code)]

mod app;
mod browse;
mod cli;
mod conn;
mod dlq;
mod errors;
mod message;
mod outbox;
#[cfg(feature = "postgres")]
mod outbox_db;
mod output;
#[cfg(feature = "postgres")]
mod parked;
mod probe;
mod select;
mod text;
mod topology;
mod triage;

#[doc(hidden)]
pub mod fuzzing;

use std::process::ExitCode;

use clap::Parser as _;

/// Runs the command given by the process's arguments, printing its output on stdout and any
/// error (with hints) on stderr: the whole of the `redeliver` binary. Exits with 2 on a usage
/// error (or a refusal that needs a flag), 1 on any other error.
pub fn run() -> ExitCode {
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
