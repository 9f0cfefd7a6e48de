//! Retention of `processed_events`: dedup rows older than the window are deleted in small
//! batches, by one instance of a consumer at a time. And of `dead_letters` that reached their
//! dead-letter topic ([`cleanup_dead_letters`], run by `postal cleanup`).
//!
//! The rule: offsets stored beside the effects make consumer-side replays harmless without the
//! dedup table, but a relay that republishes an event (it crashed after the broker acknowledged
//! and before it recorded that) puts it at a *new* offset, where only the dedup row catches it.
//! So dedup rows must outlive the longest window in which the relay can republish: its lease
//! timeout plus the longest broker or database outage you plan for. The default, 7 days, covers
//! any outage that does not need a human.
//!
//! Each cleanup first records the consumer's dedup horizon (`postal.dedup_horizon`: the newest
//! `processed_at` among the rows it is about to delete) and then deletes only rows at or before
//! it, so a replay of records produced after the horizon is always deduplicated. `postal
//! consumer reset` refuses to move a group back past it ([`dedup_horizon`]).

use std::time::Duration;

use postal_shared::cleanup::{delete_in_batches, delete_in_batches_recorded, CleanupLock};
use sqlx::PgPool;

/// First key of the advisory lock held while cleaning (`'pded'`); the second key is
/// `hashtext(consumer_name)`, so different consumers clean independently.
pub const DEDUP_CLEANUP_LOCK: i32 = 0x7064_6564;

/// Deletes `consumer`'s dedup rows older than `retention`, `batch` rows per statement, until
/// none are left. Returns `None` (doing nothing) when another instance of the consumer is
/// cleaning right now, else the number of rows deleted.
///
/// Before deleting, it moves the consumer's dedup horizon forward to the newest `processed_at`
/// of the rows it will delete, and the delete never goes past the recorded horizon: dedup
/// information is never lost without the horizon saying so, even if the cleanup is cut short.
pub async fn cleanup_processed(
    pool: &PgPool,
    consumer: &str,
    retention: Duration,
    batch: usize,
) -> Result<Option<u64>, sqlx::Error> {
    cleanup_processed_recorded(pool, consumer, retention, batch, None).await
}

/// [`cleanup_processed`], each batch adding its count to the audit row `audit`
/// (`postal.operator_audit`, `postal cleanup`'s) in the batch's transaction.
pub async fn cleanup_processed_recorded(
    pool: &PgPool,
    consumer: &str,
    retention: Duration,
    batch: usize,
    audit: Option<i64>,
) -> Result<Option<u64>, sqlx::Error> {
    // In a transaction of its own, unnamed: behind a transaction pooler each round trip
    // outside a transaction may reach another server connection, where the statement sqlx
    // prepared (named, or unnamed in the round trip before) does not exist.
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    sqlx::query(
        "INSERT INTO postal.dedup_horizon (consumer_name, horizon)
         SELECT $1, max(processed_at) FROM postal.processed_events
         WHERE consumer_name = $1 AND processed_at < now() - $2 * interval '1 millisecond'
         HAVING max(processed_at) IS NOT NULL
         ON CONFLICT (consumer_name) DO UPDATE
            SET horizon = greatest(postal.dedup_horizon.horizon, EXCLUDED.horizon),
                updated_at = now()",
    )
    .bind(consumer)
    .bind(retention.as_millis() as i64)
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    delete_in_batches_recorded(
        pool,
        CleanupLock::Named(DEDUP_CLEANUP_LOCK, consumer),
        "DELETE FROM postal.processed_events
         WHERE consumer_name = $3 AND event_id IN (
             SELECT event_id FROM postal.processed_events
             WHERE consumer_name = $3
               AND processed_at < now() - $1 * interval '1 millisecond'
               AND processed_at <= (SELECT horizon FROM postal.dedup_horizon
                                    WHERE consumer_name = $3)
             LIMIT $2)",
        retention,
        batch,
        audit,
        |_| {},
    )
    .await
}

/// Records `consumer`'s dedup retention (`None`: keeps its rows for good) in
/// `postal.consumer_settings`, where `postal cleanup` reads it.
pub async fn declare_retention(
    pool: &PgPool,
    consumer: &str,
    retention: Option<Duration>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO postal.consumer_settings (consumer_name, dedup_retention_ms)
         VALUES ($1, $2)
         ON CONFLICT (consumer_name) DO UPDATE
            SET dedup_retention_ms = EXCLUDED.dedup_retention_ms, updated_at = now()",
    )
    .bind(consumer)
    .bind(retention.map(|r| r.as_millis() as i64))
    .execute(pool)
    .await?;
    Ok(())
}

/// What `consumer` declared about its dedup retention: `None` if it never did (an older
/// consumer, or one that never started), `Some(None)` if it keeps its rows for good.
pub async fn declared_retention(
    pool: &PgPool,
    consumer: &str,
) -> Result<Option<Option<Duration>>, sqlx::Error> {
    let row: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT dedup_retention_ms FROM postal.consumer_settings WHERE consumer_name = $1",
    )
    .bind(consumer)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|ms| ms.map(|ms| Duration::from_millis(ms as u64))))
}

/// `consumer`'s dedup horizon: every dedup row retention deleted was processed at or before
/// it, and none processed after it was deleted. `None`: retention never deleted any.
pub async fn dedup_horizon(
    pool: &PgPool,
    consumer: &str,
) -> Result<Option<chrono::DateTime<chrono::Utc>>, sqlx::Error> {
    sqlx::query_scalar("SELECT horizon FROM postal.dedup_horizon WHERE consumer_name = $1")
        .bind(consumer)
        .fetch_optional(pool)
        .await
}

/// Age in seconds of `consumer`'s oldest dedup row (`None` when it has none).
pub async fn oldest_dedup_age(pool: &PgPool, consumer: &str) -> Result<Option<f64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(processed_at))::float8
         FROM postal.processed_events WHERE consumer_name = $1",
    )
    .bind(consumer)
    .fetch_one(pool)
    .await
}

/// How often a running consumer records where its group stands (`postal.offset_marks`).
pub const MARK_EVERY: Duration = Duration::from_secs(600);

/// Records where `group` stands on each partition (`postal.offset_marks`) unless it was
/// recorded less than [`MARK_EVERY`] ago, and folds the group's marks older than `keep` into
/// one per partition (their highest position, at the latest of their times).
/// `postal consumer reset` reads them to tell which offsets were processed before a dedup
/// horizon. Returns the number of marks written.
pub async fn mark_offsets(pool: &PgPool, group: &str, keep: Duration) -> Result<u64, sqlx::Error> {
    let written = sqlx::query(
        "INSERT INTO postal.offset_marks (group_id, topic, partition, next_offset)
         SELECT c.group_id, c.topic, c.partition, c.next_offset FROM postal.consumer_offsets c
         WHERE c.group_id = $1 AND c.next_offset IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM postal.offset_marks m
                           WHERE m.group_id = c.group_id AND m.topic = c.topic
                             AND m.partition = c.partition
                             AND m.marked_at > now() - $2 * interval '1 millisecond')
         ON CONFLICT DO NOTHING",
    )
    .bind(group)
    .bind(MARK_EVERY.as_millis() as i64)
    .execute(pool)
    .await?
    .rows_affected();
    // Pruning folds the marks older than `keep` into one per partition: the highest position
    // among them, at the latest of their times. A reset's bound is the highest position marked
    // up to a point in time, so dropping old marks outright could drop the one high mark (a
    // reset's pre-move mark) that a lagging horizon still needs (found by a review).
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    let folded: Vec<(String, i32, i64, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT topic, partition, max(next_offset), max(marked_at) FROM postal.offset_marks
         WHERE group_id = $1 AND marked_at < now() - $2 * interval '1 millisecond'
         GROUP BY topic, partition HAVING count(*) > 1 ORDER BY topic, partition",
    )
    .bind(group)
    .bind(keep.as_millis() as i64)
    .fetch_all(&mut *tx)
    .await?;
    for (topic, partition, next_offset, marked_at) in folded {
        sqlx::query(
            "DELETE FROM postal.offset_marks
             WHERE group_id = $1 AND topic = $2 AND partition = $3 AND marked_at <= $4",
        )
        .bind(group)
        .bind(&topic)
        .bind(partition)
        .bind(marked_at)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO postal.offset_marks (group_id, topic, partition, next_offset, marked_at)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        )
        .bind(group)
        .bind(&topic)
        .bind(partition)
        .bind(next_offset)
        .bind(marked_at)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(written)
}

/// Name of the gauge of the age of a consumer's oldest dedup row, label `consumer`.
pub const DEDUP_OLDEST_GAUGE: &str = "postal_consumer_dedup_oldest_seconds";

/// Sets [`DEDUP_OLDEST_GAUGE`] for `consumer` (0 when it has no dedup rows).
pub fn report_oldest_dedup_age(consumer: &str, age: Option<f64>) {
    metrics::gauge!(DEDUP_OLDEST_GAUGE, "consumer" => consumer.to_owned()).set(age.unwrap_or(0.0));
}

/// Advisory lock held while cleaning up dead letters (`'postdlqc'`).
pub const DEAD_LETTER_CLEANUP_LOCK: i64 = 0x706f_7374_646c_7163;

/// [`cleanup_dead_letters`] for one consumer's dead letters (its own lock per name): what the
/// consumer runtime runs with [`crate::ConsumerConfig::dead_letter_retention`]. It keeps those
/// published cut (`dlq_cut`) until replayed or resolved, as [`cleanup_dead_letters`] does.
pub async fn cleanup_dead_letters_of(
    pool: &PgPool,
    consumer: &str,
    retention: Duration,
    batch: usize,
) -> Result<Option<u64>, sqlx::Error> {
    delete_in_batches(
        pool,
        CleanupLock::Named(DEAD_LETTER_CONSUMER_LOCK, consumer),
        "DELETE FROM postal.dead_letters WHERE id IN (
             SELECT id FROM postal.dead_letters
             WHERE consumer_name = $3
               AND published_at < now() - $1 * interval '1 millisecond'
               AND (dlq_cut IS NULL OR replayed_at IS NOT NULL OR resolved_at IS NOT NULL)
             ORDER BY id LIMIT $2)",
        retention,
        batch,
        |_| {},
    )
    .await
}

/// Advisory lock (with the consumer's name) held while one consumer's dead letters are cleaned
/// up (`'pdlq'`).
pub const DEAD_LETTER_CONSUMER_LOCK: i32 = 0x7064_6c71;

/// Deletes dead letters created more than `retention` ago whose record was published to their
/// dead-letter topic (a dead letter not published yet is never deleted: the table is its only
/// copy; nor one published cut, `dlq_cut`, until it is replayed or resolved: the table is its
/// only whole copy), `batch` rows per statement, until none are left. Replayed ones go the
/// same way.
/// Returns `None` (doing nothing) when another instance is cleaning right now, else the number
/// of rows deleted.
pub async fn cleanup_dead_letters(
    pool: &PgPool,
    retention: Duration,
    batch: usize,
) -> Result<Option<u64>, sqlx::Error> {
    cleanup_dead_letters_recorded(pool, retention, batch, None).await
}

/// [`cleanup_dead_letters`], each batch adding its count to the audit row `audit`
/// (`postal.operator_audit`, `postal cleanup`'s) in the batch's transaction.
pub async fn cleanup_dead_letters_recorded(
    pool: &PgPool,
    retention: Duration,
    batch: usize,
    audit: Option<i64>,
) -> Result<Option<u64>, sqlx::Error> {
    delete_in_batches_recorded(
        pool,
        CleanupLock::Key(DEAD_LETTER_CLEANUP_LOCK),
        "DELETE FROM postal.dead_letters WHERE id IN (
             SELECT id FROM postal.dead_letters
             WHERE published_at IS NOT NULL
               AND created_at < now() - $1 * interval '1 millisecond'
               AND (dlq_cut IS NULL OR replayed_at IS NOT NULL OR resolved_at IS NOT NULL)
             ORDER BY id LIMIT $2)",
        retention,
        batch,
        audit,
        |_| {},
    )
    .await
}
