//! `--inbox-schema`: the handler's effect goes through the PostgreSQL inbox
//! (`redeliver::postgres`), so the suite can check that every message id has exactly one effect
//! whatever the faults (`tests/inbox_*.rs`).
//!
//! Per handled message, in the inbox's transaction: one row `(message_id, worker)` in
//! `<schema>.effects`, a table the test creates *without* a unique constraint (so only the
//! inbox can prevent a second row), then, with `--outbox-queue`, one outbox message to that
//! queue carrying the message id. The fault points a test selects (only on a first delivery,
//! `redelivered = false`, so the same command line can restart the worker and the message then
//! goes through):
//!
//! - `--abort-before-commit <id>` / `--abort-before-commit-rate`: the process aborts inside the
//!   transactional handler after the INSERT, before the commit (the effect is rolled back by
//!   PostgreSQL when the connection drops, the message is redelivered and handled again);
//! - `--abort-after-commit <id>` / `--abort-after-commit-rate`: the process aborts after the
//!   inbox committed and before the handler returns to the worker, i.e. before the ack (the
//!   redelivery must find the inbox row and be acked without calling the handler).
//!
//! Two records are written outside the transaction, one `write(2)` per line: the calls file
//! (`<id> <attempt> <behaviour> <label>`, one line per call of the transactional handler,
//! committed or not) and `--deliveries` (`<id> <label> <start ms> <end ms> <outcome>` with
//! outcome `handled`, `duplicate` or `error`, one line per delivery that reached the inbox and
//! returned).

use std::cell::Cell;
use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use redeliver::postgres::{Inbox, InboxHandler, OutboxMessage, Schema, TransactionalHandler, Tx};
use redeliver::{Context, Handler, HandlerError, Json};
use sqlx::postgres::PgPoolOptions;

use crate::{draw, unix_ms, App, Job};

/// Where a fault is injected.
#[derive(Clone, Debug, Default)]
pub(crate) struct Faults {
    pub before_commit: Vec<String>,
    pub after_commit: Vec<String>,
    pub before_commit_rate: f64,
    pub after_commit_rate: f64,
}

impl Faults {
    /// The seeded draws use salts of their own, so they never move the behaviour draws.
    fn hits(
        &self,
        ids: &[String],
        rate: f64,
        salt: u64,
        app: &App,
        id: &str,
        ctx: &Context,
    ) -> bool {
        !ctx.redelivered()
            && (ids.iter().any(|x| x == id) || draw(app.seed, id, ctx.attempt(), salt) < rate)
    }
}

tokio::task_local! {
    /// Set by the transactional handler when it runs for the delivery the wrapper awaits: the
    /// inbox returns `Ok` both after a commit and for a duplicate, and only this tells them
    /// apart from outside.
    static CALLED: Cell<bool>;
}

/// The transactional handler: the effect row and the optional outbox message.
struct Effect {
    app: Arc<App>,
    insert: String,
    outbox_queue: Option<String>,
    faults: Arc<Faults>,
}

impl TransactionalHandler<Json<Job>> for Effect {
    async fn handle(&self, job: Json<Job>, ctx: Context, tx: &mut Tx) -> Result<(), HandlerError> {
        let _ = CALLED.try_with(|c| c.set(true));
        let job = job.into_inner();
        let id = ctx.message_id().unwrap_or(&job.id).to_owned();
        let attempt = ctx.attempt();
        let behaviour = self.app.behaviour(&job, attempt);
        let what = format!("{behaviour:?}").to_lowercase();
        self.app
            .log_call(&id, attempt, &format!("{what} {}", self.app.label));
        sqlx::query(&self.insert)
            .bind(&id)
            .bind(&self.app.label)
            .execute(&mut **tx)
            .await
            .map_err(HandlerError::transient)?;
        if let Some(queue) = &self.outbox_queue {
            let body = serde_json::json!({ "id": id }).to_string();
            tx.publish(OutboxMessage::new("", queue.as_str(), body).with_message_id(id.as_str()))
                .await
                .map_err(HandlerError::transient)?;
        }
        // After the writes, so that a failure, a panic or a hang always has something to roll
        // back.
        self.app.act(behaviour, &id, attempt).await?;
        let f = &self.faults;
        if f.hits(
            &f.before_commit,
            f.before_commit_rate,
            11,
            &self.app,
            &id,
            &ctx,
        ) {
            tracing::warn!(%id, "injected abort before the commit");
            std::process::abort();
        }
        Ok(())
    }
}

/// The worker's handler: the inbox, then the after-commit fault, then the records.
pub(crate) struct Faulty {
    inbox: InboxHandler<Effect, Json<Job>>,
    app: Arc<App>,
    faults: Arc<Faults>,
    deliveries: Option<Mutex<File>>,
}

impl Handler<Json<Job>> for Faulty {
    async fn handle(&self, job: Json<Job>, ctx: Context) -> Result<(), HandlerError> {
        let id = ctx.message_id().unwrap_or(&job.id).to_owned();
        let start = unix_ms();
        let (called, result) = CALLED
            .scope(Cell::new(false), async {
                let r = self.inbox.handle(job, ctx.clone()).await;
                (CALLED.with(Cell::get), r)
            })
            .await;
        let outcome = match (&result, called) {
            (Ok(()), true) => "handled",
            (Ok(()), false) => "duplicate",
            (Err(_), _) => "error",
        };
        let f = &self.faults;
        if outcome == "handled"
            && f.hits(
                &f.after_commit,
                f.after_commit_rate,
                12,
                &self.app,
                &id,
                &ctx,
            )
        {
            tracing::warn!(%id, "injected abort after the commit, before the ack");
            std::process::abort();
        }
        if let Some(file) = &self.deliveries {
            let line = format!("{id} {} {start} {} {outcome}\n", self.app.label, unix_ms());
            if let Err(e) = App::append(file, &line, false) {
                tracing::warn!(error = %e, "cannot append to the deliveries file");
            }
        }
        result?;
        // As in the plain mode: recorded before the ack, so an id gone from the broker without
        // a record is lost. A duplicate is recorded too (its effect committed earlier, possibly
        // by a process killed before it could record it).
        App::append(
            &self.app.record,
            &format!("{id} {}\n", self.app.label),
            self.app.fsync,
        )
        .map_err(|e| HandlerError::transient(format!("cannot record success: {e}")))
    }
}

/// Settings of the inbox mode.
pub(crate) struct Options {
    pub database_url: String,
    pub schema: String,
    pub consumer: String,
    pub outbox_queue: Option<String>,
    pub deliveries: Option<File>,
    pub faults: Faults,
    pub pool_size: u32,
}

/// Connects, prepares the inbox (fails fast when PostgreSQL is down) and returns the handler.
pub(crate) async fn handler(app: Arc<App>, o: Options) -> anyhow::Result<Faulty> {
    let schema = Schema::named(&o.schema).context("--inbox-schema")?;
    let options: sqlx::postgres::PgConnectOptions = o
        .database_url
        .parse()
        .context("DATABASE_URL is not a PostgreSQL URL")?;
    let pool = PgPoolOptions::new()
        // One connection per running handler (the inbox holds it for the whole transaction),
        // and one for the migrations and the cleanup.
        .max_connections(o.pool_size)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);
    let inbox = Inbox::new(pool, o.consumer).schema(schema.clone());
    inbox.prepare().await.context(
        "cannot prepare the inbox: is PostgreSQL running? \
         (`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` or \
         `bash scripts/postgres.sh up`)",
    )?;
    let insert = format!(
        "INSERT INTO \"{}\".effects (message_id, worker) VALUES ($1, $2)",
        schema.name()
    );
    let faults = Arc::new(o.faults);
    Ok(Faulty {
        inbox: inbox.handler(Effect {
            app: Arc::clone(&app),
            insert,
            outbox_queue: o.outbox_queue,
            faults: Arc::clone(&faults),
        }),
        app,
        faults,
        deliveries: o.deliveries.map(Mutex::new),
    })
}
