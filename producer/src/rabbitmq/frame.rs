//! The size of a message's content-header frame. AMQP cannot split it across frames: one
//! larger than the connection's negotiated `frame_max` makes RabbitMQ close the whole
//! connection (`FRAME_ERROR`), cutting every batch in flight on it. The transport measures
//! each message's frame before sending and refuses, as that message's own permanent failure,
//! one that does not fit.

use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

/// A content-header frame's bytes around its properties: the frame header (type, channel,
/// size: 7), class id and weight (4), body size (8), property flags (2) and the frame end (1).
const OVERHEAD: usize = 22;

/// The bytes of the content-header frame that carries `p`.
pub(super) fn content_header_bytes(p: &BasicProperties) -> usize {
    let short =
        |s: &Option<lapin::types::ShortString>| s.as_ref().map_or(0, |s| 1 + s.as_str().len());
    OVERHEAD
        + short(p.content_type())
        + short(p.content_encoding())
        + p.headers().as_ref().map_or(0, table_bytes)
        + p.delivery_mode().map_or(0, |_| 1)
        + p.priority().map_or(0, |_| 1)
        + short(p.correlation_id())
        + short(p.reply_to())
        + short(p.expiration())
        + short(p.message_id())
        + p.timestamp().map_or(0, |_| 8)
        + short(p.kind())
        + short(p.user_id())
        + short(p.app_id())
        + short(p.cluster_id())
}

/// A field table: its 4-byte length, then per entry the name (a short string), a type octet
/// and the value.
fn table_bytes(t: &FieldTable) -> usize {
    4 + t
        .inner()
        .iter()
        .map(|(name, value)| 1 + name.as_str().len() + 1 + value_bytes(value))
        .sum::<usize>()
}

/// A field value's bytes after its type octet. The transport writes long strings only; the
/// other kinds are sized for completeness.
fn value_bytes(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::FieldTable(t) => table_bytes(t),
        AMQPValue::FieldArray(a) => {
            4 + a
                .as_slice()
                .iter()
                .map(|v| 1 + value_bytes(v))
                .sum::<usize>()
        }
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::Void => 0,
        _ => 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::LongString;

    /// Guarantee: the measured size is the size lapin writes (its own encoder, through
    /// cookie-factory), for properties like the transport's with headers of several sizes.
    #[test]
    fn the_measure_is_what_lapin_writes() {
        for value_len in [0usize, 10, 300, 70_000] {
            let mut headers = FieldTable::default();
            headers.insert(
                "ce_id".into(),
                AMQPValue::LongString(LongString::from("abc")),
            );
            headers.insert(
                "x-big".into(),
                AMQPValue::LongString(LongString::from("v".repeat(value_len))),
            );
            let p = BasicProperties::default()
                .with_message_id("m-1".into())
                .with_type("order.created".into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_timestamp(1_700_000_000)
                .with_app_id("postal".into())
                .with_headers(headers);
            let (properties, _) =
                cookie_factory::gen(lapin::protocol::basic::gen_properties(&p), Vec::new())
                    .expect("encoded");
            // The properties (flags included) plus the frame's other 20 bytes.
            assert_eq!(
                content_header_bytes(&p),
                properties.len() + 20,
                "{value_len}"
            );
        }
    }
}
