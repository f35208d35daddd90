//! The nesting guard against a real broker (`AMQP_URL`, default the 3.10.8 broker on 5672; CI
//! runs the suite once per broker). Never skipped:
//!
//! - RabbitMQ 4.x: a quorum queue gets a message nested 5,000 levels deep (an amqp-value body,
//!   published over AMQP 1.0 as raw bytes) between two normal ones; a receiver reading through a
//!   [`GuardedStream`] gets `RecvError::MessageDecode` for the deep one, with the delivery the
//!   guard recorded in [`Cuts`], settles it (`modified`, undeliverable here), and receives the
//!   normal ones intact. Without the guard the process would abort with a stack overflow (see
//!   docs/upstream/fe2o3-amqp-decoder-recursion.md).
//! - RabbitMQ 4.x, a dead-lettered message: a classic queue with a 10 ms TTL dead-letters a
//!   message (published over 0-9-1) into a quorum queue, so it carries `x-opt-deaths`, an
//!   array of maps (map32 elements) that fe2o3 0.18 cannot decode. Through the guard it decodes, its
//!   body intact and `x-opt-deaths` a binary; without the guard (in a task of its own, in case
//!   the decoder panics) the same delivery fails with `RecvError::MessageDecode` (see
//!   docs/upstream/serde_amqp-described-arrays.md).
//! - RabbitMQ 3.x: AMQP 1.0 is a plugin, off there; the tests assert the refusal and end.
//! - No broker: the test fails and says how to start one.
// Helpers of a test: a failure is meant to panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::RecvError;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::messaging::{AmqpValue, Body, Message, Modified, Outcome};
use fe2o3_amqp::types::primitives::Symbol;
use fe2o3_amqp::types::primitives::{LazyValue, Value};
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use rand::{Rng, SeedableRng};
use redeliver_amqp1::guard::{Cuts, GuardedStream, MAX_NESTING};
use redeliver_testkit::amqp_url;
use tokio::net::TcpStream;

const LEVELS: usize = 5_000;

/// host:port of an `amqp://user:pass@host:port/vhost` URL.
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hp = rest.split('/').next().unwrap_or(rest);
    if hp.contains(':') {
        hp.to_owned()
    } else {
        format!("{hp}:5672")
    }
}

/// `LEVELS` nested lists holding a null, as AMQP 1.0 bytes (list32 while it needs to).
fn nested_lists(levels: usize) -> Vec<u8> {
    let mut v = vec![0x40];
    for _ in 0..levels {
        let mut l = Vec::with_capacity(v.len() + 9);
        if v.len() < 255 {
            l.extend_from_slice(&[0xc0, (v.len() + 1) as u8, 1]);
        } else {
            l.push(0xd0);
            l.extend_from_slice(&((v.len() + 4) as u32).to_be_bytes());
            l.extend_from_slice(&1u32.to_be_bytes());
        }
        l.extend_from_slice(&v);
        v = l;
    }
    v
}

/// What the broker answers the AMQP 1.0 SASL protocol header with (its first 8 bytes).
async fn protocol_answer(addr: &str) -> [u8; 8] {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = TcpStream::connect(addr).await.expect("tcp");
    tcp.write_all(b"AMQP\x03\x01\x00\x00").await.expect("write");
    let mut answer = [0u8; 8];
    tcp.read_exact(&mut answer)
        .await
        .expect("the broker answers");
    answer
}

async fn open(addr: &str, cuts: &Cuts, name: &str) -> Result<ConnectionHandle<()>, String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("tcp: {e}"))?;
    open_on(GuardedStream::new(tcp, cuts.clone()), name).await
}

/// A connection on `stream` (guarded or not).
async fn open_on<S>(stream: S, name: &str) -> Result<ConnectionHandle<()>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + std::fmt::Debug + Send + Unpin + 'static,
{
    Connection::builder()
        .container_id(name)
        .sasl_profile(SaslProfile::Plain {
            username: "guest".into(),
            password: "guest".into(),
        })
        .hostname("vhost:/")
        .open_with_stream(stream)
        .await
        .map_err(|e| format!("{e:?}"))
}

/// Connects over 0-9-1; `None` (after asserting fe2o3's refusal) on a broker without AMQP 1.0.
async fn broker(name: &str) -> Option<(lapin::Connection, String)> {
    let url = amqp_url();
    let addr = host_port(&url);
    let lapin_conn = match lapin::Connection::connect(&url, Default::default()).await {
        Ok(c) => c,
        Err(e) => panic!(
            "no broker at {url} ({e}): start the test brokers with `bash scripts/rabbitmq4.sh up` \
             (RabbitMQ 4.3.6 on 5673, 4.0.5 on 5674, 3.10.8 on 5672) and set AMQP_URL"
        ),
    };
    let answer = protocol_answer(&addr).await;
    if answer == *b"AMQP\x00\x00\x09\x01" {
        let refused =
            tokio::time::timeout(Duration::from_secs(20), open(&addr, &Cuts::new(), name))
                .await
                .expect("the refusal comes quickly");
        assert!(
            refused.is_err(),
            "a broker without AMQP 1.0 opened a connection"
        );
        eprintln!(
            "no AMQP 1.0 at {addr} (answered 0-9-1); fe2o3 refused: {}",
            refused.err().unwrap_or_default()
        );
        let _ = lapin_conn.close(200, "done".into()).await;
        return None;
    }
    assert_eq!(
        answer, *b"AMQP\x03\x01\x00\x00",
        "the broker's answer to AMQP 1.0 SASL"
    );
    Some((lapin_conn, addr))
}

fn random_name(what: &str) -> String {
    format!(
        "redeliver-amqp1-{what}-{:08x}",
        rand::rngs::StdRng::from_os_rng().random::<u32>()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_message_decodes_through_the_guard() {
    let Some((lapin_conn, addr)) = broker("guard-deaths-3x").await else {
        return;
    };
    let ttl_queue = random_name("ttl");
    let queue = random_name("deaths");
    let ch = lapin_conn.create_channel().await.expect("a channel");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.as_str().into(), durable, args)
        .await
        .expect("declare the quorum queue");
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(10));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(queue.as_str().into()),
    );
    ch.queue_declare(ttl_queue.as_str().into(), durable, args)
        .await
        .expect("declare the TTL queue");
    ch.basic_publish(
        "".into(),
        ttl_queue.as_str().into(),
        BasicPublishOptions::default(),
        b"{\"order\": 42}",
        BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .expect("publish")
    .await
    .expect("confirm");

    let result = tokio::time::timeout(Duration::from_secs(60), receive_deaths(&addr, &queue)).await;
    for q in [&ttl_queue, &queue] {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
            .expect("delete the queue");
    }
    let _ = lapin_conn.close(200, "done".into()).await;
    result.expect("the test finishes in time");
}

async fn receive_deaths(addr: &str, queue: &str) {
    let address = format!("/queues/{queue}");
    let cuts = Cuts::new();
    let mut conn = open(addr, &cuts, "guard-deaths")
        .await
        .expect("AMQP 1.0 connection");
    let mut session = Session::begin(&mut conn).await.expect("session");
    let mut receiver = Receiver::builder()
        .name("guard-deaths")
        .source(address.as_str())
        .auto_accept(false)
        .attach(&mut session)
        .await
        .expect("receiver");
    let delivery = receiver
        .recv::<Body<Value>>()
        .await
        .expect("a dead-lettered message decodes through the guard");
    assert_eq!(cuts.take(*delivery.delivery_id()), None);
    let message = delivery.message();
    match &message.body {
        Body::Data(sections) => {
            let bytes: Vec<u8> = sections.iter().flat_map(|d| d.0.to_vec()).collect();
            assert_eq!(bytes, b"{\"order\": 42}");
        }
        other => panic!("a data body: {other:?}"),
    }
    let annotations = message
        .message_annotations
        .as_ref()
        .expect("message annotations");
    let deaths = annotations
        .0
        .get(&OwnedKey::Symbol(Symbol::from("x-opt-deaths")))
        .expect("x-opt-deaths");
    let Value::Binary(deaths) = deaths else {
        panic!("x-opt-deaths is not a binary: {deaths:?}");
    };
    let hex: String = deaths.iter().map(|b| format!("{b:02x}")).collect();
    eprintln!("x-opt-deaths as a binary ({} bytes): {hex}", deaths.len());
    // An array8 of one death: count 1, then the element constructor. RabbitMQ 4.0.5 and
    // 4.3.6 write map32 (0xd1); a map8 or a described map would be turned into a binary too.
    assert!(
        deaths.len() > 2 && deaths[0] == 1 && matches!(deaths[1], 0xd1 | 0xc1 | 0x00),
        "{hex}"
    );
    assert!(
        deaths.windows(7).any(|w| w == b"expired"),
        "the reason: {hex}"
    );
    receiver.release(&delivery).await.expect("release");
    receiver.close().await.expect("close receiver");
    session.end().await.expect("end session");
    conn.close().await.expect("close");

    // The same delivery without the guard: fe2o3's decoder refuses it. In a task of its own,
    // so a panic of the decoder (a debug build, some arrays) fails this test, not the process.
    let addr = addr.to_owned();
    let unguarded = tokio::spawn(async move {
        let tcp = TcpStream::connect(&addr).await.expect("tcp");
        let mut conn = open_on(tcp, "unguarded-deaths").await.expect("connection");
        let mut session = Session::begin(&mut conn).await.expect("session");
        let mut receiver = Receiver::builder()
            .name("unguarded-deaths")
            .source(address.as_str())
            .auto_accept(false)
            .attach(&mut session)
            .await
            .expect("receiver");
        let outcome = match receiver.recv::<Body<Value>>().await {
            Err(RecvError::MessageDecode(err)) => {
                let why = err.source.to_string();
                receiver.release(err.info).await.expect("release");
                Ok(why)
            }
            Ok(d) => {
                receiver.release(&d).await.expect("release");
                Err("decoded without the guard: fe2o3 was fixed?".to_owned())
            }
            Err(other) => Err(format!("not a decode error: {other:?}")),
        };
        receiver.close().await.expect("close receiver");
        session.end().await.expect("end session");
        conn.close().await.expect("close");
        outcome
    })
    .await
    .expect("no panic");
    let why = unguarded.expect("the unguarded decode fails");
    eprintln!("without the guard: RecvError::MessageDecode ({why})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_message_is_cut_settled_and_the_link_keeps_going() {
    // A broker without AMQP 1.0 (RabbitMQ 3.x has it as a plugin, off on the test broker)
    // answers the SASL protocol header with its own, 0-9-1's, and closes.
    let Some((lapin_conn, addr)) = broker("guard-3x").await else {
        return;
    };
    let cuts = Cuts::new();
    let queue = random_name("guard");
    let ch = lapin_conn.create_channel().await.expect("a channel");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("declare the quorum queue");

    let result = tokio::time::timeout(Duration::from_secs(60), run(&addr, &queue, &cuts)).await;
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete the queue");
    let _ = lapin_conn.close(200, "done".into()).await;
    result.expect("the test finishes in time");
}

async fn run(addr: &str, queue: &str, cuts: &Cuts) {
    let address = format!("/queues/{queue}");

    // Publish: normal, 5,000 levels deep, normal. The deep body goes out as raw bytes (a
    // LazyValue), so the publisher does not recurse either.
    let mut conn = open(addr, &Cuts::new(), "guard-publisher")
        .await
        .expect("AMQP 1.0 connection");
    let mut session = Session::begin(&mut conn).await.expect("session");
    let mut sender = Sender::attach(&mut session, "guard-sender", address.as_str())
        .await
        .expect("sender");
    let deep = nested_lists(LEVELS);
    eprintln!("the deep body: {} levels, {} bytes", LEVELS, deep.len());
    let lazy: LazyValue = serde_amqp_lazy(deep);
    let outcome = sender.send("before").await.expect("send");
    assert!(matches!(outcome, Outcome::Accepted(_)), "{outcome:?}");
    let outcome = sender
        .send(Message::builder().value(lazy).build())
        .await
        .expect("send the deep message");
    assert!(matches!(outcome, Outcome::Accepted(_)), "{outcome:?}");
    let outcome = sender.send("after").await.expect("send");
    assert!(matches!(outcome, Outcome::Accepted(_)), "{outcome:?}");
    sender.close().await.expect("close sender");
    session.end().await.expect("end session");
    conn.close().await.expect("close");

    // Receive through the guard, on this multi-thread runtime's 2 MiB worker threads.
    let mut conn = open(addr, cuts, "guard-receiver")
        .await
        .expect("AMQP 1.0 connection");
    let mut session = Session::begin(&mut conn).await.expect("session");
    let mut receiver = Receiver::builder()
        .name("guard-receiver")
        .source(address.as_str())
        .auto_accept(false)
        .credit_mode(fe2o3_amqp::link::receiver::CreditMode::Auto(10))
        .attach(&mut session)
        .await
        .expect("receiver");

    let first = receiver
        .recv::<Body<Value>>()
        .await
        .expect("the first message");
    assert_eq!(
        first.body(),
        &Body::Value(AmqpValue(Value::String("before".into())))
    );
    assert_eq!(cuts.take(*first.delivery_id()), None);
    receiver.accept(&first).await.expect("accept");

    let err = match receiver.recv::<Body<Value>>().await {
        Err(RecvError::MessageDecode(err)) => err,
        Ok(d) => panic!("the deep message decoded: {:?}", d.delivery_id()),
        Err(other) => panic!("not a settleable error: {other:?}"),
    };
    let id = err.info.delivery_id();
    let why = cuts.take(id).expect("the cut is recorded");
    eprintln!("delivery {id}: {} ({why})", err.source);
    assert!(
        why.contains(&format!("deeper than {MAX_NESTING} levels")),
        "{why}"
    );
    receiver
        .modify(
            err.info,
            Modified {
                delivery_failed: Some(true),
                undeliverable_here: Some(true),
                message_annotations: None,
            },
        )
        .await
        .expect("settle the cut delivery");

    let last = receiver
        .recv::<Body<Value>>()
        .await
        .expect("the link is still up");
    assert_eq!(
        last.body(),
        &Body::Value(AmqpValue(Value::String("after".into())))
    );
    assert_eq!(cuts.take(*last.delivery_id()), None);
    receiver.accept(&last).await.expect("accept");

    receiver.close().await.expect("close receiver");
    session.end().await.expect("end session");
    conn.close().await.expect("close");
}

/// Raw AMQP bytes as a value fe2o3 sends verbatim.
fn serde_amqp_lazy(bytes: Vec<u8>) -> LazyValue {
    let mut reader = serde_amqp::read::SliceReader::new(&bytes);
    LazyValue::from_reader(&mut reader).expect("a LazyValue")
}
