//! Helpers shared by the scenarios.

pub mod dashboard;
pub mod held_up;
pub mod pg_proxy;
pub mod roles;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use postal_producer::{
    FailureKind, KafkaConfig, KafkaTransport, OutboundEvent, PublishError, Relay, RelayConfig,
    RelayStats, Transport,
};
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A relay running in a task, stopped through `stop()`.
pub struct RunningRelay {
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<RelayStats, postal_producer::Error>>,
    own_pool: Option<PgPool>,
}

impl RunningRelay {
    /// Starts a relay with the given transport and config.
    pub fn start<T: Transport>(pool: &PgPool, transport: T, config: RelayConfig) -> Self {
        let relay = Relay::new(pool.clone(), transport, config).expect("valid relay config");
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(relay.run(async move {
            let _ = rx.await;
        }));
        RunningRelay {
            stop: Some(tx),
            handle,
            own_pool: None,
        }
    }

    /// Marks `pool` as this relay's own (see [`TestDb::process_pool`]): `kill` closes it.
    pub fn owning(mut self, pool: PgPool) -> Self {
        self.own_pool = Some(pool);
        self
    }

    /// Starts a Kafka relay with test-friendly settings.
    pub fn kafka(pool: &PgPool, bootstrap: &str) -> Self {
        Self::start(pool, kafka_transport(bootstrap), fast_config())
    }

    /// Kills the relay: its task is dropped with whatever it was doing, no shutdown work, no
    /// lease given up. Returns once the task is gone and, if the relay owns its pool, that pool
    /// is closed, so the server rolls back whatever its connections left open, as it does
    /// when a process dies.
    pub async fn kill(self) {
        kill(self.handle, self.own_pool).await;
    }

    /// Graceful shutdown; returns the relay's totals.
    pub async fn stop(mut self) -> RelayStats {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.handle.await.expect("relay task").expect("relay run")
    }
}

/// Kafka transport for tests.
pub fn kafka_transport(bootstrap: &str) -> KafkaTransport {
    let mut cfg = KafkaConfig::new(bootstrap);
    cfg.topic_partitions = 4;
    // Within half the tests' 3 s lease.
    cfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    KafkaTransport::new(cfg).expect("kafka transport")
}

/// Relay settings for tests: quick polling and backoff.
pub fn fast_config() -> RelayConfig {
    RelayConfig::default()
        .batch_size(500)
        .poll_interval(Duration::from_millis(200))
        .lease(Duration::from_secs(3))
        .backoff(postal_producer::Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(500),
        })
        .shutdown_timeout(Duration::from_secs(10))
}

/// Claims up to 1,000 rows of every partition as a fresh relay that will "die" holding them
/// (the caller drops the claim without recording it, as when the process is killed).
pub async fn claim_as_doomed_relay(pool: &PgPool) -> postal_producer::testing::claim::Claim {
    use postal_producer::testing::{claim, lease};
    let doomed = uuid::Uuid::now_v7();
    let held = lease::heartbeat(
        pool,
        lease::DEFAULT_GROUP,
        doomed,
        "",
        Duration::from_secs(3),
        &[],
        true,
    )
    .await
    .unwrap();
    assert_eq!(held.held.len(), 256, "a lone relay holds every partition");
    claim::claim(
        pool,
        doomed,
        &claim::all_partitions(),
        1000,
        Duration::from_secs(3),
        true,
        &postal_producer::TopicFilter::All,
    )
    .await
    .unwrap()
    .expect("rows to claim")
}

/// Rows in the outbox.
pub async fn outbox_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Counts failures by kind as they pass through a wrapped transport.
#[derive(Clone, Default)]
pub struct FailureCounts {
    pub unavailable: Arc<AtomicU64>,
    pub held_back: Arc<AtomicU64>,
    pub other: Arc<AtomicU64>,
}

/// A transport decorator that counts failure outcomes.
pub struct Counting<T> {
    pub inner: T,
    pub counts: FailureCounts,
}

impl<T: Transport> Transport for Counting<T> {
    type Acks = futures::future::BoxFuture<'static, Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        let acks = self.inner.send(batch).await;
        let counts = self.counts.clone();
        Box::pin(async move {
            let out = acks.await;
            for r in &out {
                match r {
                    Err(e) if e.kind == FailureKind::Unavailable => {
                        counts.unavailable.fetch_add(1, Ordering::Relaxed);
                    }
                    // Events queued behind a failed one of their key: the relay never
                    // counts these as attempts.
                    Err(e) if e.kind == FailureKind::HeldBack => {
                        counts.held_back.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        counts.other.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(()) => {}
                }
            }
            out
        })
    }

    // A decorator passes these on: a wrapped task runner must still be checked out to.
    fn checks_out(&self) -> Option<usize> {
        self.inner.checks_out()
    }

    fn abort_running(&self) {
        self.inner.abort_running()
    }

    fn recorded(&self, batch: &[OutboundEvent], committed: bool) {
        self.inner.recorded(batch, committed)
    }
}

/// A consumer runtime running in a task.
pub struct RunningConsumer {
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<(), postal_consumer::Error>>,
    own_pool: Option<PgPool>,
    /// The runtime's counters.
    pub stats: Arc<postal_consumer::Stats>,
}

impl RunningConsumer {
    /// Starts a built consumer.
    pub fn start(consumer: postal_consumer::Consumer) -> Self {
        let stats = consumer.stats();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(consumer.run(async move {
            let _ = rx.await;
        }));
        RunningConsumer {
            stop: Some(tx),
            handle,
            own_pool: None,
            stats,
        }
    }

    /// Marks `pool` as this consumer's own (see [`TestDb::process_pool`]): `kill` closes it.
    pub fn owning(mut self, pool: PgPool) -> Self {
        self.own_pool = Some(pool);
        self
    }

    /// Drops the runtime mid-flight, nothing finished. Returns once the task is gone and, if
    /// the consumer owns its pool, that pool is closed, so the server rolls back its
    /// in-flight transactions, as it does when a process dies.
    pub async fn kill(self) {
        kill(self.handle, self.own_pool).await;
    }

    /// Graceful shutdown.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.handle
            .await
            .expect("consumer task")
            .expect("consumer run");
    }
}

/// Aborts `handle`, waits until its task is gone, then closes `own_pool`, as a process's death
/// closes its connections. Postal's own transactions begin cancel-safely
/// (`postal_shared::cancel_safe`), but a killed process leaves nothing behind at all: with a
/// pool shared with the test, what the aborted code still held (a connection, a lock) would
/// outlive the "dead" process.
async fn kill<T>(handle: JoinHandle<T>, own_pool: Option<PgPool>) {
    handle.abort();
    if let Err(e) = handle.await {
        if e.is_panic() {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    if let Some(pool) = own_pool {
        tokio::time::timeout(Duration::from_secs(30), pool.close())
            .await
            .expect("the killed task's pool closes");
    }
}

/// Consumer settings for tests: a short session timeout (a killed member's partitions move on
/// quickly), quick retries.
pub fn consumer_config(
    bootstrap: &str,
    group: &str,
    consumer: &str,
) -> postal_consumer::ConsumerConfig {
    let mut c = postal_consumer::ConsumerConfig::new(bootstrap, group);
    // Tests name the dedup scope here too, so a handler of another scope is refused.
    c.consumer = consumer.into();
    c.backoff = postal_producer::Backoff {
        base: Duration::from_millis(20),
        max: Duration::from_millis(200),
    };
    c.kafka_commit_interval = Duration::from_millis(200);
    for (k, v) in [
        ("session.timeout.ms", "6000"),
        ("max.poll.interval.ms", "10000"),
        ("heartbeat.interval.ms", "500"),
    ] {
        c.kafka.insert(k.into(), v.into());
    }
    if let Ok(debug) = std::env::var("POSTAL_KAFKA_DEBUG") {
        c.kafka.insert("debug".into(), debug);
        c.kafka.insert("log_level".into(), "7".into());
    }
    c
}

/// Creates `topic` with `partitions` partitions.
pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) {
    create_topic_replicated(bootstrap, topic, partitions, 1).await;
}

/// Creates `topic` with `partitions` partitions of `replication` replicas each.
pub async fn create_topic_replicated(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    replication: i32,
) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let res = admin
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(replication),
            )],
            &AdminOptions::new(),
        )
        .await
        .expect("create topic");
    for r in res {
        r.expect("topic created");
    }
}

/// One record to write straight to Kafka (bypassing the outbox), for malformed-input tests.
pub struct RawRecord {
    /// Record key.
    pub key: Option<String>,
    /// Record value.
    pub payload: Vec<u8>,
    /// Headers.
    pub headers: Vec<(&'static str, String)>,
}

impl RawRecord {
    /// A well-formed Postal record: `ce_id`, `ce_type`, JSON content type.
    pub fn event(id: uuid::Uuid, key: &str, event_type: &str, payload: serde_json::Value) -> Self {
        RawRecord {
            key: Some(key.to_owned()),
            payload: serde_json::to_vec(&payload).unwrap(),
            headers: vec![
                ("ce_id", id.to_string()),
                ("ce_type", event_type.to_owned()),
                ("content-type", "application/json".to_owned()),
            ],
        }
    }
}

/// Writes records to `topic` (all to `partition` when given, else by key) and waits for acks.
pub async fn produce(bootstrap: &str, topic: &str, partition: Option<i32>, records: &[RawRecord]) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    let sends = records.iter().map(|r| {
        let mut h = OwnedHeaders::new();
        for (k, v) in &r.headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_str()),
            });
        }
        let mut rec: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic)
            .payload(r.payload.as_slice())
            .headers(h);
        if let Some(k) = &r.key {
            rec = rec.key(k.as_str());
        }
        if let Some(p) = partition {
            rec = rec.partition(p);
        }
        producer.send(rec, Duration::from_secs(30))
    });
    for r in futures::future::join_all(sends).await {
        r.expect("record acknowledged");
    }
}

/// Creates the `effects` table the consumer scenarios' handlers write to. It has no unique
/// constraint on `event_id`, so an event applied twice shows up as two rows.
pub async fn effects_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE effects (id bigserial PRIMARY KEY, event_id uuid NOT NULL,
                               n bigint NOT NULL, consumer text NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// (rows, distinct event ids) in `effects`.
pub async fn effects(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A consumer that routes `job` events on `topic` to [`crate::handlers::apply`] (not started:
/// tests take their fault-injection hooks from it first).
pub fn apply_consumer(
    pool: &PgPool,
    topic: &str,
    config: postal_consumer::ConsumerConfig,
) -> postal_consumer::Consumer {
    apply_consumer_with(pool, topic, config, crate::handlers::Probe::default())
}

/// [`apply_consumer`] whose handler reports its runs to `probe`.
pub fn apply_consumer_with(
    pool: &PgPool,
    topic: &str,
    config: postal_consumer::ConsumerConfig,
    probe: crate::handlers::Probe,
) -> postal_consumer::Consumer {
    postal_consumer::Consumer::builder(pool.clone(), config)
        .state(probe)
        .on(topic, "job", crate::handlers::apply)
        .build()
        .expect("valid consumer")
}

/// Starts a consumer that routes `job` events on `topic` to [`crate::handlers::apply`].
pub fn start_apply(
    pool: &PgPool,
    topic: &str,
    config: postal_consumer::ConsumerConfig,
) -> RunningConsumer {
    RunningConsumer::start(apply_consumer(pool, topic, config))
}

/// [`start_apply`] whose handler reports its runs to `probe`.
pub fn start_apply_with(
    pool: &PgPool,
    topic: &str,
    config: postal_consumer::ConsumerConfig,
    probe: crate::handlers::Probe,
) -> RunningConsumer {
    RunningConsumer::start(apply_consumer_with(pool, topic, config, probe))
}
