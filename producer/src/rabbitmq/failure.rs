//! What a lapin error means for the events: unavailable (retried without using attempts),
//! lost mid-batch, or refused.

use lapin::protocol::{AMQPErrorKind, AMQPSoftError};

use crate::transport::{FailureKind, PublishError};

pub(super) fn soft_error(e: &lapin::Error) -> Option<AMQPSoftError> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(s) => Some(s.clone()),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}

pub(super) fn unavailable(what: &str, e: &lapin::Error) -> PublishError {
    PublishError::new(FailureKind::Unavailable, format!("{what}: {e}"))
}

/// What a channel closed while publishing to `exchange` means for that message. The broker
/// closes the channel with ACCESS_REFUSED or NOT_FOUND when the relay may not publish to an
/// exchange (it may declare it but not write to it) or the exchange is gone: that exchange's
/// events wait, like a missing Kafka topic, instead of pausing the relay as an outage; the
/// other messages on the channel are released for the next claim without an attempt.
/// Anything else is the broker being unavailable.
pub(super) fn lost(what: &str, e: &lapin::Error, exchange: &str) -> PublishError {
    match soft_error(e) {
        Some(AMQPSoftError::ACCESSREFUSED | AMQPSoftError::NOTFOUND) => {
            // The broker names the exchange as `exchange 'X'` (its text also quotes the vhost
            // and the user, which may be named like another exchange).
            if e.to_string().contains(&format!("exchange '{exchange}'")) {
                PublishError::new(
                    FailureKind::Waiting,
                    format!(
                        "RabbitMQ refused publishing to exchange {exchange:?} ({e}): grant the relay's user write permission on it, or create it; its events wait until then"
                    ),
                )
            } else {
                PublishError::new(
                    FailureKind::HeldBack,
                    format!(
                        "not confirmed: RabbitMQ closed the channel over another exchange ({e})"
                    ),
                )
            }
        }
        // The broker is closing the channel (its reason reaches the message that caused it):
        // not sent, to be claimed again without an attempt.
        _ if matches!(e.kind(), lapin::ErrorKind::InvalidChannelState(..)) => PublishError::new(
            FailureKind::HeldBack,
            format!("not sent: the channel was closing ({e})"),
        ),
        _ => unavailable(what, e),
    }
}

pub(super) fn blocked_error() -> PublishError {
    PublishError::new(
        FailureKind::Unavailable,
        "RabbitMQ blocks publishing on this connection (a resource alarm: memory or disk)",
    )
}
