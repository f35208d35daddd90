//! Connecting (with a clear message when the broker is not there), passive queue counts, and
//! the end-of-run cleanup of every object this run declared.

use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use lapin::{Connection, ConnectionProperties};
use redeliver_amqp::TlsConfig;
use redeliver_testkit::mgmt::Client;

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
    redeliver_testkit::unique_prefix("rbench-", 8, "-")
}

/// Ready messages in a queue (passive declare on a throwaway channel: a 404 closes it).
pub async fn queue_count(conn: &Connection, queue: &str) -> Result<u32> {
    let depth = redeliver_testkit::queue_depth(conn, queue)
        .await
        .with_context(|| format!("passive declare of queue '{queue}'"))?;
    Ok(depth.ready)
}

/// Sweeps whatever is left with the run prefix through the management API at `base` (queues
/// and exchanges the AMQP cleanup did not know about); returns the names deleted.
pub fn management_sweep(base: &str, prefix: &str) -> Result<Vec<String>, String> {
    Client::new(base).delete_prefix(prefix)
}

/// The version and cluster name of the node behind the management API at `base`.
pub fn management_identity(base: &str) -> Option<(String, Option<String>)> {
    let overview = Client::new(base).get_json("/api/overview").ok()?;
    let version = overview["rabbitmq_version"].as_str()?.to_owned();
    let cluster = overview["cluster_name"].as_str().map(str::to_owned);
    Some((version, cluster))
}

/// The version and cluster name the broker at `url` announces when a connection opens: the
/// broker the scenarios run against, whatever the management URL points at.
pub async fn amqp_identity(url: &str) -> Option<(String, Option<String>)> {
    // With the run's TLS settings: an amqps:// broker with a private CA answers only to those.
    let uri: lapin::uri::AMQPUri = url.parse().ok()?;
    let tls = tls_from_env().load().ok()?;
    let info = redeliver_amqp::ServerInfo::probe_uri(&uri, tls)
        .await
        .ok()?;
    let version = info.version_text();
    (!version.is_empty()).then(|| (version.to_owned(), info.cluster_name().map(str::to_owned)))
}

/// The OS pid of the broker node behind the management API at `base` (`/api/overview`'s node,
/// `/api/nodes/<node>`'s `os_pid`), if that process is on this host: a pid whose
/// `/proc/<pid>/comm` is not `beam.smp` belongs to another machine or container.
pub fn broker_pid(base: &str) -> Option<u32> {
    let c = Client::new(base);
    let node = c
        .get_json("/api/overview")
        .ok()?
        .get("node")?
        .as_str()?
        .to_string();
    let info = c.get_json(&format!("/api/nodes/{node}")).ok()?;
    let pid = match info.get("os_pid")? {
        serde_json::Value::String(s) => s.parse().ok()?,
        serde_json::Value::Number(n) => u32::try_from(n.as_u64()?).ok()?,
        _ => return None,
    };
    is_beam(pid).then_some(pid)
}

/// Whether `pid` is a running Erlang VM on this host.
pub fn is_beam(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().starts_with("beam"))
        .unwrap_or(false)
}
