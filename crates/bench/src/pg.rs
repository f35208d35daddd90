//! PostgreSQL for scenarios 7 to 9 (inbox, outbox, outbox with refused rows): connecting with
//! a clear message when the database is not there, the run's own schema, pools, and the
//! database's CPU time.

use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use redeliver_postgres::Schema;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// The table both consumers of scenario 7 insert into, one row per message: no unique index,
/// so it costs the same on both sides (the inbox's own row is the difference being measured).
pub const EFFECTS_TABLE: &str = "bench_effects";

fn options(url: &str) -> Result<PgConnectOptions> {
    url.parse().map_err(|e| {
        anyhow!(
            "DATABASE_URL ({}) is not a PostgreSQL URL: {e}",
            redeliver_amqp::url::redact(url)
        )
    })
}

fn no_database(url: &str, why: &str) -> anyhow::Error {
    anyhow!(
        "cannot connect to PostgreSQL at {}: {why}\n\
         The inbox and outbox scenarios need a PostgreSQL database in which the user may create a\n\
         schema (the run creates its own and drops it at the end). Start one with\n    \
         bash scripts/postgres.sh up          (trust auth, database `test`: the default URL)\n\
         or with Docker\n    \
         docker run -d -p 5432:5432 -e POSTGRES_HOST_AUTH_METHOD=trust -e POSTGRES_DB=test postgres:16\n\
         or point DATABASE_URL (or --database-url) at one, or leave both scenarios out:\n    \
         --only happy,retry,delay,park,scale,inflight",
        redeliver_amqp::url::redact(url)
    )
}

/// One plain connection, to fail at the start of a run (not after the other scenarios) and with
/// the reason: a pool would only say that it timed out.
pub async fn check(url: &str) -> Result<()> {
    let opts = options(url)?;
    match tokio::time::timeout(Duration::from_secs(10), PgConnection::connect_with(&opts)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(no_database(url, &e.to_string())),
        Err(_) => Err(no_database(url, "timed out after 10 s")),
    }
}

/// A pool of `size` connections, all of them opened before it is returned: the consumers'
/// drains must not time the connection setup, on either side.
pub async fn pool(url: &str, size: usize) -> Result<PgPool> {
    let size = u32::try_from(size.max(1)).context("pool size")?;
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options(url)?)
        .await
        .map_err(|e| no_database(url, &e.to_string()))?;
    let mut held = Vec::with_capacity(size as usize);
    for _ in 0..size {
        held.push(
            pool.acquire()
                .await
                .with_context(|| format!("opening {size} connections to PostgreSQL"))?,
        );
    }
    drop(held);
    Ok(pool)
}

/// The run's schema: `rbench-3f9a1c2e-` gives `rbench_3f9a1c2e` (PostgreSQL identifiers take no
/// `-`).
pub fn schema_name(run_prefix: &str) -> String {
    run_prefix.trim_end_matches('-').replace('-', "_")
}

/// What scenarios 7 to 9 share: the database URL, a small pool of the parent's, the run's schema.
pub struct PgCtx {
    pub url: String,
    pub pool: PgPool,
    pub schema: Schema,
    /// `server_version`, for the report's header.
    pub version: String,
    /// Whether the database runs on this host, so that its processes' CPU time can be read.
    pub local: bool,
}

impl PgCtx {
    /// Connects, creates the run's schema with the inbox and outbox tables (the crate's own
    /// migrations) and [`EFFECTS_TABLE`].
    pub async fn new(url: &str, run_prefix: &str) -> Result<Self> {
        check(url).await?;
        let opts = options(url)?;
        let local = matches!(opts.get_host(), "127.0.0.1" | "localhost" | "::1")
            || opts.get_host().starts_with('/');
        let pool = pool(url, 8).await?;
        let name = schema_name(run_prefix);
        let schema = Schema::named(&name).with_context(|| format!("schema name '{name}'"))?;
        let version = sqlx::query_scalar::<_, String>("SHOW server_version")
            .fetch_one(&pool)
            .await
            .unwrap_or_else(|_| "(version unknown)".into());
        let me = PgCtx {
            url: url.to_string(),
            pool,
            schema,
            version,
            local,
        };
        let created = async {
            me.schema.migrate(&me.pool).await.with_context(|| {
                format!("creating the inbox and outbox tables in schema '{name}'")
            })?;
            sqlx::query(&format!(
                "CREATE TABLE {} (message_id text NOT NULL, body bytea NOT NULL)",
                me.effects_sql()
            ))
            .execute(&me.pool)
            .await
            .context("creating the effects table")?;
            Ok::<_, anyhow::Error>(())
        }
        .await;
        if let Err(e) = created {
            // Whatever was created before the failure goes with the schema.
            let _ = me.drop_schema().await;
            return Err(e);
        }
        Ok(me)
    }

    /// The effects table, schema-qualified and quoted.
    pub fn effects_sql(&self) -> String {
        effects_sql(self.schema.name())
    }

    /// Empties `tables` (of the run's schema): each round of a side starts from the same
    /// (empty) tables and indexes, not from the rows of the rounds before.
    pub async fn truncate(&self, tables: &[&str]) -> Result<()> {
        let list = tables
            .iter()
            .map(|t| format!("\"{}\".\"{t}\"", self.schema.name()))
            .collect::<Vec<_>>()
            .join(", ");
        sqlx::query(&format!("TRUNCATE {list}"))
            .execute(&self.pool)
            .await
            .with_context(|| format!("TRUNCATE {list}"))?;
        Ok(())
    }

    /// CPU time (user + system) of all the `postgres` processes on this host, microseconds:
    /// the backends serving the consumer, and whatever else the cluster does meanwhile (other
    /// clients, the WAL writer, checkpoints). `None` when the database is not on this host.
    pub fn cpu_us(&self) -> Option<u64> {
        if !self.local {
            return None;
        }
        let mut total = 0u64;
        let mut found = false;
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() != "postgres" {
                continue;
            }
            // A backend may exit between the two reads: it is skipped.
            if let Some(us) = crate::stats::cpu_us_of(pid) {
                total += us;
                found = true;
            }
        }
        found.then_some(total)
    }

    /// Drops the run's schema and everything in it.
    pub async fn drop_schema(&self) -> Result<()> {
        sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema.name()
        ))
        .execute(&self.pool)
        .await
        .with_context(|| format!("dropping schema '{}'", self.schema.name()))?;
        Ok(())
    }
}

/// The effects table of `schema`, quoted.
pub fn effects_sql(schema: &str) -> String {
    format!("\"{schema}\".\"{EFFECTS_TABLE}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_identifiers() {
        assert_eq!(schema_name("rbench-3f9a1c2e-"), "rbench_3f9a1c2e");
        assert!(Schema::named(&schema_name("rbench-3f9a1c2e-")).is_ok());
    }
}
