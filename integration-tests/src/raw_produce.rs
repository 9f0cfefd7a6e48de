//! Writing a record to Kafka byte by byte, for hostile-input tests: the Kafka client library
//! only produces header names that are valid UTF-8, but the wire format (and any other client)
//! allows any bytes. One ProduceRequest (v3) with one RecordBatch (v2) of one record, sent to
//! the bootstrap broker (the tests' brokers lead every partition themselves).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Writes one record with exactly these header names and values to `topic`/`partition`;
/// returns the broker's error code (0 = stored).
pub fn produce_raw(
    bootstrap: &str,
    topic: &str,
    partition: i32,
    key: &[u8],
    value: &[u8],
    headers: &[(&[u8], &[u8])],
) -> std::io::Result<i16> {
    let batch = record_batch(key, value, headers);
    let mut body = Vec::new();
    body.extend_from_slice(&0i16.to_be_bytes()); // api key: Produce
    body.extend_from_slice(&3i16.to_be_bytes()); // api version
    body.extend_from_slice(&1i32.to_be_bytes()); // correlation id
    string(&mut body, b"postal-raw-produce"); // client id
    body.extend_from_slice(&(-1i16).to_be_bytes()); // transactional id: null
    body.extend_from_slice(&(-1i16).to_be_bytes()); // acks: all
    body.extend_from_slice(&10_000i32.to_be_bytes()); // timeout
    body.extend_from_slice(&1i32.to_be_bytes()); // one topic
    string(&mut body, topic.as_bytes());
    body.extend_from_slice(&1i32.to_be_bytes()); // one partition
    body.extend_from_slice(&partition.to_be_bytes());
    body.extend_from_slice(&(batch.len() as i32).to_be_bytes());
    body.extend_from_slice(&batch);

    let addr = bootstrap.split(',').next().unwrap_or(bootstrap);
    let mut conn = TcpStream::connect(addr)?;
    conn.set_read_timeout(Some(Duration::from_secs(15)))?;
    conn.write_all(&(body.len() as i32).to_be_bytes())?;
    conn.write_all(&body)?;
    let mut size = [0u8; 4];
    conn.read_exact(&mut size)?;
    let mut response = vec![0u8; i32::from_be_bytes(size) as usize];
    conn.read_exact(&mut response)?;
    // correlation id (4), topics (4), topic name (2 + n), partitions (4), index (4), error (2)
    let name_len = i16::from_be_bytes([response[8], response[9]]) as usize;
    let at = 10 + name_len + 4 + 4;
    Ok(i16::from_be_bytes([response[at], response[at + 1]]))
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as i16).to_be_bytes());
    out.extend_from_slice(s);
}

/// A zigzag varint, as record fields are encoded.
fn varint(out: &mut Vec<u8>, v: i64) {
    let mut z = ((v << 1) ^ (v >> 63)) as u64;
    loop {
        let byte = (z & 0x7f) as u8;
        z >>= 7;
        if z == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    varint(out, b.len() as i64);
    out.extend_from_slice(b);
}

fn record_batch(key: &[u8], value: &[u8], headers: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut record = Vec::new();
    record.push(0); // attributes
    varint(&mut record, 0); // timestamp delta
    varint(&mut record, 0); // offset delta
    bytes(&mut record, key);
    bytes(&mut record, value);
    varint(&mut record, headers.len() as i64);
    for (name, value) in headers {
        bytes(&mut record, name);
        bytes(&mut record, value);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    // From the attributes on: what the CRC covers.
    let mut tail = Vec::new();
    tail.extend_from_slice(&0i16.to_be_bytes()); // attributes
    tail.extend_from_slice(&0i32.to_be_bytes()); // last offset delta
    tail.extend_from_slice(&now.to_be_bytes()); // first timestamp
    tail.extend_from_slice(&now.to_be_bytes()); // max timestamp
    tail.extend_from_slice(&(-1i64).to_be_bytes()); // producer id
    tail.extend_from_slice(&(-1i16).to_be_bytes()); // producer epoch
    tail.extend_from_slice(&(-1i32).to_be_bytes()); // base sequence
    tail.extend_from_slice(&1i32.to_be_bytes()); // one record
    varint(&mut tail, record.len() as i64);
    tail.extend_from_slice(&record);
    let mut batch = Vec::new();
    batch.extend_from_slice(&0i64.to_be_bytes()); // base offset
    let length = 4 + 1 + 4 + tail.len(); // leader epoch, magic, crc, rest
    batch.extend_from_slice(&(length as i32).to_be_bytes());
    batch.extend_from_slice(&(-1i32).to_be_bytes()); // partition leader epoch
    batch.push(2); // magic
    batch.extend_from_slice(&crc32c(&tail).to_be_bytes());
    batch.extend_from_slice(&tail);
    batch
}

/// CRC-32C (Castagnoli), as RecordBatch v2 uses.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum matches CRC-32C's published check value, and varints are zigzag-encoded.
    #[test]
    fn crc32c_and_varints_follow_the_kafka_format() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let mut v = Vec::new();
        varint(&mut v, -1);
        varint(&mut v, 1);
        varint(&mut v, 300);
        assert_eq!(v, vec![0x01, 0x02, 0xd8, 0x04]);
    }
}
