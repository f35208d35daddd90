//! The worker's HTTP endpoints as a test sees them: plain GETs, and the Prometheus text format.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// `GET http://{addr}{path}`: (status, body). 503 is an answer here, not an error.
///
/// # Panics
///
/// When nothing answers within 5 s.
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let url = format!("http://{addr}{path}");
    crate::mgmt::blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let mut resp = agent
            .get(&url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        let status = resp.status().as_u16();
        let body = resp.body_mut().read_to_string().expect("body");
        (status, body)
    })
    .await
}

/// Polls `GET path` until it answers `status`; returns the body.
///
/// # Panics
///
/// When it does not within `timeout`, with the last answer.
pub async fn wait_for_status(
    addr: SocketAddr,
    path: &str,
    status: u16,
    timeout: Duration,
) -> String {
    let start = Instant::now();
    loop {
        let (code, body) = get(addr, path).await;
        if code == status {
            return body;
        }
        if start.elapsed() > timeout {
            panic!("{path} still answers {code} after {timeout:?} (want {status}): {body}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One sample of the Prometheus text format.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (with its `_bucket`, `_sum`, `_count` suffix, if any).
    pub name: String,
    /// Label names and values.
    pub labels: BTreeMap<String, String>,
    /// The value.
    pub value: f64,
}

/// Parses the sample lines of a Prometheus text exposition (no escaped quotes in label values:
/// ours are queue names and small words).
///
/// # Panics
///
/// On a line that is not a sample.
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (head, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => panic!("bad sample line: {line}"),
        };
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in: {line}")),
        };
        let (name, labels) = match head.split_once('{') {
            None => (head.to_owned(), BTreeMap::new()),
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("bad labels: {line}"));
                let mut labels = BTreeMap::new();
                for pair in inner.split("\",").filter(|p| !p.is_empty()) {
                    let (k, v) = pair
                        .split_once("=\"")
                        .unwrap_or_else(|| panic!("bad label in: {line}"));
                    labels.insert(k.to_owned(), v.trim_end_matches('"').to_owned());
                }
                (name.to_owned(), labels)
            }
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// The value of the sample `name` whose labels are exactly `labels`.
pub fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    samples
        .iter()
        .find(|s| s.name == name && s.labels == want)
        .map(|s| s.value)
}
