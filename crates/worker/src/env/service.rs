//! The process-wide settings of a service (health server, logging), from the environment.

use std::net::SocketAddr;
use std::str::FromStr;

use super::read::{nonempty, parse, process_env, socket_addr, Source};
use super::{DEFAULT_LOG_FILTER, HEALTH_ADDR, LOG_FORMAT, RUST_LOG};
use crate::error::EnvError;

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

/// The process-wide settings of a service, from the environment: where the health server
/// listens and how to log.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServiceSettings {
    /// `REDELIVER_HEALTH_ADDR`; `None` means no health server.
    pub health_addr: Option<SocketAddr>,
    /// `REDELIVER_LOG_FORMAT`.
    pub log_format: LogFormat,
    /// `RUST_LOG`, or [`DEFAULT_LOG_FILTER`].
    pub log_filter: String,
}

impl Default for ServiceSettings {
    /// What an empty environment gives.
    fn default() -> Self {
        Self {
            health_addr: None,
            log_format: LogFormat::default(),
            log_filter: DEFAULT_LOG_FILTER.to_owned(),
        }
    }
}

impl ServiceSettings {
    /// Reads `REDELIVER_HEALTH_ADDR`, `REDELIVER_LOG_FORMAT` and `RUST_LOG`.
    ///
    /// # Errors
    ///
    /// The first variable whose value is not valid (not Unicode included).
    pub fn from_env() -> Result<Self, EnvError> {
        Self::read(&process_env)
    }

    /// The same, through `lookup` instead of the environment.
    ///
    /// ```
    /// use redeliver::worker::env::{LogFormat, ServiceSettings};
    /// let cfg = ServiceSettings::from_lookup(|n| (n == "REDELIVER_LOG_FORMAT").then(|| "json".into()))
    ///     .unwrap();
    /// assert_eq!(cfg.log_format, LogFormat::Json);
    /// assert_eq!(cfg.health_addr, None);
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        Self::read(&|name| Ok(lookup(name)))
    }

    fn read(get: &Source<'_>) -> Result<Self, EnvError> {
        let var = |name| nonempty(get, name);
        let mut cfg = ServiceSettings {
            health_addr: parse(HEALTH_ADDR, var(HEALTH_ADDR)?, socket_addr)?,
            ..ServiceSettings::default()
        };
        if let Some(v) = var(LOG_FORMAT)? {
            cfg.log_format = v
                .parse()
                .map_err(|reason: String| EnvError::new(LOG_FORMAT, &v, reason))?;
        }
        if let Some(v) = var(RUST_LOG)? {
            cfg.log_filter = v;
        }
        Ok(cfg)
    }
}
