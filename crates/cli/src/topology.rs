//! `topology declare|verify|show|delete`.

use anyhow::Context as _;
use lapin::types::FieldTable;
use lapin::Connection;
use redeliver_amqp::{
    DelayConfig, HeldMessages, QueueMessages, QueueType, Topology, TopologyError,
};
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
    fn new(q: &QueueMessages) -> Self {
        Self {
            queue: q.queue.clone(),
            messages: q.messages,
        }
    }

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
        let held = if force {
            HeldMessages::Discard
        } else {
            HeldMessages::Refuse
        };
        match t.configured_delay().delete_checked(conn, held).await {
            Ok(gone) => discarded = gone.iter().map(QueueCount::new).collect(),
            Err(TopologyError::DelayNotEmpty {
                non_empty,
                already_deleted,
                ..
            }) => {
                let refusal = Refusal {
                    non_empty: non_empty.iter().map(QueueCount::new).collect(),
                    already_deleted,
                };
                return refuse(a, &t, &refusal, json);
            }
            Err(TopologyError::DelayRestore { queue, source }) => {
                return Err(anyhow::Error::new(*source)
                    .context(format!(
                        "messages arrived in the delay queues while deleting, so nothing was \
                         deleted, but binding '{queue}' to its exchange again failed: declare \
                         the delay infrastructure again (`redeliver topology declare`)"
                    ))
                    .context("cannot delete the delay infrastructure"));
            }
            Err(e) => return Err(e).context("cannot delete the delay infrastructure"),
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
    let exists = redeliver_amqp::passive_exchange(&ch, name)
        .await
        .with_context(|| format!("cannot inspect exchange '{name}'"))?;
    if exists {
        // Best effort: the channel is done either way and the connection closes soon.
        let _ = ch.close(200, "ok".into()).await;
    }
    Ok(exists)
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
    let cfg = t.configured_delay().clone();
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
    let cfg = t.configured_delay();
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
