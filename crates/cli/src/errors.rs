//! Error types of the binary, exit codes, and the "what to do now" hints.
//!
//! Commands return `anyhow::Error` with context; this module walks the cause chain once, at the
//! end, to find the lapin / redeliver-amqp error underneath and say what the operator should do.

use std::fmt;

use lapin::ErrorKind;
use redeliver_amqp::TopologyError;

use redeliver_amqp::url::BrokerUrl;

use crate::text;

/// Exit code of a usage error (clap uses the same).
pub(crate) const EXIT_USAGE: u8 = 2;
/// Exit code of every other error.
pub(crate) const EXIT_ERROR: u8 = 1;

/// The command line is wrong or incomplete (exit code 2).
#[derive(Debug)]
pub(crate) struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for UsageError {}

/// The broker could not be reached at all (used where lapin has no error of its own, e.g. a
/// connect timeout).
#[derive(Debug)]
pub(crate) struct Unreachable(pub String);

impl fmt::Display for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Unreachable {}

/// A queue the command needs does not exist.
#[derive(Debug)]
pub(crate) struct QueueMissing {
    pub queue: String,
}

impl fmt::Display for QueueMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "queue '{}' does not exist", self.queue)
    }
}
impl std::error::Error for QueueMissing {}

/// What the hints need to know about the invocation.
#[derive(Clone, Debug, Default)]
pub(crate) struct HintContext {
    /// The `redeliver topology declare ...` line that creates the missing objects, when the
    /// command is about one consumer queue.
    pub declare_command: Option<String>,
}

/// Exit code for an error returned by a command.
pub(crate) fn exit_code(err: &anyhow::Error) -> u8 {
    if err.chain().any(|c| c.is::<UsageError>()) {
        EXIT_USAGE
    } else {
        EXIT_ERROR
    }
}

/// The full text printed on stderr: `error: ...` and zero or more `hint: ...` lines, scrubbed of
/// the password.
///
/// Error texts quote the broker (its close reasons, queue names, message ids, routing keys),
/// so each line is escaped ([`text::escape`]): one message must not be able to forge lines or
/// send escape sequences to the terminal through an error. The password is scrubbed before
/// escaping (an escaped password would no longer be found) and once more from the whole text.
pub(crate) fn render(err: &anyhow::Error, urls: &[BrokerUrl], ctx: &HintContext) -> String {
    let scrub = |s: &str| urls.iter().fold(s.to_owned(), |text, u| u.scrub(&text));
    render_with(err, &hints(err, urls.first(), ctx), &scrub)
}

/// [`render`] with the hints given and the scrubbing of another URL: for the commands that
/// talk to something else than the broker (the database of `outbox status`).
pub(crate) fn render_with(
    err: &anyhow::Error,
    hints: &[String],
    scrub: &dyn Fn(&str) -> String,
) -> String {
    let line = |s: &str| text::escape(&scrub(s)).into_owned();
    let mut out = format!("error: {}\n", line(&chain_text(err)));
    for hint in hints {
        out.push_str("hint: ");
        out.push_str(&line(hint));
        out.push('\n');
    }
    scrub(&out)
}

/// The cause chain joined by ": ", each text once (lapin's errors repeat their source in their
/// own message).
fn chain_text(err: &anyhow::Error) -> String {
    redeliver_core::error_chain(err.as_ref())
}

fn hints(err: &anyhow::Error, url: Option<&BrokerUrl>, ctx: &HintContext) -> Vec<String> {
    let declare = ctx
        .declare_command
        .as_deref()
        .unwrap_or("redeliver topology declare QUEUE [--prefix P]");
    for cause in err.chain() {
        if cause.is::<Unreachable>() {
            return vec![unreachable_hint()];
        }
        if let Some(m) = cause.downcast_ref::<QueueMissing>() {
            return vec![format!(
                "'{}' is not declared in this vhost: declare it with `{declare}` (check the \
                 queue name, --prefix and the vhost in --url)",
                m.queue
            )];
        }
        if let Some(t) = cause.downcast_ref::<TopologyError>() {
            if let Some(h) = topology_hint(t, declare, url) {
                return vec![h];
            }
        }
        if let Some(l) = cause.downcast_ref::<lapin::Error>() {
            if let Some(h) = lapin_hint(l, declare, url) {
                return vec![h];
            }
        }
    }
    Vec::new()
}

fn unreachable_hint() -> String {
    "is RabbitMQ running and listening there? Start a local one with `rabbitmq-server -detached` \
     (or `docker compose -f compose/docker-compose.yml up -d rabbitmq`), or point --url / \
     AMQP_URL at your broker"
        .to_owned()
}

fn credentials_hint(url: Option<&BrokerUrl>) -> String {
    let user = url.map_or("the user", BrokerUrl::user);
    format!(
        "the broker refused the login of user '{user}' (ACCESS_REFUSED): check the user and \
         password in --url / AMQP_URL (`rabbitmqctl authenticate_user {user} PASSWORD` tells \
         whether they match; guest may only log in from localhost)"
    )
}

fn permission_hint(url: Option<&BrokerUrl>) -> String {
    let user = url.map_or("USER", BrokerUrl::user);
    let vhost = url.map_or("/", BrokerUrl::vhost);
    format!(
        "user '{user}' lacks a permission on vhost '{vhost}': grant it with \
         `rabbitmqctl set_permissions -p '{vhost}' {user} '.*' '.*' '.*'` or use another user"
    )
}

fn mismatch_hint(object: &str, argument: Option<&str>) -> String {
    let arg = argument.map_or_else(|| "its arguments".to_owned(), |a| format!("argument '{a}'"));
    let operator_queue =
        object.ends_with(".dlq'") || object.ends_with("redeliver.delay.unroutable'");
    if argument == Some("x-delivery-limit") && operator_queue {
        return format!(
            "{object} was declared without the delivery limit redeliver now gives the queues that \
             hold messages for an operator (2147483647): from RabbitMQ 4.0 such a quorum queue has \
             a limit of 20, and each listing spends one attempt, so it can drop messages. Move its \
             messages away (`redeliver dlq replay QUEUE` or `redeliver unroutable replay`), delete \
             it, and declare again; the existing queue was left as it is"
        );
    }
    format!(
        "{object} already exists with a different {arg}. Declare with options that match the \
         existing object (--classic, --delivery-limit, --no-delivery-limit, --dlq-message-ttl, \
         --dlq-max-length, --delay-classic, --levels, --granularity), or move its messages away \
         and delete it so it can be declared again; the existing object was left as it is"
    )
}

fn topology_hint(t: &TopologyError, declare: &str, url: Option<&BrokerUrl>) -> Option<String> {
    match t {
        TopologyError::Missing { object } => Some(format!(
            "{object} is not declared: declare the topology with `{declare}`"
        )),
        TopologyError::Mismatch {
            object, argument, ..
        } => Some(mismatch_hint(object, argument.as_deref())),
        TopologyError::DelaySettingsMismatch { prefix, .. } => Some(format!(
            "declare with the settings of the existing delay infrastructure (--levels, \
             --granularity, --delay-classic) or use another --prefix. To change the settings of \
             prefix '{prefix}': stop every service using it, wait until its level queues are \
             empty, delete it with its existing --levels (`redeliver topology delete QUEUE --prefix \
             '{prefix}' --include-delay --levels N --yes`, which also deletes that queue's \
             topology), then declare again"
        )),
        TopologyError::AccessRefused { .. } => Some(permission_hint(url)),
        TopologyError::InvalidName(_) => Some(
            "queue names become words of topic routing keys: no '*', '#', and no empty words \
             (leading, trailing or doubled '.')"
                .to_owned(),
        ),
        TopologyError::Delay(_) => Some(
            "check --levels and --granularity: the longest delay is (2^levels - 1) * \
             granularity"
                .to_owned(),
        ),
        TopologyError::Amqp(l) => lapin_hint(l, declare, url),
        _ => None,
    }
}

/// I/O errors that mean nothing answers at that address (as opposed to a server that answered
/// and hung up): the hint is to start the server or fix the address.
pub(crate) fn nothing_there(kind: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind as Io;
    matches!(
        kind,
        Io::ConnectionRefused
            | Io::TimedOut
            | Io::NotFound
            | Io::HostUnreachable
            | Io::NetworkUnreachable
            | Io::AddrNotAvailable
    )
}

fn lapin_hint(err: &lapin::Error, declare: &str, url: Option<&BrokerUrl>) -> Option<String> {
    match err.kind() {
        ErrorKind::IOError(io) => {
            use std::io::ErrorKind as Io;
            match io.kind() {
                kind if nothing_there(kind) => Some(unreachable_hint()),
                Io::ConnectionReset | Io::ConnectionAborted | Io::UnexpectedEof => Some(
                    "the broker closed the connection: check its log, that this is an AMQP \
                     0-9-1 port (5672, not the management port 15672), and the credentials"
                        .to_owned(),
                ),
                _ => None,
            }
        }
        ErrorKind::ProtocolError(amqp) => {
            let msg = amqp.get_message().as_str();
            match amqp.get_id() {
                403 if msg.contains("Login was refused") || msg.contains("authentication") => {
                    Some(credentials_hint(url))
                }
                403 => Some(permission_hint(url)),
                530 if msg.contains("vhost") => Some(format!(
                    "the vhost in --url does not exist or user '{}' may not use it: the vhost is \
                     the URL path, percent-encoded ('/' is %2f); list them with `rabbitmqctl \
                     list_vhosts`",
                    url.map_or("USER", BrokerUrl::user)
                )),
                404 => Some(format!(
                    "{}: declare it with `{declare}`",
                    not_found_object(msg).unwrap_or_else(|| "an object is missing".to_owned())
                )),
                406 => {
                    let (object, arg) = parse_inequivalent(msg);
                    Some(mismatch_hint(
                        object.as_deref().unwrap_or("an object"),
                        arg.as_deref(),
                    ))
                }
                320 => Some(
                    "the broker closed the connection (CONNECTION_FORCED): it is shutting down \
                     or an operator closed it; try again"
                        .to_owned(),
                ),
                _ => None,
            }
        }
        ErrorKind::ParsingError(_) => Some(
            "what answered at that address does not speak AMQP 0-9-1: check the host and port \
             in --url / AMQP_URL (RabbitMQ's AMQP port is 5672; 5671 is TLS: use amqps:// for \
             it)"
            .to_owned(),
        ),
        ErrorKind::InvalidConnectionState(_) | ErrorKind::MissingHeartbeatError => {
            Some("the connection to the broker was lost: check the broker and try again".to_owned())
        }
        _ => None,
    }
}

/// "NOT_FOUND - no queue 'x' in vhost '/'" -> "queue 'x' does not exist".
fn not_found_object(msg: &str) -> Option<String> {
    let rest = msg.split("no ").nth(1)?;
    let (kind, rest) = rest.split_once(' ')?;
    let name = rest.strip_prefix('\'')?.split('\'').next()?;
    Some(format!("{kind} '{name}' does not exist"))
}

/// "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/':
/// ..." -> (Some("queue 'q'"), Some("x-dead-letter-exchange")). The broker's wording is stable
/// across 3.x (quoted from 3.10.8).
pub(crate) fn parse_inequivalent(msg: &str) -> (Option<String>, Option<String>) {
    let Some(rest) = msg.split("inequivalent arg '").nth(1) else {
        return (None, None);
    };
    let Some((arg, rest)) = rest.split_once('\'') else {
        return (None, None);
    };
    let object = rest.strip_prefix(" for ").and_then(|r| {
        let (kind, r) = r.split_once(" '")?;
        let name = r.split('\'').next()?;
        Some(format!("{kind} '{name}'"))
    });
    (object, Some(arg.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_brokers_406() {
        let msg = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' \
                   in vhost '/': received none but current is the value 'q.dlx' of type 'longstr'";
        assert_eq!(
            parse_inequivalent(msg),
            (
                Some("queue 'q'".to_owned()),
                Some("x-dead-letter-exchange".to_owned())
            )
        );
        assert_eq!(parse_inequivalent("something else"), (None, None));
    }

    #[test]
    fn parses_the_brokers_404() {
        assert_eq!(
            not_found_object("NOT_FOUND - no queue 'a.dlq' in vhost '/'").as_deref(),
            Some("queue 'a.dlq' does not exist")
        );
    }

    #[test]
    fn usage_errors_exit_2() {
        let e = anyhow::Error::new(UsageError("x".into())).context("while parsing");
        assert_eq!(exit_code(&e), EXIT_USAGE);
        assert_eq!(exit_code(&anyhow::anyhow!("boom")), EXIT_ERROR);
    }

    #[test]
    fn broker_text_in_errors_is_escaped() {
        let e = anyhow::anyhow!("routing key 'rk\u{1b}[2J\r\nerror: forged' names no queue")
            .context("#3 message_id \u{202e}di");
        let out = render(&e, &[], &HintContext::default());
        assert_eq!(
            out,
            "error: #3 message_id \\u{202e}di: routing key 'rk\\u{1b}[2J\\r\\nerror: forged' \
             names no queue\n"
        );
    }

    #[test]
    fn chain_skips_repeated_causes() {
        let e = anyhow::anyhow!("inner").context("outer: inner");
        assert_eq!(chain_text(&e), "outer: inner");
    }
}
