//! The [`Transport`] implementation: a batch handed to the producer record by record (behind
//! its topics' checks and the key fence), and its outcomes once every record has one.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, Producer};
use rdkafka::util::Timeout;

use postal_shared::headers as h;

use super::acks::{Ack, BatchAcks};
use super::classify::{classify, needs_reset};
use super::key_fence::FENCED;
use super::topics::TopicState;
use super::KafkaTransport;
use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};

#[cfg(test)]
mod tests;

impl KafkaTransport {
    /// Why a record of about `size` bytes (uncompressed) cannot fit its topic's limit of
    /// `limit` bytes even compressed (`None`: it may, so it is sent, alone in its key). Without
    /// compression (`compression.type=none`) it cannot; with it, the payload is compressed here
    /// with lz4 (gzip and zstd do at least as well, snappy about as well) and the rest counted
    /// whole, with 2 % to spare.
    fn too_large_compressed(
        &self,
        event: &OutboundEvent,
        size: usize,
        limit: usize,
    ) -> Option<String> {
        let codec = ["compression.type", "compression.codec"]
            .iter()
            .find_map(|k| self.config.properties.get(*k))
            .map_or("lz4", |v| v.trim());
        if codec.eq_ignore_ascii_case("none") {
            return Some(format!(
                "record of about {size} bytes exceeds its topic's max.message.bytes of {limit} (compression.type=none)"
            ));
        }
        let compressed = lz4_flex::block::compress(&event.payload).len()
            + size.saturating_sub(event.payload.len());
        (compressed + compressed / 50 > limit).then(|| {
            format!(
                "record of about {size} bytes (about {compressed} compressed) exceeds its topic's max.message.bytes of {limit}"
            )
        })
    }

    fn record_size(&self, event: &OutboundEvent) -> usize {
        // Payload, key (twice: the record's key and `ce_subject`), the event and content types
        // (`ce_type`, `content-type`) and headers, plus an allowance for record framing and
        // Postal's other headers (names and fixed-size values).
        event.payload.len()
            + 2 * event.key.len()
            + event.event_type.len()
            + event.content_type.len()
            + self.config.source.len()
            + event
                .headers
                .iter()
                .map(|(k, v)| {
                    let twice = postal_shared::headers::trace_extension(k).is_some();
                    (k.len() + v.len() + 8) * if twice { 2 } else { 1 }
                })
                .sum::<usize>()
            + 512
    }
}

type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

impl Transport for KafkaTransport {
    type Acks = Acks;

    async fn send(&self, batch: &[OutboundEvent]) -> Acks {
        // Keys whose earlier event in this batch failed before it was sent: their later events
        // are held back instead of overtaking it.
        let mut blocked: HashSet<(&str, &str)> = HashSet::new();
        // Resolve every distinct topic once per batch.
        let mut topic_ok: HashMap<&str, Result<(), PublishError>> = HashMap::new();
        // Each topic's own `max.message.bytes`, when known (`topics::topic_limit`).
        let mut limits: HashMap<&str, Option<usize>> = HashMap::new();
        let mut previous: Option<&str> = None;
        for e in batch {
            // Batches mostly hold one topic: look it up only when it changes.
            if previous != Some(e.topic.as_str()) && !topic_ok.contains_key(e.topic.as_str()) {
                // A refused topic is never looked up, let alone created.
                let r = match self.config.allowed_topics.check(&e.topic) {
                    Ok(()) => self.ensure_topic(&e.topic).await,
                    Err(refused) => Err(refused),
                };
                if r.is_ok() {
                    limits.insert(e.topic.as_str(), self.topic_limit(&e.topic).await);
                }
                topic_ok.insert(e.topic.as_str(), r);
            }
            previous = Some(e.topic.as_str());
        }
        // Batches the producer packs must fit the smallest limit of these topics.
        if let Some(smallest) = limits
            .values()
            .flatten()
            .min()
            .copied()
            .filter(|&l| self.producer.batches_over(l))
        {
            let slot = Arc::clone(&self.producer);
            let _ = tokio::task::spawn_blocking(move || slot.fit_batches(smallest)).await;
        }
        let (generation, producer) = self.producer.current();
        // Keys with a record in flight that its topic may refuse for its size (larger, before
        // compression, than the topic's own `max.message.bytes`): the broker would refuse it
        // after the key's later records were handed over, and those could be written ahead
        // of it. So such a record goes out alone in its key: the key's later records here are
        // held back, and later batches' are fenced, until its outcome is recorded.
        let mut alone: HashSet<(&str, &str)> = HashSet::new();
        let every_topic_ok = topic_ok.values().all(Result::is_ok);
        // The header values formatted per event, without an allocation each.
        let mut id_buf = uuid::Uuid::encode_buffer();
        let mut version_buf = itoa::Buffer::new();
        let mut seq_buf = itoa::Buffer::new();

        // Outcomes known before the acknowledgements (refused before sending); the rest are
        // filled in from the delivery callbacks.
        let mut outcomes: Vec<Result<(), PublishError>> = vec![Ok(()); batch.len()];
        let fence = &self.producer.fence;
        let tracked = fence.track(batch, generation);
        let acks = BatchAcks::new(
            Arc::downgrade(&self.producer),
            generation,
            tracked.clone(),
            self.limits.clone(),
        );
        // Set once the producer was replaced while this batch was being handed over.
        let mut replaced = false;
        for (index, e) in batch.iter().enumerate() {
            if !alone.is_empty() && alone.contains(&e.order_key()) {
                outcomes[index] = Err(PublishError::new(
                    FailureKind::HeldBack,
                    "an earlier event of this key, larger than its topic's max.message.bytes before compression, goes out alone",
                ));
                continue;
            }
            if !blocked.is_empty() && blocked.contains(&e.order_key()) {
                outcomes[index] = Err(PublishError::new(
                    FailureKind::HeldBack,
                    "an earlier event of this key failed",
                ));
                continue;
            }
            // A record of this key in a replaced producer has no recorded outcome yet: this
            // one must not overtake it (see `KeyFence`); nor may the key's later ones here.
            if fence.any() && fence.hold_if_fenced(&tracked, index) {
                outcomes[index] = Err(PublishError::new(FailureKind::HeldBack, FENCED));
                blocked.insert(e.order_key());
                continue;
            }
            if !every_topic_ok {
                if let Err(err) = &topic_ok[e.topic.as_str()] {
                    outcomes[index] = Err(err.clone());
                    blocked.insert(e.order_key());
                    fence.hold_key(&tracked, index);
                    continue;
                }
            }
            if let Some(err) = crate::transport::stored_headers_refused(e) {
                outcomes[index] = Err(err);
                blocked.insert(e.order_key());
                fence.hold_key(&tracked, index);
                continue;
            }
            let size = self.record_size(e);
            // The topic's own `max.message.bytes`, when known.
            let topic_limit = limits.get(e.topic.as_str()).copied().flatten();
            if size > self.max_message_bytes {
                outcomes[index] = Err(PublishError::new(
                    FailureKind::Permanent,
                    format!(
                        "record of about {size} bytes exceeds the producer's message.max.bytes of {}",
                        self.max_message_bytes
                    ),
                ));
                blocked.insert(e.order_key());
                fence.hold_key(&tracked, index);
                continue;
            }
            if let Some(why) = topic_limit
                .filter(|&limit| size > limit)
                .and_then(|limit| self.too_large_compressed(e, size, limit))
            {
                // Sent, the broker would refuse it, and that refusal stops the gap-less
                // producer for every topic: parked here instead.
                outcomes[index] = Err(PublishError::new(FailureKind::Permanent, why));
                blocked.insert(e.order_key());
                fence.hold_key(&tracked, index);
                continue;
            }
            let id: &str = e.id.as_uuid().hyphenated().encode_lower(&mut id_buf);
            let time = e
                .occurred_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            let version = version_buf.format(e.schema_version);
            let seq = seq_buf.format(e.seq);
            let mut headers = OwnedHeaders::new_with_capacity(9 + e.headers.len())
                .insert(Header {
                    key: h::CE_ID,
                    value: Some(id),
                })
                .insert(Header {
                    key: h::CE_TYPE,
                    value: Some(e.event_type.as_str()),
                })
                .insert(Header {
                    key: h::CE_SOURCE,
                    value: Some(self.config.source.as_str()),
                })
                .insert(Header {
                    key: h::CE_TIME,
                    value: Some(time.as_str()),
                })
                .insert(Header {
                    key: h::CE_SPECVERSION,
                    value: Some(h::SPEC_VERSION),
                })
                .insert(Header {
                    key: h::CE_SUBJECT,
                    value: Some(e.key.as_str()),
                })
                .insert(Header {
                    key: h::CE_SCHEMA_VERSION,
                    value: Some(version),
                })
                .insert(Header {
                    key: h::CE_POSTAL_SEQ,
                    value: Some(seq),
                })
                .insert(Header {
                    key: h::CONTENT_TYPE,
                    value: Some(e.content_type.as_str()),
                });
            for (k, v) in &e.headers {
                headers = headers.insert(Header {
                    key: k.as_str(),
                    value: Some(v.as_str()),
                });
                // The trace context also as the CloudEvents distributed-tracing extension,
                // which CloudEvents SDKs read (`ce_traceparent`, `ce_tracestate`).
                if let Some(ce) = h::trace_extension(k) {
                    headers = headers.insert(Header {
                        key: ce,
                        value: Some(v.as_str()),
                    });
                }
            }
            acks.remaining.fetch_add(1, Ordering::AcqRel);
            let ack = Box::new(Ack {
                batch: acks.clone(),
                index,
                delivered: false,
                failure: None,
                denied_topic: None,
                unconfirmed: false,
                gapless_stop: false,
                // With room for compression's worst-case growth (lz4: about 1 in 255), so that
                // a record refused alone is never taken for one refused for its neighbours.
                fits_alone: topic_limit.is_some_and(|limit| size + size / 100 <= limit),
            });
            let mut record = BaseRecord::with_opaque_to(&e.topic, ack)
                .key(e.key.as_bytes())
                .payload(e.payload.as_slice())
                .headers(headers);
            tracked.handing(index);
            if replaced || self.producer.generation.load(Ordering::SeqCst) != generation {
                // The producer was replaced meanwhile: the rest of the batch goes to none,
                // and its keys stay fenced until the batch is recorded (the records of
                // theirs that the old producer got are fenced by the replacement).
                replaced = true;
                tracked.not_handed(index);
                fence.hold_key(&tracked, index);
                let mut ack = record.delivery_opaque;
                ack.delivered = true;
                drop(ack);
                outcomes[index] = Err(PublishError::new(FailureKind::HeldBack, FENCED));
                blocked.insert(e.order_key());
                continue;
            }
            let over_topic_limit = topic_limit.is_some_and(|limit| size > limit);
            loop {
                match producer.send(record) {
                    Ok(()) => {
                        if over_topic_limit {
                            alone.insert(e.order_key());
                            fence.hold_key(&tracked, index);
                        }
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        // The local queue is full: give librdkafka a moment to drain it.
                        record = r;
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    Err((err, r)) => {
                        // Not handed over: its ack is dropped here, unreported.
                        let mut ack = r.delivery_opaque;
                        ack.delivered = true;
                        drop(ack);
                        // Stopped for good to stay gap-less (another record was refused): not an
                        // outage; replaced, and this record is sent again.
                        let gapless = err.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal)
                            && producer.context().stopped_gapless();
                        if needs_reset(&err) {
                            self.producer.replace(generation);
                        }
                        if matches!(
                            err.rdkafka_error_code(),
                            Some(
                                RDKafkaErrorCode::UnknownTopicOrPartition
                                    | RDKafkaErrorCode::UnknownTopic
                            )
                        ) {
                            // Looked up once the batch settled (see `gone` below).
                            acks.topic_gone.lock().expect("topic gone").push(index);
                        }
                        outcomes[index] = Err(if gapless {
                            PublishError::new(FailureKind::HeldBack, "the Kafka producer stopped (an earlier record of its partition was refused for good) and is replaced: sent again behind it")
                        } else {
                            PublishError::new(classify(&err), err.to_string())
                        });
                        blocked.insert(e.order_key());
                        fence.hold_key(&tracked, index);
                        break;
                    }
                }
            }
        }
        // The hand-over is done: from here the count reaches zero with the last callback.
        acks.count_down();
        // A topic deleted after it was found: its records fail as unknown, or time out. Their
        // topics are looked up once the batch settled (`gone`), and one that no longer exists
        // is missing again: its events wait, in key order, like a missing topic's, without
        // pausing the relay, and the next batches hold them back until it exists again (or is
        // created again). Other topics are not held up.
        let cache = Arc::clone(&self.topics);
        let create = self.config.create_topics;
        // Weak, and the current producer only when it is needed: holding this batch's producer
        // would keep a replaced producer (and its queued records) alive.
        let slot = Arc::downgrade(&self.producer);
        drop(producer);
        // The batch's topics, and each event's among them (a batch mostly holds one topic).
        let mut topics: Vec<String> = Vec::new();
        let topic_of: Vec<u32> = batch
            .iter()
            .map(|e| match topics.iter().rposition(|t| *t == e.topic) {
                Some(i) => i as u32,
                None => {
                    topics.push(e.topic.clone());
                    (topics.len() - 1) as u32
                }
            })
            .collect();
        async move {
            acks.settled().await;
            for (index, failure) in acks.failures.lock().expect("batch failures").drain(..) {
                outcomes[index] = Err(failure);
            }
            let suspects = std::mem::take(&mut *acks.topic_gone.lock().expect("topic gone"));
            if !suspects.is_empty() {
                let suspects: Vec<(usize, &str)> = suspects
                    .into_iter()
                    .map(|i| (i, topics[topic_of[i] as usize].as_str()))
                    .collect();
                if let Some(slot) = slot.upgrade() {
                    let current = slot.current().1;
                    drop(slot);
                    super::topics::gone(current, &cache, create, &suspects, &mut outcomes).await;
                }
            }
            // A topic refused for a missing ACL waits like a missing one: later batches hold
            // its events back until the next look-up, and the cause is said once.
            let denied = std::mem::take(&mut *acks.denied.lock().expect("denied topics"));
            if !denied.is_empty() {
                let mut cache = cache.lock().expect("topic cache");
                for (topic, reason) in denied {
                    let was = cache.insert(
                        topic.clone(),
                        TopicState::Missing {
                            reason: reason.clone(),
                            since: std::time::Instant::now(),
                        },
                    );
                    if !matches!(was, Some(TopicState::Missing { .. })) {
                        tracing::warn!(topic, "{reason}");
                    }
                }
            }
            outcomes
        }
        .boxed()
    }

    fn recorded(&self, batch: &[OutboundEvent], _committed: bool) {
        // Committed or rolled back, the batch's failed and purged rows are in the outbox again
        // (or still there), ahead of their key's later events: its fenced keys may go.
        self.producer.fence.recorded(batch);
    }

    fn delivery_timeout(&self) -> Option<Duration> {
        let ms = self
            .config
            .client_config()
            .get("message.timeout.ms")
            .and_then(|v| v.parse::<u64>().ok())?;
        // 0 = librdkafka retries without limit: there is no bound to check the lease against.
        (ms > 0).then(|| Duration::from_millis(ms))
    }

    async fn flush(&self, timeout: Duration) {
        let producer = self.producer();
        let _ = tokio::task::spawn_blocking(move || producer.flush(Timeout::After(timeout))).await;
    }
}
