//! Connecting (with a clear message when the broker is not there), passive queue counts, and
//! the end-of-run cleanup of every object this run declared.

use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redeliver_amqp::TlsConfig;

/// TLS settings for an `amqps://` URL, from the worker's variables: `REDELIVER_TLS_CA_FILE`
/// (and the client certificate ones), so both sides of a run connect the same way.
pub fn tls_from_env() -> TlsConfig {
    let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
    let mut t = TlsConfig::new();
    if let Some(ca) = var("REDELIVER_TLS_CA_FILE") {
        t = t.ca_file(ca);
    }
    if let (Some(c), Some(k)) = (
        var("REDELIVER_TLS_CERT_FILE"),
        var("REDELIVER_TLS_KEY_FILE"),
    ) {
        t = t.client_cert(c, k);
    }
    t
}

/// Connects like the worker does (lapin's `connect_uri_with_config`, TLS when the URL says so).
pub async fn connect(url: &str) -> Result<Connection> {
    let attempt = tokio::time::timeout(
        Duration::from_secs(10),
        redeliver_amqp::connect(url, ConnectionProperties::default(), &tls_from_env()),
    )
    .await;
    match attempt {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(no_broker(url, &e.to_string())),
        Err(_) => Err(no_broker(url, "timed out after 10 s")),
    }
}

fn no_broker(url: &str, why: &str) -> anyhow::Error {
    anyhow!(
        "cannot connect to RabbitMQ at {}: {why}\n\
         The benchmark needs a running broker. Start one with\n    \
         rabbitmq-server -detached        (or: bash scripts/ensure-rabbitmq.sh)\n\
         or with Docker\n    \
         docker compose -f compose/docker-compose.yml up -d rabbitmq\n\
         or point AMQP_URL (or --url) at another broker.",
        redeliver_amqp::url::redact(url)
    )
}

/// A prefix unique to this run, e.g. `rbench-3f9a1c2e-`: every queue and exchange the run
/// declares starts with it, the delay levels included.
pub fn run_prefix() -> String {
    let n: u32 = StdRng::from_os_rng().random();
    format!("rbench-{n:08x}-")
}

/// Ready messages in a queue (passive declare on a throwaway channel: a 404 closes it).
pub async fn queue_count(conn: &Connection, queue: &str) -> Result<u32> {
    let ch = conn.create_channel().await.context("opening a channel")?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("passive declare of queue '{queue}'"))?;
    let _ = ch.close(200, "bye".into()).await;
    Ok(q.message_count())
}

/// Sweeps whatever is left with the run prefix through the management API (queues and
/// exchanges the AMQP cleanup did not know about). Returns the names deleted; an unreachable
/// management API is not an error (the AMQP cleanup already ran).
pub fn management_sweep(base: &str, prefix: &str) -> Result<Vec<String>> {
    let (auth, host) = split_credentials(base);
    let agent = ureq::Agent::new_with_defaults();
    let mut deleted = Vec::new();
    for kind in ["queues", "exchanges"] {
        let url = format!("{host}/api/{kind}/%2F?columns=name");
        let mut req = agent.get(&url);
        if let Some(a) = &auth {
            req = req.header("Authorization", a);
        }
        let list: serde_json::Value = req
            .call()
            .with_context(|| format!("GET {url}"))?
            .body_mut()
            .read_json()
            .with_context(|| format!("decoding {url}"))?;
        let names: Vec<String> = list
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|o| o.get("name").and_then(|n| n.as_str()))
                    .filter(|n| n.starts_with(prefix))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        for name in names {
            let url = format!("{host}/api/{kind}/%2F/{}", encode(&name));
            let mut req = agent.delete(&url);
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            if req.call().is_ok() {
                deleted.push(name);
            }
        }
    }
    Ok(deleted)
}

/// The broker's version from the management API (`/api/overview`), if reachable.
pub fn management_version(base: &str) -> Option<String> {
    let (auth, host) = split_credentials(base);
    let agent = ureq::Agent::new_with_defaults();
    let mut req = agent.get(format!("{host}/api/overview"));
    if let Some(a) = &auth {
        req = req.header("Authorization", a);
    }
    let v: serde_json::Value = req.call().ok()?.body_mut().read_json().ok()?;
    v.get("rabbitmq_version")
        .and_then(|s| s.as_str())
        .map(str::to_string)
}

/// `http://user:pass@host:port` -> (Basic auth header, `http://host:port`).
fn split_credentials(base: &str) -> (Option<String>, String) {
    let base = base.trim_end_matches('/');
    let Some((scheme, rest)) = base.split_once("://") else {
        return (None, base.to_string());
    };
    match rest.split_once('@') {
        Some((cred, host)) => (
            Some(format!("Basic {}", base64(cred.as_bytes()))),
            format!("{scheme}://{host}"),
        ),
        None => (None, base.to_string()),
    }
}

/// A name as one path segment: everything but RFC 3986's unreserved characters encoded.
fn encode(s: &str) -> String {
    const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    utf8_percent_encode(s, SEGMENT).to_string()
}

fn base64(input: &[u8]) -> String {
    STANDARD.encode(input)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_encoding() {
        let (auth, host) = split_credentials("http://guest:guest@127.0.0.1:15672/");
        assert_eq!(auth.as_deref(), Some("Basic Z3Vlc3Q6Z3Vlc3Q="));
        assert_eq!(host, "http://127.0.0.1:15672");
        assert_eq!(encode("a.b c"), "a.b%20c");
        assert_eq!(base64(b"ab"), "YWI=");
    }
}
