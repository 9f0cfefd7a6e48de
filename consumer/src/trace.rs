//! Continuing the producer's trace: the handler span becomes a child of the span that enqueued
//! the event, through the `traceparent` header the relay carried from the outbox row.

use crate::event::Headers;

/// Makes `span` a child of the remote span named by the record's `traceparent` (W3C trace
/// context, version 00), when the `otel` feature is on and a `tracing-opentelemetry` layer is
/// installed; otherwise does nothing.
#[cfg(feature = "otel")]
pub(crate) fn continue_trace(span: &tracing::Span, headers: &Headers) {
    use std::str::FromStr;

    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    let Some(tp) = headers.get(postal_shared::headers::TRACEPARENT) else {
        return;
    };
    let parts: Vec<&str> = tp.trim().split('-').collect();
    let [version, trace, parent, flags] = parts.as_slice() else {
        return;
    };
    if *version != "00" {
        return;
    }
    let (Ok(trace), Ok(parent), Ok(flags)) = (
        TraceId::from_hex(trace),
        SpanId::from_hex(parent),
        u8::from_str_radix(flags, 16),
    ) else {
        return;
    };
    let state = headers
        .get(postal_shared::headers::TRACESTATE)
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    let sc = SpanContext::new(trace, parent, TraceFlags::new(flags), true, state);
    if !sc.is_valid() {
        return;
    }
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
}

/// Without the `otel` feature there is no trace to continue.
#[cfg(not(feature = "otel"))]
pub(crate) fn continue_trace(_span: &tracing::Span, _headers: &Headers) {}
