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

/// Of `event_ids`, those `consumer` has no dedup row for (a read: throughput mode plans its
/// batch with it and records each event's row just before its body, [`record_checked`]).
pub(crate) async fn unrecorded(
    conn: &mut PgConnection,
    consumer: &str,
    event_ids: &[EventId],
) -> Result<Vec<EventId>, sqlx::Error> {
    if event_ids.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = event_ids.iter().map(EventId::as_uuid).collect();
    let fresh: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT DISTINCT i.id FROM unnest($2::uuid[]) AS i(id)
         WHERE NOT EXISTS (SELECT 1 FROM postal.processed_events p
                           WHERE p.consumer_name = $1 AND p.event_id = i.id)",
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

/// Records the dedup rows of `event_ids` (as [`record_many`]) only if the session's
/// transaction is still `xid` (`None`: the first rows of the transaction; its id is read).
/// `None`: it is not — a handler body ended it ([`crate::batch`]'s `ended`), nothing was
/// written; otherwise the ids that were new and the transaction's id. One round trip, which is
/// also the check that the body before ended nothing.
pub(crate) async fn record_checked(
    conn: &mut PgConnection,
    consumer: &str,
    event_ids: &[EventId],
    xid: Option<&str>,
) -> Result<Option<(Vec<EventId>, String)>, sqlx::Error> {
    let ids: Vec<uuid::Uuid> = event_ids.iter().map(EventId::as_uuid).collect();
    let (ours, now, fresh): (bool, Option<String>, Vec<uuid::Uuid>) = sqlx::query_as(
        "WITH ours AS MATERIALIZED (
             SELECT $3::text IS NULL OR pg_current_xact_id_if_assigned()::text = $3 AS ok
         ), fresh AS (
             INSERT INTO postal.processed_events (consumer_name, event_id)
             SELECT $1, i.id FROM unnest($2::uuid[]) AS i(id), ours WHERE ours.ok
             ON CONFLICT DO NOTHING
             RETURNING event_id
         )
         SELECT (SELECT ok FROM ours),
                CASE WHEN (SELECT ok FROM ours) THEN pg_current_xact_id()::text END,
                ARRAY(SELECT event_id FROM fresh)",
    )
    .bind(consumer)
    .bind(&ids)
    .bind(xid)
    .fetch_one(conn)
    .await?;
    let (true, Some(now)) = (ours, now) else {
        return Ok(None);
    };
    let fresh = fresh
        .into_iter()
        .filter_map(|u| EventId::from_uuid(u).ok())
        .collect();
    Ok(Some((fresh, now)))
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
