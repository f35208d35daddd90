//! The Grafana dashboard (`compose/grafana/redeliver.json`) and the alerts
//! (`compose/kubernetes/monitoring/prometheusrule.yaml`) query only metrics the worker emits: every
//! `redeliver_*` name in their PromQL is a constant of `redeliver::worker::metrics_names`, so a
//! renamed metric fails here instead of leaving an empty panel or an alert that never fires.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;

use redeliver::worker::metrics_names as m;
use serde::Deserialize;
use serde_json::Value as Json;
use serde_norway::Value as Yaml;

const DASHBOARD: &str = "compose/grafana/redeliver.json";
const RULES: &str = "compose/kubernetes/monitoring/prometheusrule.yaml";

/// Every metric the worker emits (`metrics_names`), histogram series included.
fn known_metrics() -> BTreeSet<String> {
    let mut names: BTreeSet<String> = [
        m::MESSAGES_RECEIVED,
        m::MESSAGES_SUCCEEDED,
        m::MESSAGES_RETRIED,
        m::MESSAGES_DEAD_LETTERED,
        m::MESSAGES_SANITIZED,
        m::MESSAGES_REQUEUED,
        m::SETTLE_FAILURES,
        m::HANDLER_DURATION,
        m::HANDLERS_IN_FLIGHT,
        m::CONNECTION_STATE,
        m::RECONNECTS,
        m::CONNECTION_BLOCKED,
        m::DELAY_UNROUTABLE_MESSAGES,
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    // A histogram is exported as three series.
    for suffix in ["_bucket", "_sum", "_count"] {
        names.insert(format!("{}{suffix}", m::HANDLER_DURATION));
    }
    names
}

/// The `redeliver_*` identifiers in a PromQL expression (metric names; redeliver uses no label
/// or function called so).
fn redeliver_names(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if ident(bytes[i]) {
            let start = i;
            while i < bytes.len() && ident(bytes[i]) {
                i += 1;
            }
            let word = &expr[start..i];
            if word.starts_with("redeliver_") {
                out.push(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    out
}

fn read(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {full}: {e}"))
}

fn dashboard() -> Json {
    serde_json::from_str(&read(DASHBOARD)).expect("the dashboard is JSON")
}

/// Every query of the dashboard: panel targets (rows' nested panels too) and variable queries.
fn dashboard_queries(dash: &Json) -> Vec<(String, String)> {
    fn panels<'a>(list: &'a Json, out: &mut Vec<&'a Json>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            panels(&p["panels"], out);
        }
    }
    let mut all = Vec::new();
    panels(&dash["panels"], &mut all);
    let mut queries = Vec::new();
    for p in all {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("a target without expr");
            queries.push((
                p["title"].as_str().unwrap_or("?").to_owned(),
                expr.to_owned(),
            ));
        }
    }
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"].as_str() == Some("query") {
            let q = v["query"]["query"]
                .as_str()
                .or_else(|| v["query"].as_str())
                .expect("a variable query");
            queries.push((format!("${}", v["name"].as_str().unwrap()), q.to_owned()));
        }
    }
    queries
}

fn rule_queries() -> Vec<(String, String)> {
    let doc: Yaml = serde_norway::Deserializer::from_str(&read(RULES))
        .map(|d| Yaml::deserialize(d).expect("the rules are YAML"))
        .find(|d| d["kind"].as_str() == Some("PrometheusRule"))
        .expect("a PrometheusRule");
    let mut queries = Vec::new();
    for group in doc["spec"]["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"]
                .as_str()
                .or_else(|| rule["record"].as_str())
                .expect("an alert or a record");
            queries.push((
                name.to_owned(),
                rule["expr"].as_str().expect("expr").to_owned(),
            ));
        }
    }
    queries
}

/// The names a set of queries uses that the worker does not emit.
fn unknown(queries: &[(String, String)]) -> Vec<String> {
    let known = known_metrics();
    queries
        .iter()
        .flat_map(|(at, expr)| {
            redeliver_names(expr)
                .into_iter()
                .filter(|n| !known.contains(n))
                .map(move |n| format!("{at}: {n}"))
        })
        .collect()
}

/// Parentheses, brackets and braces balance (outside string literals): a cheap syntax check.
fn balanced(expr: &str) -> bool {
    let mut stack = Vec::new();
    let mut quote = None;
    let mut escaped = false;
    for c in expr.chars() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' | '`' => quote = Some(c),
            '(' | '[' | '{' => stack.push(c),
            ')' | ']' | '}' => {
                let open = stack.pop();
                if open
                    != Some(match c {
                        ')' => '(',
                        ']' => '[',
                        _ => '{',
                    })
                {
                    return false;
                }
            }
            _ => {}
        }
    }
    stack.is_empty() && quote.is_none()
}

#[test]
fn the_name_scanner_finds_metric_names() {
    assert_eq!(
        redeliver_names(
            r#"histogram_quantile(0.9, sum by (le) (rate(redeliver_handler_duration_seconds_bucket{queue=~"a"}[5m]))) / redeliver_x"#
        ),
        vec!["redeliver_handler_duration_seconds_bucket", "redeliver_x"]
    );
    assert!(unknown(&[("t".into(), "rate(redeliver_in_flight[1m])".into())]).len() == 1);
    assert!(balanced(r#"sum(rate(x{a=~"(b"}[1m]))"#));
    assert!(!balanced("sum(rate(x[1m])"));
}

#[test]
fn the_dashboard_queries_only_metrics_the_worker_emits() {
    let queries = dashboard_queries(&dashboard());
    assert!(queries.len() > 10, "{queries:?}");
    let unknown = unknown(&queries);
    assert!(
        unknown.is_empty(),
        "not in redeliver::worker::metrics_names:\n{}",
        unknown.join("\n")
    );
    for (at, expr) in &queries {
        assert!(balanced(expr), "{at}: unbalanced: {expr}");
    }
}

#[test]
fn the_alerts_query_only_metrics_the_worker_emits() {
    let queries = rule_queries();
    let unknown = unknown(&queries);
    assert!(
        unknown.is_empty(),
        "not in redeliver::worker::metrics_names:\n{}",
        unknown.join("\n")
    );
    for (at, expr) in &queries {
        assert!(balanced(expr), "{at}: unbalanced: {expr}");
    }
}

/// The other direction: the dashboard shows every metric the worker emits, and the panels the
/// issue asks for are there (latency as quantiles over the histogram's buckets).
#[test]
fn the_dashboard_shows_every_metric() {
    let queries = dashboard_queries(&dashboard());
    let used: BTreeSet<String> = queries
        .iter()
        .flat_map(|(_, e)| redeliver_names(e))
        .collect();
    let missing: Vec<String> = known_metrics()
        .into_iter()
        // The histogram is shown through its series, not its bare name.
        .filter(|n| n != m::HANDLER_DURATION && !used.contains(n))
        .collect();
    assert!(missing.is_empty(), "not on the dashboard: {missing:?}");

    let exprs: Vec<&str> = queries.iter().map(|(_, e)| e.as_str()).collect();
    let bucket = format!("{}_bucket", m::HANDLER_DURATION);
    for q in ["0.50", "0.95", "0.99"] {
        assert!(
            exprs
                .iter()
                .any(|e| e.contains(&format!("histogram_quantile({q},")) && e.contains(&bucket)),
            "no p{q} of {bucket}"
        );
    }
    let by_reason = |metric: &str| {
        exprs
            .iter()
            .any(|e| e.contains(metric) && e.contains("by (queue, reason)"))
    };
    assert!(
        by_reason(m::MESSAGES_DEAD_LETTERED),
        "dead letters by reason"
    );
    assert!(by_reason(m::MESSAGES_REQUEUED), "requeues by reason");
    assert!(
        exprs.iter().any(|e| e.contains(m::CONNECTION_STATE)
            && e.contains(&format!("by (queue, {})", m::LABEL_STATE))),
        "connection state by state"
    );
}

/// Grafana imports it: unique panel ids, a grid position each, every query on the data-source
/// variable (so it works with whatever the Prometheus data source is called).
#[test]
fn the_dashboard_is_importable() {
    let dash = dashboard();
    assert!(dash["title"].as_str().is_some());
    assert!(dash["uid"].as_str().is_some());
    let panels = dash["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    for p in panels {
        let id = p["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "duplicate panel id {id}");
        assert!(p["gridPos"]["w"].as_u64().is_some(), "{p}");
        if p["type"].as_str() != Some("row") {
            assert_eq!(
                p["datasource"]["uid"].as_str(),
                Some("${datasource}"),
                "{p}"
            );
        }
    }
    let variables: Vec<&str> = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(variables.contains(&"datasource"), "{variables:?}");
}
