//! The event a service writes to the outbox.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use postal_shared::{headers, ContentType, EventId, EventKey, EventType, SchemaVersion, Topic};
use serde::Serialize;

use crate::Error;

/// Largest payload `enqueue` accepts (bytes). Brokers usually reject records above ~1 MiB; the
/// relay checks the destination's own limit again and parks what does not fit.
pub const MAX_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;

/// Most user headers an event may carry: with Postal's own (up to 11) well under the 256 a
/// consumer accepts by default (`ConsumerConfig::max_headers`).
pub const MAX_USER_HEADERS: usize = 128;

/// An event to enqueue: what it is, where it goes and its payload.
///
/// Build one with [`NewEvent::json`] (typed payload, serialised with serde) or
/// [`NewEvent::bytes`] (already encoded: Avro, Protobuf, …), then refine it with the `with_*`
/// methods. The event id is a fresh UUIDv7 unless [`NewEvent::with_id`] supplies one.
#[derive(Clone, Debug)]
pub struct NewEvent {
    pub(crate) id: EventId,
    pub(crate) topic: Topic,
    pub(crate) key: EventKey,
    pub(crate) event_type: EventType,
    pub(crate) schema_version: SchemaVersion,
    pub(crate) occurred_at: DateTime<Utc>,
    pub(crate) content_type: ContentType,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) deliver_at: Option<DateTime<Utc>>,
}

impl NewEvent {
    /// An event whose payload is `payload` serialised as JSON.
    ///
    /// `topic`, `key` and `event_type` are validated here; an invalid value is an error at the
    /// call, before anything touches the database.
    pub fn json<T: Serialize + ?Sized>(
        topic: impl TryInto<Topic, Error = postal_shared::Error>,
        key: impl TryInto<EventKey, Error = postal_shared::Error>,
        event_type: impl TryInto<EventType, Error = postal_shared::Error>,
        payload: &T,
    ) -> Result<Self, Error> {
        let payload = serde_json::to_vec(payload).map_err(Error::Serialize)?;
        Self::bytes(topic, key, event_type, ContentType::json(), payload)
    }

    /// An event whose payload is already encoded, with its content type
    /// (e.g. `application/avro`, `application/x-protobuf`).
    pub fn bytes(
        topic: impl TryInto<Topic, Error = postal_shared::Error>,
        key: impl TryInto<EventKey, Error = postal_shared::Error>,
        event_type: impl TryInto<EventType, Error = postal_shared::Error>,
        content_type: ContentType,
        payload: impl Into<Vec<u8>>,
    ) -> Result<Self, Error> {
        let payload = payload.into();
        if payload.len() > MAX_PAYLOAD_BYTES {
            return Err(Error::PayloadTooLarge {
                size: payload.len(),
                max: MAX_PAYLOAD_BYTES,
            });
        }
        Ok(NewEvent {
            id: EventId::new(),
            topic: topic.try_into()?,
            key: key.try_into()?,
            event_type: event_type.try_into()?,
            schema_version: SchemaVersion::ONE,
            occurred_at: Utc::now(),
            content_type,
            payload,
            headers: BTreeMap::new(),
            deliver_at: None,
        })
    }

    /// Uses a caller-supplied event id (e.g. derived from an idempotency key). Enqueueing the
    /// same id twice fails with [`Error::DuplicateEventId`].
    pub fn with_id(mut self, id: EventId) -> Self {
        self.id = id;
        self
    }

    /// Sets the payload's schema version (default 1).
    pub fn with_schema_version(mut self, version: SchemaVersion) -> Self {
        self.schema_version = version;
        self
    }

    /// Sets when the event occurred (default: when the `NewEvent` was built).
    pub fn with_occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.occurred_at = at;
        self
    }

    /// Publishes no earlier than `at`. Until then the event also holds back later events of its
    /// key, so per-key order is kept.
    pub fn deliver_at(mut self, at: DateTime<Utc>) -> Self {
        self.deliver_at = Some(at);
        self
    }

    /// Adds a user header, copied to the Kafka record. Names Postal sets itself
    /// (`ce_*` attributes, `content-type`) are rejected, as is a header beyond the
    /// [`MAX_USER_HEADERS`]th, a value over [`headers::MAX_HEADER_VALUE_BYTES`] (8 KiB) and
    /// headers over [`headers::MAX_HEADERS_BYTES`] (64 KiB, names and values) together.
    pub fn with_header(
        mut self,
        name: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<Self, Error> {
        let name = name.into();
        if name.is_empty() || headers::is_reserved(&name) {
            return Err(Error::ReservedHeader(name));
        }
        if let Some(problem) = headers::user_header_problem(&name) {
            return Err(Error::Invalid(postal_shared::Error::Invalid {
                what: "headers",
                reason: problem.reason(&headers::shown_name(&name)),
            }));
        }
        if self.headers.len() >= MAX_USER_HEADERS && !self.headers.contains_key(&name) {
            return Err(Error::Invalid(postal_shared::Error::Invalid {
                what: "headers",
                reason: format!(
                    "at most {MAX_USER_HEADERS} user headers (consumers refuse records with more \
                     than 256 headers by default)"
                ),
            }));
        }
        let value = value.into();
        // PostgreSQL's jsonb holds no NUL (`\u0000`): written, the enqueue would fail with a
        // database error that aborts the caller's transaction.
        if name.contains('\0') || value.contains('\0') {
            return Err(Error::Invalid(postal_shared::Error::Invalid {
                what: "headers",
                reason: format!(
                    "header \"{}\" holds a NUL character, which PostgreSQL cannot store",
                    headers::shown_name(&name)
                ),
            }));
        }
        let others = self
            .headers
            .iter()
            .filter(|(k, _)| **k != name)
            .map(|(k, v)| (k.as_str(), v.as_str()));
        if let Some(reason) = headers::size_problem(others.chain([(name.as_str(), value.as_str())]))
        {
            return Err(Error::Invalid(postal_shared::Error::Invalid {
                what: "headers",
                reason,
            }));
        }
        self.headers.insert(name, value);
        Ok(self)
    }

    /// The event's id.
    pub fn id(&self) -> EventId {
        self.id
    }

    /// The destination topic.
    pub fn topic(&self) -> &Topic {
        &self.topic
    }

    /// The event key.
    pub fn key(&self) -> &EventKey {
        &self.key
    }

    /// The encoded payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: the names of an event are taken as `&str`, `String` and `&String` alike (a
    /// `&String` used to fail to compile with E0271 "expected Error, found Infallible").
    #[test]
    fn names_are_taken_from_borrowed_strings() {
        let (topic, key, event_type) = (
            "orders".to_string(),
            "customer-7".to_string(),
            "t".to_string(),
        );
        let e = NewEvent::json(&topic, &key, &event_type, &1).unwrap();
        assert_eq!(e.key.as_str(), "customer-7");
        let empty = String::new();
        assert!(NewEvent::json(&topic, &empty, &event_type, &1).is_err());
    }

    /// Guarantee: an event carries at most MAX_USER_HEADERS user headers (so that with
    /// Postal's own it stays under what consumers accept); replacing one is not adding one.
    #[test]
    fn user_headers_are_capped() {
        let mut e = NewEvent::json("orders", "k", "t", &1).unwrap();
        for i in 0..MAX_USER_HEADERS {
            e = e.with_header(format!("h{i}"), "v").unwrap();
        }
        let e = e.with_header("h0", "again").expect("replacing is fine");
        let err = e.with_header("one-more", "v").unwrap_err().to_string();
        assert!(err.contains("at most 128 user headers"), "{err}");
    }

    /// Guarantee: a header name or value holding a NUL character is refused at the call with a
    /// one-line reason.
    ///
    /// Broken: it was taken, for `enqueue` to write it into jsonb, which holds no `\u0000`
    /// (`SELECT '{"x":"a\u0000b"}'::jsonb` fails with `unsupported Unicode escape sequence`):
    /// a database error in the caller's transaction, which PostgreSQL then aborts.
    #[test]
    fn a_nul_in_a_header_is_refused_at_the_call() {
        let e = NewEvent::json("orders", "k", "t", &1).unwrap();
        for (name, value) in [("x-ua", "Mozilla\0/5.0"), ("x\0y", "v")] {
            let err = e
                .clone()
                .with_header(name, value)
                .expect_err("a NUL is refused")
                .to_string();
            assert!(err.contains("NUL") && !err.contains('\0'), "{err:?}");
        }
        assert!(e.with_header("x-ua", "Mozilla/5.0").is_ok());
    }

    /// Guarantee: a header value over 8 KiB, or headers over 64 KiB together, are refused at
    /// the call with a one-line reason; replacing a header counts its new value only.
    #[test]
    fn header_sizes_are_capped() {
        let e = NewEvent::json("orders", "k", "t", &1).unwrap();
        let err = e
            .clone()
            .with_header("x-big", "v".repeat(200_000))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"x-big\"") && !err.contains('\n'), "{err}");
        let mut e = e;
        for i in 0..8 {
            e = e.with_header(format!("h{i}"), "v".repeat(8190)).unwrap();
        }
        let e = e
            .with_header("h0", "v".repeat(8190))
            .expect("a replacement");
        let err = e.with_header("h8", "v").unwrap_err().to_string();
        assert!(err.contains("65536"), "{err}");
    }
}
