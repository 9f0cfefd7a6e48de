//! Delivery accounting: the producer's delivery callbacks count each batch's acknowledgements
//! down ([`BatchAcks`], an [`Ack`] per record) instead of a channel and a future per record.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryResult, ProducerContext};
use rdkafka::ClientContext;

use super::classify::{classify, needs_reset, unreachable};
use super::key_fence::Tracked;
use super::topics::not_authorised;
use super::ProducerSlot;
use crate::transport::{FailureKind, PublishError};

/// Delivery callbacks that count a batch's acknowledgements down (see [`BatchAcks`]), instead
/// of a channel and a future per record.
#[derive(Default)]
pub(super) struct AckContext {
    /// The producer stopped for good to keep a partition's records gap-less (a record refused
    /// for good while later ones were in flight): its other records' `Fatal` failures are then
    /// not the broker's unavailability but the stop itself, and they are held back.
    gapless_stop: std::sync::atomic::AtomicBool,
}

impl AckContext {
    /// Whether this producer stopped for good to stay gap-less (see `gapless_stop`).
    pub(super) fn stopped_gapless(&self) -> bool {
        self.gapless_stop.load(Ordering::SeqCst)
    }
}

impl ClientContext for AckContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        // Postal turns `enable.gapless.guarantee` on itself (its warning that the property is
        // experimental is no news at every start), and says what a gap-less stop means in its
        // own line (`error`): librdkafka's "FATAL" line for it is left out.
        let gapless = log_message.contains("enable.gapless.guarantee is experimental")
            || (fac == "FATAL" && log_message.contains("Gap-less ordering"));
        if !gapless {
            rdkafka::client::DefaultClientContext.log(level, fac, log_message);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::GaplessGuarantee) {
            self.gapless_stop.store(true, Ordering::SeqCst);
            tracing::warn!(reason, "a record was refused for good while later records of its partition were in flight: the Kafka producer stopped (so none of them is written past it) and is replaced; they are sent again behind it");
            return;
        }
        UNREACHABLE_LOG.kafka_client_error(unreachable(&error), &error, reason);
    }
}

/// One "broker unreachable" line every 30 s for all of the relay's Kafka clients.
static UNREACHABLE_LOG: std::sync::LazyLock<postal_shared::LogThrottle> =
    std::sync::LazyLock::new(|| postal_shared::LogThrottle::new(Duration::from_secs(30)));

impl ProducerContext for AckContext {
    type DeliveryOpaque = Box<Ack>;

    fn delivery(&self, result: &DeliveryResult<'_>, mut ack: Box<Ack>) {
        ack.delivered = true;
        if let Ok(msg) = result {
            use rdkafka::Message as _;
            // With `acks=all` a record the broker wrote has its offset. librdkafka reports a
            // record "implicitly acked" by a later request's success without one, and that
            // inference is wrong on a partition the broker had just started (see `served`):
            // not taken as published.
            if !postal_shared::kafka_producer::written(msg.offset()) {
                ack.unconfirmed = true;
            }
        }
        if let Err((err, msg)) = result {
            if err.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal)
                && self.gapless_stop.load(Ordering::SeqCst)
            {
                ack.gapless_stop = true;
            }
            if err.rdkafka_error_code() == Some(RDKafkaErrorCode::TopicAuthorizationFailed) {
                use rdkafka::Message as _;
                ack.denied_topic = Some(msg.topic().to_owned());
            }
            if err.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge) {
                // The topic's limit as last read may be stale (lowered since): read it again
                // before the next batch of the topic.
                use rdkafka::Message as _;
                ack.batch
                    .limits
                    .lock()
                    .expect("topic limits")
                    .remove(msg.topic());
            }
            ack.failure = Some(err.clone());
        }
        // Dropping the ack records it (see `Drop for Ack`).
    }
}

/// The acknowledgements of one batch, filled in from the delivery callbacks.
pub(super) struct BatchAcks {
    /// Records handed to librdkafka and not yet reported, plus one while records are still
    /// being handed over.
    pub(super) remaining: AtomicUsize,
    /// Records that failed after they were handed over: (index in the batch, error).
    pub(super) failures: Mutex<Vec<(usize, PublishError)>>,
    /// Topics the broker refused records of for a missing ACL, with the reason.
    pub(super) denied: Mutex<Vec<(String, String)>>,
    /// Records that failed as if their topic were gone (unknown to the broker or to the
    /// client, or timed out): their topics are looked up once the batch settled.
    pub(super) topic_gone: Mutex<Vec<usize>>,
    /// Set once a failure asked for a fresh producer (see [`needs_reset`]).
    reset: AtomicBool,
    /// The producer the batch went through (weak: the records queued in a producer hold their
    /// batch, which must not keep the producer alive), its generation, and the runtime to
    /// replace it on.
    slot: std::sync::Weak<ProducerSlot>,
    generation: u64,
    runtime: tokio::runtime::Handle,
    /// Woken when `remaining` reaches zero.
    done: tokio::sync::Notify,
    /// Which records have their outcome, for the key fence.
    tracked: Arc<Tracked>,
    /// The transport's topic limits (`topics::topic_limit`): a size refusal forgets its
    /// topic's.
    pub(super) limits: Arc<Mutex<HashMap<String, super::topics::TopicLimit>>>,
}

impl BatchAcks {
    pub(super) fn new(
        slot: std::sync::Weak<ProducerSlot>,
        generation: u64,
        tracked: Arc<Tracked>,
        limits: Arc<Mutex<HashMap<String, super::topics::TopicLimit>>>,
    ) -> Arc<Self> {
        Arc::new(BatchAcks {
            limits,
            remaining: AtomicUsize::new(1),
            failures: Mutex::new(Vec::new()),
            denied: Mutex::new(Vec::new()),
            topic_gone: Mutex::new(Vec::new()),
            reset: AtomicBool::new(false),
            tracked,
            slot,
            generation,
            runtime: tokio::runtime::Handle::current(),
            done: tokio::sync::Notify::new(),
        })
    }

    /// Replaces the producer at once, not when the batch is settled (other batches would keep
    /// going through a producer that needs replacing meanwhile). Called from the delivery
    /// callback, i.e. on the producer's own polling thread, which must not drop the producer:
    /// the replacement runs on the runtime's blocking pool.
    fn reset_producer(&self) {
        if self.reset.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(slot) = self.slot.upgrade() else {
            return;
        };
        let generation = self.generation;
        drop(
            self.runtime
                .spawn_blocking(move || slot.replace(generation)),
        );
    }

    /// One record (or the hand-over itself) is done.
    pub(super) fn count_down(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }

    /// Resolves once every record handed over was reported.
    pub(super) async fn settled(&self) {
        while self.remaining.load(Ordering::Acquire) > 0 {
            self.done.notified().await;
        }
    }
}

/// One record's delivery opaque: reports its outcome to the batch when dropped — by the
/// delivery callback, or by librdkafka discarding the record without one (reported as the
/// producer shutting down before the acknowledgement).
pub(super) struct Ack {
    pub(super) batch: Arc<BatchAcks>,
    pub(super) index: usize,
    pub(super) delivered: bool,
    pub(super) failure: Option<KafkaError>,
    /// The record's topic, when the broker refused it for a missing ACL.
    pub(super) denied_topic: Option<String>,
    /// Reported delivered without an offset (implicitly acked): not known to be written.
    pub(super) unconfirmed: bool,
    /// The record fits its topic's own `max.message.bytes` by itself (before compression):
    /// refused for its size, it was refused for the records it shared its produce request
    /// with, and is sent again (held back, no attempt used) rather than parked.
    pub(super) fits_alone: bool,
    /// Failed as `Fatal` because the producer stopped to stay gap-less (see
    /// [`AckContext::gapless_stop`]): held back, no attempt used, no pause.
    pub(super) gapless_stop: bool,
}

/// The failure of a record reported delivered without an offset (see `Ack::unconfirmed`).
const UNCONFIRMED: &str = postal_shared::kafka_producer::UNCONFIRMED;

/// One line every 30 s about records reported delivered without an offset.
static UNCONFIRMED_LOG: std::sync::LazyLock<postal_shared::LogThrottle> =
    std::sync::LazyLock::new(|| postal_shared::LogThrottle::new(Duration::from_secs(30)));

impl Drop for Ack {
    fn drop(&mut self) {
        let failure = match (self.delivered, self.failure.take()) {
            (true, None) if self.unconfirmed => {
                if let Some(held) = UNCONFIRMED_LOG.admit("unconfirmed") {
                    tracing::warn!(
                        index = self.index,
                        more_since_last_line = held,
                        "{UNCONFIRMED}"
                    );
                }
                Some(PublishError::new(FailureKind::HeldBack, UNCONFIRMED))
            }
            (true, None) => None,
            (true, Some(err)) => {
                // A record refused for good stops a gap-less producer (when records of its
                // partition were in flight behind it): replaced at once, not when the next
                // batch meets it stopped.
                if needs_reset(&err) || classify(&err) == FailureKind::Permanent {
                    self.batch.reset_producer();
                }
                if matches!(
                    err.rdkafka_error_code(),
                    Some(
                        RDKafkaErrorCode::UnknownTopicOrPartition
                            | RDKafkaErrorCode::UnknownTopic
                            | RDKafkaErrorCode::MessageTimedOut
                    )
                ) {
                    self.batch
                        .topic_gone
                        .lock()
                        .expect("topic gone")
                        .push(self.index);
                }
                if let Some(topic) = self.denied_topic.take() {
                    let reason = not_authorised(&topic);
                    self.batch
                        .denied
                        .lock()
                        .expect("denied topics")
                        .push((topic, reason.clone()));
                    Some(PublishError::new(FailureKind::Waiting, reason))
                } else if self.fits_alone
                    && err.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge)
                {
                    // Most likely refused for a larger record it shared its produce request
                    // with: tried again, as a transient failure. An attempt is counted all the
                    // same, so that a record refused by itself after all (the size estimate is
                    // not exact) is parked once its attempts are used up, not resent for ever.
                    Some(PublishError::new(
                        FailureKind::Transient,
                        format!("{err} (its own size fits the topic's max.message.bytes: probably refused with a larger record of its produce request; tried again)"),
                    ))
                } else if self.gapless_stop {
                    Some(PublishError::new(
                        FailureKind::HeldBack,
                        "the Kafka producer stopped (an earlier record of its partition was refused for good) and is replaced: sent again behind it",
                    ))
                } else if err.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) {
                    Some(PublishError::new(classify(&err), format!("{err}: the Kafka producer stopped for good and is replaced (its cause is logged just before: e.g. \"Cluster authorization failed\" when the relay's principal may write no topic at all)")))
                } else {
                    Some(PublishError::new(classify(&err), err.to_string()))
                }
            }
            (false, _) => Some(PublishError::new(
                FailureKind::Unavailable,
                "producer shut down before the broker acknowledged",
            )),
        };
        if let Some(f) = failure {
            // A failed record holds its key until its batch is recorded (its row is then back
            // in the outbox, holding the key there): a later batch must not send the key's
            // later records meanwhile (see `KeyFence`).
            if let Some(slot) = self.batch.slot.upgrade() {
                slot.fence.hold_key(&self.batch.tracked, self.index);
            }
            self.batch
                .failures
                .lock()
                .expect("batch failures")
                .push((self.index, f));
        }
        if self.batch.tracked.resolved(self.index) {
            // The batch holds keys in the fence: this may have been its last open record.
            if let (Some(slot), Some(id)) = (self.batch.slot.upgrade(), self.batch.tracked.id()) {
                slot.fence.try_release(id);
            }
        }
        self.batch.count_down();
    }
}
