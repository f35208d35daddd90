//! TLS (`amqps://`) and how every connection of redeliver is opened.

use std::fmt;
use std::path::{Path, PathBuf};

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::uri::SASLMechanism;
use lapin::{Connection, ConnectionProperties};

use crate::url::{BrokerUrl, UrlError};

/// TLS settings of a connection. Paths are read when connecting, so a rotated certificate is
/// picked up at the next reconnect. `Debug` shows paths only.
///
/// With the `tls` feature (on by default in `redeliver` and the CLI) an `amqps://` URL connects
/// through rustls: the broker's certificate must chain to a root of the system store or to the CA
/// bundle given here, and must name the URL's host. There is no switch to accept an invalid
/// certificate. Without the feature an `amqps://` URL is refused before anything connects, never
/// sent in plain text.
///
/// Mutual TLS: a client certificate and key (PEM). With [`TlsConfig::sasl_external`] the broker
/// logs the client in by that certificate (RabbitMQ's `rabbitmq_auth_mechanism_ssl` plugin, user
/// named by the certificate's CN by default) and the URL needs no password.
///
/// ```no_run
/// # async fn demo() -> Result<(), redeliver::amqp::ConnectError> {
/// use redeliver::lapin::ConnectionProperties;
/// use redeliver::TlsConfig;
/// use redeliver::amqp::connect;
///
/// let tls = TlsConfig::new()
///     .ca_file("/etc/redeliver/ca.pem")
///     .client_cert("/etc/redeliver/client.pem", "/etc/redeliver/client.key")
///     .sasl_external(true);
/// let conn = connect("amqps://rabbit.internal:5671/%2f", ConnectionProperties::default(), &tls).await?;
/// # let _ = conn; Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    ca_file: Option<PathBuf>,
    client_cert: Option<(PathBuf, PathBuf)>,
    sasl_external: bool,
}

impl TlsConfig {
    /// No CA bundle (the system's roots), no client certificate, password login.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also trust the CA certificates of this PEM file (a private CA), next to the system's.
    ///
    /// Read it back with [`Self::configured_ca_file`].
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Present this client certificate (PEM, the chain after it allowed) with its private key
    /// (PEM: PKCS#8, PKCS#1 or SEC1) for mutual TLS.
    ///
    /// Read it back with [`Self::configured_client_cert`].
    pub fn client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_cert = Some((cert.into(), key.into()));
        self
    }

    /// Log in with SASL EXTERNAL: the broker takes the identity from the client certificate.
    /// Needs [`Self::client_cert`] and an `amqps://` URL.
    ///
    /// Read it back with [`Self::configured_sasl_external`].
    pub fn sasl_external(mut self, yes: bool) -> Self {
        self.sasl_external = yes;
        self
    }

    /// The CA bundle, if any.
    pub fn configured_ca_file(&self) -> Option<&Path> {
        self.ca_file.as_deref()
    }

    /// The client certificate and key, if any.
    pub fn configured_client_cert(&self) -> Option<(&Path, &Path)> {
        self.client_cert
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path()))
    }

    /// Whether SASL EXTERNAL is asked for.
    pub fn configured_sasl_external(&self) -> bool {
        self.sasl_external
    }

    /// Whether anything differs from the defaults.
    pub fn is_configured(&self) -> bool {
        *self != Self::default()
    }

    /// Checks the settings against a URL: TLS settings need `amqps://` (they would be ignored on
    /// a plain connection, which is never what was meant), SASL EXTERNAL needs a client
    /// certificate.
    pub fn check(&self, url: &BrokerUrl) -> Result<(), ConnectError> {
        if self.sasl_external && self.client_cert.is_none() {
            return Err(TlsError::SaslExternalWithoutCert.into());
        }
        if self.is_configured() && !url.is_tls() {
            return Err(TlsError::NotAmqps {
                redacted: url.redacted().to_owned(),
            }
            .into());
        }
        Ok(())
    }

    /// Reads the files into lapin's form.
    pub fn load(&self) -> Result<OwnedTLSConfig, ConnectError> {
        let read = |what: &'static str, p: &Path| {
            std::fs::read(p).map_err(|error| TlsError::Read {
                what,
                path: p.to_owned(),
                error,
            })
        };
        let cert_chain = match &self.ca_file {
            Some(p) => {
                let pem = read("CA bundle", p)?;
                let pem =
                    String::from_utf8(pem).map_err(|_| TlsError::NotPem { path: p.to_owned() })?;
                if !pem.contains("-----BEGIN CERTIFICATE-----") {
                    return Err(TlsError::NoCertificate { path: p.to_owned() }.into());
                }
                Some(pem)
            }
            None => None,
        };
        let identity = match &self.client_cert {
            Some((cert, key)) => Some(OwnedIdentity::PKCS8 {
                pem: read("client certificate", cert)?,
                key: read("client key", key)?,
            }),
            None => None,
        };
        Ok(OwnedTLSConfig {
            identity,
            cert_chain,
        })
    }
}

/// Why a connection could not be opened. Messages name the broker by its redacted URL.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL is unusable (or asks for TLS in a build without it).
    #[error(transparent)]
    Url(#[from] UrlError),
    /// The TLS settings are unusable.
    #[error("TLS: {0}")]
    Tls(TlsError),
    /// The broker's certificate was refused (unknown CA, wrong host name, expired), or the broker
    /// refused ours.
    #[error("TLS handshake with {endpoint} failed: {reason}")]
    TlsHandshake {
        /// `host:port`.
        endpoint: String,
        /// rustls' reason, e.g. `invalid peer certificate: UnknownIssuer`, and what to check.
        reason: String,
    },
    /// Connecting failed (refused, unreachable, authentication, ...). The message is lapin's:
    /// callers say where they connected (the URL is in `redacted`).
    #[error("{source}")]
    Amqp {
        /// The URL, password masked.
        redacted: String,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
}

// By hand, not `#[from]`: the message already holds the inner one, which as `source()` too
// would be printed twice by a chain printer.
impl From<TlsError> for ConnectError {
    fn from(e: TlsError) -> Self {
        ConnectError::Tls(e)
    }
}

/// Why the TLS settings cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// SASL EXTERNAL without a client certificate to log in with.
    #[error(
        "SASL EXTERNAL logs in with the client certificate: give one (client certificate and key)"
    )]
    SaslExternalWithoutCert,
    /// TLS settings for a plain `amqp://` URL, where they would be ignored.
    #[error("TLS settings (CA bundle, client certificate, SASL EXTERNAL) are given but '{redacted}' is not an amqps:// URL")]
    NotAmqps {
        /// The URL, password masked.
        redacted: String,
    },
    /// A file of the settings cannot be read.
    #[error("cannot read the {what} {}: {error}", path.display())]
    Read {
        /// `CA bundle`, `client certificate` or `client key`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error (in the message, so not also a `source()`).
        error: std::io::Error,
    },
    /// The CA bundle is not text.
    #[error("the CA bundle {} is not PEM text", path.display())]
    NotPem {
        /// The file.
        path: PathBuf,
    },
    /// The CA bundle holds no `BEGIN CERTIFICATE` block.
    #[error("the CA bundle {} holds no PEM certificate", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
}

impl ConnectError {
    /// lapin's error, when connecting itself failed.
    pub fn lapin(&self) -> Option<&lapin::Error> {
        match self {
            ConnectError::Amqp { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Connects to `url` with `tls` (ignored for `amqp://` unless configured, which is an error).
pub async fn connect(
    url: &str,
    props: ConnectionProperties,
    tls: &TlsConfig,
) -> Result<Connection, ConnectError> {
    connect_url(&BrokerUrl::parse(url)?, props, tls).await
}

/// [`connect`] for a parsed URL.
pub async fn connect_url(
    url: &BrokerUrl,
    props: ConnectionProperties,
    tls: &TlsConfig,
) -> Result<Connection, ConnectError> {
    tls.check(url)?;
    let mut uri = url.uri().clone();
    if tls.configured_sasl_external() {
        uri.query.auth_mechanism = Some(SASLMechanism::External);
    }
    let owned = if url.is_tls() {
        tls.load()?
    } else {
        OwnedTLSConfig::default()
    };
    // Through the header guard: lapin's parser overflows its thread's stack on deeply nested
    // headers, and a publisher decides how deep they nest (see `frame_guard`).
    crate::frame_guard::connect(uri, props, owned)
        .await
        .map_err(|source| classify(url, tls.client_cert.is_some(), source))
}

/// TLS failures reach lapin as I/O errors carrying rustls' message: made a typed error with a hint.
fn classify(url: &BrokerUrl, client_cert: bool, source: lapin::Error) -> ConnectError {
    if url.is_tls() {
        if let lapin::ErrorKind::IOError(io) = source.kind() {
            let text = io.to_string();
            // With TLS 1.3 the broker checks a client certificate after the client considers
            // the handshake done; it then sends an alert and closes, and the alert is often lost
            // to the reset.
            let reset = matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            );
            let hint = if text.contains("UnknownIssuer") || text.contains("unknown issuer") {
                Some("the broker's certificate is not signed by a trusted CA: give its CA bundle (REDELIVER_TLS_CA_FILE, --tls-ca-file, TlsConfig::ca_file)")
            } else if text.contains("NotValidForName") || text.contains("not valid for name") {
                Some("the broker's certificate does not name this host: connect by a name the certificate lists")
            } else if text.contains("Expired") {
                Some("the broker's certificate has expired")
            } else if text.contains("alert")
                && ["UnknownCA", "BadCertificate", "CertificateRequired"]
                    .iter()
                    .any(|a| text.contains(a))
            {
                Some("the broker refused the client certificate: it must be signed by a CA the broker trusts (its ssl_options.cacertfile), or the broker requires one")
            } else if reset && client_cert {
                Some("the broker closed the connection right after the TLS handshake: most likely it refused the client certificate, which must be signed by a CA the broker trusts (its ssl_options.cacertfile)")
            } else if text.contains("certificate")
                || text.contains("alert")
                || text.contains("handshake")
            {
                Some("check the CA bundle, the client certificate and that the port speaks TLS")
            } else if text.contains("InvalidContentType") || text.contains("corrupt message") {
                Some("the port does not speak TLS (is it the plain AMQP port?)")
            } else {
                None
            };
            if let Some(hint) = hint {
                return ConnectError::TlsHandshake {
                    endpoint: url.endpoint(),
                    reason: format!("{}: {hint}", url.scrub(&text)),
                };
            }
        }
    }
    ConnectError::Amqp {
        redacted: url.redacted().to_owned(),
        source,
    }
}

impl fmt::Display for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.ca_file {
            Some(p) => write!(f, "CA {}", p.display())?,
            None => f.write_str("system CAs")?,
        }
        if let Some((c, _)) = &self.client_cert {
            write!(f, ", client certificate {}", c.display())?;
        }
        if self.sasl_external {
            f.write_str(", SASL EXTERNAL")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_against_the_url() {
        let plain = BrokerUrl::parse("amqp://u:p@h/%2f").unwrap();
        assert!(TlsConfig::new().check(&plain).is_ok());
        let with_ca = TlsConfig::new().ca_file("/ca.pem");
        assert!(with_ca
            .check(&plain)
            .unwrap_err()
            .to_string()
            .contains("not an amqps://"));
        let external = TlsConfig::new().sasl_external(true);
        assert!(external
            .check(&plain)
            .unwrap_err()
            .to_string()
            .contains("client certificate"));
        assert_eq!(
            TlsConfig::new()
                .ca_file("/a.pem")
                .client_cert("/c.pem", "/k.pem")
                .sasl_external(true)
                .to_string(),
            "CA /a.pem, client certificate /c.pem, SASL EXTERNAL"
        );
    }

    #[test]
    fn unreadable_files_are_named() {
        let e = TlsConfig::new()
            .ca_file("/nonexistent/ca.pem")
            .load()
            .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
    }
}
