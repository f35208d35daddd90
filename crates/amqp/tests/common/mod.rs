//! Helpers shared by the broker tests.
#![allow(dead_code)]

use futures::FutureExt;
use redeliver_amqp::lapin::message::Delivery;
use redeliver_amqp::lapin::options::{BasicConsumeOptions, BasicGetOptions};
use redeliver_amqp::lapin::types::FieldTable;
use redeliver_amqp::lapin::{Channel, Connection, ConnectionProperties, Consumer};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

pub fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Connects to the test broker; panics (never skips) with instructions when it is down.
pub async fn connect() -> Connection {
    let url = url();
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => panic!(
            "cannot connect to RabbitMQ at {url}: {e}. These tests need a real broker: start one \
             with `rabbitmq-server -detached` (or set AMQP_URL to a reachable broker)"
        ),
    }
}

/// A unique prefix for every object a test declares.
pub fn prefix() -> String {
    format!("t{}.", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// Runs `body`, then `cleanup` whether or not `body` panicked, then re-raises the panic.
pub async fn with_cleanup<B, C>(body: B, cleanup: C)
where
    B: Future<Output = ()>,
    C: Future<Output = ()>,
{
    let outcome = AssertUnwindSafe(body).catch_unwind().await;
    cleanup.await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

pub async fn consume(ch: &Channel, queue: &str) -> Consumer {
    ch.basic_consume(
        queue.into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("basic_consume")
}

/// Polls `queue` with basic.get until a message arrives or `timeout` passes.
pub async fn get(ch: &Channel, queue: &str, timeout: Duration) -> Option<Delivery> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .expect("basic_get")
        {
            return Some(m.delivery);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
