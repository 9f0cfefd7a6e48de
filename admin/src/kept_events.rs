//! A discard's kept events (`postal.operator_audit_events`), read in bounded pieces: an event
//! can be as large as the outbox took (hundreds of MiB), and `postal audit show` prints each
//! whole without holding it — its fields first, then its payload piece by piece.

use sqlx::PgPool;

use crate::parked::Discarded;
use crate::Error;

/// One kept event without its payload (`payload` and `payload_base64` both `None`), and the
/// payload's size in bytes; `None` when the discard `audit_id` kept no event `seq`.
pub async fn head(
    pool: &PgPool,
    audit_id: i64,
    seq: i64,
) -> Result<Option<(Discarded, i64)>, Error> {
    let row = sqlx::query(
        "SELECT event_id, topic, event_key, event_type, schema_version,
                least(greatest(occurred_at, '0001-01-01 00:00:00+00'), '262000-01-01') AS occurred_at,
                content_type, headers, attempts, last_error, NULL::text AS payload_base64,
                octet_length(payload)::int8 AS payload_bytes
         FROM postal.operator_audit_events WHERE audit_id = $1 AND seq = $2",
    )
    .bind(audit_id)
    .bind(seq)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    use sqlx::{FromRow as _, Row as _};
    Ok(Some((
        Discarded::from_row(&row)?,
        row.try_get("payload_bytes")?,
    )))
}

/// Bytes `from..from + len` (from 0) of the payload of the kept event `seq` of the discard
/// `audit_id`; fewer at its end, none past it.
pub async fn piece(
    pool: &PgPool,
    audit_id: i64,
    seq: i64,
    from: i64,
    len: i32,
) -> Result<Vec<u8>, Error> {
    Ok(sqlx::query_scalar(
        "SELECT substring(payload FROM ($3 + 1)::int4 FOR $4) FROM postal.operator_audit_events
         WHERE audit_id = $1 AND seq = $2",
    )
    .bind(audit_id)
    .bind(seq)
    .bind(from)
    .bind(len)
    .fetch_optional(pool)
    .await?
    .unwrap_or_default())
}

/// Whether the payload of the kept event `seq` of the discard `audit_id` is UTF-8 without NUL
/// (printed as text; else in base64): the database checks it (`convert_from` refuses
/// anything else), so that no client reads it for that.
pub async fn payload_is_text(pool: &PgPool, audit_id: i64, seq: i64) -> Result<bool, Error> {
    let checked = sqlx::query(
        "SELECT octet_length(convert_from(payload, 'UTF8')) FROM postal.operator_audit_events
         WHERE audit_id = $1 AND seq = $2",
    )
    .bind(audit_id)
    .bind(seq)
    .execute(pool)
    .await;
    match checked {
        Ok(_) => Ok(true),
        // character_not_in_repertoire (a NUL) or untranslatable_character.
        Err(sqlx::Error::Database(e))
            if matches!(e.code().as_deref(), Some("22021") | Some("22P05")) =>
        {
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// [`piece`] in base64 (padded, without line breaks), encoded by the database. Pieces whose
/// `from` and `len` are multiples of 3 join into the base64 of the whole payload.
pub async fn piece_base64(
    pool: &PgPool,
    audit_id: i64,
    seq: i64,
    from: i64,
    len: i32,
) -> Result<String, Error> {
    Ok(sqlx::query_scalar(
        "SELECT translate(encode(substring(payload FROM ($3 + 1)::int4 FOR $4), 'base64'), chr(10), '')
         FROM postal.operator_audit_events WHERE audit_id = $1 AND seq = $2",
    )
    .bind(audit_id)
    .bind(seq)
    .bind(from)
    .bind(len)
    .fetch_optional(pool)
    .await?
    .unwrap_or_default())
}
