//! The audit trail: every operator action — from the dashboard or the `postal` CLI — in
//! `postal.operator_audit` (and in the log). The actions of [`crate::parked`] and
//! [`crate::dead_letters`] that change anything take an [`Operator`] and record themselves
//! here: there is no unaudited way to requeue, discard, release, replay or resolve.
//!
//! An action's row is written before it changes anything ([`open`]), and each batch it
//! changes adds its count to the row in the batch's own transaction: the trail never misses a
//! committed change. A discard's events are kept whole, one row each, in
//! `postal.operator_audit_events` (migration 30), moved there inside the database by the
//! statement that deletes them: a discarded event's copy commits with its deletion, and no
//! payload passes through the process that discards. Discards recorded before migration 30
//! kept their events in the audit row's `removed` array.

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
    /// `reset` (`postal consumer reset --execute`), `cleanup` (`postal cleanup`: one row per
    /// table it deletes from), `grant` (`postal grant`).
    pub action: String,
    /// On what: the ids or the filter it was given.
    pub target: serde_json::Value,
    /// How many it matched when it started (none for `cleanup`, which deletes what is past
    /// its retention as it goes).
    pub matched: Option<i64>,
    /// On how many it acted.
    pub affected: i64,
    /// When it ended, completed or failed; none while it runs, when its process died before it
    /// ended, and for rows from before migration 38.
    pub ended_at: Option<DateTime<Utc>>,
    /// The one-line error it ended with; none when it completed.
    pub error: Option<String>,
}

impl Entry {
    /// How the action ended, in a word: `done`, `failed`, or `-` (running, its process died
    /// before it ended, or recorded before migration 38).
    pub fn outcome(&self) -> &'static str {
        match (&self.ended_at, &self.error) {
            (Some(_), None) => "done",
            (Some(_), Some(_)) => "failed",
            (None, _) => "-",
        }
    }
}

/// The most of an action's error the trail keeps, in bytes.
const ERROR_LIMIT: usize = 2000;

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

    /// Adds what one batch changed, in the batch's transaction: its count (and `removed`
    /// appended to the row's `removed` array; no action of this version passes any: a
    /// discard's events go to `postal.operator_audit_events`).
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

impl Recording {
    /// Ends the action's row with its outcome: when it ended and, for a failure, the error's
    /// one line (after the counts its committed batches added), then gives the outcome back.
    /// Written in a statement of its own: a failure to write it (the database gone, which is
    /// often why the action failed) is logged and does not replace the action's outcome.
    pub async fn end<T, E: std::fmt::Display>(
        &self,
        pool: &PgPool,
        outcome: Result<T, E>,
    ) -> Result<T, E> {
        let error = outcome.as_ref().err().map(|e| {
            postal_shared::text::storable(&postal_shared::text::bounded(
                &e.to_string(),
                ERROR_LIMIT,
            ))
            .into_owned()
        });
        let ended = sqlx::query(
            "UPDATE postal.operator_audit SET ended_at = now(), error = $2 WHERE id = $1",
        )
        .bind(self.id)
        .bind(&error)
        .execute(pool)
        .await;
        if let Err(e) = ended {
            tracing::warn!(
                audit_id = self.id,
                error = %postal_shared::text::field(&e.to_string()),
                "could not record how the operator action ended"
            );
        }
        outcome
    }
}

/// Opens the row of an action that counts what it changed only as it goes, in transactions
/// of its own (`postal cleanup`'s retention): `matched` is left null, `affected` 0; each of
/// its batches adds its count to the row in the batch's transaction
/// (`postal_shared::cleanup::delete_in_batches_recorded`, by [`Recording::id`]).
pub async fn open_uncounted(
    pool: &PgPool,
    by: &Operator,
    action: &str,
    target: &serde_json::Value,
) -> Result<Recording, Error> {
    tracing::info!(
        actor = %postal_shared::text::field(&by.name),
        via = by.via,
        action,
        target = %postal_shared::text::field(&target.to_string()),
        "operator action"
    );
    let id = sqlx::query_scalar(
        "INSERT INTO postal.operator_audit (actor, via, db_role, action, target, affected)
         VALUES ($1, $2, current_user, $3, $4, 0) RETURNING id",
    )
    .bind(&by.name)
    .bind(by.via)
    .bind(action)
    .bind(target)
    .fetch_one(pool)
    .await?;
    Ok(Recording {
        id,
        actor: by.name.clone(),
    })
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
        "INSERT INTO postal.operator_audit
                (actor, via, db_role, action, target, matched, affected, ended_at)
         VALUES ($1, $2, current_user, $3, $4, $5, $6, now()) RETURNING id",
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

const COLUMNS: &str =
    "id, at, actor, via, db_role, action, target, matched, affected, ended_at, error";

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

/// The outbox `seq`s of the events a discard kept in `postal.operator_audit_events`, in order
/// (empty for other actions, and for discards recorded before migration 30, whose events are
/// in [`get`]'s `removed`).
pub async fn removed_seqs(pool: &PgPool, id: i64) -> Result<Vec<i64>, Error> {
    Ok(sqlx::query_scalar(
        "SELECT seq FROM postal.operator_audit_events WHERE audit_id = $1 ORDER BY seq",
    )
    .bind(id)
    .fetch_all(pool)
    .await?)
}

/// One event a discard kept, whole (read one at a time: an event can be large).
pub async fn removed_event(
    pool: &PgPool,
    id: i64,
    seq: i64,
) -> Result<Option<crate::parked::Discarded>, Error> {
    let row = sqlx::query(
        "SELECT event_id, topic, event_key, event_type, schema_version,
                least(greatest(occurred_at, '0001-01-01 00:00:00+00'), '262000-01-01') AS occurred_at,
                content_type, headers, attempts, last_error, payload,
                NULL::text AS payload_base64
         FROM postal.operator_audit_events WHERE audit_id = $1 AND seq = $2",
    )
    .bind(id)
    .bind(seq)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    use sqlx::{FromRow as _, Row as _};
    let mut d = crate::parked::Discarded::from_row(&row)?;
    let payload: Vec<u8> = row.try_get("payload")?;
    drop(row);
    // As text when it is UTF-8 without NUL (as a discard printed and kept it before
    // migration 30); else in base64, encoded by the database (read only then).
    match String::from_utf8(payload) {
        Ok(text) if !text.contains('\0') => d.payload = Some(text),
        _ => {
            d.payload_base64 = sqlx::query_scalar(
                "SELECT translate(encode(payload, 'base64'), chr(10), '')
                 FROM postal.operator_audit_events WHERE audit_id = $1 AND seq = $2",
            )
            .bind(id)
            .bind(seq)
            .fetch_optional(pool)
            .await?;
        }
    }
    Ok(Some(d))
}
