//! A web service that hands image processing to a worker through the transactional outbox:
//! no dual write.
//!
//! `POST /images` with `{"url": "...", "width": N}` inserts a row into the business table
//! `images` and stores the processing job with [`Outbox::store`] in the same transaction, then
//! commits and answers `202 Accepted`. Writing the row and publishing the job separately would
//! lose the job when the broker is down after the commit (or publish a job for a row that was
//! rolled back); here both commit together or not at all. Whatever fails before the commit
//! rolls both back and publishes nothing: a width out of range (the table's CHECK refuses it:
//! 422), a database error (500, or 503 while the database is unreachable). A [`Relay`] in the
//! same process, woken by the commit's `NOTIFY`, publishes the job to the `images` queue, where
//! `examples/image_processing.rs` consumes it. `GET /images/{id}` shows the row.
//!
//! ```text
//! cargo run --example image_processing     # the worker, in one terminal
//! cargo run --example outbox_web           # this service, in another
//! curl -i localhost:3000/images -d '{"url": "https://images.example/1.jpg", "width": 640}'
//! curl localhost:3000/images/1
//! redeliver outbox status                  # jobs waiting for the broker (none while it is up)
//! ```
//!
//! Configured from the environment: `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); `AMQP_URL`, `REDELIVER_QUEUE` (default
//! `images`), `REDELIVER_PREFIX`, `REDELIVER_CONNECTION_NAME` (the relay's connection) and the
//! TLS variables, as the worker reads them; `WEB_ADDR` (default `127.0.0.1:3000`);
//! `REDELIVER_PG_SCHEMA` (schema of the outbox table, default `redeliver`); `APP_SCHEMA`
//! (schema of the `images` table, default `public`); `REDELIVER_LOG_FORMAT` and `RUST_LOG`.
//!
//! Only the database is needed to accept requests: while the broker is unreachable the jobs
//! wait in the outbox (`redeliver outbox status` counts them) and the relay reconnects with
//! backoff, then publishes them, each with the message id stored with it. A job the broker
//! refuses (no queue bound) is tried again with backoff and, after the relay's policy, parked:
//! `redeliver outbox parked list` shows it, `replay` publishes it again. `/livez` answers
//! while the process runs, `/readyz` while the database does.

#[path = "common/logging.rs"]
mod logging;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context as _};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use redeliver::postgres::{Outbox, OutboxMessage, Relay, Schema};
use redeliver::worker::env::ServiceSettings;
use redeliver::{CancellationToken, Settings, Topology, WorkerBuilder};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};

/// Used when `DATABASE_URL` is not set: a local server with the default account.
const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const DEFAULT_WEB_ADDR: &str = "127.0.0.1:3000";
/// Queue of the example worker when `REDELIVER_QUEUE` is not set.
const DEFAULT_QUEUE: &str = "images";
/// The widest image accepted (the table's CHECK, in its message).
const MAX_WIDTH: i64 = 20_000;
const MAX_URL_LEN: usize = 2048;
/// Longest pause between two attempts to declare the queue's topology.
const MAX_DECLARE_BACKOFF: Duration = Duration::from_secs(30);

/// What the environment configures.
struct Config {
    database_url: String,
    /// Where the outbox table lives (`REDELIVER_PG_SCHEMA`); `redeliver outbox status --schema`
    /// reads the same variable.
    outbox_schema: Schema,
    /// Where the `images` table lives (`APP_SCHEMA`).
    app_schema: String,
    addr: SocketAddr,
    /// AMQP_URL, REDELIVER_QUEUE, REDELIVER_PREFIX and TLS, read as the worker reads them.
    broker: Settings,
}

/// A variable's value; empty counts as unset, as for the worker's variables.
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Config {
    fn from_env() -> anyhow::Result<Self> {
        let database_url = var("DATABASE_URL").unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned());
        let outbox_schema = match var("REDELIVER_PG_SCHEMA") {
            Some(name) => Schema::named(&name).context("REDELIVER_PG_SCHEMA")?,
            None => Schema::default(),
        };
        let app_schema = var("APP_SCHEMA").unwrap_or_else(|| "public".to_owned());
        // The name is put into SQL: a schema name validates it (same rules as PostgreSQL's
        // unquoted identifiers, ASCII only).
        Schema::named(&app_schema).context("APP_SCHEMA")?;
        let addr = var("WEB_ADDR").unwrap_or_else(|| DEFAULT_WEB_ADDR.to_owned());
        let addr = addr
            .parse()
            .map_err(|e| anyhow!("invalid WEB_ADDR={addr:?}: {e} (expected 127.0.0.1:3000)"))?;
        let broker = WorkerBuilder::from_env()?.settings().clone();
        Ok(Self {
            database_url,
            outbox_schema,
            app_schema,
            addr,
            broker,
        })
    }
}

/// What every request handler shares.
struct App {
    pool: PgPool,
    outbox: Outbox,
    /// The full queue name, prefix included: jobs go through the default exchange to it.
    queue: String,
    insert: String,
    select: String,
}

/// The body of `POST /images`. The width is read as a signed integer so that a negative one
/// reaches the table's CHECK and is refused with the same message as 0.
#[derive(Deserialize)]
struct NewImage {
    url: String,
    width: i64,
}

/// The job as `examples/image_processing.rs` decodes it (its `ImageJob`).
#[derive(Serialize)]
struct ImageJob<'a> {
    id: i64,
    url: &'a str,
    width: i64,
}

/// A response with a JSON body and a status: every error of the API is one of these.
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, &json!({ "error": self.message }))
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            // The width is validated by the table (CHECK, or too large for an integer): the
            // transaction fails before its commit, so neither the row nor the job exists.
            sqlx::Error::Database(db)
                if matches!(db.code().as_deref(), Some("23514" | "22003")) =>
            {
                Self::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("width must be between 1 and {MAX_WIDTH}"),
                )
            }
            sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed => {
                tracing::warn!(error = %e, "database unavailable");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the database is unavailable",
                )
            }
            _ => {
                // The details stay in the log: they may name tables and constraints.
                tracing::error!(error = %e, "database error");
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "database error")
            }
        }
    }
}

impl From<redeliver::postgres::Error> for ApiError {
    fn from(e: redeliver::postgres::Error) -> Self {
        match e {
            redeliver::postgres::Error::Database(db) => db.into(),
            other => {
                tracing::error!(error = %other, "outbox error");
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "outbox error")
            }
        }
    }
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// `POST /images`: the row and its job in one transaction.
async fn create_image(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let new: NewImage = serde_json::from_slice(&body).map_err(|e| {
        // Not JSON at all is a bad request; JSON of the wrong shape cannot be processed.
        let status = if e.is_data() {
            StatusCode::UNPROCESSABLE_ENTITY
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(status, format!("invalid body: {e}"))
    })?;
    validate(&new)?;

    let message_id = uuid::Uuid::new_v4().to_string();
    let mut tx = app.pool.begin().await?;
    let row = sqlx::query(&app.insert)
        .bind(&new.url)
        .bind(new.width)
        .bind(&message_id)
        .fetch_one(&mut *tx)
        .await?;
    let id: i64 = row.try_get("id")?;
    let job = ImageJob {
        id,
        url: &new.url,
        width: new.width,
    };
    let message = OutboxMessage::json("", &app.queue, &job)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .with_message_id(&message_id);
    app.outbox.store(&mut tx, &message).await?;
    // Any `?` above dropped `tx`, which rolls back: neither the row nor the job exists then.
    tx.commit().await?;
    tracing::info!(id, message_id = %message_id, url = %new.url, "image accepted");

    let mut response = json_response(
        StatusCode::ACCEPTED,
        &json!({ "id": id, "message_id": message_id, "status": "queued" }),
    );
    if let Ok(location) = format!("/images/{id}").parse() {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

/// What the table cannot check. The width is left to the table's CHECK (in the transaction).
fn validate(new: &NewImage) -> Result<(), ApiError> {
    let unprocessable = |m: String| Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, m));
    if !(new.url.starts_with("http://") || new.url.starts_with("https://")) {
        return unprocessable("url must be an http:// or https:// URL".to_owned());
    }
    if new.url.len() > MAX_URL_LEN {
        return unprocessable(format!("url must be at most {MAX_URL_LEN} bytes"));
    }
    Ok(())
}

/// `GET /images/{id}`.
async fn show_image(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id: i64 = id
        .parse()
        .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "the id must be an integer"))?;
    let row = sqlx::query(&app.select)
        .bind(id)
        .fetch_optional(&app.pool)
        .await?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no image {id}")))?;
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "id": row.try_get::<i64, _>("id")?,
            "url": row.try_get::<String, _>("url")?,
            "width": row.try_get::<i32, _>("width")?,
            "status": row.try_get::<String, _>("status")?,
            "message_id": row.try_get::<String, _>("message_id")?,
            "created_at": row.try_get::<String, _>("created_at")?,
        }),
    ))
}

async fn ready(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    sqlx::query("SELECT 1").execute(&app.pool).await?;
    Ok(json_response(StatusCode::OK, &json!({ "status": "ready" })))
}

/// Creates the business table if it is missing (a real service has its own migrations). Its
/// CHECK is the width rule, for every writer, so no job the worker must refuse is stored.
async fn create_images_table(pool: &PgPool, schema: &str) -> anyhow::Result<()> {
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
         CREATE TABLE IF NOT EXISTS \"{schema}\".images (
             id         bigserial   PRIMARY KEY,
             url        text        NOT NULL,
             width      integer     NOT NULL CHECK (width BETWEEN 1 AND {MAX_WIDTH}),
             status     text        NOT NULL DEFAULT 'queued',
             message_id text        NOT NULL UNIQUE,
             created_at timestamptz NOT NULL DEFAULT now()
         );"
    ))
    .execute(pool)
    .await
    .with_context(|| format!("creating the table \"{schema}\".images"))?;
    Ok(())
}

/// Declares the queue's topology once the broker answers, retrying with backoff meanwhile: as
/// examples/publish.rs, jobs can be accepted before the worker ever ran, and they wait in the
/// queue rather than be refused as unroutable (which the relay would retry, then park).
async fn declare_when_reachable(broker: Settings, topology: Topology, token: CancellationToken) {
    let url = redeliver::amqp::url::redact(broker.url());
    let mut backoff = Duration::from_millis(100);
    while !token.is_cancelled() {
        let declared = async {
            let conn = tokio::time::timeout(
                Duration::from_secs(10),
                redeliver::amqp::connect(broker.url(), Default::default(), broker.tls()),
            )
            .await
            .map_err(|_| anyhow!("no answer within 10 s"))?
            .map_err(anyhow::Error::from)?;
            let declared = topology.declare(&conn).await;
            let _ = conn.close(200, "topology declared".into()).await;
            declared.context("declaring the queue's topology")
        }
        .await;
        match declared {
            Ok(()) => return,
            Err(e) => tracing::warn!(
                broker = %url,
                error = format!("{e:#}"),
                retry_in = ?backoff,
                "cannot declare the queue yet; jobs wait in the outbox meanwhile"
            ),
        }
        tokio::select! {
            () = token.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_DECLARE_BACKOFF);
    }
}

/// Cancels `token` on SIGINT or SIGTERM.
fn cancel_on_signal(token: CancellationToken) -> anyhow::Result<()> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
        tracing::info!("shutdown requested");
        token.cancel();
    });
    Ok(())
}

async fn run() -> anyhow::Result<()> {
    let service = ServiceSettings::from_env()?;
    logging::init(&service, &["lapin", "sqlx"])?;
    let cfg = Config::from_env()?;

    let options: PgConnectOptions = cfg.database_url.parse().map_err(|e| {
        anyhow!(
            "DATABASE_URL is not a PostgreSQL URL ({}): {e}",
            redact_database_url(&cfg.database_url)
        )
    })?;
    // The pool-size rule of redeliver::postgres: 8 requests in their transactions at once, and
    // 2 for the relay (its LISTEN and its rounds).
    let pool = PgPoolOptions::new()
        .max_connections(8 + 2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .with_context(|| {
            format!(
                "cannot connect to PostgreSQL at {} (start one, e.g. `docker compose -f \
                 compose/docker-compose.yml up -d postgres`, or set DATABASE_URL)",
                redact_database_url(&cfg.database_url)
            )
        })?;
    create_images_table(&pool, &cfg.app_schema).await?;
    // Before the first request: storing a job needs the outbox table (the relay would create
    // it too, but only once the broker answers).
    cfg.outbox_schema
        .prepare(&pool)
        .await
        .context("preparing the outbox table")?;

    let queue_name = cfg.broker.queue().unwrap_or(DEFAULT_QUEUE).to_owned();
    let mut topology = Topology::new(queue_name);
    if let Some(prefix) = cfg.broker.prefix() {
        topology = topology.prefix(prefix);
    }
    let images = format!("\"{}\".images", cfg.app_schema);
    let app = Arc::new(App {
        pool: pool.clone(),
        outbox: Outbox::new(cfg.outbox_schema.clone()),
        queue: topology.queue_name(),
        insert: format!(
            "INSERT INTO {images} (url, width, message_id) VALUES ($1, $2, $3) RETURNING id"
        ),
        select: format!(
            "SELECT id, url, width, status, message_id,
                    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
                        AS created_at
             FROM {images} WHERE id = $1"
        ),
    });

    let token = CancellationToken::new();
    cancel_on_signal(token.clone())?;
    tokio::spawn(declare_when_reachable(
        cfg.broker.clone(),
        topology,
        token.clone(),
    ));
    // The relay connects (and reconnects) to the broker itself; it ends only when cancelled or
    // on a setting waiting cannot fix, which then stops the service.
    let relay = Relay::new(pool.clone(), cfg.broker.url())
        .failover_urls(cfg.broker.failover_urls().iter().cloned())
        .tls(cfg.broker.tls().clone())
        .connection_name(
            cfg.broker
                .connection_name()
                .unwrap_or("outbox-web-relay")
                .to_owned(),
        )
        .schema(cfg.outbox_schema.clone());
    let relay = tokio::spawn({
        let token = token.clone();
        async move {
            let result = relay.run(token.clone()).await;
            token.cancel();
            result
        }
    });

    let router = Router::new()
        .route("/images", post(create_image))
        .route("/images/{id}", get(show_image))
        .route(
            "/livez",
            get(|| async { json_response(StatusCode::OK, &json!({"status": "alive"})) }),
        )
        .route("/readyz", get(ready))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed here")
        })
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .with_context(|| format!("cannot listen on {} (WEB_ADDR)", cfg.addr))?;
    tracing::info!(
        addr = %listener.local_addr().unwrap_or(cfg.addr),
        outbox = %cfg.outbox_schema.notify_channel(),
        "accepting POST /images"
    );
    let shutdown = token.clone();
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .context("serving HTTP");
    // The HTTP server may also stop on an error: the relay must stop with it.
    token.cancel();
    let relayed = match relay.await {
        Ok(r) => r.context("the outbox relay"),
        Err(e) => Err(anyhow!("the relay task failed: {e}")),
    };
    pool.close().await;
    served.and(relayed)
}

/// `DATABASE_URL` without its password, for messages.
fn redact_database_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(not a URL)".to_owned();
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => format!("{userinfo}@{host}"),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|kv| match kv.split_once('=') {
                    Some(("password", _)) => "password=***".to_owned(),
                    _ => kv.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
