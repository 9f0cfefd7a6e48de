//! What a handler sees: the decoded event with its id, key, type, version and headers.

use chrono::{DateTime, Utc};
use postal_shared::EventId;
use serde::de::DeserializeOwned;

/// Where a record was read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Position {
    /// Kafka topic.
    pub topic: String,
    /// Kafka partition.
    pub partition: i32,
    /// Offset of the record.
    pub offset: i64,
}

/// The headers of a record, in order (names may repeat).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, Option<Vec<u8>>)>);

impl Headers {
    /// Wraps raw header pairs.
    pub fn new(pairs: Vec<(String, Option<Vec<u8>>)>) -> Self {
        Headers(pairs)
    }

    /// The last value of `name` (case-sensitive) as UTF-8, if present and valid.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_bytes(name)
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The last value of `name` as bytes.
    pub fn get_bytes(&self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// Appends a header.
    pub fn push(&mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) {
        self.0.push((name.into(), Some(value.into())));
    }

    /// All pairs in record order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Option<&[u8]>)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_deref()))
    }

    /// Number of headers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One event as a handler receives it.
///
/// `id` is the outbox event id carried in the `ce_id` header: the same on every redelivery and
/// republish, so use it as the idempotency key towards external systems too.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Event<T> {
    /// The event id (`ce_id`).
    pub id: EventId,
    /// The event key (the Kafka record key, usually the aggregate id), if any.
    pub key: Option<String>,
    /// The event type (`ce_type`).
    pub event_type: String,
    /// The payload schema version (`ce_schemaversion`, 1 when absent).
    pub schema_version: i32,
    /// When the event occurred (`ce_time`), if given.
    pub occurred_at: Option<DateTime<Utc>>,
    /// Every header of the record, including the CloudEvents ones and `traceparent`.
    pub headers: Headers,
    /// Where the record was read from (`None` for events built in tests).
    pub position: Option<Position>,
    /// The record's Kafka timestamp (`None` for events built in tests and records without
    /// one): when the producer created it (`CreateTime`, Postal's relay: when it handed the
    /// event to the producer) or when the broker appended it (`LogAppendTime` topics), in
    /// milliseconds.
    pub timestamp: Option<DateTime<Utc>>,
    /// The decoded payload.
    pub payload: T,
}

impl<T> Event<T> {
    /// An event with the given id, type and payload (schema version 1, no key, no headers):
    /// for tests and for calling handlers directly.
    pub fn new(id: EventId, event_type: impl Into<String>, payload: T) -> Self {
        Event {
            id,
            key: None,
            event_type: event_type.into(),
            schema_version: 1,
            occurred_at: None,
            headers: Headers::default(),
            position: None,
            timestamp: None,
            payload,
        }
    }

    /// Sets the key.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the schema version.
    pub fn with_schema_version(mut self, version: i32) -> Self {
        self.schema_version = version;
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push(name, value);
        self
    }

    /// The W3C `traceparent` of the producing span, when the producer captured one.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get(postal_shared::headers::TRACEPARENT)
    }
}

/// How a payload type is decoded from record bytes.
///
/// Every `serde` type decodes from JSON (records whose `content-type` is absent or JSON);
/// use [`Raw`] to receive the bytes and content type as they are (Avro, Protobuf, …).
pub trait Payload: Sized + Send + 'static {
    /// Decodes the payload; the error becomes the dead letter's reason.
    fn decode(content_type: Option<&str>, bytes: &[u8]) -> Result<Self, String>;
}

impl<T: DeserializeOwned + Send + 'static> Payload for T {
    fn decode(content_type: Option<&str>, bytes: &[u8]) -> Result<Self, String> {
        if let Some(ct) = content_type {
            let essence = ct.split(';').next().unwrap_or("").trim();
            if !(essence == "application/json" || essence.ends_with("+json")) {
                return Err(format!(
                    "content type {} is not JSON",
                    postal_shared::text::quoted(ct)
                ));
            }
        }
        serde_json::from_slice(bytes).map_err(|e| format!("payload is not the expected JSON: {e}"))
    }
}

/// An undecoded payload: the bytes and the record's content type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Raw {
    /// The `content-type` header, if any.
    pub content_type: Option<String>,
    /// The record value.
    pub bytes: Vec<u8>,
}

impl Payload for Raw {
    fn decode(content_type: Option<&str>, bytes: &[u8]) -> Result<Self, String> {
        Ok(Raw {
            content_type: content_type.map(str::to_owned),
            bytes: bytes.to_vec(),
        })
    }
}
