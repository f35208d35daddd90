//! The AMQP 1.0 consumer over TLS, against the testkit's TLS node (`rdtls-1@localhost`, AMQP
//! 5697 / AMQPS 6697, of the RabbitMQ that `RD_CLUSTER_CHROOT` names or the machine's own; or
//! the broker `AMQPS_URL` and `REDELIVER_TLS_DIR` name). Each test reads that node's version and
//! asserts its behaviour; none skips, and a node that cannot be had fails saying why.
//!
//! - RabbitMQ 4.x serves AMQP 1.0 on its AMQPS port: the consumer receives over TLS with SASL
//!   PLAIN and with SASL EXTERNAL (the client certificate's CN, `guest`), and the broker lists
//!   the connection as TLS with that mechanism.
//! - RabbitMQ 3.x has AMQP 1.0 as a plugin, off on the test node: the TLS handshake succeeds and
//!   the AMQP 1.0 connection is then refused, as an AMQP error, not a TLS one.
//! - On every version: a certificate of an unknown CA, one that does not name the host, a plain
//!   port and a client certificate of another CA are refused with what to check.

// Test code: a failed expectation panics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use redeliver_amqp::{BrokerVersion, ServerInfo, TlsConfig};
use redeliver_amqp1::{Consumer, Endpoint, Error, Incoming, Tls};
use redeliver_testkit::mgmt::Client;
use redeliver_testkit::{tls_broker, tls_file, unique_prefix};

/// The TLS node's version, read on its plain port.
async fn node_version() -> BrokerVersion {
    let broker = tls_broker();
    match ServerInfo::probe(&broker.amqp_url).await {
        Ok(info) => info
            .version()
            .unwrap_or_else(|| panic!("the TLS node announced no version: {info:?}")),
        Err(e) => panic!(
            "the TLS node at {} does not answer: {e}\n{}",
            redeliver_testkit::redact(&broker.amqp_url),
            redeliver_testkit::START_BROKER
        ),
    }
}

/// `localhost` and the AMQPS port of the TLS node (its certificate names `localhost` only).
fn amqps_host_port() -> (String, u16) {
    let url = tls_broker().url;
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hp = rest.split('/').next().unwrap_or(rest);
    let (host, port) = hp.rsplit_once(':').expect("the amqps URL has a port");
    (host.to_owned(), port.parse().expect("a port"))
}

/// The plain AMQP port of the TLS node.
fn amqp_port() -> u16 {
    let url = tls_broker().amqp_url;
    let rest = url.rsplit_once('@').map_or(url.as_str(), |(_, r)| r);
    let hp = rest.split('/').next().unwrap_or(rest);
    hp.rsplit_once(':')
        .expect("a port")
        .1
        .parse()
        .expect("a port")
}

fn trusted() -> TlsConfig {
    TlsConfig::new().ca_file(tls_file("ca.pem"))
}

fn endpoint(name: &str, host: &str, port: u16, tls: Option<TlsConfig>) -> Endpoint {
    Endpoint {
        host: host.to_owned(),
        port,
        username: "guest".into(),
        password: "guest".into(),
        vhost: "/".into(),
        container_id: name.to_owned(),
        tls: tls.map(|c| Tls::new(host, c)),
    }
}

/// Declares the quorum queue `queue` on the TLS node (plain port) and publishes one message to
/// it; the connection, to delete the queue with.
async fn queue_with_one_message(queue: &str, id: &str) -> lapin::Connection {
    let conn = redeliver_testkit::connect_to(&tls_broker().amqp_url).await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        b"{}",
        BasicProperties::default().with_message_id(id.into()),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    conn
}

/// The TLS node's AMQP 1.0 connections now, as its management API lists them.
async fn amqp1_connections() -> Vec<serde_json::Value> {
    let api = Client::new(&tls_broker().mgmt_url);
    redeliver_testkit::mgmt::blocking(move || {
        api.get_json("/api/connections")
            .expect("connections")
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["protocol"].as_str().is_some_and(|p| p.contains("1-0")))
            .cloned()
            .collect()
    })
    .await
}

/// The names of the TLS node's AMQP 1.0 connections now.
async fn amqp1_connection_names() -> Vec<String> {
    amqp1_connections()
        .await
        .iter()
        .filter_map(|c| c["name"].as_str().map(str::to_owned))
        .collect()
}

/// The TLS node's record of the AMQP 1.0 connection of container `name`, opened after the
/// connections `before` were listed (listed a few seconds after it opens). RabbitMQ 4.3 lists
/// the container id with the connection; 4.0 does not (measured on 4.0.5: empty
/// `client_properties`), so there it is the one AMQP 1.0 connection not in `before` (this
/// binary's other test opens none that last).
async fn listed_connection(
    version: BrokerVersion,
    name: &str,
    before: &[String],
) -> serde_json::Value {
    let by_container = version >= BrokerVersion::new(4, 1, 0);
    let mut listed = Vec::new();
    for _ in 0..100 {
        listed = amqp1_connections().await;
        let new: Vec<&serde_json::Value> = listed
            .iter()
            .filter(|c| {
                c["name"]
                    .as_str()
                    .is_some_and(|n| !before.iter().any(|b| b == n))
            })
            .collect();
        let found = if by_container {
            new.iter().find(|c| c.to_string().contains(name))
        } else if let [one] = new.as_slice() {
            Some(one)
        } else {
            None
        };
        if let Some(c) = found {
            return (*c).clone();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "RabbitMQ {version}: no connection of container {name} in the management API within \
         20 s; its AMQP 1.0 connections: {:#}",
        serde_json::Value::Array(listed)
    );
}

/// Opens, receives the one message, accepts it, closes: the message id.
async fn receive_one(endpoint: &Endpoint, queue: &str) -> Result<(Consumer, String), Error> {
    let mut consumer = Consumer::open(endpoint, queue, 4).await?;
    let got = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("a delivery within 10 s");
    match got {
        Some(Incoming::Message(d)) => {
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            assert!(consumer.settler().accept(d.delivery_tag));
            Ok((consumer, id))
        }
        other => panic!("expected the message, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumes_over_tls_with_a_password_and_with_the_client_certificate() {
    let version = node_version().await;
    let (host, port) = amqps_host_port();
    let prefix = unique_prefix("rd1-tls-", 8, "-");
    let queue = format!("{prefix}q");
    let conn = queue_with_one_message(&queue, "one").await;
    let plain_name = format!("{prefix}plain");
    let plain = endpoint(&plain_name, &host, port, Some(trusted()));
    let external_name = format!("{prefix}external");
    let mut external = endpoint(
        &external_name,
        &host,
        port,
        Some(
            trusted()
                .client_cert(tls_file("client.pem"), tls_file("client.key"))
                .sasl_external(true),
        ),
    );
    // Not sent with EXTERNAL: a wrong password cannot matter.
    external.username = String::new();
    external.password = "not the password".into();

    if version.major < 4 {
        // AMQP 1.0 is a plugin there, off on the test node: TLS works, AMQP 1.0 does not.
        for (what, e) in [("PLAIN", &plain), ("EXTERNAL", &external)] {
            let refused = Consumer::open(e, &queue, 4)
                .await
                .expect_err("RabbitMQ 3.x without its AMQP 1.0 plugin");
            assert!(
                matches!(
                    refused,
                    Error::Amqp {
                        what: "connection",
                        ..
                    }
                ),
                "{what}: the handshake succeeds, AMQP 1.0 is refused: {refused}"
            );
            println!("RabbitMQ {version}, {what}: {refused}");
        }
        let _ = Client::new(&tls_broker().mgmt_url).delete_prefix(&prefix);
        return;
    }

    let before = amqp1_connection_names().await;
    let (consumer, id) = receive_one(&plain, &queue).await.expect("TLS with PLAIN");
    assert_eq!(id, "one");
    let seen = listed_connection(version, &plain_name, &before).await;
    consumer.close().await;
    assert_eq!(seen["ssl"], true, "{seen}");
    assert_eq!(seen["auth_mechanism"], "PLAIN", "{seen}");
    println!(
        "RabbitMQ {version}: {} over {} as {}",
        seen["protocol"], seen["ssl_protocol"], seen["user"]
    );

    // Again, with the certificate as the login.
    let ch = conn.create_channel().await.unwrap();
    ch.basic_publish(
        "".into(),
        queue.as_str().into(),
        BasicPublishOptions::default(),
        b"{}",
        BasicProperties::default().with_message_id("two".into()),
    )
    .await
    .unwrap();
    let before = amqp1_connection_names().await;
    let (consumer, id) = receive_one(&external, &queue)
        .await
        .expect("TLS with SASL EXTERNAL");
    assert_eq!(id, "two");
    let seen = listed_connection(version, &external_name, &before).await;
    consumer.close().await;
    assert_eq!(seen["ssl"], true, "{seen}");
    assert_eq!(seen["auth_mechanism"], "EXTERNAL", "{seen}");
    assert_eq!(seen["user"], "guest", "the certificate's CN: {seen}");
    println!(
        "RabbitMQ {version}: EXTERNAL as {}, peer {}",
        seen["user"], seen["peer_cert_subject"]
    );
    let _ = conn.close(200, "done".into()).await;
    let _ = Client::new(&tls_broker().mgmt_url).delete_prefix(&prefix);
}

/// Certificates that must be refused, on every version (TLS comes before AMQP 1.0): each with
/// an error that says what to check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_certificates_say_what_to_check() {
    let version = node_version().await;
    let (host, port) = amqps_host_port();
    let name = unique_prefix("rd1-tlsbad-", 8, "");
    let cases = [
        (
            "an unrelated CA",
            endpoint(
                &name,
                &host,
                port,
                Some(TlsConfig::new().ca_file(tls_file("other-ca.pem"))),
            ),
            &["UnknownIssuer", "CA bundle"][..],
        ),
        (
            "the system CAs only",
            endpoint(&name, &host, port, Some(TlsConfig::new())),
            &["UnknownIssuer", "CA bundle"][..],
        ),
        (
            "a name the certificate lacks",
            endpoint(&name, "127.0.0.1", port, Some(trusted())),
            &["not valid for name", "does not name this host"][..],
        ),
        (
            "the plain AMQP port",
            endpoint(&name, &host, amqp_port(), Some(trusted())),
            &["does not speak TLS"][..],
        ),
        (
            "a client certificate of another CA",
            endpoint(
                &name,
                &host,
                port,
                Some(
                    trusted()
                        .client_cert(tls_file("other-client.pem"), tls_file("other-client.key"))
                        .sasl_external(true),
                ),
            ),
            &["client certificate"][..],
        ),
    ];
    for (what, endpoint, expected) in &cases {
        let e = tokio::time::timeout(Duration::from_secs(30), Consumer::open(endpoint, "q", 1))
            .await
            .unwrap_or_else(|_| panic!("{what}: no answer within 30 s"))
            .expect_err(what);
        let text = e.to_string();
        assert!(
            matches!(e, Error::TlsHandshake { .. }),
            "{what}: expected a TLS handshake error, got {text}"
        );
        for part in *expected {
            assert!(text.contains(part), "{what}: {text}");
        }
        println!("RabbitMQ {version}, {what}: {text}");
    }

    // Settings refused before connecting.
    let e = Consumer::open(
        &endpoint(&name, &host, port, Some(trusted().sasl_external(true))),
        "q",
        1,
    )
    .await
    .expect_err("EXTERNAL needs a client certificate");
    assert!(
        matches!(e, Error::Tls(ref m) if m.contains("client certificate")),
        "{e}"
    );
    let e = Consumer::open(
        &endpoint(
            &name,
            &host,
            port,
            Some(TlsConfig::new().ca_file("/nonexistent/ca.pem")),
        ),
        "q",
        1,
    )
    .await
    .expect_err("an unreadable CA bundle");
    assert!(
        matches!(e, Error::Tls(ref m) if m.contains("/nonexistent/ca.pem")),
        "{e}"
    );
}
