//! Why a record became a dead letter: the vocabulary the decoder (`record`) and the
//! dead-letter writer (`dead_letter`) share.

/// Why a record became a dead letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The handler returned [`crate::HandlerError::Permanent`].
    Permanent,
    /// The payload (or a header) could not be decoded.
    Undecodable,
    /// The record has no valid `ce_id` header, so it cannot be deduplicated.
    MissingEventId,
    /// No handler is registered for the record's topic, type and version.
    UnknownType,
    /// The handler panicked.
    Panic,
    /// Retryable failures used up `max_attempts`.
    RetriesExhausted,
    /// Held (its key held) when `postal consumer reset` reset its topic's replaced log: an
    /// event of the old log, never applied.
    LogReplaced,
}

impl Reason {
    /// The name stored in `postal.dead_letters.reason` and the `postal_dlq_reason` header.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::Permanent => "permanent",
            Reason::Undecodable => "undecodable",
            Reason::MissingEventId => "missing_event_id",
            Reason::UnknownType => "unknown_type",
            Reason::Panic => "panic",
            Reason::RetriesExhausted => "retries_exhausted",
            Reason::LogReplaced => "log_replaced",
        }
    }
}
