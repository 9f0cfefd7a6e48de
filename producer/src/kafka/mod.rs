//! The Kafka transport: an idempotent rdkafka producer that writes CloudEvents-style records.
//!
//! [`KafkaTransport`] sends through a [`ProducerSlot`], whose producer is replaced after fatal
//! errors; its configuration is in [`config`], topic checks and creation in [`topics`], the
//! `Transport` implementation in [`transport`], the per-batch acknowledgement accounting in
//! [`acks`], error classification in [`classify`] and the key fence across producer
//! replacements in [`key_fence`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::ThreadedProducer;

use crate::Error;

mod acks;
mod classify;
mod config;
mod key_fence;
mod served;
mod topics;
mod transport;

use acks::AckContext;
use key_fence::KeyFence;
use topics::TopicState;

pub use classify::classify;
pub use config::KafkaConfig;

/// Publishes outbox events to Kafka.
///
/// Record layout (CloudEvents Kafka protocol binding, binary mode): key = event key, value =
/// payload, headers `ce_id`, `ce_type`, `ce_source`, `ce_time`, `ce_specversion`, `ce_subject`
/// (key), `ce_schemaversion`, `ce_postalseq`, `content-type`, then user headers (including
/// `traceparent` / `tracestate`).
pub struct KafkaTransport {
    producer: Arc<ProducerSlot>,
    admin: AdminClient<DefaultClientContext>,
    config: KafkaConfig,
    max_message_bytes: usize,
    topics: Arc<Mutex<HashMap<String, TopicState>>>,
    /// Each topic's own `max.message.bytes` as last asked (`topics::TopicLimit`).
    limits: Arc<Mutex<HashMap<String, topics::TopicLimit>>>,
}

impl std::fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("config", &self.config)
            .finish()
    }
}

impl KafkaTransport {
    /// Creates the producer and admin clients. Fails on invalid librdkafka properties; an
    /// unreachable broker is not an error here (the clients connect lazily and keep retrying).
    pub fn new(config: KafkaConfig) -> Result<Self, Error> {
        let mut client_config =
            postal_shared::kafka_producer::config(&config.bootstrap_servers, &config.properties)
                .map_err(|e| Error::Config(e.to_string()))?;
        // The admin client takes the producer's connection settings, not its gap-less mode.
        let admin: AdminClient<DefaultClientContext> = client_config.create()?;
        postal_shared::kafka_producer::pipelined(&mut client_config);
        postal_shared::headers::check_source(&config.source).map_err(Error::Config)?;
        if config.topic_partitions < 1 {
            return Err(Error::Config(format!(
                "topic partitions must be at least 1, got {}",
                config.topic_partitions
            )));
        }
        if config.topic_replication < 1 && config.topic_replication != -1 {
            return Err(Error::Config(format!(
                "topic replication factor must be -1 (the broker's default.replication.factor) or at least 1, got {}",
                config.topic_replication
            )));
        }
        if client_config.get("message.timeout.ms") == Some("0") {
            tracing::warn!("message.timeout.ms=0: deliveries never time out, so a send stuck past the relay's lease may still land after another relay republished the event (a duplicate for the consumers to drop)");
        }
        let producer = shared_producer(client_config.create_with_context(AckContext::default())?);
        let max_message_bytes = client_config
            .get("message.max.bytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1_000_000);
        let batch_bytes = client_config
            .get("batch.size")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1_000_000usize)
            .min(max_message_bytes);
        Ok(KafkaTransport {
            producer: Arc::new(ProducerSlot {
                current: std::sync::RwLock::new((0, producer)),
                generation: AtomicU64::new(0),
                client_config: Mutex::new(client_config.clone()),
                batch_bytes: AtomicUsize::new(batch_bytes),
                fence: KeyFence::default(),
            }),
            admin,
            config,
            max_message_bytes,
            topics: Arc::new(Mutex::new(HashMap::new())),
            limits: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// How many times the producer was replaced.
    #[cfg(test)]
    fn producers_generation(&self) -> u64 {
        self.producer.current().0
    }

    /// The current producer.
    fn producer(&self) -> SharedProducer {
        self.producer.current().1
    }
}

/// The producer in use, numbered so that a failure seen by many in-flight records replaces
/// it once.
struct ProducerSlot {
    current: std::sync::RwLock<(u64, SharedProducer)>,
    /// The current generation, also readable without the lock: a batch being handed over
    /// checks it before each record, so that nothing goes to a producer already replaced
    /// (see [`KeyFence`]).
    generation: AtomicU64,
    client_config: Mutex<rdkafka::ClientConfig>,
    /// The most bytes the producer packs into one record batch (librdkafka's `batch.size`,
    /// at most `message.max.bytes`): lowered to fit the smallest topic limit met
    /// ([`Self::fit_batches`]).
    batch_bytes: AtomicUsize,
    /// Keys held back while a record of theirs in a replaced producer has no recorded outcome.
    fence: KeyFence,
}

impl ProducerSlot {
    fn current(&self) -> (u64, SharedProducer) {
        self.current.read().expect("producer lock").clone()
    }

    /// Replaces producer number `generation` (if it is still the current one) with a fresh
    /// producer, which asks the broker for a new idempotent producer id. Done at once, not
    /// before the next batch: the old client would otherwise reconnect to a restarted broker
    /// and bump the epoch of an id that broker may no longer know.
    fn replace(&self, generation: u64) {
        let mut current = self.current.write().expect("producer lock");
        if current.0 != generation {
            return;
        }
        let config = self.client_config.lock().expect("client config").clone();
        match config.create_with_context::<_, AckProducer>(AckContext::default()) {
            Ok(p) => {
                // Batches still handing records to the old producer stop at their next record,
                // then the keys of its records without an outcome are fenced: all before the
                // new producer is handed out (under the lock), so no batch sends through it
                // without seeing the fence.
                self.generation.store(generation + 1, Ordering::SeqCst);
                self.fence.fence_generation(generation);
                let old = std::mem::replace(&mut current.1, shared_producer(p));
                current.0 += 1;
                drop(current);
                // Destroyed where its last handle goes (batches still in flight hold one), on
                // a thread of its own (see `SharedProducer`).
                drop(old);
                tracing::info!(
                    "recreated the Kafka producer after delivery timeouts or a fatal broker error"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not recreate the Kafka producer; keeping the old one");
            }
        }
    }
}

impl ProducerSlot {
    /// Makes the producer's record batches fit a topic whose `max.message.bytes` is `limit`.
    ///
    /// The broker checks a whole record batch against its topic's limit, and librdkafka packs
    /// a partition's queued records into batches of up to `batch.size` bytes (before
    /// compression): on a topic whose limit is lower, records that each fit but not together
    /// are refused together. Since the producer stops for good on a refused batch (gap-less
    /// order, `postal_shared::kafka_producer`), that would replace it again and again. So once
    /// a topic with a lower limit is met, `batch.size` is lowered under it (with room for
    /// compression's worst-case growth and the batch's framing) and the producer replaced
    /// (keys with records in flight are fenced as at any replacement). A record larger than
    /// `batch.size` still goes out, alone in its batch. `true` if the producer was replaced.
    fn fit_batches(&self, limit: usize) -> bool {
        if !self.batches_over(limit) {
            return false;
        }
        let fits = batch_bytes_under(limit);
        {
            let mut config = self.client_config.lock().expect("client config");
            if fits >= self.batch_bytes.load(Ordering::SeqCst) {
                return false;
            }
            config.set("batch.size", fits.to_string());
            self.batch_bytes.store(fits, Ordering::SeqCst);
        }
        tracing::info!(
            batch_bytes = fits,
            topic_limit = limit,
            "a topic's max.message.bytes is below the producer's batch size: the producer's record batches are now kept under it (every topic's)"
        );
        self.replace(self.current().0);
        true
    }

    /// Whether the producer's record batches may be larger than a topic limit of `limit`
    /// (cheap: checked before every batch).
    fn batches_over(&self, limit: usize) -> bool {
        batch_bytes_under(limit) < self.batch_bytes.load(Ordering::SeqCst)
    }
}

/// A `batch.size` whose batches fit a topic limit of `limit` after compression (lz4 grows
/// incompressible data by at most about 0.4 %) with the batch's framing.
fn batch_bytes_under(limit: usize) -> usize {
    limit.saturating_sub(limit / 100 + 128).max(1)
}

/// The producer: librdkafka's client with a polling thread that runs the delivery callbacks.
type AckProducer = ThreadedProducer<AckContext>;

/// A handle to the producer: the last one to go destroys the client on a thread of its own,
/// never on an async worker or the runtime's blocking pool (destroying it waits for
/// librdkafka's threads; see [`postal_shared::DetachedDrop`]).
type SharedProducer = postal_shared::DetachedDrop<AckProducer>;

fn shared_producer(producer: AckProducer) -> SharedProducer {
    postal_shared::DetachedDrop::new(producer, "postal-producer-drop")
}
