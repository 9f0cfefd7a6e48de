//! How Kafka errors are treated: retried, waited out, parked, or a reason to replace the
//! producer.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::transport::FailureKind;

/// Whether a client's global error only says that the broker cannot be reached now.
pub(super) fn unreachable(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::Resolve
        )
    )
}

/// Errors after which the producer is replaced by a fresh one at once:
/// librdkafka's fatal (idempotence) errors, a broker's unknown server error, and delivery
/// timeouts. After a timeout librdkafka would bump the epoch of its existing producer id; a
/// broker that restarted meanwhile may no longer know that id (some brokers fail such requests), while
/// a fresh producer simply asks for a new id.
pub(super) fn needs_reset(err: &KafkaError) -> bool {
    matches!(
        err.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::Fatal
                | RDKafkaErrorCode::Unknown
                | RDKafkaErrorCode::UnknownProducerId
                | RDKafkaErrorCode::MessageTimedOut
        )
    )
}

/// Maps a Kafka error to how the relay treats it.
pub fn classify(err: &KafkaError) -> FailureKind {
    match err.rdkafka_error_code() {
        Some(code) => classify_code(code),
        None => FailureKind::Transient,
    }
}

pub(super) fn classify_code(code: RDKafkaErrorCode) -> FailureKind {
    use RDKafkaErrorCode::*;
    match code {
        MessageSizeTooLarge
        | InvalidMessageSize
        | InvalidMessage
        | InvalidTopic
        | InvalidRecord
        | UnsupportedForMessageFormat => FailureKind::Permanent,
        MessageTimedOut
        | BrokerTransportFailure
        | AllBrokersDown
        | Resolve
        | NetworkException
        | RequestTimedOut
        | LeaderNotAvailable
        | NotLeaderForPartition
        | NotEnoughReplicas
        | NotEnoughReplicasAfterAppend
        | BrokerNotAvailable
        | ReplicaNotAvailable
        | NotCoordinator
        | CoordinatorNotAvailable
        | UnknownTopicOrPartition
        | UnknownLeaderEpoch
        | FencedLeaderEpoch
        | OperationTimedOut
        | TimedOutQueue
        | QueueFull
        | KafkaStorageError
        | ThrottlingQuotaExceeded => FailureKind::Unavailable,
        // An ACL revoked after the topic was found: the topic is looked up again (see
        // `send`), and its events wait until the ACL is back.
        TopicAuthorizationFailed => FailureKind::Waiting,
        // The producer stopped for good (an idempotence failure, or no principal allowed to
        // write at all: "Cluster authorization failed") and is replaced: not the event's
        // fault, so no attempt is used, and the relay pauses as for an outage meanwhile.
        Fatal | ClusterAuthorizationFailed => FailureKind::Unavailable,
        // Purged by the relay itself: the producer the record went through was replaced
        // (after another record's failure) or shut down. Not the record's fault, nor a sign
        // that the broker is down: released for the next claim like a held-back record.
        PurgeQueue | PurgeInflight => FailureKind::HeldBack,
        _ => FailureKind::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records purged because the relay replaced or closed its producer neither count as a
    /// failed attempt of theirs (they would be parked after enough producer resets) nor pause
    /// the relay; records the broker rejects for what they are are permanent.
    #[test]
    fn purged_records_are_held_back_rejected_ones_permanent() {
        use RDKafkaErrorCode::*;
        for code in [PurgeQueue, PurgeInflight] {
            assert_eq!(classify_code(code), FailureKind::HeldBack, "{code:?}");
        }
        for code in [MessageTimedOut, AllBrokersDown] {
            assert_eq!(classify_code(code), FailureKind::Unavailable, "{code:?}");
        }
        for code in [MessageSizeTooLarge, InvalidRecord] {
            assert_eq!(classify_code(code), FailureKind::Permanent, "{code:?}");
        }
        assert_eq!(classify_code(Unknown), FailureKind::Transient);
    }
}
