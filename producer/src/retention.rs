//! Retention of published rows: kept in the outbox and deleted in batches, or kept in the
//! day-partitioned history table whose old partitions are dropped whole.

use std::time::Duration;

use postal_shared::cleanup::{delete_in_batches_recorded, CleanupLock};
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
    cleanup_published_recorded(pool, retention, batch, None, progress).await
}

/// [`cleanup_published`], each batch adding its count to the audit row `audit`
/// (`postal.operator_audit`, `postal cleanup`'s) in the batch's transaction.
pub async fn cleanup_published_recorded(
    pool: &PgPool,
    retention: Duration,
    batch: usize,
    audit: Option<i64>,
    progress: impl FnMut(u64),
) -> Result<Option<u64>, sqlx::Error> {
    delete_in_batches_recorded(
        pool,
        CleanupLock::Key(CLEANUP_LOCK),
        "DELETE FROM postal.outbox WHERE seq IN (
             SELECT seq FROM postal.outbox
             WHERE status = 'published'
               AND published_at < now() - $1 * interval '1 millisecond'
             ORDER BY published_at LIMIT $2)",
        retention,
        batch,
        audit,
        progress,
    )
    .await
}

/// Advisory lock held while maintaining the history partitions (`'posthist'`).
pub const HISTORY_LOCK: i64 = 0x706f_7374_6869_7374;

/// The session that holds [`HISTORY_LOCK`], in a few words (its pid, application and how
/// long it has been in its state), if one does.
pub async fn history_lock_holder(pool: &PgPool) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT format('pid %s (application %L, %s for %ss)', a.pid, a.application_name, a.state,
                       round(extract(epoch FROM now() - a.state_change)))
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.granted AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.classid = $1::oid AND l.objid = $2::oid AND l.objsubid = 1
         LIMIT 1",
    )
    .bind(HISTORY_LOCK >> 32)
    .bind(HISTORY_LOCK & 0xffff_ffff)
    .fetch_optional(pool)
    .await
}

/// The longest a maintenance statement waits for a lock (`lock_timeout`): behind a long reader
/// (a `pg_dump`, a report) it gives up and runs again at the next maintenance, instead of
/// queueing an exclusive lock that every relay's archive insert would then queue behind.
pub const MAINTENANCE_LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// The most days of the default partition given partitions of their own in one run.
const MAX_DAYS_PER_RUN: i64 = 64;

/// What one run of [`maintain_history`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HistoryMaintenance {
    /// Daily partitions created.
    pub created: Vec<String>,
    /// Rows moved out of the default partition into the partitions of their days.
    pub moved_rows: u64,
    /// Daily partitions dropped (their whole day lies before now − retention).
    pub dropped: Vec<String>,
    /// Rows deleted from the default partition (expired, without a partition of their own).
    pub default_rows_deleted: u64,
    /// The steps that failed (one line each: which step, and why); the others still ran. The
    /// run is retried at the next maintenance.
    pub failed: Vec<String>,
}

impl HistoryMaintenance {
    /// Whether tomorrow's partition exists and every step succeeded.
    pub fn ok(&self) -> bool {
        self.failed.is_empty()
    }
}

/// History mode (see [`crate::RelayConfig::history`]): gives today, tomorrow (UTC) and every
/// unexpired day with rows in the default partition a partition of its own (moving the
/// default partition's rows of that day into it), drops the partitions whose day ended more
/// than `retention` ago, and deletes expired rows from the default partition.
///
/// Each day is its own transaction and every statement waits at most
/// [`MAINTENANCE_LOCK_TIMEOUT`] for a lock: a step that fails (a lock not granted in time, a
/// constraint) is reported in [`HistoryMaintenance::failed`] and the other steps still run. One
/// instance at a time: returns `None` (doing nothing) when another instance holds the lock.
/// `Err` only when the database cannot be reached.
pub async fn maintain_history(
    pool: &PgPool,
    retention: Duration,
) -> Result<Option<HistoryMaintenance>, sqlx::Error> {
    // Closed instead of returned to the pool if this job is dropped while it holds the lock.
    let mut conn = postal_shared::cancel_safe::CloseUnlessFinished::new(pool.acquire().await?);
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(HISTORY_LOCK)
        .fetch_one(&mut *conn)
        .await?;
    if !locked {
        conn.finish();
        return Ok(None);
    }
    let result = maintain_locked(&mut conn, retention).await;
    let unlocked: Result<bool, _> = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
        .bind(HISTORY_LOCK)
        .fetch_one(&mut *conn)
        .await;
    if let Ok(true) = unlocked {
        conn.finish();
    }
    result.map(Some)
}

async fn maintain_locked(
    conn: &mut sqlx::PgConnection,
    retention: Duration,
) -> Result<HistoryMaintenance, sqlx::Error> {
    let retention_ms = retention.as_millis() as i64;
    let timeout = format!("{}ms", MAINTENANCE_LOCK_TIMEOUT.as_millis());
    let mut done = HistoryMaintenance::default();
    // Today, tomorrow, and the unexpired days that have rows in the default partition.
    let days: Vec<chrono::NaiveDate> = sqlx::query_scalar(
        "SELECT d FROM (
             SELECT (now() AT TIME ZONE 'UTC')::date AS d
             UNION SELECT (now() AT TIME ZONE 'UTC')::date + 1
             UNION (SELECT DISTINCT (published_at AT TIME ZONE 'UTC')::date
                    FROM postal.outbox_history_default
                    WHERE published_at >= now() - $1 * interval '1 millisecond'
                    ORDER BY 1 DESC LIMIT $2)) days
         ORDER BY d",
    )
    .bind(retention_ms)
    .bind(MAX_DAYS_PER_RUN)
    .fetch_all(&mut *conn)
    .await?;
    for day in days {
        let step = async {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                .bind(&timeout)
                .execute(&mut *tx)
                .await?;
            let (created, moved): (bool, i64) =
                sqlx::query_as("SELECT created, moved FROM postal.history_partition_ensure($1)")
                    .bind(day)
                    .fetch_one(&mut *tx)
                    .await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>((created, moved))
        }
        .await;
        match step {
            Ok((created, moved)) => {
                if created {
                    done.created
                        .push(format!("outbox_history_{}", day.format("%Y%m%d")));
                }
                done.moved_rows += moved as u64;
            }
            Err(e) if postal_shared::database_unavailable(&e) => return Err(e),
            Err(e) => done
                .failed
                .push(format!("creating the history partition of {day}: {e}")),
        }
    }
    // Old days: one partition per transaction.
    let expired: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i
         JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'postal.outbox_history'::regclass
           AND c.relname ~ '^outbox_history_[0-9]{8}$'
           AND (to_date(substr(c.relname, 16), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC'
               <= now() - $1 * interval '1 millisecond'
         ORDER BY 1",
    )
    .bind(retention_ms)
    .fetch_all(&mut *conn)
    .await?;
    for name in expired {
        let step = async {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                .bind(&timeout)
                .execute(&mut *tx)
                .await?;
            sqlx::query(&format!("DROP TABLE IF EXISTS postal.\"{name}\""))
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
        .await;
        match step {
            Ok(()) => done.dropped.push(name),
            Err(e) if postal_shared::database_unavailable(&e) => return Err(e),
            Err(e) => done
                .failed
                .push(format!("dropping history partition {name}: {e}")),
        }
    }
    let deleted = async {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(&timeout)
            .execute(&mut *tx)
            .await?;
        let n = sqlx::query(
            "DELETE FROM postal.outbox_history_default
             WHERE published_at < now() - $1 * interval '1 millisecond'",
        )
        .bind(retention_ms)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok::<_, sqlx::Error>(n)
    }
    .await;
    match deleted {
        Ok(n) => done.default_rows_deleted = n,
        Err(e) if postal_shared::database_unavailable(&e) => return Err(e),
        Err(e) => done.failed.push(format!(
            "deleting expired rows of the default history partition: {e}"
        )),
    }
    Ok(done)
}
