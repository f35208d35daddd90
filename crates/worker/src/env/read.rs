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

/// A simple setting's variable: `parser` gets the value untrimmed (only a prefix keeps its
/// spaces) and returns the setting's value.
pub(crate) fn value<T>(
    var: &'static str,
    value: Option<String>,
    parser: fn(&str) -> Result<T, String>,
) -> Result<Option<T>, EnvError> {
    match value {
        None => Ok(None),
        Some(v) => parser(&v)
            .map(Some)
            .map_err(|reason| EnvError::new(var, &v, reason)),
    }
}

// The parsers of the simple settings (see `settings!`): each takes the raw value.

/// Text without the spaces around it.
pub(crate) fn text(v: &str) -> Result<Option<String>, String> {
    Ok(Some(v.trim().to_owned()))
}

/// Text taken literally: a prefix may end with a separator, a space included.
pub(crate) fn literal(v: &str) -> Result<Option<String>, String> {
    Ok(Some(v.to_owned()))
}

pub(crate) fn positive_count(v: &str) -> Result<usize, String> {
    match v.trim().parse::<usize>() {
        Ok(0) | Err(_) => Err("expected an integer of at least 1".to_owned()),
        Ok(n) => Ok(n),
    }
}

pub(crate) fn prefetch(v: &str) -> Result<Option<u16>, String> {
    match v.trim().parse::<u16>() {
        Ok(0) | Err(_) => Err("expected an integer from 1 to 65535".to_owned()),
        Ok(n) => Ok(Some(n)),
    }
}

pub(crate) fn flag(v: &str) -> Result<bool, String> {
    boolean(v.trim())
}

pub(crate) fn any_duration(v: &str) -> Result<Duration, String> {
    duration(v.trim())
}

/// A time limit: `0s` means none.
pub(crate) fn timeout(v: &str) -> Result<Option<Duration>, String> {
    let d = duration(v.trim())?;
    Ok((!d.is_zero()).then_some(d))
}

pub(crate) fn positive_duration(v: &str) -> Result<Duration, String> {
    match duration(v.trim())? {
        d if d.is_zero() => Err("expected a positive duration, like 30s".to_owned()),
        d => Ok(d),
    }
}

/// A value of a type parsing itself, with its own message ([`crate::DeadLetterMode`]).
pub(crate) fn from_str<T: std::str::FromStr<Err = String>>(v: &str) -> Result<T, String> {
    v.trim().parse()
}
