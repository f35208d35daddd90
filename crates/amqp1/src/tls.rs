//! TLS of the AMQP 1.0 consumer (`amqps://`), with the `tls` feature.
//!
//! RabbitMQ serves AMQP 1.0 on its AMQPS port as on its AMQP port, so the consumer uses the
//! URL's port and the TLS settings of the 0-9-1 connections ([`TlsConfig`]: CA bundle, client
//! certificate, SASL EXTERNAL). The layers, from the socket up:
//!
//! 1. TCP, then the TLS handshake: rustls with the ring provider (the TLS lapin already builds),
//!    trusting the system's root certificates plus the CA bundle, presenting the client
//!    certificate for mutual TLS. The broker's certificate must name [`Tls::server_name`].
//! 2. The nesting guard ([`GuardedStream`](crate::guard::GuardedStream)) on the plaintext side
//!    of TLS: it reads AMQP frames, not records.
//! 3. fe2o3-amqp on the guarded stream as on a plain socket (its `amqp` scheme: TLS is done).
//!    SASL PLAIN through fe2o3; SASL EXTERNAL (the broker takes the user from the client
//!    certificate) negotiated here before fe2o3 takes over, since fe2o3 0.18.4 refuses
//!    EXTERNAL on a stream it did not encrypt itself (`InvalidSchemeForSaslExternal`).
//!
//! A refused certificate is an [`Error::TlsHandshake`](crate::Error::TlsHandshake) whose reason
//! is rustls' and says what to check, as the 0-9-1 side's `ConnectError::TlsHandshake` does.

use redeliver_amqp::TlsConfig;

/// Whether this build connects over TLS (the `tls` feature). Without it an [`Endpoint`] with
/// [`Endpoint::tls`] set is refused before connecting, never sent in plain text.
///
/// [`Endpoint`]: crate::Endpoint
/// [`Endpoint::tls`]: crate::Endpoint::tls
pub const SUPPORTED: bool = cfg!(feature = "tls");

/// How an [`Endpoint`](crate::Endpoint) speaks TLS: the name to verify and the settings of the
/// 0-9-1 side, whose files are read at every open (a rotated certificate is picked up at the
/// next reconnect).
///
/// ```
/// use redeliver_amqp::TlsConfig;
/// use redeliver_amqp1::Tls;
///
/// let tls = Tls::new(
///     "rabbit.internal",
///     TlsConfig::new()
///         .ca_file("/etc/redeliver/ca.pem")
///         .client_cert("/etc/redeliver/client.pem", "/etc/redeliver/client.key")
///         .sasl_external(true),
/// );
/// assert!(tls.config.configured_sasl_external());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tls {
    /// The name the broker's certificate must list: the URL's host (a DNS name or an IP
    /// address).
    pub server_name: String,
    /// CA bundle (trusted next to the system's roots), client certificate and key, and SASL
    /// EXTERNAL (which needs the client certificate; the endpoint's user and password are then
    /// not sent).
    pub config: TlsConfig,
}

impl Tls {
    /// TLS to `server_name` with `config`.
    pub fn new(server_name: impl Into<String>, config: TlsConfig) -> Self {
        Self {
            server_name: server_name.into(),
            config,
        }
    }
}

/// What to check, for a handshake failure; the same advice as the 0-9-1 side's.
#[cfg_attr(not(feature = "tls"), allow(dead_code))]
mod hints {
    pub(super) const UNKNOWN_ISSUER: &str = "the broker's certificate is not signed by a trusted CA: give its CA bundle (REDELIVER_TLS_CA_FILE, --tls-ca-file, TlsConfig::ca_file)";
    pub(super) const WRONG_NAME: &str =
        "the broker's certificate does not name this host: connect by a name the certificate lists";
    pub(super) const EXPIRED: &str = "the broker's certificate has expired";
    pub(super) const CLIENT_CERT_REFUSED: &str = "the broker refused the client certificate: it must be signed by a CA the broker trusts (its ssl_options.cacertfile), or the broker requires one";
    pub(super) const CLOSED_AFTER_HANDSHAKE: &str = "the broker closed the connection right after the TLS handshake: most likely it refused the client certificate, which must be signed by a CA the broker trusts (its ssl_options.cacertfile)";
    pub(super) const NOT_TLS: &str = "the port does not speak TLS (is it the plain AMQP port?)";
    pub(super) const CHECK: &str =
        "check the CA bundle, the client certificate and that the port speaks TLS";
}

#[cfg(feature = "tls")]
pub(crate) use imp::{after_handshake, sasl_external, Connector, SaslFailure};

#[cfg(feature = "tls")]
mod imp {
    use std::error::Error as StdError;
    use std::io;
    use std::sync::Arc;

    use fe2o3_amqp::frames::sasl::Frame;
    use fe2o3_amqp::types::primitives::{Binary, Symbol};
    use fe2o3_amqp::types::sasl::{SaslCode, SaslInit};
    use futures_rustls::rustls::{
        self, AlertDescription, CertificateError, ClientConfig, RootCertStore,
    };
    use futures_rustls::TlsConnector;
    use lapin::tcp::OwnedIdentity;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio_util::compat::{
        Compat, FuturesAsyncReadCompatExt as _, TokioAsyncReadCompatExt as _,
    };

    use super::{hints, Tls};
    use crate::Error;

    /// The plaintext side of a TLS connection, as tokio I/O.
    pub(crate) type TlsStream = Compat<futures_rustls::client::TlsStream<Compat<TcpStream>>>;

    /// What the handshake needs, ready before connecting: the settings' files are read, and
    /// an unusable setting is refused without touching the network.
    pub(crate) struct Connector {
        connector: TlsConnector,
        name: ServerName<'static>,
        client_cert: bool,
    }

    impl Connector {
        /// Reads `tls`'s files and the system's roots.
        pub(crate) fn new(tls: &Tls) -> Result<Self, Error> {
            let config = client_config(tls)?;
            let name = ServerName::try_from(tls.server_name.clone()).map_err(|e| {
                Error::Tls(format!(
                    "'{}' is not a host name or address TLS can verify: {e}",
                    tls.server_name
                ))
            })?;
            Ok(Self {
                connector: TlsConnector::from(Arc::new(config)),
                name,
                client_cert: tls.config.configured_client_cert().is_some(),
            })
        }

        /// The TLS handshake on `tcp`, connected to `endpoint` (`host:port`, for messages).
        pub(crate) async fn handshake(
            self,
            tcp: TcpStream,
            endpoint: &str,
        ) -> Result<TlsStream, Error> {
            match self.connector.connect(self.name, tcp.compat()).await {
                Ok(stream) => Ok(stream.compat()),
                Err(e) => {
                    let hint = classify(&e, self.client_cert).unwrap_or(hints::CHECK);
                    Err(Error::TlsHandshake {
                        endpoint: endpoint.to_owned(),
                        reason: format!("{e}: {hint}"),
                    })
                }
            }
        }
    }

    /// A failure after the handshake that is TLS's: the broker's alert refusing the client
    /// certificate (TLS 1.3 checks it after the client considers the handshake done), or the
    /// reset that often replaces that alert. `None` for anything else.
    pub(crate) fn after_handshake(
        error: &(dyn StdError + 'static),
        tls: &Tls,
        endpoint: &str,
    ) -> Option<Error> {
        let client_cert = tls.config.configured_client_cert().is_some();
        let (hint, cause) = match rustls_error(error) {
            Some(e) => (classify_rustls(e), e.to_string()),
            None if client_cert && io_kind(error).is_some_and(is_reset) => (
                hints::CLOSED_AFTER_HANDSHAKE,
                io_kind(error).map(|k| k.to_string()).unwrap_or_default(),
            ),
            None => return None,
        };
        Some(Error::TlsHandshake {
            endpoint: endpoint.to_owned(),
            reason: format!("{cause}: {hint}"),
        })
    }

    /// The hint for an I/O error of the handshake, if one applies.
    fn classify(error: &io::Error, client_cert: bool) -> Option<&'static str> {
        if let Some(e) = error
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(classify_rustls(e));
        }
        if is_reset(error.kind()) {
            // A broker that refuses a TLS 1.2 client certificate alerts and closes; so does a
            // plain AMQP port, which answers a ClientHello with its protocol header and closes.
            return Some(if client_cert {
                hints::CLOSED_AFTER_HANDSHAKE
            } else {
                hints::NOT_TLS
            });
        }
        None
    }

    fn classify_rustls(e: &rustls::Error) -> &'static str {
        match e {
            rustls::Error::InvalidCertificate(c) => match c {
                CertificateError::UnknownIssuer => hints::UNKNOWN_ISSUER,
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => hints::WRONG_NAME,
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    hints::EXPIRED
                }
                _ => hints::CHECK,
            },
            rustls::Error::AlertReceived(
                AlertDescription::UnknownCA
                | AlertDescription::BadCertificate
                | AlertDescription::CertificateRequired
                | AlertDescription::CertificateUnknown
                | AlertDescription::UnsupportedCertificate,
            ) => hints::CLIENT_CERT_REFUSED,
            rustls::Error::InvalidMessage(_) => hints::NOT_TLS,
            _ => hints::CHECK,
        }
    }

    fn is_reset(kind: io::ErrorKind) -> bool {
        matches!(
            kind,
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof
        )
    }

    /// rustls' error in `error`'s chain (futures-rustls carries it inside an `io::Error`).
    fn rustls_error<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(r) = e.downcast_ref::<rustls::Error>() {
                return Some(r);
            }
            if let Some(r) = e
                .downcast_ref::<io::Error>()
                .and_then(io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                return Some(r);
            }
            next = e.source();
        }
        None
    }

    /// The kind of the first `io::Error` in `error`'s chain.
    fn io_kind(error: &(dyn StdError + 'static)) -> Option<io::ErrorKind> {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(io) = e.downcast_ref::<io::Error>() {
                return Some(io.kind());
            }
            next = e.source();
        }
        None
    }

    /// rustls' client configuration: ring, the system's roots and the CA bundle, the client
    /// certificate if any. Reads the files now.
    fn client_config(tls: &Tls) -> Result<ClientConfig, Error> {
        if tls.config.configured_sasl_external() && tls.config.configured_client_cert().is_none() {
            return Err(Error::Tls(
                redeliver_amqp::TlsError::SaslExternalWithoutCert.to_string(),
            ));
        }
        let loaded = tls.config.load().map_err(|e| Error::Tls(e.to_string()))?;
        let mut roots = RootCertStore::empty();
        // Unreadable system certificates are skipped, as lapin does: the CA bundle may be all
        // that is needed.
        let system = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(system.certs);
        if let (Some(pem), Some(path)) = (&loaded.cert_chain, tls.config.configured_ca_file()) {
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                let added = cert
                    .map_err(|e| e.to_string())
                    .and_then(|c| roots.add(c).map_err(|e| e.to_string()));
                if let Err(e) = added {
                    return Err(Error::Tls(format!(
                        "the CA bundle {} holds a certificate that cannot be used: {e}",
                        path.display()
                    )));
                }
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Tls(e.to_string()))?
            .with_root_certificates(roots);
        let config = match (loaded.identity, tls.config.configured_client_cert()) {
            (Some(OwnedIdentity::PKCS8 { pem, key }), Some((cert_path, key_path))) => {
                let chain = CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| {
                        Error::Tls(format!(
                            "the client certificate {} is not PEM: {e}",
                            cert_path.display()
                        ))
                    })?;
                if chain.is_empty() {
                    return Err(Error::Tls(format!(
                        "the client certificate {} holds no PEM certificate",
                        cert_path.display()
                    )));
                }
                let key = PrivateKeyDer::from_pem_slice(&key).map_err(|e| {
                    Error::Tls(format!(
                        "the client key {} holds no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}",
                        key_path.display()
                    ))
                })?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    Error::Tls(format!(
                        "the client certificate {} and key {} cannot be used: {e}",
                        cert_path.display(),
                        key_path.display()
                    ))
                })?
            }
            (None, _) => builder.with_no_client_auth(),
            // TlsConfig::load only makes PEM identities, with their paths.
            (Some(_), _) => {
                return Err(Error::Tls(
                    "only a PEM client certificate and key are supported".to_owned(),
                ))
            }
        };
        Ok(config)
    }

    /// The SASL protocol header of AMQP 1.0.
    const SASL_HEADER: [u8; 8] = *b"AMQP\x03\x01\x00\x00";
    /// SASL frames are small (the mechanisms, an outcome): anything larger is not one.
    const MAX_SASL_FRAME: usize = 64 * 1024;
    const EXTERNAL: &str = "EXTERNAL";

    /// SASL EXTERNAL on `stream` (TLS done, nothing else sent yet): the broker takes the user
    /// from the client certificate. Leaves the stream where fe2o3 starts without SASL: at the
    /// AMQP protocol header.
    pub(crate) async fn sasl_external<S>(stream: &mut S, hostname: &str) -> Result<(), SaslFailure>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let refused = SaslFailure::Refused;
        stream.write_all(&SASL_HEADER).await?;
        stream.flush().await?;
        let mut header = [0u8; 8];
        stream.read_exact(&mut header).await?;
        if header != SASL_HEADER {
            return Err(refused(format!(
                "the broker answered the AMQP 1.0 SASL header with {}: it does not serve AMQP 1.0 with SASL here",
                String::from_utf8_lossy(&header).escape_debug()
            )));
        }
        match read_frame(stream).await? {
            Frame::Mechanisms(m) => {
                let offered: Vec<&str> = m
                    .sasl_server_mechanisms
                    .0
                    .iter()
                    .map(|s| s.0.as_str())
                    .collect();
                if !offered.contains(&EXTERNAL) {
                    return Err(refused(format!(
                        "the broker does not offer SASL EXTERNAL (it offers {}): enable its rabbitmq_auth_mechanism_ssl plugin and list EXTERNAL in auth_mechanisms",
                        offered.join(", ")
                    )));
                }
            }
            other => {
                return Err(refused(format!(
                    "expected the SASL mechanisms, got {other:?}"
                )))
            }
        }
        let init = Frame::Init(SaslInit {
            mechanism: Symbol::from(EXTERNAL),
            // Empty: the identity is the certificate's.
            initial_response: Some(Binary::from(Vec::new())),
            hostname: Some(hostname.to_owned()),
        });
        write_frame(stream, &init).await?;
        match read_frame(stream).await? {
            Frame::Outcome(o) if o.code == SaslCode::Ok => Ok(()),
            Frame::Outcome(o) => Err(refused(format!(
                "SASL EXTERNAL refused ({:?}): the broker found no user named by the client certificate (RabbitMQ: ssl_cert_login_from, the user must exist)",
                o.code
            ))),
            other => Err(refused(format!("expected the SASL outcome, got {other:?}"))),
        }
    }

    /// Why SASL EXTERNAL failed.
    pub(crate) enum SaslFailure {
        /// Reading or writing (TLS may explain it: a refused client certificate).
        Io(io::Error),
        /// The broker's answer.
        Refused(String),
    }

    impl From<io::Error> for SaslFailure {
        fn from(e: io::Error) -> Self {
            SaslFailure::Io(e)
        }
    }

    async fn read_frame<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Frame, SaslFailure> {
        let bad = |reason: String| SaslFailure::Refused(format!("SASL EXTERNAL: {reason}"));
        let size = stream.read_u32().await? as usize;
        if !(8..=MAX_SASL_FRAME).contains(&size) {
            return Err(bad(format!("a SASL frame of {size} bytes")));
        }
        let mut frame = vec![0u8; size - 4];
        stream.read_exact(&mut frame).await?;
        let (doff, kind) = (usize::from(frame[0]), frame[1]);
        if kind != 1 || doff < 2 || doff * 4 > size {
            return Err(bad(format!("not a SASL frame (type {kind}, doff {doff})")));
        }
        serde_amqp::from_slice(&frame[doff * 4 - 4..]).map_err(|e| bad(e.to_string()))
    }

    async fn write_frame<S: AsyncWrite + Unpin>(
        stream: &mut S,
        frame: &Frame,
    ) -> Result<(), SaslFailure> {
        let body = serde_amqp::to_vec(frame)
            .map_err(|e| SaslFailure::Refused(format!("SASL EXTERNAL: {e}")))?;
        let mut out = Vec::with_capacity(body.len() + 8);
        out.extend_from_slice(&((body.len() + 8) as u32).to_be_bytes());
        out.extend_from_slice(&[2, 1, 0, 0]);
        out.extend_from_slice(&body);
        stream.write_all(&out).await?;
        Ok(stream.flush().await?)
    }
}
