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

use std::time::Duration;

use postal_shared::cleanup::{delete_in_batches, CleanupLock};
use sqlx::PgPool;

/// First key of the advisory lock held while cleaning (`'pded'`); the second key is
/// `hashtext(consumer_name)`, so different consumers clean independently.
pub const DEDUP_CLEANUP_LOCK: i32 = 0x7064_6564;

/// Deletes `consumer`'s dedup rows older than `retention`, `batch` rows per statement, until
/// none are left. Returns `None` (doing nothing) when another instance of the consumer is
/// cleaning right now, else the number of rows deleted.
pub async fn cleanup_processed(
    pool: &PgPool,
    consumer: &str,
    retention: Duration,
    batch: usize,
) -> Result<Option<u64>, sqlx::Error> {
    delete_in_batches(
        pool,
        CleanupLock::Named(DEDUP_CLEANUP_LOCK, consumer),
        "DELETE FROM postal.processed_events
         WHERE consumer_name = $3 AND event_id IN (
             SELECT event_id FROM postal.processed_events
             WHERE consumer_name = $3
               AND processed_at < now() - $1 * interval '1 millisecond'
             LIMIT $2)",
        retention,
        batch,
        |_| {},
    )
    .await
}

/// Advisory lock held while cleaning up dead letters (`'postdlqc'`).
pub const DEAD_LETTER_CLEANUP_LOCK: i64 = 0x706f_7374_646c_7163;

/// Deletes dead letters created more than `retention` ago whose record was published to their
/// dead-letter topic (a dead letter not published yet is never deleted: the table is its only
/// copy), `batch` rows per statement, until none are left. Replayed ones go the same way.
/// Returns `None` (doing nothing) when another instance is cleaning right now, else the number
/// of rows deleted.
pub async fn cleanup_dead_letters(
    pool: &PgPool,
    retention: Duration,
    batch: usize,
) -> Result<Option<u64>, sqlx::Error> {
    delete_in_batches(
        pool,
        CleanupLock::Key(DEAD_LETTER_CLEANUP_LOCK),
        "DELETE FROM postal.dead_letters WHERE id IN (
             SELECT id FROM postal.dead_letters
             WHERE published_at IS NOT NULL
               AND created_at < now() - $1 * interval '1 millisecond'
             ORDER BY id LIMIT $2)",
        retention,
        batch,
        |_| {},
    )
    .await
}
