//! Migrations and names, on a real PostgreSQL.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/test_db.rs"]
mod test_db;

use redeliver_postgres::{Error, Schema};
use test_db::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_idempotent_and_recorded() {
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.expect("first migration");
    db.schema.migrate(&db.pool).await.expect("second migration");
    db.schema.prepare(&db.pool).await.expect("prepare");
    let versions: Vec<(String, i32)> = sqlx::query_as(&format!(
        "SELECT table_name, version FROM {}.schema_migrations ORDER BY table_name, version",
        db.name
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        versions,
        [
            ("inbox".to_owned(), 1),
            ("outbox".to_owned(), 1),
            ("outbox".to_owned(), 2)
        ]
    );
    assert_eq!(db.count("inbox").await, 0);
    assert_eq!(db.count("outbox").await, 0);
    // The index on processed_at exists.
    let index: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{}.inbox_processed_at_idx", db.name))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(index.is_some(), "no index on processed_at");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_are_safe() {
    let db = TestDb::new().await;
    // Without the advisory lock, two CREATE SCHEMA / CREATE TABLE IF NOT EXISTS at once fail
    // with a unique violation on the catalog, or record a version twice.
    let runs = (0..4).map(|_| {
        let (schema, pool) = (db.schema.clone(), db.pool.clone());
        tokio::spawn(async move { schema.migrate(&pool).await })
    });
    for run in futures::future::join_all(runs).await {
        run.expect("task").expect("a concurrent migration failed");
    }
    assert_eq!(db.count("schema_migrations").await, 3);
}

/// An outbox created by version 1 of the crate, holding rows, is brought to version 2 (retries
/// and parking) by the next start: its rows are kept, due now, never tried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_of_version_1_is_upgraded_with_its_rows() {
    let db = TestDb::new().await;
    let s = &db.name;
    let v1 = include_str!("../migrations/outbox_0001_create.sql")
        .replace("{schema}", s)
        .replace("{table}", "outbox");
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {s};
         CREATE TABLE {s}.schema_migrations (table_name text NOT NULL, version integer NOT NULL,
             name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(),
             PRIMARY KEY (table_name, version));
         {v1}
         INSERT INTO {s}.schema_migrations (table_name, version, name) VALUES ('outbox', 1, 'create');
         INSERT INTO {s}.outbox (message_id, exchange, routing_key, body) VALUES ('m1', '', 'q', 'x');"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    db.schema.migrate(&db.pool).await.expect("upgrade");
    let (attempts, next, parked): (i32, Option<bool>, Option<bool>) = sqlx::query_as(&format!(
        "SELECT attempts, next_attempt_at IS NOT NULL, parked_at IS NOT NULL FROM {s}.outbox"
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((attempts, next, parked), (0, Some(false), Some(false)));
    let p = redeliver_postgres::pending(&db.pool, &db.schema)
        .await
        .unwrap();
    assert_eq!((p.count, p.retrying, p.parked), (1, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_table_names() {
    let db = TestDb::new().await;
    let schema = db
        .schema
        .clone()
        .with_inbox_table("Thumbs_Inbox")
        .unwrap()
        .with_outbox_table("thumbs_outbox")
        .unwrap();
    schema.migrate(&db.pool).await.expect("migrate");
    // Quoted: the mixed-case name is kept as given.
    assert_eq!(db.count("\"Thumbs_Inbox\"").await, 0);
    assert_eq!(db.count("thumbs_outbox").await, 0);
    // A second set of tables in the same schema gets its own migrations.
    db.schema
        .migrate(&db.pool)
        .await
        .expect("default names too");
    assert_eq!(db.count("inbox").await, 0);
    assert_eq!(db.count("schema_migrations").await, 6);
    assert_eq!(
        schema.notify_channel(),
        format!("{}.thumbs_outbox", db.name)
    );
}

#[test]
fn identifiers_are_validated() {
    for bad in [
        "",
        "9lives",
        "a-b",
        "a b",
        "x\"; DROP TABLE y; --",
        "sch.ema",
        "é",
    ] {
        let e = Schema::named(bad).expect_err(bad);
        assert!(e.to_string().contains("invalid schema name"), "{e}");
        assert!(Schema::default().with_inbox_table(bad).is_err(), "{bad}");
        assert!(Schema::default().with_outbox_table(bad).is_err(), "{bad}");
    }
    let e = Schema::default()
        .with_inbox_table(&"x".repeat(47))
        .unwrap_err();
    assert!(e.to_string().contains("at most 46"), "{e}");
    assert!(Schema::default()
        .with_inbox_table("schema_migrations")
        .is_err());
    assert!(Schema::default().with_outbox_table("inbox").is_err());
    assert!(Schema::named("_ok_1").is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_migrations_the_tables_are_checked() {
    let db = TestDb::new().await;
    let managed = db.schema.clone().without_migrations();
    match managed.prepare(&db.pool).await {
        Err(Error::MissingTable { table }) => assert_eq!(table, format!("{}.inbox", db.name)),
        other => panic!("expected MissingTable, got {other:?}"),
    }
    // The team's own schema, missing a column.
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {0};
         CREATE TABLE {0}.inbox (consumer text, message_id text, processed_at timestamptz);
         CREATE TABLE {0}.outbox (id bigserial, message_id text, exchange text, routing_key text, body bytea, content_type text, created_at timestamptz);",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    match managed.prepare(&db.pool).await {
        Err(
            e @ Error::MissingColumn {
                column: "headers", ..
            },
        ) => {
            assert!(e.to_string().contains("has no column headers"), "{e}")
        }
        other => panic!("expected MissingColumn, got {other:?}"),
    }
    sqlx::query(&format!(
        "ALTER TABLE {}.outbox ADD COLUMN headers jsonb",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    // The columns of migration 2 (retries and parking) are checked too.
    match managed.prepare(&db.pool).await {
        Err(Error::MissingColumn {
            column: "attempts", ..
        }) => {}
        other => panic!("expected MissingColumn attempts, got {other:?}"),
    }
    sqlx::query(&format!(
        "ALTER TABLE {}.outbox ADD COLUMN attempts integer NOT NULL DEFAULT 0,
             ADD COLUMN next_attempt_at timestamptz, ADD COLUMN last_error text,
             ADD COLUMN parked_at timestamptz, ADD COLUMN parked_reason text",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    managed.prepare(&db.pool).await.expect("complete tables");
    // Nothing was created: no ledger.
    let ledger: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{}.schema_migrations", db.name))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(ledger, None);
}

// One thread: the subscriber set for this test sees everything sqlx logs while it runs.
#[tokio::test(flavor = "current_thread")]
async fn a_second_start_logs_no_already_exists_notices() {
    let (captured, _guard) = redeliver_testkit::logs::capture(tracing::Level::INFO);
    let db = TestDb::new().await;
    db.schema.migrate(&db.pool).await.expect("first migration");
    db.schema.migrate(&db.pool).await.expect("second migration");
    let log = captured.text();
    assert!(
        !log.contains("already exists"),
        "a service's every start would log PostgreSQL's notices:\n{log}"
    );
}
