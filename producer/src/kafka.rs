//! The Kafka transport: an idempotent rdkafka producer that writes CloudEvents-style records.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::util::Timeout;
use rdkafka::ClientContext;

use postal_shared::headers as h;

use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};
use crate::Error;

mod key_fence;
use key_fence::{KeyFence, Tracked};

/// Settings of the Kafka transport.
#[derive(Clone)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// CloudEvents `source` written on every record (default `postal`).
    pub source: String,
    /// Create missing topics through the admin API (default `true`). When `false` (or when the
    /// cluster refuses), events for a missing topic wait, retried every few seconds without
    /// using up attempts, and the relay logs which topic to create.
    pub create_topics: bool,
    /// Partition count of created topics (default 12).
    pub topic_partitions: i32,
    /// Replication factor of created topics (default 1).
    pub topic_replication: i32,
    /// Extra librdkafka properties (TLS, SASL, tuning); they override Postal's defaults.
    pub properties: BTreeMap<String, String>,
    /// The topics the relay may publish to and create (default: every topic except
    /// dead-letter topics). Events for others are parked with the reason.
    pub allowed_topics: crate::TopicAllowList,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let props = postal_shared::secret::redacted_properties(&self.properties);
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("source", &self.source)
            .field("create_topics", &self.create_topics)
            .field("topic_partitions", &self.topic_partitions)
            .field("topic_replication", &self.topic_replication)
            .field("properties", &props)
            .field("allowed_topics", &self.allowed_topics)
            .finish()
    }
}

impl KafkaConfig {
    /// Defaults for the given bootstrap servers.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            source: "postal".into(),
            create_topics: true,
            topic_partitions: 12,
            topic_replication: 1,
            properties: BTreeMap::new(),
            allowed_topics: crate::TopicAllowList::any(),
        }
    }

    /// The librdkafka producer configuration: Postal's defaults, then the user's properties.
    ///
    /// Defaults: `enable.idempotence=true`, `acks=all`, `partitioner=murmur2_random` (keys land
    /// where Java clients and Debezium put them), `linger.ms=0`, `compression.type=lz4`,
    /// `message.timeout.ms=20000`, `queue.buffering.max.messages=1000000`,
    /// `allow.auto.create.topics=false`.
    ///
    /// `linger.ms` is 0 (librdkafka's own default is 5) because the relay already batches: it
    /// hands a whole claimed batch to the producer at once. Under light load a claim holds a
    /// few events, and a linger would add its full length to each of them (and to the
    /// acknowledgement that the batch's commit and the lane's next claim wait for). Draining a
    /// backlog, `postal-bench relay --relay-only --instances 1 --kafka linger.ms=5` against the
    /// default measured no difference beyond the spread (BENCHMARKS.md).
    ///
    /// `compression.type` is `lz4` (librdkafka's default is none): an event's nine CloudEvents
    /// and Postal headers repeat from record to record, and compressed batches are fewer bytes
    /// for the broker to receive, store and serve. Draining a backlog with it, the broker
    /// spent less CPU per event and the relay none more (`postal-bench relay --relay-only
    /// --kafka compression.type=lz4` against `=none`, before lz4 became the default;
    /// BENCHMARKS.md). librdkafka-based and Java clients read lz4 batches as they are; some
    /// others need a codec installed. `--kafka compression.type=none` turns it off.
    pub fn client_config(&self) -> ClientConfig {
        let mut cfg = ClientConfig::new();
        cfg.set("bootstrap.servers", &self.bootstrap_servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "0")
            .set("compression.type", "lz4")
            .set("message.timeout.ms", "20000")
            .set("queue.buffering.max.messages", "1000000")
            .set("queue.buffering.max.kbytes", "1048576")
            .set("allow.auto.create.topics", "false")
            .set("log_level", "4");
        for (k, v) in &self.properties {
            cfg.set(k, v);
        }
        cfg
    }
}

#[derive(Clone, Debug)]
enum TopicState {
    Ready,
    /// Missing since `since`: checked again after [`MISSING_TOPIC_RECHECK`].
    Missing {
        reason: String,
        since: std::time::Instant,
    },
}

/// How long a missing topic's events wait before the relay asks the cluster again.
const MISSING_TOPIC_RECHECK: Duration = Duration::from_secs(5);

/// One line saying which topic is missing, why Postal did not create it and what to do.
fn not_authorised(topic: &str) -> String {
    format!(
        "the relay is not authorised for topic {topic:?}: grant its Kafka principal WRITE and DESCRIBE on the topic (Kafka ACLs); its events wait until then"
    )
}

fn missing_topic(topic: &str, why: &str) -> String {
    format!(
        "topic {topic:?} does not exist and {why}: create it (kafka-topics.sh --bootstrap-server <broker> --create --topic {topic}); its events wait until it exists"
    )
}

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
        crate::kafka_overrides::check(&config.properties)?;
        postal_shared::headers::check_source(&config.source).map_err(Error::Config)?;
        if config.topic_partitions < 1 || config.topic_replication < 1 {
            return Err(Error::Config(
                "topic partitions and replication factor must be at least 1".into(),
            ));
        }
        let client_config = config.client_config();
        if client_config.get("message.timeout.ms") == Some("0") {
            tracing::warn!("message.timeout.ms=0: deliveries never time out, so a send stuck past the relay's lease may still land after another relay republished the event (a duplicate for the consumers to drop)");
        }
        let producer = shared_producer(client_config.create_with_context(AckContext)?);
        let admin: AdminClient<DefaultClientContext> = client_config.create()?;
        let max_message_bytes = client_config
            .get("message.max.bytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1_000_000);
        Ok(KafkaTransport {
            producer: Arc::new(ProducerSlot {
                current: std::sync::RwLock::new((0, producer)),
                generation: AtomicU64::new(0),
                client_config: client_config.clone(),
                fence: KeyFence::default(),
            }),
            admin,
            config,
            max_message_bytes,
            topics: Arc::new(Mutex::new(HashMap::new())),
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

    /// Makes sure `topic` exists before records go to it. A topic that is missing (topic
    /// creation off, or refused by the cluster) is not the events' fault: they wait, retried
    /// without using up attempts, and the relay logs which topic to create and how.
    async fn ensure_topic(&self, topic: &str) -> Result<(), PublishError> {
        let cached = self.topics.lock().expect("topic cache").get(topic).cloned();
        match cached {
            Some(TopicState::Ready) => return Ok(()),
            Some(TopicState::Missing { reason, since })
                if since.elapsed() < MISSING_TOPIC_RECHECK =>
            {
                return Err(PublishError::new(FailureKind::Waiting, reason));
            }
            _ => {}
        }
        let outcome = match self.topic_exists(topic).await {
            Ok(true) => Ok(()),
            Ok(false) if self.config.create_topics => self.create_topic(topic).await,
            Ok(false) => Err(PublishError::new(
                FailureKind::Waiting,
                missing_topic(topic, "topic creation is off (--no-create-topics)"),
            )),
            // Not the events' fault (a missing ACL): cached and said once, as a missing topic.
            Err(e) if e.kind == FailureKind::Waiting => Err(e),
            Err(e) => return Err(e),
        };
        let state = match &outcome {
            Ok(()) => TopicState::Ready,
            Err(e) if e.kind == FailureKind::Waiting => TopicState::Missing {
                reason: e.reason.clone(),
                since: std::time::Instant::now(),
            },
            Err(_) => return outcome,
        };
        // Lanes look topics up concurrently: say it once, when the state changes.
        let was_missing = matches!(
            self.topics
                .lock()
                .expect("topic cache")
                .insert(topic.to_owned(), state.clone()),
            Some(TopicState::Missing { .. })
        );
        match (&state, &outcome) {
            (TopicState::Missing { .. }, Err(e)) if !was_missing => {
                tracing::warn!(topic, "{}", e.reason);
            }
            (TopicState::Ready, _) if was_missing => {
                tracing::info!(topic, "topic now ready: its waiting events go out");
            }
            _ => {}
        }
        outcome
    }

    async fn topic_exists(&self, topic: &str) -> Result<bool, PublishError> {
        let producer = self.producer();
        let name = topic.to_owned();
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&name), Timeout::After(Duration::from_secs(10)))
        })
        .await
        .map_err(|e| PublishError::new(FailureKind::Transient, e.to_string()))?
        .map_err(|e| PublishError::new(classify(&e), format!("metadata for {topic:?}: {e}")))?;
        let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
            return Ok(false);
        };
        match t.error() {
            None => Ok(!t.partitions().is_empty()),
            Some(err) => {
                let code = RDKafkaErrorCode::from(err);
                match code {
                    RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic => {
                        Ok(false)
                    }
                    RDKafkaErrorCode::InvalidTopic => Err(PublishError::new(
                        FailureKind::Permanent,
                        format!("invalid topic {topic:?}: {code}"),
                    )),
                    // An ACL missing for this topic is the cluster's set-up, not the events'
                    // fault: they wait (in key order) until it is granted.
                    RDKafkaErrorCode::TopicAuthorizationFailed => Err(PublishError::new(
                        FailureKind::Waiting,
                        not_authorised(topic),
                    )),
                    other => Err(PublishError::new(
                        FailureKind::Unavailable,
                        format!("metadata for {topic:?}: {other}"),
                    )),
                }
            }
        }
    }

    async fn create_topic(&self, topic: &str) -> Result<(), PublishError> {
        let new = NewTopic::new(
            topic,
            self.config.topic_partitions,
            TopicReplication::Fixed(self.config.topic_replication),
        );
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = self.admin.create_topics([&new], &opts).await.map_err(|e| {
            PublishError::new(classify(&e), format!("creating topic {topic:?}: {e}"))
        })?;
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((_, RDKafkaErrorCode::InvalidTopic)) => {
                    return Err(PublishError::new(
                        FailureKind::Permanent,
                        format!("invalid topic {topic:?}"),
                    ))
                }
                Err((
                    _,
                    code @ (RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::ClusterAuthorizationFailed
                    | RDKafkaErrorCode::PolicyViolation
                    | RDKafkaErrorCode::InvalidReplicationFactor
                    | RDKafkaErrorCode::InvalidPartitions
                    | RDKafkaErrorCode::InvalidConfig
                    | RDKafkaErrorCode::InvalidReplicaAssignment),
                )) => {
                    return Err(PublishError::new(
                        FailureKind::Waiting,
                        missing_topic(topic, &format!("the cluster refused to create it ({code})")),
                    ))
                }
                Err((_, code)) => {
                    return Err(PublishError::new(
                        classify_code(code),
                        format!("creating topic {topic:?}: {code}"),
                    ))
                }
            }
        }
        tracing::info!(
            topic,
            partitions = self.config.topic_partitions,
            "created topic"
        );
        Ok(())
    }

    fn record_size(event: &OutboundEvent) -> usize {
        // Payload, key and headers plus a generous allowance for record framing and
        // Postal's own headers.
        event.payload.len()
            + event.key.len()
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

/// The producer in use, numbered so that a failure seen by many in-flight records replaces
/// it once.
struct ProducerSlot {
    current: std::sync::RwLock<(u64, SharedProducer)>,
    /// The current generation, also readable without the lock: a batch being handed over
    /// checks it before each record, so that nothing goes to a producer already replaced
    /// (see [`KeyFence`]).
    generation: AtomicU64,
    client_config: rdkafka::ClientConfig,
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
        match self
            .client_config
            .create_with_context::<_, AckProducer>(AckContext)
        {
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

/// The producer: librdkafka's client with a polling thread that runs the delivery callbacks.
type AckProducer = ThreadedProducer<AckContext>;

/// A handle to the producer: the last one to go destroys the client on a thread of its own,
/// never on an async worker or the runtime's blocking pool (destroying it waits for
/// librdkafka's threads; see [`postal_shared::DetachedDrop`]).
type SharedProducer = postal_shared::DetachedDrop<AckProducer>;

fn shared_producer(producer: AckProducer) -> SharedProducer {
    postal_shared::DetachedDrop::new(producer, "postal-producer-drop")
}

/// Delivery callbacks that count a batch's acknowledgements down (see [`BatchAcks`]), instead
/// of a channel and a future per record.
struct AckContext;

impl ClientContext for AckContext {
    fn error(&self, error: KafkaError, reason: &str) {
        UNREACHABLE_LOG.kafka_client_error(unreachable(&error), &error, reason);
    }
}

/// One "broker unreachable" line every 30 s for all of the relay's Kafka clients.
static UNREACHABLE_LOG: std::sync::LazyLock<postal_shared::LogThrottle> =
    std::sync::LazyLock::new(|| postal_shared::LogThrottle::new(Duration::from_secs(30)));

/// Whether a client's global error only says that the broker cannot be reached now.
fn unreachable(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::Resolve
        )
    )
}

impl ProducerContext for AckContext {
    type DeliveryOpaque = Box<Ack>;

    fn delivery(&self, result: &DeliveryResult<'_>, mut ack: Box<Ack>) {
        ack.delivered = true;
        if let Err((err, msg)) = result {
            if err.rdkafka_error_code() == Some(RDKafkaErrorCode::TopicAuthorizationFailed) {
                use rdkafka::Message as _;
                ack.denied_topic = Some(msg.topic().to_owned());
            }
            ack.failure = Some(err.clone());
        }
        // Dropping the ack records it (see `Drop for Ack`).
    }
}

/// The acknowledgements of one batch, filled in from the delivery callbacks.
struct BatchAcks {
    /// Records handed to librdkafka and not yet reported, plus one while records are still
    /// being handed over.
    remaining: AtomicUsize,
    /// Records that failed after they were handed over: (index in the batch, error).
    failures: Mutex<Vec<(usize, PublishError)>>,
    /// Topics the broker refused records of for a missing ACL, with the reason.
    denied: Mutex<Vec<(String, String)>>,
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
}

impl BatchAcks {
    fn new(
        slot: std::sync::Weak<ProducerSlot>,
        generation: u64,
        tracked: Arc<Tracked>,
    ) -> Arc<Self> {
        Arc::new(BatchAcks {
            remaining: AtomicUsize::new(1),
            failures: Mutex::new(Vec::new()),
            denied: Mutex::new(Vec::new()),
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
    fn count_down(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }

    /// Resolves once every record handed over was reported.
    async fn settled(&self) {
        while self.remaining.load(Ordering::Acquire) > 0 {
            self.done.notified().await;
        }
    }
}

/// One record's delivery opaque: reports its outcome to the batch when dropped — by the
/// delivery callback, or by librdkafka discarding the record without one (reported as the
/// producer shutting down before the acknowledgement).
struct Ack {
    batch: Arc<BatchAcks>,
    index: usize,
    delivered: bool,
    failure: Option<KafkaError>,
    /// The record's topic, when the broker refused it for a missing ACL.
    denied_topic: Option<String>,
}

impl Drop for Ack {
    fn drop(&mut self) {
        let failure = match (self.delivered, self.failure.take()) {
            (true, None) => None,
            (true, Some(err)) => {
                if needs_reset(&err) {
                    self.batch.reset_producer();
                }
                if let Some(topic) = self.denied_topic.take() {
                    let reason = not_authorised(&topic);
                    self.batch
                        .denied
                        .lock()
                        .expect("denied topics")
                        .push((topic, reason.clone()));
                    Some(PublishError::new(FailureKind::Waiting, reason))
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

type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

impl Transport for KafkaTransport {
    type Acks = Acks;

    async fn send(&self, batch: &[OutboundEvent]) -> Acks {
        let (generation, producer) = self.producer.current();
        // Keys whose earlier event in this batch failed before it was sent: their later events
        // are held back instead of overtaking it.
        let mut blocked: HashSet<&str> = HashSet::new();
        // Resolve every distinct topic once per batch.
        let mut topic_ok: HashMap<&str, Result<(), PublishError>> = HashMap::new();
        let mut previous: Option<&str> = None;
        for e in batch {
            // Batches mostly hold one topic: look it up only when it changes.
            if previous != Some(e.topic.as_str()) && !topic_ok.contains_key(e.topic.as_str()) {
                // A refused topic is never looked up, let alone created.
                let r = match self.config.allowed_topics.check(&e.topic) {
                    Ok(()) => self.ensure_topic(&e.topic).await,
                    Err(refused) => Err(refused),
                };
                topic_ok.insert(e.topic.as_str(), r);
            }
            previous = Some(e.topic.as_str());
        }
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
        let acks = BatchAcks::new(Arc::downgrade(&self.producer), generation, tracked.clone());
        // Set once the producer was replaced while this batch was being handed over.
        let mut replaced = false;
        for (index, e) in batch.iter().enumerate() {
            if !blocked.is_empty() && blocked.contains(e.key.as_str()) {
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
                blocked.insert(e.key.as_str());
                continue;
            }
            if !every_topic_ok {
                if let Err(err) = &topic_ok[e.topic.as_str()] {
                    outcomes[index] = Err(err.clone());
                    blocked.insert(e.key.as_str());
                    fence.hold_key(&tracked, index);
                    continue;
                }
            }
            if let Some(err) = crate::transport::reserved_header(e) {
                outcomes[index] = Err(err);
                blocked.insert(e.key.as_str());
                fence.hold_key(&tracked, index);
                continue;
            }
            let size = Self::record_size(e);
            if size > self.max_message_bytes {
                outcomes[index] = Err(PublishError::new(
                    FailureKind::Permanent,
                    format!(
                        "record of about {size} bytes exceeds the producer's message.max.bytes of {}",
                        self.max_message_bytes
                    ),
                ));
                blocked.insert(e.key.as_str());
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
                blocked.insert(e.key.as_str());
                continue;
            }
            loop {
                match producer.send(record) {
                    Ok(()) => break,
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
                        if needs_reset(&err) {
                            self.producer.replace(generation);
                        }
                        outcomes[index] = Err(PublishError::new(classify(&err), err.to_string()));
                        blocked.insert(e.key.as_str());
                        fence.hold_key(&tracked, index);
                        break;
                    }
                }
            }
        }
        // The hand-over is done: from here the count reaches zero with the last callback.
        acks.count_down();
        // A topic the broker no longer knows (deleted after it was found) is looked up again by
        // the next batch, which then waits for it or creates it again. (librdkafka often
        // reports a deleted topic's records only as timed out; those are not rechecked, since
        // during an outage every lookup would wait for its timeout.)
        let cache = Arc::clone(&self.topics);
        let batch_topics: Vec<String> = topic_ok.keys().map(|t| (*t).to_owned()).collect();
        async move {
            acks.settled().await;
            let mut recheck = false;
            for (index, failure) in acks.failures.lock().expect("batch failures").drain(..) {
                recheck |= failure.reason.contains("UnknownTopic");
                outcomes[index] = Err(failure);
            }
            if recheck {
                let mut cache = cache.lock().expect("topic cache");
                for t in &batch_topics {
                    if matches!(cache.get(t), Some(TopicState::Ready)) {
                        cache.remove(t);
                    }
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

/// Why a record of a fenced key was held back.
const FENCED: &str =
    "an earlier event of this key has no recorded outcome yet in a replaced Kafka producer";

/// Errors after which the producer is replaced by a fresh one at once:
/// librdkafka's fatal (idempotence) errors, a broker's unknown server error, and delivery
/// timeouts. After a timeout librdkafka would bump the epoch of its existing producer id; a
/// broker that restarted meanwhile may no longer know that id (some brokers fail such requests), while
/// a fresh producer simply asks for a new id.
fn needs_reset(err: &KafkaError) -> bool {
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

fn classify_code(code: RDKafkaErrorCode) -> FailureKind {
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
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    use crate::transport::sample_event as event;

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

    /// Guarantee: a delivery timeout (the broker went away) fails the batch's events as
    /// retryable outcomes that use up no attempt (timed out, or purged by the replacement) —
    /// nothing hangs — and replaces the producer right away, from the
    /// delivery callback; once the broker is back, the next batch goes through the fresh
    /// producer. (librdkafka's in-process mock cluster.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delivery_timeout_replaces_the_producer_and_fails_the_batch_retryably() {
        let (mock, transport) = mock_transport(&[("message.timeout.ms", "500")]).await;
        let before = transport.producers_generation();

        mock.broker_down(1).expect("broker down");
        let batch = [event("jobs", 2), event("jobs", 3)];
        let failed = transport.send(&batch).await.await;
        // As the relay does: a record still open in the replaced producer fences its key until
        // its batch is recorded.
        transport.recorded(&batch, true);
        assert_eq!(failed.len(), 2);
        // The first record to time out replaces the producer, which purges what is still
        // queued: a record whose own timeout had not been reported yet comes back purged
        // (held back) instead. Either way it is retried without using up an attempt.
        for outcome in &failed {
            let err = outcome.as_ref().expect_err("timed out");
            assert!(
                matches!(err.kind, FailureKind::Unavailable | FailureKind::HeldBack),
                "{err}"
            );
        }
        // (Under a loaded CPU both can come back purged: the replacement can purge a record
        // whose own timeout librdkafka has not reported yet. Both ways cost no attempt.)
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while transport.producers_generation() == before {
            assert!(
                std::time::Instant::now() < deadline,
                "producer not replaced"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // Back up: the fresh producer reconnects (with librdkafka's reconnect backoff, so the
        // first attempts may still time out, as the relay's retries would see).
        mock.broker_up(1).expect("broker up");
        assert!(
            publish_with_retries(&transport, event("jobs", 4)).await,
            "never published after the broker came back"
        );
    }

    /// A transport (with these extra librdkafka properties) on a fresh mock cluster with
    /// topic `jobs` (one partition) that has published one event already (so the idempotent
    /// producer holds its id).
    async fn mock_transport(
        properties: &[(&str, &str)],
    ) -> (
        MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
        KafkaTransport,
    ) {
        let mock = MockCluster::new(1).expect("mock cluster");
        mock.create_topic("jobs", 1, 1).expect("topic");
        let mut config = KafkaConfig::new(mock.bootstrap_servers());
        config.create_topics = false;
        for (k, v) in properties {
            config.properties.insert((*k).into(), (*v).into());
        }
        let transport = KafkaTransport::new(config).expect("transport");
        assert!(
            publish_with_retries(&transport, event("jobs", 0)).await,
            "the first event was never published"
        );
        (mock, transport)
    }

    /// Publishes one event, retrying as the relay would (recording each attempt): a first
    /// attempt can time out while the idempotent producer is still getting its id (or
    /// reconnecting) on a loaded machine.
    async fn publish_with_retries(transport: &KafkaTransport, e: OutboundEvent) -> bool {
        let batch = std::slice::from_ref(&e);
        for _ in 0..20 {
            let outcomes = transport.send(batch).await.await;
            transport.recorded(batch, true);
            if outcomes == vec![Ok(())] {
                return true;
            }
        }
        false
    }

    /// Makes the broker refuse the next produce request with `error` and returns how the
    /// transport reports the event it carried.
    async fn refused(
        mock: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
        transport: &KafkaTransport,
        error: RDKafkaRespErr,
    ) -> PublishError {
        mock.request_errors(RDKafkaApiKey::Produce, &[error]);
        let batch = [numbered("jobs", 1)];
        let mut outcomes = transport.send(&batch).await.await;
        // Recorded as the relay would (a failed record holds its key until then).
        transport.recorded(&batch, true);
        outcomes.remove(0).expect_err("refused")
    }

    /// The values of partition 0 of `topic`, from the beginning, until `n` arrived.
    fn read_back(
        mock: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
        topic: &str,
        n: usize,
    ) -> Vec<String> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::Message;
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", mock.bootstrap_servers())
            .set("group.id", "read-back")
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset(topic, 0, rdkafka::Offset::Beginning)
            .expect("offset");
        consumer.assign(&tpl).expect("assign");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut values = Vec::new();
        while values.len() < n && std::time::Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                values.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned());
            }
        }
        // Anything beyond `n` would be a duplicate: give it a moment to show up.
        while let Some(Ok(m)) = consumer.poll(Duration::from_millis(500)) {
            values.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned());
        }
        values
    }

    fn numbered(topic: &str, seq: i64) -> OutboundEvent {
        OutboundEvent {
            payload: format!("{{\"n\":{seq}}}").into_bytes(),
            ..event(topic, seq)
        }
    }

    /// Guarantee: leadership and replication errors from the broker (a partition changing
    /// leader, too few in-sync replicas) are retried inside the idempotent producer: the batch
    /// is acknowledged, and the topic holds each event once, in order — no duplicate from the
    /// retries, nothing used up. (librdkafka's mock cluster fails the next produce requests.)
    ///
    /// One produce request in flight at a time: the mock cluster checks producer sequence
    /// numbers only for transactional producers, so it appends a later request although an
    /// earlier one failed, and librdkafka then counts the earlier records as delivered — the
    /// later acknowledgement implies them on a real broker, which refuses such a request as out
    /// of order. With the relay's `linger.ms=0` the three records can leave in separate
    /// requests; CI once saw the first record acknowledged and missing that way.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn broker_leadership_errors_are_retried_without_duplicates() {
        let (mock, transport) =
            mock_transport(&[("max.in.flight.requests.per.connection", "1")]).await;
        mock.request_errors(
            RDKafkaApiKey::Produce,
            &[
                RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
                RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
                RDKafkaRespErr::RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE,
            ],
        );
        let batch: Vec<OutboundEvent> = (1..=3).map(|n| numbered("jobs", n)).collect();
        let outcomes = transport.send(&batch).await.await;
        assert_eq!(outcomes, vec![Ok(()), Ok(()), Ok(())]);
        let values = read_back(&mock, "jobs", 4);
        assert_eq!(values, vec!["{}", r#"{"n":1}"#, r#"{"n":2}"#, r#"{"n":3}"#]);
    }

    /// Guarantee: a broker that refuses a record for good (larger than the broker's own
    /// limit) fails that event as `Permanent` with the broker's reason — the relay parks it
    /// instead of retrying forever — and the producer goes on publishing to the same topic.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_the_broker_refuses_as_too_large_fails_permanently_and_the_topic_goes_on() {
        let (mock, transport) = mock_transport(&[]).await;
        let err = refused(
            &mock,
            &transport,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE,
        )
        .await;
        assert_eq!(err.kind, FailureKind::Permanent, "{err}");
        assert!(err.reason.to_lowercase().contains("too large"), "{err}");
        assert!(
            publish_with_retries(&transport, numbered("jobs", 2)).await,
            "the topic stopped"
        );
        assert_eq!(read_back(&mock, "jobs", 2), vec!["{}", r#"{"n":2}"#]);
    }

    /// Guarantee: a topic this producer may not write to makes its events wait (`Waiting`: no
    /// attempt used, not parked) with a reason naming the ACL to grant, while other topics keep
    /// flowing (docs/security.md).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unauthorized_topic_waits_and_other_topics_flow() {
        let (mock, transport) = mock_transport(&[]).await;
        mock.create_topic("other", 1, 1).expect("topic");
        let err = refused(
            &mock,
            &transport,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
        )
        .await;
        assert_eq!(err.kind, FailureKind::Waiting, "{err}");
        assert!(err.reason.contains("not authorised for topic"), "{err}");
        assert!(
            publish_with_retries(&transport, numbered("other", 2)).await,
            "other topics stopped"
        );
    }

    /// Guarantee: when the producer is replaced while a batch of key K has no outcome, no later
    /// record of K is acknowledged through the new producer before each record of that batch
    /// was acknowledged or came back; republished as the relay does (failed and held-back
    /// records again in sequence order, once their batch is recorded), the topic holds K's
    /// first occurrences in sequence order, none missing. Two batches of one key in flight:
    /// K:1..50 handed to a producer that cannot reach the broker, the producer replaced (as
    /// its delivery callbacks do after a timeout or a fatal error: its records are purged),
    /// then K:51..100 handed over with the broker back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replaced_producer_keeps_its_keys_until_their_records_are_recorded() {
        let (mock, transport) = mock_transport(&[("message.timeout.ms", "3000")]).await;
        let transport = Arc::new(transport);
        let events: Vec<OutboundEvent> = (1..=100).map(|n| numbered("jobs", n)).collect();
        let (first, second) = (events[..50].to_vec(), events[50..].to_vec());

        mock.broker_down(1).expect("broker down");
        let first_acks = tokio::spawn(timed(transport.send(&first).await));
        let generation = transport.producers_generation();
        let slot = transport.producer.clone();
        tokio::task::spawn_blocking(move || slot.replace(generation))
            .await
            .expect("replace");
        assert_eq!(transport.producers_generation(), generation + 1);
        mock.broker_up(1).expect("broker up");
        let second_acks = tokio::spawn(timed(transport.send(&second).await));

        let (first_out, first_done) = first_acks.await.expect("first batch");
        let (second_out, second_done) = second_acks.await.expect("second batch");
        assert!(
            first_out
                .iter()
                .all(|o| o.is_ok() || o.as_ref().is_err_and(|e| e.kind != FailureKind::Permanent)),
            "{first_out:?}"
        );
        if second_out.iter().any(Result::is_ok) {
            assert!(
                second_done >= first_done,
                "K:51.. acknowledged before K:1..50 had their outcomes"
            );
        }

        // Until the relay records the purged batch, its key stays fenced.
        assert!(transport.producer.fence.is_fenced(&first[0]));

        // As the relay: record both batches, then claim what is left in sequence order.
        let mut left: std::collections::BTreeMap<i64, OutboundEvent> = Default::default();
        for (batch, outcomes) in [(&first, first_out), (&second, second_out)] {
            for (e, o) in batch.iter().zip(outcomes) {
                if o.is_err() {
                    left.insert(e.seq, e.clone());
                }
            }
            transport.recorded(batch, true);
        }
        for _ in 0..30 {
            if left.is_empty() {
                break;
            }
            let batch: Vec<OutboundEvent> = left.values().cloned().collect();
            let outcomes = transport.send(&batch).await.await;
            transport.recorded(&batch, true);
            for (e, o) in batch.iter().zip(outcomes) {
                if o.is_ok() {
                    left.remove(&e.seq);
                }
            }
        }
        assert!(left.is_empty(), "never published: {:?}", left.keys());
        assert!(!transport.producer.fence.is_fenced(&first[0]));

        let values = read_back(&mock, "jobs", 101);
        let mut firsts: Vec<String> = Vec::new();
        for v in values.into_iter().skip(1) {
            if !firsts.contains(&v) {
                firsts.push(v);
            }
        }
        let expected: Vec<String> = (1..=100).map(|n| format!("{{\"n\":{n}}}")).collect();
        assert_eq!(firsts, expected, "K's first deliveries out of order");
    }

    /// Guarantee: while a key is fenced (a replaced producer had a record of it without an
    /// outcome), a later batch hands none of that key's records to the new producer — the first
    /// one and every later one of the key in the batch come back held back — while other keys
    /// go out; the key stays fenced until every batch holding it (the purged one and the one
    /// held back) is recorded, and then flows again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fenced_key_is_held_back_in_later_batches_until_both_are_recorded() {
        let (mock, transport) = mock_transport(&[("message.timeout.ms", "3000")]).await;
        let keyed = |seq: i64, key: &str| OutboundEvent {
            key: key.into(),
            ..numbered("jobs", seq)
        };
        mock.broker_down(1).expect("broker down");
        let purged = vec![keyed(1, "k")];
        let purged_acks = transport.send(&purged).await;
        let generation = transport.producers_generation();
        let slot = transport.producer.clone();
        tokio::task::spawn_blocking(move || slot.replace(generation))
            .await
            .expect("replace");
        mock.broker_up(1).expect("broker up");

        let later = vec![keyed(2, "k"), keyed(3, "other"), keyed(4, "k")];
        let outcomes = transport.send(&later).await.await;
        let kinds: Vec<Option<FailureKind>> = outcomes
            .iter()
            .map(|o| o.as_ref().err().map(|e| e.kind))
            .collect();
        assert_eq!(kinds[0], Some(FailureKind::HeldBack), "{outcomes:?}");
        assert_eq!(kinds[2], Some(FailureKind::HeldBack), "{outcomes:?}");
        assert_ne!(kinds[1], Some(FailureKind::HeldBack), "{outcomes:?}");

        let purged_out = purged_acks.await;
        assert!(purged_out[0].is_err(), "{purged_out:?}");
        transport.recorded(&purged, true);
        // The held-back batch's rows are not written back yet: the key stays fenced.
        assert!(transport.producer.fence.is_fenced(&later[0]));
        transport.recorded(&later, true);
        assert!(!transport.producer.fence.is_fenced(&later[0]));
        assert!(
            publish_with_retries(&transport, keyed(5, "k")).await,
            "the key never flowed again"
        );
    }

    /// Guarantee: a record that fails (here refused before sending as too large) holds its key
    /// across batches: a later batch in flight before the failed one is recorded sends none of
    /// that key's records — they come back held back, not published ahead of the failed one —
    /// while other keys go out; once the failed batch is recorded (its row back in the outbox,
    /// holding the key there) the key flows again. Before, only the failed record's own batch
    /// held the key's later records back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_record_holds_its_key_in_later_batches_until_recorded() {
        let (_mock, transport) = mock_transport(&[]).await;
        let keyed = |seq: i64, key: &str| OutboundEvent {
            key: key.into(),
            ..numbered("jobs", seq)
        };
        let too_large = OutboundEvent {
            payload: vec![b'x'; transport.max_message_bytes + 1],
            ..keyed(1, "k")
        };
        let failed = vec![too_large];
        let failed_out = transport.send(&failed).await.await;
        assert_eq!(
            failed_out[0].as_ref().err().map(|e| e.kind),
            Some(FailureKind::Permanent)
        );
        let later = vec![keyed(2, "k"), keyed(3, "other")];
        let outcomes = transport.send(&later).await.await;
        assert_eq!(
            outcomes[0].as_ref().err().map(|e| e.kind),
            Some(FailureKind::HeldBack),
            "{outcomes:?}"
        );
        assert!(outcomes[1].is_ok(), "{outcomes:?}");
        transport.recorded(&failed, true);
        transport.recorded(&later, true);
        assert!(!transport.producer.fence.is_fenced(&later[0]));
        assert!(
            publish_with_retries(&transport, keyed(4, "k")).await,
            "the key never flowed again"
        );
    }

    /// Awaits a batch's acknowledgements and notes when they were all in.
    async fn timed(acks: Acks) -> (Vec<Result<(), PublishError>>, std::time::Instant) {
        let outcomes = acks.await;
        (outcomes, std::time::Instant::now())
    }

    /// SASL and TLS secrets given as librdkafka properties never show in `Debug` output (which
    /// is what gets logged), while the rest of the configuration does.
    #[test]
    fn debug_output_redacts_secrets() {
        let mut c = KafkaConfig::new("broker:9092");
        c.properties
            .insert("sasl.password".into(), "hunter2".into());
        c.properties
            .insert("ssl.key.password".into(), "s3cret".into());
        c.properties.insert("sasl.username".into(), "relay".into());
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(
            shown.contains("relay") && shown.contains("broker:9092"),
            "{shown}"
        );
    }
}
