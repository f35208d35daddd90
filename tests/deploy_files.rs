//! The deployment files can't be run here (no container engine), so their key fields are checked.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_norway::Value;

fn load(path: &str) -> Value {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {full}: {e}"));
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{full} is not valid YAML: {e}"))
}

fn env_names(container: &Value) -> Vec<String> {
    container["env"]
        .as_sequence()
        .expect("env list")
        .iter()
        .map(|e| e["name"].as_str().expect("env name").to_owned())
        .collect()
}

#[test]
fn compose_runs_rabbitmq_with_management_and_the_worker() {
    let doc = load("compose/docker-compose.yml");
    let rabbit = &doc["services"]["rabbitmq"];
    assert!(rabbit["image"].as_str().unwrap().contains("management"));
    let ports: Vec<&str> = rabbit["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(ports.contains(&"5672:5672"), "{ports:?}");
    assert!(ports.contains(&"15672:15672"), "{ports:?}");

    let worker = &doc["services"]["worker"];
    assert_eq!(
        worker["build"]["dockerfile"].as_str(),
        Some("compose/Dockerfile")
    );
    let url = worker["environment"]["AMQP_URL"].as_str().unwrap();
    assert!(
        url.contains("@rabbitmq:5672"),
        "worker must reach the rabbitmq service: {url}"
    );
    assert_eq!(
        worker["depends_on"]["rabbitmq"]["condition"].as_str(),
        Some("service_healthy")
    );
    // The worker is the Dockerfile's default example.
    let example = &worker["build"]["args"]["EXAMPLE"];
    assert!(
        example.is_null() || example.as_str() == Some("image_processing"),
        "{example:?}"
    );
}

#[test]
fn compose_runs_postgres_and_the_outbox_web_service() {
    let doc = load("compose/docker-compose.yml");
    let postgres = &doc["services"]["postgres"];
    assert_eq!(postgres["image"].as_str(), Some("postgres:17"));
    let check: Vec<&str> = postgres["healthcheck"]["test"]
        .as_sequence()
        .expect("a healthcheck command")
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(check.contains(&"pg_isready"), "{check:?}");
    // The data outlives the container: a named volume on PostgreSQL's data directory.
    let volume = postgres["volumes"][0].as_str().expect("a volume");
    let (name, path) = volume.split_once(':').expect("NAME:PATH");
    assert_eq!(path, "/var/lib/postgresql/data");
    assert!(
        doc["volumes"].as_mapping().unwrap().contains_key(name),
        "volume {name} is not declared"
    );
    let user = postgres["environment"]["POSTGRES_USER"].as_str().unwrap();
    let db = postgres["environment"]["POSTGRES_DB"].as_str().unwrap();

    let web = &doc["services"]["web"];
    assert_eq!(
        web["build"]["dockerfile"].as_str(),
        Some("compose/Dockerfile")
    );
    assert_eq!(web["build"]["args"]["EXAMPLE"].as_str(), Some("outbox_web"));
    let example = format!("{}/examples/outbox_web.rs", env!("CARGO_MANIFEST_DIR"));
    assert!(std::path::Path::new(&example).is_file(), "{example}");
    let database_url = web["environment"]["DATABASE_URL"].as_str().unwrap();
    assert!(
        database_url.starts_with(&format!("postgres://{user}:"))
            && database_url.ends_with(&format!("@postgres:5432/{db}")),
        "the web service must reach the postgres service's database: {database_url}"
    );
    let amqp_url = web["environment"]["AMQP_URL"].as_str().unwrap();
    assert!(amqp_url.contains("@rabbitmq:5672"), "{amqp_url}");
    for service in ["postgres", "rabbitmq"] {
        assert_eq!(
            web["depends_on"][service]["condition"].as_str(),
            Some("service_healthy"),
            "web waits for {service}"
        );
    }
    // It listens where its port is published, and not on Grafana's 3000.
    let addr = web["environment"]["WEB_ADDR"].as_str().unwrap();
    let port = addr.rsplit(':').next().unwrap();
    let ports: Vec<&str> = web["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(ports, vec![format!("{port}:{port}")]);
    assert_ne!(port, "3000");
}

/// The `members` of the workspace's Cargo.toml (one line, as it is written there).
fn workspace_members() -> Vec<String> {
    let path = format!("{}/Cargo.toml", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("members = ["))
        .expect("a one-line members list");
    let members: Vec<String> = line
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    assert!(members.len() > 3, "{line}");
    members
}

#[test]
fn dockerfile_is_multi_stage_and_runs_as_non_root() {
    let path = format!("{}/compose/Dockerfile", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let stages = text.lines().filter(|l| l.starts_with("FROM ")).count();
    assert!(stages >= 2, "multi-stage build expected");
    // One example per image, the worker unless the build argument names another.
    assert!(text.contains("ARG EXAMPLE=image_processing"), "{text}");
    assert!(text.contains("--example \"$EXAMPLE\""), "{text}");
    // The cached dependency layer needs every workspace member's manifest, or cargo refuses
    // the workspace.
    // ... and a placeholder source for each crate under crates/.
    let placeholders: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once("for lib in ").or(l.split_once("for bin in ")))
        .flat_map(|(_, rest)| rest.split(';').next().unwrap_or("").split_whitespace())
        .collect();
    for member in workspace_members() {
        assert!(
            text.contains(&format!("COPY {member}/Cargo.toml {member}/")),
            "compose/Dockerfile does not copy {member}/Cargo.toml"
        );
        if let Some(name) = member.strip_prefix("crates/") {
            assert!(
                placeholders.contains(&name),
                "compose/Dockerfile has no placeholder source for {member}: {placeholders:?}"
            );
        }
    }
    let user = text
        .lines()
        .rev()
        .find(|l| l.starts_with("USER "))
        .expect("a USER line");
    assert_ne!(user.trim(), "USER root");
    assert_ne!(user.trim(), "USER 0");
}

#[test]
fn kubernetes_deployment_has_probes_grace_limits_and_env() {
    let doc = load("compose/kubernetes/deployment.yaml");
    assert_eq!(doc["kind"].as_str(), Some("Deployment"));
    let spec = &doc["spec"]["template"]["spec"];
    let container = &spec["containers"][0];

    assert_eq!(
        container["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/livez")
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert!(container["resources"]["limits"]["memory"]
        .as_str()
        .is_some());
    assert!(container["resources"]["limits"]["cpu"].as_str().is_some());

    let names = env_names(container);
    for required in [
        "AMQP_URL",
        "REDELIVER_PREFETCH",
        "REDELIVER_CONCURRENCY",
        "REDELIVER_HEALTH_ADDR",
        "REDELIVER_GRACE_PERIOD",
        "RUST_LOG",
    ] {
        assert!(
            names.iter().any(|n| n == required),
            "missing env {required}"
        );
    }

    // The kubelet's SIGKILL must come after the worker's own grace period ends.
    let grace: u64 = container["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"].as_str() == Some("REDELIVER_GRACE_PERIOD"))
        .and_then(|e| e["value"].as_str())
        .and_then(|v| humantime::parse_duration(v).ok())
        .map(|d| d.as_secs())
        .expect("grace period value");
    let termination = spec["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace");
    assert!(termination > grace, "{termination} <= {grace}");
    assert_eq!(
        spec["securityContext"]["runAsNonRoot"].as_bool(),
        Some(true)
    );
}

/// The TLS patch takes the CA and the amqps:// URL from Secrets mounted as files, the variables
/// it sets are the ones the worker reads, and every mount has its volume.
#[test]
fn kubernetes_tls_patch_mounts_the_ca_and_the_url_from_secrets() {
    let doc = load("compose/kubernetes/patches/tls.patch.yaml");
    let spec = &doc["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    assert_eq!(container["name"].as_str(), Some("worker"));
    let env = container["env"].as_sequence().expect("env");
    let value = |name: &str| {
        env.iter()
            .find(|e| e["name"].as_str() == Some(name))
            .and_then(|e| e["value"].as_str())
            .map(str::to_owned)
    };
    let ca = value("REDELIVER_TLS_CA_FILE").expect("the CA file");
    let url_file = value("AMQP_URL_FILE").expect("the URL file");
    for name in ["REDELIVER_TLS_CA_FILE", "AMQP_URL_FILE"] {
        assert!(
            redeliver::worker::env::VARIABLES.contains(&name),
            "{name} is not read by the worker"
        );
    }
    let mounts = container["volumeMounts"].as_sequence().expect("mounts");
    let volumes = spec["volumes"].as_sequence().expect("volumes");
    for file in [&ca, &url_file] {
        let mount = mounts
            .iter()
            .find(|m| file.starts_with(m["mountPath"].as_str().unwrap_or("?")))
            .unwrap_or_else(|| panic!("{file} is on no mount"));
        assert_eq!(mount["readOnly"].as_bool(), Some(true));
        let name = mount["name"].as_str().unwrap();
        let volume = volumes
            .iter()
            .find(|v| v["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no volume {name}"));
        assert!(
            volume["secret"]["secretName"].as_str().is_some(),
            "{name} is a Secret"
        );
    }
}
