//! `redeliver`: the operator CLI of the redeliver framework. The commands live in the
//! `redeliver_cli` library, which the fuzz targets use too.

#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    redeliver_cli::run()
}
