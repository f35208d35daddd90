//! Command-line arguments (clap derive). Nothing here talks to the broker.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// RabbitMQ's out-of-the-box account on the local machine. This is a public, documented default,
/// not a secret; any password given with `--url`/`AMQP_URL` is never printed.
pub(crate) const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// How listing works, shared by the long help of every command that reads a queue without
/// consuming it. Kept in one place so `--help` and the docs cannot drift apart.
pub(crate) const LISTING_METHOD: &str = "\
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

/// What --json promises, shared by the long help of every command that has it.
pub(crate) const JSON_OUTPUT: &str = "\
With --json, stdout holds exactly one JSON document and nothing else: progress bars, notes and \
errors go to stderr, and a failure still sets the exit code. The keys are a stable interface \
for scripts: keys may be added, existing ones keep their name and meaning. Strings hold the \
exact values; the characters in them a terminal would act on (control characters, bidi \
overrides, zero-width characters) are written as \\u escapes, as they are escaped (\\u{1b}, \
\\r) in text output.";

/// Where the triage fields come from, shared by `dlq list`, `dlq stats` and the selections.
pub(crate) const TRIAGE_FIELDS: &str = "\
Why a message died (REASON, JSON \"reason\"): the worker's annotation \
(x-redeliver-dead-letter-reason: permanent, retries_exhausted, budget_exhausted, \
forward_unconfigured, undecodable, too_large, requeue_limit, or a name the handler gave) when \
it published the dead letter itself, else the broker's x-death \
reason (rejected, expired, maxlen, delivery_limit), else none. Its final error (ERROR, \
\"final_error\"): the annotation's error, else the last retry's error \
(x-redeliver-last-error). When it died (DEAD_LETTERED_AT, \"dead_lettered_at\"): the \
annotation's time, else the broker's x-death time. Times are RFC 3339; one past the year \
9999 (which a publisher can write) is shown with an expanded year \
(+584554051223-11-09T07:00:15Z) and counts as unknown.";

/// How --reason, --error-contains, --older-than and --message-id select, for `replay`/`purge`.
pub(crate) const SELECTION: &str = "\
Selection: --reason R takes the messages whose reason is exactly R (as `dlq list` shows it); \
--error-contains TEXT those whose final error contains TEXT (case-sensitive); --older-than \
DURATION those dead-lettered at least that long ago (30m, 12h, 7d; a message whose time is \
unknown never matches); --message-id ID (repeatable) those with one of these ids. Given \
together, the criteria must all hold (AND). A --message-id that is not found makes the exit \
code 1 after the rest was done, so a typo does not look like success.";

/// Help heading of the selection options of `dlq replay`, `dlq purge` and `outbox parked`.
const SELECTION_HEADING: &str = "Selection (criteria combine with AND)";

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
messages, and watch and repair the PostgreSQL outbox of redeliver-postgres.\n\nExit codes: 0 success, 1 \
error (broker, database, queue, message), 2 usage (bad arguments, a destructive command without \
--yes).",
    after_help = "The password in --url / AMQP_URL is never printed; messages show it as ***. amqps:// \
URLs connect with TLS and verify the broker's certificate and host name."
)]
pub(crate) struct Cli {
    /// Broker URL: amqp://USER:PASSWORD@HOST:PORT/VHOST (the vhost '/' is written %2f).
    /// Several separated by ';' are tried in order. Defaults to the local broker,
    /// 127.0.0.1:5672, with the guest account
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
pub(crate) enum Command {
    /// Declare, verify or show the objects of one consumer queue (Q, Q.dlx, Q.dlq, delay levels)
    #[command(subcommand)]
    Topology(TopologyCmd),
    /// Inspect and repair a dead-letter queue (Q.dlq): list, stats, peek, replay, purge
    #[command(subcommand)]
    Dlq(DlqCmd),
    /// Inspect and replay the delay infrastructure's parking queue ({prefix}redeliver.delay.unroutable)
    #[command(subcommand)]
    Unroutable(UnroutableCmd),
    /// Self-tests of the delay infrastructure
    #[command(subcommand)]
    Delay(DelayCmd),
    /// The PostgreSQL outbox of redeliver-postgres: messages committed, not yet published, and
    /// those the relay parked
    #[command(subcommand)]
    Outbox(OutboxCmd),
}

#[derive(Subcommand, Debug)]
pub(crate) enum TopologyCmd {
    /// Declare Q, Q.dlx, Q.dlq and the delay infrastructure (idempotent)
    #[command(
        long_about = format!("Declare everything one consumer needs: the queue Q (quorum unless \
--classic) with its dead-letter exchange Q.dlx and dead-letter queue Q.dlq, the binding of Q on \
the delay deliver exchange, and the shared delay infrastructure (levels, deliver exchange, \
unroutable parking queue). Declaring is idempotent; an existing object with different \
arguments is reported with the object and argument named, and nothing is changed.\n\n--json \
prints {{\"declared\": true, \"queue\", \"queue_type\", \"dlx\", \"dlq\", \"dlq_type\", \
\"delay\": {{\"prefix\", \"levels\", \"granularity_ms\", \"queue_type\"}}}}. {JSON_OUTPUT}"
    ))]
    Declare(TopologyCmdArgs),
    /// Check that every object exists (passive declares only; creates nothing)
    #[command(long_about = format!("Check that every object of the topology exists (passive \
declares only; creates nothing). A missing object or one declared with other arguments is \
named, with the command that fixes it, and the exit code is 1.\n\n--json prints {{\"ok\": \
true, \"queue\", \"queue_type\", \"dlx\", \"dlq\", \"dlq_type\", \"delay\": \
{{\"prefix\", \"levels\", \"granularity_ms\", \"queue_type\"}}}} when everything is in place \
(nothing on stdout otherwise). {JSON_OUTPUT}"))]
    Verify(TopologyCmdArgs),
    /// Print every object with its arguments and live message counts; missing ones are marked
    #[command(
        long_about = format!("Print every object of the topology: Q, Q.dlx, Q.dlq, each delay \
level (exchange and queue), the deliver exchange and the unroutable parking exchange and queue. \
Each row shows whether the object exists, the live message and consumer counts of queues \
(from a passive declare, which creates nothing) and the arguments redeliver declares it with. \
AMQP cannot read back an existing object's arguments; `topology verify` and `topology declare` \
report a mismatch.\n\n--json prints {{\"objects\": [{{\"kind\", \"name\", \"exists\", \
\"messages\", \"consumers\", \"arguments\"}}], \"bindings\": [{{\"source\", \
\"destination\", \"routing_key\"}}]}}. {JSON_OUTPUT}"
    ))]
    Show(TopologyCmdArgs),
    /// Delete Q, Q.dlx and Q.dlq (and, with --include-delay, the shared delay infrastructure)
    #[command(long_about = format!("Delete Q, Q.dlx and Q.dlq, and with --include-delay the \
delay levels, deliver exchange and unroutable parking queue of the prefix (shared by every \
consumer that uses it). Requires --yes: deleting a queue destroys its messages.\n\nThe delay \
level queues hold other services' retries (their originals are already acknowledged) and the \
unroutable queue holds parked messages: with --include-delay, if any of them holds messages \
nothing is deleted and the command fails (exit code 2) naming them, unless --force is given. \
Queues found empty are deleted only once nothing can reach them any more, so a retry that \
arrives meanwhile is not destroyed either.\n\n--json prints {{\"deleted\": true, \"queue\", \
\"dlx\", \"dlq\", \"delay_deleted\", \"delay\" (as in `topology declare --json`, null \
without --include-delay), \"discarded\": [{{\"queue\", \"messages\"}}] (delay queues \
deleted with their messages by --force)}}; a refusal prints {{\"deleted\": false, \
\"refused\": true, \"non_empty\": [{{\"queue\", \"messages\"}}], \"already_deleted\": \
[queue names], \"error\"}} before failing. {JSON_OUTPUT}"))]
    Delete(DeleteArgs),
}

/// Options describing one consumer's topology. They must match what the service declares, or
/// `verify`/`declare` report a mismatch.
#[derive(Args, Debug, Clone)]
pub(crate) struct TopologyArgs {
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

/// `topology declare|verify|show` take the topology options plus an output format.
#[derive(Args, Debug, Clone)]
pub(crate) struct TopologyCmdArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// Print JSON instead of text (one document on stdout; keys in the long help)
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct DeleteArgs {
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
    /// With --include-delay: delete the delay queues even when they hold messages (other
    /// services' pending retries and parked messages are lost)
    #[arg(long, requires = "include_delay")]
    pub force: bool,
    /// Print JSON instead of text (one document on stdout; keys in the long help)
    #[arg(long)]
    pub json: bool,
}

/// Shape of the shared delay infrastructure. Only needed when it differs from the defaults.
#[derive(Args, Debug, Clone)]
pub(crate) struct DelayArgs {
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
pub(crate) struct QueueArgs {
    /// Queue name, without the prefix (the DLQ is QUEUE.dlq)
    #[arg(value_name = "QUEUE")]
    pub queue: String,
    /// Prefix put in front of every object name
    #[arg(long, default_value = "", value_name = "P")]
    pub prefix: String,
}

#[derive(Subcommand, Debug)]
pub(crate) enum DlqCmd {
    /// Table of dead-lettered messages, or counts per reason or error, without removing them
    #[command(long_about = format!("List dead-lettered messages of QUEUE.dlq, oldest first, \
without removing them: position, message_id, when it was dead-lettered, attempts (retries \
made), reason, x-death count, final error and a body preview.\n\n{TRIAGE_FIELDS}\n\n\
--group-by reason|error counts the messages read (the same --limit applies) per distinct \
reason or final error instead, most frequent first; messages without one are counted under \
(none).\n\n--json prints a JSON array with one object per message (keys position, \
message_id, correlation_id, content_type, timestamp, exchange, routing_key, redelivered, \
first_failed_at, attempts, last_error, original_exchange, original_routing_key, death_reason, \
death_count, x_death, reason, final_error, dead_lettered_at, dead_letter_attempts, \
dead_lettered_by, delivery_count, body_bytes, body_preview); with --group-by, \
[{{\"reason\": R, \"count\": N}}] or [{{\"error\": E, \"count\": N}}], null for none. \
{JSON_OUTPUT}\n\n{LISTING_METHOD}"))]
    List(ListArgs),
    /// Counts of QUEUE.dlq: ready, per reason, oldest and newest dead letter, body bytes
    #[command(long_about = format!("Summarise QUEUE.dlq without removing anything: the \
messages ready, how many were read, the count per reason (most frequent first), the oldest and \
newest dead-lettering time and the total size of the bodies read. Up to --limit messages are \
read (by default as many as one read can hold, 65535); when the queue holds more, the figures \
cover its head and say so.\n\n{TRIAGE_FIELDS}\n\n--json prints {{\"queue\", \"ready\", \
\"read\", \"by_reason\": [{{\"reason\", \"count\"}}], \"oldest_dead_lettered_at\", \
\"newest_dead_lettered_at\", \"undated\" (messages read without a known time), \
\"body_bytes\", \"read_at\"}}. {JSON_OUTPUT}\n\n{LISTING_METHOD}"))]
    Stats(StatsArgs),
    /// Print one dead-lettered message in full (properties, headers, body)
    #[command(long_about = format!("Print one message of QUEUE.dlq in full: delivery info, every \
property, every header (x-death included) and the body, pretty-printed when it is JSON, as text \
when it is UTF-8, as a hex dump otherwise. The queue is read without removing anything.\n\n{LISTING_METHOD}"))]
    Peek(PeekArgs),
    /// Move messages back to QUEUE with their attempt count reset
    #[command(
        long_about = format!("Move messages from QUEUE.dlq back to QUEUE, oldest first. Each copy \
keeps the body, message_id, content_type, correlation_id, the other properties and the user \
headers; the x-redeliver-* headers (attempt count, first failure, last error) and the broker's \
x-death / x-first-death-* / x-last-death-* / x-delivery-count headers are removed, so the \
handler sees a fresh message. user_id is dropped (the broker refuses one that is not the \
connection's user). Each copy is published to QUEUE through the default exchange with a \
publisher confirm, and only after the broker confirmed it is the DLQ copy acknowledged: an \
interruption never loses a message; at worst one message is in both queues (a duplicate, which \
the message_id lets a handler detect). Messages that are not selected (see below, and \
--limit, which caps how many selected messages move) stay in the DLQ in their order. Messages \
dead-lettered again while the replay runs are not replayed a second time. Ctrl-C stops after \
the message in progress. A selective replay looks past at most 65535 messages it does not move \
(the largest prefetch AMQP can express): when it could not examine every message it says how \
many it did not, and the exit code is 1.\n\n{SELECTION} Example: `redeliver dlq replay images \
--reason retries_exhausted --error-contains timeout`.\n\n--json prints {{\"queue\", \
\"destination\", \"dry_run\", \"moved\", \"examined\", \"not_examined\", \"messages\": \
[{{\"position\", \"message_id\", \"destination\"}}], \"skipped\": [{{\"position\", \"message_id\", \
\"error\"}}], \"missing_message_ids\", \"interrupted\"}}, also when the exit code is 1. \
{JSON_OUTPUT}"
    ))]
    Replay(ReplayArgs),
    /// Delete every message of QUEUE.dlq, or only the selected ones (requires --yes)
    #[command(long_about = format!("Delete messages of QUEUE.dlq for good; requires --yes. \
Without a selection every message is deleted (queue.purge). With one, only the matching \
messages are: the queue is read as by `dlq list`, each match is acknowledged (which deletes \
it) and every other message goes back to its original position, in order, when the channel \
closes. One run looks past at most 65535 messages it keeps (the largest prefetch AMQP can \
express): when it could not examine every message it says how many it did not, and the exit \
code is 1.\n\n{SELECTION} Example: `redeliver dlq purge images --reason undecodable \
--older-than 7d --yes`.\n\n--json prints {{\"queue\", \"purged\", \"kept\", \"not_examined\", \
\"selection\" (the criteria, null without), \"missing_message_ids\"}}. {JSON_OUTPUT}"))]
    Purge(PurgeArgs),
}

/// What `dlq list --group-by` counts by.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GroupBy {
    /// The reason the message died
    Reason,
    /// The final error
    Error,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// Show (or, with --group-by, count) at most N messages from the head of the queue
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65535))]
    pub limit: u32,
    /// Count the messages per distinct reason or final error instead of listing them
    #[arg(long, value_enum, value_name = "FIELD")]
    pub group_by: Option<GroupBy>,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct StatsArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// Read at most N messages from the head of the queue
    #[arg(long, default_value_t = 65535, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65535))]
    pub limit: u32,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

/// Which dead letters `dlq replay` and `dlq purge` act on.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct FilterArgs {
    /// Only messages with this reason, as `dlq list` shows it (permanent, retries_exhausted,
    /// rejected, ...)
    #[arg(long, value_name = "REASON", help_heading = SELECTION_HEADING,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub reason: Option<String>,
    /// Only messages whose final error contains TEXT (case-sensitive)
    #[arg(long, value_name = "TEXT", help_heading = SELECTION_HEADING,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub error_contains: Option<String>,
    /// Only messages dead-lettered at least this long ago, e.g. 30m or 7d (unknown time: no match)
    #[arg(long, value_parser = parse_duration, value_name = "DURATION", help_heading = SELECTION_HEADING)]
    pub older_than: Option<Duration>,
    /// Only the messages with this message_id (repeatable: any of them)
    #[arg(long = "message-id", value_name = "ID", help_heading = SELECTION_HEADING)]
    pub message_ids: Vec<String>,
}

impl FilterArgs {
    /// True when any criterion is given.
    pub(crate) fn any(&self) -> bool {
        self.reason.is_some()
            || self.error_contains.is_some()
            || self.older_than.is_some()
            || !self.message_ids.is_empty()
    }
}

#[derive(Args, Debug, Clone)]
pub(crate) struct PeekArgs {
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
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// Move at most N (selected) messages
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: Option<u64>,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Print what would move and change nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Print a JSON report instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct PurgeArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Confirm: the messages are deleted for good
    #[arg(long)]
    pub yes: bool,
    /// Print a JSON report instead of text
    #[arg(long)]
    pub json: bool,
}

/// The parking queue is shared by every consumer of a prefix, so these commands take no QUEUE;
/// `--queue` filters by destination instead.
#[derive(Args, Debug, Clone)]
pub(crate) struct UnroutableArgs {
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
pub(crate) enum UnroutableCmd {
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
        long_about = format!("Publish parked messages straight to their destination queue through \
the default exchange (the delay they were waiting for is not applied again: it has long elapsed \
while they were parked). Unlike `dlq replay`, the x-redeliver-* headers are KEPT: these messages \
were in the middle of a retry, and their attempt count still counts toward max_retries. The \
broker's x-death headers from the delay hops are removed. The destination is the routing key \
minus its first L (delay bit) words, or --to. A message whose destination does not exist (the \
broker returns it) or cannot be read stays parked and is reported; the exit code is then 1. \
Each copy is confirmed by the broker before the parked copy is acknowledged.\n\n--json prints \
the report of `dlq replay --json`. {JSON_OUTPUT}"
    ))]
    Replay(UnroutableReplayArgs),
    /// Delete every parked message, or with --queue those for one destination (requires --yes)
    #[command(long_about = format!("Delete parked messages for good; requires --yes. Without \
--queue every message is deleted; with --queue only those whose destination is that queue, the \
others go back in their order.\n\n--json prints {{\"queue\", \"purged\", \"kept\", \
\"not_examined\", \"selection\", \"missing_message_ids\"}}. {JSON_OUTPUT}"))]
    Purge(UnroutablePurgeArgs),
}

#[derive(Args, Debug, Clone)]
pub(crate) struct UnroutableListArgs {
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
pub(crate) struct UnroutablePeekArgs {
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
pub(crate) struct UnroutableReplayArgs {
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
    /// Print a JSON report instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct UnroutablePurgeArgs {
    #[command(flatten)]
    pub common: UnroutableArgs,
    /// Confirm: the messages are deleted for good
    #[arg(long)]
    pub yes: bool,
    /// Print a JSON report instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub(crate) enum DelayCmd {
    /// Send probes through the delay levels and print observed vs intended delay
    #[command(
        long_about = format!("Operator self-test of the delay infrastructure: declares a temporary \
exclusive probe queue bound to {{prefix}}redeliver.delay.deliver, publishes one probe per delay \
through the levels (with publisher confirms), and prints for each the intended delay, the delay \
the levels can represent (rounded up to the granularity), the observed delay and the error. The \
probe queue is deleted at the end. The delay infrastructure must exist (`redeliver topology \
declare`). Exit code 1 if a probe does not arrive within the longest delay plus --grace.\n\n\
--json prints {{\"probes\": [{{\"intended_ms\", \"routed_ms\", \"observed_ms\", \
\"error_ms\", \"status\" (ok, lost or not_sent), \"error\"}}], \"lost\", \"not_sent\"}}, \
also when the exit code is 1. {JSON_OUTPUT}"
    ))]
    Probe(ProbeArgs),
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ProbeArgs {
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
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

/// Where the outbox is, shared by every `outbox` command.
pub(crate) const OUTBOX_DATABASE: &str = "\
The database comes from --database-url / DATABASE_URL (its password is never printed); \
--connect-timeout bounds the connection to it. --schema and --outbox-table must name the tables \
the services use (their redeliver_postgres::Schema).";

/// How the `outbox parked` commands select rows.
pub(crate) const PARKED_SELECTION: &str = "\
Selection: --id N (repeatable) takes the rows with one of these ids; --message-id ID \
(repeatable) those with one of these message ids; --reason R those parked for reason R \
(retries_exhausted: the broker refused every attempt the relay's policy allows; permanent: it \
can never take the row as it is; unreadable: the row's headers are not a JSON object of \
strings); --error-contains TEXT those whose last error contains TEXT (case-sensitive); \
--exchange X and --routing-key K those published to that exchange (\"\" is the default exchange) \
or with that routing key; --older-than DURATION those parked at least that long ago (30m, 12h, \
7d, by the database's clock). Given together, the criteria must all hold (AND). Without any, \
every parked row is selected.";

/// The keys of one row in `outbox parked list --json` (and of the rows of a dry run).
const PARKED_ROW_KEYS: &str = "\"id\", \"message_id\", \"exchange\", \"routing_key\", \
\"reason\", \"attempts\", \"last_error\", \"created_at\", \"parked_at\", \
\"parked_age_seconds\", \"content_type\", \"unreadable\" (why the row cannot be read as a \
message, null when it can), \"body_bytes\", \"body_preview\"";

#[derive(Subcommand, Debug)]
pub(crate) enum OutboxCmd {
    /// How many messages wait in the outbox, and for how long the oldest has waited
    #[command(long_about = format!("Count the rows of the outbox table (messages that \
transactions stored and committed, which no relay has published yet) and the age of the oldest, \
as redeliver_postgres::pending computes them and the relay's gauges redeliver_outbox_pending and \
redeliver_outbox_oldest_age_seconds report them; of those, the rows the broker refused at least \
once and that wait for their next attempt (retrying); and the rows the relay gave up on \
(parked, see `redeliver outbox parked`) with how long ago the earliest was parked, as the gauges \
redeliver_outbox_parked and redeliver_outbox_parked_oldest_age_seconds report them. A count that \
keeps growing, or an old oldest row, means no relay runs or it cannot reach the broker. Reads \
only: nothing is changed or created, so a missing table is an error (exit code 1) naming \
it.\n\n{OUTBOX_DATABASE}\n\n--json prints {{\"outbox\" (schema.table), \"schema\", \"table\", \
\"pending\", \"oldest_age_seconds\" (null when nothing is pending), \"retrying\", \"parked\", \
\"oldest_parked_age_seconds\" (null when nothing is parked)}}. {JSON_OUTPUT}"))]
    Status(OutboxStatusArgs),
    /// Rows the relay gave up on (parked): list, stats, peek, replay, purge
    #[command(subcommand)]
    Parked(ParkedCmd),
}

impl OutboxCmd {
    /// The database options of the command.
    pub(crate) fn db(&self) -> &OutboxDbArgs {
        match self {
            OutboxCmd::Status(a) => &a.db,
            OutboxCmd::Parked(p) => p.db(),
        }
    }
}

impl ParkedCmd {
    /// The database options of the command.
    pub(crate) fn db(&self) -> &OutboxDbArgs {
        match self {
            ParkedCmd::List(a) => &a.db,
            ParkedCmd::Stats(a) => &a.db,
            ParkedCmd::Peek(a) => &a.db,
            ParkedCmd::Replay(a) => &a.db,
            ParkedCmd::Purge(a) => &a.db,
        }
    }
}

/// Which outbox table, in which database.
#[derive(Args, Debug, Clone)]
pub(crate) struct OutboxDbArgs {
    /// PostgreSQL URL: postgres://USER:PASSWORD@HOST:PORT/DATABASE
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: Option<String>,
    /// Schema of the outbox table
    #[arg(
        long,
        env = "REDELIVER_PG_SCHEMA",
        default_value = "redeliver",
        value_name = "NAME"
    )]
    pub schema: String,
    /// Name of the outbox table
    #[arg(long, default_value = "outbox", value_name = "TABLE")]
    pub outbox_table: String,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct OutboxStatusArgs {
    #[command(flatten)]
    pub db: OutboxDbArgs,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub(crate) enum ParkedCmd {
    /// Table of parked rows, oldest id first
    #[command(long_about = format!("List the rows the outbox relay parked: messages the broker \
refused on every attempt its retry policy allows, or that it can never publish as they are. \
Each row shows its id, message id, exchange, routing key, why it was parked, the publishes the \
broker refused, how long ago it was parked and its last error, cut short (`outbox parked peek` \
shows everything). At most --limit rows, lowest id first; the first line says how many \
match. Reads only.\n\n{PARKED_SELECTION}\n\n{OUTBOX_DATABASE}\n\n--json prints an array with \
one object per row: {{{PARKED_ROW_KEYS}}}. Times are RFC 3339. {JSON_OUTPUT}"))]
    List(ParkedListArgs),
    /// Counts of parked rows: by reason, by exchange and routing key, the oldest's age
    #[command(long_about = format!("Count the parked rows that match, by reason and by \
(exchange, routing key), most frequent first, and how long ago the earliest of them was \
parked. Reads only.\n\n{PARKED_SELECTION}\n\n{OUTBOX_DATABASE}\n\n--json prints {{\"outbox\", \
\"selection\" (the criteria as options, null without), \"parked\", \"by_reason\": \
[{{\"reason\", \"count\"}}], \"by_route\": [{{\"exchange\", \"routing_key\", \"count\"}}], \
\"oldest_age_seconds\" (null when none matches)}}. {JSON_OUTPUT}"))]
    Stats(ParkedStatsArgs),
    /// Print parked rows in full (headers, content type, body)
    #[command(long_about = format!("Print the parked rows that match in full, lowest id first, \
at most --limit of them: every column, the headers, the content type and the body, \
pretty-printed when it is JSON, as text when it is UTF-8, as a hex dump otherwise. Text and \
header values are escaped (a control character shows as \\u{{1b}}, never raw) and cut when \
long: a body after {PEEK_BODY_KIB} KiB, a header value or the last error after {PEEK_VALUE_CHARS} \
characters. A row whose headers are not a JSON object of strings (reason unreadable) shows them \
as stored. No row matching is an error (exit code 1). Reads only.\n\n{PARKED_SELECTION}\n\n\
{OUTBOX_DATABASE}\n\n--json prints an array with one object per row, whole: the keys of \
`outbox parked list --json` without body_preview, plus \"headers\" (an object, null when the \
row is unreadable), \"stored_headers\" (the headers column as stored, when the row is \
unreadable), \"body\" ({{\"json\": value}}, {{\"text\": string}} or {{\"bytes_hex\": \
string}}). {JSON_OUTPUT}"))]
    Peek(ParkedPeekArgs),
    /// Put parked rows back in the outbox for the relay to publish again
    #[command(long_about = format!("Put the parked rows that match back in the outbox as new: \
no attempts, due now, and the relays are woken (NOTIFY) to publish them. Their message ids are \
kept, so a consumer behind a redeliver-postgres inbox still recognises one it already handled. \
Fix what made the broker refuse them first (a missing exchange or binding, a full queue): a \
row refused again is retried and parked again. Without a selection every parked row is \
replayed, as `dlq replay` moves every message; --dry-run shows what would be replayed and \
changes nothing. An --id or --message-id that names no parked row makes the exit code 1 after \
the rest was done, so a typo does not look like success.\n\n{PARKED_SELECTION} Example: \
`redeliver outbox parked replay --reason retries_exhausted --exchange orders`.\n\n\
{OUTBOX_DATABASE}\n\n--json prints {{\"outbox\", \"dry_run\", \"selection\" (the criteria as \
options, null without), \"replayed\" (rows replayed, or that would be), \"rows\" (dry run: up \
to {DRY_RUN_ROWS} of them, as `outbox parked list --json` shows them; empty otherwise), \
\"missing_ids\", \"missing_message_ids\"}}, also when the exit code is 1. {JSON_OUTPUT}"))]
    Replay(ParkedReplayArgs),
    /// Delete parked rows for good (requires --yes)
    #[command(long_about = format!("Delete the parked rows that match, for good; requires \
--yes (not with --dry-run, which shows what would be deleted and changes nothing). Without a \
selection every parked row is deleted; rows that are not parked are never touched. An --id or \
--message-id that names no parked row makes the exit code 1 after the rest was done.\n\n\
{PARKED_SELECTION} Example: `redeliver outbox parked purge --reason unreadable --older-than 7d \
--yes`.\n\n{OUTBOX_DATABASE}\n\n--json prints {{\"outbox\", \"dry_run\", \"selection\", \
\"purged\", \"rows\", \"missing_ids\", \"missing_message_ids\"}}, as `outbox parked replay \
--json` does. {JSON_OUTPUT}"))]
    Purge(ParkedPurgeArgs),
}

/// Body bytes `outbox parked peek` shows in text, in KiB.
pub(crate) const PEEK_BODY_KIB: usize = 16;
/// Characters of one header value (or last error) `outbox parked peek` shows in text.
pub(crate) const PEEK_VALUE_CHARS: usize = 2048;
/// Rows a dry run of `outbox parked replay|purge` shows.
pub(crate) const DRY_RUN_ROWS: u32 = 1000;

/// Which parked rows an `outbox parked` command acts on.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ParkedFilterArgs {
    /// Only the row with this id (repeatable: any of them)
    #[arg(long = "id", value_name = "N", help_heading = SELECTION_HEADING)]
    pub ids: Vec<i64>,
    /// Only the rows with this message id (repeatable: any of them)
    #[arg(long = "message-id", value_name = "ID", help_heading = SELECTION_HEADING)]
    pub message_ids: Vec<String>,
    /// Only rows parked for this reason: retries_exhausted, permanent or unreadable
    #[arg(long, value_name = "REASON", help_heading = SELECTION_HEADING,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub reason: Option<String>,
    /// Only rows whose last error contains TEXT (case-sensitive)
    #[arg(long, value_name = "TEXT", help_heading = SELECTION_HEADING,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub error_contains: Option<String>,
    /// Only rows for this exchange ("" is the default exchange)
    #[arg(long, value_name = "EXCHANGE", help_heading = SELECTION_HEADING)]
    pub exchange: Option<String>,
    /// Only rows with this routing key
    #[arg(long, value_name = "KEY", help_heading = SELECTION_HEADING)]
    pub routing_key: Option<String>,
    /// Only rows parked at least this long ago, e.g. 30m or 7d
    #[arg(long, value_parser = parse_duration, value_name = "DURATION", help_heading = SELECTION_HEADING)]
    pub older_than: Option<Duration>,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ParkedListArgs {
    #[command(flatten)]
    pub db: OutboxDbArgs,
    #[command(flatten)]
    pub filter: ParkedFilterArgs,
    /// Show at most N rows, lowest id first
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65535))]
    pub limit: u32,
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ParkedStatsArgs {
    #[command(flatten)]
    pub db: OutboxDbArgs,
    #[command(flatten)]
    pub filter: ParkedFilterArgs,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ParkedPeekArgs {
    #[command(flatten)]
    pub db: OutboxDbArgs,
    #[command(flatten)]
    pub filter: ParkedFilterArgs,
    /// Print at most N rows, lowest id first
    #[arg(long, default_value_t = 10, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub limit: u32,
    /// Print a JSON array instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ParkedReplayArgs {
    #[command(flatten)]
    pub db: OutboxDbArgs,
    #[command(flatten)]
    pub filter: ParkedFilterArgs,
    /// Print what would be replayed and change nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Print a JSON report instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ParkedPurgeArgs {
    #[command(flatten)]
    pub db: OutboxDbArgs,
    #[command(flatten)]
    pub filter: ParkedFilterArgs,
    /// Confirm: the rows are deleted for good
    #[arg(long)]
    pub yes: bool,
    /// Print what would be deleted and change nothing (no --yes needed)
    #[arg(long)]
    pub dry_run: bool,
    /// Print a JSON report instead of text
    #[arg(long)]
    pub json: bool,
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

    /// The help lists every reason the worker dead-letters with: a reason added to
    /// `DeadLetterReason` fails here until the text names it.
    #[test]
    fn triage_help_names_every_dead_letter_reason() {
        let words: Vec<&str> = TRIAGE_FIELDS
            .split(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .collect();
        for reason in redeliver_core::DeadLetterReason::ALL {
            assert_eq!(
                words.contains(&reason.as_str()),
                !reason.is_requeue(),
                "{reason:?} in TRIAGE_FIELDS"
            );
        }
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
