//! Recording the outcome of a published batch: one statement per batch.

use std::time::Duration;

use sqlx::PgPool;

/// What happens to a row whose publish failed.
#[derive(Clone, Debug)]
pub struct Failure {
    /// Outbox sequence number.
    pub seq: i64,
    /// Whether the failure uses up an attempt.
    pub counts: bool,
    /// Park now (permanent failure or attempts exhausted).
    pub park: bool,
    /// Whether the row holds back later events of its key meanwhile.
    pub hold: bool,
    /// When to retry, from now.
    pub retry_in: Duration,
    /// Recorded as `last_error` (kept unchanged when `None`).
    pub reason: Option<String>,
}

/// In one statement: deletes (or marks published) the acknowledged rows and reschedules or
/// parks the failed ones. Failed rows hold back later events of their key.
pub async fn complete(
    pool: &PgPool,
    published: &[i64],
    failures: &[Failure],
    delete_on_publish: bool,
) -> Result<(), sqlx::Error> {
    let seqs: Vec<i64> = failures.iter().map(|f| f.seq).collect();
    let incs: Vec<i32> = failures.iter().map(|f| i32::from(f.counts)).collect();
    let delays: Vec<i64> = failures
        .iter()
        .map(|f| f.retry_in.as_millis() as i64)
        .collect();
    let parks: Vec<bool> = failures.iter().map(|f| f.park).collect();
    let reasons: Vec<Option<&str>> = failures.iter().map(|f| f.reason.as_deref()).collect();
    let holds: Vec<bool> = failures.iter().map(|f| f.hold).collect();
    let sql = if delete_on_publish {
        r#"
        WITH done AS (
            DELETE FROM postal.outbox WHERE seq = ANY($1) RETURNING 1
        ), failed AS (
            UPDATE postal.outbox o
            SET attempts = o.attempts + u.inc,
                status = CASE WHEN u.park THEN 'failed' ELSE 'pending' END,
                available_at = now() + u.delay_ms * interval '1 millisecond',
                held = u.hold,
                last_error = coalesce(u.reason, o.last_error),
                claimed_by = NULL,
                locked_until = NULL
            FROM unnest($2::int8[], $3::int4[], $4::int8[], $5::bool[], $6::text[], $7::bool[])
                 AS u(seq, inc, delay_ms, park, reason, hold)
            WHERE o.seq = u.seq AND o.status = 'pending'
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM done) + (SELECT count(*) FROM failed)
        "#
    } else {
        r#"
        WITH done AS (
            UPDATE postal.outbox
            SET status = 'published', published_at = now(), claimed_by = NULL,
                locked_until = NULL, held = false
            WHERE seq = ANY($1) AND status = 'pending'
            RETURNING 1
        ), failed AS (
            UPDATE postal.outbox o
            SET attempts = o.attempts + u.inc,
                status = CASE WHEN u.park THEN 'failed' ELSE 'pending' END,
                available_at = now() + u.delay_ms * interval '1 millisecond',
                held = u.hold,
                last_error = coalesce(u.reason, o.last_error),
                claimed_by = NULL,
                locked_until = NULL
            FROM unnest($2::int8[], $3::int4[], $4::int8[], $5::bool[], $6::text[], $7::bool[])
                 AS u(seq, inc, delay_ms, park, reason, hold)
            WHERE o.seq = u.seq AND o.status = 'pending'
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM done) + (SELECT count(*) FROM failed)
        "#
    };
    let _: Option<i64> = sqlx::query_scalar(sql)
        .bind(published)
        .bind(&seqs)
        .bind(&incs)
        .bind(&delays)
        .bind(&parks)
        .bind(&reasons)
        .bind(&holds)
        .fetch_one(pool)
        .await?;
    Ok(())
}
