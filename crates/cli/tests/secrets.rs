//! The broker password never reaches the CLI's stdout or stderr, whatever URL the user writes:
//! special characters raw or percent-encoded, lists (and lists that mix amqps:// and amqp://,
//! refused), a URL in quotes, a value that is not UTF-8, the password file (a URL without a user
//! is an error, not a login as `guest`). The binary runs for real, against the test broker where
//! a login is involved.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt as _;
use std::process::Command;

use proptest::prelude::*;
use redeliver_amqp::url::BrokerUrl;
use redeliver_testkit::amqp_url;
use redeliver_testkit::process::Output;

/// Runs `redeliver ARGS` with exactly these variables of its own (AMQP_* removed unless given).
fn run(args: &[&str], env: &[(&str, OsString)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redeliver"));
    cmd.args(args)
        .env_remove("AMQP_URL")
        .env_remove("AMQP_URL_FILE")
        .env_remove("AMQP_PASSWORD_FILE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Output::of(&mut cmd)
}

fn url_env(url: &str) -> Vec<(&'static str, OsString)> {
    vec![("AMQP_URL", url.into())]
}

/// Panics when any of `secrets` is in the output; returns stdout and stderr together.
fn assert_hidden(out: &Output, secrets: &[&str]) -> String {
    let text = format!("{}\n{}", out.stdout, out.stderr);
    for s in secrets {
        assert!(!text.contains(s), "{s} printed:\n{text}");
    }
    assert!(!text.contains("panicked"), "{text}");
    text
}

/// The test broker's `user`, `host:port`, and its URL with `password` (percent-encoded).
fn broker_with(password: &str) -> (String, String, String) {
    let base = BrokerUrl::parse(&amqp_url()).expect("AMQP_URL");
    let encoded: String = password
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let url = format!("amqp://{}:{encoded}@{}/%2f", base.user(), base.endpoint());
    (base.user().to_owned(), base.endpoint(), url)
}

/// A file holding `content`, deleted when dropped.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(content: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "redeliver-cli-secrets-{}",
            redeliver_testkit::unique_id(16)
        ));
        std::fs::write(&path, content).expect("write the temporary file");
        Self(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_list_mixing_amqps_and_amqp_is_refused() {
    for list in [
        "amqps://app:Mx1Pw@rabbit-0:5671/%2f;amqp://app:Mx1Pw@127.0.0.1:1/%2f",
        "amqp://app:Mx1Pw@127.0.0.1:1/%2f ; amqps://app:Mx1Pw@rabbit-0:5671/%2f",
    ] {
        let out = run(&["dlq", "list", "orders"], &url_env(list));
        assert_eq!(out.code, 2, "{out:?}");
        let text = assert_hidden(&out, &["Mx1Pw"]);
        assert!(text.contains("mixes amqps:// and amqp://"), "{text}");
    }
}

#[test]
fn a_semicolon_that_may_be_in_a_password_is_refused_without_showing_it() {
    for url in [
        // One URL with the password `Am1;amqp://Am2`, or two URLs: which one is not known.
        "amqp://app:Am1;amqp://Am2@127.0.0.1:1/%2f",
        "amqp://127.0.0.1:1;amqp://app:Am1@127.0.0.1:1/%2f",
    ] {
        let out = run(&["dlq", "list", "orders"], &url_env(url));
        assert_eq!(out.code, 2, "{out:?}");
        let text = assert_hidden(&out, &["Am1", "Am2"]);
        assert!(text.contains("%3B"), "{text}");
    }
}

#[test]
fn the_password_file_needs_a_user_in_the_url() {
    let file = TempFile::new("Pf1secret\n");
    let path = file.0.to_string_lossy().into_owned();
    for url in [
        "amqp://127.0.0.1:1/%2f",
        "amqp://:Old1pw@127.0.0.1:1/%2f",
        "amqp://guest@127.0.0.1:1/%2f;amqp://127.0.0.1:2/%2f",
    ] {
        for args in [
            vec![
                "dlq",
                "list",
                "orders",
                "--url",
                url,
                "--password-file",
                &path,
            ],
            vec!["dlq", "list", "orders"],
        ] {
            let env = vec![
                ("AMQP_URL", OsString::from(url)),
                ("AMQP_PASSWORD_FILE", OsString::from(&path)),
            ];
            let out = run(&args, &env);
            assert_eq!(out.code, 2, "{url}: {out:?}");
            let text = assert_hidden(&out, &["Pf1secret", "Old1pw"]);
            assert!(text.contains("no user"), "{text}");
        }
    }
}

#[test]
fn a_url_that_is_not_utf8_is_refused_without_its_password() {
    let mut raw = b"amqp://app:Nu1".to_vec();
    raw.extend_from_slice(&[0xff, 0xfe]);
    raw.extend_from_slice(b"Nu2@127.0.0.1:1/%2f");
    let value = OsString::from_vec(raw);
    let out = run(&["dlq", "list", "orders"], &[("AMQP_URL", value.clone())]);
    assert_ne!(out.code, 0, "{out:?}");
    assert_hidden(&out, &["Nu1", "Nu2"]);
    let out = Output::of(
        Command::new(env!("CARGO_BIN_EXE_redeliver"))
            .args(["dlq", "list", "orders", "--url"])
            .arg(&value)
            .env_remove("AMQP_URL"),
    );
    assert_ne!(out.code, 0, "{out:?}");
    assert_hidden(&out, &["Nu1", "Nu2"]);
    // Percent-encoded bytes that are not UTF-8 once decoded.
    let out = run(
        &["dlq", "list", "orders"],
        &url_env("amqp://app:Nu1%FF%FENu2@127.0.0.1:1/%2f"),
    );
    assert_ne!(out.code, 0, "{out:?}");
    assert_hidden(&out, &["Nu1", "Nu2"]);
}

#[test]
fn a_quoted_url_is_refused_without_its_password() {
    for url in [
        "'amqp://app:Qu1pw@127.0.0.1:1/%2f'",
        "\"amqp://app:Qu1pw@127.0.0.1:1/%2f\"",
    ] {
        let out = run(&["dlq", "list", "orders"], &url_env(url));
        assert_eq!(out.code, 2, "{out:?}");
        assert_hidden(&out, &["Qu1pw"]);
    }
}

/// The password file with a list of URLs: every URL gets it, the command uses the first.
#[test]
fn the_password_file_fills_a_list_and_the_first_url_is_used() {
    let (user, endpoint, _) = broker_with("unused");
    let base = BrokerUrl::parse(&amqp_url()).expect("AMQP_URL");
    let password = base.uri().authority.userinfo.password.clone();
    let file = TempFile::new(&format!("{password}\n"));
    let list = format!("amqp://{user}@{endpoint}/%2f;amqp://{user}@127.0.0.1:1/%2f");
    let queue = redeliver_testkit::unique_prefix("sec", 10, "-q");
    let out = run(
        &["dlq", "list", &queue],
        &[
            ("AMQP_URL", list.into()),
            ("AMQP_PASSWORD_FILE", file.0.clone().into()),
        ],
    );
    // Connected (the queue, not the login, is what is missing).
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("does not exist"), "{}", out.stderr);
}

/// A list whose first node is down: the command warns (without the password) and uses the
/// next, as the worker would.
#[test]
fn a_node_that_is_down_is_skipped_for_the_next_in_the_list() {
    let base = BrokerUrl::parse(&amqp_url()).expect("AMQP_URL");
    let password = base.uri().authority.userinfo.password.clone();
    let (user, endpoint) = (base.user(), base.endpoint());
    let down = format!("amqp://{user}:Dn1pwDn1@127.0.0.1:1/%2f");
    let list = format!("{down};amqp://{user}:{password}@{endpoint}/%2f");
    let queue = redeliver_testkit::unique_prefix("sec", 10, "-q");
    let out = run(&["dlq", "list", &queue], &url_env(&list));
    let text = assert_hidden(&out, &["Dn1pwDn1"]);
    // Connected to the second (the queue, not the connection, is what is missing).
    assert_eq!(out.code, 1, "{text}");
    assert!(out.stderr.contains("does not exist"), "{text}");
    assert!(
        out.stderr
            .contains("warning: cannot connect to the broker at amqp://")
            && out.stderr.contains("127.0.0.1:1")
            && out.stderr.contains("trying the next URL of the list"),
        "{text}"
    );
    // Every node down: the last one's error, and no password of any.
    let out = run(
        &["dlq", "list", &queue],
        &url_env(&format!("{down};amqp://{user}:Dn2pwDn2@127.0.0.1:2/%2f")),
    );
    let text = assert_hidden(&out, &["Dn1pwDn1", "Dn2pwDn2"]);
    assert_ne!(out.code, 0, "{text}");
    assert!(
        out.stderr
            .contains("error: cannot connect to the broker at"),
        "{text}"
    );
    assert!(out.stderr.contains("127.0.0.1:2"), "{text}");
}

/// A password with every character that trips URL code, percent-encoded, refused by the
/// broker.
fn hostile_password() -> impl Strategy<Value = String> {
    proptest::string::string_regex(
        "[A-Z][0-9][A-Z][0-9]([A-Za-z0-9@:/%;?#!$&'()*+,=.~ -]|;amqp://|amqps:|://|@){1,6}[A-Z][0-9][A-Z][0-9]",
    )
    .expect("regex")
}

proptest! {
    // Each case runs the binary, some against the broker: few cases.
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn a_refused_login_never_shows_the_password(p in hostile_password()) {
        let (_, _, url) = broker_with(&p);
        let marks = [&p[..4], &p[p.len() - 4..]];
        let out = run(&["dlq", "list", "orders"], &url_env(&url));
        prop_assert_eq!(out.code, 1, "{:?}", out);
        let text = format!("{}\n{}", out.stdout, out.stderr);
        prop_assert!(text.contains("ACCESS_REFUSED"), "{}", text);
        prop_assert!(!text.contains(&p) && !marks.iter().any(|m| text.contains(m)), "{}", text);
        // The same password from the password file, with --url.
        let file = TempFile::new(&format!("{p}\n"));
        let bare = BrokerUrl::parse(&url).expect("the URL");
        let no_password = format!("amqp://{}@{}/%2f", bare.user(), bare.endpoint());
        let path = file.0.to_string_lossy().into_owned();
        let out = run(&["dlq", "list", "orders", "--url", &no_password, "--password-file", &path], &[]);
        prop_assert_eq!(out.code, 1, "{:?}", out);
        let text = format!("{}\n{}", out.stdout, out.stderr);
        prop_assert!(text.contains("ACCESS_REFUSED"), "{}", text);
        prop_assert!(!text.contains(&p) && !marks.iter().any(|m| text.contains(m)), "{}", text);
    }

    #[test]
    fn a_url_that_does_not_parse_never_shows_the_password(p in hostile_password(), n in 0..5u8) {
        let marks = [&p[..4], &p[p.len() - 4..]];
        // Raw `@` then `;` and a scheme in a `scheme://` URL can make a valid list, read as one
        // (undecidable; see redeliver_amqp::url::split_list).
        let at_then_semicolon = p.find('@').is_some_and(|at| p[at..].contains(';'));
        prop_assume!(!(matches!(n, 1 | 2 | 4) && at_then_semicolon));
        let url = match n {
            0 => format!("amqp:app:{p}@127.0.0.1:1"),
            1 => format!("amqp://app:{p}@127.0.0.1:notaport/%2f"),
            2 => format!("amqpx://app:{p}@127.0.0.1:1"),
            3 => format!("'amqp://app:{p}@127.0.0.1:1/%2f'"),
            _ => format!("amqps://app:{p}@127.0.0.1:1/%2f;amqp://app:{p}@127.0.0.1:2/%2f"),
        };
        let out = run(&["dlq", "list", "orders"], &url_env(&url));
        prop_assert!(out.code != 0, "{:?}", out);
        let text = format!("{}\n{}", out.stdout, out.stderr);
        prop_assert!(!text.contains(&p) && !marks.iter().any(|m| text.contains(m)), "{}", text);
        prop_assert!(!text.contains("panicked"), "{}", text);
    }
}
