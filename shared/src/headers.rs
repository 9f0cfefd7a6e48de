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
/// CloudEvents distributed-tracing extension `traceparent` (the relay writes it beside
/// [`TRACEPARENT`], for CloudEvents SDKs).
pub const CE_TRACEPARENT: &str = "ce_traceparent";
/// CloudEvents distributed-tracing extension `tracestate`.
pub const CE_TRACESTATE: &str = "ce_tracestate";

/// The CloudEvents extension header the relay writes beside a trace-context header `name`.
pub fn trace_extension(name: &str) -> Option<&'static str> {
    match name {
        TRACEPARENT => Some(CE_TRACEPARENT),
        TRACESTATE => Some(CE_TRACESTATE),
        _ => None,
    }
}

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
/// Dead-letter records: what the copy leaves out because the whole record does not fit
/// (`value`, `value,headers` or `value,headers,key`); absent on a whole copy. The row in
/// `postal.dead_letters` ([`DLQ_ID`]) keeps the record whole.
pub const DLQ_CUT: &str = "postal_dlq_cut";

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
    CE_TRACEPARENT,
    CE_TRACESTATE,
    CONTENT_TYPE,
];

/// Whether a header name is reserved for Postal.
pub fn is_reserved(name: &str) -> bool {
    RESERVED.iter().any(|r| r.eq_ignore_ascii_case(name))
}

/// The CloudEvents context attributes (as Kafka headers `ce_<name>`): a user header may not
/// use one, whether or not Postal sets it (a CloudEvents SDK reads it as the attribute).
const CONTEXT_ATTRIBUTES: &[&str] = &[
    "id",
    "source",
    "specversion",
    "type",
    "datacontenttype",
    "dataschema",
    "subject",
    "time",
];

/// The value a dead letter's row keeps for its `i`th header (from 0): `None` when the header
/// had none (its position, from 1, is in `absent`, the row's `header_absent`, ascending),
/// else `value` (empty when it was empty).
pub fn kept_value<'a>(value: &'a [u8], absent: &[i32], i: usize) -> Option<&'a [u8]> {
    let position = i32::try_from(i + 1).unwrap_or(i32::MAX);
    absent.binary_search(&position).is_err().then_some(value)
}

/// The longest user header name (RabbitMQ's header names are AMQP short strings).
pub const MAX_HEADER_NAME_BYTES: usize = 255;

/// The largest user header value (bytes). Header values travel in every copy of the record
/// and, on RabbitMQ, in the message's content-header frame, which AMQP cannot split: large
/// data belongs in the payload. 8 KiB, like the per-header limit of common HTTP servers.
pub const MAX_HEADER_VALUE_BYTES: usize = 8 * 1024;

/// The most bytes all user headers of an event may hold together (names and values). With
/// Postal's own headers and properties this stays well inside RabbitMQ's default `frame_max`
/// (128 KiB, one frame for all headers) and Kafka's default record limit (1 MB).
pub const MAX_HEADERS_BYTES: usize = 64 * 1024;

/// Why an event's user headers are too large to send, if they are: one value over
/// [`MAX_HEADER_VALUE_BYTES`], or names and values together over [`MAX_HEADERS_BYTES`]. One
/// line, naming the header.
pub fn size_problem<'a>(headers: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<String> {
    let mut total = 0usize;
    for (name, value) in headers {
        if value.len() > MAX_HEADER_VALUE_BYTES {
            return Some(format!(
                "header \"{}\" has a value of {} bytes, more than the {MAX_HEADER_VALUE_BYTES} a header value may hold (put large data in the payload)",
                shown_name(name),
                value.len()
            ));
        }
        total += name.len() + value.len();
    }
    (total > MAX_HEADERS_BYTES).then(|| {
        format!(
            "the headers hold {total} bytes (names and values), more than the {MAX_HEADERS_BYTES} an event's headers may hold together (put large data in the payload)"
        )
    })
}

/// Why a user header may not be sent as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderProblem {
    /// An empty name.
    Empty,
    /// A name Postal sets itself.
    Reserved,
    /// A CloudEvents context attribute (`ce_dataschema`, …).
    ContextAttribute,
    /// `ce_<name>` where `<name>` is not letters and digits.
    ExtensionName,
    /// Longer than [`MAX_HEADER_NAME_BYTES`].
    TooLong,
    /// A stored header whose value is not a string (written around `postal.enqueue`).
    NotAString,
}

impl HeaderProblem {
    /// The one-line reason, naming the header as `shown`.
    pub fn reason(self, shown: &str) -> String {
        match self {
            HeaderProblem::Empty => "a header name must not be empty".into(),
            HeaderProblem::Reserved => format!("header \"{shown}\" is reserved: Postal sets it"),
            HeaderProblem::ContextAttribute => format!(
                "header \"{shown}\" is a CloudEvents context attribute: CloudEvents consumers read it as the event's own; use another name"
            ),
            HeaderProblem::ExtensionName => format!(
                "header \"{shown}\" is a CloudEvents extension attribute (ce_<name>) whose name is not letters and digits: CloudEvents consumers refuse the record; rename it"
            ),
            HeaderProblem::TooLong => format!(
                "header name \"{shown}…\" is longer than {MAX_HEADER_NAME_BYTES} bytes"
            ),
            HeaderProblem::NotAString => {
                format!("stored header \"{shown}\" has a value that is not a JSON string")
            }
        }
    }
}

/// The name under which the relay passes on a stored header whose value is not a string: a
/// NUL first, which no header name stored in PostgreSQL can hold.
pub fn not_a_string(name: &str) -> String {
    format!("\0{name}")
}

/// Why a user header may not have this name, if it may not: a name Postal sets itself, a
/// CloudEvents context attribute, a `ce_<name>` header (an extension attribute in the Kafka
/// binding) whose `<name>` is not letters and digits — CloudEvents consumers (the Java SDK's
/// `CloudEventDeserializer`) refuse such a record, and a consumer that stops on it holds its
/// partition — or a name longer than [`MAX_HEADER_NAME_BYTES`].
pub fn user_header_problem(name: &str) -> Option<HeaderProblem> {
    if name.is_empty() {
        return Some(HeaderProblem::Empty);
    }
    if name.starts_with('\0') {
        return Some(HeaderProblem::NotAString);
    }
    if is_reserved(name) {
        return Some(HeaderProblem::Reserved);
    }
    if name.len() > MAX_HEADER_NAME_BYTES {
        return Some(HeaderProblem::TooLong);
    }
    if name.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("ce_")) {
        let ext = &name[3..];
        if CONTEXT_ATTRIBUTES
            .iter()
            .any(|a| a.eq_ignore_ascii_case(ext))
        {
            return Some(HeaderProblem::ContextAttribute);
        }
        if ext.is_empty() || !ext.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Some(HeaderProblem::ExtensionName);
        }
    }
    None
}

/// A header name for a one-line message: escaped, at most 64 characters.
pub fn shown_name(name: &str) -> String {
    name.trim_start_matches('\0')
        .chars()
        .take(64)
        .flat_map(char::escape_default)
        .collect()
}

/// Checks a CloudEvents `source` (the relay's `--source`): a non-empty URI-reference (RFC 3986
/// characters, `%` followed by two hex digits), as CloudEvents consumers require — the Java
/// SDK refuses every record of a relay whose source is, say, `billing service`.
pub fn check_source(source: &str) -> Result<(), String> {
    let refuse = |why: &str| {
        Err(format!(
            "source {source:?} is not a URI-reference ({why}): CloudEvents consumers refuse its records; use e.g. /shop/orders or urn:shop:orders"
        ))
    };
    if source.is_empty() {
        return refuse("it is empty");
    }
    let bytes = source.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c == b'%' {
            let hex = |b: Option<&u8>| b.is_some_and(u8::is_ascii_hexdigit);
            if !(hex(bytes.get(i + 1)) && hex(bytes.get(i + 2))) {
                return refuse("a % not followed by two hex digits");
            }
            i += 3;
            continue;
        }
        if !(c.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=".contains(&c)) {
            return refuse("a character a URI cannot hold unescaped");
        }
        i += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: user headers a CloudEvents consumer would refuse (a `ce_<name>` whose name
    /// is not letters and digits) and Postal's own names are refused; others pass.
    #[test]
    fn user_header_names() {
        for ok in [
            "x-tenant",
            "traceparent2",
            "ce_tenant",
            "ce_Tenant2",
            "c",
            "cex_a-b",
        ] {
            assert_eq!(user_header_problem(ok), None, "{ok}");
        }
        for bad in [
            "",
            "ce_id",
            "CE_TYPE",
            "ce_",
            "ce_tenant-id",
            "Ce_a.b",
            "content-type",
        ] {
            assert!(user_header_problem(bad).is_some(), "{bad}");
        }
    }

    /// Guarantee: a header value over MAX_HEADER_VALUE_BYTES, or headers over
    /// MAX_HEADERS_BYTES together, are refused with a reason naming the limit; headers at the
    /// limits pass.
    #[test]
    fn header_sizes() {
        let at = "v".repeat(MAX_HEADER_VALUE_BYTES);
        assert_eq!(size_problem([("a", at.as_str())]), None);
        let over = "v".repeat(MAX_HEADER_VALUE_BYTES + 1);
        let err = size_problem([("x-big", over.as_str())]).expect("refused");
        assert!(err.contains("\"x-big\"") && err.contains("8192"), "{err}");
        let names: Vec<String> = (0..8).map(|i| format!("h{i}")).collect();
        let value = "v".repeat(MAX_HEADER_VALUE_BYTES - 2);
        let fits: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), value.as_str())).collect();
        assert_eq!(size_problem(fits.iter().copied()), None);
        let err = size_problem(fits.iter().copied().chain([("h8", "v")])).expect("refused");
        assert!(err.contains("65536"), "{err}");
    }

    /// Guarantee: a source that is not a URI-reference is refused, with the reason.
    #[test]
    fn sources() {
        for ok in [
            "postal",
            "/shop/orders",
            "urn:shop:orders",
            "https://a.example/x?y=1",
            "a%20b",
        ] {
            assert_eq!(check_source(ok), Ok(()), "{ok}");
        }
        for bad in ["", "billing service", "a%2", "a%zz", "ä", "a\nb"] {
            let err = check_source(bad).unwrap_err();
            assert!(err.contains("not a URI-reference"), "{bad}: {err}");
        }
    }
}
