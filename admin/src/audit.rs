//! The audit trail: every dashboard action in `postal.operator_audit` (and in the log).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::Error;

/// One recorded action.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Entry {
    /// Its id.
    pub id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Who (the dashboard's actor: `local`, `token`, or what the auth hook named).
    pub actor: String,
    /// What: `requeue`, `discard`, `release-key`, `replay`, `resolve`.
    pub action: String,
    /// On what: the ids or the filter it was given.
    pub target: serde_json::Value,
    /// On how many.
    pub affected: i64,
}

/// Records an action (and logs it at INFO). `removed`: what a discard deleted.
pub async fn record(
    pool: &PgPool,
    actor: &str,
    action: &str,
    target: &serde_json::Value,
    affected: u64,
    removed: Option<&serde_json::Value>,
) -> Result<i64, Error> {
    tracing::info!(
        actor = %postal_shared::text::field(actor),
        action,
        target = %target,
        affected,
        "operator action"
    );
    Ok(sqlx::query_scalar(
        "INSERT INTO postal.operator_audit (actor, action, target, affected, removed)
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(actor)
    .bind(action)
    .bind(target)
    .bind(affected as i64)
    .bind(removed)
    .fetch_one(pool)
    .await?)
}

/// The latest entries, newest first.
pub async fn latest(pool: &PgPool, limit: i64) -> Result<Vec<Entry>, Error> {
    Ok(sqlx::query_as(
        "SELECT id, at, actor, action, target, affected FROM postal.operator_audit
         ORDER BY id DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?)
}
