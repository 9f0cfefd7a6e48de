/// Errors of the producer half.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A topic, key, type or other envelope value was invalid.
    #[error(transparent)]
    Invalid(#[from] postal_shared::Error),
    /// The payload could not be serialised as JSON.
    #[error("payload is not serialisable as JSON: {0}")]
    Serialize(serde_json::Error),
    /// The payload exceeds what `enqueue` accepts.
    #[error("payload of {size} bytes exceeds the maximum of {max} bytes")]
    PayloadTooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// A user header used a name Postal reserves for itself.
    #[error("header name {0:?} is reserved by Postal or empty")]
    ReservedHeader(String),
    /// An event with this id is already in the outbox.
    #[error("an event with this id is already in the outbox")]
    DuplicateEventId,
    /// The relay or transport configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A claim was not completed because the relay no longer owns some of its key partitions
    /// (the fence between a claim and the next owner of its partitions): its transaction rolled back, and its rows are handed out
    /// again.
    #[error("the claim's key partitions {partitions:?} are no longer this relay's; its completion was rolled back")]
    LeaseLost {
        /// The claim's partitions that another relay (or nobody) owns now.
        partitions: Vec<i16>,
    },
    /// The WAL source's replication stream failed or sent what the relay cannot read.
    #[error("WAL source: {0}")]
    Wal(String),
    /// A database call failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The Kafka client could not be created.
    #[error("kafka client error: {0}")]
    Kafka(rdkafka::error::KafkaError),
}

impl From<rdkafka::error::KafkaError> for Error {
    /// Without the value of a configuration property (it may be a secret).
    fn from(e: rdkafka::error::KafkaError) -> Self {
        Error::Kafka(postal_shared::secret::kafka_error_without_value(e))
    }
}

impl Error {
    pub(crate) fn from_insert(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e {
            if db.constraint() == Some("outbox_event_id_unique") {
                return Error::DuplicateEventId;
            }
        }
        Error::Database(e)
    }
}
