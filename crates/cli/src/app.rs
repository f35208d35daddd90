//! Dispatch: turns parsed arguments into one command run against one connection.

use redeliver_amqp::DelayConfig;
use redeliver_amqp::Topology;

use crate::cli::{
    Cli, Command, DelayCmd, DlqCmd, FilterArgs, ListArgs, PeekArgs, PurgeArgs, ReplayArgs,
    StatsArgs, TopologyArgs, TopologyCmd, UnroutableArgs, UnroutableCmd,
};
use crate::conn::{self, BrokerUrl};
use crate::dlq::{self, Selection, Source};
use crate::errors::{HintContext, UsageError};
use crate::select::Filter;
use crate::{probe, topology, triage};

/// Everything main needs to print an error well: the URLs (to scrub their passwords; empty
/// when they did not parse) and hints.
pub(crate) struct Invocation {
    pub urls: Vec<BrokerUrl>,
    pub hints: HintContext,
}

/// `redeliver topology declare QUEUE [--prefix P]`, to quote in "declare it" hints.
fn declare_line(queue: &str, prefix: &str) -> String {
    if prefix.is_empty() {
        format!("redeliver topology declare {queue}")
    } else {
        format!("redeliver topology declare {queue} --prefix {prefix}")
    }
}

fn hints_for(cmd: &Command) -> HintContext {
    let declare_command = match cmd {
        Command::Topology(
            TopologyCmd::Declare(a) | TopologyCmd::Verify(a) | TopologyCmd::Show(a),
        ) => Some(declare_line(&a.topology.queue, &a.topology.prefix)),
        Command::Topology(TopologyCmd::Delete(d)) => Some(declare_line(&d.queue, &d.prefix)),
        Command::Dlq(
            DlqCmd::List(ListArgs { queue: q, .. })
            | DlqCmd::Stats(StatsArgs { queue: q, .. })
            | DlqCmd::Peek(PeekArgs { queue: q, .. })
            | DlqCmd::Replay(ReplayArgs { queue: q, .. })
            | DlqCmd::Purge(PurgeArgs { queue: q, .. }),
        ) => Some(declare_line(&q.queue, &q.prefix)),
        Command::Unroutable(c) => {
            let p = match c {
                UnroutableCmd::List(a) => &a.common.prefix,
                UnroutableCmd::Peek(a) => &a.common.prefix,
                UnroutableCmd::Replay(a) => &a.common.prefix,
                UnroutableCmd::Purge(a) => &a.common.prefix,
            };
            Some(declare_line("QUEUE", p))
        }
        Command::Delay(DelayCmd::Probe(p)) => Some(declare_line("QUEUE", &p.prefix)),
        Command::Outbox(_) => None,
    };
    HintContext { declare_command }
}

/// Refuses destructive commands without --yes before anything connects (exit code 2).
fn check_confirmations(cmd: &Command) -> Result<(), UsageError> {
    let (yes, what) = match cmd {
        Command::Dlq(DlqCmd::Purge(p)) => {
            let dlq = Topology::new(p.queue.queue.clone())
                .prefix(p.queue.prefix.clone())
                .dlq_name();
            let what = if p.filter.any() {
                format!(
                    "purging deletes the messages of '{dlq}' matching {} for good",
                    filter(&p.filter).describe()
                )
            } else {
                format!("purging deletes every message of '{dlq}' for good")
            };
            (p.yes, what)
        }
        Command::Unroutable(UnroutableCmd::Purge(p)) => (
            p.yes,
            format!(
                "purging deletes every message of '{}' for good",
                unroutable_queue(&p.common)
            ),
        ),
        Command::Topology(TopologyCmd::Delete(d)) => (
            d.yes,
            "deleting the queues destroys their messages".to_owned(),
        ),
        _ => return Ok(()),
    };
    if yes {
        Ok(())
    } else {
        Err(UsageError(format!(
            "{what}; nothing was changed. Add --yes to confirm"
        )))
    }
}

/// The selection criteria of `dlq replay` / `dlq purge`.
fn filter(f: &FilterArgs) -> Filter {
    Filter {
        message_ids: f.message_ids.clone(),
        reason: f.reason.clone(),
        error_contains: f.error_contains.clone(),
        older_than: f.older_than,
    }
}

fn unroutable_queue(a: &UnroutableArgs) -> String {
    DelayConfig::new()
        .prefix(a.prefix.clone())
        .levels(a.levels)
        .unroutable_name()
}

fn unroutable_source(a: &UnroutableArgs) -> Source {
    Source::Unroutable {
        queue: unroutable_queue(a),
        levels: a.levels,
        only: a.destination.clone(),
    }
}

fn dlq_source(queue: &str, prefix: &str) -> Source {
    let t = Topology::new(queue.to_owned()).prefix(prefix.to_owned());
    Source::Dlq {
        dlq: t.dlq_name(),
        home: t.queue_name(),
    }
}

/// Parses the URL and the confirmations, returning what error printing needs even when the
/// command then fails.
pub(crate) fn prepare(cli: &Cli) -> (Invocation, Result<(), anyhow::Error>) {
    let hints = hints_for(&cli.command);
    let urls = match conn::broker_urls(cli) {
        Ok(u) => u,
        Err(e) => {
            let none = Invocation {
                urls: Vec::new(),
                hints,
            };
            return (none, Err(e.into()));
        }
    };
    let checked = check_confirmations(&cli.command).map_err(anyhow::Error::from);
    (Invocation { urls, hints }, checked)
}

/// Runs the command. `urls` come from [`prepare`].
pub(crate) async fn run(cli: Cli, urls: &[BrokerUrl]) -> anyhow::Result<()> {
    let tls = conn::tls_config(&cli);
    let conn = conn::connect_any(urls, &tls, cli.connect_timeout).await?;
    let result = dispatch(cli.command, &conn).await;
    // Closing politely lets the broker requeue at once instead of on socket loss; a failure
    // here changes nothing for the user.
    let _ = conn.close(200, "redeliver-cli done".into()).await;
    result
}

async fn dispatch(cmd: Command, conn: &lapin::Connection) -> anyhow::Result<()> {
    match cmd {
        Command::Topology(t) => topology_cmd(t, conn).await,
        Command::Dlq(d) => dlq_cmd(d, conn).await,
        Command::Unroutable(u) => unroutable_cmd(u, conn).await,
        Command::Delay(DelayCmd::Probe(p)) => {
            let cfg = topology::delay_config(&p.prefix, &p.delay);
            probe::run(conn, &cfg, &p.prefix, &p.delays, p.grace, p.json).await
        }
        // main runs it without a broker (crate::outbox); never reached with a connection.
        Command::Outbox(_) => Err(anyhow::anyhow!(
            "outbox commands talk to PostgreSQL, not to the broker"
        )),
    }
}

async fn topology_cmd(t: TopologyCmd, conn: &lapin::Connection) -> anyhow::Result<()> {
    match t {
        TopologyCmd::Declare(a) => topology::declare(conn, &a.topology, a.json).await,
        TopologyCmd::Verify(a) => topology::verify(conn, &a.topology, a.json).await,
        TopologyCmd::Show(a) => topology::show(conn, &a.topology, a.json).await,
        TopologyCmd::Delete(d) => {
            // Deleting needs only the names, which the queue, prefix and delay shape give.
            let a = TopologyArgs {
                queue: d.queue,
                prefix: d.prefix,
                classic: false,
                delivery_limit: 20,
                no_delivery_limit: false,
                quorum_dlq: false,
                dlq_message_ttl: None,
                dlq_max_length: None,
                bindings: Vec::new(),
                delay: d.delay,
            };
            topology::delete(conn, &a, d.include_delay, d.force, d.json).await
        }
    }
}

async fn dlq_cmd(d: DlqCmd, conn: &lapin::Connection) -> anyhow::Result<()> {
    match d {
        DlqCmd::List(a) => {
            let src = dlq_source(&a.queue.queue, &a.queue.prefix);
            match a.group_by {
                Some(by) => triage::group_by(conn, &src, a.limit, by, a.json).await,
                None => dlq::list(conn, &src, a.limit, a.json).await,
            }
        }
        DlqCmd::Stats(a) => {
            let src = dlq_source(&a.queue.queue, &a.queue.prefix);
            triage::stats(conn, &src, a.limit, a.json).await
        }
        DlqCmd::Peek(a) => {
            let src = dlq_source(&a.queue.queue, &a.queue.prefix);
            dlq::peek(conn, &src, &a.message_id, a.json).await
        }
        DlqCmd::Replay(a) => {
            let sel = Selection {
                limit: a.limit,
                filter: filter(&a.filter),
                dry_run: a.dry_run,
                to: None,
            };
            let src = dlq_source(&a.queue.queue, &a.queue.prefix);
            let delay = DelayConfig::new().prefix(a.queue.prefix.clone());
            dlq::replay(conn, &src, &sel, delay, a.json).await
        }
        // With criteria only the matching messages go, the rest keep their place.
        DlqCmd::Purge(a) if a.filter.any() => {
            let src = dlq_source(&a.queue.queue, &a.queue.prefix);
            dlq::purge_matching(conn, &src, &filter(&a.filter), a.json).await
        }
        DlqCmd::Purge(a) => {
            let dlq = Topology::new(a.queue.queue.clone())
                .prefix(a.queue.prefix.clone())
                .dlq_name();
            dlq::purge(conn, &dlq, a.json).await
        }
    }
}

async fn unroutable_cmd(u: UnroutableCmd, conn: &lapin::Connection) -> anyhow::Result<()> {
    match u {
        UnroutableCmd::List(a) => {
            dlq::list(conn, &unroutable_source(&a.common), a.limit, a.json).await
        }
        UnroutableCmd::Peek(a) => {
            dlq::peek(conn, &unroutable_source(&a.common), &a.message_id, a.json).await
        }
        UnroutableCmd::Replay(a) => {
            let sel = Selection {
                limit: a.limit,
                filter: Filter {
                    message_ids: a.message_ids,
                    ..Filter::default()
                },
                dry_run: a.dry_run,
                to: a.to,
            };
            let cfg = DelayConfig::new()
                .prefix(a.common.prefix.clone())
                .levels(a.common.levels);
            dlq::replay(conn, &unroutable_source(&a.common), &sel, cfg, a.json).await
        }
        // --queue selects: only that destination's messages go, the rest keep their place.
        UnroutableCmd::Purge(a) if a.common.destination.is_some() => {
            let src = unroutable_source(&a.common);
            dlq::purge_matching(conn, &src, &Filter::default(), a.json).await
        }
        UnroutableCmd::Purge(a) => dlq::purge(conn, &unroutable_queue(&a.common), a.json).await,
    }
}
