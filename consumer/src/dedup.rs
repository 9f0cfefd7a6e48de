//! The `processed_events` dedup row.

use postal_shared::EventId;
use sqlx::PgConnection;

use crate::Error;

/// Records that `consumer` processed `event_id`, in the caller's transaction. Returns `true`
/// for the first delivery and `false` for a duplicate (the row already existed), in which case
/// the caller must skip the effects. If the transaction rolls back, the row goes with it.
pub async fn record(
    conn: &mut PgConnection,
    consumer: &str,
    event_id: EventId,
) -> Result<bool, Error> {
    let inserted = sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id) VALUES ($1, $2)
         ON CONFLICT DO NOTHING",
    )
    .bind(consumer)
    .bind(event_id)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(inserted == 1)
}

/// Records many event ids at once (one multi-row `INSERT … ON CONFLICT DO NOTHING
/// RETURNING`); returns the ids that were new. Ids repeated in `event_ids` are returned once.
pub async fn record_many(
    conn: &mut PgConnection,
    consumer: &str,
    event_ids: &[EventId],
) -> Result<Vec<EventId>, sqlx::Error> {
    if event_ids.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = event_ids.iter().map(EventId::as_uuid).collect();
    let fresh: Vec<uuid::Uuid> = sqlx::query_scalar(
        "INSERT INTO postal.processed_events (consumer_name, event_id)
         SELECT $1, unnest($2::uuid[])
         ON CONFLICT DO NOTHING
         RETURNING event_id",
    )
    .bind(consumer)
    .bind(&ids)
    .fetch_all(conn)
    .await?;
    Ok(fresh
        .into_iter()
        .filter_map(|u| EventId::from_uuid(u).ok())
        .collect())
}

/// Records the dedup rows of a batch's `event_ids` up front, in its transaction (as
/// [`record_many`]): the ids that were new and, when any was, the transaction's id (read in
/// the same statement), against which [`crate::batch`] checks later that no handler body ended
/// the transaction.
pub(crate) async fn record_batch(
    conn: &mut PgConnection,
    consumer: &str,
    event_ids: &[EventId],
) -> Result<(Vec<EventId>, Option<String>), sqlx::Error> {
    if event_ids.is_empty() {
        return Ok((Vec::new(), None));
    }
    let ids: Vec<uuid::Uuid> = event_ids.iter().map(EventId::as_uuid).collect();
    let rows: Vec<(uuid::Uuid, String)> = sqlx::query_as(
        "INSERT INTO postal.processed_events (consumer_name, event_id)
         SELECT $1, unnest($2::uuid[])
         ON CONFLICT DO NOTHING
         RETURNING event_id, pg_current_xact_id()::text",
    )
    .bind(consumer)
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?;
    let xid = rows.first().map(|(_, x)| x.clone());
    let fresh = rows
        .into_iter()
        .filter_map(|(u, _)| EventId::from_uuid(u).ok())
        .collect();
    Ok((fresh, xid))
}

/// The session's transaction id (`pg_current_xact_id_if_assigned()`, as text): `None` outside a
/// transaction or before it wrote anything.
pub(crate) async fn current_xid(conn: &mut PgConnection) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text")
        .fetch_one(conn)
        .await
}

/// [`current_xid`], sealing the transaction for the runtime's own `COMMIT` in the same
/// statement (`postal.sealed`: without it a batch's dedup rows refuse the commit, migration
/// 0040). In a transaction a body began after ending the batch's, the seal is rolled back with
/// it (the caller sees another id).
/// Also reads the seal's refusals in the session ([`seal_refusals`]).
pub(crate) async fn seal(conn: &mut PgConnection) -> Result<(Option<String>, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT pg_current_xact_id_if_assigned()::text, postal.batch_seal_refusals()
         FROM (SELECT set_config('postal.sealed', 'on', true)) AS sealed",
    )
    .fetch_one(conn)
    .await
}

/// The number of the batch seal's last refusal in this session (migration 0041; a session with
/// none yet takes a fresh number, so that `DISCARD SEQUENCES` cannot make it look unchanged).
/// Outlives the rollback of a handler's savepoint: a change since the batch's session was
/// opened means the seal refused meanwhile, whatever the handler made of the error (wrapped
/// it, caught it and went on).
pub(crate) async fn seal_refusals(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT postal.batch_seal_refusals()")
        .fetch_one(conn)
        .await
}

/// Deletes dedup rows (in the caller's transaction): for records whose dedup row was written
/// in this transaction but which were not applied after all.
pub(crate) async fn forget_many(
    conn: &mut PgConnection,
    consumer: &str,
    event_ids: &[EventId],
) -> Result<(), sqlx::Error> {
    if event_ids.is_empty() {
        return Ok(());
    }
    let ids: Vec<uuid::Uuid> = event_ids.iter().map(EventId::as_uuid).collect();
    sqlx::query(
        "DELETE FROM postal.processed_events WHERE consumer_name = $1 AND event_id = ANY($2)",
    )
    .bind(consumer)
    .bind(&ids)
    .execute(conn)
    .await?;
    Ok(())
}
