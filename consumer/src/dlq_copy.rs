//! The copy of a dead letter on its `.dlq` topic: the original record (key, value, headers)
//! with Postal's `postal_dlq_*` headers, cut to fit when it does not. A record the consumer
//! could read may not fit the dead-letter producer once Postal's headers are added (a record
//! just under the broker's limit; the producer's `message.max.bytes`, 1,000,000 bytes by
//! default, is below the broker's 1,048,588), and a topic may take less than the producer.
//! Then the value goes first, then the original headers, then the key, and the header
//! `postal_dlq_cut` names what went (`value`, `value,headers` or `value,headers,key`). The
//! dead letter in `postal.dead_letters` always stays whole (`postal dead-letters replay`).
//!
//! The broker checks a whole record batch against a topic's `max.message.bytes`, and
//! librdkafka packs the copies sent together into one batch: a refusal for size of a copy sent
//! with others says nothing of the copy alone. So a refused copy is sent again alone, as it
//! was, and then cut further ([`Cut::and_further`]) while the broker refuses it alone.

use postal_shared::headers;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;

use crate::dead_letter::Row;

/// What of the original record a copy leaves out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    /// The whole record.
    Nothing,
    /// Without the value.
    Value,
    /// Without the value and the original headers.
    ValueAndHeaders,
    /// Without the value, the original headers and the key: Postal's headers only.
    All,
}

impl Cut {
    /// The value of the `postal_dlq_cut` header.
    pub(crate) fn marker(self) -> Option<&'static str> {
        match self {
            Cut::Nothing => None,
            Cut::Value => Some("value"),
            Cut::ValueAndHeaders => Some("value,headers"),
            Cut::All => Some("value,headers,key"),
        }
    }

    /// This cut and the further ones, least first.
    pub(crate) fn and_further(self) -> impl Iterator<Item = Cut> {
        [Cut::Nothing, Cut::Value, Cut::ValueAndHeaders, Cut::All]
            .into_iter()
            .skip_while(move |c| *c != self)
    }

    /// The least cut whose copy of `r` fits in `limit` bytes (`All` when none does).
    pub(crate) fn to_fit(r: &Row, consumer: &str, limit: usize) -> Cut {
        [Cut::Nothing, Cut::Value, Cut::ValueAndHeaders]
            .into_iter()
            .find(|cut| bytes(r, consumer, *cut) <= limit)
            .unwrap_or(Cut::All)
    }
}

/// The producer's record limit: its `message.max.bytes` (librdkafka's default 1,000,000).
pub(crate) fn limit(config: &rdkafka::ClientConfig) -> usize {
    config
        .get("message.max.bytes")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

/// Whether a send failed because of the record itself (its size or form), so that sending it
/// again as it is can never succeed (or, sent with others, that its record batch was too large).
pub(crate) fn refused_for_itself(e: &KafkaError) -> bool {
    postal_shared::kafka_producer::refused_for_itself(e)
}

/// Postal's headers of the copy of `r`.
fn postal_headers(r: &Row, consumer: &str, cut: Cut) -> Vec<(&'static str, String)> {
    let mut h = vec![
        (headers::DLQ_REASON, r.reason.clone()),
        (headers::DLQ_ERROR, r.error.clone()),
        (headers::DLQ_TOPIC, r.topic.clone()),
        (headers::DLQ_PARTITION, r.partition.to_string()),
        (headers::DLQ_OFFSET, r.kafka_offset.to_string()),
        (headers::DLQ_CONSUMER, consumer.to_owned()),
        (headers::DLQ_ATTEMPTS, r.attempts.to_string()),
        (headers::DLQ_ID, r.id.to_string()),
    ];
    if let Some(marker) = cut.marker() {
        h.push((headers::DLQ_CUT, marker.to_owned()));
    }
    h
}

/// About how many bytes the copy takes, as the relay counts a record (`record_size`): key,
/// value and headers, 8 bytes per header and 512 for the record's framing.
fn bytes(r: &Row, consumer: &str, cut: Cut) -> usize {
    let original_headers = if matches!(cut, Cut::Nothing | Cut::Value) {
        r.header_names
            .iter()
            .zip(&r.header_values)
            .map(|(n, v)| n.len() + v.len() + 8)
            .sum()
    } else {
        0
    };
    let value = if cut == Cut::Nothing {
        r.payload.as_ref().map_or(0, Vec::len)
    } else {
        0
    };
    let key = if cut == Cut::All {
        0
    } else {
        r.record_key.as_ref().map_or(0, Vec::len)
    };
    let postal: usize = postal_headers(r, consumer, cut)
        .iter()
        .map(|(n, v)| n.len() + v.len() + 8)
        .sum();
    key + value + original_headers + postal + 512
}

/// The copy of `r` for its `.dlq` topic, with `cut` left out.
pub(crate) fn record<'a>(r: &'a Row, consumer: &str, cut: Cut) -> FutureRecord<'a, [u8], [u8]> {
    let mut h = OwnedHeaders::new_with_capacity(r.header_names.len() + 9);
    if matches!(cut, Cut::Nothing | Cut::Value) {
        for (i, (n, v)) in r.header_names.iter().zip(&r.header_values).enumerate() {
            h = h.insert(Header {
                key: n,
                value: postal_shared::headers::kept_value(v, &r.header_absent, i),
            });
        }
    }
    for (k, v) in postal_headers(r, consumer, cut) {
        h = h.insert(Header {
            key: k,
            value: Some(&v),
        });
    }
    let mut rec: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&r.dlq_topic).headers(h);
    if cut != Cut::All {
        if let Some(k) = &r.record_key {
            rec = rec.key(k.as_slice());
        }
    }
    if cut == Cut::Nothing {
        if let Some(p) = &r.payload {
            rec = rec.payload(p.as_slice());
        }
    }
    rec
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(value: usize, header: usize, key: usize) -> Row {
        Row {
            id: 7,
            topic: "orders".into(),
            partition: 0,
            kafka_offset: 3,
            record_key: Some(vec![b'k'; key]),
            payload: Some(vec![b'v'; value]),
            header_names: vec!["x-h".into()],
            header_values: vec![vec![b'h'; header]],
            header_absent: Vec::new(),
            reason: "missing_event_id".into(),
            error: "no ce_id".into(),
            attempts: 1,
            dlq_topic: "orders.dlq".into(),
            marked: false,
            locked: 1,
        }
    }

    /// Guarantee: a copy that fits is sent whole; one that does not loses its value first,
    /// then its original headers, then its key, the least that makes it fit, and the cut is
    /// named.
    #[test]
    fn the_least_cut_that_fits() {
        let limit = 1_000_000;
        assert_eq!(Cut::to_fit(&row(10_000, 10, 10), "c", limit), Cut::Nothing);
        assert_eq!(Cut::to_fit(&row(1_040_000, 10, 10), "c", limit), Cut::Value);
        assert_eq!(
            Cut::to_fit(&row(10, 1_040_000, 10), "c", limit),
            Cut::ValueAndHeaders
        );
        assert_eq!(Cut::to_fit(&row(10, 10, 1_040_000), "c", limit), Cut::All);
        assert_eq!(Cut::Value.marker(), Some("value"));
        assert_eq!(Cut::Nothing.marker(), None);
        let copy = bytes(&row(1_040_000, 10, 10), "c", Cut::Value);
        assert!(copy < 2_000, "{copy}");
    }

    /// Guarantee: a copy the broker refuses for its size is tried again cut further, one step
    /// at a time, down to Postal's headers only, never less cut than before.
    #[test]
    fn further_cuts_go_down_to_postals_headers_only() {
        let all = |c: Cut| c.and_further().collect::<Vec<_>>();
        assert_eq!(
            all(Cut::Nothing),
            [Cut::Nothing, Cut::Value, Cut::ValueAndHeaders, Cut::All]
        );
        assert_eq!(all(Cut::ValueAndHeaders), [Cut::ValueAndHeaders, Cut::All]);
        assert_eq!(all(Cut::All), [Cut::All]);
    }
}
