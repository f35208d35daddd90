//! The Kubernetes manifests under `compose/kubernetes/`, checked without a cluster: what
//! `kubectl apply -f compose/kubernetes/` creates, the Pod Security "restricted" fields of every
//! pod template, the pinned image, the connection name from the downward API, and the optional
//! manifests for CRDs (Prometheus Operator, KEDA, RabbitMQ Cluster Operator) in their subfolders.
//!
//! The PromQL of the alerts is checked against the metric-name constants in `tests/dashboard.rs`.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_norway::Value;

const DIR: &str = "compose/kubernetes";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every YAML document of a file (`---`-separated), empty ones skipped.
fn documents(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| {
            Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// What `kubectl apply -f DIR` reads: the `.yaml`, `.yml` and `.json` files of the folder itself
/// (it does not descend into subfolders without `-R`).
fn applied_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml" | "json")
            )
        })
        .collect();
    files.sort();
    files
}

/// Every `.yaml` / `.yml` file under `dir`, subfolders included.
fn all_yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The documents of one manifest, by path relative to the repository.
fn load(path: &str) -> Vec<Value> {
    documents(&root().join(path))
}

/// The one document of `kind` in a manifest.
fn one(docs: &[Value], kind: &str) -> Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(found.len(), 1, "expected one {kind}, found {}", found.len());
    found[0].clone()
}

/// The pod spec of a workload (or a pod), if the document has one.
fn pod_spec(doc: &Value) -> Option<&Value> {
    let spec = match doc["kind"].as_str()? {
        "Pod" => &doc["spec"],
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
            &doc["spec"]["template"]["spec"]
        }
        "CronJob" => &doc["spec"]["jobTemplate"]["spec"]["template"]["spec"],
        _ => return None,
    };
    Some(spec)
}

fn seq(v: &Value) -> &[Value] {
    v.as_sequence().map(|s| s.as_slice()).unwrap_or(&[])
}

fn all_containers(spec: &Value) -> Vec<&Value> {
    ["initContainers", "containers", "ephemeralContainers"]
        .iter()
        .flat_map(|k| seq(&spec[*k]))
        .collect()
}

fn workload_docs() -> Vec<(PathBuf, Value)> {
    all_yaml_files(&root().join(DIR))
        .into_iter()
        .flat_map(|p| documents(&p).into_iter().map(move |d| (p.clone(), d)))
        .filter(|(_, d)| pod_spec(d).is_some())
        .collect()
}

/// Pod Security Standards, "restricted" profile (which includes "baseline"), as the admission
/// controller evaluates a pod: pod-level fields apply to every container unless it overrides them.
fn check_restricted(name: &str, spec: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    let pod_sc = &spec["securityContext"];
    for host in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[host].as_bool() == Some(true) {
            errors.push(format!("{name}: {host}"));
        }
    }
    if pod_sc["runAsUser"].as_u64() == Some(0) {
        errors.push(format!("{name}: pod runAsUser 0"));
    }
    if !seq(&pod_sc["sysctls"]).is_empty() {
        errors.push(format!("{name}: sysctls"));
    }
    const VOLUME_TYPES: &[&str] = &[
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    for volume in seq(&spec["volumes"]) {
        let map = volume.as_mapping().expect("a volume is a mapping");
        for key in map.keys().filter_map(Value::as_str) {
            if key != "name" && !VOLUME_TYPES.contains(&key) {
                errors.push(format!("{name}: volume type {key}"));
            }
        }
    }
    let containers = all_containers(spec);
    if containers.is_empty() {
        errors.push(format!("{name}: no containers"));
    }
    for c in containers {
        let cname = format!("{name}/{}", c["name"].as_str().unwrap_or("?"));
        let sc = &c["securityContext"];
        let effective = |key: &str| -> Value {
            if sc[key].is_null() {
                pod_sc[key].clone()
            } else {
                sc[key].clone()
            }
        };
        if effective("runAsNonRoot").as_bool() != Some(true) {
            errors.push(format!("{cname}: runAsNonRoot is not true"));
        }
        if effective("runAsUser").as_u64() == Some(0) {
            errors.push(format!("{cname}: runAsUser 0"));
        }
        match effective("seccompProfile")["type"].as_str() {
            Some("RuntimeDefault" | "Localhost") => {}
            other => errors.push(format!("{cname}: seccompProfile.type {other:?}")),
        }
        if sc["allowPrivilegeEscalation"].as_bool() != Some(false) {
            errors.push(format!("{cname}: allowPrivilegeEscalation is not false"));
        }
        if sc["privileged"].as_bool() == Some(true) {
            errors.push(format!("{cname}: privileged"));
        }
        let drop: Vec<&str> = seq(&sc["capabilities"]["drop"])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        if !drop.contains(&"ALL") {
            errors.push(format!("{cname}: capabilities.drop lacks ALL: {drop:?}"));
        }
        for add in seq(&sc["capabilities"]["add"]) {
            if add.as_str() != Some("NET_BIND_SERVICE") {
                errors.push(format!("{cname}: capability added: {add:?}"));
            }
        }
        // Not part of the profile, but the worker writes no file: keep it that way.
        if sc["readOnlyRootFilesystem"].as_bool() != Some(true) {
            errors.push(format!("{cname}: readOnlyRootFilesystem is not true"));
        }
        for port in seq(&c["ports"]) {
            if port["hostPort"].as_u64().unwrap_or(0) != 0 {
                errors.push(format!("{cname}: hostPort"));
            }
        }
    }
    errors
}

/// `kubectl apply -f compose/kubernetes/` must work on a cluster with nothing but the built-in
/// API: every file it reads is an object (no patch), of a built-in kind (CRD-based manifests
/// live in subfolders), and none is a Secret carrying credentials.
#[test]
fn applying_the_folder_creates_only_builtin_objects_and_no_secret() {
    const BUILTIN_GROUPS: &[&str] = &[
        "apps",
        "batch",
        "policy",
        "autoscaling",
        "networking.k8s.io",
        "rbac.authorization.k8s.io",
        "scheduling.k8s.io",
    ];
    let files = applied_files(&root().join(DIR));
    assert!(
        files.iter().any(|f| f.ends_with("deployment.yaml")),
        "{files:?}"
    );
    for file in &files {
        let docs = documents(file);
        assert!(!docs.is_empty(), "{} has no object", file.display());
        for doc in docs {
            let api = doc["apiVersion"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: an object without apiVersion", file.display()));
            let kind = doc["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: an object without kind", file.display()));
            assert!(
                doc["metadata"]["name"].as_str().is_some(),
                "{}: {kind} without a name",
                file.display()
            );
            if let Some((group, _)) = api.split_once('/') {
                assert!(
                    BUILTIN_GROUPS.contains(&group),
                    "{}: {kind} of {api} needs a CRD: move it to a subfolder",
                    file.display()
                );
            }
            if kind == "Secret" {
                assert!(
                    doc["data"].is_null() && doc["stringData"].is_null(),
                    "{}: a Secret with data is applied with the folder",
                    file.display()
                );
            }
        }
    }
}

/// The example secret exists for a throwaway cluster, under a name kubectl skips, and is the
/// Secret the Deployment reads the URL from.
#[test]
fn example_secret_is_kept_out_of_the_folder_apply() {
    let path = format!("{DIR}/secret.yaml.example");
    let secret = one(&load(&path), "Secret");
    let name = secret["metadata"]["name"].as_str().unwrap();
    assert!(secret["stringData"]["amqp-url"].as_str().is_some());
    assert!(
        !applied_files(&root().join(DIR))
            .iter()
            .any(|f| f.ends_with("secret.yaml.example")),
        "kubectl would apply {path}"
    );

    let deployment = one(&load(&format!("{DIR}/deployment.yaml")), "Deployment");
    let referenced: Vec<&str> = all_containers(pod_spec(&deployment).unwrap())
        .into_iter()
        .flat_map(|c| seq(&c["env"]))
        .filter_map(|e| e["valueFrom"]["secretKeyRef"]["name"].as_str())
        .collect();
    assert_eq!(referenced, vec![name]);
}

#[test]
fn every_pod_template_passes_pod_security_restricted() {
    let workloads = workload_docs();
    assert!(!workloads.is_empty());
    let mut errors = Vec::new();
    for (path, doc) in &workloads {
        let name = format!(
            "{}: {} {}",
            path.strip_prefix(root()).unwrap().display(),
            doc["kind"].as_str().unwrap(),
            doc["metadata"]["name"].as_str().unwrap_or("?")
        );
        errors.extend(check_restricted(&name, pod_spec(doc).unwrap()));
        // The worker calls no Kubernetes API: no token in the pod.
        assert_eq!(
            pod_spec(doc).unwrap()["automountServiceAccountToken"].as_bool(),
            Some(false),
            "{name}"
        );
    }
    assert!(
        errors.is_empty(),
        "not \"restricted\":\n{}",
        errors.join("\n")
    );
}

/// The checker itself: the old manifest (no seccomp profile, privilege escalation allowed) fails.
#[test]
fn the_restricted_check_rejects_what_the_profile_rejects() {
    let spec: Value = serde_norway::from_str(
        r#"
securityContext: {runAsNonRoot: true, runAsUser: 10001}
volumes: [{name: data, hostPath: {path: /var/data}}]
containers:
  - name: worker
    securityContext:
      readOnlyRootFilesystem: true
      capabilities: {drop: [ALL], add: [SYS_ADMIN]}
"#,
    )
    .unwrap();
    let errors = check_restricted("old", &spec).join("\n");
    for expected in [
        "seccompProfile",
        "allowPrivilegeEscalation",
        "SYS_ADMIN",
        "hostPath",
    ] {
        assert!(
            errors.contains(expected),
            "{expected} not found in {errors}"
        );
    }
}

/// The TLS patch is a patch (so not in the applied folder) and adds only Secret volumes.
#[test]
fn the_tls_patch_keeps_the_pod_restricted() {
    let patch = &load(&format!("{DIR}/patches/tls.patch.yaml"))[0];
    assert!(patch["kind"].is_null(), "a patch, not an object");
    let spec = &patch["spec"]["template"]["spec"];
    for volume in seq(&spec["volumes"]) {
        assert!(
            volume["secret"]["secretName"].as_str().is_some(),
            "{volume:?}"
        );
    }
    for c in all_containers(spec) {
        assert!(
            c["securityContext"].is_null(),
            "the patch must not touch securityContext"
        );
    }
}

#[test]
fn the_image_is_pinned_to_the_release_and_runs_as_the_dockerfile_user() {
    let deployment = one(&load(&format!("{DIR}/deployment.yaml")), "Deployment");
    let spec = pod_spec(&deployment).unwrap();
    for c in all_containers(spec) {
        let image = c["image"].as_str().expect("image");
        let (repo, tag) = image
            .rsplit_once(':')
            .filter(|(repo, _)| !repo.is_empty())
            .unwrap_or_else(|| panic!("{image} has no tag"));
        assert_ne!(tag, "latest", "{image}");
        if repo == "redeliver-example" {
            assert_eq!(tag, env!("CARGO_PKG_VERSION"), "the tag is the release");
        }
        assert_eq!(c["imagePullPolicy"].as_str(), Some("IfNotPresent"));
    }

    // The Dockerfile's final USER is the uid:gid the pod runs as.
    let dockerfile = std::fs::read_to_string(root().join("compose/Dockerfile")).unwrap();
    let user = dockerfile
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER line")
        .trim();
    let (uid, gid) = user.split_once(':').unwrap_or((user, user));
    let sc = &spec["securityContext"];
    assert_eq!(
        sc["runAsUser"].as_u64().map(|u| u.to_string()).as_deref(),
        Some(uid)
    );
    assert_eq!(
        sc["runAsGroup"].as_u64().map(|g| g.to_string()).as_deref(),
        Some(gid)
    );
}

/// Each pod gets its own connection name (`image-worker-<pod name>`) from the downward API, and
/// every variable the manifest sets for the worker is one it reads.
#[test]
fn the_connection_name_comes_from_the_pod_name() {
    let deployment = one(&load(&format!("{DIR}/deployment.yaml")), "Deployment");
    let container = &pod_spec(&deployment).unwrap()["containers"][0];
    let env = seq(&container["env"]);
    let index = |name: &str| {
        env.iter()
            .position(|e| e["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no env {name}"))
    };
    let pod_name = index("POD_NAME");
    assert_eq!(
        env[pod_name]["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("metadata.name")
    );
    let connection = index(redeliver::worker::env::CONNECTION_NAME);
    assert_eq!(
        env[connection]["value"].as_str(),
        Some("image-worker-$(POD_NAME)")
    );
    // Kubernetes expands $(VAR) only from variables defined earlier in the list.
    assert!(pod_name < connection, "POD_NAME must come first");

    for e in env {
        let name = e["name"].as_str().unwrap();
        if name.starts_with("REDELIVER_") || name.starts_with("AMQP_") || name == "RUST_LOG" {
            assert!(
                redeliver::worker::env::VARIABLES.contains(&name),
                "{name} is not read by the worker"
            );
        }
    }
}

/// The PodMonitor scrapes /metrics on the Deployment's health port (8080).
#[test]
fn the_pod_monitor_scrapes_the_health_port() {
    let docs = load(&format!("{DIR}/monitoring/podmonitor.yaml"));
    let deployment = one(&load(&format!("{DIR}/deployment.yaml")), "Deployment");
    let labels = deployment["spec"]["template"]["metadata"]["labels"]
        .as_mapping()
        .unwrap();
    let container = &pod_spec(&deployment).unwrap()["containers"][0];
    let monitor = docs
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("PodMonitor")
                && d["spec"]["selector"]["matchLabels"]
                    .as_mapping()
                    .is_some_and(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)))
        })
        .expect("a PodMonitor selecting the worker's pods");
    assert_eq!(
        monitor["apiVersion"].as_str(),
        Some("monitoring.coreos.com/v1")
    );
    let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["path"].as_str(), Some("/metrics"));
    let port = seq(&container["ports"])
        .iter()
        .find(|p| p["name"].as_str() == endpoint["port"].as_str())
        .expect("the monitor's port is a named container port");
    assert_eq!(port["containerPort"].as_u64(), Some(8080));
    // The health server listens there.
    let health = seq(&container["env"])
        .iter()
        .find(|e| e["name"].as_str() == Some(redeliver::worker::env::HEALTH_ADDR))
        .and_then(|e| e["value"].as_str())
        .unwrap();
    assert!(health.ends_with(":8080"), "{health}");
}

#[test]
fn the_prometheus_rule_has_the_alerts() {
    let rule = one(
        &load(&format!("{DIR}/monitoring/prometheusrule.yaml")),
        "PrometheusRule",
    );
    assert_eq!(
        rule["apiVersion"].as_str(),
        Some("monitoring.coreos.com/v1")
    );
    let rules: Vec<&Value> = seq(&rule["spec"]["groups"])
        .iter()
        .flat_map(|g| seq(&g["rules"]))
        .collect();
    let alerts: Vec<&str> = rules.iter().filter_map(|r| r["alert"].as_str()).collect();
    for expected in [
        "RedeliverDeadLetterQueueGrowing",
        "RedeliverRetriesParked",
        "RedeliverSettleFailures",
        "RedeliverWorkerNotReady",
        "RedeliverConnectionBlocked",
    ] {
        assert!(
            alerts.contains(&expected),
            "{expected} missing from {alerts:?}"
        );
    }
    for r in &rules {
        let expr = r["expr"].as_str().unwrap_or("");
        assert!(!expr.trim().is_empty(), "{r:?} has no expr");
        assert!(
            ["warning", "critical"].contains(&r["labels"]["severity"].as_str().unwrap_or("")),
            "{r:?} has no severity"
        );
        assert!(r["annotations"]["summary"].as_str().is_some(), "{r:?}");
    }
    // DLQ growth comes from RabbitMQ's own metrics (rabbitmq_prometheus), on the *.dlq queues.
    let dlq = rules
        .iter()
        .find(|r| r["alert"].as_str() == Some("RedeliverDeadLetterQueueGrowing"))
        .unwrap();
    let expr = dlq["expr"].as_str().unwrap();
    assert!(
        expr.contains("rabbitmq_detailed_queue_messages_ready"),
        "{expr}"
    );
    assert!(expr.contains(r#"queue=~".+\\.dlq""#), "{expr}");
}

#[test]
fn the_keda_scaled_object_scales_the_deployment_on_queue_length() {
    let docs = load(&format!("{DIR}/keda/scaledobject.yaml"));
    let deployment = one(&load(&format!("{DIR}/deployment.yaml")), "Deployment");
    let scaled = one(&docs, "ScaledObject");
    assert_eq!(scaled["apiVersion"].as_str(), Some("keda.sh/v1alpha1"));
    assert_eq!(
        scaled["spec"]["scaleTargetRef"]["name"],
        deployment["metadata"]["name"]
    );
    let trigger = &scaled["spec"]["triggers"][0];
    assert_eq!(trigger["type"].as_str(), Some("rabbitmq"));
    assert_eq!(trigger["metadata"]["mode"].as_str(), Some("QueueLength"));
    assert!(trigger["metadata"]["queueName"].as_str().is_some());
    assert!(trigger["metadata"]["value"].as_str().is_some());
    // Credentials come from a TriggerAuthentication on the worker's Secret, not inline.
    assert!(trigger["metadata"]["host"].is_null());
    let auth = one(&docs, "TriggerAuthentication");
    assert_eq!(
        trigger["authenticationRef"]["name"],
        auth["metadata"]["name"]
    );
    let secret = one(&load(&format!("{DIR}/secret.yaml.example")), "Secret");
    let target = &auth["spec"]["secretTargetRef"][0];
    assert_eq!(target["parameter"].as_str(), Some("host"));
    assert_eq!(target["name"], secret["metadata"]["name"]);
    assert!(secret["stringData"][target["key"].as_str().unwrap()]
        .as_str()
        .is_some());
}

#[test]
fn the_rabbitmq_cluster_has_three_nodes_and_the_prometheus_plugin() {
    let cluster = one(
        &load(&format!("{DIR}/rabbitmq/rabbitmqcluster.yaml")),
        "RabbitmqCluster",
    );
    assert_eq!(cluster["apiVersion"].as_str(), Some("rabbitmq.com/v1beta1"));
    // A quorum queue (the worker's default) needs a majority: three nodes survive losing one.
    assert_eq!(cluster["spec"]["replicas"].as_u64(), Some(3));
    let plugins: Vec<&str> = seq(&cluster["spec"]["rabbitmq"]["additionalPlugins"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(plugins.contains(&"rabbitmq_prometheus"), "{plugins:?}");
}

/// The web service in front of the outbox takes both URLs from Secrets (the broker's from the
/// worker's Secret, the database's from the example database Secret, kept out of the folder
/// apply), runs the release's image, probes the port it listens on, and its Service reaches it.
#[test]
fn the_outbox_web_service_reads_both_urls_from_secrets() {
    let docs = load(&format!("{DIR}/outbox-web.yaml"));
    let deployment = one(&docs, "Deployment");
    let spec = pod_spec(&deployment).unwrap();
    let container = &spec["containers"][0];
    let env = seq(&container["env"]);
    let secret_ref = |name: &str| {
        let e = env
            .iter()
            .find(|e| e["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no env {name}"));
        assert!(
            e["value"].is_null(),
            "{name} must not be written in the manifest"
        );
        let r = &e["valueFrom"]["secretKeyRef"];
        (
            r["name"]
                .as_str()
                .unwrap_or_else(|| panic!("{name} is not from a Secret"))
                .to_owned(),
            r["key"].as_str().expect("a key").to_owned(),
        )
    };
    for (variable, file) in [
        ("DATABASE_URL", "postgres-secret.yaml.example"),
        ("AMQP_URL", "secret.yaml.example"),
    ] {
        let (name, key) = secret_ref(variable);
        let path = format!("{DIR}/{file}");
        let secret = one(&load(&path), "Secret");
        assert_eq!(
            secret["metadata"]["name"].as_str(),
            Some(name.as_str()),
            "{variable}"
        );
        let example = secret["stringData"][key.as_str()]
            .as_str()
            .unwrap_or_else(|| panic!("{path} has no {key}"));
        let scheme = if variable == "DATABASE_URL" {
            "postgres://"
        } else {
            "amqp://"
        };
        assert!(example.starts_with(scheme), "{example}");
        assert!(
            !applied_files(&root().join(DIR))
                .iter()
                .any(|f| f.ends_with(file)),
            "kubectl would apply {path}"
        );
    }

    let image = container["image"].as_str().expect("image");
    assert_eq!(
        image,
        format!("redeliver-outbox-web:{}", env!("CARGO_PKG_VERSION")),
        "a pinned image of the release"
    );
    assert_eq!(container["imagePullPolicy"].as_str(), Some("IfNotPresent"));

    // It listens (WEB_ADDR) on the port the probes and the Service use.
    let addr = env
        .iter()
        .find(|e| e["name"].as_str() == Some("WEB_ADDR"))
        .and_then(|e| e["value"].as_str())
        .expect("WEB_ADDR");
    let port = seq(&container["ports"])
        .iter()
        .find(|p| p["name"].as_str() == Some("http"))
        .expect("a port named http");
    assert!(
        addr.starts_with("0.0.0.0:"),
        "{addr}: reachable from outside the pod"
    );
    assert_eq!(
        addr.rsplit(':').next(),
        port["containerPort"]
            .as_u64()
            .map(|p| p.to_string())
            .as_deref()
    );
    assert_eq!(
        container["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/livez")
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(
            container[probe]["httpGet"]["port"].as_str(),
            Some("http"),
            "{probe}"
        );
    }
    let service = one(&docs, "Service");
    assert_eq!(
        service["spec"]["ports"][0]["targetPort"].as_str(),
        Some("http")
    );
    let labels = deployment["spec"]["template"]["metadata"]["labels"]
        .as_mapping()
        .unwrap();
    let selector = service["spec"]["selector"]
        .as_mapping()
        .expect("a selector");
    assert!(
        selector.iter().all(|(k, v)| labels.get(k) == Some(v)),
        "the Service selects the Deployment's pods"
    );
    // Not scraped as a worker: it has no health port and no worker metrics.
    assert!(labels.get("app.kubernetes.io/part-of").is_none());
}
