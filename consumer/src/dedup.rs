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
