//! Held keys of consumer groups (`FinalFailure::HoldKey`, migration 32): what waits behind
//! each key, and releasing one. A release only asks: it marks the key's row, audited in the
//! same transaction, and the partition's owning consumer applies it (the head, or the head
//! dead-lettered, then the rest in offset order), so the partition keeps one writer.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::audit::{self, Operator};
use crate::Error;

/// How many of a key's first held events a listing and a release name.
pub const FIRST: i64 = 5;

/// One held key of a group, with what waits behind it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct HeldKey {
    /// The record key's bytes.
    #[serde(skip)]
    pub key_bytes: Vec<u8>,
    /// The topic.
    pub topic: String,
    /// The partition it is held on.
    pub partition: i32,
    /// The record key (lossy UTF-8; see `key_bytes`).
    #[sqlx(skip)]
    pub key: String,
    /// The record key's bytes in base64: names any key, UTF-8 or not (`postal held release
    /// --key-base64`).
    pub key_base64: String,
    /// Why the head failed (a dead-letter reason).
    pub reason: String,
    /// The head's error.
    pub error: String,
    /// Handler runs of the head so far.
    pub attempts: i32,
    /// Since when.
    pub held_at: DateTime<Utc>,
    /// The retry policy's next retry of the head, if any.
    pub due_at: Option<DateTime<Utc>>,
    /// A release asked for and not yet applied: `retry` or `skip`.
    pub release: Option<String>,
    /// Held records (the head included).
    pub count: i64,
    /// Their bytes, as counted against the group's bound.
    pub bytes: i64,
    /// The first held events, head first: `offset:event_id:event_type` (`-` for a record
    /// held without an envelope, dead-lettered at the release).
    pub first: Vec<String>,
}

/// The held keys of `group`, oldest first.
pub async fn list(pool: &PgPool, group: &str) -> Result<Vec<HeldKey>, Error> {
    Ok(sqlx::query_as(
        "SELECT k.topic, k.partition, k.record_key AS key_bytes,
                translate(encode(k.record_key, 'base64'), chr(10), '') AS key_base64,
                k.reason, k.error, k.attempts, k.held_at, k.due_at, k.release,
                r.count, r.bytes, r.first
         FROM postal.held_keys k
         CROSS JOIN LATERAL (
             SELECT count(*) AS count, coalesce(sum(bytes), 0)::bigint AS bytes,
                    (array_agg(kafka_offset || ':'
                                || coalesce(nullif(event_id, '00000000-0000-0000-0000-000000000000')::text, '-')
                                || ':' || event_type
                               ORDER BY kafka_offset))[1:$2] AS first
             FROM postal.held_records h
             WHERE h.group_id = k.group_id AND h.topic = k.topic
               AND h.partition = k.partition AND h.key_hash = k.key_hash
               AND h.record_key = k.record_key) r
         WHERE k.group_id = $1
         ORDER BY k.held_at, k.topic, k.partition",
    )
    .bind(group)
    .bind(FIRST as i32)
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|mut k: HeldKey| {
        k.first.truncate(FIRST as usize);
        k.key = String::from_utf8_lossy(&k.key_bytes).into_owned();
        k
    })
    .collect())
}

/// The held keys of `group` matching `topic` and `key` (its bytes).
pub async fn find(
    pool: &PgPool,
    group: &str,
    topic: &str,
    key: &[u8],
) -> Result<Vec<HeldKey>, Error> {
    Ok(list(pool, group)
        .await?
        .into_iter()
        .filter(|k| k.topic == topic && k.key_bytes == key)
        .collect())
}

/// Whether `group` is known to this database: it has stored offsets (or held keys).
pub async fn group_known(pool: &PgPool, group: &str) -> Result<bool, Error> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM postal.consumer_offsets WHERE group_id = $1)
             OR EXISTS (SELECT 1 FROM postal.held_keys WHERE group_id = $1)",
    )
    .bind(group)
    .fetch_one(pool)
    .await?)
}

/// `bytes` in standard base64 (with padding).
pub fn base64_of(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `key` for a message: as text if it is UTF-8, else in base64 (as `--key-base64` takes it).
pub fn key_named(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(k) => postal_shared::text::quoted(k),
        Err(_) => format!("(base64) {}", base64_of(key)),
    }
}

/// Bytes of held records per group, as counted against the bound.
pub async fn group_bytes(pool: &PgPool, group: &str) -> Result<i64, Error> {
    Ok(
        sqlx::query_scalar("SELECT bytes FROM postal.held_bytes WHERE group_id = $1")
            .bind(group)
            .fetch_optional(pool)
            .await?
            .unwrap_or(0),
    )
}

/// Asks the owner of `key`'s partition(s) to release it: the head retried then the rest, or
/// with `skip_head` the head dead-lettered then the rest. Audited (action `release-held`) in
/// the transaction that marks the key. Refused if the key is not held, or a release of it is
/// already under way. Returns what it asked to release.
pub async fn release(
    pool: &PgPool,
    by: &Operator,
    group: &str,
    topic: &str,
    key: &[u8],
    skip_head: bool,
) -> Result<Vec<HeldKey>, Error> {
    let held = find(pool, group, topic, key).await?;
    if held.is_empty() {
        return Err(Error::Invalid(format!(
            "no held key {} on topic {} of group {}",
            key_named(key),
            postal_shared::text::quoted(topic),
            postal_shared::text::quoted(group)
        )));
    }
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    let marked: Vec<i32> = sqlx::query_scalar(
        "UPDATE postal.held_keys SET release = $4, released_by = $5
         WHERE group_id = $1 AND topic = $2 AND key_hash = sha256($3) AND record_key = $3
           AND release IS NULL
         RETURNING partition",
    )
    .bind(group)
    .bind(topic)
    .bind(key)
    .bind(if skip_head { "skip" } else { "retry" })
    .bind(by.name())
    .fetch_all(&mut *tx)
    .await?;
    if marked.is_empty() {
        return Err(Error::Invalid(format!(
            "a release of key {} on topic {} is already under way",
            key_named(key),
            postal_shared::text::quoted(topic)
        )));
    }
    let count: i64 = held.iter().map(|k| k.count).sum();
    let target = serde_json::json!({
        "group": group,
        "topic": topic,
        "key": String::from_utf8_lossy(key),
        "key_base64": held.first().map(|k| k.key_base64.clone()),
        "skip_head": skip_head,
        "partitions": marked,
        "first": held.iter().flat_map(|k| k.first.clone()).collect::<Vec<_>>(),
    });
    audit::record(
        &mut tx,
        by,
        "release-held",
        &target,
        count as usize,
        count as u64,
    )
    .await?;
    tx.commit().await?;
    Ok(held)
}

/// The groups that hold keys, by name.
pub async fn groups(pool: &PgPool) -> Result<Vec<String>, Error> {
    Ok(
        sqlx::query_scalar("SELECT DISTINCT group_id FROM postal.held_keys ORDER BY 1")
            .fetch_all(pool)
            .await?,
    )
}

/// The held keys and records of `group` on `topic`: (keys, records).
pub async fn count(pool: &PgPool, group: &str, topic: &str) -> Result<(i64, i64), Error> {
    Ok(sqlx::query_as(
        "SELECT (SELECT count(*) FROM postal.held_keys WHERE group_id = $1 AND topic = $2),
                (SELECT count(*) FROM postal.held_records WHERE group_id = $1 AND topic = $2)",
    )
    .bind(group)
    .bind(topic)
    .fetch_one(pool)
    .await?)
}

/// The dead-letter reason of a replaced log's held records (as the consumer's
/// `DeadLetterReason::LogReplaced` names it).
pub const LOG_REPLACED: &str = "log_replaced";

/// A replaced log's held records become dead letters (reason `log_replaced`), in key order,
/// and its held keys are let go, their bytes taken off the group's count. They are events of
/// the old log never applied: kept as dead letters, nothing is lost (`postal dead-letters
/// replay` applies them after the new log's), and held records of the old log cannot meet the
/// new log's records at the same offsets.
pub async fn dead_letter_replaced_log(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    group: &str,
    topic: &str,
) -> Result<u64, Error> {
    let moved = sqlx::query(
        "WITH gone AS (
             DELETE FROM postal.held_records r USING postal.held_keys k
             WHERE r.group_id = $1 AND r.topic = $2
               AND (k.group_id, k.topic, k.partition, k.key_hash)
                   = (r.group_id, r.topic, r.partition, r.key_hash)
             RETURNING r.*, k.consumer_name, k.head_offset, k.reason AS head_reason,
                       k.error AS head_error, k.attempts AS head_attempts,
                       k.dlq_topic AS held_dlq_topic),
         counted AS (
             UPDATE postal.held_bytes
             SET bytes = greatest(bytes - (SELECT sum(bytes) FROM gone), 0)
             WHERE group_id = $1 AND EXISTS (SELECT 1 FROM gone))
         INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
             kafka_offset, event_id, event_type, record_key, payload, header_names,
             header_values, reason, error, attempts, dlq_topic, header_absent)
         SELECT g.consumer_name, g.group_id, g.topic, g.partition, g.kafka_offset,
                nullif(g.event_id, '00000000-0000-0000-0000-000000000000'), g.event_type,
                g.record_key, g.payload, g.header_names, g.header_values, $3,
                left(CASE WHEN g.kafka_offset = g.head_offset
                          THEN 'held as its key''s head (' || g.head_reason || ': '
                               || g.head_error || ')'
                          ELSE 'held behind its key''s head at offset ' || g.head_offset
                     END || ' when the topic''s log was replaced (postal consumer reset); never applied', 2000),
                CASE WHEN g.kafka_offset = g.head_offset THEN g.head_attempts ELSE 0 END,
                coalesce(g.held_dlq_topic,
                         (SELECT d.dlq_topic FROM postal.dead_letters d
                          WHERE d.consumer_name = g.consumer_name AND d.topic = g.topic
                          ORDER BY d.id DESC LIMIT 1),
                         g.topic || '.dlq'),
                g.header_absent
         FROM gone g
         ORDER BY g.partition, g.kafka_offset",
    )
    .bind(group)
    .bind(topic)
    .bind(LOG_REPLACED)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    sqlx::query("DELETE FROM postal.held_keys WHERE group_id = $1 AND topic = $2")
        .bind(group)
        .bind(topic)
        .execute(&mut **tx)
        .await?;
    Ok(moved)
}
