//! The little of pgoutput the WAL relay decodes: `Relation` messages (to find the outbox and
//! its `seq` column) and `Insert` messages (to read `seq`, in text format).
//!
//! Only `seq` is read from the WAL: the row itself is read from the outbox when its batch is
//! locked ([`super::rows`]), which is also where the relay learns whether the row is still to
//! publish. So nothing here depends on how PostgreSQL prints payloads, times or JSON.

use std::collections::HashMap;

/// A pgoutput message the relay acts on.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// An insert into `postal.outbox`, with the row's `seq`.
    Outbox(i64),
    /// Anything else (another table, a relation or type message, an update, …).
    Other,
}

/// Where `seq` sits in the outbox's tuples, by relation id (from `Relation` messages, which
/// pgoutput sends before the first change of a relation in each session and after DDL).
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    outbox: HashMap<u32, usize>,
}

impl Decoder {
    /// Decodes one pgoutput message (the `XLogData` payload). An error means the stream
    /// cannot be trusted (a truncated message, an outbox insert without `seq`).
    pub(crate) fn decode(&mut self, data: &[u8]) -> Result<Change, String> {
        let mut r = Reader(data);
        match r.u8()? {
            b'R' => {
                let id = r.u32()?;
                let namespace = r.cstr()?;
                let name = r.cstr()?;
                let _replica_identity = r.u8()?;
                let columns = r.u16()?;
                let mut seq = None;
                for i in 0..usize::from(columns) {
                    let _flags = r.u8()?;
                    let column = r.cstr()?;
                    let _type_oid = r.u32()?;
                    let _type_modifier = r.u32()?;
                    if column == "seq" {
                        seq = Some(i);
                    }
                }
                if namespace == "postal" && name == "outbox" {
                    let seq = seq.ok_or("the outbox relation has no column seq")?;
                    self.outbox.insert(id, seq);
                } else {
                    self.outbox.remove(&id);
                }
                Ok(Change::Other)
            }
            b'I' => {
                let id = r.u32()?;
                let Some(&seq_at) = self.outbox.get(&id) else {
                    return Ok(Change::Other);
                };
                if r.u8()? != b'N' {
                    return Err("an insert without a new tuple".into());
                }
                let columns = usize::from(r.u16()?);
                for i in 0..columns {
                    match r.u8()? {
                        b'n' | b'u' => {
                            if i == seq_at {
                                return Err("an outbox insert whose seq is null".into());
                            }
                        }
                        kind @ (b't' | b'b') => {
                            let len = r.u32()? as usize;
                            let value = r.take(len)?;
                            if i == seq_at {
                                return parse_seq(kind, value).map(Change::Outbox);
                            }
                        }
                        other => return Err(format!("unknown tuple column kind {other}")),
                    }
                }
                Err("an outbox insert without its seq column".into())
            }
            _ => Ok(Change::Other),
        }
    }
}

fn parse_seq(kind: u8, value: &[u8]) -> Result<i64, String> {
    if kind == b'b' {
        let bytes: [u8; 8] = value
            .try_into()
            .map_err(|_| "a binary seq of the wrong size")?;
        return Ok(i64::from_be_bytes(bytes));
    }
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "an outbox seq that is not a number".to_owned())
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("a truncated pgoutput message".into());
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn cstr(&mut self) -> Result<&'a str, String> {
        let end = self
            .0
            .iter()
            .position(|&b| b == 0)
            .ok_or("a string without its terminator")?;
        let s = std::str::from_utf8(&self.0[..end]).map_err(|_| "a string that is not UTF-8")?;
        self.0 = &self.0[end + 1..];
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation(id: u32, namespace: &str, name: &str, columns: &[&str]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(id.to_be_bytes());
        for s in [namespace, name] {
            m.extend(s.as_bytes());
            m.push(0);
        }
        m.push(b'd');
        m.extend((columns.len() as u16).to_be_bytes());
        for c in columns {
            m.push(0);
            m.extend(c.as_bytes());
            m.push(0);
            m.extend(20u32.to_be_bytes());
            m.extend((-1i32).to_be_bytes());
        }
        m
    }

    fn insert(id: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend(id.to_be_bytes());
        m.push(b'N');
        m.extend((values.len() as u16).to_be_bytes());
        for v in values {
            match v {
                None => m.push(b'n'),
                Some(v) => {
                    m.push(b't');
                    m.extend((v.len() as u32).to_be_bytes());
                    m.extend(v.as_bytes());
                }
            }
        }
        m
    }

    /// Guarantee: an insert into `postal.outbox` yields its `seq`, wherever the column sits;
    /// inserts into other relations (even one named `outbox` in another schema) yield nothing,
    /// and a relation id reused for another table stops counting as the outbox.
    #[test]
    fn only_outbox_inserts_yield_their_seq() {
        let mut d = Decoder::default();
        assert_eq!(
            d.decode(&relation(7, "postal", "outbox", &["x", "seq"])),
            Ok(Change::Other)
        );
        assert_eq!(
            d.decode(&relation(8, "public", "outbox", &["seq"])),
            Ok(Change::Other)
        );
        assert_eq!(
            d.decode(&insert(7, &[None, Some("42")])),
            Ok(Change::Outbox(42))
        );
        assert_eq!(d.decode(&insert(8, &[Some("43")])), Ok(Change::Other));
        assert_eq!(
            d.decode(&relation(7, "public", "other", &["seq"])),
            Ok(Change::Other)
        );
        assert_eq!(d.decode(&insert(7, &[Some("44")])), Ok(Change::Other));
    }

    /// Guarantee: a message the relay cannot read is an error, never a skipped event.
    #[test]
    fn an_unreadable_outbox_insert_is_an_error() {
        let mut d = Decoder::default();
        d.decode(&relation(7, "postal", "outbox", &["seq"]))
            .unwrap();
        assert!(d.decode(&insert(7, &[None])).is_err());
        assert!(d.decode(&insert(7, &[Some("x")])).is_err());
        let mut cut = insert(7, &[Some("42")]);
        cut.truncate(cut.len() - 1);
        assert!(d.decode(&cut).is_err());
    }
}
