//! The worker's settings: one type, written by the builder's methods and by the environment
//! layer ([`crate::env`]), read back through [`WorkerBuilder::settings`](crate::WorkerBuilder::settings).
//!
//! Every setting is declared once, in the [`settings!`] table at the end of this file: its field,
//! type and default, its builder method and that method's documentation, its getter, its
//! environment variable and parser, its check at `build()`, its `Debug` field and its rows in
//! the settings tables of the rustdoc and the README. Adding a simple setting is one entry there,
//! its rows pasted into the README (a test prints them), and the code that uses it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redeliver_amqp::url::{self, BrokerUrl};
use redeliver_amqp::DelayConfig;
use redeliver_amqp::TlsConfig;
use redeliver_amqp::Topology;
use redeliver_core::{Backoff, Delays, Jitter, RetryPolicy};

use crate::env::read;
use crate::error::{EnvError, SettingError};
use crate::handler::ErasedHandler;
use crate::permits::Permits;

/// How the worker dead-letters a message that cannot succeed.
///
/// | | `Reject` (default) | `Annotate` |
/// |---|---|---|
/// | how | `basic.reject(requeue = false)`: the broker's DLX moves the message to `Q.dlq` | the worker publishes it to `Q.dlx` (routing key `Q`, mandatory, confirmed), then acks the original |
/// | what the DLQ copy says | `x-death` (reason `rejected`); a message retried before carries its last retry's error (`x-redeliver-last-error`) | `x-redeliver-dead-letter-reason`, `-error` (the final error and its sources, at most 4 KiB), `-attempts`, `x-redeliver-dead-lettered-at`, `-by` (the connection name), `x-redeliver-first-failed-at`; no `x-death` |
/// | the final error | in the log line, the metric's `reason` and the delivery's span | on the message too |
/// | cost | one frame | one confirmed publish per dead letter |
/// | if `Q.dlq` is missing | a quorum `Q` keeps the message (at-least-once); a classic one drops it | the publish comes back unroutable: the original is requeued (bounded by [`WorkerBuilder::requeue_limit`](crate::WorkerBuilder::requeue_limit), then rejected) |
///
/// In both modes, messages the broker dead-letters itself (delivery limit, TTL, overflow) carry
/// the broker's `x-death`, and body and properties are kept (a dead letter drops `expiration`,
/// kept in `x-redeliver-original-expiration`, so it cannot expire in the DLQ).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterMode {
    /// The broker-native way: `basic.reject(requeue = false)`.
    #[default]
    Reject,
    /// Spring's republish-to-DLQ: the worker publishes the dead letter with its reason and error.
    Annotate,
}

/// Where a retry waits out its delay.
///
/// | | `Levels` (default) | `Native` | `Auto` |
/// |---|---|---|---|
/// | how | a confirmed copy through the shared TTL delay levels, then an ack | AMQP 1.0 consumer; the quorum queue holds the message until its time (`modified` with `x-opt-delivery-time`) | `Native` where it works, `Levels` elsewhere |
/// | needs | any RabbitMQ | RabbitMQ 4.3+, a quorum queue, `amqp://` | |
/// | dead letters | as [`DeadLetterMode`] says | through the queue's DLX with `x-opt-redeliver-dead-letter-reason`, `-error`, `-attempts`, `-at`, `-by` whatever the mode | |
///
/// An explicit `Native` that cannot work (an older broker, a classic queue) stops the worker at
/// start with [`WorkerError::RetryMode`](crate::WorkerError::RetryMode). A retried message is
/// handled by a worker of either mode, so switching modes loses nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RetryMode {
    /// The delay levels everywhere.
    #[default]
    Levels,
    /// The queue holds retries: RabbitMQ 4.3+ quorum queues only.
    Native,
    /// Native where the broker and the queue allow it, the delay levels elsewhere.
    Auto,
}

impl std::str::FromStr for RetryMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "levels" => Ok(Self::Levels),
            "native" => Ok(Self::Native),
            "auto" => Ok(Self::Auto),
            _ => Err("expected `levels`, `native` or `auto`".into()),
        }
    }
}

impl std::fmt::Display for RetryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Levels => "levels",
            Self::Native => "native",
            Self::Auto => "auto",
        })
    }
}

impl std::str::FromStr for DeadLetterMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "reject" => Ok(Self::Reject),
            "annotate" => Ok(Self::Annotate),
            _ => Err("expected `reject` or `annotate`".into()),
        }
    }
}

/// Declares the settings: `hand_written` fields (their methods, getters and `Debug` lines are
/// written by hand: they are not plain values), then one entry per simple setting, and the
/// hand-written rows of the two tables. From them it generates [`Settings`] with its defaults,
/// its getters, its `Debug` fields and its checks; the [`WorkerBuilder`](crate::WorkerBuilder)
/// methods; the environment variables' constants (`vars`) and reader; and the markdown tables
/// `builder_table!()` and `env_table!()` for the rustdoc and the README.
///
/// An entry:
///
/// ```text
/// /// The builder method's documentation.
/// KIND NAME(ARG[: TYPE]) [= DEFAULT],
///     "meaning (one line, markdown, for the tables and the getter)", "default, in words"
///     [, env CONSTANT = "VARIABLE", "format, in words", PARSER]
///     [, check CHECK];
/// ```
///
/// where `KIND` is `value` (a field of `TYPE`, its method takes a `TYPE`), `option` (an
/// `Option<TYPE>`, `None` by default, its method sets `Some`) or `text` (an `Option<String>`,
/// its method takes `impl Into<String>`); `PARSER` turns the variable's value (untrimmed) into
/// the field's type; `CHECK` returns the [`SettingError`] `build()` refuses the field's value
/// with. A setting holding a secret must not be simple: `Debug` prints simple values as they are.
macro_rules! settings {
    (
        hand_written new($url:ident) {
            $( $(#[$fattr:meta])* $field:ident: $fty:ty = $fdefault:expr, )*
        }
        hand_written_builder_rows: [$($builder_rows:literal),* $(,)?];
        hand_written_env_rows_first: [$($env_first:literal),* $(,)?];
        simple {
            $(
                $(#[doc = $doc:literal])*
                $kind:ident $name:ident ($arg:ident $(: $argty:ty)?) $(= $default:expr)?,
                $meaning:literal, $default_text:literal
                $(, env $const:ident = $var:literal, $format:literal, $parser:path)?
                $(, check $check:path)?;
            )*
        }
        hand_written_env_rows_last: [$($env_last:literal),* $(,)?];
    ) => {
        /// Everything a [`WorkerBuilder`](crate::WorkerBuilder) holds, as its methods and the
        /// environment set it. The defaults are listed once, on
        /// [`WorkerBuilder`](crate::WorkerBuilder#defaults).
        ///
        /// ```
        /// use redeliver::Worker;
        /// let builder = Worker::builder("amqp://127.0.0.1:5672/%2f").queue("images").prefetch(32);
        /// assert_eq!(builder.settings().queue(), Some("images"));
        /// assert_eq!(builder.settings().prefetch(), Some(32));
        /// assert_eq!(builder.settings().concurrency(), 10);
        /// ```
        #[derive(Clone)]
        pub struct Settings {
            $( $(#[$fattr])* pub(crate) $field: $fty, )*
            $( pub(crate) $name: settings!(@type $kind $($argty)?), )*
        }

        impl Settings {
            pub(crate) fn new($url: String) -> Self {
                Self {
                    $( $field: $fdefault, )*
                    $( $name: settings!(@default $kind $($default)?), )*
                }
            }

            $(
                #[doc = concat!(
                    "[`", stringify!($name), "`](crate::WorkerBuilder::", stringify!($name), "): ",
                    $meaning, ". Default: ", $default_text, "."
                )]
                pub fn $name(&self) -> settings!(@get_type $kind $($argty)?) {
                    settings!(@get $kind self.$name)
                }
            )*

            /// The simple settings' `Debug` fields (none of them is a secret).
            fn debug_simple(&self, d: &mut fmt::DebugStruct<'_, '_>) {
                $( d.field(stringify!($name), &self.$name); )*
            }

            /// The simple settings' checks, run by [`build`](crate::WorkerBuilder::build).
            pub(crate) fn check_simple(&self) -> Result<(), SettingError> {
                $( $( $check(stringify!($name), &self.$name)?; )? )*
                Ok(())
            }

            /// Writes the simple settings' variables that are set.
            pub(crate) fn read_simple_env(
                &mut self,
                var: &dyn Fn(&'static str) -> Result<Option<String>, EnvError>,
            ) -> Result<(), EnvError> {
                $( $(
                    if let Some(v) = read::value(vars::$const, var(vars::$const)?, $parser)? {
                        self.$name = v;
                    }
                )? )*
                Ok(())
            }
        }

        impl crate::WorkerBuilder {
            $(
                $(#[doc = $doc])*
                pub fn $name(mut self, $arg: settings!(@arg_type $kind $($argty)?)) -> Self {
                    self.settings_mut().$name = settings!(@set $kind $arg);
                    self
                }
            )*
        }

        /// The environment variables of the simple settings, re-exported by [`crate::env`].
        pub(crate) mod vars {
            $( $(
                #[doc = concat!(
                    "`", $var, "`: [`", stringify!($name), "`](crate::WorkerBuilder::",
                    stringify!($name), "), ", $meaning, "."
                )]
                pub const $const: &str = $var;
            )? )*

            /// Every variable above, in the table's order.
            pub(crate) const SIMPLE_VARIABLES: &[&str] = &[$( $( $const, )? )*];
        }

        /// The settings table (markdown): one row per builder method, hand-written rows first.
        macro_rules! builder_table {
            () => {
                concat!(
                    "| method | meaning | default | environment |\n",
                    "|---|---|---|---|\n",
                    $( $builder_rows, )*
                    $(
                        "| `.", stringify!($name), "(", stringify!($arg), ")` | ", $meaning,
                        " | ", $default_text, " |", $( " `", $var, "`", )? " |\n",
                    )*
                )
            };
        }
        pub(crate) use builder_table;

        /// The environment table (markdown): one row per variable.
        macro_rules! env_table {
            () => {
                concat!(
                    "| variable | method | meaning | format | default |\n",
                    "|---|---|---|---|---|\n",
                    $( $env_first, )*
                    $( $(
                        "| `", $var, "` | `.", stringify!($name), "(", stringify!($arg), ")` | ",
                        $meaning, " | ", $format, " | ", $default_text, " |\n",
                    )? )*
                    $( $env_last, )*
                )
            };
        }
        pub(crate) use env_table;
    };

    (@type value $t:ty) => { $t };
    (@type option $t:ty) => { Option<$t> };
    (@type text) => { Option<String> };
    (@default value $d:expr) => { $d };
    (@default option) => { None };
    (@default text) => { None };
    (@arg_type value $t:ty) => { $t };
    (@arg_type option $t:ty) => { $t };
    (@arg_type text) => { impl Into<String> };
    (@set value $a:ident) => { $a };
    (@set option $a:ident) => { Some($a) };
    (@set text $a:ident) => { Some($a.into()) };
    (@get_type value $t:ty) => { $t };
    (@get_type option $t:ty) => { Option<$t> };
    (@get_type text) => { Option<&str> };
    (@get value $v:expr) => { $v };
    (@get option $v:expr) => { $v };
    (@get text $v:expr) => { $v.as_deref() };
}

settings! {
    hand_written new(url) {
        url: String = url,
        failover_urls: Vec<String> = Vec::new(),
        topology: Option<Topology> = None,
        delay: Option<DelayConfig> = None,
        policy: RetryPolicy = RetryPolicy::default(),
        reconnect_backoff: Backoff = Backoff::Exponential {
            base: Duration::from_millis(100),
            factor: 2.0,
            cap: Duration::from_secs(30),
        },
        reconnect_jitter: Jitter = Jitter::Full,
        tls: TlsConfig = TlsConfig::new(),
    }
    // The rows of the hand-written settings above, and of the other methods.
    hand_written_builder_rows: [
        "| `Worker::builder(url)` | the broker (`amqps://` for TLS) | required | `AMQP_URL`, `AMQP_URL_FILE`, `AMQP_PASSWORD_FILE` |\n",
        "| `.failover_urls([url, ..])` | more brokers (cluster nodes), tried in turn after `url` when a connect fails or a connection is lost; the backoff pause comes only after a whole round failed | none | `AMQP_URL` (`;`-separated) |\n",
        "| `.topology(Topology)` / `.map_topology(f)` | the queue and its objects, instead of `.queue(name)`'s: `Topology::classic()`, `.bind(exchange, key)`, `.dlq_message_ttl(d)`, `.dlq_max_length(n)`, `.dlq_queue_type(QueueType::Quorum)` (classic by default; quorum on a cluster) | `Topology::new(queue)`: quorum queue, delivery limit 20, `Q.dlx`, `Q.dlq` | |\n",
        "| `.delay(DelayConfig)` | delay levels | the topology's prefix, 10 ms × 24 levels, quorum | |\n",
        "| `.policy(RetryPolicy)` | backoff, jitter, max retries, error classification, retry budget | `RetryPolicy::default()`: `exponential(1 s)`, factor 2, cap 60 s, full jitter, 5 retries | `REDELIVER_MAX_RETRIES`, `REDELIVER_RETRY_BASE`, `REDELIVER_RETRY_CAP` amend it |\n",
        "| `.reconnect_backoff(backoff, jitter)` | reconnect pacing | 100 ms × 2 up to 30 s, full jitter | |\n",
        "| `.tls(TlsConfig)` | TLS for `amqps://` URLs: CA bundle, client certificate, SASL EXTERNAL | the system's root certificates, password login | `REDELIVER_TLS_*` |\n",
        "| `.handler(f)` / `.handler(h)` | the handler | required | |\n",
    ];
    hand_written_env_rows_first: [
        "| `AMQP_URL` | `Worker::builder(url)`, `.failover_urls(..)` | broker; several separated by `;` (as Celery's `broker_url`) are the first URL and its failover URLs (the CLI connects to the first that answers, warning about each that does not); a list mixing `amqps://` and `amqp://` is refused, and a `;` in a password is written `%3B` | `amqp://user:pass@host:5672/%2f` (vhost `/` is `%2f`), `amqps://…:5671/…` for TLS | `amqp://guest:guest@127.0.0.1:5672/%2f` |\n",
        "| `AMQP_URL_FILE` | | instead of `AMQP_URL`: a file holding it (a Kubernetes secret mounted as a file) | path | none |\n",
        "| `AMQP_PASSWORD_FILE` | | the password of every URL, from a file (a URL without a user is an error, not a login as `guest`) | path | none |\n",
        "| `REDELIVER_TLS_CA_FILE` | `.tls(TlsConfig::new().ca_file(p))` | CA certificates trusted next to the system's | PEM file | none |\n",
        "| `REDELIVER_TLS_CERT_FILE`, `REDELIVER_TLS_KEY_FILE` | `TlsConfig::client_cert(cert, key)` | client certificate for mutual TLS (both or neither) | PEM files | none |\n",
        "| `REDELIVER_TLS_SASL_EXTERNAL` | `TlsConfig::sasl_external(yes)` | log in by the client certificate | `true`/`false` | `false` |\n",
    ];
    simple {
        /// The queue to consume, with the default topology (quorum queue, `Q.dlx`, `Q.dlq`,
        /// delivery limit 20, see [`Topology`]). Refine it with [`map_topology`](Self::map_topology),
        /// or pass a whole [`Topology`] with [`topology`](Self::topology) instead.
        text queue(name),
            "the queue to consume, with the default topology", "none: required unless `.topology(..)` is given",
            env QUEUE = "REDELIVER_QUEUE", "a queue name", read::text;
        /// Name prefix for every object (queue, DLX, DLQ and, unless [`delay`](Self::delay) is
        /// given, the delay levels). Applied before [`map_topology`](Self::map_topology)'s functions.
        text prefix(prefix),
            "prefix of every object's name (and of the delay levels' unless `.delay(..)` is given)", "none",
            env PREFIX = "REDELIVER_PREFIX", "text, taken literally", read::literal;
        /// Handlers allowed to run at once. A prefetch below it caps concurrency.
        value concurrency(n: usize) = 10,
            "handlers at once", "10",
            env CONCURRENCY = "REDELIVER_CONCURRENCY", "an integer ≥ 1", read::positive_count,
            check concurrency_in_range;
        /// Per-consumer prefetch (`basic.qos`, `global = false`), applied on every channel the worker
        /// opens. It is the only bound on messages buffered in memory. Must be at least
        /// 1.
        option prefetch(n: u16),
            "unacked deliveries per consumer, the only in-memory bound", "2 × concurrency, at most 65535",
            env PREFETCH = "REDELIVER_PREFETCH", "1..=65535", read::prefetch,
            check prefetch_nonzero;
        /// Per-message handler time limit; a handler that exceeds it is dropped and the message
        /// retried as a transient failure.
        ///
        /// Keep it well below the broker's `consumer_timeout` (30 min by default): a delivery held
        /// longer than that makes the broker close the channel, and every in-flight message of that
        /// channel is redelivered.
        option handler_timeout(d: Duration),
            "per-message time limit, a transient error; keep it below RabbitMQ's `consumer_timeout` (30 min), which closes the channel of a delivery held longer", "none",
            env HANDLER_TIMEOUT = "REDELIVER_HANDLER_TIMEOUT", "a duration, `0s` = none", read::timeout;
        /// How long shutdown waits for in-flight handlers before dropping them (their messages go
        /// back to the queue when the channel closes).
        value shutdown_grace(d: Duration) = Duration::from_secs(25),
            "time in-flight handlers get on shutdown (SIGTERM)", "25 s (below Kubernetes' 30 s `terminationGracePeriodSeconds`)",
            env GRACE_PERIOD = "REDELIVER_GRACE_PERIOD", "a duration: `25s`, `500ms`, `1m 30s`", read::any_duration;
        /// Only verify (passively) that the topology exists instead of declaring it, for
        /// deployments where an operator or the CLI owns the topology.
        value verify_only(yes: bool) = false,
            "passive declares only, for users without configure permission", "`false`: declare the topology",
            env VERIFY_ONLY = "REDELIVER_VERIFY_ONLY", "`true`/`false` (`1`/`0`, `yes`/`no`)", read::flag;
        /// Connection name shown in the management UI (client property `connection_name`).
        text connection_name(name),
            "connection name shown in the management UI", "`redeliver-worker:<queue>`",
            env CONNECTION_NAME = "REDELIVER_CONNECTION_NAME", "text", read::text;
        /// How messages that cannot succeed reach `Q.dlq`; see the modes' trade-offs on
        /// [`DeadLetterMode`].
        ///
        /// ```
        /// use redeliver::{DeadLetterMode, Worker};
        /// let builder = Worker::builder("amqp://127.0.0.1:5672/%2f")
        ///     .queue("images")
        ///     .dead_letter_mode(DeadLetterMode::Annotate);
        /// # let _ = builder;
        /// ```
        value dead_letter_mode(mode: DeadLetterMode) = DeadLetterMode::Reject,
            "how dead letters reach `Q.dlq`: `Reject` (the broker's DLX moves the message, `x-death` says `rejected`) or `Annotate` (the worker publishes it to `Q.dlx` with `x-redeliver-dead-letter-reason`, `-error`, `-attempts`, `x-redeliver-dead-lettered-at`, `-by`, confirmed, then acks the original)", "`Reject`",
            env DEAD_LETTER_MODE = "REDELIVER_DEAD_LETTER_MODE", "`reject` or `annotate`", read::from_str;
        /// Where retries wait: the delay levels, the queue itself (RabbitMQ 4.3+ quorum queues,
        /// over AMQP 1.0), or the second where it works; see [`RetryMode`].
        value retry_mode(mode: RetryMode) = RetryMode::Levels,
            "where retries wait: `Levels` (TTL delay levels), `Native` (the quorum queue holds them, RabbitMQ 4.3+, over AMQP 1.0) or `Auto` (native where it works)", "`Levels`",
            env RETRY_MODE = "REDELIVER_RETRY_MODE", "`levels`, `native` or `auto`", read::from_str;
        /// How often the worker itself gives one message back to its queue, because the broker did
        /// not confirm the copy that would have replaced it (a retry copy, a repaired copy), before
        /// it dead-letters the message instead (reason `requeue_limit`). Each requeue waits 1 s.
        ///
        /// Before RabbitMQ 4.3 a quorum queue counted these requeues toward its delivery limit; from
        /// 4.3 it does not, and a classic queue never did, so without this bound a copy that can
        /// never be confirmed would cycle forever.
        value requeue_limit(n: u32) = 10,
            "how often the worker gives one message back to its queue because the broker did not confirm its retry (or repaired) copy, 1 s apart, before it dead-letters it instead (reason `requeue_limit`)", "10";
        /// Largest body the worker publishes (retry and repaired copies); a larger copy is refused
        /// before it reaches the broker, and its original dead-lettered with reason `too_large`.
        /// Set it when the broker's `max_message_size` is not its version's default.
        option max_message_size(bytes: usize),
            "largest body the worker publishes; a retry copy over it dead-letters the original (reason `too_large`) instead of failing forever", "the broker version's default: 16 MiB from RabbitMQ 4.0, 128 MiB before";
        /// How long the worker waits for the broker to confirm a copy it publishes (a retry copy, a
        /// repaired copy, an annotated dead letter), and for the broker to unblock its publishing
        /// connection during a resource alarm, before it gives the original back to the queue (as
        /// when the copy is refused). Copies go out on a connection of their own, so a blocked
        /// publish never holds up the acks of successful deliveries. Requeues while the broker
        /// blocks the connection do not count toward the [`requeue_limit`](Self::requeue_limit):
        /// an alarm is not the message's fault.
        value confirm_timeout(d: Duration) = Duration::from_secs(30),
            "longest wait for the broker to confirm a copy (retry, dead letter) or to unblock publishing, before the original goes back to the queue", "30 s",
            env CONFIRM_TIMEOUT = "REDELIVER_CONFIRM_TIMEOUT", "a positive duration", read::positive_duration,
            check positive;
        /// How often the running worker checks that its topology still exists (`Q.dlx`, `Q.dlq`,
        /// `Q`, and the delay infrastructure: its levels and the parking queue of retries whose queue
        /// is gone), declares again what was deleted (unless [`verify_only`](Self::verify_only)),
        /// and measures the parking queue (metric `redeliver_delay_unroutable_messages`). Without the
        /// parking queue, such a retry would be dropped; without `Q.dlx`, the broker drops (classic
        /// `Q`) or holds (quorum `Q`) dead letters, silently. The interval bounds that window.
        value topology_check_interval(d: Duration) = Duration::from_secs(30),
            "how often the running worker checks its topology and the delay infrastructure, and declares again what was deleted", "30 s",
            check positive;
    }
    hand_written_env_rows_last: [
        "| `REDELIVER_MAX_RETRIES` | `.policy(..)` | retries before the DLQ (amends the builder's policy) | integer | the policy's |\n",
        "| `REDELIVER_RETRY_BASE` | `.policy(..)` | first backoff delay: the base of an exponential or linear backoff, the delay of a constant one; refused for a fixed schedule, which has none (amends the builder's policy) | a duration (`200ms`) | the policy's |\n",
        "| `REDELIVER_RETRY_CAP` | `.policy(..)` | largest backoff delay (amends the builder's policy) | a duration (`30s`) | the policy's |\n",
        "| `REDELIVER_HEALTH_ADDR` | `ServiceSettings::health_addr` | health server `/livez` `/readyz` `/metrics` | `0.0.0.0:8080`, `[::1]:8080`, or a bare port `8080` for every IPv4 and IPv6 address | off |\n",
        "| `REDELIVER_LOG_FORMAT` | `ServiceSettings::log_format` | log lines | `json` or `pretty` | `pretty` |\n",
        "| `RUST_LOG` | `ServiceSettings::log_filter` | log filter | `tracing` directives | `info` |\n",
    ];
}

/// [`concurrency`](crate::WorkerBuilder::concurrency) from 1 to [`Permits::MAX`].
fn concurrency_in_range(_name: &'static str, n: &usize) -> Result<(), SettingError> {
    if *n == 0 || *n > Permits::MAX {
        return Err(SettingError::Concurrency {
            got: *n,
            max: Permits::MAX,
        });
    }
    Ok(())
}

/// A prefetch of 0 means "unlimited" to the broker, and lapin buffers deliveries without bound.
fn prefetch_nonzero(_name: &'static str, n: &Option<u16>) -> Result<(), SettingError> {
    match n {
        Some(0) => Err(SettingError::Prefetch),
        _ => Ok(()),
    }
}

/// A duration that must be more than zero (a zero timeout or interval would spin).
fn positive(name: &'static str, d: &Duration) -> Result<(), SettingError> {
    if d.is_zero() {
        return Err(SettingError::Zero(name));
    }
    Ok(())
}

impl Settings {
    /// The first broker URL (it may hold a password: log [`Settings`]' `Debug`, which masks it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URLs tried after [`url`](Self::url).
    pub fn failover_urls(&self) -> &[String] {
        &self.failover_urls
    }

    /// The topology given to [`topology`](crate::WorkerBuilder::topology), if any.
    pub fn topology(&self) -> Option<&Topology> {
        self.topology.as_ref()
    }

    /// The delay settings given to [`delay`](crate::WorkerBuilder::delay), if any.
    pub fn delay(&self) -> Option<&DelayConfig> {
        self.delay.as_ref()
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Pacing of reconnect attempts.
    pub fn reconnect_backoff(&self) -> (&Backoff, Jitter) {
        (&self.reconnect_backoff, self.reconnect_jitter)
    }

    /// The pauses of the reconnect loop: [`reconnect_backoff`](Self::reconnect_backoff) as an
    /// iterator of delays.
    pub(crate) fn reconnect_delays(&self) -> Delays {
        self.reconnect_backoff.delays(self.reconnect_jitter)
    }

    /// TLS settings for `amqps://` URLs.
    pub fn tls(&self) -> &TlsConfig {
        &self.tls
    }
}

impl fmt::Debug for Settings {
    // By hand, so that logging the settings never prints the broker password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Settings");
        d.field("url", &url::redact(&self.url))
            .field(
                "failover_urls",
                &self
                    .failover_urls
                    .iter()
                    .map(|u| url::redact(u))
                    .collect::<Vec<_>>(),
            )
            .field("topology", &self.topology)
            .field("delay", &self.delay)
            .field("policy", &self.policy)
            .field("reconnect_backoff", &self.reconnect_backoff)
            .field("reconnect_jitter", &self.reconnect_jitter)
            .field("tls", &self.tls);
        self.debug_simple(&mut d);
        d.finish()
    }
}

/// What [`WorkerBuilder::build`](crate::WorkerBuilder::build) made of the settings: the settings
/// themselves, and only what is derived from them (URLs parsed, the final topology and its
/// queue's name) or is not a setting (the handler). Shared by the worker's sessions and
/// deliveries; defaults that depend on other settings are methods, not copies.
pub(crate) struct Resolved {
    pub(crate) settings: Settings,
    /// The first URL, then the failover URLs; never empty.
    pub(crate) urls: Vec<BrokerUrl>,
    pub(crate) topology: Topology,
    /// The topology's full queue name (prefix included), computed once and shared by the
    /// sessions' rules and every delivery's context.
    pub(crate) queue: Arc<str>,
    pub(crate) handler: Arc<dyn ErasedHandler>,
}

impl Resolved {
    /// [`Settings::prefetch`], or its default: twice the concurrency, at most 65535.
    pub(crate) fn prefetch(&self) -> u16 {
        let concurrency = self.settings.concurrency;
        self.settings
            .prefetch
            .unwrap_or_else(|| u16::try_from(concurrency.saturating_mul(2)).unwrap_or(u16::MAX))
    }

    /// [`Settings::connection_name`], or its default `redeliver-worker:<queue>`.
    pub(crate) fn connection_name(&self) -> String {
        match &self.settings.connection_name {
            Some(name) => name.clone(),
            None => format!("redeliver-worker:{}", self.queue),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's tables are these ones: on a mismatch, paste what this prints.
    #[test]
    fn the_readme_shows_the_generated_tables() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
        let readme = std::fs::read_to_string(path).expect("the workspace's README");
        let mut stale = String::new();
        for (name, table) in [
            ("builder (## Configuration)", builder_table!()),
            ("environment (### Environment variables)", env_table!()),
        ] {
            if !readme.contains(table) {
                stale += &format!("the README's {name} table should read:\n\n{table}\n");
            }
        }
        assert!(stale.is_empty(), "{stale}");
    }

    /// Every variable the environment layer reads has its row, and every row its variable.
    #[test]
    fn the_environment_table_lists_every_variable() {
        let table = env_table!();
        let rows: Vec<&str> = table.lines().skip(2).collect();
        for var in crate::env::VARIABLES {
            let cell = format!("`{var}`");
            assert!(
                rows.iter()
                    .any(|r| r.split(" | ").next().is_some_and(|c| c.contains(&cell))),
                "{var} has no row"
            );
        }
        for row in rows {
            let first = row.split(" | ").next().unwrap_or_default();
            assert!(
                crate::env::VARIABLES
                    .iter()
                    .any(|v| first.contains(&format!("`{v}`"))),
                "row without its variable in env::VARIABLES: {row}"
            );
        }
        let mut sorted = crate::env::VARIABLES.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            crate::env::VARIABLES.len(),
            "a variable twice"
        );
    }

    #[test]
    fn one_default_retry_policy() {
        let worker = Settings::new(String::new());
        assert_eq!(
            format!("{:?}", worker.policy()),
            format!("{:?}", RetryPolicy::default())
        );
        assert_eq!(
            RetryPolicy::default().configured_backoff().base(),
            Duration::from_secs(1)
        );
    }
}
