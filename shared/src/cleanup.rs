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

/// The session advisory lock that makes a cleanup job run in one instance at a time.
#[derive(Clone, Copy, Debug)]
pub enum CleanupLock<'a> {
    /// `pg_try_advisory_lock(key)`.
    Key(i64),
    /// `pg_try_advisory_lock(key, hashtext(name))`: one lock per name (e.g. per consumer).
    Named(i32, &'a str),
}

/// Runs `delete` until a run deletes fewer than `batch` rows, holding `lock` for the whole job.
/// `delete` is a `DELETE` of at most `$2` rows older than `$1` milliseconds; with
/// [`CleanupLock::Named`], `$3` is the name. Returns `None` (doing nothing) when another
/// instance holds the lock, else the number of rows deleted; `progress` gets the running total
/// after every batch.
pub async fn delete_in_batches(
    pool: &PgPool,
    lock: CleanupLock<'_>,
    delete: &'static str,
    retention: Duration,
    batch: usize,
    mut progress: impl FnMut(u64),
) -> Result<Option<u64>, sqlx::Error> {
    // Closed instead of returned to the pool if this job is dropped while it holds the lock.
    let mut conn = crate::cancel_safe::CloseUnlessFinished::new(pool.acquire().await?);
    let (try_lock, unlock) = match lock {
        CleanupLock::Key(_) => (
            "SELECT pg_try_advisory_lock($1)",
            "SELECT pg_advisory_unlock($1)",
        ),
        CleanupLock::Named(..) => (
            "SELECT pg_try_advisory_lock($1, hashtext($2))",
            "SELECT pg_advisory_unlock($1, hashtext($2))",
        ),
    };
    let bind_lock = |sql| match lock {
        CleanupLock::Key(key) => sqlx::query_scalar::<_, bool>(sql).bind(key),
        CleanupLock::Named(key, name) => sqlx::query_scalar::<_, bool>(sql).bind(key).bind(name),
    };
    if !bind_lock(try_lock).fetch_one(&mut *conn).await? {
        conn.finish();
        return Ok(None);
    }
    let result = async {
        // A batch waits at most this long for a row or table lock, then the job ends with an
        // error and runs again next time, instead of queueing behind a long transaction.
        sqlx::query("SELECT set_config('lock_timeout', $1, false)")
            .bind(format!("{}ms", CLEANUP_LOCK_TIMEOUT.as_millis()))
            .execute(&mut *conn)
            .await?;
        let mut total = 0u64;
        loop {
            let mut q = sqlx::query(delete)
                .bind(retention.as_millis() as i64)
                .bind(batch as i64);
            if let CleanupLock::Named(_, name) = lock {
                q = q.bind(name);
            }
            let n = q.execute(&mut *conn).await?.rows_affected();
            total += n;
            progress(total);
            if (n as usize) < batch {
                return Ok::<u64, sqlx::Error>(total);
            }
        }
    }
    .await;
    // Returned to the pool only as it was taken: lock released, no lock timeout of ours.
    let reset = sqlx::query("RESET lock_timeout").execute(&mut *conn).await;
    if let (Ok(true), Ok(_)) = (bind_lock(unlock).fetch_one(&mut *conn).await, reset) {
        conn.finish();
    }
    result.map(Some)
}
