//! What a handler is, what it receives, and how the body is decoded.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use redeliver_amqp::headers::RetryState;
use redeliver_core::{BoxError, HandlerError};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

/// Handles the messages of one queue.
///
/// Closures `Fn(M, Context) -> impl Future<Output = Result<(), HandlerError>>` implement it, so
/// most services pass a closure to [`WorkerBuilder::handler`](crate::WorkerBuilder::handler).
/// Implement it on a struct when the handler owns state (database pools, HTTP clients) and pass
/// it to [`WorkerBuilder::handler`](crate::WorkerBuilder::handler); `async fn` works
/// in the impl as long as the future is `Send`.
///
/// `M` is the decoded message: [`Json<T>`], [`Raw`], [`Text`] or any [`FromDelivery`] type.
///
/// ```no_run
/// use redeliver::{Context, Handler, HandlerError, Json, Worker};
///
/// #[derive(serde::Deserialize)]
/// struct Resize { url: String, width: u32 }
///
/// struct Resizer { http: std::sync::Arc<String> /* e.g. an HTTP client */ }
///
/// impl Handler<Json<Resize>> for Resizer {
///     async fn handle(&self, job: Json<Resize>, ctx: Context) -> Result<(), HandlerError> {
///         if job.width == 0 {
///             return Err(HandlerError::permanent("width must be positive"));
///         }
///         tracing::info!(url = %job.url, attempt = ctx.attempt(), via = %self.http, "resizing");
///         Ok(())
///     }
/// }
///
/// # async fn demo() -> Result<(), redeliver::WorkerError> {
/// Worker::builder("amqp://127.0.0.1:5672/%2f")
///     .queue("images")
///     .handler(Resizer { http: std::sync::Arc::new("client".into()) })
///     .build()?
///     .run(redeliver::shutdown_on_signal()?)
///     .await
/// # }
/// ```
pub trait Handler<M>: Send + Sync + 'static {
    /// Processes one message. `Ok` acks it; an error is retried through the delay levels or
    /// dead-lettered, as the worker's [`RetryPolicy`](redeliver_core::RetryPolicy) decides.
    fn handle(
        &self,
        message: M,
        ctx: Context,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

impl<F, M, Fut> Handler<M> for F
where
    F: Fn(M, Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    M: Send + 'static,
{
    fn handle(
        &self,
        message: M,
        ctx: Context,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        self(message, ctx)
    }
}

/// The body could not be turned into the handler's message type. The worker treats it as a
/// poison pill: rejected at once, without retries, so the broker dead-letters it.
#[derive(Debug, thiserror::Error)]
#[error("cannot decode message body: {source}")]
pub struct DecodeError {
    #[source]
    source: BoxError,
}

impl DecodeError {
    /// Wraps a decoder's error.
    pub fn new(e: impl Into<BoxError>) -> Self {
        Self { source: e.into() }
    }

    /// The decoder's error.
    pub fn inner(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.source
    }
}

/// Decodes a delivery into a handler's message type: the codec trait.
///
/// Implemented by [`Json<T>`] (serde_json, the default choice), [`Raw`] (the bytes as they
/// came) and [`Text`] (UTF-8). Implement it for other formats:
///
/// ```
/// use redeliver::{DecodeError, FromDelivery};
/// use redeliver::lapin::message::Delivery;
///
/// /// Comma-separated values, one record per message.
/// struct Csv(Vec<String>);
///
/// impl FromDelivery for Csv {
///     fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
///         let text = std::str::from_utf8(&delivery.data).map_err(DecodeError::new)?;
///         Ok(Csv(text.split(',').map(str::to_owned).collect()))
///     }
/// }
///
/// let d = Delivery::mock(1, "".into(), "q".into(), false, b"a,b".to_vec());
/// assert_eq!(Csv::from_delivery(&d).unwrap().0, ["a", "b"]);
/// ```
///
/// A handler's first argument must be one of these. A plain serde type is not, and the compiler
/// then says which ones are: ``error[E0277]: a handler cannot take `Order` as its message``,
/// with a note listing them and one suggesting `Json<Order>`:
///
/// ```compile_fail,E0277
/// use redeliver::{Context, HandlerError, Worker};
///
/// #[derive(serde::Deserialize)]
/// struct Order { id: u64 }
///
/// Worker::builder("amqp://127.0.0.1:5672/%2f")
///     .queue("orders")
///     .handler(|order: Order, _ctx: Context| async move { Ok::<(), HandlerError>(()) });
/// ```
#[diagnostic::on_unimplemented(
    message = "a handler cannot take `{Self}` as its message",
    label = "`{Self}` does not implement `FromDelivery`",
    note = "a handler is `|message, ctx: Context|`, where `message` is `Json<T>` (T: serde::Deserialize), `Raw` (the body's bytes), `Text` (a UTF-8 body) or a type of yours that implements `FromDelivery`",
    note = "for a JSON body, take `Json<{Self}>` (it derefs to `{Self}`)"
)]
pub trait FromDelivery: Sized + Send + 'static {
    /// Decodes `delivery` (body in `delivery.data`, properties in `delivery.properties`).
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError>;
}

/// A JSON body decoded with serde_json. Derefs to `T`.
///
/// The `content_type` property is not checked (many publishers leave it empty); a body that does
/// not parse as `T` is a [`DecodeError`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Json<T>(pub T);

impl<T> Json<T> {
    /// The decoded value.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> Deref for Json<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for Json<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T: DeserializeOwned + Send + 'static> FromDelivery for Json<T> {
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
        serde_json::from_slice(&delivery.data)
            .map(Json)
            .map_err(DecodeError::new)
    }
}

/// The body bytes, undecoded. Never fails to decode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Raw(pub Vec<u8>);

impl Deref for Raw {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl FromDelivery for Raw {
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
        Ok(Raw(delivery.data.clone()))
    }
}

/// A UTF-8 body; anything else is a [`DecodeError`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Text(pub String);

impl Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl FromDelivery for Text {
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
        String::from_utf8(delivery.data.clone())
            .map(Text)
            .map_err(DecodeError::new)
    }
}

/// What a handler knows about the delivery it is processing. Cheap to clone.
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

struct ContextInner {
    queue: Arc<str>,
    /// Owned here, not behind an `Arc` of its own: the worker's delivery task reads it through
    /// its clone of the context, so a delivery costs one allocation for both.
    delivery: Delivery,
    retry: RetryState,
    /// One token for the whole worker: cloning a `CancellationToken` takes its lock, cloning the
    /// `Arc` does not.
    shutdown: Arc<CancellationToken>,
}

impl Context {
    pub(crate) fn new(
        queue: Arc<str>,
        delivery: Delivery,
        retry: RetryState,
        shutdown: Arc<CancellationToken>,
    ) -> Self {
        Self {
            inner: Arc::new(ContextInner {
                queue,
                delivery,
                retry,
                shutdown,
            }),
        }
    }

    /// A context for `delivery` outside a worker, as the worker would build it for a delivery
    /// from `queue` (retry headers read the same way): for testing a handler, or a wrapper of
    /// handlers, without a broker. Its shutdown token is never cancelled.
    ///
    /// ```
    /// use redeliver::Context;
    /// use redeliver::lapin::message::Delivery;
    /// use redeliver::lapin::BasicProperties;
    ///
    /// let mut delivery = Delivery::mock(1, "".into(), "orders".into(), false, b"{}".to_vec());
    /// delivery.properties = BasicProperties::default().with_message_id("m-1".into());
    /// let ctx = Context::detached("orders", delivery);
    /// assert_eq!(ctx.message_id(), Some("m-1"));
    /// assert_eq!(ctx.attempt(), 0);
    /// ```
    pub fn detached(queue: &str, delivery: Delivery) -> Self {
        let retry = RetryState::read(delivery.properties.headers().as_ref());
        Self::new(queue.into(), delivery, retry, Arc::default())
    }

    /// The delivery itself, for the worker's own settling.
    pub(crate) fn delivery(&self) -> &Delivery {
        &self.inner.delivery
    }

    /// The retry headers as read once when the delivery arrived.
    pub(crate) fn retry(&self) -> &RetryState {
        &self.inner.retry
    }

    /// Retries already done for this message: 0 on the first delivery, 1 on the first retry,
    /// and so on (read from `x-redeliver-attempt`; a missing or garbage header counts as 0).
    pub fn attempt(&self) -> u32 {
        self.inner.retry.attempt
    }

    /// True when this delivery is a retry copy (`attempt() > 0`).
    pub fn is_retry(&self) -> bool {
        self.inner.retry.attempt > 0
    }

    /// The message's `message_id` property (kept on every retry copy): the key for idempotency.
    pub fn message_id(&self) -> Option<&str> {
        self.inner
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
    }

    /// The message's `correlation_id` property.
    pub fn correlation_id(&self) -> Option<&str> {
        self.inner
            .delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(|s| s.as_str())
    }

    /// The broker's redelivered flag: the message was delivered before on a channel that died
    /// or was requeued, so the handler may already have seen it.
    pub fn redelivered(&self) -> bool {
        self.inner.delivery.redelivered
    }

    /// Exchange this delivery came through. For a retry copy that is the delay infrastructure's
    /// deliver exchange; see [`original_exchange`](Self::original_exchange).
    pub fn exchange(&self) -> &str {
        self.inner.delivery.exchange.as_str()
    }

    /// Routing key of this delivery (for a retry copy, the delay routing key); see
    /// [`original_routing_key`](Self::original_routing_key).
    pub fn routing_key(&self) -> &str {
        self.inner.delivery.routing_key.as_str()
    }

    /// Exchange the message was first published to (from `x-redeliver-original-exchange` on a
    /// retry copy, else this delivery's exchange).
    pub fn original_exchange(&self) -> &str {
        self.inner
            .retry
            .original_exchange
            .as_deref()
            .unwrap_or(self.inner.delivery.exchange.as_str())
    }

    /// Routing key the message was first published with.
    pub fn original_routing_key(&self) -> &str {
        self.inner
            .retry
            .original_routing_key
            .as_deref()
            .unwrap_or(self.inner.delivery.routing_key.as_str())
    }

    /// Name of the queue being consumed (prefix included).
    pub fn queue(&self) -> &str {
        &self.inner.queue
    }

    /// Delivery tag on the worker's channel (for logs; settling is the worker's job).
    pub fn delivery_tag(&self) -> u64 {
        self.inner.delivery.delivery_tag
    }

    /// All message properties.
    pub fn properties(&self) -> &BasicProperties {
        &self.inner.delivery.properties
    }

    /// The message headers (user headers plus `x-redeliver-*` on a retry copy).
    pub fn headers(&self) -> Option<&FieldTable> {
        self.inner.delivery.properties.headers().as_ref()
    }

    /// One header by name.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.headers()?.inner().get(name)
    }

    /// The error of the previous attempt (`x-redeliver-last-error`), if this is a retry.
    pub fn last_error(&self) -> Option<&str> {
        self.inner.retry.last_error.as_deref()
    }

    /// When the first attempt failed (`x-redeliver-first-failed-at`, RFC 3339), if this is a retry.
    pub fn first_failed_at(&self) -> Option<&str> {
        self.inner.retry.first_failed_at.as_deref()
    }

    /// Delay applied to reach this retry copy, if known.
    pub fn previous_delay(&self) -> Option<Duration> {
        self.inner.retry.delay
    }

    /// Cancelled when the worker starts draining (shutdown requested). Long handlers can watch
    /// it and return early; a handler that returns an error because of it is retried as usual.
    pub fn shutdown_token(&self) -> &CancellationToken {
        &self.inner.shutdown
    }

    /// True once shutdown was requested.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutdown.is_cancelled()
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("queue", &self.inner.queue)
            .field("message_id", &self.message_id())
            .field("attempt", &self.inner.retry.attempt)
            .field("redelivered", &self.inner.delivery.redelivered)
            .field("exchange", &self.inner.delivery.exchange.as_str())
            .field("routing_key", &self.inner.delivery.routing_key.as_str())
            .finish_non_exhaustive()
    }
}

pub(crate) type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>;

/// Type-erased handler: decodes, then returns the boxed handler future. Erasing here keeps the
/// builder and worker free of type parameters, so workers for different message types can be run
/// together.
pub(crate) trait ErasedHandler: Send + Sync + 'static {
    fn prepare(&self, ctx: Context) -> Result<HandlerFuture, DecodeError>;
}

pub(crate) struct Erased<H, M> {
    handler: Arc<H>,
    _message: std::marker::PhantomData<fn() -> M>,
}

impl<H, M> Erased<H, M> {
    pub(crate) fn new(handler: H) -> Self {
        Self {
            handler: Arc::new(handler),
            _message: std::marker::PhantomData,
        }
    }
}

impl<H, M> ErasedHandler for Erased<H, M>
where
    H: Handler<M>,
    M: FromDelivery,
{
    fn prepare(&self, ctx: Context) -> Result<HandlerFuture, DecodeError> {
        let message = M::from_delivery(ctx.delivery())?;
        let handler = Arc::clone(&self.handler);
        // The async block owns the Arc, so the handler's future may borrow `&self` and the boxed
        // future is still 'static (needed to spawn it).
        Ok(Box::pin(async move { handler.handle(message, ctx).await }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mock(body: &[u8]) -> Delivery {
        Delivery::mock(7, "ex".into(), "rk".into(), true, body.to_vec())
    }

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Job {
        id: u32,
    }

    #[test]
    fn json_decodes_and_rejects_garbage() {
        let ok = Json::<Job>::from_delivery(&mock(br#"{"id": 3}"#)).unwrap();
        assert_eq!(ok.id, 3);
        assert!(Json::<Job>::from_delivery(&mock(b"{not json")).is_err());
        assert!(Json::<Job>::from_delivery(&mock(b"")).is_err());
    }

    #[test]
    fn raw_and_text() {
        assert_eq!(
            Raw::from_delivery(&mock(b"\xff\x00")).unwrap().0,
            b"\xff\x00"
        );
        assert!(Text::from_delivery(&mock(b"\xff")).is_err());
        assert_eq!(&*Text::from_delivery(&mock(b"hi")).unwrap(), "hi");
    }

    #[test]
    fn context_falls_back_to_delivery_routing() {
        let d = mock(b"{}");
        let ctx = Context::new(
            "q".into(),
            mock(b"{}"),
            RetryState::default(),
            Arc::default(),
        );
        assert_eq!(ctx.attempt(), 0);
        assert!(!ctx.is_retry());
        assert!(ctx.redelivered());
        assert_eq!(ctx.original_exchange(), "ex");
        assert_eq!(ctx.original_routing_key(), "rk");
        assert_eq!(ctx.delivery_tag(), 7);
        assert_eq!(ctx.message_id(), None);
        let retry = RetryState {
            attempt: 2,
            original_exchange: Some("orders".into()),
            original_routing_key: Some("eu.new".into()),
            ..RetryState::default()
        };
        let ctx = Context::new("q".into(), d, retry, Arc::default());
        assert!(ctx.is_retry());
        assert_eq!(ctx.original_exchange(), "orders");
        assert_eq!(ctx.original_routing_key(), "eu.new");
    }

    #[tokio::test]
    async fn closures_and_structs_are_handlers() {
        struct S;
        impl Handler<Raw> for S {
            async fn handle(&self, m: Raw, _ctx: Context) -> Result<(), HandlerError> {
                if m.is_empty() {
                    Err(HandlerError::permanent("empty"))
                } else {
                    Ok(())
                }
            }
        }
        let ctx = |body: &[u8]| {
            Context::new(
                "q".into(),
                mock(body),
                RetryState::default(),
                Arc::default(),
            )
        };
        let erased: Box<dyn ErasedHandler> = Box::new(Erased::<_, Raw>::new(S));
        assert!(erased.prepare(ctx(b"x")).unwrap().await.is_ok());
        assert!(erased.prepare(ctx(b"")).unwrap().await.is_err());
        let closure = |m: Json<Job>, _ctx: Context| async move {
            if m.id == 1 {
                Ok(())
            } else {
                Err(HandlerError::transient("not one"))
            }
        };
        let erased: Box<dyn ErasedHandler> = Box::new(Erased::<_, Json<Job>>::new(closure));
        assert!(erased.prepare(ctx(br#"{"id":1}"#)).unwrap().await.is_ok());
        assert!(erased.prepare(ctx(b"nope")).is_err());
    }
}
