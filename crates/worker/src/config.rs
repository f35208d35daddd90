//! Configuration from environment variables, for containers: the same settings as the
//! [`WorkerBuilder`] methods, read from the variables below and applied on top of a builder.
//!
//! | variable | builder method / use | format | default |
//! |---|---|---|---|
//! | `AMQP_URL` | [`Worker::builder`], then [`failover_urls`](WorkerBuilder::failover_urls) | `amqp://user:pass@host:5672/vhost` (vhost `/` is `%2f`); several separated by `;` (as Celery's `broker_url`) | `amqp://guest:guest@127.0.0.1:5672/%2f` |
//! | `AMQP_URL_FILE` | instead of `AMQP_URL`: a file holding it (a Kubernetes secret mounted as a file) | path | none |
//! | `AMQP_PASSWORD_FILE` | the password of every `AMQP_URL`, from a file (the URL then carries none) | path | none |
//! | `REDELIVER_TLS_CA_FILE` | [`tls`](WorkerBuilder::tls): [`TlsConfig::ca_file`] | PEM file of CA certificates, trusted next to the system's | none |
//! | `REDELIVER_TLS_CERT_FILE`, `REDELIVER_TLS_KEY_FILE` | [`TlsConfig::client_cert`] (mutual TLS; both or neither) | PEM files | none |
//! | `REDELIVER_TLS_SASL_EXTERNAL` | [`TlsConfig::sasl_external`] | `true`/`false` | `false` |
//! | `REDELIVER_QUEUE` | [`queue`](WorkerBuilder::queue) | queue name | the one set in code |
//! | `REDELIVER_PREFIX` | [`prefix`](WorkerBuilder::prefix) | name prefix of every object | none |
//! | `REDELIVER_PREFETCH` | [`prefetch`](WorkerBuilder::prefetch) | integer 1..=65535 | 2 × concurrency |
//! | `REDELIVER_CONCURRENCY` | [`concurrency`](WorkerBuilder::concurrency) | integer ≥ 1 | 10 |
//! | `REDELIVER_GRACE_PERIOD_SECS` | [`shutdown_grace`](WorkerBuilder::shutdown_grace) | seconds (decimals allowed) | 25 |
//! | `REDELIVER_HANDLER_TIMEOUT_SECS` | [`handler_timeout`](WorkerBuilder::handler_timeout) | seconds; `0` = none | none |
//! | `REDELIVER_VERIFY_ONLY` | [`verify_only`](WorkerBuilder::verify_only) | `true`/`false` (`1`/`0`, `yes`/`no`) | `false` |
//! | `REDELIVER_DEAD_LETTER_MODE` | [`dead_letter_mode`](WorkerBuilder::dead_letter_mode) | `reject` or `annotate` ([`DeadLetterMode`](crate::DeadLetterMode)) | `reject` |
//! | `REDELIVER_CONNECTION_NAME` | [`connection_name`](WorkerBuilder::connection_name) | text | `redeliver-worker:<queue>` |
//! | `REDELIVER_MAX_RETRIES` | [`Config::policy`] → [`RetryPolicy::max_retries`] | integer | the policy's |
//! | `REDELIVER_RETRY_BASE_MS` | [`Config::policy`] → [`RetryPolicy::base`] | milliseconds | the policy's |
//! | `REDELIVER_RETRY_CAP_MS` | [`Config::policy`] → [`RetryPolicy::cap`] | milliseconds | the policy's |
//! | `REDELIVER_HEALTH_ADDR` | [`Config::health_addr`] → [`health`](crate::health) server | `0.0.0.0:8080`, or a bare port `8080` | off |
//! | `REDELIVER_LOG_FORMAT` | [`Config::log_format`] | `json` or `pretty` | `pretty` |
//! | `RUST_LOG` | [`Config::log_filter`] | `tracing` filter directives | `info` |
//!
//! An empty variable counts as unset (manifests often template `value: ""`). A bad value is an
//! error naming the variable, its value and what was expected, so a misconfigured pod fails at
//! startup instead of running with a default nobody chose.
//!
//! The worker crate does not install a logger: [`Config::log_format`] and [`Config::log_filter`]
//! tell the service how to set up `tracing-subscriber` (the `image_processing` example shows it).
//!
//! ```no_run
//! use std::time::Duration;
//! use redeliver_worker::config::Config;
//! use redeliver_worker::{Context, HandlerError, Raw, RetryPolicy};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = Config::from_env()?;
//! config
//!     // Code sets the defaults; the environment overrides them.
//!     .apply(redeliver_worker::Worker::builder(&config.amqp_url).queue("images"))
//!     .policy(config.policy(RetryPolicy::exponential(Duration::from_millis(200)).max_retries(5)))
//!     .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
//!     .run_until_signal()
//!     .await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use redeliver_amqp::url::{self, BrokerUrl};
use redeliver_amqp::TlsConfig;
use redeliver_core::RetryPolicy;

use crate::{Worker, WorkerBuilder};

/// `AMQP_URL`: the broker URL, or several separated by `;` (cluster nodes, tried in turn).
pub const AMQP_URL: &str = "AMQP_URL";
/// `AMQP_URL_FILE`: a file holding what `AMQP_URL` would (mutually exclusive with it).
pub const AMQP_URL_FILE: &str = "AMQP_URL_FILE";
/// `AMQP_PASSWORD_FILE`: a file holding the broker password, put into every URL.
pub const AMQP_PASSWORD_FILE: &str = "AMQP_PASSWORD_FILE";
/// `REDELIVER_TLS_CA_FILE`: CA certificates (PEM) to trust for `amqps://`.
pub const TLS_CA_FILE: &str = "REDELIVER_TLS_CA_FILE";
/// `REDELIVER_TLS_CERT_FILE`: client certificate (PEM) for mutual TLS.
pub const TLS_CERT_FILE: &str = "REDELIVER_TLS_CERT_FILE";
/// `REDELIVER_TLS_KEY_FILE`: the client certificate's private key (PEM).
pub const TLS_KEY_FILE: &str = "REDELIVER_TLS_KEY_FILE";
/// `REDELIVER_TLS_SASL_EXTERNAL`: log in with the client certificate (SASL EXTERNAL).
pub const TLS_SASL_EXTERNAL: &str = "REDELIVER_TLS_SASL_EXTERNAL";
/// `REDELIVER_DEAD_LETTER_MODE`: `reject` (default) or `annotate`.
pub const DEAD_LETTER_MODE: &str = "REDELIVER_DEAD_LETTER_MODE";
/// `REDELIVER_QUEUE`: the queue to consume.
pub const QUEUE: &str = "REDELIVER_QUEUE";
/// `REDELIVER_PREFIX`: prefix of every object's name.
pub const PREFIX: &str = "REDELIVER_PREFIX";
/// `REDELIVER_PREFETCH`: per-consumer prefetch.
pub const PREFETCH: &str = "REDELIVER_PREFETCH";
/// `REDELIVER_CONCURRENCY`: handlers running at once.
pub const CONCURRENCY: &str = "REDELIVER_CONCURRENCY";
/// `REDELIVER_GRACE_PERIOD_SECS`: shutdown grace period.
pub const GRACE_PERIOD_SECS: &str = "REDELIVER_GRACE_PERIOD_SECS";
/// `REDELIVER_HANDLER_TIMEOUT_SECS`: per-message handler time limit.
pub const HANDLER_TIMEOUT_SECS: &str = "REDELIVER_HANDLER_TIMEOUT_SECS";
/// `REDELIVER_VERIFY_ONLY`: verify the topology instead of declaring it.
pub const VERIFY_ONLY: &str = "REDELIVER_VERIFY_ONLY";
/// `REDELIVER_CONNECTION_NAME`: connection name shown in the management UI.
pub const CONNECTION_NAME: &str = "REDELIVER_CONNECTION_NAME";
/// `REDELIVER_MAX_RETRIES`: retries per message before dead-lettering.
pub const MAX_RETRIES: &str = "REDELIVER_MAX_RETRIES";
/// `REDELIVER_RETRY_BASE_MS`: first backoff delay.
pub const RETRY_BASE_MS: &str = "REDELIVER_RETRY_BASE_MS";
/// `REDELIVER_RETRY_CAP_MS`: largest backoff delay.
pub const RETRY_CAP_MS: &str = "REDELIVER_RETRY_CAP_MS";
/// `REDELIVER_HEALTH_ADDR`: listen address of the health server.
pub const HEALTH_ADDR: &str = "REDELIVER_HEALTH_ADDR";
/// `REDELIVER_LOG_FORMAT`: `json` or `pretty`.
pub const LOG_FORMAT: &str = "REDELIVER_LOG_FORMAT";
/// `RUST_LOG`: log filter.
pub const RUST_LOG: &str = "RUST_LOG";

/// Every variable [`Config::from_env`] reads.
pub const VARIABLES: &[&str] = &[
    AMQP_URL,
    AMQP_URL_FILE,
    AMQP_PASSWORD_FILE,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    TLS_SASL_EXTERNAL,
    DEAD_LETTER_MODE,
    QUEUE,
    PREFIX,
    PREFETCH,
    CONCURRENCY,
    GRACE_PERIOD_SECS,
    HANDLER_TIMEOUT_SECS,
    VERIFY_ONLY,
    CONNECTION_NAME,
    MAX_RETRIES,
    RETRY_BASE_MS,
    RETRY_CAP_MS,
    HEALTH_ADDR,
    LOG_FORMAT,
    RUST_LOG,
];

/// Default of `AMQP_URL`: a local broker with the default account.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default of `RUST_LOG`.
pub const DEFAULT_LOG_FILTER: &str = "info";

/// A variable with a value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {var}={value:?}: {reason}")]
pub struct ConfigError {
    var: &'static str,
    value: String,
    reason: String,
}

impl ConfigError {
    fn new(var: &'static str, value: &str, reason: impl Into<String>) -> Self {
        Self {
            var,
            value: value.to_owned(),
            reason: reason.into(),
        }
    }

    /// The variable's name.
    pub fn var(&self) -> &'static str {
        self.var
    }

    /// The value found (a URL's password is masked).
    pub fn value(&self) -> &str {
        &self.value
    }

    /// What was expected.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// Log output format, from `REDELIVER_LOG_FORMAT`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Pretty,
    /// One JSON object per line, for log collectors.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "pretty" | "text" => Ok(LogFormat::Pretty),
            "json" => Ok(LogFormat::Json),
            _ => Err("expected `json` or `pretty`".into()),
        }
    }
}

/// Settings read from the environment. Fields left `None` were not set, so the builder's own
/// default (or what the code set) stays.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// `AMQP_URL` (validated); the first URL when it lists several.
    pub amqp_url: String,
    /// The other URLs `AMQP_URL` lists after the first (validated), for
    /// [`failover_urls`](WorkerBuilder::failover_urls); usually empty.
    pub failover_urls: Vec<String>,
    /// `REDELIVER_TLS_*`; the default when none is set.
    pub tls: TlsConfig,
    /// `REDELIVER_DEAD_LETTER_MODE`.
    pub dead_letter_mode: Option<crate::DeadLetterMode>,
    /// `REDELIVER_QUEUE`.
    pub queue: Option<String>,
    /// `REDELIVER_PREFIX`.
    pub prefix: Option<String>,
    /// `REDELIVER_PREFETCH`.
    pub prefetch: Option<u16>,
    /// `REDELIVER_CONCURRENCY`.
    pub concurrency: Option<usize>,
    /// `REDELIVER_GRACE_PERIOD_SECS`.
    pub shutdown_grace: Option<Duration>,
    /// `REDELIVER_HANDLER_TIMEOUT_SECS` (`0` reads as `None`).
    pub handler_timeout: Option<Duration>,
    /// `REDELIVER_VERIFY_ONLY`.
    pub verify_only: Option<bool>,
    /// `REDELIVER_CONNECTION_NAME`.
    pub connection_name: Option<String>,
    /// `REDELIVER_MAX_RETRIES`.
    pub max_retries: Option<u32>,
    /// `REDELIVER_RETRY_BASE_MS`.
    pub retry_base: Option<Duration>,
    /// `REDELIVER_RETRY_CAP_MS`.
    pub retry_cap: Option<Duration>,
    /// `REDELIVER_HEALTH_ADDR`; `None` means no health server.
    pub health_addr: Option<SocketAddr>,
    /// `REDELIVER_LOG_FORMAT`.
    pub log_format: LogFormat,
    /// `RUST_LOG`, or [`DEFAULT_LOG_FILTER`].
    pub log_filter: String,
}

impl Default for Config {
    /// What an empty environment gives.
    fn default() -> Self {
        Self {
            amqp_url: DEFAULT_AMQP_URL.to_owned(),
            failover_urls: Vec::new(),
            tls: TlsConfig::new(),
            dead_letter_mode: None,
            queue: None,
            prefix: None,
            prefetch: None,
            concurrency: None,
            shutdown_grace: None,
            handler_timeout: None,
            verify_only: None,
            connection_name: None,
            max_retries: None,
            retry_base: None,
            retry_cap: None,
            health_addr: None,
            log_format: LogFormat::default(),
            log_filter: DEFAULT_LOG_FILTER.to_owned(),
        }
    }
}

impl fmt::Debug for Config {
    // By hand, so that logging the configuration never prints the broker password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("amqp_url", &url::redact(&self.amqp_url))
            .field(
                "failover_urls",
                &self
                    .failover_urls
                    .iter()
                    .map(|u| url::redact(u))
                    .collect::<Vec<_>>(),
            )
            .field("tls", &self.tls)
            .field("dead_letter_mode", &self.dead_letter_mode)
            .field("queue", &self.queue)
            .field("prefix", &self.prefix)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("handler_timeout", &self.handler_timeout)
            .field("verify_only", &self.verify_only)
            .field("connection_name", &self.connection_name)
            .field("max_retries", &self.max_retries)
            .field("retry_base", &self.retry_base)
            .field("retry_cap", &self.retry_cap)
            .field("health_addr", &self.health_addr)
            .field("log_format", &self.log_format)
            .field("log_filter", &self.log_filter)
            .finish()
    }
}

impl Config {
    /// Reads the [variables](self) from the process environment.
    ///
    /// # Errors
    ///
    /// The first variable whose value is not valid (not Unicode included).
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_source(|name| match std::env::var(name) {
            Ok(v) => Ok(Some(v)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(raw)) => Err(ConfigError::new(
                name_of(name),
                &raw.to_string_lossy(),
                "not valid Unicode",
            )),
        })
    }

    /// Reads the [variables](self) through `lookup` instead of the environment (tests, or a
    /// configuration source of your own).
    ///
    /// ```
    /// use redeliver_worker::config::{Config, LogFormat};
    /// let vars = [("REDELIVER_PREFETCH", "64"), ("REDELIVER_LOG_FORMAT", "json")];
    /// let cfg = Config::from_lookup(|name| {
    ///     vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    /// })
    /// .unwrap();
    /// assert_eq!(cfg.prefetch, Some(64));
    /// assert_eq!(cfg.log_format, LogFormat::Json);
    ///
    /// let err = Config::from_lookup(|name| (name == "REDELIVER_CONCURRENCY").then(|| "lots".into()))
    ///     .unwrap_err();
    /// assert_eq!(err.var(), "REDELIVER_CONCURRENCY");
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        Self::from_source(|name| Ok(lookup(name)))
    }

    fn from_source(
        get: impl Fn(&'static str) -> Result<Option<String>, ConfigError>,
    ) -> Result<Self, ConfigError> {
        // Empty means unset: templated manifests often render a missing value as "".
        let var = |name: &'static str| -> Result<Option<String>, ConfigError> {
            Ok(get(name)?.filter(|v| !v.trim().is_empty()))
        };
        let mut cfg = Config::default();
        let file = |name: &'static str, what: &'static str, path: String| {
            url::read_secret_file(what, std::path::Path::new(&path))
                .map_err(|e| ConfigError::new(name, &path, e.to_string()))
        };
        let (url_var, mut urls) = match (var(AMQP_URL)?, var(AMQP_URL_FILE)?) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    AMQP_URL_FILE,
                    "(set)",
                    "set AMQP_URL or AMQP_URL_FILE, not both",
                ))
            }
            (Some(v), None) => (AMQP_URL, Some(v)),
            (None, Some(path)) => (
                AMQP_URL_FILE,
                Some(file(AMQP_URL_FILE, "the broker URL", path)?),
            ),
            (None, None) => (AMQP_URL, None),
        };
        if let Some(path) = var(AMQP_PASSWORD_FILE)? {
            let password = file(AMQP_PASSWORD_FILE, "the broker password", path)?;
            let base = urls.unwrap_or_else(|| DEFAULT_AMQP_URL.to_owned());
            urls = Some(url::with_password(&base, &password));
        }
        if let Some(value) = urls {
            // Parsing refuses amqps:// in a build without TLS, and never echoes a password.
            let parsed = BrokerUrl::parse_list(&value).map_err(|e| {
                ConfigError::new(
                    url_var,
                    &url::redact(&value),
                    format!("{e}; several URLs are separated by `;`"),
                )
            })?;
            let mut raw: Vec<String> = url::split_list(&value)
                .into_iter()
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_owned)
                .collect();
            debug_assert_eq!(raw.len(), parsed.len());
            cfg.amqp_url = raw.remove(0);
            cfg.failover_urls = raw;
        }
        let mut tls = TlsConfig::new();
        if let Some(p) = var(TLS_CA_FILE)? {
            tls = tls.ca_file(p.trim());
        }
        match (var(TLS_CERT_FILE)?, var(TLS_KEY_FILE)?) {
            (Some(c), Some(k)) => tls = tls.client_cert(c.trim(), k.trim()),
            (None, None) => {}
            (Some(c), None) => {
                return Err(ConfigError::new(
                    TLS_CERT_FILE,
                    &c,
                    "also set REDELIVER_TLS_KEY_FILE (the certificate's private key)",
                ))
            }
            (None, Some(k)) => {
                return Err(ConfigError::new(
                    TLS_KEY_FILE,
                    &k,
                    "also set REDELIVER_TLS_CERT_FILE (the client certificate)",
                ))
            }
        }
        if let Some(yes) = parse(TLS_SASL_EXTERNAL, var(TLS_SASL_EXTERNAL)?, boolean)? {
            tls = tls.sasl_external(yes);
        }
        cfg.tls = tls;
        cfg.dead_letter_mode = parse(DEAD_LETTER_MODE, var(DEAD_LETTER_MODE)?, |v| v.parse())?;
        cfg.queue = var(QUEUE)?.map(|v| v.trim().to_owned());
        // Not trimmed: a prefix is taken literally (it may end with a separator like `-`).
        cfg.prefix = var(PREFIX)?;
        cfg.prefetch = parse(PREFETCH, var(PREFETCH)?, |v| match v.parse::<u16>() {
            Ok(0) | Err(_) => Err("expected an integer from 1 to 65535".to_owned()),
            Ok(n) => Ok(n),
        })?;
        cfg.concurrency = parse(CONCURRENCY, var(CONCURRENCY)?, |v| {
            match v.parse::<usize>() {
                Ok(0) | Err(_) => Err("expected an integer of at least 1".to_owned()),
                Ok(n) => Ok(n),
            }
        })?;
        cfg.shutdown_grace = parse(GRACE_PERIOD_SECS, var(GRACE_PERIOD_SECS)?, seconds)?;
        cfg.handler_timeout = parse(HANDLER_TIMEOUT_SECS, var(HANDLER_TIMEOUT_SECS)?, seconds)?
            .filter(|d| !d.is_zero());
        cfg.verify_only = parse(VERIFY_ONLY, var(VERIFY_ONLY)?, boolean)?;
        cfg.connection_name = var(CONNECTION_NAME)?.map(|v| v.trim().to_owned());
        cfg.max_retries = parse(MAX_RETRIES, var(MAX_RETRIES)?, |v| {
            v.parse::<u32>()
                .map_err(|_| "expected a non-negative integer".to_owned())
        })?;
        cfg.retry_base = parse(RETRY_BASE_MS, var(RETRY_BASE_MS)?, millis)?;
        cfg.retry_cap = parse(RETRY_CAP_MS, var(RETRY_CAP_MS)?, millis)?;
        cfg.health_addr = parse(HEALTH_ADDR, var(HEALTH_ADDR)?, socket_addr)?;
        if let Some(v) = var(LOG_FORMAT)? {
            cfg.log_format = v
                .parse()
                .map_err(|reason: String| ConfigError::new(LOG_FORMAT, &v, reason))?;
        }
        if let Some(v) = var(RUST_LOG)? {
            cfg.log_filter = v;
        }
        Ok(cfg)
    }

    /// A builder for [`amqp_url`](Self::amqp_url) with the settings applied:
    /// `apply(Worker::builder(&self.amqp_url))`.
    pub fn builder(&self) -> WorkerBuilder {
        self.apply(Worker::builder(self.amqp_url.clone()))
    }

    /// Applies the settings that are set to `builder`, overriding what it had: TLS, dead-letter
    /// mode, failover URLs,
    /// queue, prefix, prefetch, concurrency, grace period, handler timeout, verify-only and
    /// connection name.
    /// Setters called after this win over the environment.
    ///
    /// Not applied: the first URL (given to [`Worker::builder`]), the retry settings (use
    /// [`policy`](Self::policy), since a builder's policy cannot be read back and amended), the
    /// health address and the log settings (process-wide, for the service to use). A
    /// `REDELIVER_QUEUE` has no effect on a builder given a whole
    /// [`topology`](WorkerBuilder::topology), which names its own queue.
    pub fn apply(&self, mut builder: WorkerBuilder) -> WorkerBuilder {
        if self.tls.is_configured() {
            builder = builder.tls(self.tls.clone());
        }
        if let Some(mode) = self.dead_letter_mode {
            builder = builder.dead_letter_mode(mode);
        }
        if !self.failover_urls.is_empty() {
            builder = builder.failover_urls(self.failover_urls.clone());
        }
        if let Some(q) = &self.queue {
            builder = builder.queue(q.clone());
        }
        if let Some(p) = &self.prefix {
            builder = builder.prefix(p.clone());
        }
        if let Some(n) = self.prefetch {
            builder = builder.prefetch(n);
        }
        if let Some(n) = self.concurrency {
            builder = builder.concurrency(n);
        }
        if let Some(d) = self.shutdown_grace {
            builder = builder.shutdown_grace(d);
        }
        if let Some(d) = self.handler_timeout {
            builder = builder.handler_timeout(d);
        }
        if let Some(v) = self.verify_only {
            builder = builder.verify_only(v);
        }
        if let Some(n) = &self.connection_name {
            builder = builder.connection_name(n.clone());
        }
        builder
    }

    /// `policy` with the retry settings that are set (`REDELIVER_MAX_RETRIES`,
    /// `REDELIVER_RETRY_BASE_MS`, `REDELIVER_RETRY_CAP_MS`) applied.
    ///
    /// ```
    /// use std::time::Duration;
    /// use redeliver_worker::config::Config;
    /// use redeliver_worker::RetryPolicy;
    /// let cfg = Config::from_lookup(|n| (n == "REDELIVER_MAX_RETRIES").then(|| "7".into())).unwrap();
    /// let p = cfg.policy(RetryPolicy::exponential(Duration::from_millis(100)).max_retries(3));
    /// assert_eq!(p.configured_max_retries(), 7);
    /// ```
    pub fn policy(&self, mut policy: RetryPolicy) -> RetryPolicy {
        if let Some(n) = self.max_retries {
            policy = policy.max_retries(n);
        }
        if let Some(d) = self.retry_base {
            policy = policy.base(d);
        }
        if let Some(d) = self.retry_cap {
            policy = policy.cap(d);
        }
        policy
    }

    /// The URL with its password masked, for logs.
    pub fn redacted_url(&self) -> String {
        url::redact(&self.amqp_url)
    }
}

impl WorkerBuilder {
    /// A builder configured from the environment: [`Config::from_env`], then
    /// [`Config::builder`]. Set the queue and handler in code as usual (an environment
    /// `REDELIVER_QUEUE` is overridden by a later [`queue`](Self::queue) call, so set the code
    /// default first with [`Config::apply`] if the environment should win).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use redeliver_worker::{Context, HandlerError, Raw, WorkerBuilder};
    /// WorkerBuilder::from_env()?
    ///     .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
    ///     .run_until_signal()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// See [`Config::from_env`].
    pub fn from_env() -> Result<WorkerBuilder, ConfigError> {
        Ok(Config::from_env()?.builder())
    }
}

/// Maps a name back to its `&'static str` constant (the environment callback gets `&str`).
fn name_of(name: &str) -> &'static str {
    VARIABLES
        .iter()
        .copied()
        .find(|v| *v == name)
        .unwrap_or("environment variable")
}

fn parse<T>(
    var: &'static str,
    value: Option<String>,
    f: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, ConfigError> {
    match value {
        None => Ok(None),
        Some(v) => f(v.trim())
            .map(Some)
            .map_err(|reason| ConfigError::new(var, &v, reason)),
    }
}

fn seconds(v: &str) -> Result<Duration, String> {
    let expected = "expected a non-negative number of seconds, like 25 or 0.5";
    let secs: f64 = v.parse().map_err(|_| expected.to_owned())?;
    Duration::try_from_secs_f64(secs).map_err(|_| expected.to_owned())
}

fn millis(v: &str) -> Result<Duration, String> {
    v.parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| "expected a whole number of milliseconds".to_owned())
}

fn boolean(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err("expected true or false".to_owned()),
    }
}

fn socket_addr(v: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = v.parse::<u16>() {
        return Ok(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)));
    }
    v.parse::<SocketAddr>()
        .map_err(|_| "expected an address like 0.0.0.0:8080 (or a bare port like 8080)".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::from_lookup(move |name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn empty_environment_gives_defaults() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.amqp_url, DEFAULT_AMQP_URL);
        assert_eq!(c.health_addr, None);
        assert_eq!(c.log_format, LogFormat::Pretty);
        assert_eq!(c.log_filter, "info");
    }

    #[test]
    fn every_variable_is_read() {
        let c = cfg(&[
            (AMQP_URL, "amqp://u:p@rabbitmq:5672/%2f"),
            (QUEUE, "images"),
            (PREFIX, "eu-"),
            (PREFETCH, "64"),
            (CONCURRENCY, "16"),
            (GRACE_PERIOD_SECS, "25"),
            (HANDLER_TIMEOUT_SECS, "1.5"),
            (VERIFY_ONLY, "yes"),
            (CONNECTION_NAME, "pod-1"),
            (MAX_RETRIES, "4"),
            (RETRY_BASE_MS, "200"),
            (RETRY_CAP_MS, "30000"),
            (HEALTH_ADDR, "0.0.0.0:8080"),
            (LOG_FORMAT, "JSON"),
            (RUST_LOG, "debug,lapin=warn"),
        ])
        .unwrap();
        assert_eq!(c.amqp_url, "amqp://u:p@rabbitmq:5672/%2f");
        assert_eq!(c.queue.as_deref(), Some("images"));
        assert_eq!(c.prefix.as_deref(), Some("eu-"));
        assert_eq!(c.prefetch, Some(64));
        assert_eq!(c.concurrency, Some(16));
        assert_eq!(c.shutdown_grace, Some(Duration::from_secs(25)));
        assert_eq!(c.handler_timeout, Some(Duration::from_millis(1500)));
        assert_eq!(c.verify_only, Some(true));
        assert_eq!(c.connection_name.as_deref(), Some("pod-1"));
        assert_eq!(c.max_retries, Some(4));
        assert_eq!(c.retry_base, Some(Duration::from_millis(200)));
        assert_eq!(c.retry_cap, Some(Duration::from_secs(30)));
        assert_eq!(c.health_addr, Some("0.0.0.0:8080".parse().unwrap()));
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.log_filter, "debug,lapin=warn");
    }

    #[test]
    fn errors_name_the_variable_and_value() {
        for (var, value, expect) in [
            (PREFETCH, "0", "1 to 65535"),
            (PREFETCH, "70000", "1 to 65535"),
            (CONCURRENCY, "many", "at least 1"),
            (GRACE_PERIOD_SECS, "-3", "seconds"),
            (HANDLER_TIMEOUT_SECS, "soon", "seconds"),
            (VERIFY_ONLY, "maybe", "true or false"),
            (MAX_RETRIES, "-1", "non-negative"),
            (RETRY_BASE_MS, "1.5", "milliseconds"),
            (HEALTH_ADDR, "localhost", "0.0.0.0:8080"),
            (LOG_FORMAT, "xml", "json"),
        ] {
            let err = cfg(&[(var, value)]).expect_err(var);
            assert_eq!(err.var(), var);
            assert_eq!(err.value(), value);
            let text = err.to_string();
            assert!(text.contains(var) && text.contains(value), "{text}");
            assert!(text.contains(expect), "{text}");
        }
    }

    #[test]
    fn bad_url_is_reported_without_its_password() {
        let err = cfg(&[(AMQP_URL, "http://user:hunter2@host/")]).unwrap_err();
        assert_eq!(err.var(), AMQP_URL);
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let c = cfg(&[(AMQP_URL, "amqp://user:hunter2@host:5672/%2f")]).unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
        assert_eq!(c.redacted_url(), "amqp://user:***@host:5672/%2f");
    }

    #[test]
    fn dead_letter_mode() {
        use crate::DeadLetterMode;
        assert_eq!(cfg(&[]).unwrap().dead_letter_mode, None);
        let c = cfg(&[(DEAD_LETTER_MODE, "Annotate")]).unwrap();
        assert_eq!(c.dead_letter_mode, Some(DeadLetterMode::Annotate));
        let e = cfg(&[(DEAD_LETTER_MODE, "republish")]).unwrap_err();
        assert_eq!(e.var(), DEAD_LETTER_MODE);
        assert!(e.to_string().contains("`annotate`"), "{e}");
    }

    #[test]
    fn several_urls_separated_by_semicolons() {
        let c = cfg(&[(
            AMQP_URL,
            " amqp://u:p1@rabbit-0:5672/%2f ; amqp://u:p2@rabbit-1:5672/%2f;amqp://u:p3@rabbit-2/%2f;",
        )])
        .unwrap();
        assert_eq!(c.amqp_url, "amqp://u:p1@rabbit-0:5672/%2f");
        assert_eq!(
            c.failover_urls,
            ["amqp://u:p2@rabbit-1:5672/%2f", "amqp://u:p3@rabbit-2/%2f"]
        );
        let shown = format!("{c:?}");
        assert!(!shown.contains("p2") && !shown.contains("p3"), "{shown}");
        let err = cfg(&[(AMQP_URL, "amqp://rabbit-0/%2f;http://u:hunter2@rabbit-1/")]).unwrap_err();
        assert_eq!(err.var(), AMQP_URL);
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(cfg(&[(AMQP_URL, "amqp://rabbit-0/%2f")])
            .unwrap()
            .failover_urls
            .is_empty());
    }

    #[test]
    fn empty_values_are_unset_and_zero_timeout_is_none() {
        let c = cfg(&[
            (PREFETCH, ""),
            (HEALTH_ADDR, "  "),
            (HANDLER_TIMEOUT_SECS, "0"),
        ])
        .unwrap();
        assert_eq!(c.prefetch, None);
        assert_eq!(c.health_addr, None);
        assert_eq!(c.handler_timeout, None);
    }

    #[test]
    fn bare_port_listens_on_every_interface() {
        let c = cfg(&[(HEALTH_ADDR, "9090")]).unwrap();
        assert_eq!(c.health_addr, Some("0.0.0.0:9090".parse().unwrap()));
    }

    #[test]
    fn apply_sets_what_is_configured() {
        let c = cfg(&[(QUEUE, "from-env"), (PREFIX, "p-"), (CONCURRENCY, "3")]).unwrap();
        let worker = c
            .apply(Worker::builder(c.amqp_url.clone()).queue("from-code"))
            .handler(|_m: crate::Raw, _c: crate::Context| async move {
                Ok::<(), crate::HandlerError>(())
            })
            .build()
            .unwrap();
        assert_eq!(worker.queue_name(), "p-from-env");
    }

    #[test]
    fn policy_overrides() {
        let c = cfg(&[(RETRY_BASE_MS, "50"), (RETRY_CAP_MS, "400")]).unwrap();
        let p = c.policy(
            RetryPolicy::exponential(Duration::from_secs(1))
                .jitter(redeliver_core::Jitter::None)
                .max_retries(9),
        );
        assert_eq!(p.configured_max_retries(), 9);
        assert_eq!(p.delay_for(0, None), Duration::from_millis(50));
        assert_eq!(p.delay_for(10, None), Duration::from_millis(400));
    }

    #[test]
    fn redaction() {
        assert_eq!(url::redact("amqp://h:5672/%2f"), "amqp://h:5672/%2f");
        assert_eq!(url::redact("amqp://u@h/%2f"), "amqp://u@h/%2f");
        assert_eq!(url::redact("amqp://u:p@h/%2f"), "amqp://u:***@h/%2f");
        assert_eq!(url::redact("not a url"), "not a url");
    }
}
