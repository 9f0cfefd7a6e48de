//! Telling "the database is unreachable right now" apart from errors about the statement.

/// Whether `e` means PostgreSQL is (for now) unreachable or refusing work — connection lost,
/// server shutting down or starting, too many connections, pool exhausted — as opposed to an
/// error about the statement itself. Callers wait and retry the former without counting it as
/// a failed attempt.
pub fn database_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // The connection broke during the TLS negotiation that `sslmode=prefer` (the default)
        // starts with: a server restarting, a connection cut mid-handshake.
        sqlx::Error::Protocol(m) if m.contains("SSLRequest") => true,
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            code.starts_with("08") || code.starts_with("57P") || code == "53300"
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connection-level failures count as unavailable; statement errors do not.
    #[test]
    fn connection_failures_are_unavailable_statement_errors_are_not() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(database_unavailable(&sqlx::Error::Io(io)));
        assert!(database_unavailable(&sqlx::Error::PoolTimedOut));
        assert!(database_unavailable(&sqlx::Error::Protocol(
            "unexpected response from SSLRequest: 0x00".into()
        )));
        assert!(!database_unavailable(&sqlx::Error::RowNotFound));
        assert!(!database_unavailable(&sqlx::Error::ColumnNotFound(
            "x".into()
        )));
    }
}
