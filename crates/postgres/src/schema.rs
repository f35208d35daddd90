//! Where the inbox and outbox tables live, and the migrations that create them.

use std::collections::HashSet;
use std::fmt;

use sqlx::{Executor, PgPool, Row};

use crate::error::{Error, IdentifierError};

/// PostgreSQL's longest identifier, in bytes (`NAMEDATALEN - 1`).
const MAX_IDENTIFIER: usize = 63;
/// Suffix of the inbox's index on `processed_at`.
const PROCESSED_AT_SUFFIX: &str = "_processed_at_idx";
/// The table recording applied migrations, in the schema.
const MIGRATIONS_TABLE: &str = "schema_migrations";
/// First key of the advisory lock taken while migrating ("rd").
const LOCK_CLASS: i32 = 0x7264;

/// One versioned migration of one table.
struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

const INBOX_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "create",
    sql: include_str!("../migrations/inbox_0001_create.sql"),
}];

const OUTBOX_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "create",
        sql: include_str!("../migrations/outbox_0001_create.sql"),
    },
    Migration {
        version: 2,
        name: "retry",
        sql: include_str!("../migrations/outbox_0002_retry.sql"),
    },
];

/// The PostgreSQL schema and table names of the inbox and the outbox, and whether the crate
/// creates them.
///
/// Defaults: schema `redeliver`, tables `inbox` and `outbox`. Every name is checked when set
/// ([`IdentifierError`]): ASCII letters, digits and `_`, not starting with a digit, at most 63
/// bytes; the inbox table name at most 46 (its index is `<inbox>_processed_at_idx`), and the
/// schema and outbox names together at most 62 (the relay's notification channel is
/// `<schema>.<outbox>`). Names are always quoted, so they are case-sensitive. The schema also
/// holds `schema_migrations`, which neither table may be named.
///
/// [`migrate`](Self::migrate) creates what is missing, under an advisory lock so that several
/// workers starting at once are safe, and records each applied version in
/// `<schema>.schema_migrations` (one row per table and version). A team that manages its own
/// schema turns that off with [`without_migrations`](Self::without_migrations): the tables are
/// then only checked (the SQL to create them is in the crate's `migrations/` directory).
///
/// ```
/// use redeliver::postgres::Schema;
///
/// let schema = Schema::named("billing")?.with_inbox_table("billing_inbox")?;
/// assert_eq!(schema.inbox_table(), "billing_inbox");
/// assert_eq!(schema.outbox_table(), "outbox");
/// assert!(Schema::named("billing; DROP TABLE users").is_err());
/// # Ok::<(), redeliver::postgres::IdentifierError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Schema {
    name: String,
    inbox: String,
    outbox: String,
    migrations: bool,
}

impl Default for Schema {
    fn default() -> Self {
        Self {
            name: "redeliver".into(),
            inbox: "inbox".into(),
            outbox: "outbox".into(),
            migrations: true,
        }
    }
}

impl fmt::Debug for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schema")
            .field("name", &self.name)
            .field("inbox", &self.inbox)
            .field("outbox", &self.outbox)
            .field("migrations", &self.migrations)
            .finish()
    }
}

/// Checks that `value` can be a (quoted) identifier of at most `max` bytes.
fn identifier(what: &'static str, value: &str, max: usize) -> Result<(), IdentifierError> {
    let refuse = |reason: String| IdentifierError {
        what,
        value: value.to_owned(),
        reason,
    };
    let Some(first) = value.chars().next() else {
        return Err(refuse("it is empty".into()));
    };
    if !(first.is_ascii_alphabetic() || first == '_') {
        return Err(refuse("it must start with an ASCII letter or '_'".into()));
    }
    if let Some(c) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
    {
        return Err(refuse(format!(
            "{c:?} is not allowed: only ASCII letters, digits and '_'"
        )));
    }
    if value.len() > max {
        return Err(refuse(format!(
            "it has {} bytes, at most {max} are allowed here",
            value.len()
        )));
    }
    Ok(())
}

/// `name` as a quoted identifier (validated names hold no `"`, but quoting doubles any).
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl Schema {
    /// The defaults in schema `name`.
    pub fn named(name: &str) -> Result<Self, IdentifierError> {
        Self::default().with_name(name)
    }

    /// Puts the tables in schema `name` (default `redeliver`).
    pub fn with_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        identifier("schema name", name, MAX_IDENTIFIER)?;
        self.name = name.to_owned();
        self.check_channel()?;
        Ok(self)
    }

    /// Names the inbox table (default `inbox`).
    pub fn with_inbox_table(mut self, table: &str) -> Result<Self, IdentifierError> {
        identifier(
            "inbox table name",
            table,
            MAX_IDENTIFIER - PROCESSED_AT_SUFFIX.len(),
        )?;
        self.inbox = table.to_owned();
        self.check_distinct("inbox table name", table)?;
        Ok(self)
    }

    /// Names the outbox table (default `outbox`).
    pub fn with_outbox_table(mut self, table: &str) -> Result<Self, IdentifierError> {
        identifier("outbox table name", table, MAX_IDENTIFIER)?;
        self.outbox = table.to_owned();
        self.check_channel()?;
        self.check_distinct("outbox table name", table)?;
        Ok(self)
    }

    /// Turns the migrations off, for a team that manages the schema itself:
    /// [`prepare`](Self::prepare) then only checks that both tables exist with the crate's
    /// columns, and fails with [`Error::MissingTable`] or [`Error::MissingColumn`] otherwise.
    pub fn without_migrations(mut self) -> Self {
        self.migrations = false;
        self
    }

    /// False after [`without_migrations`](Self::without_migrations).
    pub fn migrates(&self) -> bool {
        self.migrations
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The inbox table's name.
    pub fn inbox_table(&self) -> &str {
        &self.inbox
    }

    /// The outbox table's name.
    pub fn outbox_table(&self) -> &str {
        &self.outbox
    }

    /// The channel the outbox notifies on commit and the relay listens to:
    /// `<schema>.<outbox>`.
    pub fn notify_channel(&self) -> String {
        format!("{}.{}", self.name, self.outbox)
    }

    fn check_channel(&self) -> Result<(), IdentifierError> {
        let channel = self.notify_channel();
        if channel.len() > MAX_IDENTIFIER {
            return Err(IdentifierError {
                what: "schema and outbox table names",
                value: channel.clone(),
                reason: format!(
                    "the notification channel '{channel}' would have {} bytes, at most {MAX_IDENTIFIER} are allowed",
                    channel.len()
                ),
            });
        }
        Ok(())
    }

    fn check_distinct(&self, what: &'static str, table: &str) -> Result<(), IdentifierError> {
        if table == MIGRATIONS_TABLE || self.inbox == self.outbox {
            return Err(IdentifierError {
                what,
                value: table.to_owned(),
                reason: format!(
                    "the inbox, the outbox and {MIGRATIONS_TABLE} must be different tables"
                ),
            });
        }
        Ok(())
    }

    /// `"schema"."inbox"`.
    pub(crate) fn inbox_sql(&self) -> String {
        format!("{}.{}", quote(&self.name), quote(&self.inbox))
    }

    /// `"schema"."outbox"`.
    pub(crate) fn outbox_sql(&self) -> String {
        format!("{}.{}", quote(&self.name), quote(&self.outbox))
    }

    /// Makes the tables ready: [`migrate`](Self::migrate), or with migrations off
    /// [`verify`](Self::verify). The inbox and the relay call it before their first use.
    pub async fn prepare(&self, pool: &PgPool) -> Result<(), Error> {
        if self.migrations {
            self.migrate(pool).await
        } else {
            self.verify(pool).await
        }
    }

    /// Creates the schema and applies the migrations of both tables not applied yet, in one
    /// transaction under `pg_advisory_xact_lock` (keyed by the schema's name): workers starting
    /// at once wait for each other, and the later ones find everything applied. Idempotent.
    ///
    /// ```no_run
    /// # async fn demo(pool: redeliver::postgres::sqlx::PgPool) -> Result<(), redeliver::postgres::Error> {
    /// redeliver::postgres::Schema::default().migrate(&pool).await?;
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self, pool: &PgPool) -> Result<(), Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
            .bind(LOCK_CLASS)
            .bind(lock_key(&self.name))
            .execute(&mut *tx)
            .await?;
        let schema = quote(&self.name);
        let ledger = format!("{schema}.{}", quote(MIGRATIONS_TABLE));
        // Every start after the first finds the schema and the ledger: PostgreSQL's notices
        // ("already exists, skipping") would reach the service's log at INFO through sqlx.
        let create = format!(
            "SET LOCAL client_min_messages TO warning;
             CREATE SCHEMA IF NOT EXISTS {schema};
             CREATE TABLE IF NOT EXISTS {ledger} (
                 table_name text NOT NULL,
                 version    integer NOT NULL,
                 name       text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now(),
                 PRIMARY KEY (table_name, version)
             );"
        );
        (&mut *tx).execute(sqlx::raw_sql(&create)).await?;
        let applied: HashSet<(String, i32)> =
            sqlx::query(&format!("SELECT table_name, version FROM {ledger}"))
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .collect::<Result<_, sqlx::Error>>()?;
        let index = quote(&format!("{}{PROCESSED_AT_SUFFIX}", self.inbox));
        for (table, migrations) in [
            (&self.inbox, INBOX_MIGRATIONS),
            (&self.outbox, OUTBOX_MIGRATIONS),
        ] {
            for m in migrations {
                if applied.contains(&(table.clone(), m.version)) {
                    continue;
                }
                let sql = m
                    .sql
                    .replace("{schema}", &schema)
                    .replace("{table}", &quote(table))
                    .replace("{processed_at_index}", &index);
                let failed = |source| Error::Migration {
                    table: format!("{}.{table}", self.name),
                    version: m.version,
                    name: m.name,
                    source,
                };
                (&mut *tx)
                    .execute(sqlx::raw_sql(&sql))
                    .await
                    .map_err(failed)?;
                sqlx::query(&format!(
                    "INSERT INTO {ledger} (table_name, version, name) VALUES ($1, $2, $3)"
                ))
                .bind(table)
                .bind(m.version)
                .bind(m.name)
                .execute(&mut *tx)
                .await
                .map_err(failed)?;
                tracing::info!(
                    schema = %self.name,
                    table = %table,
                    version = m.version,
                    migration = m.name,
                    "applied a migration"
                );
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Checks that both tables exist with the columns the crate uses, without changing
    /// anything: [`Error::MissingTable`] or [`Error::MissingColumn`] otherwise.
    pub async fn verify(&self, pool: &PgPool) -> Result<(), Error> {
        const INBOX: &[&str] = &["consumer", "message_id", "processed_at"];
        const OUTBOX: &[&str] = &[
            "id",
            "message_id",
            "exchange",
            "routing_key",
            "body",
            "content_type",
            "headers",
            "created_at",
            "attempts",
            "next_attempt_at",
            "last_error",
            "parked_at",
            "parked_reason",
        ];
        for (table, columns) in [(&self.inbox, INBOX), (&self.outbox, OUTBOX)] {
            let found: HashSet<String> = sqlx::query(
                "SELECT column_name::text FROM information_schema.columns
                 WHERE table_schema = $1 AND table_name = $2",
            )
            .bind(&self.name)
            .bind(table)
            .fetch_all(pool)
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, sqlx::Error>>()?;
            let qualified = format!("{}.{table}", self.name);
            if found.is_empty() {
                return Err(Error::MissingTable { table: qualified });
            }
            if let Some(column) = columns.iter().find(|c| !found.contains(**c)) {
                return Err(Error::MissingColumn {
                    table: qualified,
                    column,
                });
            }
        }
        Ok(())
    }
}

/// A stable 32-bit key for the advisory lock of schema `name` (FNV-1a, folded): the same in
/// every build and on every machine, unlike the standard library's hasher.
fn lock_key(name: &str) -> i32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in name.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // The two halves folded into one; the cast keeps the bits.
    ((hash >> 32) ^ (hash & 0xffff_ffff)) as u32 as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers() {
        assert!(Schema::named("redeliver_2").is_ok());
        assert!(Schema::named("_x").is_ok());
        for bad in ["", "1abc", "a-b", "a b", "a\"b", "a;b", "é", "a.b"] {
            assert!(Schema::named(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Schema::named(&"a".repeat(63)).is_err(), "channel too long");
        assert!(Schema::named(&"a".repeat(56)).is_ok());
        assert!(Schema::default().with_inbox_table(&"i".repeat(47)).is_err());
        assert!(Schema::default().with_inbox_table(&"i".repeat(46)).is_ok());
        assert!(Schema::default().with_inbox_table("outbox").is_err());
        assert!(Schema::default()
            .with_outbox_table("schema_migrations")
            .is_err());
        assert_eq!(quote("a\"b"), "\"a\"\"b\"");
        assert_eq!(lock_key("redeliver"), lock_key("redeliver"));
        assert_ne!(lock_key("redeliver"), lock_key("redelivef"));
    }
}
