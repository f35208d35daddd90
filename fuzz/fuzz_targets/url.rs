//! Broker URL parsing and redaction (`redeliver_amqp::url`): a user writes the URL, on the
//! command line, in `AMQP_URL` or in a file, and every message about it is printed or logged.
//!
//! Every URL built here has a password, which holds [`CANARY`] at a position the fuzzer picks,
//! written raw or percent-encoded, next to any characters (`;`, `@`, `:`, `/`, `?`, `#`, `%`,
//! `://`, scheme-like words, non-ASCII, blanks), alone or in a `;`-separated list; user, host,
//! port are any text that does not end them early, vhost and query any text (an `@` included),
//! and the whole may follow stray text (a quote, `:x@y; `). Checked:
//! the canary, in any spelling, is in none of `Display`, `Debug`, `redacted()`, `endpoint()`,
//! `user()`, `scrub(vhost())` of what parses, `Display` and `Debug` of every error, `redact()` of the
//! text, and `scrub()` of a text holding the password as written and decoded.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use redeliver_amqp::url::{redact, split_list, BrokerUrl};
use redeliver_fuzz::secret::{ambiguous, leaks, plain, without_canary, CANARY};

/// One URL's pieces.
#[derive(Arbitrary, Debug)]
struct Parts {
    scheme: u8,
    scheme_text: String,
    slashes: bool,
    user: Option<String>,
    before: String,
    after: String,
    encoding: u8,
    host: String,
    port: Option<String>,
    vhost: Option<String>,
    query: Option<String>,
    blank: bool,
    lead: Option<String>,
}

const SCHEMES: [&str; 6] = ["amqp", "amqps", "AMQP", "http", "amqp+x", "a"];
const SNIPPETS: [&str; 10] = [
    ";", "@", ":", "/", "?", "#", "%", "://", ";amqp://", "amqp:",
];

impl Parts {
    /// The URL, and its password as written in it.
    fn url(&self, secret: bool, lead: bool) -> (String, String) {
        let scheme = match SCHEMES.get(usize::from(self.scheme) % 8) {
            Some(s) => (*s).to_owned(),
            // Any scheme the syntax allows (a letter, then letters, digits, `+`, `-`, `.`).
            None => {
                let rest: String = without_canary(&self.scheme_text)
                    .chars()
                    .filter(|c| c.is_ascii_alphanumeric() || "+-.".contains(*c))
                    .collect();
                format!("x{rest}")
            }
        };
        let password = if secret {
            // The fuzzer's text around the canary, with one of the awkward snippets next to it.
            let snippet = SNIPPETS[usize::from(self.encoding >> 2) % SNIPPETS.len()];
            format!("{}{snippet}{CANARY}{}", self.before, self.after)
        } else {
            without_canary(&format!("{}{}", self.before, self.after))
        };
        let written = match self.encoding % 4 {
            0 | 1 => password.clone(),
            2 => encode(&password, false),
            _ => encode(&password, true),
        };
        let mut url = scheme;
        url.push(':');
        // `scheme:` without `//` is a URL only for amqp and amqps (see "known gaps").
        let amqp = ["amqp:", "amqps:"].contains(&url.to_ascii_lowercase().as_str());
        if self.slashes || !amqp {
            url.push_str("//");
        }
        if let Some(u) = &self.user {
            url.push_str(&plain(u, ":@/?#;"));
        }
        url.push(':');
        url.push_str(&written);
        url.push('@');
        // A host is needed: `amqp://user:pw@` ends where a list's next URL may begin.
        match plain(&self.host, "@/?#;:").trim() {
            "" => url.push_str("rabbit"),
            host => url.push_str(host),
        }
        if let Some(p) = &self.port {
            url.push(':');
            url.push_str(&plain(p, "@/?#;"));
        }
        if let Some(v) = &self.vhost {
            url.push('/');
            url.push_str(&plain(v, ""));
        }
        if let Some(q) = &self.query {
            url.push('?');
            url.push_str(&plain(q, ""));
        }
        if let Some(lead) = self.lead.as_ref().filter(|_| lead) {
            // Text before the scheme: a quote, a stray character, a broken URL before this one.
            url = format!("{}{url}", plain(lead, ";"));
        }
        if self.blank {
            url = format!(" {url}\n");
        }
        (url, written)
    }
}

/// `s` percent-encoded: every byte that is not alphanumeric, or every byte.
fn encode(s: &str, all: bool) -> String {
    s.bytes()
        .map(|b| {
            if !all && b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn check(what: &str, text: &str, input: &str) {
    assert!(
        !leaks(text),
        "the password shows in {what}: {text:?}\ninput: {input:?}"
    );
}

/// `alone`: `url` was parsed from the URL holding the password, not from a list around it (the
/// other URLs of a list scrub their own passwords, not this one).
fn check_parse(url: &BrokerUrl, input: &str, written: &str, alone: bool) {
    check("Display", &url.to_string(), input);
    check("Debug", &format!("{url:?}"), input);
    check("redacted()", url.redacted(), input);
    // `BrokerUrl::parse` refuses a URL whose parser reads another password than redaction
    // masks, so what parses shows nothing of it anywhere.
    check("endpoint()", &url.endpoint(), input);
    check("user()", url.user(), input);
    if alone {
        let text = format!("refused {written} / {} / {input}", decode(written));
        check("scrub()", &url.scrub(&text), input);
    }
    // The vhost goes to the broker; what the broker says about it is scrubbed.
    check("scrub(vhost())", &url.scrub(url.vhost()), input);
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let (Ok(main), Ok(others), Ok(position), Ok(sep)) = (
        Parts::arbitrary(&mut u),
        Vec::<Parts>::arbitrary(&mut u),
        u8::arbitrary(&mut u),
        u8::arbitrary(&mut u),
    ) else {
        return;
    };
    let (one, written) = main.url(true, true);
    // In a list, text before a scheme makes the entry run into the one before it, and an `@`
    // there turns a `;` in the password into a separator: one list as much as another (the
    // undecidable case in RELIABILITY.md, "Fuzzing"). Lists are built without it.
    let (in_list, _) = main.url(true, false);
    let mut list: Vec<String> = others
        .iter()
        .take(3)
        .map(|p| p.url(false, false).0)
        .collect();
    // An `@` before a `;` in the password: one URL as much as two (see `ambiguous`).
    let pos = one.find(written.as_str()).unwrap_or(0);
    if ambiguous(&one[..pos], &written) {
        return;
    }
    // Only the password may hold the canary, in any spelling.
    let skeleton = one.replacen(&written, "", 1);
    if [&skeleton]
        .into_iter()
        .chain(&list)
        .any(|o| leaks(o) || leaks(&decode(o)))
    {
        return;
    }
    let at = usize::from(position) % (list.len() + 1);
    list.insert(at, in_list);
    let separator = [";", " ; ", ";;", "; "][usize::from(sep) % 4];
    let all = list.join(separator);

    check("redact()", &redact(&one), &one);
    match BrokerUrl::parse(&one) {
        Ok(url) => check_parse(&url, &one, &written, true),
        Err(e) => {
            check("an error", &e.to_string(), &one);
            check("an error's Debug", &format!("{e:?}"), &one);
        }
    }
    let _ = split_list(&all);
    // An `@` anywhere before the password in the list (another URL's query or vhost may hold
    // one) with a `;` in the password: one URL as much as two, as above.
    let pos = all.find(written.as_str()).unwrap_or(0);
    if ambiguous(&all[..pos], &written) {
        return;
    }
    check("redact() of a list", &redact(&all), &all);
    match BrokerUrl::parse_list(&all) {
        Ok(urls) => {
            for url in &urls {
                check_parse(url, &all, &written, false);
            }
        }
        Err(e) => {
            check("a list's error", &e.to_string(), &all);
            check("a list's error's Debug", &format!("{e:?}"), &all);
        }
    }
});
