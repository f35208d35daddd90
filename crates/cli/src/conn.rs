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

/// The broker URLs the arguments name, in the order to try them (never empty). Errors never
/// contain the password.
pub(crate) fn broker_urls(cli: &Cli) -> Result<Vec<BrokerUrl>, UsageError> {
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
    // command talks to one broker: the first that answers, in the list's order, as the worker
    // picks its first choice.
    BrokerUrl::parse_list(&raw).map_err(usage)
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

/// Connects to the first of `urls` that accepts, each bounded by `timeout`. A node that is
/// down does not stop an operator whose list names others: its failure is a warning on stderr
/// (redacted, escaped) and the next URL is tried. The error is the last URL's.
pub(crate) async fn connect_any(
    urls: &[BrokerUrl],
    tls: &TlsConfig,
    timeout: Duration,
) -> anyhow::Result<Connection> {
    let mut last = None;
    for (i, url) in urls.iter().enumerate() {
        match connect(url, tls, timeout).await {
            Ok(conn) => return Ok(conn),
            Err(e) if i + 1 < urls.len() => {
                let text = url.scrub(&redeliver_core::error_chain(e.as_ref()));
                eprintln!(
                    "warning: {}; trying the next URL of the list",
                    crate::text::escape(&text)
                );
                last = Some(e);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no broker URL")))
}

/// Connects, bounded by `timeout` (a black-holed host would otherwise hang for minutes).
/// Errors carry the redacted URL; `errors::explain` turns the cause into a hint.
async fn connect(
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
