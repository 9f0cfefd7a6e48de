/// Errors of the consumer half.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A database call failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The Kafka client refused its configuration or failed.
    #[error("kafka error: {0}")]
    Kafka(rdkafka::error::KafkaError),
    /// The consumer's configuration is invalid.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// Postal's schema is missing or out of date.
    #[error(transparent)]
    Schema(#[from] postal_shared::Error),
}

impl From<rdkafka::error::KafkaError> for Error {
    /// Without the value of a configuration property (it may be a secret).
    fn from(e: rdkafka::error::KafkaError) -> Self {
        Error::Kafka(postal_shared::secret::kafka_error_without_value(e))
    }
}
