//! Command-line arguments (clap derive). Nothing here talks to the broker.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// RabbitMQ's out-of-the-box account on the local machine. This is a public, documented default,
/// not a secret; any password given with `--url`/`AMQP_URL` is never printed.
pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// How listing works, shared by the long help of every command that reads a queue without
/// consuming it. Kept in one place so `--help` and the docs cannot drift apart.
pub const LISTING_METHOD: &str = "\
How messages are read without removing them: the command first asks the broker how many \
messages are ready (passive queue.declare), opens a consumer with manual acknowledgements and \
a prefetch of exactly that many (at most --limit), takes the deliveries, and then closes its \
channel WITHOUT acknowledging anything. The broker puts every unacknowledged message back in its \
original position, in the original order, for classic and quorum queues alike. basic.get with \
a requeue after each message is not used: every requeue puts that message back at the head one \
by one, which reorders the queue for the next reader. Side effects of reading: the messages are \
marked redelivered, and a quorum queue counts the return as a delivery attempt \
(x-delivery-count). From RabbitMQ 4.0 every quorum queue has a delivery limit (20 unless \
declared otherwise) and drops a message that reaches it when it has no dead-letter exchange: \
the parking queue and a quorum Q.dlq are therefore declared with x-delivery-limit 2147483647, \
which no listing can reach (a classic Q.dlq has no limit at all). Messages published while the \
listing runs are not shown.";

/// Help heading of the TLS options.
const TLS_HEADING: &str =
    "TLS (amqps://; the broker's certificate and host name are always verified)";

/// Operator tool for redeliver: topology, dead-letter queues and the delay infrastructure.
#[derive(Parser, Debug)]
#[command(
    name = "redeliver",
    version,
    about = "Operator tool for redeliver: topology, dead-letter queues and the delay infrastructure",
    long_about = "Operator tool for redeliver: inspect and repair a RabbitMQ consumer's topology, \
its dead-letter queue (Q.dlq), the shared delay levels and their parking queue for unroutable \
messages.\n\nExit codes: 0 success, 1 error (broker, queue, message), 2 usage (bad arguments, a \
destructive command without --yes).",
    after_help = "The password in --url / AMQP_URL is never printed; messages show it as ***. amqps:// \
URLs connect with TLS and verify the broker's certificate and host name."
)]
pub struct Cli {
    /// Broker URL: amqp://USER:PASSWORD@HOST:PORT/VHOST (the vhost '/' is written %2f).
    /// Defaults to the local broker, 127.0.0.1:5672, with the guest account
    #[arg(
        long,
        env = "AMQP_URL",
        global = true,
        hide_env_values = true,
        value_name = "URL",
        help_heading = "Connection"
    )]
    pub url: Option<String>,

    /// Read the broker URL from this file instead (a mounted Kubernetes secret)
    #[arg(
        long,
        env = "AMQP_URL_FILE",
        global = true,
        hide_env_values = true,
        value_name = "PATH",
        conflicts_with = "url",
        help_heading = "Connection"
    )]
    pub url_file: Option<PathBuf>,

    /// Read the broker password from this file; it replaces the URL's
    #[arg(
        long,
        env = "AMQP_PASSWORD_FILE",
        global = true,
        hide_env_values = true,
        value_name = "PATH",
        help_heading = "Connection"
    )]
    pub password_file: Option<PathBuf>,

    /// amqps://: also trust the CA certificates of this PEM file (the system's are trusted too)
    #[arg(
        long,
        env = "REDELIVER_TLS_CA_FILE",
        global = true,
        hide_env_values = true,
        value_name = "PATH",
        help_heading = TLS_HEADING
    )]
    pub tls_ca_file: Option<PathBuf>,

    /// amqps://: client certificate (PEM) for mutual TLS; needs --tls-key-file
    #[arg(
        long,
        env = "REDELIVER_TLS_CERT_FILE",
        global = true,
        hide_env_values = true,
        value_name = "PATH",
        requires = "tls_key_file",
        help_heading = TLS_HEADING
    )]
    pub tls_cert_file: Option<PathBuf>,

    /// amqps://: the client certificate's private key (PEM)
    #[arg(
        long,
        env = "REDELIVER_TLS_KEY_FILE",
        global = true,
        hide_env_values = true,
        value_name = "PATH",
        requires = "tls_cert_file",
        help_heading = TLS_HEADING
    )]
    pub tls_key_file: Option<PathBuf>,

    /// amqps://: log in with the client certificate (SASL EXTERNAL) instead of a password
    #[arg(
        long,
        env = "REDELIVER_TLS_SASL_EXTERNAL",
        global = true,
        requires = "tls_cert_file",
        help_heading = TLS_HEADING
    )]
    pub sasl_external: bool,

    /// Give up connecting to the broker after this long
    #[arg(
        long,
        global = true,
        default_value = "10s",
        value_parser = parse_duration,
        value_name = "DURATION",
        help_heading = "Connection"
    )]
    pub connect_timeout: Duration,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Declare, verify or show the objects of one consumer queue (Q, Q.dlx, Q.dlq, delay levels)
    #[command(subcommand)]
    Topology(TopologyCmd),
    /// Inspect and repair a dead-letter queue (Q.dlq): list, peek, replay, purge
    #[command(subcommand)]
    Dlq(DlqCmd),
    /// Inspect and replay the delay infrastructure's parking queue ({prefix}redeliver.delay.unroutable)
    #[command(subcommand)]
    Unroutable(UnroutableCmd),
    /// Self-tests of the delay infrastructure
    #[command(subcommand)]
    Delay(DelayCmd),
}

#[derive(Subcommand, Debug)]
pub enum TopologyCmd {
    /// Declare Q, Q.dlx, Q.dlq and the delay infrastructure (idempotent)
    #[command(
        long_about = "Declare everything one consumer needs: the queue Q (quorum unless \
--classic) with its dead-letter exchange Q.dlx and dead-letter queue Q.dlq, the binding of Q on \
the delay deliver exchange, and the shared delay infrastructure (levels, deliver exchange, \
unroutable parking queue). Declaring is idempotent; an existing object with different \
arguments is reported with the object and argument named, and nothing is changed."
    )]
    Declare(TopologyArgs),
    /// Check that every object exists (passive declares only; creates nothing)
    Verify(TopologyArgs),
    /// Print every object with its arguments and live message counts; missing ones are marked
    #[command(
        long_about = "Print every object of the topology: Q, Q.dlx, Q.dlq, each delay \
level (exchange and queue), the deliver exchange and the unroutable parking exchange and queue. \
Each row shows whether the object exists, the live message and consumer counts of queues \
(from a passive declare, which creates nothing) and the arguments redeliver declares it with. \
AMQP cannot read back an existing object's arguments; `topology verify` and `topology declare` \
report a mismatch."
    )]
    Show(ShowArgs),
    /// Delete Q, Q.dlx and Q.dlq (and, with --include-delay, the shared delay infrastructure)
    Delete(DeleteArgs),
}

/// Options describing one consumer's topology. They must match what the service declares, or
/// `verify`/`declare` report a mismatch.
#[derive(Args, Debug, Clone)]
pub struct TopologyArgs {
    /// Queue name, without the prefix
    #[arg(value_name = "QUEUE")]
    pub queue: String,
    /// Prefix put in front of every object name, including the delay levels
    #[arg(long, default_value = "", value_name = "P")]
    pub prefix: String,
    /// Q is a classic queue instead of a quorum queue
    #[arg(long)]
    pub classic: bool,
    /// x-delivery-limit of a quorum Q (poison-message guard)
    #[arg(
        long,
        default_value_t = 20,
        value_name = "N",
        conflicts_with = "no_delivery_limit"
    )]
    pub delivery_limit: u32,
    /// Declare a quorum Q without x-delivery-limit
    #[arg(long)]
    pub no_delivery_limit: bool,
    /// Q.dlq is a quorum queue (survives the loss of a cluster node) instead of a classic one
    #[arg(long)]
    pub quorum_dlq: bool,
    /// Retention of Q.dlq (x-message-ttl), e.g. 14d; none by default
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub dlq_message_ttl: Option<Duration>,
    /// x-max-length of Q.dlq; none by default
    #[arg(long, value_name = "N")]
    pub dlq_max_length: Option<u64>,
    /// Also bind Q to EXCHANGE with ROUTING_KEY (repeatable)
    #[arg(long = "bind", value_name = "EXCHANGE:ROUTING_KEY", value_parser = parse_binding)]
    pub bindings: Vec<(String, String)>,
    #[command(flatten)]
    pub delay: DelayArgs,
}

/// `topology show` takes the topology options plus an output format.
#[derive(Args, Debug, Clone)]
pub struct ShowArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct DeleteArgs {
    /// Queue name, without the prefix
    #[arg(value_name = "QUEUE")]
    pub queue: String,
    /// Prefix put in front of every object name, including the delay levels
    #[arg(long, default_value = "", value_name = "P")]
    pub prefix: String,
    /// Also delete the delay levels, deliver and unroutable objects of this prefix (shared by
    /// every consumer using the prefix)
    #[arg(long)]
    pub include_delay: bool,
    #[command(flatten)]
    pub delay: DelayArgs,
    /// Confirm: deleting queues destroys their messages
    #[arg(long)]
    pub yes: bool,
}

/// Shape of the shared delay infrastructure. Only needed when it differs from the defaults.
#[derive(Args, Debug, Clone)]
pub struct DelayArgs {
    /// Number of binary delay levels (max delay = (2^levels - 1) * granularity)
    #[arg(long, default_value_t = 24, value_name = "L", value_parser = clap::value_parser!(u8).range(1..=32))]
    pub levels: u8,
    /// Delay granularity (TTL of level 0)
    #[arg(long, default_value = "10ms", value_parser = parse_duration, value_name = "DURATION")]
    pub granularity: Duration,
    /// The delay level queues are classic instead of quorum
    #[arg(long)]
    pub delay_classic: bool,
}

/// Which queue and prefix a DLQ command works on.
#[derive(Args, Debug, Clone)]
pub struct QueueArgs {
    /// Queue name, without the prefix (the DLQ is QUEUE.dlq)
    #[arg(value_name = "QUEUE")]
    pub queue: String,
    /// Prefix put in front of every object name
    #[arg(long, default_value = "", value_name = "P")]
    pub prefix: String,
}

#[derive(Subcommand, Debug)]
pub enum DlqCmd {
    /// Table of dead-lettered messages, without removing them
    #[command(long_about = format!("List dead-lettered messages of QUEUE.dlq, oldest first, \
without removing them: position, message_id, first failure time, attempts, x-death reason and \
count, last error and a body preview. --json prints the same as a JSON array for scripts.\n\n{LISTING_METHOD}"))]
    List(ListArgs),
    /// Print one dead-lettered message in full (properties, headers, body)
    #[command(long_about = format!("Print one message of QUEUE.dlq in full: delivery info, every \
property, every header (x-death included) and the body, pretty-printed when it is JSON, as text \
when it is UTF-8, as a hex dump otherwise. The queue is read without removing anything.\n\n{LISTING_METHOD}"))]
    Peek(PeekArgs),
    /// Move messages back to QUEUE with their attempt count reset
    #[command(
        long_about = "Move messages from QUEUE.dlq back to QUEUE, oldest first. Each copy \
keeps the body, message_id, content_type, correlation_id, the other properties and the user \
headers; the x-redeliver-* headers (attempt count, first failure, last error) and the broker's \
x-death / x-first-death-* / x-last-death-* / x-delivery-count headers are removed, so the \
handler sees a fresh message. user_id is dropped (the broker refuses one that is not the \
connection's user). Each copy is published to QUEUE through the default exchange with a \
publisher confirm, and only after the broker confirmed it is the DLQ copy acknowledged: an \
interruption never loses a message; at worst one message is in both queues (a duplicate, which \
the message_id lets a handler detect). Messages that are not selected (--message-id, --limit) \
stay in the DLQ in their order. Messages dead-lettered again while the replay runs are not \
replayed a second time. Ctrl-C stops after the message in progress."
    )]
    Replay(ReplayArgs),
    /// Delete every message of QUEUE.dlq (requires --yes)
    Purge(PurgeArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ListArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// Show at most N messages from the head of the queue
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65535))]
    pub limit: u32,
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct PeekArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// message_id of the message to print (the first match from the head)
    #[arg(value_name = "MESSAGE_ID")]
    pub message_id: String,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// Move at most N messages
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: Option<u64>,
    /// Move only the messages with this message_id (repeatable)
    #[arg(long = "message-id", value_name = "ID")]
    pub message_ids: Vec<String>,
    /// Print what would move and change nothing
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Args, Debug, Clone)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// Confirm: the messages are deleted for good
    #[arg(long)]
    pub yes: bool,
}

/// The parking queue is shared by every consumer of a prefix, so these commands take no QUEUE;
/// `--queue` filters by destination instead.
#[derive(Args, Debug, Clone)]
pub struct UnroutableArgs {
    /// Prefix of the delay infrastructure
    #[arg(long, default_value = "", value_name = "P")]
    pub prefix: String,
    /// Number of delay levels (needed to read the destination from a routing key)
    #[arg(long, default_value_t = 24, value_name = "L", value_parser = clap::value_parser!(u8).range(1..=32))]
    pub levels: u8,
    /// Only messages whose destination is this queue (full name, prefix included)
    #[arg(long = "queue", value_name = "QUEUE")]
    pub destination: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum UnroutableCmd {
    /// Table of parked messages, without removing them
    #[command(long_about = format!("List the messages parked in {{prefix}}redeliver.delay.unroutable: \
delayed copies that no queue could take (their destination queue was deleted or unbound from the \
deliver exchange, or the routing key is malformed). The DESTINATION column is read from the \
routing key: its first L words are the delay bits, the rest is the destination queue.\n\n{LISTING_METHOD}"))]
    List(UnroutableListArgs),
    /// Print one parked message in full
    Peek(UnroutablePeekArgs),
    /// Publish parked messages straight to their destination queue (or --to)
    #[command(
        long_about = "Publish parked messages straight to their destination queue through \
the default exchange (the delay they were waiting for is not applied again: it has long elapsed \
while they were parked). Unlike `dlq replay`, the x-redeliver-* headers are KEPT: these messages \
were in the middle of a retry, and their attempt count still counts toward max_retries. The \
broker's x-death headers from the delay hops are removed. The destination is the routing key \
minus its first L (delay bit) words, or --to. A message whose destination does not exist (the \
broker returns it) or cannot be read stays parked and is reported; the exit code is then 1. \
Each copy is confirmed by the broker before the parked copy is acknowledged."
    )]
    Replay(UnroutableReplayArgs),
    /// Delete every parked message (requires --yes)
    Purge(UnroutablePurgeArgs),
}

#[derive(Args, Debug, Clone)]
pub struct UnroutableListArgs {
    #[command(flatten)]
    pub common: UnroutableArgs,
    /// Show at most N messages from the head of the queue
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65535))]
    pub limit: u32,
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct UnroutablePeekArgs {
    #[command(flatten)]
    pub common: UnroutableArgs,
    /// message_id of the message to print
    #[arg(value_name = "MESSAGE_ID")]
    pub message_id: String,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct UnroutableReplayArgs {
    #[command(flatten)]
    pub common: UnroutableArgs,
    /// Move at most N messages
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: Option<u64>,
    /// Move only the messages with this message_id (repeatable)
    #[arg(long = "message-id", value_name = "ID")]
    pub message_ids: Vec<String>,
    /// Publish to this queue (full name) instead of the one in the routing key
    #[arg(long, value_name = "QUEUE")]
    pub to: Option<String>,
    /// Print what would move and change nothing
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Args, Debug, Clone)]
pub struct UnroutablePurgeArgs {
    #[command(flatten)]
    pub common: UnroutableArgs,
    /// Confirm: the messages are deleted for good
    #[arg(long)]
    pub yes: bool,
}

#[derive(Subcommand, Debug)]
pub enum DelayCmd {
    /// Send probes through the delay levels and print observed vs intended delay
    #[command(
        long_about = "Operator self-test of the delay infrastructure: declares a temporary \
exclusive probe queue bound to {prefix}redeliver.delay.deliver, publishes one probe per delay \
through the levels (with publisher confirms), and prints for each the intended delay, the delay \
the levels can represent (rounded up to the granularity), the observed delay and the error. The \
probe queue is deleted at the end. The delay infrastructure must exist (`redeliver topology \
declare`). Exit code 1 if a probe does not arrive within the longest delay plus --grace."
    )]
    Probe(ProbeArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ProbeArgs {
    /// Comma-separated delays to probe
    #[arg(long, value_delimiter = ',', default_value = "100ms,1s,5s", value_parser = parse_duration, value_name = "LIST")]
    pub delays: Vec<Duration>,
    /// Prefix of the delay infrastructure
    #[arg(long, default_value = "", value_name = "P")]
    pub prefix: String,
    /// How long to wait past the longest delay before a probe counts as lost
    #[arg(long, default_value = "5s", value_parser = parse_duration, value_name = "DURATION")]
    pub grace: Duration,
    #[command(flatten)]
    pub delay: DelayArgs,
}

/// Accepts humantime durations ("250ms", "1m 30s", "14d").
fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("'{s}' is not a duration like 100ms, 5s or 2m: {e}"))
}

/// `EXCHANGE:ROUTING_KEY`; the routing key may contain ':' (only the first one splits).
fn parse_binding(s: &str) -> Result<(String, String), String> {
    match s.split_once(':') {
        Some((exchange, key)) if !exchange.is_empty() => Ok((exchange.to_owned(), key.to_owned())),
        _ => Err(format!("'{s}' is not EXCHANGE:ROUTING_KEY")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn bindings_split_on_first_colon() {
        assert_eq!(
            parse_binding("ex:a:b"),
            Ok(("ex".to_owned(), "a:b".to_owned()))
        );
        assert!(parse_binding(":k").is_err());
        assert!(parse_binding("nokey").is_err());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert!(parse_duration("soon").is_err());
    }
}
