//! A handler body that ends the transaction it was given.
//!
//! A handler runs in the runtime's transaction. If its SQL ends it — a script written for
//! `psql` with its own `BEGIN; …; COMMIT;`, a `ROLLBACK` meant for its savepoint, `COMMIT AND
//! CHAIN` — PostgreSQL commits or rolls back everything the transaction held so far, and the
//! statements after it run in autocommit; sqlx does not notice (the runtime's `COMMIT` then
//! only warns). One record per transaction the damage stays on the handler's own event. In
//! throughput mode the transaction also holds other events' dedup rows and effects: a
//! script's `COMMIT` and then a transient failure left the rest of the batch counted as
//! duplicates, never applied; a `ROLLBACK` in the last body rolled back the earlier events and
//! the offset still moved past them (`batch_sixth_attack::`).
//!
//! So a batch transaction is sealed: every dedup row it writes queues a deferred check
//! (migration 0040) that refuses any `COMMIT` but the runtime's own, which seals the
//! transaction in the statement that checks it is still the batch's (`pg_current_xact_id_if_assigned()`
//! against the id read with the batch's rows). A body's `COMMIT` (or `COMMIT AND CHAIN`) fails,
//! and nothing of the batch is kept. After that, or a `ROLLBACK`, the session is out of any
//! transaction and read-only by default ([`super::session`]): the writes of the bodies after
//! it fail instead of committing one by one. The runtime checks the transaction before each of
//! its own writes (a hold, a dead letter, the offset) when a body ran since the last check, and,
//! in the isolating pass, after each body; an end found in the first pass runs the batch again
//! isolated, where the body is named. Nothing of the transaction stands: the next transaction
//! takes the records before the body alone; then the body's record, alone at the head, counts
//! an attempt each time (dead-lettered or held after `max_attempts`, saying why), as any handler
//! failure.
//!
//! Not covered: a body that opens a transaction of its own after ending the batch's (`ROLLBACK
//! AND CHAIN`, whose new transaction copies the batch's `READ WRITE`, or `BEGIN READ WRITE`)
//! and commits it, or whose later body does: those writes are its own, outside the batch, as
//! writes through another connection would be (`lazy_dedup_attack::a_held_head_is_applied_on_release_after_a_later_bodys_commit`).
//!
//! Should a `COMMIT` get through all the same (the check dropped by hand), the settle below
//! keeps what it committed: the dedup rows of the records before the body and of the body's
//! own events stay, the batch's other rows are deleted, and the offset moves past the records
//! done before the body.

use std::collections::HashSet;

use postal_shared::EventId;
use sqlx::{Connection, PgConnection};

use super::Committed;
use crate::offsets::Ownership;
use crate::partition::BodyFailure;
use crate::partition::{Attempt, Worker};

/// Whether a body ended the batch's transaction: the session's transaction is no longer `xid`
/// (the batch's; `None`: no dedup row was new, so no body runs). If so, also ends whatever the
/// body left open (a transaction it began after ending the batch's: its writes are not the
/// batch's to keep; in autocommit a warning only). `Err`: the check found the session gone
/// (ended for idling, 25P03, or unreachable): the caller tells the attempt's failure from it,
/// as from the statement that would have met it. A transaction a failed statement aborted is
/// still the batch's (the check fails with 25P02), as is any other failure of the check: the
/// runtime's next statement meets it and handles it as before.
pub(super) async fn body_ended(
    conn: &mut PgConnection,
    xid: Option<&str>,
) -> Result<bool, sqlx::Error> {
    check(conn, xid).await
}

/// What the check before the runtime's last writes found ([`sealed_or_ended`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Sealed {
    /// The transaction is the batch's, sealed for the runtime's `COMMIT`.
    Ours,
    /// A body ended it (rolled back here, as [`body_ended`] does).
    Ended,
    /// It is the batch's, but the seal refused in it meanwhile (a body's `SET CONSTRAINTS ALL
    /// IMMEDIATE`, whatever the body made of the error: wrapped it, or caught it in a
    /// savepoint of its own and went on): the body may have taken a branch it would not take
    /// one record per transaction. Not committed: the batch runs again unsealed.
    RefusedEarly,
}

/// [`body_ended`], sealing the transaction for the runtime's `COMMIT` in the same statement
/// ([`crate::dedup::seal`]), which also reads the seal's refusals in the session (against
/// `refusals`, the count when the batch's session was opened): the check before the
/// runtime's last writes.
pub(super) async fn sealed_or_ended(
    conn: &mut PgConnection,
    xid: Option<&str>,
    refusals: i64,
) -> Result<Sealed, sqlx::Error> {
    let Some(xid) = xid else {
        return Ok(Sealed::Ours);
    };
    match crate::dedup::seal(&mut *conn).await {
        Ok((now, count)) if now.as_deref() == Some(xid) => {
            return Ok(if count == refusals {
                Sealed::Ours
            } else {
                Sealed::RefusedEarly
            });
        }
        Ok(_) => {}
        Err(e) if super::failure::gone(&e) => return Err(e),
        Err(_) => return Ok(Sealed::Ours),
    }
    roll_back_ended(conn).await;
    Ok(Sealed::Ended)
}

async fn check(conn: &mut PgConnection, xid: Option<&str>) -> Result<bool, sqlx::Error> {
    let Some(xid) = xid else { return Ok(false) };
    match crate::dedup::current_xid(&mut *conn).await {
        Ok(now) if now.as_deref() == Some(xid) => return Ok(false),
        Ok(_) => {}
        Err(e) if super::failure::gone(&e) => return Err(e),
        Err(_) => return Ok(false),
    }
    roll_back_ended(conn).await;
    Ok(true)
}

/// Ends whatever a body left open after ending the batch's transaction.
async fn roll_back_ended(conn: &mut PgConnection) {
    if let Err(e) = sqlx::query("ROLLBACK").execute(conn).await {
        tracing::debug!(error = %e, "rolling back after a handler ended its transaction");
    }
}

/// Where a body ended the batch's transaction.
pub(super) struct EndedAt {
    /// How many records of the queue come before the body's.
    pub before: usize,
    /// The events the body ran for, with those a batch handler's earlier calls of this
    /// transaction applied (a `COMMIT` kept them).
    pub ids: Vec<EventId>,
    /// Whether the body ran for one record.
    pub alone: bool,
    pub handler: String,
    /// The batch transaction's id (`pg_current_xact_id()`).
    pub xid: String,
    /// The offset after the records before the body (`None`: there are none).
    pub next_offset: Option<i64>,
    /// The body failed with the seal's refusal of its `COMMIT` ([`refused`]).
    pub refused: bool,
}

/// The text of the seal's refusal (migration 0040), as the body's error carries it.
const REFUSAL: &str = "a handler committed the transaction it was given";

/// Logs that `handler`'s body (`None`: a body of the batch, which one not known: it went on
/// after the refusal) set the batch's seal off before the commit, its transaction still the
/// batch's: `SET CONSTRAINTS ALL IMMEDIATE` runs every deferred check queued so far, the
/// seal's too. Nothing of the transaction is committed; the rest of the poll batch runs one
/// record per transaction, unsealed, as with `max_batch` 1.
pub(super) fn warn_early(topic: &str, partition: i32, handler: Option<&str>) {
    let who = match handler {
        Some(h) => format!("handler {}", postal_shared::text::quoted(h)),
        None => "a handler of the batch".to_string(),
    };
    tracing::warn!(%topic, partition, handler = handler.unwrap_or(""), "{who} set off the batch's commit check before the commit (SET CONSTRAINTS ALL IMMEDIATE in its SQL?): the batch runs again one record per transaction; name the handler's own constraints in SET CONSTRAINTS to keep throughput mode");
}

/// Whether a body's result is the seal's refusal of its `COMMIT` (a body that swallowed the
/// error cannot be told from one that ran `ROLLBACK`).
pub(super) fn refused(r: &Result<(), BodyFailure>) -> bool {
    matches!(r, Err(f) if f.error().contains(REFUSAL))
}

/// Whether a failed body (`r`, rolled back to its savepoint, in a transaction still the
/// batch's) set the seal off before the commit, whatever its error says: the seal counts its
/// refusals in the session (migration 0041; `refusals`: the count when the batch's session was
/// opened), and a handler that wraps its database errors (`anyhow`'s `.context`, an error
/// type of its own) hides the seal's message ([`refused`]). Asked only after a failed body:
/// no statement per event.
pub(super) async fn set_off_early(
    tx: &mut PgConnection,
    refusals: i64,
    r: &Result<(), BodyFailure>,
) -> Result<bool, Attempt> {
    if r.is_ok() {
        return Ok(false);
    }
    let now = crate::dedup::seal_refusals(tx).await.map_err(Attempt::db)?;
    Ok(now != refusals)
}

/// What the caller does after a body's `ROLLBACK`: nothing of the transaction stands.
pub(super) struct RolledBack {
    pub before: usize,
    pub alone: bool,
    pub error: String,
}

impl Worker {
    /// Settles a batch whose transaction a body ended (see the module's text), in a new
    /// transaction. `c` and `finished` are what the batch had done before the body (`c.done`
    /// records, all before it). The caller has dropped the batch's transaction; the settle's
    /// runs on the same session (`begin`: the batch's `BEGIN`), not a second connection of the
    /// pool.
    #[allow(clippy::too_many_arguments)] // the batch's state, handed over
    pub(super) async fn settle_ended(
        &self,
        conn: &mut PgConnection,
        begin: &str,
        own: &Ownership,
        fresh: &HashSet<EventId>,
        mut finished: HashSet<EventId>,
        mut c: Committed,
        at: EndedAt,
    ) -> Result<Committed, Attempt> {
        let config = &self.shared.config;
        // The batch's dropped transaction (and savepoint) queued their rollbacks; sqlx answers
        // the next statement with their error (`ROLLBACK TO SAVEPOINT` outside a transaction,
        // once a body ended it): read them off first (a dead session fails the begin below).
        for _ in 0..3 {
            if conn.ping().await.is_ok() {
                break;
            }
        }
        let mut rtx = conn
            .begin_with(self.shared.batch_begin_statement(begin, &self.topic, false))
            .await
            .map_err(Attempt::db)?;
        let ids: Vec<uuid::Uuid> = fresh.iter().map(EventId::as_uuid).collect();
        // The rows the batch's own transaction wrote (`xmin`): a new owner's rows of the same
        // events (a takeover meanwhile) are neither counted nor deleted.
        let kept: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM postal.processed_events
             WHERE consumer_name = $1 AND event_id = ANY($2) AND xmin = $3::xid8::xid",
        )
        .bind(&config.consumer)
        .bind(&ids)
        .bind(&at.xid)
        .fetch_one(&mut *rtx)
        .await
        .map_err(Attempt::db)?;
        if kept == 0 {
            let handler = postal_shared::text::quoted(&at.handler);
            let error = if at.refused {
                format!("handler {handler} ended the transaction it was given with a COMMIT, which was refused (only the consumer commits it): remove COMMIT and BEGIN from its SQL")
            } else {
                format!("handler {handler} ended the transaction it was given (a ROLLBACK or COMMIT in its SQL?); use a savepoint (`tx.begin()`) to undo part of a handler's work")
            };
            tracing::warn!(topic = %self.topic, partition = self.partition, handler = %at.handler, "{error}: the batch's work was rolled back with it; running it again");
            return Ok(Committed {
                rolled_back: Some(RolledBack {
                    before: at.before,
                    alone: at.alone,
                    error,
                }),
                ..Committed::default()
            });
        }
        finished.extend(at.ids);
        // The body's commit took the batch's dedup rows with it, outside the epoch's fence:
        // those of events not applied are deleted even if the partition was taken over or
        // paused meanwhile (a new owner would count them duplicates and never apply them).
        let unfinished: Vec<uuid::Uuid> =
            fresh.difference(&finished).map(EventId::as_uuid).collect();
        sqlx::query(
            "DELETE FROM postal.processed_events
             WHERE consumer_name = $1 AND event_id = ANY($2) AND xmin = $3::xid8::xid",
        )
        .bind(&config.consumer)
        .bind(&unfinished)
        .bind(&at.xid)
        .execute(&mut *rtx)
        .await
        .map_err(Attempt::db)?;
        let mut refused = None;
        if let Some(next) = at.next_offset {
            refused = self.advance(&mut rtx, own, next).await?.err();
        }
        rtx.commit().await.map_err(Attempt::db)?;
        self.now_held(c.held_keys.iter().cloned());
        if let Some(refused) = refused {
            return Err(refused);
        }
        tracing::warn!(topic = %self.topic, partition = self.partition, handler = %at.handler, "handler {} committed the transaction it was given (a COMMIT in its SQL?): the batch's first {} records (its own events among them) were committed with it, the rest of the batch runs again", postal_shared::text::quoted(&at.handler), c.done);
        c.stopped = None;
        Ok(c)
    }
}
