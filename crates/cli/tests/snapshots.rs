//! Snapshot tests of `--help` and of the error messages operators see.
//!
//! The expected texts live in tests/snapshots/*.txt. After an intended change, regenerate them
//! with `UPDATE_SNAPSHOTS=1 cargo test -p redeliver-cli --test snapshots` and review the diff.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use redeliver_testkit::process::Output;
use redeliver_testkit::{amqp_url, connect};

/// Runs `redeliver ARGS` with exactly these extra environment variables (AMQP_URL and the
/// outbox's variables removed unless given).
fn cli_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_redeliver"));
    cmd.args(args)
        .env_remove("AMQP_URL")
        .env_remove("DATABASE_URL")
        .env_remove("REDELIVER_PG_SCHEMA");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Output::of(&mut cmd)
}

fn snapshot_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("snapshots")
        .join(format!("{name}.txt"))
}

fn check(name: &str, actual: &str) {
    let path = snapshot_path(name);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "missing snapshot {}; create it with UPDATE_SNAPSHOTS=1 cargo test -p redeliver-cli \
             --test snapshots\nactual:\n{actual}",
            path.display()
        )
    });
    assert!(
        expected == actual,
        "snapshot {name} differs (rerun with UPDATE_SNAPSHOTS=1 if the change is intended)\n\
         --- expected\n{expected}\n--- actual\n{actual}"
    );
}

#[test]
fn help_texts() {
    let cases: &[(&str, &[&str])] = &[
        ("help_root", &["--help"]),
        ("help_topology", &["topology", "--help"]),
        ("help_topology_declare", &["topology", "declare", "--help"]),
        ("help_topology_show", &["topology", "show", "--help"]),
        ("help_topology_delete", &["topology", "delete", "--help"]),
        ("help_dlq", &["dlq", "--help"]),
        ("help_dlq_list", &["dlq", "list", "--help"]),
        ("help_dlq_peek", &["dlq", "peek", "--help"]),
        ("help_dlq_replay", &["dlq", "replay", "--help"]),
        ("help_dlq_purge", &["dlq", "purge", "--help"]),
        ("help_dlq_stats", &["dlq", "stats", "--help"]),
        ("help_unroutable", &["unroutable", "--help"]),
        ("help_unroutable_list", &["unroutable", "list", "--help"]),
        (
            "help_unroutable_replay",
            &["unroutable", "replay", "--help"],
        ),
        ("help_unroutable_purge", &["unroutable", "purge", "--help"]),
        ("help_delay_probe", &["delay", "probe", "--help"]),
        ("help_outbox", &["outbox", "--help"]),
        ("help_outbox_status", &["outbox", "status", "--help"]),
        ("help_outbox_parked", &["outbox", "parked", "--help"]),
        (
            "help_outbox_parked_list",
            &["outbox", "parked", "list", "--help"],
        ),
        (
            "help_outbox_parked_stats",
            &["outbox", "parked", "stats", "--help"],
        ),
        (
            "help_outbox_parked_peek",
            &["outbox", "parked", "peek", "--help"],
        ),
        (
            "help_outbox_parked_replay",
            &["outbox", "parked", "replay", "--help"],
        ),
        (
            "help_outbox_parked_purge",
            &["outbox", "parked", "purge", "--help"],
        ),
    ];
    for (name, args) in cases {
        // A secret in the environment must not show up in help ("hide_env_values").
        let out = cli_env(
            args,
            &[
                ("AMQP_URL", "amqp://u:env-secret-pw@h:5672/%2f"),
                ("DATABASE_URL", "postgres://u:env-secret-db@h/db"),
            ],
        );
        assert_eq!(out.code, 0, "{name}: {out:?}");
        assert!(
            !out.stdout.contains("env-secret-pw"),
            "{name} leaks AMQP_URL"
        );
        assert!(
            !out.stdout.contains("env-secret-db"),
            "{name} leaks DATABASE_URL"
        );
        check(name, &out.stdout);
    }
}

#[test]
fn unreachable_broker() {
    let out = cli_env(
        &[
            "--url",
            "amqp://guest:s3cret-pw@127.0.0.1:1/%2f",
            "dlq",
            "list",
            "orders",
        ],
        &[],
    );
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        !out.stderr.contains("s3cret-pw"),
        "password printed: {}",
        out.stderr
    );
    assert!(
        out.stderr.contains("rabbitmq-server -detached"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    check("error_unreachable", &out.stderr);
}

#[cfg(feature = "postgres")]
#[test]
fn unreachable_database() {
    let out = cli_env(
        &[
            "outbox",
            "status",
            "--database-url",
            "postgres://app:s3cret-pw@127.0.0.1:1/shop",
        ],
        &[],
    );
    assert_eq!(out.code, 1, "{out:?}");
    assert!(!out.stderr.contains("s3cret-pw"), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    check("error_outbox_unreachable", &out.stderr);
}

/// AMQP_URL with its password replaced by `password`, and that URL as the CLI prints it.
fn with_password(url: &str, password: &str) -> (String, String) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..].find('/').map_or(url.len(), |i| start + i);
    let authority = &url[start..end];
    let (user, host) = match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            let user = userinfo.split(':').next().unwrap_or("guest");
            (user.to_owned(), &authority[at + 1..])
        }
        None => ("guest".to_owned(), authority),
    };
    let rest = &url[end..];
    let scheme = &url[..start];
    (
        format!("{scheme}{user}:{password}@{host}{rest}"),
        format!("{scheme}{user}:***@{host}{rest}"),
    )
}

#[tokio::test]
async fn wrong_password() {
    // Fails with instructions when there is no broker, instead of snapshotting "unreachable".
    let _conn = connect().await;
    let (url, shown) = with_password(&amqp_url(), "not-the-password-42");
    let out = cli_env(&["dlq", "list", "orders"], &[("AMQP_URL", &url)]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        !out.stderr.contains("not-the-password-42") && !out.stdout.contains("not-the-password-42"),
        "password printed: {}",
        out.stderr
    );
    assert!(out.stderr.contains("ACCESS_REFUSED"), "{}", out.stderr);
    assert!(out.stderr.contains(&shown), "{}", out.stderr);
    // Normalized so that an AMQP_URL with another host or user gives the same text.
    let user = shown
        .split("://")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .unwrap_or("guest")
        .to_owned();
    let normalized = out
        .stderr
        .replace(&shown, "<URL>")
        .replace(&format!("user '{user}'"), "user '<USER>'")
        .replace(
            &format!("authenticate_user {user} "),
            "authenticate_user <USER> ",
        );
    check("error_wrong_password", &normalized);
}

#[test]
fn purge_without_yes() {
    // Refused before connecting: no broker needed, exit code 2.
    let out = cli_env(
        &[
            "--url",
            "amqp://guest:pw@127.0.0.1:1/%2f",
            "dlq",
            "purge",
            "orders",
        ],
        &[],
    );
    assert_eq!(out.code, 2, "{out:?}");
    check("error_purge_without_yes", &out.stderr);
}

#[cfg(feature = "postgres")]
#[test]
fn outbox_purge_without_yes() {
    // Refused before connecting: no database needed, exit code 2.
    let out = cli_env(
        &[
            "outbox",
            "parked",
            "purge",
            "--database-url",
            "postgres://app:s3cret-pw@127.0.0.1:1/shop",
            "--reason",
            "retries_exhausted",
        ],
        &[],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(!out.stderr.contains("s3cret-pw"), "{}", out.stderr);
    check("error_outbox_purge_without_yes", &out.stderr);
}

#[test]
fn usage_errors_exit_2() {
    let out = cli_env(&["dlq", "list"], &[]);
    assert_eq!(out.code, 2, "{out:?}");
    check("error_missing_queue_argument", &out.stderr);

    let out = cli_env(
        &[
            "--url",
            "amqp://bob:topsecret@host:notaport/",
            "dlq",
            "list",
            "q",
        ],
        &[],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(!out.stderr.contains("topsecret"), "{}", out.stderr);
    check("error_bad_url", &out.stderr);
}
