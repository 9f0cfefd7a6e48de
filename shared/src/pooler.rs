//! Connection poolers (PgBouncer): which pooling a connection goes through, found out at start.
//!
//! Every part of Postal but the application's `enqueue` needs a session of its own: the relay
//! (session advisory locks, `LISTEN`, prepared statements), the consumer, the `postal` command
//! and the dashboard (prepared statements) and `postal migrate` (a session `search_path` and an
//! advisory lock). Through a pooler in transaction (or statement) mode each of those would
//! fail later in ways that look like an outage; [`require_session`] finds it out at start, so
//! that they stop with one line instead (docs/operations.md, "Poolers").

use std::time::Duration;

use sqlx::{Connection, Executor, PgConnection, PgPool};

use crate::Error;

/// How long the probe may wait, in all, for the pooler to give its two connections a server
/// connection each. A transaction pooler whose application holds every server connection in
/// transactions of a few seconds (a batch job at peak) makes them wait as long; giving up
/// sooner passed such a pooler as "unknown", and the relay then died on "prepared statement
/// sqlx_s_1 does not exist" (`production_topology::a_relay_started_through_a_busy_transaction_pooler_is_still_refused`).
const SERVER_WAIT: Duration = Duration::from_secs(30);

/// How long `a`'s second statement may wait while `b` holds a transaction: a session never
/// waits here (it keeps its server), so a wait this long means `a` lost its server.
const PROBE_WAIT: Duration = Duration::from_secs(3);

/// Probe rounds: under other clients' load a transaction pooler can hand a connection its own
/// server back by chance; one round that shows a change is proof.
const ROUNDS: usize = 3;

/// What [`session_probe`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Pooling {
    /// Each client connection keeps one server session: a direct connection or a
    /// session-mode pooler.
    Session,
    /// The server session behind one client connection changes between transactions (a
    /// transaction- or statement-mode pooler).
    Transaction,
    /// The probe could not tell (the pooler had no server connection free for it in time).
    Unknown,
}

/// The backend pid behind `conn` (simple query protocol: no prepared statement, which a
/// transaction pooler would lose).
async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    use sqlx::Row as _;
    let row = conn.fetch_one("SELECT pg_backend_pid()").await?;
    row.try_get(0)
}

/// Finds out whether connections of `pool` keep their server session between transactions.
///
/// Two connections of their own: `a` reads its backend pid `p`; `b` opens a transaction and
/// reads its pid `q`; `a` reads its pid again while `b` holds its transaction. On a session
/// (direct, or a session pooler) `a` is always `p` and `q` is another backend. A transaction
/// pooler hands `p`, free since `a`'s statement ended, to `b` (PgBouncer reuses the most
/// recently freed server first), or gives `a` another server, or makes `a` wait for one.
pub async fn session_probe(pool: &PgPool) -> Result<Pooling, sqlx::Error> {
    let options = pool.connect_options();
    let mut a = PgConnection::connect_with(&options).await?;
    let mut b = PgConnection::connect_with(&options).await?;
    let mut found = Pooling::Session;
    let deadline = tokio::time::Instant::now() + SERVER_WAIT;
    for _ in 0..ROUNDS {
        let Ok(p) = tokio::time::timeout_at(deadline, backend_pid(&mut a)).await else {
            found = Pooling::Unknown;
            break;
        };
        let p = p?;
        let Ok(begun) = tokio::time::timeout_at(deadline, b.execute("BEGIN")).await else {
            found = Pooling::Unknown;
            break;
        };
        begun?;
        let q = backend_pid(&mut b).await?;
        // `a` waits for a server only when it lost its own: a transaction pooler.
        let r = tokio::time::timeout(PROBE_WAIT, backend_pid(&mut a)).await;
        b.execute("ROLLBACK").await?;
        let moved = match r {
            Err(_) => true,
            Ok(r) => q == p || r? != p,
        };
        if moved {
            found = Pooling::Transaction;
            break;
        }
    }
    // A connection left waiting is dropped (closed without a goodbye); the others close.
    if found == Pooling::Session {
        a.close().await.ok();
    }
    b.close().await.ok();
    Ok(found)
}

/// As [`require_session`], for a one-shot command that sets session state (`postal migrate`):
/// an unknown answer is refused too ([`Error::PoolingUnknown`]). Run through a transaction
/// pooler the probe could not see, migrate's `search_path` and `lock_timeout` stayed on a server
/// session the application's next transactions got
/// (`production_topology::migrate_through_a_transaction_pooler_busy_longer_than_the_probe_waits`).
pub async fn require_known_session(pool: &PgPool) -> Result<(), Error> {
    match session_probe(pool).await? {
        Pooling::Transaction => Err(Error::TransactionPooling),
        Pooling::Session => Ok(()),
        Pooling::Unknown => Err(Error::PoolingUnknown(SERVER_WAIT)),
    }
}

/// Refuses, with [`Error::TransactionPooling`], a `pool` whose connections do not keep their
/// server session (see [`session_probe`]). An unknown answer passes: a pooler with no server
/// connection free shows later as waiting claims, which the relay reports.
pub async fn require_session(pool: &PgPool) -> Result<(), Error> {
    match session_probe(pool).await? {
        Pooling::Transaction => Err(Error::TransactionPooling),
        Pooling::Session => Ok(()),
        Pooling::Unknown => {
            tracing::warn!("could not tell whether the database connection goes through a transaction pooler: no server connection answered within {SERVER_WAIT:?}");
            Ok(())
        }
    }
}
