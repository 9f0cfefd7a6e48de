//! The consumed Kafka record as Postal reads it: owned bytes plus the envelope headers.

use chrono::{DateTime, Utc};
use postal_shared::{headers, EventId};
use rdkafka::message::{Headers as _, Message};

use crate::event::{Event, Headers, Payload, Position};
use crate::packed_headers::PackedHeaders;
use crate::reason::Reason;

/// One consumed record.
#[derive(Clone, Debug)]
pub(crate) struct Record {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub headers: Headers,
    /// The record's Kafka timestamp, if it has one.
    pub timestamp: Option<DateTime<Utc>>,
    /// The position of the first header whose name could not be read (not UTF-8): the record
    /// is dead-lettered as undecodable instead of crashing the consumer.
    pub unreadable_header: Option<usize>,
    /// The record's headers, whole and packed (`crate::packed_headers`), when it carried
    /// more than the limit (`max_headers`): only Postal's own were copied to `headers`, and
    /// the event is dead-lettered as undecodable, its dead-letter row keeping these whole.
    pub too_many_headers: Option<PackedHeaders>,
    /// About how many bytes this copy holds (see [`weight`]).
    pub weight: usize,
}

/// Memory a header costs in the record's copy beyond its name and value (two allocations
/// and their bookkeeping).
const HEADER_OVERHEAD: usize = 48;

/// About how many bytes a record's copy holds: key, value, header names and values, and a
/// fixed cost per header and per record.
pub(crate) fn weight(key: Option<&[u8]>, payload: Option<&[u8]>, headers: &Headers) -> usize {
    256 + key.map_or(0, <[u8]>::len)
        + payload.map_or(0, <[u8]>::len)
        + headers
            .iter()
            .map(|(n, v)| HEADER_OVERHEAD + n.len() + v.map_or(0, <[u8]>::len))
            .sum::<usize>()
}

impl Record {
    /// Its headers as read from a record carrying `all` (in order): over `max_headers`, only
    /// Postal's own, and all of them packed (as [`Record::from_message`] keeps them).
    pub(crate) fn read_headers(
        all: Vec<(String, Option<Vec<u8>>)>,
        max_headers: usize,
    ) -> (Headers, Option<PackedHeaders>) {
        if all.len() <= max_headers {
            return (Headers::new(all), None);
        }
        let mut packed = PackedHeaders::with_capacity(0);
        for (n, v) in &all {
            packed.push(n, v.as_deref());
        }
        let own = all
            .into_iter()
            .filter(|(n, _)| headers::is_reserved(n))
            .collect();
        (Headers::new(own), Some(packed.shrunk()))
    }

    /// A copy of `m`. A record with more than `max_headers` headers keeps only Postal's own
    /// in `headers` (its envelope: the event is still identified, deduplicated and
    /// dead-lettered as itself) and all of them packed in `too_many_headers`, for its
    /// dead-letter row; [`decode`] refuses it.
    pub fn from_message<M: Message>(m: &M, max_headers: usize) -> Self {
        let mut unreadable_header = None;
        let mut too_many_headers = None;
        let headers = m
            .headers()
            .map(|h| {
                let over = h.count() > max_headers;
                let mut packed = over.then(|| PackedHeaders::with_capacity(2 * h.count()));
                let mut pairs = Vec::with_capacity(if over { 16 } else { h.count() });
                for i in 0..h.count() {
                    // The Kafka client's accessor panics on a header name that is not UTF-8
                    // (it unwraps the conversion): one such record from anyone with produce
                    // rights would end the consumer, and again after every restart. Caught
                    // here, per header, so the record can be dead-lettered by position.
                    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        h.try_get(i).map(|h| {
                            if let Some(p) = packed.as_mut() {
                                p.push(h.key, h.value);
                            }
                            (!over || headers::is_reserved(h.key))
                                .then(|| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                        })
                    }));
                    match read {
                        Ok(Some(Some(pair))) => pairs.push(pair),
                        Ok(Some(None) | None) => {}
                        Err(_) => {
                            unreadable_header.get_or_insert(i);
                        }
                    }
                }
                too_many_headers = packed.map(PackedHeaders::shrunk);
                pairs
            })
            .unwrap_or_default();
        let headers = Headers::new(headers);
        Record {
            weight: weight(m.key(), m.payload(), &headers)
                + too_many_headers.as_ref().map_or(0, PackedHeaders::len),
            too_many_headers,
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
            timestamp: m
                .timestamp()
                .to_millis()
                .and_then(DateTime::from_timestamp_millis),
            unreadable_header,
        }
    }

    pub fn position(&self) -> Position {
        Position {
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
        }
    }
}

/// The envelope fields every record must carry.
#[derive(Clone, Debug)]
pub(crate) struct Meta {
    pub id: EventId,
    pub event_type: String,
    pub schema_version: i32,
}

/// Why a record cannot even be routed.
pub(crate) type Rejection = (Reason, String);

/// Reads the event id, type and version from the headers.
pub(crate) fn meta(record: &Record) -> Result<Meta, Rejection> {
    if let Some(i) = record.unreadable_header {
        return Err((
            Reason::Undecodable,
            format!("header #{i} has a name that is not valid UTF-8"),
        ));
    }
    // Postal writes each of its headers once: a record with one twice (written around
    // Postal, or a row whose stored headers spoofed it) could make the event pass for another.
    if let Some((name, n)) = repeated_reserved(&record.headers) {
        return Err((
            Reason::Undecodable,
            format!("header {name} appears {n} times (Postal writes it once)"),
        ));
    }
    let id = match record.headers.get(headers::CE_ID) {
        None => {
            return Err((
                Reason::MissingEventId,
                format!("record has no {} header", headers::CE_ID),
            ))
        }
        Some(raw) => raw
            .parse::<uuid::Uuid>()
            .ok()
            .and_then(|u| EventId::from_uuid(u).ok())
            .ok_or_else(|| {
                (
                    Reason::MissingEventId,
                    format!(
                        "{} header {} is not a non-nil UUID",
                        headers::CE_ID,
                        postal_shared::text::quoted(raw)
                    ),
                )
            })?,
    };
    let event_type = record
        .headers
        .get(headers::CE_TYPE)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            (
                Reason::UnknownType,
                format!("record has no {} header", headers::CE_TYPE),
            )
        })?
        .to_owned();
    if event_type.len() > postal_shared::MAX_NAME_LEN {
        return Err((
            Reason::Undecodable,
            format!(
                "{} header of {} bytes is longer than an event type may be ({} bytes)",
                headers::CE_TYPE,
                event_type.len(),
                postal_shared::MAX_NAME_LEN
            ),
        ));
    }
    let schema_version = match record.headers.get(headers::CE_SCHEMA_VERSION) {
        None => 1,
        Some(v) => v.parse().map_err(|_| {
            (
                Reason::Undecodable,
                format!(
                    "{} header {} is not an integer",
                    headers::CE_SCHEMA_VERSION,
                    postal_shared::text::quoted(v)
                ),
            )
        })?,
    };
    Ok(Meta {
        id,
        event_type,
        schema_version,
    })
}

/// The first of Postal's reserved headers that the record carries more than once (names
/// compared without case), with how often.
fn repeated_reserved(h: &Headers) -> Option<(&'static str, usize)> {
    headers::RESERVED.iter().find_map(|&name| {
        let n = h
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .count();
        (n > 1).then_some((name, n))
    })
}

/// Why `record` cannot be decoded for its headers' count, if it cannot.
pub(crate) fn too_many_headers(record: &Record) -> Option<String> {
    record
        .too_many_headers
        .as_ref()
        .map(PackedHeaders::count)
        .map(|n| {
            format!(
                "record has {n} headers, more than the consumer's max_headers (the dead letter \
                 keeps them all)"
            )
        })
}

/// Decodes the full event for a handler.
/// The error (a decode error may quote the payload) is escaped and bounded.
pub(crate) fn decode<T: Payload>(record: &Record, meta: &Meta) -> Result<Event<T>, String> {
    if let Some(error) = too_many_headers(record) {
        return Err(error);
    }
    let content_type = record.headers.get(headers::CONTENT_TYPE);
    let payload =
        T::decode(content_type, record.payload.as_deref().unwrap_or_default()).map_err(|e| {
            postal_shared::text::bounded(&e, postal_shared::text::MAX_ERROR_BYTES).into_owned()
        })?;
    let occurred_at = record
        .headers
        .get(headers::CE_TIME)
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc));
    Ok(Event {
        id: meta.id,
        key: record
            .key
            .as_deref()
            .map(|k| String::from_utf8_lossy(k).into_owned()),
        event_type: meta.event_type.clone(),
        schema_version: meta.schema_version,
        occurred_at,
        headers: record.headers.clone(),
        position: Some(record.position()),
        timestamp: record.timestamp,
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};

    /// A held record rebuilt from its stored headers (`Record::read_headers`) is the record
    /// read from Kafka: the same headers kept, the same ones packed, values absent or empty
    /// as they were; under and over `max_headers`.
    #[test]
    fn headers_read_back_as_from_the_message() {
        let mut h = OwnedHeaders::new()
            .insert(Header {
                key: headers::CE_ID,
                value: Some("x"),
            })
            .insert(Header::<&str> {
                key: headers::CE_SCHEMA_VERSION,
                value: None,
            })
            .insert(Header {
                key: "x-empty",
                value: Some(""),
            });
        for _ in 0..3 {
            h = h.insert(Header::<&str> {
                key: "x-none",
                value: None,
            });
        }
        let m = OwnedMessage::new(
            None,
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            Some(h),
        );
        for max in [16, 4] {
            let read = Record::from_message(&m, max);
            let all: Vec<(String, Option<Vec<u8>>)> = match &read.too_many_headers {
                Some(p) => p
                    .iter()
                    .map(|(n, v)| (n.to_owned(), v.map(<[u8]>::to_vec)))
                    .collect(),
                None => read
                    .headers
                    .iter()
                    .map(|(n, v)| (n.to_owned(), v.map(<[u8]>::to_vec)))
                    .collect(),
            };
            assert_eq!(all.len(), 6);
            let (headers, packed) = Record::read_headers(all, max);
            assert_eq!(packed, read.too_many_headers, "max_headers {max}");
            let pairs = |h: &Headers| {
                h.iter()
                    .map(|(n, v)| (n.to_owned(), v.map(<[u8]>::to_vec)))
                    .collect::<Vec<_>>()
            };
            assert_eq!(pairs(&headers), pairs(&read.headers), "max_headers {max}");
        }
    }

    fn message(timestamp: Timestamp) -> OwnedMessage {
        let id = EventId::new().to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: headers::CE_ID,
                value: Some(id.as_str()),
            })
            .insert(Header {
                key: headers::CE_TYPE,
                value: Some("order.created"),
            });
        OwnedMessage::new(
            Some(b"{}".to_vec()),
            Some(b"k".to_vec()),
            "orders".into(),
            timestamp,
            3,
            42,
            Some(headers),
        )
    }

    /// A record carrying one of Postal's headers twice (here `ce_type`, the second spelled in
    /// other case) is refused as undecodable, naming the header: the consumer never picks one.
    #[test]
    fn a_reserved_header_twice_is_refused() {
        let m = message(Timestamp::NotAvailable);
        let mut record = Record::from_message(&m, 256);
        record.headers.push("CE_TYPE", "invoice.created");
        let (reason, error) = meta(&record).expect_err("refused");
        assert_eq!(reason, Reason::Undecodable);
        assert_eq!(
            error,
            "header ce_type appears 2 times (Postal writes it once)"
        );
        assert!(meta(&Record::from_message(&m, 256)).is_ok());
    }

    /// The handler sees the record's Kafka timestamp (create or log-append time), and none
    /// when the record has none.
    #[test]
    fn the_record_timestamp_reaches_the_event() {
        for ts in [
            Timestamp::CreateTime(1_700_000_000_123),
            Timestamp::LogAppendTime(1_700_000_000_456),
        ] {
            let record = Record::from_message(&message(ts), 256);
            let event: Event<serde_json::Value> =
                decode(&record, &meta(&record).expect("envelope")).expect("decodes");
            assert_eq!(
                event.timestamp.map(|t| t.timestamp_millis()),
                ts.to_millis()
            );
            assert_eq!(
                event.position.map(|p| (p.partition, p.offset)),
                Some((3, 42))
            );
        }
        let record = Record::from_message(&message(Timestamp::NotAvailable), 256);
        let event: Event<serde_json::Value> =
            decode(&record, &meta(&record).expect("envelope")).expect("decodes");
        assert_eq!(event.timestamp, None);
    }
}
