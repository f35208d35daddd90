//! The broker password never reaches an error, a `Debug` rendering, a log-ready URL or the
//! tracing output, whatever shape the URL has: no `//`, percent-encoded or raw special
//! characters (`;`, `@`, `://`, a scheme-like word), several URLs separated by `;`, one of them
//! broken, a list mixing amqps:// and amqp:// (refused), a URL in quotes, bytes that are not
//! UTF-8, and the password file.
//!
//! Each password is `MARK + middle + MARK2`, where the marks are random letter-digit runs: the
//! tests look for the whole password and for each mark, so a password shown in part (cut at a
//! `;` read as a list separator, say) is caught too.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::OsString;
use std::io::Write as _;
use std::time::Duration;

use proptest::prelude::*;
use redeliver_amqp::url::{redact, BrokerUrl, UrlError};
use redeliver_core::HandlerError;
use redeliver_worker::{Context, Raw, Worker, WorkerBuilder};

/// A password as `(whole, [first mark, last mark])`, its middle drawn from what URL parsers
/// and list splitters trip on.
fn password() -> impl Strategy<Value = (String, [String; 2])> {
    let mark = || proptest::string::string_regex("[A-Z][0-9][A-Z][0-9][A-Z]").expect("regex");
    let middle = proptest::string::string_regex(
        "([A-Za-z0-9@:/%;?#!$&'()*+,=.~-]|;amqp://|;amqps:|amqp:|://|@|;){0,6}",
    )
    .expect("regex");
    (mark(), middle, mark()).prop_map(|(a, m, b)| (format!("{a}{m}{b}"), [a, b]))
}

/// Every byte but ASCII letters and digits percent-encoded.
fn encode(p: &str) -> String {
    p.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The URL shapes a user can write around a password.
const SHAPES: u8 = 14;

fn shape(n: u8, p: &str) -> String {
    let e = encode(p);
    match n {
        0 => format!("amqp://app:{e}@rabbit:5672/%2f"),
        1 => format!("amqp:app:{p}@rabbit"),
        2 => format!("amqp://app:{p}@rabbit:5672/%2f"),
        3 => format!("amqp://app:{e}@rabbit:notaport/%2f"),
        4 => format!("amqp://a:{e}@r1;amqp://app:{e}@r2:99999999"),
        5 => format!("amqpx://app:{e}@rabbit"),
        6 => format!(" amqp://app:{e}@r1 ; amqp:app:{p}@r2 "),
        7 => format!("amqp://app:{e}@[::1:5672/%2f"),
        // A list of URLs whose passwords are written raw.
        8 => format!("amqp://app:{p}@r1/%2f;amqp://app:{p}@r2/%2f"),
        // TLS and plain mixed: refused.
        9 => format!("amqps://app:{e}@r1/%2f;amqp://app:{e}@r2/%2f"),
        // Quoted, as a .env file may have it.
        10 => format!("'amqp://app:{p}@rabbit/%2f'"),
        // Bytes that are not UTF-8 once decoded.
        11 => format!("amqp://app:{e}%FF%FE@rabbit/%2f"),
        // A first URL without a user: its port may be the start of a password.
        12 => format!("amqp://r0:5672/%2f;amqp://app:{p}@r1/%2f"),
        _ => format!("amqp://app:{p}@r1/%2f;amqps://app:{p}@r2"),
    }
}

fn leaks(text: &str, password: &str, marks: &[String; 2]) -> bool {
    text.contains(password) || marks.iter().any(|m| text.contains(m.as_str()))
}

fn handler() -> impl Fn(Raw, Context) -> std::future::Ready<Result<(), HandlerError>> + Clone {
    |_m: Raw, _c: Context| std::future::ready(Ok(()))
}

/// A password file holding `content`, deleted when dropped.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(content: &[u8]) -> Self {
        let path = std::env::temp_dir().join(format!(
            "redeliver-secrets-{}-{}",
            std::process::id(),
            redeliver_testkit::unique_id(16)
        ));
        let mut f = std::fs::File::create(&path).expect("create the password file");
        f.write_all(content).expect("write the password file");
        Self(path)
    }

    fn path(&self) -> String {
        self.0.to_string_lossy().into_owned()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn no_error_shows_the_password((p, marks) in password(), n in 0..SHAPES) {
        // Written raw in a `scheme://` URL, a password holding `@` and later `;` can make a valid
        // list of URLs (`amqp://app:x@y;amqp://z@host`), read as such: undecidable, and such a
        // password must be percent-encoded anyway for the URL to parse (split_list's docs).
        let at_then_semicolon = p.find('@').is_some_and(|at| p[at..].contains(';'));
        prop_assume!(!(matches!(n, 2 | 8 | 12 | 13) && at_then_semicolon));
        let url = shape(n, &p);
        // What a log line shows.
        prop_assert!(!leaks(&redact(&url), &p, &marks), "redact({url}): {}", redact(&url));
        // The URL parser, one URL and a list.
        match BrokerUrl::parse(&url) {
            Ok(u) => {
                let shown = format!("{u:?} {u} {}", u.redacted());
                prop_assert!(!leaks(&shown, &p, &marks), "{}", shown);
                if n == 0 || n == 2 {
                    let scrubbed = u.scrub(&format!("{} {}", url, p));
                    prop_assert!(!leaks(&scrubbed, &p, &marks), "{}", scrubbed);
                }
            }
            Err(e) => prop_assert!(!leaks(&format!("{e} {e:?}"), &p, &marks), "{e}"),
        }
        match BrokerUrl::parse_list(&url) {
            Ok(l) => {
                let shown = format!("{l:?}");
                prop_assert!(!leaks(&shown, &p, &marks), "{}", shown);
                let tls = l.iter().filter(|u| u.is_tls()).count();
                prop_assert!(tls == 0 || tls == l.len(), "mixed list accepted: {url}");
            }
            Err(e) => prop_assert!(!leaks(&format!("{e} {e:?}"), &p, &marks), "{e}"),
        }
        // The worker's builder, the list split as the environment would.
        let parts: Vec<String> = redeliver_amqp::url::split_list(&url)
            .into_iter()
            .map(str::to_owned)
            .collect();
        let built = Worker::builder(parts[0].clone())
            .failover_urls(parts[1..].to_vec())
            .queue("q")
            .handler(handler())
            .build();
        if let Err(e) = built {
            prop_assert!(!leaks(&format!("{e} {e:?}"), &p, &marks), "{e}");
        }
        // The environment.
        match Worker::builder("amqp://127.0.0.1/%2f")
            .env_from(|name| (name == "AMQP_URL").then(|| url.clone()))
        {
            Ok(cfg) => {
                let shown = format!("{cfg:?} {:?}", cfg.settings());
                prop_assert!(!leaks(&shown, &p, &marks), "{}", shown);
            }
            Err(e) => prop_assert!(!leaks(&format!("{e} {e:?}"), &p, &marks), "{e}"),
        }
    }

    /// AMQP_PASSWORD_FILE: the password is never shown, whatever it holds, and a URL without a
    /// user is an error (the broker would otherwise be asked to log in `guest`).
    #[test]
    fn the_password_file_never_shows_and_needs_a_user((p, marks) in password(), n in 0..6u8) {
        let url = match n {
            0 => "amqp://app@rabbit:5672/%2f",
            1 => "amqp://app:old@r0/%2f;amqp://app@r1/%2f",
            2 => "amqp://rabbit:5672/%2f",
            3 => "amqp://:old@rabbit/%2f",
            4 => "amqp://app@r0/%2f;amqp://r1/%2f",
            _ => "amqps://app@r0/%2f;amqp://app@r1/%2f",
        };
        let file = TempFile::new(format!("{p}\n").as_bytes());
        let path = file.path();
        let got = Worker::builder("amqp://127.0.0.1/%2f").env_from(|name| match name {
            "AMQP_URL" => Some(url.to_owned()),
            "AMQP_PASSWORD_FILE" => Some(path.clone()),
            _ => None,
        });
        match (n, got) {
            (0 | 1, Ok(cfg)) => {
                let shown = format!("{cfg:?} {:?}", cfg.settings());
                prop_assert!(!leaks(&shown, &p, &marks), "{}", shown);
                for raw in std::iter::once(cfg.settings().url()).chain(
                    cfg.settings().failover_urls().iter().map(String::as_str)
                ) {
                    let u = BrokerUrl::parse(raw).expect("the URL with the file's password");
                    prop_assert_eq!(&u.uri().authority.userinfo.password, &p);
                    prop_assert_eq!(u.user(), "app");
                }
            }
            (2..=4, Err(e)) => {
                prop_assert_eq!(e.var(), "AMQP_PASSWORD_FILE");
                prop_assert!(e.to_string().contains("no user"), "{e}");
                prop_assert!(!leaks(&format!("{e} {e:?}"), &p, &marks), "{e}");
            }
            (5, Err(e)) => {
                prop_assert!(e.to_string().contains("mixes amqps:// and amqp://"), "{e}");
                prop_assert!(!leaks(&format!("{e} {e:?}"), &p, &marks), "{e}");
            }
            (n, got) => prop_assert!(false, "shape {n}: {got:?}"),
        }
    }
}

#[test]
fn a_list_mixing_amqps_and_amqp_is_refused_everywhere() {
    let (tls, plain) = (
        "amqps://app:mixed-pw-1@rabbit-0:5671/%2f",
        "amqp://app:mixed-pw-1@rabbit-1:5672/%2f",
    );
    for (first, second) in [(tls, plain), (plain, tls)] {
        let e = BrokerUrl::parse_list(&format!("{first};{second}")).unwrap_err();
        assert!(matches!(e, UrlError::MixedTls { .. }), "{e}");
        let e = Worker::builder("amqp://127.0.0.1/%2f")
            .env_from(|name| (name == "AMQP_URL").then(|| format!("{first};{second}")))
            .unwrap_err();
        assert_eq!(e.var(), "AMQP_URL");
        assert!(e.to_string().contains("clear text"), "{e}");
        assert!(!e.to_string().contains("mixed-pw"), "{e}");
        // Through the builder's own list.
        let Err(e) = Worker::builder(first)
            .failover_urls([second])
            .queue("q")
            .handler(handler())
            .build()
        else {
            panic!("a mixed list is accepted by the builder");
        };
        assert!(e.to_string().contains("clear text"), "{e}");
        assert!(!format!("{e} {e:?}").contains("mixed-pw"), "{e}");
    }
}

/// The only test of this binary that touches the process environment.
#[test]
fn a_url_that_is_not_unicode_is_reported_without_its_password() {
    use std::os::unix::ffi::OsStringExt as _;
    let mut raw = b"amqp://app:Q1W2E".to_vec();
    raw.extend_from_slice(&[0xff, 0xfe]);
    raw.extend_from_slice(b"R3T4Y@rabbit:5672/%2f");
    std::env::set_var("AMQP_URL", OsString::from_vec(raw));
    let got = WorkerBuilder::from_env();
    std::env::remove_var("AMQP_URL");
    let Err(e) = got else {
        panic!("a URL that is not Unicode is accepted");
    };
    assert_eq!(e.var(), "AMQP_URL");
    let shown = format!("{e} {e:?}");
    assert!(shown.contains("not valid Unicode"), "{shown}");
    assert!(
        !shown.contains("Q1W2E") && !shown.contains("R3T4Y"),
        "{shown}"
    );
}

/// A worker refused by the broker (wrong password, with every character that trips URL code)
/// and failing over to a closed port logs at every level, lapin's included, without the
/// password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracing_output_never_shows_the_password() {
    // Global, not per thread: the worker logs from its runtime's threads.
    let captured = redeliver_testkit::logs::Captured::default();
    tracing::subscriber::set_global_default(captured.subscriber(tracing::Level::TRACE))
        .expect("the only subscriber of this test binary");
    let _broker = redeliver_testkit::connect().await;
    let base = BrokerUrl::parse(&redeliver_testkit::amqp_url()).expect("AMQP_URL");
    let password = "Z9X8;amqp://p@ss:w0rd%FFamqps:K7J6";
    let encoded = encode(password);
    let refused = format!("amqp://{}:{encoded}@{}/%2f", base.user(), base.endpoint());
    let closed = format!("amqp://{}:{encoded}@127.0.0.1:1/%2f", base.user());
    let worker = Worker::builder(refused)
        .failover_urls([closed])
        .queue(format!(
            "{}q",
            redeliver_testkit::unique_prefix("sec", 10, ".")
        ))
        .handler(handler())
        .build()
        .expect("a worker");
    let token = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(token.clone()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    token.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the worker stops when cancelled")
        .expect("the worker task");
    let text = captured.text() + &format!("{ended:?}");
    assert!(
        text.contains("ACCESS_REFUSED") || text.contains("refused"),
        "the broker refused the login: {text}"
    );
    for secret in [password, encoded.as_str(), "Z9X8", "K7J6", "w0rd"] {
        assert!(!text.contains(secret), "{secret} in the logs:\n{text}");
    }
}
