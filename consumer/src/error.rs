/// Errors of the consumer half.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A database call failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The Kafka client refused its configuration or failed.
    #[error("kafka error: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// The consumer's configuration is invalid.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// Postal's schema is missing or out of date.
    #[error(transparent)]
    Schema(#[from] postal_shared::Error),
}
