//! The crate's one error type.

/// What an operator action or the dashboard can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database refused or could not be reached.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A filter or id that cannot be used (the message says which and why).
    #[error("{0}")]
    Invalid(String),
    /// The action matches more events than it may act on at once.
    #[error("{matched} events match, more than the cap of {cap} per action: narrow the filter")]
    OverCap {
        /// How many matched.
        matched: usize,
        /// The cap.
        cap: usize,
    },
    /// A pause could not wait for the work in flight it pauses (what and for how long).
    #[error("{0}")]
    StillRunning(String),
    /// Sending to Kafka failed (dead-letter replay).
    #[error("{0}")]
    Kafka(String),
    /// Writing out what an action removed failed (the action stopped before deleting more).
    #[error("writing the discarded events: {0}")]
    Output(#[from] std::io::Error),
    /// The dashboard's address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The dashboard would be reachable from other hosts without a token.
    #[error("refusing to serve the dashboard on {0} without a token: set --token (POSTAL_DASHBOARD_TOKEN), or listen on 127.0.0.1")]
    Unprotected(std::net::SocketAddr),
}
