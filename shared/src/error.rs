/// Errors of the shared vocabulary: invalid values and migration failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A value did not satisfy the rules of its type (empty topic, oversized key, …).
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// Which kind of value was rejected.
        what: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// Applying Postal's migrations failed.
    #[error("postal migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A database call failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

impl Error {
    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::Invalid {
            what,
            reason: reason.into(),
        }
    }
}
