//! `delay probe`: an operator's end-to-end self-test of the delay levels.
//!
//! A temporary exclusive queue is bound to the deliver exchange like a consumer's queue, one
//! probe per delay is published through the levels, and arrival times are compared with the
//! intended delays. The clock is this process's monotonic clock at both ends, so the numbers
//! include publish-confirm and delivery latency but no clock skew.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt as _;
use lapin::options::{
    BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use redeliver_amqp::DelayConfig;
use redeliver_amqp::Publisher;
use serde::Serialize;

use crate::output::{self, Table};

/// One probe's result.
#[derive(Debug)]
pub(crate) struct ProbeResult {
    pub intended: Duration,
    /// What the levels can represent: the delay rounded up to the granularity.
    pub effective: Option<Duration>,
    pub observed: Option<Duration>,
    /// Why the probe could not be sent.
    pub error: Option<String>,
}

/// One probe in `delay probe --json`; durations in milliseconds.
#[derive(Debug, Serialize)]
struct ProbeJson {
    intended_ms: f64,
    routed_ms: Option<f64>,
    observed_ms: Option<f64>,
    /// observed - routed.
    error_ms: Option<f64>,
    /// ok, lost or not_sent.
    status: &'static str,
    /// Why it was not sent.
    error: Option<String>,
}

impl From<&ProbeResult> for ProbeJson {
    fn from(r: &ProbeResult) -> Self {
        // Microsecond resolution: finer digits are noise of the clock and the float.
        let round = |ms: f64| (ms * 1000.0).round() / 1000.0;
        let ms = |d: Duration| round(d.as_secs_f64() * 1000.0);
        Self {
            intended_ms: ms(r.intended),
            routed_ms: r.effective.map(ms),
            observed_ms: r.observed.map(ms),
            error_ms: match (r.observed, r.effective) {
                (Some(o), Some(e)) => Some(round((o.as_secs_f64() - e.as_secs_f64()) * 1000.0)),
                _ => None,
            },
            status: match (&r.error, r.observed) {
                (Some(_), _) => "not_sent",
                (None, Some(_)) => "ok",
                (None, None) => "lost",
            },
            error: r.error.clone(),
        }
    }
}

fn print_json(results: &[ProbeResult], lost: usize, failed: usize) -> anyhow::Result<()> {
    let v = serde_json::json!({
        "probes": results.iter().map(ProbeJson::from).collect::<Vec<_>>(),
        "lost": lost,
        "not_sent": failed,
    });
    output::print_json(&v, "the probe results")
}

/// Runs the probe and prints its table (or JSON). Fails when a probe was lost or could not be
/// sent, after printing the results.
pub(crate) async fn run(
    conn: &Connection,
    cfg: &DelayConfig,
    prefix: &str,
    delays: &[Duration],
    grace: Duration,
    json: bool,
) -> anyhow::Result<()> {
    cfg.verify(conn)
        .await
        .context("the delay infrastructure is not in place")?;
    let queue = format!("{prefix}redeliver.probe.{}", uuid::Uuid::new_v4().simple());
    let ch = conn
        .create_channel()
        .await
        .context("cannot open a channel")?;
    // Exclusive + auto-delete: even if this process dies, the broker removes the queue when
    // the connection goes.
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .with_context(|| format!("cannot declare the probe queue '{queue}'"))?;

    let outcome = probe(conn, &ch, cfg, &queue, delays, grace).await;
    // Delete in every case; the error of the probe itself matters more than this one.
    let deleted = ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = ch.close(200, "ok".into()).await;
    let results = outcome?;
    deleted.with_context(|| format!("cannot delete the probe queue '{queue}'"))?;

    let lost = results
        .iter()
        .filter(|r| r.error.is_none() && r.observed.is_none())
        .count();
    let failed = results.iter().filter(|r| r.error.is_some()).count();
    if json {
        print_json(&results, lost, failed)?;
    } else {
        print!("{}", table(&results));
    }
    if lost > 0 {
        anyhow::bail!(
            "{lost} probe(s) did not arrive within the longest delay plus {}: check the \
             unroutable queue (`redeliver unroutable list`) and the level queues (`redeliver \
             topology show`)",
            humantime::format_duration(grace)
        );
    }
    if failed > 0 {
        anyhow::bail!("{failed} probe(s) could not be sent");
    }
    Ok(())
}

async fn probe(
    conn: &Connection,
    ch: &lapin::Channel,
    cfg: &DelayConfig,
    queue: &str,
    delays: &[Duration],
    grace: Duration,
) -> anyhow::Result<Vec<ProbeResult>> {
    ch.queue_bind(
        queue.into(),
        cfg.deliver_exchange().as_str().into(),
        cfg.deliver_binding_key(queue).as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .context("cannot bind the probe queue to the deliver exchange")?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "redeliver-probe".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .context("cannot consume from the probe queue")?;
    let publisher = Publisher::new(conn, cfg.clone())
        .await
        .context("cannot open a confirm-mode channel")?;

    let mut results: Vec<ProbeResult> = Vec::with_capacity(delays.len());
    let mut sent: HashMap<String, (usize, Instant)> = HashMap::new();
    for (i, &d) in delays.iter().enumerate() {
        let id = format!("probe-{i}-{}", uuid::Uuid::new_v4().simple());
        let route = cfg.route(queue, d);
        let effective = route.as_ref().ok().map(|r| r.effective);
        let props = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_content_type("application/json".into());
        let body = serde_json::json!({ "probe": i, "delay_ms": d.as_millis() as u64 }).to_string();
        let start = Instant::now();
        let error = match route {
            Err(e) => Some(e.to_string()),
            Ok(_) => publisher
                .publish_delayed(queue, d, body.as_bytes(), props)
                .await
                .err()
                .map(|e| e.to_string()),
        };
        if error.is_none() {
            sent.insert(id, (i, start));
        }
        results.push(ProbeResult {
            intended: d,
            effective,
            observed: None,
            error,
        });
    }

    let longest = results
        .iter()
        .filter(|r| r.error.is_none())
        .filter_map(|r| r.effective)
        .max()
        .unwrap_or_default();
    let deadline = Instant::now() + longest + grace;
    // The wait lasts the longest delay at least: show it on a terminal.
    let bar = output::waiting(sent.len() as u64, "waiting for probes");
    while !sent.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, consumer.next()).await {
            Ok(Some(Ok(d))) => {
                let at = Instant::now();
                let id = d.properties.message_id().as_ref().map(|m| m.to_string());
                if let Some((i, start)) = id.and_then(|id| sent.remove(&id)) {
                    if let Some(r) = results.get_mut(i) {
                        r.observed = Some(at.duration_since(start));
                    }
                    bar.inc(1);
                }
            }
            Ok(Some(Err(e))) => {
                bar.finish_and_clear();
                return Err(e).context("lost the probe consumer");
            }
            Ok(None) | Err(_) => break,
        }
    }
    bar.finish_and_clear();
    Ok(results)
}

fn ms(d: Duration) -> String {
    format!("{:.0}ms", d.as_secs_f64() * 1000.0)
}

/// The result table. Error = observed - effective (publish and delivery latency included).
pub(crate) fn table(results: &[ProbeResult]) -> String {
    let mut t = Table::new(&[
        ("INTENDED", 12),
        ("ROUTED", 12),
        ("OBSERVED", 12),
        ("ERROR", 12),
        ("STATUS", 80),
    ]);
    for r in results {
        let (observed, error, status) = match (&r.error, r.observed, r.effective) {
            (Some(e), _, _) => ("-".to_owned(), "-".to_owned(), format!("not sent: {e}")),
            (None, Some(o), Some(eff)) => {
                let err = o.as_secs_f64() - eff.as_secs_f64();
                (ms(o), format!("{:+.0}ms", err * 1000.0), "ok".to_owned())
            }
            (None, Some(o), None) => (ms(o), "-".to_owned(), "ok".to_owned()),
            (None, None, _) => (
                "-".to_owned(),
                "-".to_owned(),
                "LOST (not received)".to_owned(),
            ),
        };
        t.row(vec![
            ms(r.intended),
            r.effective.map_or_else(|| "-".to_owned(), ms),
            observed,
            error,
            status,
        ]);
    }
    t.render()
}
