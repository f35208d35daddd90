//! The crate's errors.

/// A schema, table or channel name that cannot be used.
///
/// Names are used as quoted SQL identifiers, so only a safe subset is accepted: ASCII letters,
/// digits and `_`, not starting with a digit, at most 63 bytes (PostgreSQL's limit), and short
/// enough that the names derived from them fit too (see [`Schema`](crate::Schema)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {value:?}: {reason}")]
pub struct IdentifierError {
    /// Which name: `schema name`, `inbox table name`, `outbox table name`.
    pub what: &'static str,
    /// The name given.
    pub value: String,
    /// Why it is refused.
    pub reason: String,
}

/// What can go wrong in the inbox, the outbox, the relay and the migrations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database refused a statement or could not be reached.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration failed; nothing of it was applied (each run is one transaction).
    #[error("migration {version} ({name}) of table {table} failed: {source}")]
    Migration {
        /// The table the migration is for, `schema.table`.
        table: String,
        /// Its version.
        version: i32,
        /// Its name.
        name: &'static str,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },
    /// A table the crate needs does not exist: nothing prepared its schema yet (a producer
    /// that stores before any [`Schema::prepare`](crate::Schema::prepare)), or migrations are
    /// off ([`Schema::without_migrations`](crate::Schema::without_migrations)) and the team has
    /// not created it.
    #[error("table {table} does not exist: call Schema::prepare(&pool) at start (Inbox::prepare and a starting Relay do it too), or, for a schema the team manages (Schema::without_migrations), create it with the SQL in the redeliver-postgres crate's migrations/")]
    MissingTable {
        /// `schema.table`.
        table: String,
    },
    /// Migrations are off and a table lacks a column the crate uses.
    #[error(
        "table {table} has no column {column}: its definition differs from the crate's migrations/"
    )]
    MissingColumn {
        /// `schema.table`.
        table: String,
        /// The missing column.
        column: &'static str,
    },
    /// An outbox message that could not be published as it is: a name or property longer
    /// than AMQP's 255-byte short strings. Refused when stored, never half-sent later.
    #[error("invalid outbox message: {0}")]
    InvalidMessage(String),
    /// The headers of an outbox row are not a JSON object of strings (the row was not written
    /// by this crate).
    #[error("outbox row {id}: headers are not a JSON object of strings: {source}")]
    Headers {
        /// The row's id.
        id: i64,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The relay cannot connect to the broker: a URL that is not one or TLS files that
    /// cannot be read end [`Relay::run`](crate::Relay::run); an unreachable broker or a
    /// refused login are retried.
    #[error("cannot connect to the broker: {0}")]
    Broker(#[source] redeliver_amqp::ConnectError),
    /// The relay connected but could not open its publishing channels (retried).
    #[error("cannot open the relay's publisher: {0}")]
    Publisher(#[source] redeliver_amqp::PublishError),
}

impl Error {
    /// Whether waiting cannot fix it: everything but an unreachable broker or database.
    pub(crate) fn is_fatal(&self) -> bool {
        use redeliver_amqp::ConnectError;
        match self {
            Error::Broker(ConnectError::Url(_) | ConnectError::Tls(_)) => true,
            Error::Broker(_) | Error::Publisher(_) => false,
            _ => true,
        }
    }
}
