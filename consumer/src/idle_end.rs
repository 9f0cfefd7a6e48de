//! A session the server ended because its transaction sat idle.
//!
//! A DBA's `idle_in_transaction_session_timeout` ends a session whose transaction waits longer
//! than it between two statements: SQLSTATE `25P03`, sent before the server closes the
//! connection, so the first statement after the wait fails with it (the ones after that with
//! an I/O error). The wait is the transaction's own doing — a handler waiting outside the
//! database inside its transaction — not an outage: it is told apart from one (which is never
//! an attempt) by this code, never by timing.

use std::error::Error as StdError;

/// SQLSTATE `idle_in_transaction_session_timeout`.
const IDLE_IN_TRANSACTION_TIMEOUT: &str = "25P03";

/// What PgBouncer says (with SQLSTATE `08P01`) when its own `idle_transaction_timeout` ends a
/// client's transaction.
const PGBOUNCER_IDLE_TRANSACTION: &str = "idle transaction timeout";

/// What PgBouncer says (with SQLSTATE `08P01`) when its `query_timeout` closes a client's
/// connection because one statement ran longer than it: the statement's own doing, as a
/// server's `statement_timeout` (`57014`, an attempt) is. Read as an outage, a record whose
/// statement is that slow every time was waited on for good (`batch_sixth_attack::`: 12 tries
/// in 35 s, no attempt, the partition stuck).
const PGBOUNCER_QUERY_TIMEOUT: &str = "query timeout";

/// Whether `e` is the server ending the session by the transaction's own doing: sitting idle
/// in a transaction (PostgreSQL's `idle_in_transaction_session_timeout`, or PgBouncer's
/// `idle_transaction_timeout` in front of it), or a statement longer than PgBouncer's
/// `query_timeout` (PgBouncer's two with class `08` codes, which would otherwise make them
/// outages).
pub(crate) fn ended_idle(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    match db.code().as_deref() {
        Some(IDLE_IN_TRANSACTION_TIMEOUT) => true,
        Some("08P01") => matches!(
            db.message(),
            PGBOUNCER_IDLE_TRANSACTION | PGBOUNCER_QUERY_TIMEOUT
        ),
        _ => false,
    }
}

/// Whether `e` or an error it wraps (its `source` chain: a handler's own error type around a
/// `sqlx::Error`) is [`ended_idle`].
pub(crate) fn ended_idle_within(e: &(dyn StdError + 'static)) -> bool {
    any_within(e, ended_idle)
}

/// Whether `e` or an error it wraps is the database being unreachable or ending the session
/// for a reason of its own (`postal_shared::database_unavailable`: a terminated backend
/// `57P01`, a restart, an I/O error) and not for idling: an outage, whatever a handler that
/// returned it called it.
pub(crate) fn outage_within(e: &(dyn StdError + 'static)) -> bool {
    any_within(e, |e| {
        postal_shared::database_unavailable(e) && !ended_idle(e)
    })
}

/// Whether a `sqlx::Error` in `e`'s `source` chain satisfies `test`.
fn any_within(e: &(dyn StdError + 'static), test: impl Fn(&sqlx::Error) -> bool) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.downcast_ref::<sqlx::Error>().is_some_and(&test) {
            return true;
        }
        next = e.source();
    }
    false
}

/// The error a transaction ended for idling is retried with: what happened and what to look at.
pub(crate) fn explain(e: &str) -> String {
    format!(
        "the server ended the transaction's session: it sat idle longer than the database's idle_in_transaction_session_timeout or a pooler's idle_transaction_timeout (a handler waiting outside the database inside its transaction?), or a statement ran longer than a pooler's query_timeout: {e}"
    )
}

/// [`explain`] for a failure whose error was `error` when a later statement (the probe, a
/// rollback) read the server's end of the session, `e`: both texts.
pub(crate) fn explain_after(error: &str, e: &sqlx::Error) -> String {
    explain(&format!("{error}; then: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Wrapper(sqlx::Error);
    impl std::fmt::Display for Wrapper {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("lookup failed")
        }
    }
    impl StdError for Wrapper {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    /// A server error with a code, as PostgreSQL sends one.
    #[derive(Debug)]
    struct Server(&'static str, &'static str);
    impl std::fmt::Display for Server {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "server error {}", self.0)
        }
    }
    impl StdError for Server {}
    impl sqlx::error::DatabaseError for Server {
        fn message(&self) -> &str {
            self.1
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn StdError + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn StdError + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    /// 25P03 is an idle end, also inside a handler's own error type.
    #[test]
    fn the_idle_code_is_an_idle_end_also_wrapped() {
        let idle = || sqlx::Error::Database(Box::new(Server("25P03", "terminating")));
        assert!(ended_idle(&idle()));
        assert!(ended_idle_within(&Wrapper(idle())));
        let boxed: Box<dyn StdError + Send + Sync> = Box::new(Wrapper(idle()));
        assert!(ended_idle_within(boxed.as_ref()));
        let pooler = sqlx::Error::Database(Box::new(Server("08P01", "idle transaction timeout")));
        assert!(ended_idle(&pooler));
        // PgBouncer's query_timeout: the statement's own doing too.
        let slow = sqlx::Error::Database(Box::new(Server("08P01", "query timeout")));
        assert!(ended_idle(&slow));
        assert!(!outage_within(&Wrapper(slow)));
    }

    /// Outage-like errors (a terminated backend, 57P01, among them) are never taken for an idle end (they must never count as an
    /// attempt); an error wrapping something else is not one either.
    #[test]
    fn only_the_idle_code_is_an_idle_end() {
        let io = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert!(!ended_idle(&io));
        assert!(!ended_idle_within(&Wrapper(io)));
        assert!(!ended_idle(&sqlx::Error::PoolTimedOut));
        let terminated = sqlx::Error::Database(Box::new(Server("57P01", "terminating")));
        assert!(!ended_idle(&terminated));
        // PgBouncer's other class-08 errors (a server connection lost) stay outages.
        let lost = sqlx::Error::Database(Box::new(Server("08P01", "server conn crashed?")));
        assert!(!ended_idle(&lost));
    }

    /// A terminated backend wrapped in a handler's error is an outage; an idle end (also
    /// PgBouncer's, a class-08 code) and a statement's own error are not.
    #[test]
    fn an_outage_is_read_through_the_chain() {
        let terminated = || sqlx::Error::Database(Box::new(Server("57P01", "terminating")));
        assert!(outage_within(&Wrapper(terminated())));
        let io = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert!(outage_within(&Wrapper(io)));
        let idle = sqlx::Error::Database(Box::new(Server("25P03", "terminating")));
        assert!(!outage_within(&Wrapper(idle)));
        let pooler = sqlx::Error::Database(Box::new(Server("08P01", "idle transaction timeout")));
        assert!(!outage_within(&Wrapper(pooler)));
        let unique = sqlx::Error::Database(Box::new(Server("23505", "duplicate key")));
        assert!(!outage_within(&Wrapper(unique)));
    }
}
