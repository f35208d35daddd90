//! The test database of the inbox and outbox tests: where it is, a pool on it that fails the
//! test saying how to start PostgreSQL, and schemas dropped when a test ends, also when it fails.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// `DATABASE_URL` when it is not set: the machine's PostgreSQL, trust authentication.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// What a test says when it cannot reach PostgreSQL.
pub const START_POSTGRES: &str = "start PostgreSQL with `bash scripts/postgres.sh up` or \
    `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` (trust \
    authentication for local connections, database `test`), or point DATABASE_URL at one";

/// `DATABASE_URL`, or [`DEFAULT_DATABASE_URL`].
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// A pool of at most `max` connections on the test database. When the database is on this
/// machine and does not answer, its cluster is started (and the database created) once, as the
/// broker tests bring up RabbitMQ.
///
/// # Panics
///
/// When PostgreSQL still cannot be reached: the test fails with the reason and
/// [`START_POSTGRES`]; it never skips.
pub async fn pool(max: u32) -> PgPool {
    let url = database_url();
    let options: PgConnectOptions = url
        .parse()
        .unwrap_or_else(|e| panic!("DATABASE_URL is not a PostgreSQL URL: {e}"));
    // One plain connection first: its error says why (refused, no such database), where a
    // pool's would only say it timed out.
    if let Err(first) = PgConnection::connect_with(&options).await {
        static STARTED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        STARTED.get_or_init(|| start_local(&options)).await;
        if let Err(e) = PgConnection::connect_with(&options).await {
            panic!(
                "cannot connect to PostgreSQL at {}: {e} (first try: {first})\n{START_POSTGRES}",
                redact(&url)
            );
        }
    }
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot connect to PostgreSQL at {}: {e}\n{START_POSTGRES}",
                redact(&url)
            )
        })
}

/// The URL without its user and password.
fn redact(url: &str) -> &str {
    url.rsplit('@').next().unwrap_or(url)
}

/// Starts this machine's cluster(s) and creates the database if missing, when the test
/// database is local. Best effort: the caller's second try reports.
async fn start_local(options: &PgConnectOptions) {
    if !matches!(options.get_host(), "127.0.0.1" | "localhost" | "::1") {
        return;
    }
    if let Ok(versions) = std::fs::read_dir("/etc/postgresql") {
        for version in versions.flatten() {
            let _ = std::process::Command::new("pg_ctlcluster")
                .args(["--skip-systemctl-redirect"])
                .arg(version.file_name())
                .args(["main", "start"])
                .status();
        }
    }
    let Some(database) = options.get_database().map(str::to_owned) else {
        return;
    };
    for _ in 0..25 {
        if let Ok(mut conn) =
            PgConnection::connect_with(&options.clone().database("postgres")).await
        {
            let _ = sqlx::query(&format!("CREATE DATABASE \"{database}\""))
                .execute(&mut conn)
                .await;
            let _ = conn.close().await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Drops schema `name` with everything in it, on a connection and a thread of its own, so that
/// it also works while a failed test unwinds, inside or outside a runtime, and after a
/// PostgreSQL restart broke the test's pool (it waits up to 10 s for PostgreSQL to come back).
pub fn drop_schema(name: &str) {
    let name = name.to_owned();
    let shown = name.clone();
    let dropped = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async move {
            let mut last = String::new();
            for _ in 0..20 {
                match PgConnection::connect(&database_url()).await {
                    Ok(mut conn) => {
                        let r = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                            .execute(&mut conn)
                            .await;
                        let _ = conn.close().await;
                        return r.map(|_| ()).map_err(|e| e.to_string());
                    }
                    Err(e) => last = e.to_string(),
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(last)
        })
    })
    .join();
    if !matches!(dropped, Ok(Ok(()))) {
        eprintln!("could not drop schema {shown}: {dropped:?}");
    }
}

/// Drops its schema (see [`drop_schema`]) when dropped.
#[derive(Debug)]
pub struct SchemaGuard(pub String);

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        drop_schema(&self.0);
    }
}

/// PostgreSQL's cluster, for the restart test: `pg_ctlcluster` on the one version installed.
pub fn pg_ctlcluster(action: &str) -> Result<String, String> {
    let versions: Vec<String> = std::fs::read_dir("/etc/postgresql")
        .map_err(|e| format!("/etc/postgresql: {e}; {START_POSTGRES}"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let [version] = versions.as_slice() else {
        return Err(format!(
            "expected one PostgreSQL version in /etc/postgresql, found {versions:?}"
        ));
    };
    let out = std::process::Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", version, "main", action])
        .output()
        .map_err(|e| format!("run pg_ctlcluster: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "pg_ctlcluster {version} main {action}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A pool of at most `max` connections on the test database whose sessions carry
/// `application_name = app` (so a test can find and terminate the backends of one relay in
/// `pg_stat_activity`), acquiring for at most `acquire_timeout`. Call after [`pool`] (or
/// [`EffectsSchema::new`](crate::effects::EffectsSchema::new)), which makes sure PostgreSQL answers.
pub async fn pool_named(app: &str, max: u32, acquire_timeout: Duration) -> PgPool {
    let url = database_url();
    let options: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .unwrap_or_else(|e| panic!("DATABASE_URL is not a PostgreSQL URL: {e}"))
        .application_name(app);
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(acquire_timeout)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to PostgreSQL: {e}\n{START_POSTGRES}"))
}

/// Starts the machine's PostgreSQL again when dropped, unless it runs: a test that restarts it
/// holds one, so PostgreSQL is left running whatever happens between its stop and its start.
#[derive(Debug)]
pub struct KeepRunning;

impl Drop for KeepRunning {
    fn drop(&mut self) {
        if pg_ctlcluster("status").is_err() {
            if let Err(e) = pg_ctlcluster("start") {
                eprintln!(
                    "PostgreSQL is NOT running after the restart test: {e}\n{START_POSTGRES}"
                );
            }
        }
    }
}
