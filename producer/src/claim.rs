//! Claiming committed outbox rows for publishing.

use std::time::Duration;

use chrono::{DateTime, Utc};
use postal_shared::EventId;
use sqlx::PgPool;
use uuid::Uuid;

use crate::transport::OutboundEvent;

/// Number of key partitions (`key_partition` = `hashtext(key) & 255`).
pub const KEY_PARTITIONS: i16 = 256;

/// Every key partition: what a relay claims from when it is the only one.
pub fn all_partitions() -> Vec<i16> {
    (0..KEY_PARTITIONS).collect()
}

#[derive(sqlx::FromRow)]
struct Row {
    seq: i64,
    event_id: Uuid,
    topic: String,
    event_key: String,
    event_type: String,
    schema_version: i32,
    occurred_at: DateTime<Utc>,
    content_type: String,
    payload: Vec<u8>,
    headers: sqlx::types::Json<std::collections::BTreeMap<String, String>>,
    attempts: i32,
}

/// Claims up to `limit` publishable rows of the given key partitions, in sequence order, and
/// leases them to `relay` for `lease`.
///
/// A row is publishable when it is pending, due (`available_at` passed), not leased to a live
/// claim, and no earlier row of its key holds it back (parked, waiting for a retry, or
/// scheduled for later). `FOR UPDATE SKIP LOCKED` keeps concurrent claimers from taking the
/// same rows; the lease recovers rows of a relay that died.
pub async fn claim(
    pool: &PgPool,
    relay: Uuid,
    partitions: &[i16],
    limit: usize,
    lease: Duration,
) -> Result<Vec<OutboundEvent>, sqlx::Error> {
    let rows: Vec<Row> = sqlx::query_as(
        r#"
        WITH cand AS (
            SELECT o.seq
            FROM postal.outbox o
            WHERE o.status = 'pending'
              AND o.available_at <= now()
              AND (o.locked_until IS NULL OR o.locked_until < now())
              AND o.key_partition = ANY($1)
              AND NOT EXISTS (
                  SELECT 1 FROM postal.outbox b
                  WHERE b.held AND b.event_key = o.event_key AND b.seq < o.seq
                    AND (b.status = 'failed' OR b.available_at > now())
              )
            ORDER BY o.seq
            LIMIT $2
            FOR UPDATE SKIP LOCKED
        )
        UPDATE postal.outbox o
        SET claimed_by = $3,
            locked_until = now() + $4 * interval '1 millisecond',
            held = false
        FROM cand
        WHERE o.seq = cand.seq
        RETURNING o.seq, o.event_id, o.topic, o.event_key, o.event_type, o.schema_version,
                  o.occurred_at, o.content_type, o.payload, o.headers, o.attempts
        "#,
    )
    .bind(partitions)
    .bind(limit as i64)
    .bind(relay)
    .bind(lease.as_millis() as i64)
    .fetch_all(pool)
    .await?;

    let mut events: Vec<OutboundEvent> = rows
        .into_iter()
        .map(|r| OutboundEvent {
            seq: r.seq,
            id: EventId::from_uuid(r.event_id)
                .expect("the outbox's CHECK constraint forbids the nil event id"),
            topic: r.topic,
            key: r.event_key,
            event_type: r.event_type,
            schema_version: r.schema_version,
            occurred_at: r.occurred_at,
            content_type: r.content_type,
            payload: r.payload,
            headers: r.headers.0.into_iter().collect(),
            attempts: r.attempts,
        })
        .collect();
    events.sort_unstable_by_key(|e| e.seq);
    Ok(events)
}

/// Releases every row still leased to `relay` (graceful shutdown): they become claimable at
/// once instead of after the lease.
pub async fn release_all(pool: &PgPool, relay: Uuid) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE postal.outbox SET claimed_by = NULL, locked_until = NULL
         WHERE claimed_by = $1 AND status = 'pending'",
    )
    .bind(relay)
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}
