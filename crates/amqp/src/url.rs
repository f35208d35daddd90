//! Broker URLs that never show their password: redaction for logs and errors, and a parsed form
//! that scrubs the password, in every spelling it could take, from any text.
//!
//! Redaction works on the raw text, so it also hides the password of a URL that does not parse:
//! `amqp:app:s3cret@host` (no `//`), an unencoded `@` in the password, several URLs separated by
//! `;`.
//!
//! ```
//! use redeliver_amqp::url::{redact, BrokerUrl};
//!
//! assert_eq!(redact("amqp://app:s3cret@rabbit:5672/%2f"), "amqp://app:***@rabbit:5672/%2f");
//! assert_eq!(redact("amqp:app:s3cret@rabbit"), "amqp:app:***@rabbit");
//!
//! let url = BrokerUrl::parse("amqp://app:p%40ss@rabbit/%2f").unwrap();
//! assert_eq!(url.redacted(), "amqp://app:***@rabbit/%2f");
//! assert_eq!(url.scrub("refused p%40ss and p@ss"), "refused *** and ***");
//! assert!(!format!("{url:?}").contains("p@ss"));
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use lapin::uri::{AMQPScheme, AMQPUri};
use percent_encoding::percent_decode_str;

/// Whether this build speaks TLS (the `tls` feature): without it [`BrokerUrl::parse`] refuses
/// `amqps://` URLs.
pub const TLS_ENABLED: bool = cfg!(feature = "tls");

/// What replaces a password.
pub const MASK: &str = "***";

/// `url` with the password of every `;`-separated URL in it replaced by [`MASK`].
pub fn redact(url: &str) -> String {
    split_list(url)
        .into_iter()
        .map(redact_one)
        .collect::<Vec<_>>()
        .join(";")
}

/// Length of the scheme at the start of `s` (`amqp` in `amqp:...`), if it starts with one.
fn scheme_len(s: &str) -> Option<usize> {
    let colon = s.find(':')?;
    let scheme = &s[..colon];
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic() && chars.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)))
        .then_some(colon)
}

/// Whether `s` starts like the next URL of a list: `amqp:` or `amqps:`, or any scheme followed
/// by `//`. A password holding `;x:` must not look like one (`a:@host` is not a URL).
fn starts_url(s: &str) -> bool {
    let Some(n) = scheme_len(s) else {
        return false;
    };
    let scheme = s[..n].to_ascii_lowercase();
    scheme == "amqp" || scheme == "amqps" || s[n + 1..].starts_with("//")
}

/// Splits a `;`-separated list of URLs. Only a `;` followed by a URL (`amqp:`, `amqps:`, or any
/// scheme with `//`), by more `;` or by nothing separates: one inside a password stays in its URL
/// (so it is masked with the rest). Empty entries are the caller's to skip.
pub fn split_list(raw: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut from = 0;
    for (i, _) in raw.match_indices(';') {
        let rest = raw[i + 1..].trim_start_matches(|c: char| c == ';' || c.is_whitespace());
        if rest.is_empty() || starts_url(rest) {
            parts.push(&raw[from..i]);
            from = i + 1;
        }
    }
    parts.push(&raw[from..]);
    parts
}

fn redact_one(url: &str) -> String {
    match password_range(url) {
        Some((start, end)) => format!("{}{MASK}{}", &url[..start], &url[end..]),
        None => url.to_owned(),
    }
}

/// Byte range of the password in a URL as written: from the first `:` after the scheme (and its
/// `//`, when present) to the last `@`. Taking the last `@` of the whole URL, not of a
/// well-formed authority, masks too much rather than too little when the password holds a raw
/// `/`, `?`, `#` or `@`.
fn password_range(url: &str) -> Option<(usize, usize)> {
    let lead = url.len() - url.trim_start().len();
    let mut start = lead + scheme_len(&url[lead..])? + 1;
    if url[start..].starts_with("//") {
        start += 2;
    }
    let at = url[start..].rfind('@')?;
    let colon = url[start..start + at].find(':')?;
    Some((start + colon + 1, start + at))
}

/// Every form in which the passwords of `url` (one or several, `;`-separated) could appear in a
/// text: as written and percent-decoded. Empty passwords are left out.
pub(crate) fn secrets_of(url: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for one in split_list(url) {
        let Some((s, e)) = password_range(one) else {
            continue;
        };
        let raw = &one[s..e];
        let decoded = percent_decode_str(raw).decode_utf8_lossy().into_owned();
        for form in [raw.to_owned(), decoded] {
            if !form.is_empty() && !out.contains(&form) {
                out.push(form);
            }
        }
    }
    // Longest first, so a password containing another one is masked whole.
    out.sort_by_key(|s| std::cmp::Reverse(s.len()));
    out
}

/// Replaces each of `secrets` in `text` by [`MASK`].
pub(crate) fn scrub_with(text: &str, secrets: &[String]) -> String {
    let mut out = text.to_owned();
    for s in secrets {
        if !s.is_empty() {
            out = out.replace(s.as_str(), MASK);
        }
    }
    out
}

/// Why a broker URL cannot be used. The message shows the URL redacted, never its password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// The text is not an AMQP URL.
    #[error("'{redacted}' is not a broker URL ({reason}); expected amqp://USER:PASSWORD@HOST:PORT/VHOST (amqps:// for TLS), e.g. amqp://guest:guest@127.0.0.1:5672/%2f")]
    Invalid {
        /// The URL, password masked.
        redacted: String,
        /// What is wrong, password masked.
        reason: String,
    },
    /// An `amqps://` URL in a build without TLS support.
    #[error("'{redacted}' asks for TLS (amqps://), but this build has no TLS support: enable the `tls` feature of redeliver (on by default), or use amqp:// on a trusted network")]
    TlsDisabled {
        /// The URL, password masked.
        redacted: String,
    },
    /// A `*_FILE` setting names a file that cannot be read.
    #[error("cannot read {what} from {}: {reason}", path.display())]
    File {
        /// What the file holds (`the broker URL`, `the broker password`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
}

/// A parsed broker URL that hides its password: in [`Self::redacted`], in `Debug`, and in any
/// text passed through [`Self::scrub`].
#[derive(Clone)]
pub struct BrokerUrl {
    uri: AMQPUri,
    redacted: String,
    secrets: Vec<String>,
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BrokerUrl").field(&self.redacted).finish()
    }
}

impl fmt::Display for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted)
    }
}

impl BrokerUrl {
    /// Parses one URL. An `amqps://` URL is refused when this build has no TLS support
    /// ([`UrlError::TlsDisabled`]), before anything connects.
    pub fn parse(raw: &str) -> Result<Self, UrlError> {
        let raw = raw.trim();
        let redacted = redact(raw);
        let mut secrets = secrets_of(raw);
        let uri: AMQPUri = raw.parse().map_err(|e: String| UrlError::Invalid {
            redacted: redacted.clone(),
            // amq-protocol-uri's message can quote the whole URL, password included.
            reason: scrub_with(&e.replace(raw, &redacted), &secrets),
        })?;
        if uri.scheme == AMQPScheme::AMQPS && !TLS_ENABLED {
            return Err(UrlError::TlsDisabled { redacted });
        }
        // A password equal to the user name cannot be scrubbed without hiding the user name too;
        // the URL itself is still redacted by position.
        let user = uri.authority.userinfo.username.clone();
        secrets.retain(|s| *s != user);
        Ok(Self {
            uri,
            redacted,
            secrets,
        })
    }

    /// Several URLs separated by `;` (Celery's `broker_url` syntax; a comma can appear in a
    /// password), blanks around them and empty entries ignored. At least one is required.
    pub fn parse_list(raw: &str) -> Result<Vec<Self>, UrlError> {
        let urls = split_list(raw)
            .into_iter()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Self::parse)
            .collect::<Result<Vec<_>, _>>()?;
        if urls.is_empty() {
            return Err(UrlError::Invalid {
                redacted: String::new(),
                reason: "empty".into(),
            });
        }
        Ok(urls)
    }

    /// The parsed URL (for lapin).
    pub fn uri(&self) -> &AMQPUri {
        &self.uri
    }

    /// The URL with its password replaced by `***`, safe to print.
    pub fn redacted(&self) -> &str {
        &self.redacted
    }

    /// Whether this is an `amqps://` URL.
    pub fn is_tls(&self) -> bool {
        self.uri.scheme == AMQPScheme::AMQPS
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.uri.authority.userinfo.username
    }

    /// The vhost.
    pub fn vhost(&self) -> &str {
        &self.uri.vhost
    }

    /// `host:port`.
    pub fn endpoint(&self) -> String {
        format!("{}:{}", self.uri.authority.host, self.uri.authority.port)
    }

    /// `text` with every form of the password replaced by `***`: the last line of defence for
    /// anything printed about this URL.
    pub fn scrub(&self, text: &str) -> String {
        scrub_with(text, &self.secrets)
    }
}

/// Reads a secret or a URL from a file (a Kubernetes secret mounted as a file): the contents
/// without the trailing newline.
pub fn read_secret_file(what: &'static str, path: &Path) -> Result<String, UrlError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim_end_matches(['\n', '\r']).to_owned())
        .map_err(|e| UrlError::File {
            what,
            path: path.to_owned(),
            reason: e.to_string(),
        })
}

/// `url` (one or several, `;`-separated) with `password` put in each URL's userinfo,
/// percent-encoded, replacing any password there. Used for `AMQP_PASSWORD_FILE`.
pub fn with_password(url: &str, password: &str) -> String {
    use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
    // Unreserved characters stay as they are (RFC 3986), everything else is encoded.
    const USERINFO: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    let encoded = utf8_percent_encode(password, USERINFO).to_string();
    split_list(url)
        .into_iter()
        .map(|one| {
            let one = one.trim();
            if let Some((s, e)) = password_range(one) {
                return format!("{}{encoded}{}", &one[..s], &one[e..]);
            }
            // No password yet: after `user` in `scheme://user@host`.
            let Some(start) = one.find("://").map(|i| i + 3) else {
                return one.to_owned();
            };
            let end = one[start..]
                .find(['/', '?', '#'])
                .map_or(one.len(), |i| start + i);
            match one[start..end].rfind('@') {
                Some(at) => format!("{}:{encoded}{}", &one[..start + at], &one[start + at..]),
                None => one.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(";")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_every_shape() {
        assert_eq!(
            redact("amqp://bob:s3cr%40t@h:5672/%2f"),
            "amqp://bob:***@h:5672/%2f"
        );
        assert_eq!(redact("amqp://bob@h/%2f"), "amqp://bob@h/%2f");
        assert_eq!(redact("amqp://h:5672"), "amqp://h:5672");
        assert_eq!(redact("amqp://u:p@ss@h"), "amqp://u:***@h");
        assert_eq!(redact("amqp:app:s3cret@host"), "amqp:app:***@host");
        assert_eq!(redact("amqp:app:s3cret@host/vh"), "amqp:app:***@host/vh");
        assert_eq!(
            redact("amqp://a:x@h1;amqps://b:y@h2:5671"),
            "amqp://a:***@h1;amqps://b:***@h2:5671"
        );
        assert_eq!(redact("not a url"), "not a url");
        assert_eq!(redact("host:5672"), "host:5672");
        // Raw special characters in the password: masked, never cut apart.
        assert_eq!(
            redact("amqp://app:ab/c@rabbit:5672/%2f"),
            "amqp://app:***@rabbit:5672/%2f"
        );
        assert_eq!(redact("amqp://app:ab;c@rabbit"), "amqp://app:***@rabbit");
        assert_eq!(redact("amqp:app:abc://x@rabbit"), "amqp:app:***@rabbit");
        assert_eq!(
            split_list("amqp://a:x;y@h1;amqps://b@h2"),
            ["amqp://a:x;y@h1", "amqps://b@h2"]
        );
        // A `;x:` inside a password is not the start of another URL.
        assert_eq!(
            split_list("amqp:app:aaA;a:@rabbit"),
            ["amqp:app:aaA;a:@rabbit"]
        );
        assert!(!redact("amqp:app:aaA;a:@rabbit").contains("aaA"));
        assert_eq!(
            split_list("amqp://r0/%2f;http://u:p@r1/"),
            ["amqp://r0/%2f", "http://u:p@r1/"]
        );
    }

    #[test]
    fn secrets_in_both_spellings() {
        assert_eq!(secrets_of("amqp://u:p%40ss@h"), ["p%40ss", "p@ss"]);
        assert_eq!(secrets_of("amqp://u@h"), Vec::<String>::new());
        assert_eq!(secrets_of("amqp:u:pw@h;amqp://v:other@h"), ["other", "pw"]);
    }

    #[test]
    fn parse_errors_hide_the_password() {
        for raw in [
            "amqp://bob:hunter22@:99999999/x",
            "amqp:bob:hunter22@host",
            "amqp://bob:hunter22@host:notaport",
            "amqpx://bob:hunter22@host",
        ] {
            let e = BrokerUrl::parse(raw).unwrap_err().to_string();
            assert!(!e.contains("hunter22"), "{raw}: {e}");
        }
        let url = BrokerUrl::parse("amqp://bob:p%40ssw0rd@127.0.0.1:5672/%2f").unwrap();
        assert_eq!(url.scrub("x p%40ssw0rd y p@ssw0rd"), "x *** y ***");
        assert_eq!(url.user(), "bob");
        assert_eq!(url.endpoint(), "127.0.0.1:5672");
        assert!(!format!("{url:?} {url}").contains("ssw0rd"));
    }

    #[test]
    fn tls_urls_need_the_feature() {
        let r = BrokerUrl::parse("amqps://u:secret@h:5671/%2f");
        if TLS_ENABLED {
            assert!(r.unwrap().is_tls());
        } else {
            let e = r.unwrap_err();
            assert!(matches!(e, UrlError::TlsDisabled { .. }));
            assert!(e.to_string().contains("`tls` feature"), "{e}");
            assert!(!e.to_string().contains("secret"));
        }
    }

    #[test]
    fn lists_and_passwords() {
        let l = BrokerUrl::parse_list(" amqp://u:a@h1 ; amqp://u:b@h2;").unwrap();
        assert_eq!(l.len(), 2);
        assert!(BrokerUrl::parse_list(" ; ").is_err());
        assert_eq!(
            with_password("amqp://app@h/%2f", "s3:c@t"),
            "amqp://app:s3%3Ac%40t@h/%2f"
        );
        assert_eq!(with_password("amqp://app:old@h", "new"), "amqp://app:new@h");
        let url = BrokerUrl::parse(&with_password("amqp://app@h/%2f", "s3:c@t")).unwrap();
        assert_eq!(url.uri().authority.userinfo.password, "s3:c@t");
    }
}
