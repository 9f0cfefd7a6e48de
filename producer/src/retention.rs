//! Retention of published rows (when the relay keeps them instead of deleting them).

use std::time::Duration;

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
    mut progress: impl FnMut(u64),
) -> Result<Option<u64>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(CLEANUP_LOCK)
        .fetch_one(&mut *conn)
        .await?;
    if !locked {
        return Ok(None);
    }
    let result = async {
        let mut total = 0u64;
        loop {
            let n = sqlx::query(
                "DELETE FROM postal.outbox WHERE seq IN (
                     SELECT seq FROM postal.outbox
                     WHERE status = 'published'
                       AND published_at < now() - $1 * interval '1 millisecond'
                     ORDER BY published_at LIMIT $2)",
            )
            .bind(retention.as_millis() as i64)
            .bind(batch as i64)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            total += n;
            progress(total);
            if (n as usize) < batch {
                return Ok::<u64, sqlx::Error>(total);
            }
        }
    }
    .await;
    let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(CLEANUP_LOCK)
        .execute(&mut *conn)
        .await;
    result.map(Some)
}
