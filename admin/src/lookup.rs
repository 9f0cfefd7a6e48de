//! "Did consumer X process event Y?"

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::Error;

/// What Postal's tables say about one event.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Answer {
    /// When the consumer committed it (its dedup row), if it did.
    pub processed_at: Option<DateTime<Utc>>,
    /// Dead letters recorded for it: (id, consumer, reason, replayed, resolved).
    pub dead_letters: Vec<(i64, String, String, bool, bool)>,
    /// Its outbox row's status, if the outbox still has it (`pending`, `published`, `failed`).
    pub outbox_status: Option<String>,
    /// The consumer's dedup horizon: dedup rows processed before it were deleted, so "not
    /// processed" is only certain for events after it.
    pub horizon: Option<DateTime<Utc>>,
}

/// Looks `event_id` up for `consumer` (its dedup row's primary key).
pub async fn event(pool: &PgPool, consumer: &str, event_id: Uuid) -> Result<Answer, Error> {
    let processed_at = sqlx::query_scalar(
        "SELECT processed_at FROM postal.processed_events
         WHERE consumer_name = $2 AND event_id = $1",
    )
    .bind(event_id)
    .bind(consumer)
    .fetch_optional(pool)
    .await?;
    let dead_letters = sqlx::query_as(
        "SELECT id, consumer_name, reason, replayed_at IS NOT NULL, resolved_at IS NOT NULL
         FROM postal.dead_letters
         WHERE event_id = $1 AND consumer_name = $2 ORDER BY id",
    )
    .bind(event_id)
    .bind(consumer)
    .fetch_all(pool)
    .await?;
    let outbox_status = sqlx::query_scalar("SELECT status FROM postal.outbox WHERE event_id = $1")
        .bind(event_id)
        .fetch_optional(pool)
        .await?;
    let horizon =
        sqlx::query_scalar("SELECT horizon FROM postal.dedup_horizon WHERE consumer_name = $1")
            .bind(consumer)
            .fetch_optional(pool)
            .await?;
    Ok(Answer {
        processed_at,
        dead_letters,
        outbox_status,
        horizon,
    })
}
