//! `redeliver outbox status` against a real PostgreSQL: rows stored with `Outbox::store` in a
//! schema of its own (dropped at the end), counted in text and JSON; a missing table, an
//! unreachable database and a bad command line fail with their exit codes, without printing
//! the password. No broker is involved: `AMQP_URL` is set to garbage to prove it is not read.
//!
//! PostgreSQL comes from `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`);
//! without it the tests fail, saying what to start.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![cfg(feature = "postgres")]

use std::net::TcpListener;
use std::process::Command;

use redeliver_postgres::{Outbox, OutboxMessage, Schema};
use redeliver_testkit::process::Output;
use serde_json::Value;
use sqlx::PgPool;

use redeliver_testkit::postgres::database_url;

/// Runs `redeliver ARGS` with exactly these variables of its own.
fn cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redeliver"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDELIVER_PG_SCHEMA")
        .env("AMQP_URL", "not a broker URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Output::of(&mut cmd)
}

/// A schema of its own, dropped with everything in it when this is dropped.
struct TestSchema {
    pool: PgPool,
    name: String,
}

impl TestSchema {
    async fn new() -> Self {
        let pool = redeliver_testkit::postgres::pool(2).await;
        let name = format!("rdcli_{}", redeliver_testkit::unique_id(12));
        Self { pool, name }
    }

    fn schema(&self) -> Schema {
        Schema::named(&self.name).expect("schema name")
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        redeliver_testkit::postgres::drop_schema(&self.name);
    }
}

fn json(out: &Output) -> Value {
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {out:?}"))
}

#[tokio::test]
async fn status_counts_the_pending_rows_and_the_age_of_the_oldest() {
    let db = TestSchema::new().await;
    let schema = db.schema();
    schema.migrate(&db.pool).await.expect("migrate");
    let outbox = Outbox::new(schema.clone());
    let mut tx = db.pool.begin().await.expect("begin");
    for i in 0..3 {
        outbox
            .store(
                &mut tx,
                &OutboxMessage::new("", "images", format!("job {i}")),
            )
            .await
            .expect("store");
    }
    tx.commit().await.expect("commit");
    // The oldest row waited 90 s: the age is the database's now() - created_at.
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox SET created_at = now() - interval '90 seconds'
         WHERE id = (SELECT min(id) FROM \"{}\".outbox)",
        db.name, db.name
    ))
    .execute(&db.pool)
    .await
    .expect("age a row");
    let url = database_url();
    let env = [("DATABASE_URL", url.as_str())];

    let out = cli(&["outbox", "status", "--schema", &db.name, "--json"], &env);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(v["outbox"], format!("{}.outbox", db.name));
    assert_eq!(v["schema"], db.name.as_str());
    assert_eq!(v["table"], "outbox");
    assert_eq!(v["pending"], 3);
    let age = v["oldest_age_seconds"].as_f64().expect("an age");
    assert!((90.0..150.0).contains(&age), "{age}");
    // Nothing refused, nothing parked.
    assert_eq!(v["retrying"], 0);
    assert_eq!(v["parked"], 0);
    assert!(v["oldest_parked_age_seconds"].is_null(), "{v}");

    // The schema from the services' variable, text output.
    let out = cli(
        &["outbox", "status"],
        &[("DATABASE_URL", &url), ("REDELIVER_PG_SCHEMA", &db.name)],
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout.starts_with(&format!(
            "outbox {}.outbox: 3 pending, the oldest for 1m 3",
            db.name
        )),
        "{out:?}"
    );

    // Once the relay published everything.
    sqlx::query(&format!("DELETE FROM \"{}\".outbox", db.name))
        .execute(&db.pool)
        .await
        .expect("delete");
    let out = cli(&["outbox", "status", "--schema", &db.name, "--json"], &env);
    assert_eq!(out.code, 0, "{out:?}");
    let v = json(&out);
    assert_eq!(v["pending"], 0);
    assert!(v["oldest_age_seconds"].is_null(), "{v}");
    let out = cli(&["outbox", "status", "--schema", &db.name], &env);
    assert_eq!(
        out.stdout,
        format!("outbox {}.outbox: nothing pending\n", db.name)
    );
}

#[tokio::test]
async fn a_missing_table_is_an_error_that_names_it() {
    let db = TestSchema::new().await;
    let url = database_url();
    let env = [("DATABASE_URL", url.as_str())];
    // No schema at all, then the schema without that table.
    let out = cli(&["outbox", "status", "--schema", &db.name, "--json"], &env);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(
        out.stderr.contains(&format!(
            "the outbox table {}.outbox does not exist",
            db.name
        )),
        "{out:?}"
    );
    assert!(out.stderr.contains("\nhint: "), "{out:?}");
    assert!(!out.stderr.contains("panicked"), "{out:?}");

    db.schema().migrate(&db.pool).await.expect("migrate");
    let out = cli(
        &[
            "outbox",
            "status",
            "--schema",
            &db.name,
            "--outbox-table",
            "jobs_outbox",
        ],
        &env,
    );
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains(&format!(
            "the outbox table {}.jobs_outbox does not exist",
            db.name
        )),
        "{out:?}"
    );
}

#[test]
fn an_unreachable_database_fails_with_a_hint_and_never_shows_the_password() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let url = format!("postgres://app:s3cr%40t@127.0.0.1:{port}/shop");
    let out = cli(&["outbox", "status"], &[("DATABASE_URL", &url)]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.starts_with(&format!(
            "error: cannot connect to PostgreSQL at postgres://app@127.0.0.1:{port}/shop: "
        )),
        "{out:?}"
    );
    assert!(
        out.stderr.contains("hint: is PostgreSQL running"),
        "{out:?}"
    );
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(!all.contains("s3cr"), "password printed: {all}");

    // The same through --database-url, with the password as a parameter.
    let url = format!("postgres://app@127.0.0.1:{port}/shop?password=s3cr%40t");
    let out = cli(&["outbox", "status", "--database-url", &url], &[]);
    assert_eq!(out.code, 1, "{out:?}");
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(!all.contains("s3cr"), "password printed: {all}");
}

#[test]
fn a_bad_command_line_is_a_usage_error() {
    let out = cli(&["outbox", "status"], &[]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("--database-url or set DATABASE_URL"),
        "{out:?}"
    );

    let url = database_url();
    let env = [("DATABASE_URL", url.as_str())];
    for (args, expected) in [
        (
            &["--schema", "a;b"][..],
            "--schema / --outbox-table: invalid schema name",
        ),
        (&["--outbox-table", "1x"][..], "invalid outbox table name"),
    ] {
        let mut all = vec!["outbox", "status"];
        all.extend_from_slice(args);
        let out = cli(&all, &env);
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stderr.contains(expected), "{args:?}: {out:?}");
    }

    let out = cli(
        &["outbox", "status"],
        &[("DATABASE_URL", "mysql://app:s3cret@db/app")],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("is not a PostgreSQL URL"), "{out:?}");
    assert!(!out.stderr.contains("s3cret"), "{out:?}");
}
