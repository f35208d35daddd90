//! Broker URLs that never show their password: redaction for logs and errors, and a parsed form
//! that scrubs the password, in every spelling it could take, from any text.
//!
//! Redaction works on the raw text, so it also hides the password of a URL that does not parse:
//! `amqp:app:s3cret@host` (no `//`), an unencoded `@` in the password, several URLs separated by
//! `;`.
//!
//! ```
//! use redeliver::amqp::url::{redact, BrokerUrl};
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
///
/// A `;` that could end a URL as well as sit inside a password is not a separator either: when
/// an `@` follows somewhere after it and the text before it is not a whole URL (`scheme://`, a
/// userinfo closed by `@`, a host). `amqp://app:ab;amqp://cd@host` is one URL whose password is
/// `ab;amqp://cd` as much as two URLs: kept together, the whole stretch is masked as a password,
/// and [`BrokerUrl::parse_list`] refuses it as [`UrlError::Ambiguous`].
///
/// What stays undecidable: a password written raw that holds `@`, then `;` and a scheme
/// (`amqp://app:x@y;amqp://z@host` is a valid list of two URLs, and read so). Such a password
/// must be percent-encoded, as it must anyway for the URL to parse.
pub fn split_list(raw: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut from = 0;
    for (i, _) in raw.match_indices(';') {
        let rest = raw[i + 1..].trim_start_matches(|c: char| c == ';' || c.is_whitespace());
        let ambiguous = !whole_url(&raw[from..i]) && raw[i + 1..].contains('@');
        if rest.is_empty() || (starts_url(rest) && !ambiguous) {
            parts.push(&raw[from..i]);
            from = i + 1;
        }
    }
    parts.push(&raw[from..]);
    parts
}

/// Whether `piece` reads as a whole URL, not the start of one whose password goes on after a
/// `;`: `scheme://`, then no `user:` left open (a `:` without a later `@`), and a host after the
/// last `@`. A URL without `//` (`amqp:app:pw@host`) never parses, so it is never taken as
/// whole: masking too much of a broken list is the safe side.
fn whole_url(piece: &str) -> bool {
    let piece = piece.trim();
    let Some(n) = scheme_len(piece) else {
        return piece.is_empty();
    };
    if !piece[n + 1..].starts_with("//") {
        return false;
    }
    let rest = &piece[n + 3..];
    match rest.rfind('@') {
        Some(at) => !rest[at + 1..].trim().is_empty(),
        // `host:port` is not: the port may be the start of a password (which matters only when
        // an `@` follows, the caller's check).
        None => !rest.contains(':'),
    }
}

/// Where the userinfo would start in `url`: after its scheme (and `//`, when present:
/// `amqp:app:pw@host` is masked too), else after the first `://` when nothing before it can be
/// part of a userinfo (a URL in quotes, or with a stray character before it), else at the start:
/// text that is not a URL must still lose what could be a password (`:app:pw@h; x://a:b@c`).
fn userinfo_start(url: &str) -> usize {
    let lead = url.len() - url.trim_start().len();
    if let Some(n) = scheme_len(&url[lead..]) {
        let after = lead + n + 1;
        return if url[after..].starts_with("//") {
            after + 2
        } else {
            after
        };
    }
    match url.find("://") {
        Some(i) if !url[..i].contains([':', '@']) => i + 3,
        _ => 0,
    }
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
/// `/`, `?`, `#`, `@` or `://`. Text that does not start with a scheme (a URL in quotes, a
/// stray character before it) is read from its first `://`, or from its start.
fn password_range(url: &str) -> Option<(usize, usize)> {
    let start = userinfo_start(url);
    let at = start + url[start..].rfind('@')?;
    match url[start..at].find(':') {
        Some(colon) => Some((start + colon + 1, at)),
        // `app:pw@host`: what looked like a scheme without `//` is the user.
        None if start > 0 && !url[..start].ends_with("//") => Some((start, at)),
        None => None,
    }
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
    /// A list that mixes `amqps://` and `amqp://` URLs: if the TLS node could not be reached
    /// (or were made unreachable), the next URL would carry the password in clear text.
    #[error("'{redacted}' mixes amqps:// and amqp:// URLs: whoever can make the TLS node unreachable would get the password in clear text from the next one; use amqps:// for every URL (or amqp:// for every URL on a trusted network)")]
    MixedTls {
        /// The list, passwords masked.
        redacted: String,
    },
    /// A `;` in a list that may separate two URLs or belong to a password.
    #[error("'{redacted}' can be read as one URL whose password holds `;` or as several URLs; percent-encode a `;` in a password as %3B (and `@` as %40, `:` as %3A), or give every URL of the list its user")]
    Ambiguous {
        /// The text, with every possible password masked.
        redacted: String,
    },
    /// A password (from a password file) is to be put into a URL that has no user: refused,
    /// rather than logging in as the default user `guest`.
    #[error("'{redacted}' has no user to go with the password from the password file; write the user into the URL: amqp://USER@HOST:PORT/VHOST")]
    NoUser {
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
        // Redaction masks from the first `:` of the userinfo to the last `@`; the parser ends
        // the authority at the first `/`, `?` or `#`. Where the two disagree
        // (`amqp://u:p@ss/word@host` connects to host `ss`; `amqp://u:pw@rabbit/team@prod` has
        // a vhost holding `@`), the host, port or vhost would show part of what the user meant
        // as the password, and scrubbing would miss the password the parser found.
        if let Some((start, end)) = password_range(raw) {
            let masked = percent_decode_str(&raw[start..end]).decode_utf8_lossy();
            if masked != uri.authority.userinfo.password {
                return Err(UrlError::Invalid {
                    redacted,
                    reason: "its password cannot be told apart from the rest: percent-encode \
                             `@`, `/`, `?`, `#` and `:` in the password (%40, %2F, %3F, %23, \
                             %3A) and `@` in the vhost or the query (%40)"
                        .into(),
                });
            }
        }
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
    ///
    /// Refused: a list that mixes `amqps://` and `amqp://` ([`UrlError::MixedTls`], see
    /// [`check_list`]), and a `;` that may belong to a password ([`UrlError::Ambiguous`], see
    /// [`split_list`]).
    pub fn parse_list(raw: &str) -> Result<Vec<Self>, UrlError> {
        let entries: Vec<&str> = split_list(raw)
            .into_iter()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if entries.is_empty() {
            return Err(UrlError::Invalid {
                redacted: String::new(),
                reason: "empty".into(),
            });
        }
        // Checked before any entry is parsed: a parse error would show the ambiguous entry
        // redacted one way, and the user may have meant the other.
        if entries.iter().any(|e| has_separator_inside(e)) {
            return Err(UrlError::Ambiguous {
                redacted: redact(raw.trim()),
            });
        }
        let urls = entries
            .into_iter()
            .map(Self::parse)
            .collect::<Result<Vec<_>, _>>()?;
        check_list(&urls)?;
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

/// Whether `entry` (one entry of [`split_list`]) still holds a `;` followed by what starts a URL:
/// [`split_list`] kept it whole because the `;` may be part of a password.
fn has_separator_inside(entry: &str) -> bool {
    entry.match_indices(';').any(|(i, _)| {
        starts_url(entry[i + 1..].trim_start_matches(|c: char| c == ';' || c.is_whitespace()))
    })
}

/// Refuses a list of URLs that mixes `amqps://` and `amqp://` ([`UrlError::MixedTls`]): the
/// worker goes on with the next URL when one cannot be reached, so whoever can block the TLS
/// node would receive the password, in clear text, from the plain one.
///
/// ```
/// use redeliver::amqp::url::{check_list, BrokerUrl};
/// let plain = BrokerUrl::parse("amqp://app:pw@rabbit-1/%2f").unwrap();
/// assert!(check_list(&[plain.clone(), plain]).is_ok());
/// ```
pub fn check_list(urls: &[BrokerUrl]) -> Result<(), UrlError> {
    let tls = urls.iter().filter(|u| u.is_tls()).count();
    if tls == 0 || tls == urls.len() {
        return Ok(());
    }
    Err(UrlError::MixedTls {
        redacted: urls
            .iter()
            .map(BrokerUrl::redacted)
            .collect::<Vec<_>>()
            .join(";"),
    })
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
///
/// # Errors
///
/// [`UrlError::NoUser`] for a URL without a user (`amqp://rabbit/%2f`, `amqp://:old@rabbit`):
/// the broker would be asked to log in the default user `guest` with the file's password, which
/// is never what the file was meant for.
pub fn with_password(url: &str, password: &str) -> Result<String, UrlError> {
    use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
    // Unreserved characters stay as they are (RFC 3986), everything else is encoded.
    const USERINFO: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    let encoded = utf8_percent_encode(password, USERINFO).to_string();
    let no_user = |one: &str| UrlError::NoUser {
        redacted: redact(one),
    };
    split_list(url)
        .into_iter()
        .map(str::trim)
        .filter(|one| !one.is_empty())
        .map(|one| {
            let start = userinfo_start(one);
            if let Some((s, e)) = password_range(one) {
                // The user is what precedes the password's `:`.
                if one
                    .get(start..s - 1)
                    .is_none_or(|user| user.trim().is_empty())
                {
                    return Err(no_user(one));
                }
                return Ok(format!("{}{encoded}{}", &one[..s], &one[e..]));
            }
            // No password yet: after `user` in `scheme://user@host`.
            let end = one[start..]
                .find(['/', '?', '#'])
                .map_or(one.len(), |i| start + i);
            match one[start..end].rfind('@') {
                Some(at) if at > 0 => Ok(format!(
                    "{}:{encoded}{}",
                    &one[..start + at],
                    &one[start + at..]
                )),
                _ => Err(no_user(one)),
            }
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|urls| urls.join(";"))
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
        assert_eq!(
            secrets_of("amqp://u:pw@h;amqp://v:other@h"),
            ["other", "pw"]
        );
        // A URL without `//` never parses: what follows it may be its password, masked whole.
        assert_eq!(
            secrets_of("amqp:u:pw@h;amqp://v:other@h"),
            ["pw@h;amqp://v:other"]
        );
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
            with_password("amqp://app@h/%2f", "s3:c@t").unwrap(),
            "amqp://app:s3%3Ac%40t@h/%2f"
        );
        assert_eq!(
            with_password("amqp://app:old@h", "new").unwrap(),
            "amqp://app:new@h"
        );
        let url = BrokerUrl::parse(&with_password("amqp://app@h/%2f", "s3:c@t").unwrap()).unwrap();
        assert_eq!(url.uri().authority.userinfo.password, "s3:c@t");
    }

    #[test]
    fn a_list_mixing_tls_and_plain_is_refused() {
        for raw in [
            "amqps://app:tls-secret-1@r0:5671/%2f;amqp://app:tls-secret-1@r1:5672/%2f",
            "amqp://app:tls-secret-1@r0/%2f ; amqps://app:tls-secret-1@r1/%2f",
        ] {
            let e = BrokerUrl::parse_list(raw).unwrap_err();
            if TLS_ENABLED {
                assert!(matches!(e, UrlError::MixedTls { .. }), "{raw}: {e}");
                assert!(e.to_string().contains("clear text"), "{e}");
            }
            assert!(!format!("{e} {e:?}").contains("tls-secret"), "{e:?}");
        }
        assert_eq!(
            BrokerUrl::parse_list("amqp://a@r0;amqp://a@r1")
                .unwrap()
                .len(),
            2
        );
        if TLS_ENABLED {
            assert_eq!(
                BrokerUrl::parse_list("amqps://a@r0;amqps://a@r1")
                    .unwrap()
                    .len(),
                2
            );
        }
    }

    #[test]
    fn a_semicolon_that_may_be_in_a_password_is_masked_and_refused() {
        // Read as two URLs, the first would show `pw-first` as a port; read as one, it is the
        // start of the password `pw-first;amqp://pw-second`.
        let raw = "amqp://app:pw-first;amqp://pw-second@rabbit/%2f";
        assert_eq!(split_list(raw), [raw]);
        assert_eq!(redact(raw), "amqp://app:***@rabbit/%2f");
        let e = BrokerUrl::parse_list(raw).unwrap_err();
        assert!(matches!(e, UrlError::Ambiguous { .. }), "{e}");
        assert!(!format!("{e} {e:?}").contains("pw-"), "{e}");
        // Same with a port, which a first URL without a user could have.
        let raw = "amqp://app:5672;amqp://u:pw-x@rabbit";
        assert_eq!(redact(raw), "amqp://app:***@rabbit");
        assert!(matches!(
            BrokerUrl::parse_list(raw),
            Err(UrlError::Ambiguous { .. })
        ));
        // Lists where every URL has its user, or none has one, are not ambiguous.
        assert_eq!(
            split_list("amqp://h0:5672/%2f;amqp://h1:5672/%2f"),
            ["amqp://h0:5672/%2f", "amqp://h1:5672/%2f"]
        );
        assert_eq!(
            BrokerUrl::parse_list("amqp://u:p0@h0:5672/%2f;amqp://u:p1@h1:5672/%2f")
                .unwrap()
                .len(),
            2
        );
        // Percent-encoded, the `;` is no longer a question.
        let one = BrokerUrl::parse_list("amqp://app:pw%3Bamqp%3A%2F%2Fx@rabbit/%2f").unwrap();
        assert_eq!(one[0].uri().authority.userinfo.password, "pw;amqp://x");
    }

    #[test]
    fn urls_that_do_not_start_with_their_scheme_are_redacted_too() {
        for (raw, shown) in [
            (
                "'amqp://app:quoted-pw@rabbit/%2f'",
                "'amqp://app:***@rabbit/%2f'",
            ),
            (
                "\"amqp://app:quoted-pw@rabbit\"",
                "\"amqp://app:***@rabbit\"",
            ),
            ("x amqp://app:quoted-pw@rabbit", "x amqp://app:***@rabbit"),
            ("app:quoted-pw@rabbit", "app:***@rabbit"),
            (
                "\u{fffd}amqp://app:quoted-pw@rabbit",
                "\u{fffd}amqp://app:***@rabbit",
            ),
        ] {
            assert_eq!(redact(raw), shown, "{raw}");
            let e = BrokerUrl::parse(raw).unwrap_err();
            assert!(!format!("{e} {e:?}").contains("quoted-pw"), "{e}");
        }
    }

    #[test]
    fn a_url_whose_password_the_parser_reads_otherwise_is_refused() {
        for raw in [
            // The parser would connect to host `ss` and call the rest the vhost.
            "amqp://u:p@ss/word@rabbit/%2f",
            // An `@` in the vhost: the parser's password is only `s3cret`.
            "amqp://app:s3cret@rabbit/team@prod",
            "amqp://app:s3cret@rabbit/%2f?x=@y",
            // No `//`: the parser would take it all as the vhost.
            "amqp:/app:s3cret@rabbit",
        ] {
            let e = BrokerUrl::parse(raw).unwrap_err();
            assert!(matches!(e, UrlError::Invalid { .. }), "{raw}: {e}");
            let shown = format!("{e} {e:?}");
            for piece in ["s3cret", "p@ss", "ss/word"] {
                assert!(!shown.contains(piece), "{raw}: {shown}");
            }
        }
        // Percent-encoded, both read the same: accepted, and the password is scrubbed alone.
        let url = BrokerUrl::parse("amqp://app:s3cret@rabbit/team%40prod").unwrap();
        assert_eq!(url.vhost(), "team@prod");
        assert_eq!(url.scrub("refused s3cret"), "refused ***");
        let url = BrokerUrl::parse("amqp://u:p%40ss%2Fword@rabbit/%2f").unwrap();
        assert_eq!(url.endpoint(), "rabbit:5672");
    }

    #[test]
    fn text_before_a_later_scheme_is_masked_from_its_start() {
        let raw = ":app:pw-early@h; x://a:b@c";
        assert!(!redact(raw).contains("pw-early"), "{}", redact(raw));
        let e = BrokerUrl::parse(raw).unwrap_err();
        assert!(!format!("{e} {e:?}").contains("pw-early"), "{e}");
        let e = BrokerUrl::parse_list(raw).unwrap_err();
        assert!(!format!("{e} {e:?}").contains("pw-early"), "{e}");
    }

    #[test]
    fn a_password_file_needs_a_user_in_the_url() {
        for raw in [
            "amqp://rabbit:5672/%2f",
            "amqp://rabbit",
            "amqp://@rabbit/%2f",
            "amqp://:old-pw@rabbit/%2f",
            "amqp://app@r0/%2f;amqp://r1/%2f",
        ] {
            let e = with_password(raw, "file-pw").unwrap_err();
            assert!(matches!(e, UrlError::NoUser { .. }), "{raw}: {e}");
            assert!(!format!("{e} {e:?}").contains("old-pw"), "{e}");
            assert!(!format!("{e} {e:?}").contains("file-pw"), "{e}");
        }
        assert_eq!(
            with_password("amqp://app@r0/%2f;amqp://app:old@r1/%2f", "p;w").unwrap(),
            "amqp://app:p%3Bw@r0/%2f;amqp://app:p%3Bw@r1/%2f"
        );
    }
}
