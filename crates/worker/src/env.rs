//! The environment layer, for containers: the variables below write into a
//! [`WorkerBuilder`]'s [`Settings`](crate::Settings), the same ones its methods set.
//!
#![doc = crate::settings::env_table!()]
//!
//! A variable that is not set leaves the setting as the code (or the default, see
//! [`WorkerBuilder`'s defaults](WorkerBuilder#defaults)) had it. An empty variable counts as
//! unset (manifests often template `value: ""`). A bad value is an error naming the variable,
//! its value and what was expected, so a misconfigured pod fails at startup instead of running
//! with a default nobody chose.
//!
//! The last three are the process's, not a worker's: [`ServiceSettings`] reads them, and the
//! service sets up its health server and `tracing-subscriber` with them (the worker crate
//! installs no logger).
//!
//! ```no_run
//! use std::time::Duration;
//! use redeliver::{Context, HandlerError, Raw, RetryPolicy, Worker};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     // Code sets the defaults; the environment overrides them; later calls override both.
//!     .queue("images")
//!     .policy(RetryPolicy::exponential(Duration::from_millis(200)).max_retries(5))
//!     .env()?
//!     .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
//!     .build()?
//!     .run(redeliver::shutdown_on_signal()?)
//!     .await?;
//! # Ok(()) }
//! ```

use redeliver_amqp::url::{self, BrokerUrl};
use std::time::Duration;

use redeliver_core::{Backoff, RetryPolicy};

use crate::{Worker, WorkerBuilder};

pub(crate) mod read;
mod service;

pub use crate::error::EnvError;
use read::{boolean, duration, nonempty, parse, process_env, Source};
pub use service::{LogFormat, ServiceSettings};

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
/// `REDELIVER_MAX_RETRIES`: retries per message before dead-lettering.
pub const MAX_RETRIES: &str = "REDELIVER_MAX_RETRIES";
/// `REDELIVER_RETRY_BASE`: first backoff delay, the base of the policy's exponential or linear
/// backoff or the delay of its constant one; an error for a fixed schedule.
pub const RETRY_BASE: &str = "REDELIVER_RETRY_BASE";
/// `REDELIVER_RETRY_CAP`: largest backoff delay.
pub const RETRY_CAP: &str = "REDELIVER_RETRY_CAP";
/// `REDELIVER_HEALTH_ADDR`: listen address of the health server.
pub const HEALTH_ADDR: &str = "REDELIVER_HEALTH_ADDR";
/// `REDELIVER_LOG_FORMAT`: `json` or `pretty`.
pub const LOG_FORMAT: &str = "REDELIVER_LOG_FORMAT";
/// `RUST_LOG`: log filter.
pub const RUST_LOG: &str = "RUST_LOG";

pub use crate::settings::vars::*;

/// The variables of the hand-written settings, read before the simple ones.
const FIRST: &[&str] = &[
    AMQP_URL,
    AMQP_URL_FILE,
    AMQP_PASSWORD_FILE,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    TLS_SASL_EXTERNAL,
];
/// The variables amending the policy, and the process's.
const LAST: &[&str] = &[
    MAX_RETRIES,
    RETRY_BASE,
    RETRY_CAP,
    HEALTH_ADDR,
    LOG_FORMAT,
    RUST_LOG,
];
const COUNT: usize = FIRST.len() + SIMPLE_VARIABLES.len() + LAST.len();
const ALL: [&str; COUNT] = join([FIRST, SIMPLE_VARIABLES, LAST]);

/// `parts` one after the other (a `const` cannot concatenate slices otherwise).
const fn join<const N: usize>(parts: [&[&'static str]; 3]) -> [&'static str; N] {
    let mut all = [""; N];
    let mut i = 0;
    let mut p = 0;
    while p < parts.len() {
        let mut j = 0;
        while j < parts[p].len() {
            all[i] = parts[p][j];
            i += 1;
            j += 1;
        }
        p += 1;
    }
    all
}

/// Every variable this module reads, in the order of the table above.
pub const VARIABLES: &[&str] = &ALL;

/// Variables of earlier versions, refused when set (with the one to use instead), so that a
/// manifest written for them does not silently run with defaults.
pub const REPLACED: &[(&str, &str)] = &[
    ("REDELIVER_GRACE_PERIOD_SECS", GRACE_PERIOD),
    ("REDELIVER_HANDLER_TIMEOUT_SECS", HANDLER_TIMEOUT),
    ("REDELIVER_RETRY_BASE_MS", RETRY_BASE),
    ("REDELIVER_RETRY_CAP_MS", RETRY_CAP),
];

/// Default of `AMQP_URL`: a local broker with the default account.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default of `RUST_LOG`.
pub const DEFAULT_LOG_FILTER: &str = "info";

impl WorkerBuilder {
    /// A builder from the environment alone: the default URL
    /// (`amqp://guest:guest@127.0.0.1:5672/%2f`) unless `AMQP_URL` says otherwise, then
    /// [`env`](Self::env). Set the queue and handler in code as usual.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use redeliver::{Context, HandlerError, Raw, WorkerBuilder};
    /// WorkerBuilder::from_env()?
    ///     .queue("images")
    ///     .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) })
    ///     .build()?
    ///     .run(redeliver::shutdown_on_signal()?)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// See [`env`](Self::env).
    pub fn from_env() -> Result<WorkerBuilder, EnvError> {
        Worker::builder(DEFAULT_AMQP_URL).env()
    }

    /// Writes the [variables](crate::env) that are set into this builder's settings, over what
    /// was set before; methods called afterwards override the environment.
    ///
    /// # Errors
    ///
    /// The first variable whose value is not valid (not Unicode included); a URL's password is
    /// never in the error.
    pub fn env(self) -> Result<Self, EnvError> {
        self.read_env(&process_env)
    }

    /// [`env`](Self::env), reading through `lookup` instead of the process environment (tests,
    /// or a configuration source of your own).
    ///
    /// ```
    /// use redeliver::Worker;
    /// let vars = [("REDELIVER_PREFETCH", "64"), ("REDELIVER_QUEUE", "images")];
    /// let builder = Worker::builder("amqp://127.0.0.1:5672/%2f")
    ///     .env_from(|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
    ///     .unwrap();
    /// assert_eq!(builder.settings().prefetch(), Some(64));
    /// assert_eq!(builder.settings().queue(), Some("images"));
    ///
    /// let err = Worker::builder("amqp://127.0.0.1:5672/%2f")
    ///     .env_from(|name| (name == "REDELIVER_CONCURRENCY").then(|| "lots".into()))
    ///     .unwrap_err();
    /// assert_eq!(err.var(), "REDELIVER_CONCURRENCY");
    /// ```
    pub fn env_from(self, lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        self.read_env(&|name| Ok(lookup(name)))
    }

    fn read_env(mut self, get: &Source<'_>) -> Result<Self, EnvError> {
        let var = |name| nonempty(get, name);
        let s = self.settings_mut();
        let file = |name: &'static str, what: &'static str, path: String| {
            url::read_secret_file(what, std::path::Path::new(&path))
                .map_err(|e| EnvError::new(name, &path, e.to_string()))
        };
        let (url_var, mut urls) = match (var(AMQP_URL)?, var(AMQP_URL_FILE)?) {
            (Some(_), Some(_)) => {
                return Err(EnvError::new(
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
            let password = file(AMQP_PASSWORD_FILE, "the broker password", path.clone())?;
            let base = match urls {
                Some(u) => u,
                None => std::iter::once(s.url.as_str())
                    .chain(s.failover_urls.iter().map(String::as_str))
                    .collect::<Vec<_>>()
                    .join(";"),
            };
            // A URL without a user is an error, not a login as `guest`.
            let with = url::with_password(&base, &password)
                .map_err(|e| EnvError::new(AMQP_PASSWORD_FILE, &path, e.to_string()))?;
            urls = Some(with);
        }
        if let Some(value) = urls {
            // Parsing refuses amqps:// in a build without TLS, and never echoes a password.
            BrokerUrl::parse_list(&value).map_err(|e| {
                EnvError::new(
                    url_var,
                    &url::redact(&value),
                    format!("{e}; several URLs are separated by `;`"),
                )
            })?;
            let mut raw = url::split_list(&value)
                .into_iter()
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_owned);
            if let Some(first) = raw.next() {
                s.url = first;
                s.failover_urls = raw.collect();
            }
        }
        // Only variables that are set replace the TLS settings made in code.
        let mut tls = s.tls.clone();
        let mut tls_set = false;
        if let Some(p) = var(TLS_CA_FILE)? {
            tls = tls.ca_file(p.trim());
            tls_set = true;
        }
        match (var(TLS_CERT_FILE)?, var(TLS_KEY_FILE)?) {
            (Some(c), Some(k)) => {
                tls = tls.client_cert(c.trim(), k.trim());
                tls_set = true;
            }
            (None, None) => {}
            (Some(c), None) => {
                return Err(EnvError::new(
                    TLS_CERT_FILE,
                    &c,
                    "also set REDELIVER_TLS_KEY_FILE (the certificate's private key)",
                ))
            }
            (None, Some(k)) => {
                return Err(EnvError::new(
                    TLS_KEY_FILE,
                    &k,
                    "also set REDELIVER_TLS_CERT_FILE (the client certificate)",
                ))
            }
        }
        if let Some(yes) = parse(TLS_SASL_EXTERNAL, var(TLS_SASL_EXTERNAL)?, boolean)? {
            tls = tls.sasl_external(yes);
            tls_set = true;
        }
        if tls_set {
            s.tls = tls;
        }
        for (old, new) in REPLACED {
            if let Some(v) = var(old)? {
                return Err(EnvError::new(
                    old,
                    &v,
                    format!("no longer read: set {new} instead, to a duration with its unit (`25s`, `250ms`)"),
                ));
            }
        }
        s.read_simple_env(&var)?;
        if let Some(n) = parse(MAX_RETRIES, var(MAX_RETRIES)?, |v| {
            v.parse::<u32>()
                .map_err(|_| "expected a non-negative integer".to_owned())
        })? {
            s.policy = s.policy.clone().max_retries(n);
        }
        let raw = var(RETRY_BASE)?;
        if let Some(d) = parse(RETRY_BASE, raw.clone(), duration)? {
            s.policy = with_base(&s.policy, d).map_err(|why| {
                EnvError::new(RETRY_BASE, raw.as_deref().unwrap_or_default(), why)
            })?;
        }
        if let Some(d) = parse(RETRY_CAP, var(RETRY_CAP)?, duration)? {
            s.policy = s.policy.clone().cap(d);
        }
        Ok(self)
    }
}

/// `policy` with `base` as its backoff's first delay. A fixed schedule has no such parameter:
/// an error rather than a variable silently ignored.
fn with_base(policy: &RetryPolicy, base: Duration) -> Result<RetryPolicy, &'static str> {
    let backoff = match policy.configured_backoff().clone() {
        Backoff::Constant(_) => Backoff::Constant(base),
        Backoff::Linear { step, cap, .. } => Backoff::Linear { base, step, cap },
        Backoff::Exponential { factor, cap, .. } => Backoff::Exponential { base, factor, cap },
        Backoff::Fixed(_) => {
            return Err("the policy's backoff is a fixed schedule, which has no base delay")
        }
    };
    Ok(policy.clone().backoff(backoff))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::settings::Settings;
    use crate::DeadLetterMode;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    fn cfg(vars: &[(&str, &str)]) -> Result<WorkerBuilder, EnvError> {
        Worker::builder(DEFAULT_AMQP_URL).env_from(lookup(vars))
    }

    fn settings(vars: &[(&str, &str)]) -> Settings {
        cfg(vars).unwrap().settings().clone()
    }

    #[test]
    fn empty_environment_changes_nothing() {
        let s = settings(&[]);
        let d = Worker::builder(DEFAULT_AMQP_URL).settings().clone();
        assert_eq!(format!("{s:?}"), format!("{d:?}"));
        assert_eq!(s.url(), DEFAULT_AMQP_URL);
        let svc = ServiceSettings::from_lookup(lookup(&[])).unwrap();
        assert_eq!(svc, ServiceSettings::default());
        assert_eq!(svc.health_addr, None);
        assert_eq!(svc.log_format, LogFormat::Pretty);
        assert_eq!(svc.log_filter, "info");
    }

    #[test]
    fn every_variable_is_read() {
        let vars = [
            (AMQP_URL, "amqp://u:p@rabbitmq:5672/%2f"),
            (QUEUE, "images"),
            (PREFIX, "eu-"),
            (PREFETCH, "64"),
            (CONCURRENCY, "16"),
            (GRACE_PERIOD, "20s"),
            (CONFIRM_TIMEOUT, "5s"),
            (HANDLER_TIMEOUT, "1500ms"),
            (VERIFY_ONLY, "yes"),
            (CONNECTION_NAME, "pod-1"),
            (MAX_RETRIES, "4"),
            (RETRY_BASE, "200ms"),
            (RETRY_CAP, "30s"),
            (DEAD_LETTER_MODE, "Annotate"),
            (HEALTH_ADDR, "0.0.0.0:8080"),
            (LOG_FORMAT, "JSON"),
            (RUST_LOG, "debug,lapin=warn"),
        ];
        let s = Worker::builder(DEFAULT_AMQP_URL)
            .policy(
                RetryPolicy::exponential(Duration::from_secs(1))
                    .jitter(redeliver_core::Jitter::None),
            )
            .env_from(lookup(&vars))
            .unwrap()
            .settings()
            .clone();
        assert_eq!(s.url(), "amqp://u:p@rabbitmq:5672/%2f");
        assert_eq!(s.queue(), Some("images"));
        assert_eq!(s.prefix(), Some("eu-"));
        assert_eq!(s.prefetch(), Some(64));
        assert_eq!(s.concurrency(), 16);
        assert_eq!(s.shutdown_grace(), Duration::from_secs(20));
        assert_eq!(s.confirm_timeout(), Duration::from_secs(5));
        assert_eq!(s.handler_timeout(), Some(Duration::from_millis(1500)));
        assert!(s.verify_only());
        assert_eq!(s.connection_name(), Some("pod-1"));
        assert_eq!(s.policy().configured_max_retries(), 4);
        assert_eq!(s.policy().delay_for(0, None), Duration::from_millis(200));
        assert_eq!(s.policy().delay_for(30, None), Duration::from_secs(30));
        assert_eq!(s.dead_letter_mode(), DeadLetterMode::Annotate);
        let svc = ServiceSettings::from_lookup(lookup(&vars)).unwrap();
        assert_eq!(svc.health_addr, Some("0.0.0.0:8080".parse().unwrap()));
        assert_eq!(svc.log_format, LogFormat::Json);
        assert_eq!(svc.log_filter, "debug,lapin=warn");
    }

    #[test]
    fn errors_name_the_variable_and_value() {
        for (var, value, expect) in [
            (PREFETCH, "0", "1 to 65535"),
            (PREFETCH, "70000", "1 to 65535"),
            (CONCURRENCY, "many", "at least 1"),
            (GRACE_PERIOD, "-3s", "duration"),
            (GRACE_PERIOD, "25", "with its unit"),
            (HANDLER_TIMEOUT, "soon", "duration"),
            (VERIFY_ONLY, "maybe", "true or false"),
            (MAX_RETRIES, "-1", "non-negative"),
            (RETRY_BASE, "1.5", "duration"),
            (
                "REDELIVER_GRACE_PERIOD_SECS",
                "25",
                "REDELIVER_GRACE_PERIOD",
            ),
            ("REDELIVER_RETRY_CAP_MS", "400", "REDELIVER_RETRY_CAP"),
            (DEAD_LETTER_MODE, "republish", "`annotate`"),
        ] {
            let err = cfg(&[(var, value)]).expect_err(var);
            assert_eq!(err.var(), var);
            assert_eq!(err.value(), value);
            let text = err.to_string();
            assert!(text.contains(var) && text.contains(value), "{text}");
            assert!(text.contains(expect), "{text}");
        }
        for (var, value, expect) in [
            (HEALTH_ADDR, "localhost", "0.0.0.0:8080"),
            (LOG_FORMAT, "xml", "json"),
        ] {
            let err = ServiceSettings::from_lookup(lookup(&[(var, value)])).expect_err(var);
            assert_eq!(err.var(), var);
            assert!(err.to_string().contains(expect), "{err}");
        }
    }

    #[test]
    fn bad_url_is_reported_without_its_password() {
        let err = cfg(&[(AMQP_URL, "http://user:hunter2@host/")]).unwrap_err();
        assert_eq!(err.var(), AMQP_URL);
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let b = cfg(&[(AMQP_URL, "amqp://user:hunter2@host:5672/%2f")]).unwrap();
        assert!(!format!("{b:?}").contains("hunter2"));
        assert!(!format!("{:?}", b.settings()).contains("hunter2"));
    }

    #[test]
    fn several_urls_separated_by_semicolons() {
        let s = settings(&[(
            AMQP_URL,
            " amqp://u:p1@rabbit-0:5672/%2f ; amqp://u:p2@rabbit-1:5672/%2f;amqp://u:p3@rabbit-2/%2f;",
        )]);
        assert_eq!(s.url(), "amqp://u:p1@rabbit-0:5672/%2f");
        assert_eq!(
            s.failover_urls(),
            ["amqp://u:p2@rabbit-1:5672/%2f", "amqp://u:p3@rabbit-2/%2f"]
        );
        let shown = format!("{s:?}");
        assert!(!shown.contains("p2") && !shown.contains("p3"), "{shown}");
        let err = cfg(&[(AMQP_URL, "amqp://rabbit-0/%2f;http://u:hunter2@rabbit-1/")]).unwrap_err();
        assert_eq!(err.var(), AMQP_URL);
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(settings(&[(AMQP_URL, "amqp://rabbit-0/%2f")])
            .failover_urls()
            .is_empty());
    }

    #[test]
    fn empty_values_are_unset_and_zero_timeout_is_none() {
        let b = Worker::builder(DEFAULT_AMQP_URL)
            .prefetch(7)
            .handler_timeout(Duration::from_secs(3));
        let s = b
            .env_from(lookup(&[(PREFETCH, ""), (HANDLER_TIMEOUT, "0s")]))
            .unwrap()
            .settings()
            .clone();
        assert_eq!(s.prefetch(), Some(7));
        assert_eq!(s.handler_timeout(), None);
        let svc = ServiceSettings::from_lookup(lookup(&[(HEALTH_ADDR, "  ")])).unwrap();
        assert_eq!(svc.health_addr, None);
    }

    #[test]
    fn bare_port_listens_on_every_interface() {
        let svc = ServiceSettings::from_lookup(lookup(&[(HEALTH_ADDR, "9090")])).unwrap();
        assert_eq!(svc.health_addr, Some("[::]:9090".parse().unwrap()));
    }

    #[test]
    fn the_environment_overrides_earlier_calls_and_later_calls_override_it() {
        let vars = [(QUEUE, "from-env"), (PREFIX, "p-"), (CONCURRENCY, "3")];
        let worker = Worker::builder(DEFAULT_AMQP_URL)
            .queue("from-code")
            .concurrency(5)
            .env_from(lookup(&vars))
            .unwrap()
            .concurrency(4)
            .handler(|_m: crate::Raw, _c: crate::Context| async move {
                Ok::<(), redeliver_core::HandlerError>(())
            })
            .build()
            .unwrap();
        assert_eq!(worker.queue_name(), "p-from-env");
        assert_eq!(worker.settings().concurrency(), 4);
    }

    #[test]
    fn retry_settings_amend_the_policy_set_in_code() {
        let s = Worker::builder(DEFAULT_AMQP_URL)
            .policy(
                RetryPolicy::exponential(Duration::from_secs(1))
                    .jitter(redeliver_core::Jitter::None)
                    .max_retries(9),
            )
            .env_from(lookup(&[(RETRY_BASE, "50ms"), (RETRY_CAP, "400ms")]))
            .unwrap()
            .settings()
            .clone();
        assert_eq!(s.policy().configured_max_retries(), 9);
        assert_eq!(s.policy().delay_for(0, None), Duration::from_millis(50));
        assert_eq!(s.policy().delay_for(10, None), Duration::from_millis(400));
    }

    #[test]
    fn retry_base_sets_the_first_delay_of_each_backoff_that_has_one() {
        let ms = Duration::from_millis;
        let amended = |policy: RetryPolicy| {
            Worker::builder(DEFAULT_AMQP_URL)
                .policy(policy)
                .env_from(lookup(&[(RETRY_BASE, "50ms")]))
                .map(|b| b.settings().policy().configured_backoff().clone())
        };
        assert_eq!(
            amended(RetryPolicy::from_backoff(Backoff::Exponential {
                base: ms(1),
                factor: 3.0,
                cap: ms(900),
            }))
            .unwrap(),
            Backoff::Exponential {
                base: ms(50),
                factor: 3.0,
                cap: ms(900)
            }
        );
        assert_eq!(
            amended(RetryPolicy::linear(ms(1), ms(7)).cap(ms(90))).unwrap(),
            Backoff::Linear {
                base: ms(50),
                step: ms(7),
                cap: ms(90)
            }
        );
        assert_eq!(
            amended(RetryPolicy::constant(ms(1))).unwrap(),
            Backoff::Constant(ms(50))
        );
        // A schedule has no base: refused, not ignored.
        let err = amended(RetryPolicy::fixed([ms(1), ms(2)])).unwrap_err();
        assert_eq!(err.var(), RETRY_BASE);
        assert_eq!(err.value(), "50ms");
        assert!(err.to_string().contains("fixed schedule"), "{err}");
    }

    #[test]
    fn password_file_applies_to_the_code_url_too() {
        let dir = std::env::temp_dir().join(format!("redeliver-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "s3cret\n").unwrap();
        let s = Worker::builder("amqp://app@rabbit:5672/%2f")
            .env_from(lookup(&[(AMQP_PASSWORD_FILE, file.to_str().unwrap())]))
            .unwrap()
            .settings()
            .clone();
        assert!(s.url().contains("app:s3cret@rabbit"), "{}", s.url());
        // A URL without a user would log in as `guest` with the file's password: an error.
        for url in ["amqp://rabbit:5672/%2f", "amqp://app@r0/%2f;amqp://r1/%2f"] {
            let err = cfg(&[
                (AMQP_URL, url),
                (AMQP_PASSWORD_FILE, file.to_str().unwrap()),
            ])
            .unwrap_err();
            assert_eq!(err.var(), AMQP_PASSWORD_FILE);
            assert_eq!(err.value(), file.to_str().unwrap());
            assert!(err.to_string().contains("no user"), "{err}");
            assert!(!format!("{err} {err:?}").contains("s3cret"), "{err}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_list_mixing_tls_and_plain_is_refused() {
        let err = cfg(&[(
            AMQP_URL,
            "amqps://u:hunter2@rabbit-0:5671/%2f;amqp://u:hunter2@rabbit-1:5672/%2f",
        )])
        .unwrap_err();
        assert_eq!(err.var(), AMQP_URL);
        assert!(err.to_string().contains("clear text"), "{err}");
        assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
    }
}
