//! The broker password never reaches an error, a `Debug` rendering or a log-ready URL, whatever
//! shape the URL has: no `//`, percent-encoded or raw special characters, several URLs separated
//! by `;`, one of them broken.

use proptest::prelude::*;
use redeliver_amqp::url::{redact, BrokerUrl};
use redeliver_worker::{Context, HandlerError, Raw, Worker};

/// A password of at least 6 characters, from a mix that URL parsers trip on.
fn password() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[A-Za-z0-9]{3}[A-Za-z0-9@:/%;?#!$&'()*+,=.~-]{3,12}")
        .expect("regex")
}

/// `(url text, the password as a human would recognise it)`.
fn url_with(password: String) -> impl Strategy<Value = (String, String)> {
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
    (0..8u8).prop_map(move |shape| {
        let p = &password;
        let e = &encoded;
        let url = match shape {
            0 => format!("amqp://app:{e}@rabbit:5672/%2f"),
            1 => format!("amqp:app:{p}@rabbit"),
            2 => format!("amqp://app:{p}@rabbit:5672/%2f"),
            3 => format!("amqp://app:{e}@rabbit:notaport/%2f"),
            4 => format!("amqp://a:{e}@r1;amqp://app:{e}@r2:99999999"),
            5 => format!("amqpx://app:{e}@rabbit"),
            6 => format!(" amqp://app:{e}@r1 ; amqp:app:{p}@r2 "),
            _ => format!("amqp://app:{e}@[::1:5672/%2f"),
        };
        (url, p.clone())
    })
}

fn leaks(text: &str, secret: &str) -> bool {
    text.contains(secret)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_error_shows_the_password((url, secret) in password().prop_flat_map(url_with)) {
        // What a log line shows.
        prop_assert!(!leaks(&redact(&url), &secret), "redact: {}", redact(&url));
        // The URL parser.
        match BrokerUrl::parse(&url) {
            Ok(u) => {
                let shown = format!("{u:?} {u} {}", u.redacted());
                prop_assert!(!leaks(&shown, &secret), "{}", shown);
            }
            Err(e) => prop_assert!(!leaks(&format!("{e} {e:?}"), &secret), "{e}"),
        }
        // The worker's builder.
        let built = Worker::builder(url.clone())
            .queue("q")
            .handler(|_m: Raw, _c: Context| async { Ok::<(), HandlerError>(()) })
            .build();
        if let Err(e) = built {
            prop_assert!(!leaks(&format!("{e} {e:?}"), &secret), "{e}");
        }
        // The environment.
        match Worker::builder("amqp://127.0.0.1/%2f")
            .env_from(|name| (name == "AMQP_URL").then(|| url.clone()))
        {
            Ok(cfg) => {
                let shown = format!("{cfg:?} {:?}", cfg.settings());
                prop_assert!(!leaks(&shown, &secret), "{}", shown);
            }
            Err(e) => prop_assert!(!leaks(&format!("{e} {e:?}"), &secret), "{e}"),
        }
    }
}
