//! Reading a variable: where it comes from, when it counts as set, and the parsers of its
//! value; [`EnvError`] when it cannot be used.

use std::net::{Ipv6Addr, SocketAddr};
use std::time::Duration;

use redeliver_amqp::url;

use super::AMQP_URL;
use crate::error::EnvError;

/// Where variables come from: the process environment or a caller's lookup.
pub(super) type Source<'a> = dyn Fn(&'static str) -> Result<Option<String>, EnvError> + 'a;

pub(super) fn process_env(name: &'static str) -> Result<Option<String>, EnvError> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(raw)) => {
            let lossy = raw.to_string_lossy();
            // A URL's password is masked here as everywhere: the rest of the value still helps
            // to find the bad byte.
            let shown = if name == AMQP_URL {
                url::redact(&lossy)
            } else {
                lossy.into_owned()
            };
            Err(EnvError::new(name, &shown, "not valid Unicode"))
        }
    }
}

/// Empty means unset: templated manifests often render a missing value as "".
pub(super) fn nonempty(get: &Source<'_>, name: &'static str) -> Result<Option<String>, EnvError> {
    Ok(get(name)?.filter(|v| !v.trim().is_empty()))
}

pub(super) fn parse<T>(
    var: &'static str,
    value: Option<String>,
    f: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, EnvError> {
    match value {
        None => Ok(None),
        Some(v) => f(v.trim())
            .map(Some)
            .map_err(|reason| EnvError::new(var, &v, reason)),
    }
}

/// A duration with its unit, as the CLI takes them: `25s`, `250ms`, `1m 30s`, `0s`.
pub(super) fn duration(v: &str) -> Result<Duration, String> {
    // A bare `0` is unambiguous; any other number needs its unit.
    if v == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(v)
        .map_err(|_| "expected a duration with its unit, like 25s, 250ms or 1m 30s".to_owned())
}

pub(super) fn boolean(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err("expected true or false".to_owned()),
    }
}

pub(super) fn socket_addr(v: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = v.parse::<u16>() {
        // Every address, IPv4 and IPv6 (dual-stack; the health server falls back to IPv4 alone
        // on a host without IPv6).
        return Ok(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)));
    }
    v.parse::<SocketAddr>()
        .map_err(|_| "expected an address like 0.0.0.0:8080 (or a bare port like 8080)".to_owned())
}
