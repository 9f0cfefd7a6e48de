//! The headers of a record that carries more than `max_headers`, packed in one buffer: each
//! header as its name's length, its name, its value's length (plus one; 0 for none) and its
//! value, lengths as LEB128 varints, as Kafka's record format writes them. The buffer is
//! about as large as the headers were on the wire (at most one byte more per header): the
//! record was accepted by the broker, so this is bounded by what the broker took, while an
//! unpacked copy costs about 48 bytes more per header (two allocations each). They are
//! unpacked only to write the dead-letter row, which keeps them whole.

/// A record's headers, whole and in order, packed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PackedHeaders {
    count: usize,
    bytes: Vec<u8>,
}

fn put_len(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn take_len(bytes: &[u8], at: &mut usize) -> usize {
    let mut n = 0usize;
    let mut shift = 0;
    loop {
        let byte = bytes[*at];
        *at += 1;
        n |= usize::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return n;
        }
        shift += 7;
    }
}

impl PackedHeaders {
    /// Empty, with room for `bytes` bytes (a header takes at least 2).
    pub(crate) fn with_capacity(bytes: usize) -> Self {
        Self {
            count: 0,
            bytes: Vec::with_capacity(bytes),
        }
    }

    /// Appends one header.
    pub(crate) fn push(&mut self, name: &str, value: Option<&[u8]>) {
        put_len(&mut self.bytes, name.len());
        self.bytes.extend_from_slice(name.as_bytes());
        match value {
            None => put_len(&mut self.bytes, 0),
            Some(v) => {
                put_len(&mut self.bytes, v.len() + 1);
                self.bytes.extend_from_slice(v);
            }
        }
        self.count += 1;
    }

    /// Without room it does not use.
    pub(crate) fn shrunk(mut self) -> Self {
        self.bytes.shrink_to_fit();
        self
    }

    /// How many headers.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// The bytes held.
    pub(crate) fn len(&self) -> usize {
        self.bytes.capacity()
    }

    /// The headers in order: name, value (`None`: the header had no value).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, Option<&[u8]>)> {
        let bytes = &self.bytes;
        let mut at = 0;
        std::iter::from_fn(move || {
            if at >= bytes.len() {
                return None;
            }
            let n = take_len(bytes, &mut at);
            // Written from a `&str` by `push`.
            let name = std::str::from_utf8(&bytes[at..at + n]).expect("packed from a str");
            at += n;
            let v = take_len(bytes, &mut at);
            let value = (v > 0).then(|| {
                let value = &bytes[at..at + v - 1];
                at += v - 1;
                value
            });
            Some((name, value))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Headers come back whole and in order: empty and missing values, long ones (multi-byte
    /// lengths), non-ASCII names; and the buffer is about the size of the headers.
    #[test]
    fn headers_come_back_whole_and_in_order() {
        let long = vec![7u8; 300];
        let given: Vec<(String, Option<Vec<u8>>)> = vec![
            ("ce_id".into(), Some(b"x".to_vec())),
            ("".into(), None),
            ("é".into(), Some(Vec::new())),
            ("long".into(), Some(long.clone())),
        ];
        let mut p = PackedHeaders::with_capacity(0);
        for (n, v) in &given {
            p.push(n, v.as_deref());
        }
        let back: Vec<(String, Option<Vec<u8>>)> = p
            .iter()
            .map(|(n, v)| (n.to_owned(), v.map(<[u8]>::to_vec)))
            .collect();
        assert_eq!(back, given);
        assert_eq!(p.count(), 4);
        assert_eq!(
            p.bytes.len(),
            (1 + 5 + 1 + 1) + (1 + 1) + (1 + 2 + 1) + (1 + 4 + 2 + 300)
        );
    }
}
