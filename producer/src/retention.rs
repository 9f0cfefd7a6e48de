//! Retention of published rows (when the relay keeps them instead of deleting them).

use std::time::Duration;

use postal_shared::cleanup::{delete_in_batches, CleanupLock};
use sqlx::PgPool;

/// Advisory lock held while cleaning up, so one instance cleans at a time (`'postclen'`).
pub const CLEANUP_LOCK: i64 = 0x706f_7374_636c_656e;

/// Deletes published rows older than `retention`, `batch` rows per statement, until none are
/// left. Returns `None` (doing nothing) when another instance is cleaning right now, else the
/// number of rows deleted. `progress` is called after every batch with the running total.
pub async fn cleanup_published(
    pool: &PgPool,
    retention: Duration,
    batch: usize,
    progress: impl FnMut(u64),
) -> Result<Option<u64>, sqlx::Error> {
    delete_in_batches(
        pool,
        CleanupLock::Key(CLEANUP_LOCK),
        "DELETE FROM postal.outbox WHERE seq IN (
             SELECT seq FROM postal.outbox
             WHERE status = 'published'
               AND published_at < now() - $1 * interval '1 millisecond'
             ORDER BY published_at LIMIT $2)",
        retention,
        batch,
        progress,
    )
    .await
}
