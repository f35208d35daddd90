//! Broker URL handling (with password redaction) and connecting.

use std::time::Duration;

use anyhow::Context as _;
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

use crate::errors::{Unreachable, UsageError};

/// A parsed broker URL that knows how to hide its password.
#[derive(Clone, Debug)]
pub struct BrokerUrl {
    uri: AMQPUri,
    redacted: String,
    /// Forms of the password that could appear in text: as typed (percent-encoded) and decoded.
    secrets: Vec<String>,
}

impl BrokerUrl {
    /// Parses `raw`. The error never contains `raw`: amq-protocol-uri's own message echoes the
    /// whole URL, password included, so it is replaced by the redacted form.
    pub fn parse(raw: &str) -> Result<Self, UsageError> {
        let redacted = redact_url(raw);
        let mut secrets = Vec::new();
        if let Some(p) = raw_password(raw) {
            secrets.push(p.to_owned());
        }
        let uri: AMQPUri = raw.parse().map_err(|e: String| {
            let mut msg = e.replace(raw, &redacted);
            for s in &secrets {
                msg = scrub_with(&msg, s);
            }
            UsageError(format!(
                "--url / AMQP_URL '{redacted}' is not a broker URL ({msg}); expected \
                 amqp://USER:PASSWORD@HOST:PORT/VHOST, e.g. amqp://guest:guest@127.0.0.1:5672/%2f"
            ))
        })?;
        let decoded = uri.authority.userinfo.password.clone();
        if !decoded.is_empty() && !secrets.contains(&decoded) {
            secrets.push(decoded);
        }
        // A password equal to the user name cannot be scrubbed without also hiding the user
        // name; the URL itself is still redacted structurally.
        let user = uri.authority.userinfo.username.clone();
        secrets.retain(|s| !s.is_empty() && *s != user);
        Ok(Self {
            uri,
            redacted,
            secrets,
        })
    }

    /// The URL with its password replaced by `***`, safe to print.
    pub fn redacted(&self) -> &str {
        &self.redacted
    }

    /// The user name, for "check the user" hints.
    pub fn user(&self) -> &str {
        &self.uri.authority.userinfo.username
    }

    /// The vhost, for hints.
    pub fn vhost(&self) -> &str {
        &self.uri.vhost
    }

    /// Replaces every occurrence of the password in `text` by `***`. Last line of defence
    /// applied to everything the binary prints on error.
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for s in &self.secrets {
            out = scrub_with(&out, s);
        }
        out
    }
}

fn scrub_with(text: &str, secret: &str) -> String {
    if secret.is_empty() {
        text.to_owned()
    } else {
        text.replace(secret, "***")
    }
}

/// Byte range of the authority ("user:pass@host:port") in a URL, if it has one.
fn authority_range(raw: &str) -> Option<(usize, usize)> {
    let start = raw.find("://")? + 3;
    let end = raw[start..]
        .find(['/', '?', '#'])
        .map_or(raw.len(), |i| start + i);
    Some((start, end))
}

/// The password exactly as written in the URL (still percent-encoded), if any.
fn raw_password(raw: &str) -> Option<&str> {
    let (start, end) = authority_range(raw)?;
    let authority = &raw[start..end];
    // The last '@' ends the userinfo: an unencoded '@' in a password is invalid but must still
    // not leak.
    let at = authority.rfind('@')?;
    let userinfo = &authority[..at];
    let colon = userinfo.find(':')?;
    Some(&userinfo[colon + 1..])
}

/// `amqp://user:secret@host/vh` -> `amqp://user:***@host/vh`. Works on the raw string so that it
/// also redacts URLs that fail to parse.
pub fn redact_url(raw: &str) -> String {
    let Some((start, end)) = authority_range(raw) else {
        return raw.to_owned();
    };
    let authority = &raw[start..end];
    let Some(at) = authority.rfind('@') else {
        return raw.to_owned();
    };
    let userinfo = &authority[..at];
    let Some(colon) = userinfo.find(':') else {
        return raw.to_owned();
    };
    format!(
        "{}{}:***{}",
        &raw[..start],
        &userinfo[..colon],
        &raw[start + at..]
    )
}

/// Connects, bounded by `timeout` (a black-holed host would otherwise hang for minutes).
/// Errors carry the redacted URL; `errors::explain` turns the lapin cause into a hint.
pub async fn connect(url: &BrokerUrl, timeout: Duration) -> anyhow::Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name("redeliver-cli".into());
    let attempt = Connection::connect_uri(url.uri.clone(), props);
    match tokio::time::timeout(timeout, attempt).await {
        Ok(res) => {
            res.with_context(|| format!("cannot connect to the broker at {}", url.redacted()))
        }
        Err(_) => Err(anyhow::Error::new(Unreachable(format!(
            "no answer within {}",
            humantime::format_duration(timeout)
        )))
        .context(format!(
            "cannot connect to the broker at {}",
            url.redacted()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_password() {
        assert_eq!(
            redact_url("amqp://bob:s3cr%40t@h:5672/%2f"),
            "amqp://bob:***@h:5672/%2f"
        );
        assert_eq!(redact_url("amqp://bob@h/%2f"), "amqp://bob@h/%2f");
        assert_eq!(redact_url("amqp://h:5672"), "amqp://h:5672");
        assert_eq!(redact_url("amqp://u:p@ss@h"), "amqp://u:***@h");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn parse_error_hides_password() {
        let err = BrokerUrl::parse("amqp://bob:hunter22@:99999999/x").unwrap_err();
        assert!(!err.0.contains("hunter22"), "{}", err.0);
    }

    #[test]
    fn scrub_hides_encoded_and_decoded_forms() {
        let url = BrokerUrl::parse("amqp://bob:p%40ssw0rd@127.0.0.1:5672/%2f").unwrap();
        assert_eq!(url.scrub("x p%40ssw0rd y p@ssw0rd"), "x *** y ***");
        assert_eq!(url.redacted(), "amqp://bob:***@127.0.0.1:5672/%2f");
        assert_eq!(url.user(), "bob");
    }
}
