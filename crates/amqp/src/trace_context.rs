//! W3C trace context in message headers (`traceparent`, `tracestate`), with the `otel` feature:
//! the [`Publisher`](crate::Publisher) writes the current `tracing` span's context into the
//! messages it publishes, and a consumer continues that trace with [`extract`] (the worker
//! does it for every delivery).
//!
//! The format is always W3C Trace Context (what Spring AMQP, MassTransit and NServiceBus use),
//! whatever global propagator the service installed. The spans themselves only reach an
//! OpenTelemetry exporter when the service installs `tracing-opentelemetry`'s layer.

use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::headers::TRACEPARENT;

/// The trace context `headers` carry; an empty context (a new trace) when they carry none or
/// an invalid one.
///
/// ```
/// use lapin::types::{AMQPValue, FieldTable};
/// use opentelemetry::trace::TraceContextExt;
/// let mut headers = FieldTable::default();
/// headers.insert(
///     "traceparent".into(),
///     AMQPValue::LongString("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
/// );
/// let cx = redeliver::amqp::trace_context::extract(Some(&headers));
/// assert_eq!(
///     cx.span().span_context().trace_id().to_string(),
///     "0af7651916cd43dd8448eb211c80319c"
/// );
/// ```
pub fn extract(headers: Option<&FieldTable>) -> Context {
    match headers {
        Some(h) => TraceContextPropagator::new().extract(&Headers(h)),
        None => Context::new(),
    }
}

/// Writes `cx` into `headers` (replacing a `traceparent` already there); nothing when `cx` has
/// no valid span.
pub fn inject(cx: &Context, headers: &mut FieldTable) {
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(cx, &mut HeadersMut(headers));
    }
}

/// `props` with the current span's trace context in its headers, unless they already carry a
/// `traceparent` (a copy keeps its original's trace).
pub(crate) fn with_current(props: BasicProperties) -> BasicProperties {
    let has_parent = props
        .headers()
        .as_ref()
        .is_some_and(|h| h.inner().contains_key(TRACEPARENT));
    if has_parent {
        return props;
    }
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return props;
    }
    let mut headers = props.headers().clone().unwrap_or_default();
    inject(&cx, &mut headers);
    props.with_headers(headers)
}

struct Headers<'a>(&'a FieldTable);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match self.0.inner().get(key)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
            AMQPValue::ShortString(s) => Some(s.as_str()),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.0.inner().keys().map(|k| k.as_str()).collect()
    }
}

struct HeadersMut<'a>(&'a mut FieldTable);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0
            .insert(key.into(), AMQPValue::LongString(LongString::from(value)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    #[test]
    fn a_context_survives_the_round_trip() {
        let sc = SpanContext::new(
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
            SpanId::from_hex("b7ad6b7169203331").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let cx = Context::new().with_remote_span_context(sc.clone());
        let mut headers = FieldTable::default();
        inject(&cx, &mut headers);
        assert!(headers.inner().contains_key(TRACEPARENT));
        let back = extract(Some(&headers));
        assert_eq!(back.span().span_context().trace_id(), sc.trace_id());
        assert_eq!(back.span().span_context().span_id(), sc.span_id());
    }

    #[test]
    fn no_or_bad_headers_start_a_new_trace() {
        assert!(!extract(None).span().span_context().is_valid());
        let mut headers = FieldTable::default();
        headers.insert(TRACEPARENT.into(), AMQPValue::LongString("garbage".into()));
        assert!(!extract(Some(&headers)).span().span_context().is_valid());
        let mut empty = FieldTable::default();
        inject(&Context::new(), &mut empty);
        assert!(empty.inner().is_empty());
    }

    #[test]
    fn a_copy_keeps_its_trace() {
        let mut headers = FieldTable::default();
        headers.insert(
            TRACEPARENT.into(),
            AMQPValue::LongString("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
        );
        let props = BasicProperties::default().with_headers(headers.clone());
        assert_eq!(with_current(props).headers(), &Some(headers));
    }
}
