//! The environment reader (`redeliver_worker::env`): what a deployment sets, read through
//! `WorkerBuilder::env_from` and `ServiceSettings::from_lookup`, files included (`AMQP_URL_FILE`,
//! `AMQP_PASSWORD_FILE`: written by the target into a directory of its own, never a path from
//! the input).
//!
//! Every password set (in `AMQP_URL`, the URL file or the password file) holds [`CANARY`];
//! every other value is free of it. Checked, beyond "no panic": the canary is in no error
//! (`Display`, `Debug`, `value()`, `reason()`) and not in the `Debug` of the builder or its
//! settings.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use redeliver_fuzz::secret::{ambiguous, leaks, plain, without_canary, CANARY};
use redeliver_worker::env::{ServiceSettings, REPLACED, VARIABLES};
use redeliver_worker::Worker;

#[derive(Arbitrary, Debug)]
struct Input {
    /// A value per variable (in the order of `VARIABLES`, then `REPLACED`), none = unset.
    values: Vec<Option<String>>,
    /// Which of the URL-bearing variables carry the secret, and how.
    url: Option<(String, String, String)>,
    url_in_file: bool,
    password: Option<(String, String)>,
    newline: bool,
    code_url: u8,
}

const CODE_URLS: [&str; 4] = [
    "amqp://app@127.0.0.1:5672/%2f",
    "amqp://127.0.0.1:5672/%2f",
    "amqps://app:old@rabbit/%2f;amqps://app:old@rabbit-2/%2f",
    "amqp://guest:guest@127.0.0.1:5672/%2f",
];

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("redeliver-fuzz-env-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&d);
        d
    })
}

fn write(name: &str, contents: &str) -> String {
    let path = dir().join(name);
    let _ = std::fs::write(&path, contents);
    path.to_string_lossy().into_owned()
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary(&mut Unstructured::new(data)) else {
        return;
    };
    let names: Vec<&'static str> = VARIABLES
        .iter()
        .copied()
        .chain(REPLACED.iter().map(|(old, _)| *old))
        .collect();
    let mut env: Vec<(&'static str, String)> = names
        .iter()
        .zip(&input.values)
        .filter_map(|(n, v)| v.as_ref().map(|v| (*n, without_canary(v))))
        .filter(|(n, _)| !n.ends_with("_FILE") || n.starts_with("REDELIVER_TLS"))
        .collect();
    if env.iter().any(|(_, v)| leaks(v)) {
        return;
    }
    let nl = if input.newline { "\n" } else { "" };
    if let Some((user, before, rest)) = &input.url {
        // User and host as a user writes them, the password anything (see `plain`).
        let (user, rest) = (plain(user, ":@/?#;"), plain(rest, "@;"));
        let password = format!("{before}{CANARY}");
        if leaks(&user) || leaks(&rest) || ambiguous(&user, &password) {
            return;
        }
        let url = format!("amqp://{user}:{password}@rabbit{rest}");
        if input.url_in_file {
            // An AMQP_URL set as well is an error naming both: checked too.
            env.push(("AMQP_URL_FILE", write("url", &format!("{url}{nl}"))));
        } else {
            env.retain(|(n, _)| *n != "AMQP_URL");
            env.push(("AMQP_URL", url));
        }
    }
    if let Some((before, after)) = &input.password {
        env.push((
            "AMQP_PASSWORD_FILE",
            write("password", &format!("{before}{CANARY}{after}{nl}")),
        ));
    }
    let lookup = |name: &str| env.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone());
    let code_url = CODE_URLS[usize::from(input.code_url) % CODE_URLS.len()];
    match Worker::builder(code_url).env_from(lookup) {
        Ok(builder) => {
            let shown = format!("{builder:?} {:?}", builder.settings());
            assert!(
                !leaks(&shown),
                "the password shows in Debug: {shown}\n{env:?}"
            );
        }
        Err(e) => {
            let shown = format!("{e} {e:?} {} {}", e.value(), e.reason());
            assert!(
                !leaks(&shown),
                "the password shows in an error: {shown}\n{env:?}"
            );
        }
    }
    let _ = ServiceSettings::from_lookup(lookup);
});
