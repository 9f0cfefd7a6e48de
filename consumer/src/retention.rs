//! Retention of `processed_events`: dedup rows older than the window are deleted in small
//! batches, by one instance of a consumer at a time.
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
