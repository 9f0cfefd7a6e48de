//! The destination-neutral interface the relay publishes through.
//!
//! A transport takes a batch of claimed events in outbox order, hands all of them to its
//! destination without waiting for each one, and returns a future of per-event outcomes that
//! resolves once the destination acknowledged (or refused) every event. The relay marks rows
//! only from those outcomes. Kafka is the transport shipped today ([`crate::KafkaTransport`]);
//! RabbitMQ or in-process task handlers implement the same trait.

use std::fmt;
use std::future::Future;

use chrono::{DateTime, Utc};
use postal_shared::EventId;

/// A claimed outbox row, ready to publish.
#[derive(Clone, Debug)]
pub struct OutboundEvent {
    /// Outbox sequence number.
    pub seq: i64,
    /// The event id (unchanged across every attempt).
    pub id: EventId,
    /// Destination topic.
    pub topic: String,
    /// Event key (aggregate id).
    pub key: String,
    /// Event type.
    pub event_type: String,
    /// Payload schema version.
    pub schema_version: i32,
    /// When the event occurred.
    pub occurred_at: DateTime<Utc>,
    /// Payload content type.
    pub content_type: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// User headers (including `traceparent` when captured).
    pub headers: Vec<(String, String)>,
    /// Failed attempts so far. For a row checked out to the transport
    /// ([`Transport::checks_out`]): the runs before this one (its run number less one).
    pub attempts: i32,
}

impl OutboundEvent {
    /// The scope of per-key order: the topic and the key. A key's events on one topic reach it
    /// in outbox order; its events on two topics are independent (no destination orders
    /// records across topics), so a failure on one topic never holds the key back on another.
    /// The claim's hold, the batch verdict, the transports, the key chain and the key fence all
    /// scope a key this way.
    pub fn order_key(&self) -> (&str, &str) {
        (&self.topic, &self.key)
    }
}

/// How a failed publish is treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// The destination is unreachable or not ready (connection refused, timeouts, no leader).
    /// Retried with backoff for as long as it takes; never uses up the event's attempts.
    Unavailable,
    /// A transient error that counts as an attempt; the event is parked after `max_attempts`.
    Transient,
    /// The event can never be published as it is (too large, invalid topic): parked at once.
    Permanent,
    /// Not attempted: an earlier event of the same key in the batch failed first (or, with
    /// Kafka, the record was purged when the relay replaced its producer after another
    /// record's failure, or an earlier record of its key in a replaced producer has no
    /// recorded outcome yet). Released for a later claim without using up an attempt; the
    /// earlier event holds the key meanwhile.
    HeldBack,
    /// The destination cannot take it until an operator acts, for reasons of the destination
    /// and not of the event (a topic that does not exist and that Postal may not create).
    /// Retried every minute for as long as it takes, never using up attempts; unlike
    /// [`FailureKind::Unavailable`] it does not pause the relay, so other topics flow.
    Waiting,
}

/// Why one event was not published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishError {
    /// How the relay treats it.
    pub kind: FailureKind,
    /// Human-readable reason, recorded on the row as `last_error`.
    pub reason: String,
}

impl PublishError {
    /// A failure of the given kind.
    pub fn new(kind: FailureKind, reason: impl Into<String>) -> Self {
        PublishError {
            kind,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.reason)
    }
}

/// A destination the relay publishes to.
pub trait Transport: Send + Sync + 'static {
    /// Resolves to one outcome per event of the batch, in batch order.
    type Acks: Future<Output = Vec<Result<(), PublishError>>> + Send + 'static;

    /// Hands the whole batch to the destination, in order, without waiting for
    /// acknowledgements; returns the future of the acknowledgements.
    ///
    /// Per key, order is the transport's to keep within a batch: once an event fails, no later
    /// event of its key in the batch may be published — return [`FailureKind::HeldBack`] for
    /// them (the built-in transports do). Across batches the relay keeps it.
    fn send(&self, batch: &[OutboundEvent]) -> impl Future<Output = Self::Acks> + Send;

    /// The longest the transport may take to acknowledge or fail an event, if bounded. The
    /// relay refuses a lease whose half does not exceed it (a claim would otherwise be cut
    /// off while its acknowledgements are still on their way).
    fn delivery_timeout(&self) -> Option<std::time::Duration> {
        None
    }

    /// `Some(n)` when the relay checks rows out to this transport instead of holding its claim
    /// open while the transport works (the task runner, whose handlers may run for minutes),
    /// with at most `n` events in flight at once. A checked-out row is the first pending row
    /// of its key; it stays in the outbox, marked with its run number and a run lease that
    /// the relay renews while the event is in flight, and holds back its key's later rows
    /// until its outcome is recorded. Each event is handed over on its own, and its outcome
    /// is recorded as soon as it is known (see [`crate::TaskTransport`]). Default `None`.
    fn checks_out(&self) -> Option<usize> {
        None
    }

    /// Stops the work on everything handed over that can be stopped (the task runner aborts
    /// its handlers); each event's outcome then resolves once its work has really ended. The
    /// relay calls it when a graceful stop stops waiting for checked-out events. Default:
    /// nothing.
    fn abort_running(&self) {}

    /// Called once the relay recorded the outcomes of a batch this transport was handed
    /// (`committed`), or failed to (the claim rolled back and its events are handed out
    /// again), or gave the batch up (shutdown). Default: nothing. The Kafka transport holds
    /// back the keys of records that a replaced producer had no outcome for until their batch
    /// is recorded, so a caller other than the relay must call this too. A transport that wraps
    /// another must pass this on, and [`Transport::checks_out`] too.
    fn recorded(&self, batch: &[OutboundEvent], committed: bool) {
        let _ = (batch, committed);
    }

    /// Waits (bounded) for everything handed over to be acknowledged; called on shutdown.
    fn flush(&self, timeout: std::time::Duration) -> impl Future<Output = ()> + Send {
        let _ = timeout;
        async {}
    }
}

/// The refusal of an event whose stored headers use a name Postal sets itself (`ce_id`,
/// `ce_type`, …: published, it would carry two values, and a consumer could take the event
/// for another), a `ce_<name>` name CloudEvents consumers refuse, or are larger than `enqueue`
/// accepts ([`postal_shared::headers::size_problem`]: on RabbitMQ a content-header frame
/// larger than the connection's `frame_max` makes the broker close the connection). `enqueue`
/// refuses such headers; a row written around it, or before the size limits existed, is
/// parked with this (permanent) reason.
pub(crate) fn stored_headers_refused(e: &OutboundEvent) -> Option<PublishError> {
    use postal_shared::headers::{shown_name, size_problem, user_header_problem, HeaderProblem};
    let Some((name, problem)) = e
        .headers
        .iter()
        .find_map(|(k, _)| user_header_problem(k).map(|p| (k, p)))
    else {
        // As many as `enqueue` takes (the SQL `postal.enqueue` does not count them), besides
        // the trace context `enqueue` adds: a consumer turns a record with more than its
        // `max_headers` (256 by default, with Postal's own headers) into a dead letter.
        let user = e
            .headers
            .iter()
            .filter(|(k, _)| {
                k != postal_shared::headers::TRACEPARENT && k != postal_shared::headers::TRACESTATE
            })
            .count();
        if user > crate::MAX_USER_HEADERS {
            return Some(PublishError::new(
                FailureKind::Permanent,
                format!(
                    "stored headers: {user} user headers, more than the {} an event may carry (consumers refuse records with more than their max_headers)",
                    crate::MAX_USER_HEADERS
                ),
            ));
        }
        let sizes = e.headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        return size_problem(sizes)
            .map(|reason| PublishError::new(FailureKind::Permanent, format!("stored {reason}")));
    };
    let shown = shown_name(name);
    let reason = match problem {
        HeaderProblem::Reserved => format!(
            "stored header \"{shown}\" is reserved: Postal sets it (the row was written around postal.enqueue)"
        ),
        HeaderProblem::Empty => "a stored header has an empty name".to_owned(),
        HeaderProblem::NotAString => problem.reason(&shown),
        other => format!("stored {}", other.reason(&shown)),
    };
    Some(PublishError::new(FailureKind::Permanent, reason))
}

/// An event for the transports' unit tests: key `k`, type `job`, an empty JSON object.
#[cfg(test)]
pub(crate) fn sample_event(topic: &str, seq: i64) -> OutboundEvent {
    OutboundEvent {
        seq,
        id: EventId::new(),
        topic: topic.into(),
        key: "k".into(),
        event_type: "job".into(),
        schema_version: 1,
        occurred_at: chrono::Utc::now(),
        content_type: "application/json".into(),
        payload: b"{}".to_vec(),
        headers: Vec::new(),
        attempts: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored header with a reserved name, in any case, is refused permanently, naming it;
    /// other headers pass.
    #[test]
    fn a_stored_reserved_header_is_refused() {
        let mut e = sample_event("t", 1);
        e.headers = vec![("traceparent".into(), "00-x".into())];
        assert!(stored_headers_refused(&e).is_none());
        e.headers.push(("CE_Type".into(), "invoice.created".into()));
        let err = stored_headers_refused(&e).expect("refused");
        assert_eq!(err.kind, FailureKind::Permanent);
        assert!(
            err.reason.contains("\"CE_Type\" is reserved"),
            "{}",
            err.reason
        );
    }

    /// Guarantee: a row with more user headers than `enqueue` takes ([`crate::MAX_USER_HEADERS`])
    /// is refused permanently (parked) before it is sent; as many as it takes pass, with the
    /// trace context `enqueue` adds to them.
    ///
    /// Broken: the SQL `postal.enqueue` counts no headers and the relay did not either: an
    /// event with 300 small headers (well within the size limits) was published, for every
    /// Postal consumer (`max_headers` 256 by default) to dead-letter (`record::decode`: "record
    /// has … headers, more than the consumer's max_headers").
    #[test]
    fn stored_headers_over_the_enqueue_count_are_refused() {
        let mut e = sample_event("t", 1);
        e.headers = (0..crate::MAX_USER_HEADERS)
            .map(|i| (format!("x-{i}"), "v".into()))
            .collect();
        e.headers.push(("traceparent".into(), "00-1-2-01".into()));
        e.headers.push(("tracestate".into(), "a=b".into()));
        assert!(stored_headers_refused(&e).is_none());
        e.headers.push(("x-one-more".into(), "v".into()));
        let err = stored_headers_refused(&e).expect("refused");
        assert_eq!(err.kind, FailureKind::Permanent);
        assert!(err.reason.contains("129 user headers"), "{}", err.reason);
    }

    /// Guarantee: a stored header value over the enqueue limit (a row written before it
    /// existed) is refused permanently, naming the header, not sent.
    #[test]
    fn a_stored_oversized_header_is_refused() {
        let mut e = sample_event("t", 1);
        e.headers = vec![("x-big".into(), "v".repeat(200_000))];
        let err = stored_headers_refused(&e).expect("refused");
        assert_eq!(err.kind, FailureKind::Permanent);
        assert!(
            err.reason.starts_with("stored header \"x-big\""),
            "{}",
            err.reason
        );
    }
}
