/// Errors of the consumer half.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A database call failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}
