//! `examples/outbox_web.rs` end to end, on a real PostgreSQL and RabbitMQ: every image accepted
//! by `POST /images` is a row of `images` and exactly one message in the queue, with the message
//! id stored in its row; a refused request (422, 400) leaves neither a row nor a message.
//!
//! The example runs as a child process with a schema of its own (`rdweb_<hex>`, dropped at the
//! end) and a prefix of its own on the broker (deleted at the end). Without PostgreSQL at
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) or RabbitMQ at `AMQP_URL`
//! the test fails, saying what to start.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use redeliver::lapin;
use redeliver::postgres::{pending, Schema};
use redeliver_testkit::process::LoggedChild;
use redeliver_testkit::{amqp_url, connect, drain, queue_depth, unique_id, unique_prefix, Cleanup};
use serde_json::Value;
use sqlx::Row;

use redeliver_testkit::postgres::{database_url, pool, SchemaGuard as DropSchema};

/// A port nothing listens on: bound, then released.
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// `METHOD http://{addr}{path}` with an optional body: (status, body as JSON).
async fn request(
    addr: SocketAddr,
    method: &'static str,
    path: &str,
    body: Option<String>,
) -> (u16, Value) {
    let url = format!("http://{addr}{path}");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        let mut resp = match (method, body) {
            ("POST", Some(b)) => agent
                .post(&url)
                .header("content-type", "application/json")
                .send(b),
            _ => agent.get(&url).call(),
        }
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().expect("body");
        let json = serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!("{method} {url} answered {status} with non-JSON {text:?}: {e}")
        });
        (status, json)
    })
    .await
    .expect("request thread")
}

async fn post_image(addr: SocketAddr, body: &str) -> (u16, Value) {
    request(addr, "POST", "/images", Some(body.to_owned())).await
}

/// Waits until `GET /readyz` answers 200; fails with the service's log if it exits or does not
/// within 30 s.
async fn wait_ready(addr: SocketAddr, service: &mut LoggedChild) {
    let start = Instant::now();
    loop {
        assert!(
            service.is_running(),
            "outbox_web exited: {}",
            service.log_tail(30)
        );
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            && request(addr, "GET", "/readyz", None).await.0 == 200
        {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "outbox_web not ready after 30 s: {}",
            service.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The example running with a prefix and a schema of its own, and what the test needs of it.
struct Service {
    child: LoggedChild,
    addr: SocketAddr,
    prefix: String,
    schema: String,
    // Dropped after the child (declaration order): nothing recreates what they delete.
    _cleanup: Cleanup,
    _drop_schema: DropSchema,
}

impl Service {
    /// Starts `outbox_web` with `amqp_url` and waits until it is ready.
    async fn start(amqp_url: &str) -> Self {
        let bin = redeliver_testkit::examples::example_binary(
            Path::new(env!("CARGO_MANIFEST_DIR")),
            "outbox_web",
        );
        let prefix = unique_prefix("web-", 10, "-");
        let schema = format!("rdweb_{}", unique_id(12));
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let log = std::env::temp_dir().join(format!("{prefix}outbox_web.log"));
        let mut cmd = Command::new(&bin);
        cmd.env("DATABASE_URL", database_url())
            .env("AMQP_URL", amqp_url)
            .env("REDELIVER_PREFIX", &prefix)
            .env_remove("REDELIVER_QUEUE")
            .env("REDELIVER_PG_SCHEMA", &schema)
            .env("APP_SCHEMA", &schema)
            .env("WEB_ADDR", addr.to_string())
            .env("RUST_LOG", "info");
        let mut child = LoggedChild::spawn(cmd, "outbox_web", log);
        wait_ready(addr, &mut child).await;
        Self {
            child,
            addr,
            _cleanup: Cleanup(prefix.clone()),
            _drop_schema: DropSchema(schema.clone()),
            prefix,
            schema,
        }
    }
}

/// Waits until `queue` holds at least `n` ready messages.
async fn wait_ready_messages(conn: &lapin::Connection, queue: &str, n: u32, service: &Service) {
    let start = Instant::now();
    loop {
        if let Ok(d) = queue_depth(conn, queue).await {
            if d.ready >= n {
                return;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{queue} did not receive {n} jobs within 30 s: {}",
            service.child.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_images_are_rows_and_one_message_each_refused_ones_leave_nothing() {
    // Both services first: a missing one fails here, with what to start.
    let pool = pool(2).await;
    let conn = connect().await;
    let mut service = Service::start(&amqp_url()).await;
    let (addr, prefix, schema) = (service.addr, service.prefix.clone(), service.schema.clone());

    // Refused by the table's CHECK inside the transaction, which rolls back: no row, no job.
    for width in ["0", "-5", "20001", "99999999999"] {
        let (code, body) = post_image(
            addr,
            &format!(r#"{{"url": "https://images.example/0.jpg", "width": {width}}}"#),
        )
        .await;
        assert_eq!(code, 422, "width {width}: {body}");
        assert!(body["error"].as_str().unwrap().contains("width"), "{body}");
    }
    // Refused before a transaction starts.
    let (code, body) = post_image(addr, r#"{"url": "https://images.example/x.jpg", "wid"#).await;
    assert_eq!(code, 400, "not JSON: {body}");
    let (code, body) = post_image(addr, r#"{"url": "https://images.example/x.jpg"}"#).await;
    assert_eq!(code, 422, "no width: {body}");
    let (code, body) = post_image(
        addr,
        r#"{"url": "ftp://images.example/x.jpg", "width": 10}"#,
    )
    .await;
    assert_eq!(code, 422, "not http: {body}");

    // Accepted: 202 with the row's id and the job's message id.
    let mut accepted: BTreeMap<i64, String> = BTreeMap::new();
    for (i, width) in [(1, 640), (2, 1024), (3, 64)] {
        let (code, body) = post_image(
            addr,
            &format!(r#"{{"url": "https://images.example/{i}.jpg", "width": {width}}}"#),
        )
        .await;
        assert_eq!(code, 202, "{body}");
        assert_eq!(body["status"], "queued", "{body}");
        let id = body["id"].as_i64().expect("id");
        let message_id = body["message_id"].as_str().expect("message_id").to_owned();
        assert!(accepted.insert(id, message_id).is_none(), "id {id} twice");
    }
    let (first, first_message) = accepted.iter().next().expect("one");
    let (code, row) = request(addr, "GET", &format!("/images/{first}"), None).await;
    assert_eq!(code, 200, "{row}");
    assert_eq!(row["url"], "https://images.example/1.jpg");
    assert_eq!(row["width"], 640);
    assert_eq!(row["status"], "queued");
    assert_eq!(row["message_id"].as_str(), Some(first_message.as_str()));
    assert!(
        row["created_at"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{row}"
    );
    let (code, body) = request(addr, "GET", "/images/987654321", None).await;
    assert_eq!(code, 404, "{body}");
    let (code, body) = request(addr, "GET", "/images/abc", None).await;
    assert_eq!(code, 400, "{body}");
    // Every error is JSON, the router's own ones included.
    let (code, body) = request(addr, "GET", "/images", None).await;
    assert_eq!(code, 405, "{body}");
    let (code, body) = request(addr, "GET", "/nowhere", None).await;
    assert_eq!(code, 404, "{body}");

    // The relay publishes on the commits' NOTIFY: three messages, once each.
    let queue = format!("{prefix}images");
    wait_ready_messages(&conn, &queue, 3, &service).await;
    // Nothing left to publish either: the outbox is empty once the relay committed its round.
    let outbox = Schema::named(&schema).expect("schema name");
    let start = Instant::now();
    loop {
        let p = pending(&pool, &outbox).await.expect("pending");
        if p.count == 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} jobs still in the outbox: {}",
            p.count,
            service.child.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let messages = drain(&conn, &queue).await;
    let mut published: BTreeMap<i64, String> = BTreeMap::new();
    for m in &messages {
        let props = &m.delivery.properties;
        assert_eq!(
            props.content_type().as_ref().map(|c| c.as_str()),
            Some("application/json")
        );
        let job: Value = serde_json::from_slice(&m.delivery.data).expect("a JSON job");
        let id = job["id"].as_i64().expect("job id");
        assert!(
            job["url"].as_str().is_some() && job["width"].as_i64().is_some(),
            "{job}"
        );
        let message_id = redeliver_testkit::message_id(props);
        assert!(
            published.insert(id, message_id).is_none(),
            "job {id} published twice"
        );
    }
    assert_eq!(
        published, accepted,
        "one message per accepted image, with its message id"
    );

    // The table holds exactly the accepted rows, with the message ids the queue got.
    let rows: BTreeMap<i64, String> = sqlx::query(&format!(
        "SELECT id, message_id FROM \"{schema}\".images ORDER BY id"
    ))
    .fetch_all(&pool)
    .await
    .expect("select images")
    .iter()
    .map(|r| (r.get("id"), r.get("message_id")))
    .collect();
    assert_eq!(rows, accepted, "the refused requests left no row");

    let status = service.child.terminate(Duration::from_secs(20)).await;
    assert!(
        status.contains("exit status: 0"),
        "{status}: {}",
        service.child.log_tail(20)
    );
    // No late publish after the drain: the queue stays empty.
    let d = queue_depth(&conn, &queue).await.expect("queue");
    assert_eq!(d.ready, 0, "a message arrived after the three jobs");
    pool.close().await;
}

/// The broker's `host:port` from the test's `AMQP_URL`.
fn broker_addr() -> String {
    let url = amqp_url();
    let rest = url.split("://").nth(1).unwrap_or("");
    let authority = rest.split('/').next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    }
}

/// The point of the outbox: a request needs only the database. With the broker away the job is
/// accepted and waits in the outbox; once the broker answers, the relay (reconnecting with
/// backoff) publishes it with the message id stored in its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_accepted_while_the_broker_is_away_and_published_once_it_is_back() {
    let pool = pool(2).await;
    let conn = connect().await;
    let outage_port = free_port();
    let broker = amqp_url();
    let (scheme, rest) = broker.split_once("://").expect("a URL");
    let target = broker_addr();
    let unreachable = format!(
        "{scheme}://{}",
        rest.replacen(&target, &format!("127.0.0.1:{outage_port}"), 1)
    );
    assert_ne!(unreachable, broker, "AMQP_URL names {target}");
    let mut service = Service::start(&unreachable).await;
    let addr = service.addr;

    let (code, body) = post_image(
        addr,
        r#"{"url": "https://images.example/7.jpg", "width": 700}"#,
    )
    .await;
    assert_eq!(code, 202, "{body}");
    let message_id = body["message_id"].as_str().expect("message_id").to_owned();
    let outbox = Schema::named(&service.schema).expect("schema name");
    let waiting = pending(&pool, &outbox).await.expect("pending");
    assert_eq!(waiting.count, 1, "the job waits in the outbox");

    // The broker appears on the port the service was given.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", outage_port))
        .await
        .expect("the outage port is free again");
    let forwarding = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    let queue = format!("{}images", service.prefix);
    wait_ready_messages(&conn, &queue, 1, &service).await;
    let messages = drain(&conn, &queue).await;
    assert_eq!(messages.len(), 1, "one job");
    assert_eq!(
        redeliver_testkit::message_id(&messages[0].delivery.properties),
        message_id
    );
    assert_eq!(pending(&pool, &outbox).await.expect("pending").count, 0);

    let status = service.child.terminate(Duration::from_secs(20)).await;
    assert!(
        status.contains("exit status: 0"),
        "{status}: {}",
        service.child.log_tail(20)
    );
    forwarding.abort();
    pool.close().await;
}
