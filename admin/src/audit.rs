//! The audit trail: every operator action — from the dashboard or the `postal` CLI — in
//! `postal.operator_audit` (and in the log). The actions of [`crate::parked`] and
//! [`crate::dead_letters`] that change anything take an [`Operator`] and record themselves
//! here: there is no unaudited way to requeue, discard, release, replay or resolve.
//!
//! An action's row is written before it changes anything ([`open`]), and each batch it
//! changes adds its count (and, for a discard, the deleted events whole) to the row in the
//! batch's own transaction: the trail never misses a committed change, and a discarded event's
//! copy in `removed` commits with its deletion.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use crate::Error;

/// Who acts, as recorded (with the database role of the session, `current_user`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    name: String,
    via: &'static str,
}

impl Operator {
    /// A dashboard user (`local`, `token`, or what the dashboard's auth hook named).
    pub fn dashboard(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            via: "dashboard",
        }
    }

    /// The OS user running the `postal` CLI.
    pub fn cli(os_user: impl Into<String>) -> Self {
        Self {
            name: os_user.into(),
            via: "cli",
        }
    }

    /// The name recorded as `actor`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where from: `dashboard` or `cli`.
    pub fn via(&self) -> &str {
        self.via
    }
}

/// One recorded action.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[non_exhaustive]
pub struct Entry {
    /// Its id.
    pub id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Who: the dashboard's user (`local`, `token`, or what the auth hook named) or the OS
    /// user who ran the CLI.
    pub actor: String,
    /// Where from: `dashboard` or `cli` (none for rows written before migration 21).
    pub via: Option<String>,
    /// The database role of the session that acted (`current_user`).
    pub db_role: Option<String>,
    /// What: `requeue`, `discard`, `release-key`, `replay`, `resolve`, `pause`, `resume`,
    /// `reset` (`postal consumer reset --execute`).
    pub action: String,
    /// On what: the ids or the filter it was given.
    pub target: serde_json::Value,
    /// How many it matched when it started.
    pub matched: Option<i64>,
    /// On how many it acted.
    pub affected: i64,
}

/// An action's row in the trail, written before the action changes anything.
#[derive(Debug)]
pub struct Recording {
    id: i64,
    actor: String,
}

impl Recording {
    /// The row's id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The actor's name.
    pub(crate) fn actor(&self) -> &str {
        &self.actor
    }

    /// Adds what one batch changed, in the batch's transaction: its count, and for a discard
    /// the deleted events (appended to `removed`).
    pub(crate) async fn add(
        &self,
        tx: &mut PgConnection,
        affected: u64,
        removed: Option<&serde_json::Value>,
    ) -> Result<(), Error> {
        sqlx::query(
            "UPDATE postal.operator_audit
                SET affected = affected + $2,
                    removed = CASE WHEN $3::jsonb IS NULL THEN removed
                                   ELSE coalesce(removed, '[]'::jsonb) || $3::jsonb END
              WHERE id = $1",
        )
        .bind(self.id)
        .bind(affected as i64)
        .bind(removed)
        .execute(tx)
        .await?;
        Ok(())
    }
}

/// Opens an action's row (and logs the action at INFO): who, what, on what, how many it
/// matched; `affected` 0 until its batches commit.
pub async fn open(
    pool: &PgPool,
    by: &Operator,
    action: &str,
    target: &serde_json::Value,
    matched: usize,
) -> Result<Recording, Error> {
    tracing::info!(
        actor = %postal_shared::text::field(&by.name),
        via = by.via,
        action,
        target = %postal_shared::text::field(&target.to_string()),
        matched,
        "operator action"
    );
    let id = sqlx::query_scalar(
        "INSERT INTO postal.operator_audit (actor, via, db_role, action, target, matched, affected)
         VALUES ($1, $2, current_user, $3, $4, $5, 0) RETURNING id",
    )
    .bind(&by.name)
    .bind(by.via)
    .bind(action)
    .bind(target)
    .bind(matched as i64)
    .fetch_one(pool)
    .await?;
    Ok(Recording {
        id,
        actor: by.name.clone(),
    })
}

/// Records a whole action in the caller's transaction (an action that changes one thing,
/// in one transaction: a pause, a resume), and logs it at INFO: its row commits with the
/// change, or neither does.
pub async fn record(
    tx: &mut PgConnection,
    by: &Operator,
    action: &str,
    target: &serde_json::Value,
    matched: usize,
    affected: u64,
) -> Result<Recording, Error> {
    tracing::info!(
        actor = %postal_shared::text::field(&by.name),
        via = by.via,
        action,
        target = %postal_shared::text::field(&target.to_string()),
        matched,
        affected,
        "operator action"
    );
    let id = sqlx::query_scalar(
        "INSERT INTO postal.operator_audit (actor, via, db_role, action, target, matched, affected)
         VALUES ($1, $2, current_user, $3, $4, $5, $6) RETURNING id",
    )
    .bind(&by.name)
    .bind(by.via)
    .bind(action)
    .bind(target)
    .bind(matched as i64)
    .bind(affected as i64)
    .fetch_one(tx)
    .await?;
    Ok(Recording {
        id,
        actor: by.name.clone(),
    })
}

const COLUMNS: &str = "id, at, actor, via, db_role, action, target, matched, affected";

/// The latest entries, newest first.
pub async fn latest(pool: &PgPool, limit: i64) -> Result<Vec<Entry>, Error> {
    Ok(sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM postal.operator_audit ORDER BY id DESC LIMIT $1"
    ))
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// One entry with what it removed (a discard's deleted events, whole; else none).
pub async fn get(
    pool: &PgPool,
    id: i64,
) -> Result<Option<(Entry, Option<serde_json::Value>)>, Error> {
    let row = sqlx::query(&format!(
        "SELECT {COLUMNS}, removed FROM postal.operator_audit WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    use sqlx::{FromRow as _, Row as _};
    Ok(Some((Entry::from_row(&row)?, row.try_get("removed")?)))
}
