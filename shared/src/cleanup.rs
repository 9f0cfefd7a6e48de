//! Batched deletion of old rows by one instance at a time: the shape both of Postal's
//! retention jobs (published outbox rows, dedup rows) share.

use std::time::Duration;

use sqlx::PgPool;

/// The shortest dedup retention Postal accepts (consumer configuration and `postal cleanup`).
///
/// A copy of an event can arrive as long as a relay may publish it again — until its batch is
/// recorded, which an outage of the database or the broker delays for as long as it lasts — and
/// as long as a consumer may re-read it (a rebalance re-reads from the last committed offset, a
/// `postal consumer reset` from wherever it is told). Dedup rows deleted before that let the copy
/// apply twice. An hour is the floor, for tests and demos; keep production retention above the
/// longest outage you plan for (the default is 7 days).
pub const MIN_DEDUP_RETENTION: Duration = Duration::from_secs(3600);

/// The longest one batch of a cleanup job waits for a lock (`lock_timeout`).
pub const CLEANUP_LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// The advisory lock that makes a cleanup job run in one instance at a time. It is taken
/// transaction-scoped, anew by every batch (`pg_try_advisory_xact_lock`), so that a job holds
/// no session state: it works the same through a transaction pooler and leaves nothing behind
/// on a server session when it is dropped. A session lock on the same key (taken by an older
/// release) excludes it too.
#[derive(Clone, Copy, Debug)]
pub enum CleanupLock<'a> {
    /// `pg_try_advisory_xact_lock(key)`.
    Key(i64),
    /// `pg_try_advisory_xact_lock(key, hashtext(name))`: one lock per name (e.g. per consumer).
    Named(i32, &'a str),
}

/// Runs `delete` until a run deletes fewer than `batch` rows, each run a transaction of its own
/// that first takes `lock` and sets a transaction-local `lock_timeout`
/// ([`CLEANUP_LOCK_TIMEOUT`]). `delete` is a `DELETE` of at most `$2` rows older than `$1`
/// milliseconds; with [`CleanupLock::Named`], `$3` is the name. Returns `None` (doing nothing)
/// when another instance holds the lock at the first batch, else the number of rows deleted
/// (a job that finds the lock taken at a later batch ends there: the other instance goes on);
/// `progress` gets the running total after every batch.
///
/// No statement is prepared by name (a transaction pooler would lose it), and no session
/// setting is changed.
pub async fn delete_in_batches(
    pool: &PgPool,
    lock: CleanupLock<'_>,
    delete: &'static str,
    retention: Duration,
    batch: usize,
    progress: impl FnMut(u64),
) -> Result<Option<u64>, sqlx::Error> {
    delete_in_batches_recorded(pool, lock, delete, retention, batch, None, progress).await
}

/// [`delete_in_batches`] that also adds each batch's count to the `affected` of the audit row
/// `audit` (`postal.operator_audit`), in the batch's own transaction: a job that fails or is
/// stopped midway leaves its row saying how many rows its committed batches deleted.
pub async fn delete_in_batches_recorded(
    pool: &PgPool,
    lock: CleanupLock<'_>,
    delete: &'static str,
    retention: Duration,
    batch: usize,
    audit: Option<i64>,
    mut progress: impl FnMut(u64),
) -> Result<Option<u64>, sqlx::Error> {
    // Closed instead of returned to the pool if this job is dropped inside a batch.
    let mut conn = crate::cancel_safe::CloseUnlessFinished::new(pool.acquire().await?);
    let mut total = 0u64;
    let mut first = true;
    loop {
        let ran = one_batch(&mut conn, lock, delete, retention, batch, audit).await;
        let end = if ran.is_ok() { "COMMIT" } else { "ROLLBACK" };
        sqlx::Executor::execute(&mut *conn, end).await?;
        let Some(n) = ran? else {
            conn.finish();
            return Ok(if first { None } else { Some(total) });
        };
        first = false;
        total += n;
        progress(total);
        if (n as usize) < batch {
            conn.finish();
            return Ok(Some(total));
        }
    }
}

/// One batch of [`delete_in_batches`]: `BEGIN`, the lock and the transaction's `lock_timeout`,
/// the `DELETE` (and its count added to the audit row `audit`). `None` when another instance holds the lock. The caller ends the transaction.
async fn one_batch(
    conn: &mut sqlx::PgConnection,
    lock: CleanupLock<'_>,
    delete: &'static str,
    retention: Duration,
    batch: usize,
    audit: Option<i64>,
) -> Result<Option<u64>, sqlx::Error> {
    sqlx::Executor::execute(&mut *conn, "BEGIN").await?;
    let timeout = format!("{}ms", CLEANUP_LOCK_TIMEOUT.as_millis());
    // A batch waits at most CLEANUP_LOCK_TIMEOUT for a row or table lock, then the job ends
    // with an error and runs again next time, instead of queueing behind a long transaction.
    let locked: bool =
        match lock {
            CleanupLock::Key(key) => sqlx::query_scalar(
                "SELECT pg_try_advisory_xact_lock($1) FROM set_config('lock_timeout', $2, true)",
            )
            .bind(key)
            .bind(timeout)
            .persistent(false)
            .fetch_one(&mut *conn)
            .await?,
            CleanupLock::Named(key, name) => {
                sqlx::query_scalar(
                    "SELECT pg_try_advisory_xact_lock($1, hashtext($3)) \
                 FROM set_config('lock_timeout', $2, true)",
                )
                .bind(key)
                .bind(timeout)
                .bind(name)
                .persistent(false)
                .fetch_one(&mut *conn)
                .await?
            }
        };
    if !locked {
        return Ok(None);
    }
    let mut q = sqlx::query(delete)
        .bind(retention.as_millis() as i64)
        .bind(batch as i64)
        .persistent(false);
    if let CleanupLock::Named(_, name) = lock {
        q = q.bind(name);
    }
    let n = q.execute(&mut *conn).await?.rows_affected();
    if let (Some(id), true) = (audit, n > 0) {
        sqlx::query("UPDATE postal.operator_audit SET affected = affected + $2 WHERE id = $1")
            .bind(id)
            .bind(n as i64)
            .persistent(false)
            .execute(&mut *conn)
            .await?;
    }
    Ok(Some(n))
}
