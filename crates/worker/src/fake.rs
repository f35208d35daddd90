//! A scripted broker for the unit tests of settling and of whole deliveries.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use redeliver_amqp::headers::{DeadLetterInfo, RetryState};
use redeliver_amqp::PublishError;

use crate::broker::{Broker, CopyError, Link, Publish};

/// What the code under test asked of the broker.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Call {
    Ack {
        success: bool,
    },
    Reject {
        requeue: bool,
    },
    PublishDelayed {
        queue: String,
        delay: Duration,
    },
    Publish {
        exchange: String,
        routing_key: String,
    },
    /// A native retry: `modified` with the delivery time.
    Hold {
        until_ms: u64,
        state: RetryState,
    },
    /// A native dead letter: `modified{undeliverable-here}` with the reason.
    DeadLetter {
        info: DeadLetterInfo,
    },
}

/// A scripted broker: publishes answer in order from `publish_results` (confirmed when
/// empty), `open` says whether the channel is up, `close_after_publish` closes it once a
/// publish is done (a channel lost mid-settle), `reject_result` answers rejects.
pub(crate) struct FakeBroker {
    pub(crate) calls: StdMutex<Vec<Call>>,
    pub(crate) props: StdMutex<Vec<BasicProperties>>,
    pub(crate) publish_results: StdMutex<VecDeque<Result<(), CopyError>>>,
    pub(crate) open: StdMutex<bool>,
    pub(crate) close_after_publish: bool,
    pub(crate) reject_result: fn() -> Result<bool, lapin::Error>,
    /// Tags released to the batched acks, channels abandoned: what a later multiple ack
    /// could cover, kept apart from `calls` (no frame of their own).
    pub(crate) released: StdMutex<u32>,
    pub(crate) abandoned: StdMutex<Vec<&'static str>>,
    /// The next publish panics (a bug in settling), once.
    pub(crate) panic_on_publish: AtomicBool,
    /// The queue holds retries (AMQP 1.0 on RabbitMQ 4.3+): `hold` and `dead_letter` are
    /// native outcomes.
    pub(crate) native: bool,
}

impl FakeBroker {
    pub(crate) fn new() -> Self {
        Self {
            calls: StdMutex::default(),
            props: StdMutex::default(),
            publish_results: StdMutex::default(),
            open: StdMutex::new(true),
            close_after_publish: false,
            reject_result: || Ok(true),
            released: StdMutex::new(0),
            abandoned: StdMutex::default(),
            panic_on_publish: AtomicBool::new(false),
            native: false,
        }
    }

    /// A broker whose queue holds retries (native mode).
    pub(crate) fn native() -> Self {
        Self {
            native: true,
            ..Self::new()
        }
    }

    pub(crate) fn answering(results: impl IntoIterator<Item = Result<(), PublishError>>) -> Self {
        let b = Self::new();
        b.publish_results
            .lock()
            .unwrap()
            .extend(results.into_iter().map(|r| r.map_err(CopyError::from)));
        b
    }

    pub(crate) fn answering_copy(results: impl IntoIterator<Item = Result<(), CopyError>>) -> Self {
        let b = Self::new();
        b.publish_results.lock().unwrap().extend(results);
        b
    }

    pub(crate) fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    pub(crate) fn published_headers(&self) -> FieldTable {
        let props = self.props.lock().unwrap();
        props
            .last()
            .and_then(|p| p.headers().clone())
            .expect("a publish with headers")
    }

    fn published(&self, props: BasicProperties) -> Result<(), CopyError> {
        if self.panic_on_publish.swap(false, Ordering::SeqCst) {
            panic!("a bug while publishing the copy");
        }
        self.props.lock().unwrap().push(props);
        if self.close_after_publish {
            *self.open.lock().unwrap() = false;
        }
        self.publish_results
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Ok(()))
    }
}

impl Broker for &FakeBroker {
    type Copies = FakeBroker;

    fn is_open(&self) -> bool {
        *self.open.lock().unwrap()
    }

    fn ack(&self, success: bool) -> bool {
        if !self.is_open() {
            return false;
        }
        self.calls.lock().unwrap().push(Call::Ack { success });
        true
    }

    async fn reject(&self, requeue: bool) -> Result<bool, lapin::Error> {
        self.calls.lock().unwrap().push(Call::Reject { requeue });
        if !self.is_open() {
            return Ok(false);
        }
        (self.reject_result)()
    }

    fn holds_retries(&self) -> bool {
        self.native
    }

    async fn hold(&self, until_ms: u64, state: &RetryState) -> Result<bool, lapin::Error> {
        assert!(self.native, "hold on a broker that does not hold retries");
        self.calls.lock().unwrap().push(Call::Hold {
            until_ms,
            state: state.clone(),
        });
        Ok(self.is_open())
    }

    async fn dead_letter(
        &self,
        info: &DeadLetterInfo,
        _state: &RetryState,
    ) -> Result<bool, lapin::Error> {
        if !self.native {
            return self.reject(false).await;
        }
        self.calls
            .lock()
            .unwrap()
            .push(Call::DeadLetter { info: info.clone() });
        Ok(self.is_open())
    }

    fn released(&self) {
        *self.released.lock().unwrap() += 1;
    }

    async fn abandon_channel(&self, why: &'static str) {
        self.abandoned.lock().unwrap().push(why);
    }

    fn copies(&self) -> &FakeBroker {
        self
    }
}

impl Publish for FakeBroker {
    async fn publish_delayed(
        &self,
        queue: &str,
        delay: Duration,
        _body: &[u8],
        props: BasicProperties,
    ) -> Result<(), CopyError> {
        self.calls.lock().unwrap().push(Call::PublishDelayed {
            queue: queue.to_owned(),
            delay,
        });
        self.published(props)
    }

    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        _body: &[u8],
        props: BasicProperties,
    ) -> Result<(), CopyError> {
        self.calls.lock().unwrap().push(Call::Publish {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        });
        self.published(props)
    }
}

/// A session whose deliveries all settle on one [`FakeBroker`].
pub(crate) struct FakeLink(pub(crate) FakeBroker);

impl Link for FakeLink {
    type Broker<'a> = &'a FakeBroker;

    fn register(&self, _delivery_tag: u64) {}

    fn broker<'a>(&'a self, _delivery: &'a Delivery) -> &'a FakeBroker {
        &self.0
    }
}

/// A copy the broker nacked.
pub(crate) fn nacked() -> PublishError {
    PublishError::Nacked {
        exchange: "delay".into(),
        routing_key: "orders".into(),
    }
}

/// A copy the broker returned (unroutable).
pub(crate) fn returned() -> PublishError {
    PublishError::Returned {
        exchange: "delay".into(),
        routing_key: "orders".into(),
        reply_code: 312,
        reply_text: "NO_ROUTE".into(),
    }
}

/// A copy above the publisher's size limit.
pub(crate) fn too_large() -> PublishError {
    PublishError::TooLarge {
        exchange: "delay".into(),
        routing_key: "orders".into(),
        size: 10,
        limit: Some(5),
    }
}

/// Waits `d` of (paused) test time: ends a test's wait for a sleep without real time.
#[allow(dead_code)]
pub(crate) async fn elapse(d: Duration) {
    tokio::time::sleep(d).await;
}
