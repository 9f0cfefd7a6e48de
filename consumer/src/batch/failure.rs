//! How a body's failure, or a session found gone around it, becomes the attempt's failure; a
//! body's savepoint released or rolled back.

use sqlx::{Postgres, Transaction};

use crate::partition::{Attempt, BodyFailure, Retry};

/// A body failed in the optimistic pass (no savepoints): rolls the transaction back, and says
/// how the attempt failed. A session found gone at the rollback (the server ended it while the
/// body ran) makes the batch halve at once rather than run again with savepoints to meet the
/// same end (measured: each too-large batch ran twice): an outage if the body said so (or
/// said nothing of its own: never), otherwise the transaction's own failure
/// ([`Attempt::SessionEnded`]: the head alone counts it, as one at a time counts the handler's
/// failure; a handler that kept only the text of the server's 25P03 stalled its partition
/// when the rollback's I/O error was taken for an outage, `idle_end_attack::`).
pub(super) async fn abandon(tx: Transaction<'_, Postgres>, f: BodyFailure) -> Attempt {
    match tx.rollback().await {
        Err(e) if gone(&e) => session_gone(f, &e),
        _ => f.into_attempt(),
    }
}

/// Rolls back the savepoint of a body that failed with `f`, and gives `f` back. A rollback
/// that finds the session gone is the attempt's failure, told as [`abandon`] tells it.
pub(super) async fn roll_back(
    sp: Transaction<'_, Postgres>,
    f: BodyFailure,
) -> Result<BodyFailure, Attempt> {
    match sp.rollback().await {
        Ok(()) => Ok(f),
        Err(e) if gone(&e) => Err(session_gone(f, &e)),
        Err(e) => Err(Attempt::db(e)),
    }
}

/// Whether a rollback's error `e` says the session is gone: unreachable, or ended for idling
/// (the rollback is then the first statement to read the server's 25P03).
pub(super) fn gone(e: &sqlx::Error) -> bool {
    crate::idle_end::ended_idle(e) || postal_shared::database_unavailable(e)
}

/// The attempt's failure when the check after a body ([`super::ended::body_ended`]) found the session
/// gone (`e`), read as the runtime's next statement would have read it: the body's failure
/// `r` told with the session's end ([`session_gone`]), or the transaction's own.
pub(super) fn after_gone(r: &Result<(), BodyFailure>, e: sqlx::Error) -> Attempt {
    match r {
        Ok(()) => Attempt::db(e),
        Err(f) => session_gone(f.clone(), &e),
    }
}

/// The attempt's failure when a body failed with `f` and its session is gone (`e`).
fn session_gone(f: BodyFailure, e: &sqlx::Error) -> Attempt {
    match f {
        // The handler said a dependency was unavailable: an outage, also when its wait for it
        // outlasted the idle timeout (as one at a time takes it).
        BodyFailure::Retry(_, Retry::Outage) => {
            Attempt::Unavailable(format!("the session ended while a handler ran: {e}"))
        }
        f if crate::idle_end::ended_idle(e) => {
            Attempt::SessionEnded(crate::idle_end::explain_after(f.error(), e))
        }
        BodyFailure::Retry(error, _) | BodyFailure::Dead(_, error) => Attempt::SessionEnded(error),
    }
}

/// Releases the savepoint of a body that returned `Ok`. A handler that swallowed a database
/// error leaves the transaction aborted and the release fails: that is the body's failure (a
/// retryable one, counted as an attempt and dead-lettered after `max_attempts`), not the
/// database's; the savepoint is rolled back when `sp` is dropped, before the next statement.
pub(super) async fn release(
    sp: Transaction<'_, Postgres>,
) -> Result<Result<(), BodyFailure>, Attempt> {
    match sp.commit().await {
        Ok(()) => Ok(Ok(())),
        Err(e) => match Attempt::db(e) {
            Attempt::Unavailable(e) => Err(Attempt::Unavailable(e)),
            Attempt::SessionEnded(e) => Err(Attempt::SessionEnded(e)),
            Attempt::Retryable(e) | Attempt::Permanent(_, e) => Ok(Err(BodyFailure::Retry(
                format!("the handler returned Ok but its transaction had failed (a database error it did not return?): {e}"),
                Retry::Handler,
            ))),
            Attempt::Fenced => Err(Attempt::Fenced),
            Attempt::Paused => Err(Attempt::Paused),
            Attempt::OverBound(need) => Err(Attempt::OverBound(need)),
        },
    }
}
