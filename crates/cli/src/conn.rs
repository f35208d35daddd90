//! Where to connect: the broker URL (from --url, --url-file, --password-file), the TLS
//! settings, and connecting within a time limit.

use std::time::Duration;

use anyhow::Context as _;
use lapin::{Connection, ConnectionProperties};
use redeliver_amqp::url::{self, UrlError};
use redeliver_amqp::TlsConfig;

pub(crate) use redeliver_amqp::url::BrokerUrl;

use crate::cli::{Cli, DEFAULT_URL};
use crate::errors::{Unreachable, UsageError};

/// The broker URL the arguments name. Errors never contain the password.
pub(crate) fn broker_url(cli: &Cli) -> Result<BrokerUrl, UsageError> {
    let usage = |e: UrlError| UsageError(format!("--url / AMQP_URL: {e}"));
    let mut raw = match &cli.url_file {
        Some(path) => url::read_secret_file("the broker URL", path).map_err(usage)?,
        None => cli.url.clone().unwrap_or_else(|| DEFAULT_URL.to_owned()),
    };
    if let Some(path) = &cli.password_file {
        let password = url::read_secret_file("the broker password", path).map_err(usage)?;
        raw = url::with_password(&raw, &password).map_err(usage)?;
    }
    // The same list syntax as the worker's AMQP_URL (one environment serves both), with its
    // checks: no list mixing amqps:// and amqp://, no `;` that may belong to a password. A
    // command talks to one broker: the first URL, as the worker's first choice.
    let mut urls = BrokerUrl::parse_list(&raw).map_err(usage)?;
    Ok(urls.swap_remove(0))
}

/// The TLS settings the arguments name.
pub(crate) fn tls_config(cli: &Cli) -> TlsConfig {
    let mut t = TlsConfig::new();
    if let Some(ca) = &cli.tls_ca_file {
        t = t.ca_file(ca);
    }
    if let (Some(c), Some(k)) = (&cli.tls_cert_file, &cli.tls_key_file) {
        t = t.client_cert(c, k);
    }
    t.sasl_external(cli.sasl_external)
}

/// Connects, bounded by `timeout` (a black-holed host would otherwise hang for minutes).
/// Errors carry the redacted URL; `errors::explain` turns the cause into a hint.
pub(crate) async fn connect(
    url: &BrokerUrl,
    tls: &TlsConfig,
    timeout: Duration,
) -> anyhow::Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name("redeliver-cli".into());
    let attempt = redeliver_amqp::connect_url(url, props, tls);
    match tokio::time::timeout(timeout, attempt).await {
        Ok(res) => {
            res.with_context(|| format!("cannot connect to the broker at {}", url.redacted()))
        }
        Err(_) => Err(anyhow::Error::new(Unreachable(format!(
            "no answer within {}",
            humantime::format_duration(timeout)
        )))
        .context(format!(
            "cannot connect to the broker at {}",
            url.redacted()
        ))),
    }
}
