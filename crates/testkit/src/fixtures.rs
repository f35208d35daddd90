//! What the tests need from this machine, brought up by the tests themselves, once.
//!
//! `git clone` then `cargo test --workspace` must pass on a machine that has RabbitMQ as its
//! distribution installs it, with nothing run before. So the first test that needs a piece
//! brings it up, and every other test (of any test binary, even running at the same time) finds
//! it ready:
//!
//! - [`broker`]: the broker at `AMQP_URL` answers. When it is the machine's own default node
//!   (`127.0.0.1:5672`), installed but stopped, it is started (`rabbitmq-server -detached`).
//!   Anything else that does not answer fails at once, naming what to run.
//! - [`management`]: the management API answers. The machine's own node gets its plugin
//!   enabled (`rabbitmq-plugins enable rabbitmq_management`), which starts the API without
//!   restarting the broker, so a test already connected loses nothing.
//! - [`tls`]: an amqps listener with throwaway certificates. The machine's broker is never
//!   reconfigured for it (that would mean a restart under the feet of other tests): the
//!   certificates are made here (rcgen) and a dedicated node, `rdtls-1@localhost`, is started
//!   with `scripts/cluster.sh` (of the `RD_CLUSTER_CHROOT` version when that is set) and left
//!   running for the next test binary and the next run.
//!
//! Each step runs under an exclusive lock on a file in the temporary directory, so two test
//! binaries started together do not both enable, generate or start; the loser re-checks and
//! finds the work done. A step's result is kept for the life of the process: a broker that is
//! not there fails every test quickly, with the same message.

use std::fs::File;
use std::io::Write as _;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a started broker, an enabled plugin or a started TLS node get to answer.
const BRING_UP: Duration = Duration::from_secs(90);

/// How long one probe of a port may take: a refused connection answers at once, a host that
/// drops packets must not stall the test.
const PROBE: Duration = Duration::from_secs(2);

/// AMQP port of the TLS node (`rdtls-1@localhost`); its amqps listener is this + 1000.
const TLS_NODE_BASE_PORT: u16 = 5697;

/// Name of the TLS node for `scripts/cluster.sh` (`.ci/run` reaps it between brokers). Its
/// management API listens on the AMQP port + 10000.
const TLS_NODE_NAME: &str = "rdtls";

/// What to do when no broker answers; the tail of every such failure.
pub const START_BROKER: &str = "\
To start one:
  - Debian/Ubuntu: `sudo apt-get install rabbitmq-server` (the tests enable its management plugin \
themselves), or `sudo rabbitmq-server -detached` when it is installed but stopped;
  - Docker: `docker compose -f compose/docker-compose.yml up -d rabbitmq`.
To test another broker, point AMQP_URL (and RABBITMQ_MGMT_URL at its management API) at it; \
`bash scripts/rabbitmq4.sh up` starts RabbitMQ 4.3.6 (5673/15673) and 4.0.5 (5674/15674).";

/// Makes sure the broker at `url` accepts connections; see the [module docs](self).
///
/// # Errors
///
/// When it does not and cannot be started here: the message names the address, the cause and
/// what to run ([`START_BROKER`]).
pub fn broker(url: &str) -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| ensure_broker(url)).clone()
}

/// Makes sure the management API at `base` (`http://host:port`) answers; see the
/// [module docs](self).
///
/// # Errors
///
/// When it does not and cannot be enabled here, with what to run.
pub fn management(base: &str, authorization: &str) -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| ensure_management(base, authorization))
        .clone()
}

/// The test broker's management API base URL (`RABBITMQ_MGMT_URL`, or
/// `http://127.0.0.1:15672`), once it answers; see [`management`].
///
/// # Errors
///
/// As [`management`].
pub fn management_url() -> Result<String, String> {
    let url =
        std::env::var("RABBITMQ_MGMT_URL").unwrap_or_else(|_| "http://127.0.0.1:15672".into());
    let client = crate::api::Client::new(&url);
    management(client.base(), client.authorization())?;
    Ok(url)
}

/// The broker the TLS tests use: its amqps and plain endpoints, its management API, and the
/// directory of its test certificates.
#[derive(Clone)]
pub struct Tls {
    /// `amqps://guest:guest@localhost:PORT/%2f` (the server certificate names `localhost` only).
    pub url: String,
    /// The same broker over plain `amqp://`, to declare and publish what a TLS test consumes.
    pub amqp_url: String,
    /// The same broker's management API.
    pub mgmt_url: String,
    /// `ca.pem`, `client.pem`/`.key` (CN=guest, for SASL EXTERNAL), `other-ca.pem` (a CA the
    /// broker's certificate does not chain to), `other-client.pem`/`.key` (a client certificate
    /// of that other CA), and the broker's `server.pem`/`.key`.
    pub dir: PathBuf,
}

/// With the URLs' passwords masked.
impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("url", &crate::redact(&self.url))
            .field("amqp_url", &crate::redact(&self.amqp_url))
            .field("mgmt_url", &crate::redact(&self.mgmt_url))
            .field("dir", &self.dir)
            .finish()
    }
}

/// The TLS broker; see the [module docs](self). `AMQPS_URL` with `REDELIVER_TLS_DIR` name a
/// broker of your own instead (nothing is started then): the amqps listener of the broker at
/// `AMQP_URL` and `RABBITMQ_MGMT_URL`.
///
/// # Errors
///
/// When the certificates cannot be written or the node does not start, with what to do.
pub fn tls() -> Result<Tls, String> {
    static DONE: OnceLock<Result<Tls, String>> = OnceLock::new();
    DONE.get_or_init(ensure_tls).clone()
}

/// Holds the machine-wide lock of the test fixtures while alive.
struct Lock {
    /// Never read: held for its `Drop`, which closes the file and so releases the lock.
    _held: File,
}

fn lock() -> Result<Lock, String> {
    let path = std::env::temp_dir().join("redeliver-test-fixtures.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    // Released when the file closes, also when the process dies.
    file.lock()
        .map_err(|e| format!("lock {}: {e}", path.display()))?;
    Ok(Lock { _held: file })
}

/// `host` and `port` of an `amqp://` / `amqps://` / `http://` URL (credentials and path
/// dropped), with the scheme's default port.
fn host_port(url: &str) -> Option<(String, u16)> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let default = match scheme {
        "amqps" => 5671,
        "http" => 80,
        "https" => 443,
        _ => 5672,
    };
    let (host, port) = match host_port.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || host_port.starts_with('[') => (h, p.parse().ok()?),
        _ => (host_port, default),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return None;
    }
    Some((host.to_owned(), port))
}

fn is_local(host: &str) -> bool {
    matches!(host, "127.0.0.1" | "localhost" | "::1")
}

/// Whether something accepts TCP connections at `host:port`; the error says why not.
fn probe(host: &str, port: u16) -> Result<(), String> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .collect();
    let mut last = format!("{host} resolves to no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, PROBE) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

/// Polls `probe` until it succeeds or [`BRING_UP`] passes.
fn wait_until(what: &str, mut probe: impl FnMut() -> Result<(), String>) -> Result<(), String> {
    let start = Instant::now();
    loop {
        match probe() {
            Ok(()) => return Ok(()),
            Err(e) if start.elapsed() > BRING_UP => {
                return Err(format!("{what} did not answer within {BRING_UP:?}: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// A RabbitMQ tool of the machine's own installation, when there is one.
fn system_tool(name: &str) -> Option<PathBuf> {
    [
        "/usr/sbin",
        "/usr/lib/rabbitmq/bin",
        "/usr/local/sbin",
        "/usr/bin",
    ]
    .iter()
    .map(|dir| Path::new(dir).join(name))
    .find(|p| p.is_file())
}

/// Runs `cmd`, returning its output or an error with both streams.
fn run(mut cmd: Command) -> Result<String, String> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| format!("{shown}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{shown} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn ensure_broker(url: &str) -> Result<(), String> {
    let Some((host, port)) = host_port(url) else {
        return Err(format!(
            "AMQP_URL is not a URL the tests can use (amqp://user:password@host:port/vhost)\n\
             {START_BROKER}"
        ));
    };
    let Err(refused) = probe(&host, port) else {
        return Ok(());
    };
    let missing = format!("no RabbitMQ answers at {host}:{port} ({refused}).");
    // Only the machine's own default node is ours to start: any other address is a broker
    // somebody chose, and starting something else there would test the wrong thing.
    let server = system_tool("rabbitmq-server");
    let (true, 5672, Some(server)) = (is_local(&host), port, server) else {
        return Err(format!("{missing}\n{START_BROKER}"));
    };
    let _lock = lock()?;
    if probe(&host, port).is_ok() {
        return Ok(()); // another test binary started it meanwhile
    }
    eprintln!(
        "redeliver tests: RabbitMQ is installed but not running; starting it \
         ({} -detached)",
        server.display()
    );
    let mut cmd = Command::new(&server);
    cmd.arg("-detached");
    run(cmd).map_err(|e| format!("{missing} Starting it failed: {e}\n{START_BROKER}"))?;
    wait_until("RabbitMQ on 127.0.0.1:5672", || probe(&host, port)).map_err(|e| {
        format!("{missing} It was started, but {e}; see /var/log/rabbitmq.\n{START_BROKER}")
    })
}

/// `GET {base}/api/overview`: whether the API answers with these credentials.
fn overview(base: &str, authorization: &str) -> Result<(), String> {
    let agent = ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(5)))
            .build(),
    );
    agent
        .get(&format!("{base}/api/overview"))
        .header("Authorization", authorization)
        .call()
        .map(drop)
        .map_err(|e| e.to_string())
}

fn ensure_management(base: &str, authorization: &str) -> Result<(), String> {
    let Err(error) = overview(base, authorization) else {
        return Ok(());
    };
    let missing = format!("the RabbitMQ management API at {base} does not answer ({error}).");
    let own_node = host_port(base).is_some_and(|(h, p)| is_local(&h) && p == 15672)
        && host_port(&crate::amqp_url()).is_some_and(|(h, p)| is_local(&h) && p == 5672);
    let plugins = system_tool("rabbitmq-plugins");
    let (true, Some(plugins)) = (own_node, plugins) else {
        return Err(format!(
            "{missing}\nEnable it on that broker: `rabbitmq-plugins enable rabbitmq_management`, \
             or point RABBITMQ_MGMT_URL at it.\n{START_BROKER}"
        ));
    };
    // The API is a plugin of a running broker: it needs the broker first.
    broker(&crate::amqp_url())?;
    let _lock = lock()?;
    if overview(base, authorization).is_ok() {
        return Ok(());
    }
    eprintln!(
        "redeliver tests: enabling the management plugin of the local RabbitMQ \
         ({} enable rabbitmq_management)",
        plugins.display()
    );
    let mut cmd = Command::new(&plugins);
    cmd.args(["-q", "enable", "rabbitmq_management"]);
    run(cmd).map_err(|e| {
        format!(
            "{missing} Enabling its plugin failed (the tests must run as root, or as a user \
             allowed to administer the local RabbitMQ): {e}"
        )
    })?;
    wait_until(&format!("the management API at {base}"), || {
        overview(base, authorization)
    })
    .map_err(|e| format!("{missing} The plugin was enabled, but {e}"))
}

/// The workspace's root (where `scripts/` lives).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ensure_tls() -> Result<Tls, String> {
    if let Ok(url) = std::env::var("AMQPS_URL") {
        let dir = std::env::var("REDELIVER_TLS_DIR").map_err(|_| {
            "AMQPS_URL is set but REDELIVER_TLS_DIR is not: name the directory of the test \
             certificates that broker uses (ca.pem, client.pem, client.key, other-ca.pem, \
             other-client.pem, other-client.key), or unset AMQPS_URL and the tests start a TLS \
             node of their own"
                .to_owned()
        })?;
        return Ok(Tls {
            url,
            amqp_url: crate::amqp_url(),
            mgmt_url: management_url()?,
            dir: dir.into(),
        });
    }
    let dir = std::env::temp_dir().join("redeliver-test-tls");
    let tls_port = TLS_NODE_BASE_PORT + 1000;
    let mgmt_port = TLS_NODE_BASE_PORT + 10000;
    let tls = Tls {
        url: format!("amqps://guest:guest@localhost:{tls_port}/%2f"),
        amqp_url: format!("amqp://guest:guest@127.0.0.1:{TLS_NODE_BASE_PORT}/%2f"),
        mgmt_url: format!("http://127.0.0.1:{mgmt_port}"),
        dir: dir.clone(),
    };
    let client = crate::api::Client::new(&tls.mgmt_url);
    let serving = || {
        probe("127.0.0.1", tls_port)?;
        overview(client.base(), client.authorization())
    };
    if dir.join("ca.pem").is_file() && serving().is_ok() {
        return Ok(tls);
    }
    let _lock = lock()?;
    let made = if dir.join("ca.pem").is_file() {
        false
    } else {
        certificates::write(&dir)
            .map_err(|e| format!("writing the test certificates to {}: {e}", dir.display()))?;
        true
    };
    let node = |action: &str| {
        let mut cmd = Command::new("bash");
        cmd.arg(workspace_root().join("scripts/cluster.sh"))
            .arg(action)
            .env("RD_CLUSTER_NAME", TLS_NODE_NAME)
            .env("RD_CLUSTER_NODES", "1")
            .env("RD_CLUSTER_BASE_PORT", TLS_NODE_BASE_PORT.to_string())
            .env("RD_CLUSTER_MANAGEMENT", "1")
            .env("RD_CLUSTER_TLS_DIR", &dir);
        run(cmd)
    };
    if serving().is_ok() && !made {
        return Ok(tls); // another test binary started it meanwhile
    }
    // Not serving while we hold the lock: not running, or a node from before that holds
    // certificates nobody has any more, or lacks a listener. No test can be using it.
    let _ = node("clean");
    eprintln!(
        "redeliver tests: starting a RabbitMQ node with an amqps listener on localhost:{tls_port} \
         (scripts/cluster.sh, node {TLS_NODE_NAME}-1@localhost; it keeps running for later tests)"
    );
    node("start").map_err(|e| {
        format!(
            "the TLS tests start their own RabbitMQ node with scripts/cluster.sh, which needs the \
             rabbitmq-server package and root (or the user owning ~/.erlang.cookie): {e}"
        )
    })?;
    wait_until(
        &format!("the amqps listener on localhost:{tls_port} and the management API"),
        serving,
    )?;
    Ok(tls)
}

/// The throwaway certificates of the TLS tests.
mod certificates {
    use super::*;
    use rcgen::{
        date_time_ymd, BasicConstraints, CertificateParams, DistinguishedName, DnType,
        ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };

    fn params(common_name: &str, names: Vec<String>) -> Result<CertificateParams, rcgen::Error> {
        let mut p = CertificateParams::new(names)?;
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, common_name);
        // UTCTime range: every TLS stack reads it (rcgen's default end, 4096, is not UTCTime).
        p.not_before = date_time_ymd(2020, 1, 1);
        p.not_after = date_time_ymd(2049, 12, 31);
        Ok(p)
    }

    fn ca(common_name: &str) -> Result<(String, Issuer<'static, KeyPair>), rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut p = params(common_name, Vec::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let pem = p.self_signed(&key)?.pem();
        Ok((pem, Issuer::new(p, key)))
    }

    fn leaf(
        issuer: &Issuer<'_, KeyPair>,
        common_name: &str,
        names: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<(String, String), rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut p = params(common_name, names)?;
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![usage];
        Ok((p.signed_by(&key, issuer)?.pem(), key.serialize_pem()))
    }

    /// Writes the files of [`Tls::dir`](super::Tls) into `dir`, all at once (a directory
    /// renamed into place) so no reader sees half of them.
    pub(super) fn write(dir: &Path) -> Result<(), String> {
        let files = generate().map_err(|e| e.to_string())?;
        let partial = dir.with_extension("partial");
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial).map_err(|e| e.to_string())?;
        for (name, text) in files {
            let mut f = File::create(partial.join(name)).map_err(|e| e.to_string())?;
            f.write_all(text.as_bytes()).map_err(|e| e.to_string())?;
        }
        let _ = std::fs::remove_dir_all(dir);
        std::fs::rename(&partial, dir).map_err(|e| e.to_string())
    }

    /// Nothing here is secret: the keys exist for the tests on this machine only. The server's
    /// certificate names `localhost` alone, so `amqps://127.0.0.1` does not verify; the
    /// client's CN is `guest`, the user SASL EXTERNAL logs in as.
    fn generate() -> Result<Vec<(&'static str, String)>, rcgen::Error> {
        let (ca_pem, test_ca) = ca("redeliver test CA")?;
        let (server, server_key) = leaf(
            &test_ca,
            "localhost",
            vec!["localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        )?;
        let (client, client_key) = leaf(
            &test_ca,
            "guest",
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        let (other_ca_pem, other_ca) = ca("some other CA")?;
        let (other_client, other_client_key) = leaf(
            &other_ca,
            "guest",
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        Ok(vec![
            ("ca.pem", ca_pem),
            ("server.pem", server),
            ("server.key", server_key),
            ("client.pem", client),
            ("client.key", client_key),
            ("other-ca.pem", other_ca_pem),
            ("other-client.pem", other_client),
            ("other-client.key", other_client_key),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_passwords() {
        let tls = Tls {
            url: "amqps://app:Tl5;pw@localhost:5671/%2f".into(),
            amqp_url: "amqp://app:Tl5;pw@127.0.0.1:5672/%2f".into(),
            mgmt_url: "http://app:Tl5;pw@127.0.0.1:15672".into(),
            dir: "/tmp/x".into(),
        };
        let shown = format!("{tls:?}");
        assert!(shown.contains("localhost:5671"), "{shown}");
        assert!(!shown.contains("Tl5"), "{shown}");
    }

    #[test]
    fn host_and_port_of_the_urls_tests_use() {
        let cases = [
            ("amqp://guest:guest@127.0.0.1:5672/%2f", ("127.0.0.1", 5672)),
            ("amqp://u:p@w@localhost/%2f", ("localhost", 5672)),
            ("amqps://guest:guest@localhost/%2f", ("localhost", 5671)),
            ("http://127.0.0.1:15673", ("127.0.0.1", 15673)),
            ("amqp://[::1]:5673/%2f", ("::1", 5673)),
        ];
        for (url, (host, port)) in cases {
            assert_eq!(host_port(url), Some((host.to_owned(), port)), "{url}");
        }
        assert_eq!(host_port("not a url"), None);
        assert_eq!(host_port("amqp:///%2f"), None);
    }

    /// A broker that is not there fails within seconds, naming what to run, instead of every
    /// test waiting out a timeout.
    #[test]
    fn no_broker_fails_at_once_with_what_to_run() {
        let start = Instant::now();
        // Port 1 on loopback: nothing listens, and it is not the machine's node to start.
        let err = ensure_broker("amqp://guest:guest@127.0.0.1:1/%2f").unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        assert!(err.contains("no RabbitMQ answers at 127.0.0.1:1"), "{err}");
        assert!(err.contains("apt-get install rabbitmq-server"), "{err}");
        assert!(err.contains("docker compose"), "{err}");
    }

    /// Every file of the TLS fixture is written, as PEM, and no partial directory is left.
    #[test]
    fn certificates_are_written_whole() {
        let dir = std::env::temp_dir().join(format!("redeliver-certs-{}", crate::unique_id(8)));
        certificates::write(&dir).expect("write");
        for name in [
            "ca.pem",
            "server.pem",
            "server.key",
            "client.pem",
            "client.key",
            "other-ca.pem",
            "other-client.pem",
            "other-client.key",
        ] {
            let text = std::fs::read_to_string(dir.join(name)).expect(name);
            assert!(text.starts_with("-----BEGIN "), "{name}: {text}");
        }
        assert!(!dir.with_extension("partial").exists());
        std::fs::remove_dir_all(&dir).expect("remove");
    }
}
