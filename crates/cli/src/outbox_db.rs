//! Where the outbox commands connect (`--database-url`, `--schema`, `--outbox-table`), their
//! errors and hints, and `outbox status`.

use std::fmt;
use std::time::Duration;

use anyhow::Context as _;
use redeliver_postgres::{pending, Pending, Schema};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions as _, Connection as _, PgPool};

use crate::cli::{OutboxDbArgs, OutboxStatusArgs};
use crate::errors::UsageError;
use crate::output;

/// The database did not answer within `--connect-timeout`.
#[derive(Debug)]
struct NoAnswer(String);

impl fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for NoAnswer {}

/// The outbox table (or its schema) does not exist in that database.
#[derive(Debug)]
struct OutboxMissing {
    table: String,
}

impl fmt::Display for OutboxMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the outbox table {} does not exist", self.table)
    }
}
impl std::error::Error for OutboxMissing {}

/// `outbox status --json`.
#[derive(Debug, Serialize)]
struct StatusJson<'a> {
    outbox: String,
    schema: &'a str,
    table: &'a str,
    pending: u64,
    oldest_age_seconds: Option<f64>,
    retrying: u64,
    parked: u64,
    oldest_parked_age_seconds: Option<f64>,
}

/// Where an outbox command connects, checked before anything connects (a usage error, exit
/// code 2, when the URL or the names are wrong).
#[derive(Debug)]
pub(crate) struct Target {
    options: PgConnectOptions,
    pub(crate) schema: Schema,
}

impl Target {
    pub(crate) fn of(args: &OutboxDbArgs) -> anyhow::Result<Self> {
        let url = args.database_url.as_deref().ok_or_else(|| {
            UsageError(
                "no database: give --database-url or set DATABASE_URL \
                 (postgres://USER:PASSWORD@HOST:PORT/DATABASE)"
                    .to_owned(),
            )
        })?;
        let schema = Schema::named(&args.schema)
            .and_then(|s| s.with_outbox_table(&args.outbox_table))
            .map_err(|e| UsageError(format!("--schema / --outbox-table: {e}")))?;
        let not_postgres = |why: String| {
            UsageError(format!(
                "--database-url / DATABASE_URL is not a PostgreSQL URL \
                 (postgres://USER:PASSWORD@HOST:PORT/DATABASE): {why}"
            ))
        };
        // sqlx reads any scheme as PostgreSQL's: a MySQL URL would be tried as one.
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(
                not_postgres("it must start with postgres:// or postgresql://".to_owned()).into(),
            );
        }
        let options: PgConnectOptions = url.parse().map_err(|e| not_postgres(format!("{e}")))?;
        Ok(Self { options, schema })
    }

    /// `schema.table`, as messages name the outbox.
    pub(crate) fn table(&self) -> String {
        format!("{}.{}", self.schema.name(), self.schema.outbox_table())
    }
}

/// A pool of one connection on the outbox's database, and what error messages say of it.
#[derive(Debug)]
pub(crate) struct Db {
    pub(crate) pool: PgPool,
    pub(crate) schema: Schema,
    /// `postgres://USER@HOST:PORT/DATABASE`, without the password.
    at: String,
}

impl Db {
    /// `e` with the context "cannot {doing} at {where}"; a missing table becomes the error
    /// the hints recognise.
    pub(crate) fn error(&self, e: redeliver_postgres::Error, doing: &str) -> anyhow::Error {
        let table = format!("{}.{}", self.schema.name(), self.schema.outbox_table());
        let context = format!("cannot {doing} at {}", self.at);
        match e {
            redeliver_postgres::Error::MissingTable { .. } => {
                anyhow::Error::new(OutboxMissing { table }).context(context)
            }
            e => anyhow::Error::new(e).context(context),
        }
    }

    pub(crate) async fn close(self) {
        self.pool.close().await;
    }
}

/// A runtime on this thread: one connection, a few queries.
pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

pub(crate) fn status(args: &OutboxStatusArgs, timeout: Duration) -> anyhow::Result<()> {
    let target = Target::of(&args.db)?;
    let found = runtime()?.block_on(async {
        let db = connect(&target, timeout).await?;
        let table = target.table();
        let result = pending(&db.pool, &db.schema)
            .await
            .map_err(|e| db.error(e, &format!("read the outbox {table}")));
        db.close().await;
        result
    })?;
    print(&target.schema, found, args.json)
}

/// `postgres://USER@HOST:PORT/DATABASE`: where the command connects, without the password.
fn shown(options: &PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        options.get_username(),
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or(options.get_username())
    )
}

/// Connects to `target`'s database within `timeout`.
pub(crate) async fn connect(target: &Target, timeout: Duration) -> anyhow::Result<Db> {
    let at = shown(&target.options);
    // A connection of its own first: its error says why (refused, a wrong password, no such
    // database), where a pool retries a refused connection until its timeout and then only
    // says that it timed out.
    let conn = match tokio::time::timeout(timeout, target.options.connect()).await {
        Ok(result) => result.with_context(|| format!("cannot connect to PostgreSQL at {at}"))?,
        Err(_) => {
            return Err(anyhow::Error::new(NoAnswer(format!(
                "no answer within {}",
                humantime::format_duration(timeout)
            )))
            .context(format!("cannot connect to PostgreSQL at {at}")))
        }
    };
    let _ = conn.close().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(timeout)
        .connect_lazy_with(target.options.clone());
    Ok(Db {
        pool,
        schema: target.schema.clone(),
        at,
    })
}

/// Seconds with millisecond resolution, for JSON: ages are measured by the database's
/// clock, at a statement's start.
pub(crate) fn age_seconds(age: Option<Duration>) -> Option<f64> {
    age.map(|d| (d.as_secs_f64() * 1000.0).round() / 1000.0)
}

fn print(schema: &Schema, found: Pending, json: bool) -> anyhow::Result<()> {
    let outbox = format!("{}.{}", schema.name(), schema.outbox_table());
    if json {
        return output::print_json(
            &StatusJson {
                outbox,
                schema: schema.name(),
                table: schema.outbox_table(),
                pending: found.count,
                oldest_age_seconds: age_seconds(found.oldest_age),
                retrying: found.retrying,
                parked: found.parked,
                oldest_parked_age_seconds: age_seconds(found.oldest_parked_age),
            },
            "the outbox status",
        );
    }
    println!("{}", status_text(&outbox, &found));
    Ok(())
}

/// The text of `outbox status`: one line, and one more when rows are parked.
fn status_text(outbox: &str, found: &Pending) -> String {
    let mut out = match found.oldest_age {
        Some(age) if found.count > 0 => format!(
            "outbox {outbox}: {} pending, the oldest for {}",
            found.count,
            human_age(age)
        ),
        _ => format!("outbox {outbox}: nothing pending"),
    };
    if found.retrying > 0 {
        out.push_str(&format!(
            " ({} of them retrying after the broker refused them)",
            found.retrying
        ));
    }
    if found.parked > 0 {
        let since = found.oldest_parked_age.map_or_else(String::new, |a| {
            format!(", the oldest for {}", human_age(a))
        });
        out.push_str(&format!(
            "\noutbox {outbox}: {} parked (the relay gave up on them){since}: see \
             `redeliver outbox parked stats`",
            found.parked
        ));
    }
    out
}

/// Whole seconds from a second on (`1m 5s`), milliseconds below.
pub(crate) fn human_age(age: Duration) -> String {
    let shown = if age >= Duration::from_secs(1) {
        Duration::from_secs(age.as_secs())
    } else {
        Duration::from_millis(age.as_millis() as u64)
    };
    humantime::format_duration(shown).to_string()
}

const START_POSTGRES: &str = "is PostgreSQL running and listening there? Start one (`docker \
    compose -f compose/docker-compose.yml up -d postgres`), or point --database-url / \
    DATABASE_URL at yours";

pub(crate) fn hints(err: &anyhow::Error) -> Vec<String> {
    for cause in err.chain() {
        if cause.is::<NoAnswer>() {
            return vec![START_POSTGRES.to_owned()];
        }
        if cause.is::<OutboxMissing>() {
            return vec![
                "the services create it when they start (the outbox relay and the \
                 inbox run redeliver_postgres::Schema::prepare), or an operator applies the \
                 SQL of the redeliver-postgres crate's migrations/; check that --schema and \
                 --outbox-table (REDELIVER_PG_SCHEMA) name the services' tables and that \
                 --database-url names their database"
                    .to_owned(),
            ];
        }
        let sqlx_err = cause.downcast_ref::<sqlx::Error>().or_else(|| {
            match cause.downcast_ref::<redeliver_postgres::Error>() {
                Some(redeliver_postgres::Error::Database(e)) => Some(e),
                _ => None,
            }
        });
        if let Some(e) = sqlx_err {
            if let Some(h) = sqlx_hint(e) {
                return vec![h];
            }
        }
    }
    Vec::new()
}

fn sqlx_hint(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Io(io) => match io.kind() {
            kind if crate::errors::nothing_there(kind) => Some(START_POSTGRES.to_owned()),
            _ => None,
        },
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("28P01" | "28000") => Some(
                "PostgreSQL refused the login: check the user and password in \
                 --database-url / DATABASE_URL (and the server's pg_hba.conf)"
                    .to_owned(),
            ),
            Some("3D000") => Some(
                "the database named in --database-url / DATABASE_URL (the URL's path) \
                 does not exist on that server"
                    .to_owned(),
            ),
            Some("42501") => Some(
                "the user may not use the outbox table: GRANT USAGE on its schema and \
                 SELECT on the table to it (UPDATE for `outbox parked replay`, DELETE for \
                 `outbox parked purge`), or use the services' user"
                    .to_owned(),
            ),
            Some("42703") => Some(
                "the outbox table lacks a column the crate uses: its definition differs \
                 from the redeliver-postgres crate's migrations/ (the retry and parking \
                 columns come with outbox_0002_retry.sql, which a relay of this version \
                 applies when it starts)"
                    .to_owned(),
            ),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_are_whole_seconds_from_one_second_on() {
        assert_eq!(human_age(Duration::from_millis(65_400)), "1m 5s");
        assert_eq!(human_age(Duration::from_millis(250)), "250ms");
    }

    #[test]
    fn status_names_the_retrying_and_parked_rows() {
        let mut p = Pending {
            count: 3,
            oldest_age: Some(Duration::from_secs(65)),
            retrying: 0,
            parked: 0,
            oldest_parked_age: None,
        };
        assert_eq!(
            status_text("s.o", &p),
            "outbox s.o: 3 pending, the oldest for 1m 5s"
        );
        p.retrying = 1;
        p.parked = 2;
        p.oldest_parked_age = Some(Duration::from_secs(7200));
        assert_eq!(
            status_text("s.o", &p),
            "outbox s.o: 3 pending, the oldest for 1m 5s (1 of them retrying after the \
             broker refused them)\noutbox s.o: 2 parked (the relay gave up on them), the \
             oldest for 2h: see `redeliver outbox parked stats`"
        );
    }

    #[test]
    fn the_shown_url_has_no_password() {
        let options: PgConnectOptions = "postgres://app:s3cret@db.internal:6432/shop"
            .parse()
            .unwrap();
        assert_eq!(shown(&options), "postgres://app@db.internal:6432/shop");
    }
}
