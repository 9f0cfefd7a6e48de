//! Retention of published rows: kept in the outbox and deleted in batches, or kept in the
//! day-partitioned history table whose old partitions are dropped whole.

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

/// Advisory lock held while maintaining the history partitions (`'posthist'`).
pub const HISTORY_LOCK: i64 = 0x706f_7374_6869_7374;

/// What one run of [`maintain_history`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HistoryMaintenance {
    /// Daily partitions dropped (their whole day lies before now − retention).
    pub dropped: Vec<String>,
    /// Rows deleted from the default partition (days that had no partition of their own).
    pub default_rows_deleted: u64,
}

/// History mode (see [`crate::RelayConfig::history`]): creates the daily partitions of
/// `postal.outbox_history` for today and tomorrow (UTC), drops those whose day ended more than
/// `retention` ago, and deletes expired rows from the default partition. One instance at a
/// time: returns `None` (doing nothing) when another instance holds the lock.
pub async fn maintain_history(
    pool: &PgPool,
    retention: Duration,
) -> Result<Option<HistoryMaintenance>, sqlx::Error> {
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(HISTORY_LOCK)
        .fetch_one(&mut *tx)
        .await?;
    if !locked {
        return Ok(None);
    }
    sqlx::query(
        "SELECT postal.history_partition_ensure((now() AT TIME ZONE 'UTC')::date),
                postal.history_partition_ensure((now() AT TIME ZONE 'UTC')::date + 1)",
    )
    .execute(&mut *tx)
    .await?;
    let retention_ms = retention.as_millis() as i64;
    let dropped: Vec<String> = sqlx::query_scalar(
        "SELECT postal.history_drop_before(now() - $1 * interval '1 millisecond')",
    )
    .bind(retention_ms)
    .fetch_all(&mut *tx)
    .await?;
    let default_rows_deleted = sqlx::query(
        "DELETE FROM postal.outbox_history_default
         WHERE published_at < now() - $1 * interval '1 millisecond'",
    )
    .bind(retention_ms)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(Some(HistoryMaintenance {
        dropped,
        default_rows_deleted,
    }))
}
