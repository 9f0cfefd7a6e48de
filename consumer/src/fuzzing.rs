//! The record decode path as a function of raw bytes, for the fuzz target in `fuzz/` (feature
//! `fuzzing`; not part of the API). It runs what the runtime runs on every consumed record —
//! reading the headers (a name that is not UTF-8 marks the record undecodable, as the
//! Kafka client's accessor would panic on it), the envelope check, and the payload decode —
//! and checks what the runtime relies on: no panic, and a dead-letter reason that is bounded
//! and free of control characters.

use crate::record::{decode, meta, Record};
use crate::Headers;

/// The default `max_headers`.
const MAX_HEADERS: usize = 256;

/// A record as raw bytes.
#[derive(Debug)]
pub struct RawRecord<'a> {
    /// The record key.
    pub key: Option<&'a [u8]>,
    /// The record value.
    pub payload: Option<&'a [u8]>,
    /// Header names and values, in order, as bytes.
    pub headers: Vec<(&'a [u8], Option<&'a [u8]>)>,
}

/// A payload type with fields of several kinds, so that typed decoding is exercised too.
#[derive(Debug, serde::Deserialize)]
#[allow(dead_code)]
struct Typed {
    n: i64,
    name: String,
    tags: Vec<String>,
    nested: Option<Box<Typed>>,
}

/// Runs the decode path on `raw`. `Ok` when the record would reach a handler of both payload
/// types, else the dead-letter reason and error the runtime would record. Panics when an
/// error breaks the bounds (over [`postal_shared::text::MAX_ERROR_BYTES`] plus the cut-off
/// note, or holding a control character).
pub fn decode_record(raw: &RawRecord<'_>) -> Result<(), (&'static str, String)> {
    let mut unreadable_header = None;
    let mut too_many_headers = (raw.headers.len() > MAX_HEADERS)
        .then(|| crate::packed_headers::PackedHeaders::with_capacity(0));
    let mut pairs = Vec::with_capacity(raw.headers.len());
    for (i, (name, value)) in raw.headers.iter().enumerate() {
        match std::str::from_utf8(name) {
            // Over the limit, all are packed and only Postal's own copied (as
            // `Record::from_message`).
            Ok(n) => {
                if let Some(p) = too_many_headers.as_mut() {
                    p.push(n, *value);
                    if !postal_shared::headers::is_reserved(n) {
                        continue;
                    }
                }
                pairs.push((n.to_owned(), value.map(<[u8]>::to_vec)))
            }
            Err(_) => {
                unreadable_header.get_or_insert(i);
            }
        }
    }
    let headers = Headers::new(pairs);
    let record = Record {
        weight: crate::record::weight(raw.key, raw.payload, &headers),
        too_many_headers,
        topic: "fuzz".into(),
        partition: 0,
        offset: 0,
        key: raw.key.map(<[u8]>::to_vec),
        payload: raw.payload.map(<[u8]>::to_vec),
        headers,
        timestamp: None,
        unreadable_header,
    };
    let outcome = meta(&record)
        .map_err(|(reason, e)| (reason.as_str(), e))
        .and_then(|m| {
            decode::<serde_json::Value>(&record, &m)
                .and_then(|_| decode::<Typed>(&record, &m))
                .map(|_| ())
                .map_err(|e| (crate::dead_letter::Reason::Undecodable.as_str(), e))
        });
    if let Err((_, e)) = &outcome {
        assert!(
            e.len() <= postal_shared::text::MAX_ERROR_BYTES + 40,
            "a dead-letter error of {} bytes",
            e.len()
        );
        assert!(
            !e.chars().any(postal_shared::text::unsafe_char),
            "a dead-letter error with a control character: {e:?}"
        );
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guarantee: the hostile records of issue 31 decode to bounded, escaped refusals, and a
    /// well-formed record decodes.
    #[test]
    fn hostile_records_are_refused_with_bounded_reasons() {
        let id = postal_shared::EventId::new().to_string();
        let good = RawRecord {
            key: Some(b"k"),
            payload: Some(br#"{"n": 1, "name": "a", "tags": []}"#),
            headers: vec![(b"ce_id", Some(id.as_bytes())), (b"ce_type", Some(b"t"))],
        };
        assert_eq!(decode_record(&good), Ok(()));
        let huge = format!("\u{1b}]0;x{}", "a".repeat(600_000));
        let long_string = format!(r#"{{"n": "{}"}}"#, "b".repeat(600_000));
        let cases: Vec<RawRecord<'_>> = vec![
            RawRecord {
                key: None,
                payload: None,
                headers: vec![(&[0xff, 0xfe], Some(b"v"))],
            },
            RawRecord {
                key: None,
                payload: None,
                headers: vec![(b"ce_id", Some(huge.as_bytes()))],
            },
            RawRecord {
                key: None,
                payload: Some(long_string.as_bytes()),
                headers: vec![(b"ce_id", Some(id.as_bytes())), (b"ce_type", Some(b"t"))],
            },
            RawRecord {
                key: None,
                payload: Some(b"{}"),
                headers: vec![
                    (b"ce_id", Some(id.as_bytes())),
                    (b"ce_type", Some(b"t")),
                    (b"content-type", Some(huge.as_bytes())),
                ],
            },
            RawRecord {
                key: None,
                payload: Some(b"{}"),
                headers: vec![
                    (b"ce_id", Some(id.as_bytes())),
                    (b"ce_type", Some(b"a")),
                    (b"CE_TYPE", Some(b"b")),
                ],
            },
        ];
        for case in &cases {
            assert!(decode_record(case).is_err(), "{:.200?}", case.headers);
        }
    }

    /// A small xorshift generator: the test needs no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn bytes(&mut self, pieces: &[&[u8]], max: usize) -> Vec<u8> {
            let mut out = Vec::new();
            for _ in 0..self.below(max + 1) {
                if self.below(3) == 0 {
                    out.push(self.next() as u8);
                } else {
                    out.extend_from_slice(pieces[self.below(pieces.len())]);
                }
            }
            out
        }
    }

    /// Guarantee: random records (header names biased to Postal's own, values, keys and
    /// payloads built from envelope and JSON fragments and random bytes) never panic the
    /// decode path, and every refusal's reason is bounded and free of control characters.
    /// What `bash scripts/fuzz.sh` checks with libFuzzer's coverage-guided search, here without
    /// its separate build, in every test run (`POSTAL_DECODE_SEED` replays a run, whose seed a
    /// failure prints).
    #[test]
    fn random_records_decode_with_bounded_reasons() {
        let seed = std::env::var("POSTAL_DECODE_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
                    | 1
            });
        eprintln!("random_records_decode_with_bounded_reasons: POSTAL_DECODE_SEED={seed}");
        let mut rng = Rng(seed);
        let id = postal_shared::EventId::new().to_string();
        let names: &[&[u8]] = &[
            b"ce_id",
            b"ce_type",
            b"ce_schemaversion",
            b"ce_time",
            b"content-type",
            b"CE_TYPE",
            b"traceparent",
            b"ce_subject",
            &[0xff, 0x00],
        ];
        let values: &[&[u8]] = &[
            id.as_bytes(),
            b"t",
            b"1",
            b"-1",
            b"99999999999999999999",
            b"2026-11-30T18:00:00Z",
            b"application/json",
            b"\x1b[31m",
            b"\r\n",
            &[0xc3, 0x28],
        ];
        let json: &[&[u8]] = &[
            b"{",
            b"}",
            b"[",
            b"]",
            b"\"n\": 1",
            b"\"name\": \"a\"",
            b"\"tags\": [\"x\"]",
            b"\"nested\": ",
            b",",
            b"null",
            b"1e999",
            b"\"\\u0000\"",
            b"\"\\ud800\"",
        ];
        for _ in 0..20_000 {
            let mut headers: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
            for _ in 0..rng.below(8) {
                let name = if rng.below(4) == 0 {
                    rng.bytes(names, 2)
                } else {
                    names[rng.below(names.len())].to_vec()
                };
                let value = (rng.below(8) != 0).then(|| rng.bytes(values, 3));
                headers.push((name, value));
            }
            if rng.below(2) == 0 {
                headers.push((b"ce_id".to_vec(), Some(id.as_bytes().to_vec())));
                headers.push((b"ce_type".to_vec(), Some(b"t".to_vec())));
            }
            let key = (rng.below(4) != 0).then(|| rng.bytes(values, 2));
            let payload = (rng.below(8) != 0).then(|| rng.bytes(json, 24));
            let raw = RawRecord {
                key: key.as_deref(),
                payload: payload.as_deref(),
                headers: headers
                    .iter()
                    .map(|(n, v)| (n.as_slice(), v.as_deref()))
                    .collect(),
            };
            // decode_record panics on an unbounded or unescaped reason.
            let _ = decode_record(&raw);
        }
    }
}
