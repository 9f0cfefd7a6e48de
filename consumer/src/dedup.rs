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

/// [`record_many`], also returning the transaction's id (`pg_current_xact_id()`, as text) when
/// any row was new: what [`crate::ended`] compares after each handler body, to notice a body
/// that ended the transaction it was given. Same round trip.
pub(crate) async fn record_many_with_xid(
    conn: &mut PgConnection,
    consumer: &str,
    event_ids: &[EventId],
) -> Result<(Vec<EventId>, Option<String>), sqlx::Error> {
    if event_ids.is_empty() {
        return Ok((Vec::new(), None));
    }
    let ids: Vec<uuid::Uuid> = event_ids.iter().map(EventId::as_uuid).collect();
    let rows: Vec<(uuid::Uuid, String)> = sqlx::query_as(
        "WITH fresh AS (
             INSERT INTO postal.processed_events (consumer_name, event_id)
             SELECT $1, unnest($2::uuid[])
             ON CONFLICT DO NOTHING
             RETURNING event_id
         )
         SELECT event_id, pg_current_xact_id()::text FROM fresh",
    )
    .bind(consumer)
    .bind(&ids)
    .fetch_all(conn)
    .await?;
    let xid = rows.first().map(|r| r.1.clone());
    let fresh = rows
        .into_iter()
        .filter_map(|(u, _)| EventId::from_uuid(u).ok())
        .collect();
    Ok((fresh, xid))
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
