//! Logging for the example services: stderr, JSON when `REDELIVER_LOG_FORMAT=json`, filtered
//! by `RUST_LOG`. The worker reads these settings but leaves installing a subscriber to the
//! service.

use anyhow::anyhow;
use redeliver::worker::env::{LogFormat, ServiceSettings};

/// Installs the subscriber. Without `RUST_LOG`, the `quiet` crates (lapin, sqlx: chatty at
/// info) log warnings only, next to our info lines.
pub(crate) fn init(cfg: &ServiceSettings, quiet: &[&str]) -> anyhow::Result<()> {
    let directives = match std::env::var_os("RUST_LOG") {
        Some(_) => cfg.log_filter.clone(),
        None => quiet.iter().fold(cfg.log_filter.clone(), |mut d, krate| {
            d.push_str(&format!(",{krate}=warn"));
            d
        }),
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&directives)
        .map_err(|e| anyhow!("invalid RUST_LOG={directives:?}: {e}"))?;
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cfg.log_format {
        LogFormat::Json => fmt.json().try_init(),
        LogFormat::Pretty => fmt.try_init(),
    }
    .map_err(|e| anyhow!("cannot install the logger: {e}"))
}
