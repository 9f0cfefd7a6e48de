//! The session a batch transaction runs in: read-only outside that transaction.
//!
//! A handler body whose SQL ends the batch's transaction — a `ROLLBACK`, or a `COMMIT` the
//! seal refused (migration 0040, [`super::ended`]) — leaves the session in autocommit: the
//! statements of the bodies after it would each commit on their own, outside the batch, and run
//! again when the batch does. So for the batch's time the session's default is read-only
//! (`default_transaction_read_only`, set before the batch's `BEGIN READ WRITE`, outside it): a
//! write after the transaction's end fails, the body that made it fails, and the runtime finds
//! the end before its own next write (or its commit) and runs the batch again with a savepoint
//! around each body, which names the body that ended it. No statement per event: one before and
//! one after the batch.
//!
//! The setting is the session's, so it is reset before the connection goes back to the pool;
//! a connection whose reset did not happen (a cancelled batch, a session already gone) is closed
//! instead ([`CloseUnlessFinished`]): the application's other users of the pool never see it.

use postal_shared::cancel_safe::CloseUnlessFinished;
use sqlx::{Executor, PgConnection, PgPool};

/// A pooled connection, read-only outside the transaction the batch opens on it.
pub(super) struct Session {
    conn: CloseUnlessFinished,
    /// Whether the session was read-only by default already (a DBA's maintenance window,
    /// `ALTER DATABASE … SET default_transaction_read_only`): the batch then begins as any
    /// transaction would, read-only, and fails as before rather than write through it.
    read_only_before: bool,
    /// The seal's refusals in this session when it was opened
    /// ([`crate::dedup::seal_refusals`]).
    pub(super) refusals: i64,
}

impl Session {
    pub(super) async fn open(pool: &PgPool) -> Result<Self, sqlx::Error> {
        let mut conn = CloseUnlessFinished::new(pool.acquire().await?);
        // The default before, the new one and the seal's refusals so far, in one round trip.
        let (before, refusals): (String, i64) = sqlx::query_as(
            "WITH b AS MATERIALIZED (SELECT current_setting('default_transaction_read_only') AS before)
             SELECT before, postal.batch_seal_refusals() FROM b,
                 LATERAL (SELECT set_config('default_transaction_read_only', 'on', false)
                          WHERE b.before IS NOT NULL) AS s",
        )
        .fetch_one(&mut *conn)
        .await?;
        Ok(Session {
            conn,
            read_only_before: before == "on",
            refusals,
        })
    }

    /// The batch transaction's `BEGIN`: `READ WRITE` unless the session was read-only by
    /// default before the batch set it.
    pub(super) fn begin(&self) -> &'static str {
        if self.read_only_before {
            "BEGIN"
        } else {
            "BEGIN READ WRITE"
        }
    }

    pub(super) fn conn(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// Resets the session (after a transaction left unfinished was rolled back: sqlx sends
    /// that first) and gives the connection back to the pool; closes it if that fails.
    pub(super) async fn close(mut self) {
        let reset = self
            .conn
            .execute("RESET default_transaction_read_only")
            .await;
        if reset.is_ok() {
            self.conn.finish();
        }
    }
}
