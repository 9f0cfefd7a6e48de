//! Fuzzes the consumer's record decode path: header names and values, key and payload as
//! arbitrary bytes, with a bias towards Postal's own header names so that the envelope checks
//! past the first one are reached. Fails on a panic, or on a dead-letter reason that is
//! unbounded or holds a control character (see `postal_consumer::fuzzing`).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use postal_consumer::fuzzing::{decode_record, RawRecord};

const NAMES: &[&[u8]] = &[
    b"ce_id",
    b"ce_type",
    b"ce_schemaversion",
    b"ce_time",
    b"content-type",
    b"CE_TYPE",
    b"traceparent",
];

#[derive(Arbitrary, Debug)]
struct Header<'a> {
    /// A known name by index, or the raw bytes.
    known: Option<u8>,
    name: &'a [u8],
    value: Option<&'a [u8]>,
}

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    key: Option<&'a [u8]>,
    payload: Option<&'a [u8]>,
    /// A valid event id for `ce_id` instead of the fuzzed value.
    valid_id: bool,
    headers: Vec<Header<'a>>,
}

fuzz_target!(|input: Input<'_>| {
    let id = uuid_v7_like(input.key.unwrap_or_default());
    let headers = input
        .headers
        .iter()
        .map(|h| {
            let name = match h.known {
                Some(i) => NAMES[usize::from(i) % NAMES.len()],
                None => h.name,
            };
            let value = if input.valid_id && name == b"ce_id" {
                Some(id.as_bytes())
            } else {
                h.value
            };
            (name, value)
        })
        .collect();
    let _ = decode_record(&RawRecord {
        key: input.key,
        payload: input.payload,
        headers,
    });
});

/// A well-formed, non-nil UUID (version 7 layout) derived from some bytes.
fn uuid_v7_like(seed: &[u8]) -> String {
    let mut b = [1u8; 16];
    for (i, x) in seed.iter().take(16).enumerate() {
        b[i] ^= x;
    }
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}
