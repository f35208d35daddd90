//! `topology declare|verify|show|delete`.

use anyhow::Context as _;
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ExchangeKind};
use redeliver_amqp::DelayConfig;
use redeliver_amqp::{QueueType, Topology};
use serde::Serialize;
use serde_json::Value;

use crate::browse;
use crate::cli::{DelayArgs, TopologyArgs};
use crate::errors::UsageError;
use crate::output::{self, table_json, Table};

/// The delay configuration the flags describe.
pub(crate) fn delay_config(prefix: &str, d: &DelayArgs) -> DelayConfig {
    DelayConfig::new()
        .prefix(prefix)
        .levels(d.levels)
        .granularity(d.granularity)
        .queue_type(if d.delay_classic {
            QueueType::Classic
        } else {
            QueueType::Quorum
        })
}

/// The topology the flags describe. The delay configuration is always given explicitly so its
/// queue type follows --delay-classic, not --classic.
pub(crate) fn topology(a: &TopologyArgs) -> Topology {
    let mut t = Topology::new(a.queue.clone())
        .prefix(a.prefix.clone())
        .queue_type(if a.classic {
            QueueType::Classic
        } else {
            QueueType::Quorum
        })
        .delivery_limit(if a.no_delivery_limit {
            None
        } else {
            Some(a.delivery_limit)
        })
        .dlq_queue_type(if a.quorum_dlq {
            QueueType::Quorum
        } else {
            QueueType::Classic
        })
        .delay(delay_config(&a.prefix, &a.delay));
    if let Some(ttl) = a.dlq_message_ttl {
        t = t.dlq_message_ttl(ttl);
    }
    if let Some(n) = a.dlq_max_length {
        t = t.dlq_max_length(n);
    }
    for (ex, key) in &a.bindings {
        t = t.bind(ex.clone(), key.clone());
    }
    t
}

fn describe_delay(a: &TopologyArgs) -> String {
    format!(
        "the delay infrastructure '{}redeliver.delay.*' ({} {} levels of {})",
        a.prefix,
        a.delay.levels,
        if a.delay.delay_classic {
            "classic"
        } else {
            "quorum"
        },
        humantime::format_duration(a.delay.granularity)
    )
}

/// What `declare --json` / `verify --json` print (`declared` or `ok` is set, the other absent).
#[derive(Debug, Serialize)]
struct Names {
    #[serde(skip_serializing_if = "Option::is_none")]
    declared: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ok: Option<bool>,
    queue: String,
    queue_type: &'static str,
    dlx: String,
    dlq: String,
    dlq_type: &'static str,
    delay: DelayJson,
}

/// The shared delay infrastructure in JSON reports.
#[derive(Debug, Serialize)]
struct DelayJson {
    prefix: String,
    levels: u8,
    granularity_ms: u64,
    queue_type: &'static str,
}

impl DelayJson {
    fn new(a: &TopologyArgs) -> Self {
        Self {
            prefix: a.prefix.clone(),
            levels: a.delay.levels,
            granularity_ms: u64::try_from(a.delay.granularity.as_millis()).unwrap_or(u64::MAX),
            queue_type: if a.delay.delay_classic {
                "classic"
            } else {
                "quorum"
            },
        }
    }
}

impl Names {
    fn new(a: &TopologyArgs, t: &Topology) -> Self {
        Self {
            declared: None,
            ok: None,
            queue: t.queue_name(),
            queue_type: if a.classic { "classic" } else { "quorum" },
            dlx: t.dlx_name(),
            dlq: t.dlq_name(),
            dlq_type: t.configured_dlq_queue_type().as_str(),
            delay: DelayJson::new(a),
        }
    }
}

/// What `delete --json` prints.
#[derive(Debug, Serialize)]
struct Deleted {
    deleted: bool,
    queue: String,
    dlx: String,
    dlq: String,
    delay_deleted: bool,
    /// The delay infrastructure deleted with --include-delay, else null.
    delay: Option<DelayJson>,
    /// Delay queues deleted with their messages (--force), and how many each held.
    discarded: Vec<QueueCount>,
}

/// A delay queue and the messages it held.
#[derive(Clone, Debug, Serialize)]
struct QueueCount {
    queue: String,
    messages: u32,
}

impl QueueCount {
    fn list(v: &[QueueCount]) -> String {
        v.iter()
            .map(|c| format!("'{}' ({} message(s))", c.queue, c.messages))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What `delete --include-delay --json` prints when delay queues hold messages and --force was
/// not given, before it fails.
#[derive(Debug, Serialize)]
struct Refused {
    deleted: bool,
    refused: bool,
    queue: String,
    dlx: String,
    dlq: String,
    /// The delay queues that hold messages: none of them was deleted.
    non_empty: Vec<QueueCount>,
    /// Empty delay queues deleted before a queue that had meanwhile received messages was
    /// found (only when messages arrived during the command); nothing else was deleted.
    already_deleted: Vec<String>,
    error: String,
}

/// Why the delay infrastructure was not deleted: queues that hold messages.
#[derive(Debug)]
struct Refusal {
    non_empty: Vec<QueueCount>,
    already_deleted: Vec<String>,
}

impl Refusal {
    fn message(&self, a: &TopologyArgs) -> String {
        let done = if self.already_deleted.is_empty() {
            "nothing was deleted".to_owned()
        } else {
            format!(
                "messages arrived while deleting: only the empty queues {} were deleted, nothing \
                 else",
                self.already_deleted
                    .iter()
                    .map(|q| format!("'{q}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        format!(
            "refusing to delete {}: {} hold messages (other services' pending retries, whose \
             originals are already acknowledged, or parked messages); {done}. Wait until they \
             are empty (`redeliver topology show` counts them; `redeliver unroutable replay` \
             moves parked ones), or add --force to delete them with their messages",
            describe_delay(a),
            QueueCount::list(&self.non_empty)
        )
    }
}

pub(crate) async fn declare(conn: &Connection, a: &TopologyArgs, json: bool) -> anyhow::Result<()> {
    let t = topology(a);
    t.declare(conn)
        .await
        .with_context(|| format!("cannot declare the topology of '{}'", t.queue_name()))?;
    if json {
        let names = Names {
            declared: Some(true),
            ..Names::new(a, &t)
        };
        return output::print_json(&names, "the result");
    }
    println!(
        "declared queue '{}' ({}), exchange '{}', queue '{}' ({}) and {}",
        t.queue_name(),
        if a.classic { "classic" } else { "quorum" },
        t.dlx_name(),
        t.dlq_name(),
        t.configured_dlq_queue_type().as_str(),
        describe_delay(a)
    );
    Ok(())
}

pub(crate) async fn verify(conn: &Connection, a: &TopologyArgs, json: bool) -> anyhow::Result<()> {
    let t = topology(a);
    t.verify(conn)
        .await
        .with_context(|| format!("the topology of '{}' is not in place", t.queue_name()))?;
    if json {
        let names = Names {
            ok: Some(true),
            ..Names::new(a, &t)
        };
        return output::print_json(&names, "the result");
    }
    println!(
        "ok: queue '{}', exchange '{}', queue '{}' and {} exist",
        t.queue_name(),
        t.dlx_name(),
        t.dlq_name(),
        describe_delay(a)
    );
    Ok(())
}

pub(crate) async fn delete(
    conn: &Connection,
    a: &TopologyArgs,
    include_delay: bool,
    force: bool,
    json: bool,
) -> anyhow::Result<()> {
    let t = topology(a);
    let mut discarded = Vec::new();
    // The delay infrastructure goes first: when it is refused, Q's own objects stay too.
    if include_delay {
        let outcome = delete_delay(conn, t.delay_config(), force)
            .await
            .context("cannot delete the delay infrastructure")?;
        match outcome {
            Ok(gone) => discarded = gone,
            Err(refusal) => return refuse(a, &t, &refusal, json),
        }
    }
    t.delete(conn)
        .await
        .with_context(|| format!("cannot delete the topology of '{}'", t.queue_name()))?;
    if json {
        let v = Deleted {
            deleted: true,
            queue: t.queue_name(),
            dlx: t.dlx_name(),
            dlq: t.dlq_name(),
            delay_deleted: include_delay,
            delay: include_delay.then(|| DelayJson::new(a)),
            discarded,
        };
        return output::print_json(&v, "the result");
    }
    println!(
        "deleted queue '{}', exchange '{}' and queue '{}'",
        t.queue_name(),
        t.dlx_name(),
        t.dlq_name()
    );
    if include_delay {
        println!("deleted {}", describe_delay(a));
    }
    if !discarded.is_empty() {
        println!(
            "--force: deleted with their messages: {}",
            QueueCount::list(&discarded)
        );
    }
    Ok(())
}

/// Reports a refusal (as JSON on stdout with --json) and fails with exit code 2, as the other
/// "confirm with a flag" refusals do: nothing is wrong with the broker, the command needs
/// --force.
fn refuse(a: &TopologyArgs, t: &Topology, r: &Refusal, json: bool) -> anyhow::Result<()> {
    let message = r.message(a);
    if json {
        let v = Refused {
            deleted: false,
            refused: true,
            queue: t.queue_name(),
            dlx: t.dlx_name(),
            dlq: t.dlq_name(),
            non_empty: r.non_empty.clone(),
            already_deleted: r.already_deleted.clone(),
            error: message.clone(),
        };
        output::print_json(&v, "the result")?;
    }
    Err(anyhow::Error::new(UsageError(message)))
}

/// The delay queues that may hold messages: the levels, top down, then the parking queue.
fn delay_queues(cfg: &DelayConfig) -> Vec<String> {
    let mut v: Vec<String> = (0..cfg.configured_levels())
        .rev()
        .map(|k| cfg.level_name(k))
        .collect();
    v.push(cfg.unroutable_name());
    v
}

/// How long a publish the broker routed before a binding or an exchange went away may still be
/// on its way to the queue (measured in milliseconds; a loaded node is slower).
const IN_FLIGHT: std::time::Duration = std::time::Duration::from_secs(1);

/// Deletes the delay infrastructure. With `force`, everything goes and the queues that held
/// messages are returned. Without it, nothing goes if any delay queue holds messages, and a
/// queue is only deleted once nothing can reach it any more and it was found empty then.
///
/// The broker cannot do that check for us: `queue.delete` with `if-empty` is refused on
/// quorum queues (the default level type and always the parking queue's) by 3.10.8, 4.0.5 and
/// 4.3.6 alike ("not supported by quorum queues", NOT_IMPLEMENTED, which closes the whole
/// connection over AMQP), and the CLI cannot tell a level queue's type. So the way in is closed
/// first: a level queue receives only through its exchange's binding, which is removed before
/// the queue is counted again; a retry routed there meanwhile goes to the alternate exchange,
/// the parking queue. The parking queue is counted again after every exchange that could route
/// to it is gone.
async fn delete_delay(
    conn: &Connection,
    cfg: &DelayConfig,
    force: bool,
) -> anyhow::Result<Result<Vec<QueueCount>, Refusal>> {
    let mut ops = Ops::new(conn);
    // Count everything first, so a refusal changes nothing.
    let mut held = Vec::new();
    for q in delay_queues(cfg) {
        if let Some(n) = ops.count(&q).await? {
            if n > 0 {
                held.push(QueueCount {
                    queue: q,
                    messages: n,
                });
            }
        }
    }
    if !held.is_empty() && !force {
        ops.close().await;
        return Ok(Err(Refusal {
            non_empty: held,
            already_deleted: Vec::new(),
        }));
    }
    if force {
        let mut discarded = Vec::new();
        for k in (0..cfg.configured_levels()).rev() {
            let name = cfg.level_name(k);
            if let Some(n) = ops.delete_queue(&name).await? {
                if n > 0 {
                    discarded.push(QueueCount {
                        queue: name.clone(),
                        messages: n,
                    });
                }
            }
            ops.delete_exchange(&name).await?;
        }
        ops.delete_exchange(&cfg.deliver_exchange()).await?;
        let parking = cfg.unroutable_name();
        if let Some(n) = ops.delete_queue(&parking).await? {
            if n > 0 {
                discarded.push(QueueCount {
                    queue: parking.clone(),
                    messages: n,
                });
            }
        }
        ops.delete_exchange(&parking).await?;
        ops.delete_exchange(&cfg.settings_name()).await?;
        ops.close().await;
        return Ok(Ok(discarded));
    }
    // Every way in closed first, then one pause for what was routed before: a publish the
    // exchange routed just before the unbind still travels to the queue (to a quorum queue's
    // leader through the publisher's channel), and counted too early it would be deleted with
    // the queue. RabbitMQ then even confirms it (its queue is gone), so the publisher believes
    // the retry is stored.
    let levels: Vec<(String, String)> = (0..cfg.configured_levels())
        .rev()
        .map(|k| (cfg.level_name(k), cfg.level_binding_key(k, true)))
        .collect();
    for (name, key) in &levels {
        ops.unbind(name, name, key).await?;
    }
    tokio::time::sleep(IN_FLIGHT).await;
    // The level queues that exist, with what they hold now.
    let mut counted = Vec::new();
    for (name, key) in &levels {
        if let Some(n) = ops.count(name).await? {
            counted.push((name, key, n));
        }
    }
    let arrived: Vec<QueueCount> = counted
        .iter()
        .filter(|(_, _, n)| *n > 0)
        .map(|(name, _, n)| QueueCount {
            queue: (*name).clone(),
            messages: *n,
        })
        .collect();
    if !arrived.is_empty() {
        // Put the ways in back: every queue stays as it was.
        for (name, key, _) in &counted {
            ops.bind(name, name, key).await.with_context(|| {
                format!(
                    "messages arrived in the delay queues while deleting, so nothing was \
                     deleted, but binding '{name}' to its exchange again failed: declare the \
                     delay infrastructure again (`redeliver topology declare`)"
                )
            })?;
        }
        ops.close().await;
        return Ok(Err(Refusal {
            non_empty: arrived,
            already_deleted: Vec::new(),
        }));
    }
    let mut deleted = Vec::new();
    for (name, _, _) in counted {
        ops.delete_queue(name).await?;
        deleted.push(name.clone());
    }
    // No level queue is left, so nothing is waiting to expire into these exchanges; a retry
    // published from now on fails at its publisher (404) instead of vanishing.
    for k in (0..cfg.configured_levels()).rev() {
        ops.delete_exchange(&cfg.level_name(k)).await?;
    }
    ops.delete_exchange(&cfg.deliver_exchange()).await?;
    let parking = cfg.unroutable_name();
    // Last, the exchange that leads to the parking queue: every exchange naming it as its
    // alternate is gone, so nothing can reach the queue when it is counted again.
    ops.delete_exchange(&parking).await?;
    ops.delete_exchange(&cfg.settings_name()).await?;
    tokio::time::sleep(IN_FLIGHT).await;
    let result = match ops.count(&parking).await? {
        Some(n) if n > 0 => Err(Refusal {
            non_empty: vec![QueueCount {
                queue: parking,
                messages: n,
            }],
            already_deleted: deleted,
        }),
        Some(_) => {
            ops.delete_queue(&parking).await?;
            Ok(Vec::new())
        }
        None => Ok(Vec::new()),
    };
    ops.close().await;
    Ok(result)
}

/// One channel for a series of operations, opened again after an error closed it (a 404 closes
/// the channel it happened on).
struct Ops<'a> {
    conn: &'a Connection,
    channel: Option<Channel>,
}

impl<'a> Ops<'a> {
    fn new(conn: &'a Connection) -> Self {
        Self {
            conn,
            channel: None,
        }
    }

    async fn channel(&mut self) -> anyhow::Result<Channel> {
        match &self.channel {
            Some(ch) if ch.status().connected() => Ok(ch.clone()),
            _ => {
                let ch = self
                    .conn
                    .create_channel()
                    .await
                    .context("cannot open a channel")?;
                self.channel = Some(ch.clone());
                Ok(ch)
            }
        }
    }

    /// `Ok(None)` for a 404 (the channel is then reopened by the next operation).
    fn missing_ok<T>(&mut self, r: lapin::Result<T>) -> lapin::Result<Option<T>> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e) => {
                self.channel = None;
                if redeliver_amqp::is_not_found(&e) {
                    Ok(None)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Ready messages of `queue` (a passive declare), `None` when it does not exist.
    async fn count(&mut self, queue: &str) -> anyhow::Result<Option<u32>> {
        let ch = self.channel().await?;
        let r = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        Ok(self
            .missing_ok(r)
            .with_context(|| format!("cannot inspect queue '{queue}'"))?
            .map(|q| q.message_count()))
    }

    /// Deletes `queue` with its messages; how many it held, `None` when it did not exist.
    async fn delete_queue(&mut self, queue: &str) -> anyhow::Result<Option<u32>> {
        let ch = self.channel().await?;
        let r = ch
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await;
        self.missing_ok(r)
            .with_context(|| format!("cannot delete queue '{queue}'"))
    }

    async fn delete_exchange(&mut self, exchange: &str) -> anyhow::Result<()> {
        let ch = self.channel().await?;
        let r = ch
            .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
            .await;
        self.missing_ok(r)
            .with_context(|| format!("cannot delete exchange '{exchange}'"))?;
        Ok(())
    }

    /// Removes a binding; a missing queue or exchange means there is none to remove.
    async fn unbind(&mut self, queue: &str, exchange: &str, key: &str) -> anyhow::Result<()> {
        let ch = self.channel().await?;
        let r = ch
            .queue_unbind(
                queue.into(),
                exchange.into(),
                key.into(),
                FieldTable::default(),
            )
            .await;
        self.missing_ok(r)
            .with_context(|| format!("cannot unbind queue '{queue}' from exchange '{exchange}'"))?;
        Ok(())
    }

    async fn bind(&mut self, queue: &str, exchange: &str, key: &str) -> anyhow::Result<()> {
        let ch = self.channel().await?;
        let r = ch
            .queue_bind(
                queue.into(),
                exchange.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await;
        if let Err(e) = r {
            self.channel = None;
            return Err(anyhow::Error::new(e));
        }
        Ok(())
    }

    async fn close(mut self) {
        if let Some(ch) = self.channel.take() {
            if ch.status().connected() {
                // Best effort: the work is done either way and the connection closes soon.
                let _ = ch.close(200, "ok".into()).await;
            }
        }
    }
}

/// One row of `topology show`.
#[derive(Debug, Serialize)]
pub(crate) struct ObjectRow {
    pub kind: &'static str,
    pub name: String,
    pub exists: bool,
    /// Ready messages (queues that exist).
    pub messages: Option<u32>,
    pub consumers: Option<u32>,
    /// The arguments redeliver declares the object with.
    pub arguments: Value,
}

/// Exchange type plus arguments, shown together in the ARGUMENTS column.
fn exchange_args(kind: &str, args: &FieldTable) -> Value {
    let mut v = serde_json::json!({ "type": kind });
    if let (Value::Object(m), Value::Object(extra)) = (&mut v, table_json(args)) {
        m.extend(extra);
    }
    v
}

async fn exchange_exists(conn: &Connection, name: &str) -> anyhow::Result<bool> {
    // A passive declare that fails with 404 closes its channel: one channel per check.
    let ch = conn
        .create_channel()
        .await
        .context("cannot open a channel")?;
    let res = ch
        .exchange_declare(
            name.into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match res {
        Ok(()) => {
            let _ = ch.close(200, "ok".into()).await;
            Ok(true)
        }
        Err(e) if redeliver_amqp::is_not_found(&e) => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot inspect exchange '{name}'")),
    }
}

async fn queue_row(
    conn: &Connection,
    kind: &'static str,
    name: String,
    arguments: Value,
) -> anyhow::Result<ObjectRow> {
    let counts = browse::probe_queue(conn, &name).await?;
    Ok(ObjectRow {
        kind,
        exists: counts.is_some(),
        messages: counts.map(|c| c.messages),
        consumers: counts.map(|c| c.consumers),
        name,
        arguments,
    })
}

async fn exchange_row(
    conn: &Connection,
    kind: &'static str,
    name: String,
    arguments: Value,
) -> anyhow::Result<ObjectRow> {
    let exists = exchange_exists(conn, &name).await?;
    Ok(ObjectRow {
        kind,
        exists,
        messages: None,
        consumers: None,
        name,
        arguments,
    })
}

/// Every object, in the order a message meets them.
pub(crate) async fn rows(conn: &Connection, a: &TopologyArgs) -> anyhow::Result<Vec<ObjectRow>> {
    let t = topology(a);
    let cfg = t.delay_config().clone();
    let mut rows = vec![
        queue_row(
            conn,
            "queue",
            t.queue_name(),
            table_json(&t.queue_arguments()),
        )
        .await?,
        exchange_row(
            conn,
            "exchange",
            t.dlx_name(),
            exchange_args("direct", &t.dlx_arguments()),
        )
        .await?,
        queue_row(conn, "queue", t.dlq_name(), table_json(&t.dlq_arguments())).await?,
    ];
    for k in (0..a.delay.levels).rev() {
        rows.push(
            exchange_row(
                conn,
                "exchange",
                cfg.level_name(k),
                exchange_args("topic", &cfg.exchange_arguments()),
            )
            .await?,
        );
        rows.push(
            queue_row(
                conn,
                "queue",
                cfg.level_name(k),
                table_json(&cfg.level_queue_arguments(k)),
            )
            .await?,
        );
    }
    rows.push(
        exchange_row(
            conn,
            "exchange",
            cfg.deliver_exchange(),
            exchange_args("topic", &cfg.exchange_arguments()),
        )
        .await?,
    );
    rows.push(
        exchange_row(
            conn,
            "exchange",
            cfg.unroutable_name(),
            exchange_args("fanout", &FieldTable::default()),
        )
        .await?,
    );
    rows.push(
        queue_row(
            conn,
            "queue",
            cfg.unroutable_name(),
            table_json(&cfg.unroutable_queue_arguments()),
        )
        .await?,
    );
    Ok(rows)
}

fn args_text(v: &Value) -> String {
    match v {
        Value::Object(m) if m.is_empty() => "-".to_owned(),
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => format!("{k}={s}"),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(" "),
        other => other.to_string(),
    }
}

pub(crate) async fn show(conn: &Connection, a: &TopologyArgs, json: bool) -> anyhow::Result<()> {
    let rows = rows(conn, a).await?;
    let t = topology(a);
    let cfg = t.delay_config();
    let bindings: Vec<(String, String, String)> = {
        let mut b = vec![
            (t.dlx_name(), t.dlq_name(), t.queue_name()),
            (
                cfg.deliver_exchange(),
                t.queue_name(),
                cfg.deliver_binding_key(&t.queue_name()),
            ),
            (cfg.unroutable_name(), cfg.unroutable_name(), String::new()),
        ];
        for (ex, key) in &a.bindings {
            b.push((ex.clone(), t.queue_name(), key.clone()));
        }
        b
    };
    if json {
        let v = serde_json::json!({
            "objects": rows,
            "bindings": bindings.iter().map(|(s, d, k)| serde_json::json!({
                "source": s, "destination": d, "routing_key": k
            })).collect::<Vec<_>>(),
        });
        return output::print_json(&v, "the topology");
    }
    let mut table = Table::new(&[
        ("KIND", 8),
        ("NAME", 80),
        ("STATUS", 7),
        ("MESSAGES", 10),
        ("CONSUMERS", 9),
        ("ARGUMENTS (as redeliver declares them)", 200),
    ]);
    for r in &rows {
        table.row(vec![
            r.kind.to_owned(),
            r.name.clone(),
            if r.exists { "ok" } else { "MISSING" }.to_owned(),
            r.messages.map_or_else(|| "-".to_owned(), |n| n.to_string()),
            r.consumers
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            args_text(&r.arguments),
        ]);
    }
    print!("{}", table.render());
    println!(
        "bindings (declared by `topology declare`; AMQP cannot list them, see the management UI):"
    );
    for (s, d, k) in &bindings {
        if k.is_empty() {
            println!("  {s} -> {d}");
        } else {
            println!("  {s} -> {d}  key {k}");
        }
    }
    println!(
        "delay levels 0..{} between exchanges: a 1 bit at a level's word goes to its queue, a 0 \
         bit to the next lower exchange",
        a.delay.levels.saturating_sub(1)
    );
    let missing = rows.iter().filter(|r| !r.exists).count();
    if missing > 0 {
        println!(
            "{missing} object(s) missing: declare them with `redeliver topology declare {}{}`",
            a.queue,
            if a.prefix.is_empty() {
                String::new()
            } else {
                format!(" --prefix {}", a.prefix)
            }
        );
    }
    Ok(())
}
