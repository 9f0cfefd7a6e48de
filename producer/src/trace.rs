//! W3C trace context capture at enqueue time.
//!
//! With the `otel` feature (on by default) and a `tracing-opentelemetry` layer installed, the
//! current span's context is written into the event's `traceparent` (and `tracestate`) header,
//! so the consumer's handler span can continue the same trace. Without a layer, or with an
//! invalid span context, nothing is captured.

/// The current span's `(traceparent, tracestate)`, if it belongs to a valid trace.
#[cfg(feature = "otel")]
pub(crate) fn current_traceparent() -> Option<(String, Option<String>)> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let parent = format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    );
    let state = sc.trace_state().header();
    Some((parent, (!state.is_empty()).then_some(state)))
}

/// Without the `otel` feature there is no span context to capture.
#[cfg(not(feature = "otel"))]
pub(crate) fn current_traceparent() -> Option<(String, Option<String>)> {
    None
}
