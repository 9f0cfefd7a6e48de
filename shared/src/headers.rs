//! Kafka header names Postal writes on every record and reads back on the consumer side.
//!
//! The layout follows the CloudEvents Kafka protocol binding, binary content mode: the record
//! value is the payload as-is, and each CloudEvents attribute is a header with the `ce_` prefix.
//! Postal adds two extension attributes (`ce_schemaversion`, `ce_postalseq`) and the W3C
//! `traceparent` / `tracestate` headers. User headers are copied unchanged.

/// CloudEvents `id`: the event id (UUID, text form).
pub const CE_ID: &str = "ce_id";
/// CloudEvents `type`: the event type, e.g. `order.created`.
pub const CE_TYPE: &str = "ce_type";
/// CloudEvents `source`: the producing service (relay setting `source`).
pub const CE_SOURCE: &str = "ce_source";
/// CloudEvents `time`: when the event occurred (RFC 3339).
pub const CE_TIME: &str = "ce_time";
/// CloudEvents `specversion`: always [`SPEC_VERSION`].
pub const CE_SPECVERSION: &str = "ce_specversion";
/// CloudEvents `subject`: the event key (aggregate id).
pub const CE_SUBJECT: &str = "ce_subject";
/// Extension attribute: the payload's schema version.
pub const CE_SCHEMA_VERSION: &str = "ce_schemaversion";
/// Extension attribute: the event's outbox sequence number (per key, increasing).
pub const CE_POSTAL_SEQ: &str = "ce_postalseq";
/// The payload's content type (CloudEvents `datacontenttype` in binary mode).
pub const CONTENT_TYPE: &str = "content-type";
/// W3C trace context parent.
pub const TRACEPARENT: &str = "traceparent";
/// W3C trace context vendor state.
pub const TRACESTATE: &str = "tracestate";

/// Dead-letter records: why the record was dead-lettered (`permanent`, `undecodable`,
/// `missing_event_id`, `unknown_type`, `panic`, `retries_exhausted`).
pub const DLQ_REASON: &str = "postal_dlq_reason";
/// Dead-letter records: the error message.
pub const DLQ_ERROR: &str = "postal_dlq_error";
/// Dead-letter records: the topic the record was consumed from.
pub const DLQ_TOPIC: &str = "postal_dlq_topic";
/// Dead-letter records: the partition the record was consumed from.
pub const DLQ_PARTITION: &str = "postal_dlq_partition";
/// Dead-letter records: the offset of the original record.
pub const DLQ_OFFSET: &str = "postal_dlq_offset";
/// Dead-letter records: the consumer (dedup scope) that gave up on the record.
pub const DLQ_CONSUMER: &str = "postal_dlq_consumer";
/// Dead-letter records: how many times the handler ran.
pub const DLQ_ATTEMPTS: &str = "postal_dlq_attempts";
/// Dead-letter records: the id of the row in `postal.dead_letters`.
pub const DLQ_ID: &str = "postal_dlq_id";

/// The CloudEvents spec version Postal writes.
pub const SPEC_VERSION: &str = "1.0";

/// Headers Postal sets itself; user headers with these names are rejected at enqueue time.
pub const RESERVED: &[&str] = &[
    CE_ID,
    CE_TYPE,
    CE_SOURCE,
    CE_TIME,
    CE_SPECVERSION,
    CE_SUBJECT,
    CE_SCHEMA_VERSION,
    CE_POSTAL_SEQ,
    CONTENT_TYPE,
];

/// Whether a header name is reserved for Postal.
pub fn is_reserved(name: &str) -> bool {
    RESERVED.iter().any(|r| r.eq_ignore_ascii_case(name))
}
