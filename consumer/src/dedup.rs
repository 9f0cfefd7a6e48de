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
/// transaction is still `xid` (`None`: no row of the transaction was written yet, nothing to
/// check). `None`: it is not — a handler body ended it ([`crate::batch`]'s `ended`), nothing
/// was written; otherwise the ids that were new and, when any was, the transaction's id. One
/// plain insert (the round trip the row costs anyway is the check that the body before ended
/// nothing); only when no row was new does a second statement tell a duplicate from an ended
/// transaction.
pub(crate) async fn record_checked(
    conn: &mut PgConnection,
    consumer: &str,
    event_ids: &[EventId],
    xid: Option<&str>,
) -> Result<Option<(Vec<EventId>, Option<String>)>, sqlx::Error> {
    let ids: Vec<uuid::Uuid> = event_ids.iter().map(EventId::as_uuid).collect();
    // The batch's first rows (its id read back), then later rows (guarded by it).
    let rows: Vec<(uuid::Uuid, String)> = match xid {
        None => {
            sqlx::query_as(
                "INSERT INTO postal.processed_events (consumer_name, event_id)
                 SELECT $1, unnest($2::uuid[])
                 ON CONFLICT DO NOTHING
                 RETURNING event_id, pg_current_xact_id()::text",
            )
            .bind(consumer)
            .bind(&ids)
            .fetch_all(&mut *conn)
            .await?
        }
        Some(xid) => {
            sqlx::query_as(
                "INSERT INTO postal.processed_events (consumer_name, event_id)
                 SELECT $1, i.id FROM unnest($2::uuid[]) AS i(id)
                 WHERE pg_current_xact_id_if_assigned()::text = $3
                 ON CONFLICT DO NOTHING
                 RETURNING event_id, $3",
            )
            .bind(consumer)
            .bind(&ids)
            .bind(xid)
            .fetch_all(&mut *conn)
            .await?
        }
    };
    if let Some((_, now)) = rows.first() {
        if xid.is_some_and(|x| x != now) {
            return Ok(None);
        }
        let now = now.clone();
        let fresh = rows
            .into_iter()
            .filter_map(|(u, _)| EventId::from_uuid(u).ok())
            .collect();
        return Ok(Some((fresh, Some(now))));
    }
    // Nothing new: duplicates, or no longer the batch's transaction.
    if let Some(xid) = xid {
        if current_xid(conn).await?.as_deref() != Some(xid) {
            return Ok(None);
        }
    }
    Ok(Some((Vec::new(), None)))
}

/// The session's transaction id (`pg_current_xact_id_if_assigned()`, as text): `None` outside a
/// transaction or before it wrote anything.
pub(crate) async fn current_xid(conn: &mut PgConnection) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text")
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
