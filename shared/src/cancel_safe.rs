//! Pool work that stays correct when the future doing it is dropped (a task aborted at a
//! shutdown deadline, a `select!` that took another branch, a killed in-process runtime).
//!
//! sqlx 0.8.6 and 0.9.0 leave a pooled PostgreSQL connection inside a transaction when a
//! `begin()` is cancelled after `BEGIN` was sent but before its reply was read: the
//! transaction depth is raised only after the reply, so the drop guard queues no `ROLLBACK`,
//! and the pool's health check on return does not look at the transaction status
//! (transact-rs/sqlx#4393). The next borrower of that connection — possibly the application
//! itself, whose pool Postal shares — then runs inside the stale transaction and keeps its
//! locks. Likewise a session advisory lock taken on a pooled connection outlives a cancelled
//! job that meant to release it.
//!
//! Upstream fixed the `begin()` case in transact-rs/sqlx#4394, not yet in a release as of
//! sqlx 0.9.0; once Postal's sqlx includes it, [`begin`] can become `pool.begin()` again.

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

/// `pool.begin()`, but finished even if the caller's future is dropped meanwhile: the
/// `BEGIN` round trip runs in a task of its own, so a cancelled caller leaves a transaction
/// that is then dropped whole (and rolled back) instead of a connection stuck inside one.
pub async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    begin_with(pool, "BEGIN".into()).await
}

/// [`begin`] with a custom opening statement (`BEGIN` followed by `SET LOCAL`s, sent as one
/// simple query).
pub async fn begin_with(
    pool: &PgPool,
    statement: String,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    use tracing::Instrument as _;
    let pool = pool.clone();
    match tokio::spawn(async move { pool.begin_with(statement).await }.in_current_span()).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(sqlx::Error::PoolClosed),
    }
}

/// A pooled connection that is closed rather than returned to the pool unless [`finish`] was
/// called: for session state (an advisory lock) that must not outlive a cancelled job.
///
/// [`finish`]: CloseUnlessFinished::finish
pub struct CloseUnlessFinished {
    conn: PoolConnection<Postgres>,
    finished: bool,
}

impl CloseUnlessFinished {
    /// Wraps a connection just acquired from the pool.
    pub fn new(conn: PoolConnection<Postgres>) -> Self {
        CloseUnlessFinished {
            conn,
            finished: false,
        }
    }

    /// The session state is cleaned up: the connection may go back to the pool.
    pub fn finish(mut self) {
        self.finished = true;
    }
}

impl std::ops::Deref for CloseUnlessFinished {
    type Target = PgConnection;
    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}

impl std::ops::DerefMut for CloseUnlessFinished {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.conn
    }
}

impl Drop for CloseUnlessFinished {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.close_on_drop();
        }
    }
}
