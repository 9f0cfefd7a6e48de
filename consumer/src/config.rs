//! Consumer settings with their documented defaults.

use std::collections::BTreeMap;
use std::time::Duration;

use postal_shared::Backoff;

use crate::Error;

/// What to do with records whose event type has no handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum UnknownTypes {
    /// Record them as dead letters (default): nothing is dropped silently.
    #[default]
    DeadLetter,
    /// Skip them (the offset advances; `postal_consumer_skipped_total` counts them). For
    /// topics that carry event types this consumer does not care about.
    Skip,
}

/// What the consumer does with an event that failed for good (its retries used up, or a
/// permanent failure, a panic, an undecodable payload).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FinalFailure {
    /// Record it as a dead letter and move on (default): later events of its key are applied
    /// without it.
    #[default]
    DeadLetter,
    /// Hold its key: the event and every later record of its key on the partition are stored
    /// in `postal.held_records`, in the transactions that move the offset past them, and are
    /// not applied until the key is released (`postal held release`, or the retry policy
    /// [`ConsumerConfig::hold_retry_after`]); other keys flow. For per-key ordered workflows
    /// (docs/guarantees.md, "Held keys"). A record without a key is dead-lettered.
    HoldKey,
}

/// How the consumer runtime connects, retries and shuts down. Every field has a default (see
/// [`ConsumerConfig::new`]); [`ConsumerConfig::validate`] rejects nonsensical values. `Debug`
/// redacts Kafka properties that look like secrets.
#[derive(Clone)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Kafka consumer group; also the key of the stored offsets.
    pub group: String,
    /// The dedup scope: `processed_events.consumer_name` of every handler of this runtime.
    /// Empty by default: the handlers name it (`#[idempotent(consumer = "...")]`), and
    /// [`ConsumerBuilder::on`](crate::ConsumerBuilder::on) refuses handlers that disagree.
    pub consumer: String,
    /// Partitions processed at the same time (default 8). Messages of one partition are
    /// always processed one after another, in offset order.
    pub max_concurrent_partitions: usize,
    /// Records of one partition processed in one transaction (default 1). Above 1 this is
    /// throughput mode: one multi-row dedup insert, bodies only for new ids, one offset
    /// advance; a failing record is isolated under a savepoint (see the crate docs).
    pub max_batch: usize,
    /// Delete `processed_events` rows of this consumer older than this (default 7 days), in
    /// batches, by one instance at a time; `None` keeps them. They must outlive the longest
    /// window in which a relay can republish an event (docs/consumer.md: "Dedup retention").
    pub dedup_retention: Option<Duration>,
    /// Delete this consumer's dead letters published to their dead-letter topic more than this
    /// long ago (unpublished ones are kept: the table is their only copy; so are ones published
    /// cut until replayed or resolved: the table is their only whole copy), in batches, every
    /// `cleanup_interval`; `None` (the default) keeps them. A deleted dead letter can no longer
    /// be replayed with `postal dead-letters replay`, and its copy on the `.dlq` topic lasts only
    /// as long as that topic's retention (the broker's default, 7 days on stock Kafka): set it
    /// only if losing unreplayed dead letters after that long is acceptable.
    pub dead_letter_retention: Option<Duration>,
    /// How often retention runs and `postal_consumer_dedup_oldest_seconds` is refreshed
    /// (default 60 s).
    pub cleanup_interval: Duration,
    /// Handler runs per event before a retryable failure becomes a dead letter (default 10).
    /// Outages ([`crate::HandlerError::Unavailable`], an unreachable database) never count.
    pub max_attempts: u32,
    /// Retry backoff: exponential with full jitter (default 100 ms doubling up to 30 s).
    pub backoff: Backoff,
    /// Records of types without a handler (default: dead letters).
    pub unknown_types: UnknownTypes,
    /// What happens to an event that failed for good (default: a dead letter).
    pub final_failure: FinalFailure,
    /// [`final_failure`](Self::final_failure) for the handlers named here (their
    /// `#[idempotent]` function names), over the consumer's.
    pub final_failure_by_handler: BTreeMap<String, FinalFailure>,
    /// The retry policy of held keys: the head of a held key (its failed event) is retried
    /// this long after it failed, again and again until it is applied or an operator acts
    /// (default `None`: only an operator releases a held key).
    pub hold_retry_after: Option<Duration>,
    /// Bytes of held records the group may store (default 256 MiB; each record counts as
    /// buffered, see [`partition_buffer_bytes`](Self::partition_buffer_bytes)). A hold that
    /// would pass it waits: its partition pauses (log line, `postal_consumer_held_full`),
    /// nothing is dropped; it resumes once released records bring the group below it. A
    /// group that holds nothing always takes one record.
    pub held_bytes_limit: u64,
    /// How often a partition with held keys looks for releases and due retries (default 1 s).
    pub held_poll: Duration,
    /// Suffix of dead-letter topics (default `.dlq`: records of `orders` go to `orders.dlq`).
    pub dlq_suffix: String,
    /// Partitions of dead-letter topics the consumer creates (default 1).
    pub dlq_partitions: i32,
    /// Replication factor of dead-letter topics the consumer creates (default -1: the broker's
    /// `default.replication.factor`); -1 or at least 1.
    pub dlq_replication: i32,
    /// How often processed offsets are also committed to Kafka, asynchronously, for lag
    /// tools (default 1 s). The database copy is the one the consumer resumes from.
    pub kafka_commit_interval: Duration,
    /// Records buffered per partition before fetching from it pauses (default 5000: more than
    /// one fetch of small records, `max.partition.fetch.bytes` 1 MiB, holds; a pause makes
    /// librdkafka drop what it prefetched for the partition and fetch it again, and with 1000
    /// the consumer bench ran at 0.17 of its SQL ceiling instead of 0.67, BENCHMARKS.md).
    /// Memory is bounded by [`partition_buffer_bytes`](Self::partition_buffer_bytes) either way.
    pub partition_buffer: usize,
    /// Bytes buffered per partition before fetching from it pauses (default 16 MiB; a record
    /// counts its key, value, and header names and values plus a per-header overhead). Without
    /// a [`memory_budget`](Self::memory_budget), librdkafka's prefetch queue (one for the whole
    /// consumer, `queued.max.messages.kbytes`) is bounded to this too.
    pub partition_buffer_bytes: usize,
    /// The most bytes of fetched, unprocessed records the whole consumer holds (default:
    /// none beyond the per-partition bound). Half goes to librdkafka's prefetch queue, half is
    /// split evenly among the assigned partitions' buffers (each at most
    /// `partition_buffer_bytes`, at least 1 MiB: with more than budget/2 MiB partitions the
    /// budget is exceeded). A partition's buffer may exceed its share by one record, plus the
    /// records librdkafka hands over before a pause takes effect (librdkafka applies it on a
    /// thread of its own): measured up to about 1.5 records per partition with the machine's
    /// two cores under a load average of 11 (`hostile::a_memory_budget_bounds_the_whole_consumer`).
    pub memory_budget: Option<usize>,
    /// Most headers a record may carry (default 256). A record with more is dead-lettered as
    /// undecodable without its headers being copied (each costs about 48 bytes in memory
    /// however small it is on the wire).
    pub max_headers: usize,
    /// When an owned partition has delivered nothing for this long while the broker's high
    /// watermark lies beyond the stored offset, the consumer logs a warning, resumes the
    /// partition and seeks to the stored offset again (default 10 s), once per stored offset
    /// and high watermark (transaction markers also keep the high watermark ahead). It guards
    /// against a fetch position lost to a broker fault; records are never skipped by it.
    pub stall_check: Duration,
    /// How long shutdown waits for in-flight transactions before abandoning (rolling back)
    /// them (default 10 s).
    pub shutdown_timeout: Duration,
    /// How long PostgreSQL keeps a processing transaction open once this consumer's host
    /// stops answering (a network cut, a crashed host): TCP keepalives probe the connection
    /// (first probe after half of it, then three more within the rest), `tcp_user_timeout`
    /// bounds data sent and not acknowledged, and `client_connection_check_interval` makes a
    /// running statement notice the dead connection too, set for the transaction's session
    /// only (default 30 s, `None`: the server's settings). A consumer cut off mid-transaction keeps its partition's offset row
    /// locked and the partition's next owner waits for it: this bounds the wait. A slow
    /// handler on a live host is not affected (its host answers the probes), nor is a frozen
    /// process (its kernel answers them): that one holds its partitions until it thaws. One
    /// exception: a handler that stops reading a query result larger than both socket
    /// buffers (tens of MB) for longer than this is cut, and retried as an outage. Whole
    /// seconds, 3 s to 18 h.
    pub lost_connection_timeout: Option<Duration>,
    /// Serve Prometheus `/metrics`, `/healthz` and `/readyz` (the database answers) on this
    /// address while the consumer runs (default: off). One per process.
    pub ops_addr: Option<std::net::SocketAddr>,
    /// Extra librdkafka consumer properties; they override Postal's defaults. The dead-letter
    /// producer takes them too, but the consumer-only ones, over the relay's producer defaults
    /// (see [`dlq_producer_config`](Self::dlq_producer_config)).
    pub kafka: BTreeMap<String, String>,
}

postal_shared::setters!(ConsumerConfig {
    brokers: String,
    group: String,
    consumer: String,
    max_concurrent_partitions: usize,
    max_batch: usize,
    dedup_retention: Option<Duration>,
    dead_letter_retention: Option<Duration>,
    cleanup_interval: Duration,
    max_attempts: u32,
    backoff: Backoff,
    unknown_types: UnknownTypes,
    final_failure: FinalFailure,
    final_failure_by_handler: BTreeMap<String, FinalFailure>,
    hold_retry_after: Option<Duration>,
    held_bytes_limit: u64,
    held_poll: Duration,
    dlq_suffix: String,
    dlq_partitions: i32,
    dlq_replication: i32,
    kafka_commit_interval: Duration,
    partition_buffer: usize,
    partition_buffer_bytes: usize,
    memory_budget: Option<usize>,
    max_headers: usize,
    stall_check: Duration,
    shutdown_timeout: Duration,
    lost_connection_timeout: Option<Duration>,
    ops_addr: Option<std::net::SocketAddr>,
    kafka: BTreeMap<String, String>,
});

impl std::fmt::Debug for ConsumerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kafka = postal_shared::secret::redacted_properties(&self.kafka);
        f.debug_struct("ConsumerConfig")
            .field("brokers", &self.brokers)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("max_batch", &self.max_batch)
            .field("dedup_retention", &self.dedup_retention)
            .field("dead_letter_retention", &self.dead_letter_retention)
            .field("max_concurrent_partitions", &self.max_concurrent_partitions)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("unknown_types", &self.unknown_types)
            .field("final_failure", &self.final_failure)
            .field("final_failure_by_handler", &self.final_failure_by_handler)
            .field("hold_retry_after", &self.hold_retry_after)
            .field("held_bytes_limit", &self.held_bytes_limit)
            .field("dlq_suffix", &self.dlq_suffix)
            .field("kafka_commit_interval", &self.kafka_commit_interval)
            .field("partition_buffer", &self.partition_buffer)
            .field("partition_buffer_bytes", &self.partition_buffer_bytes)
            .field("memory_budget", &self.memory_budget)
            .field("max_headers", &self.max_headers)
            .field("stall_check", &self.stall_check)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("lost_connection_timeout", &self.lost_connection_timeout)
            .field("ops_addr", &self.ops_addr)
            .field("kafka", &kafka)
            .finish_non_exhaustive()
    }
}

/// Refuses extra librdkafka properties that would make the consumer skip or misapply records;
/// the error names the property, its value and why.
fn check_overrides(kafka: &BTreeMap<String, String>) -> Result<(), Error> {
    let refuse = |k: &str, v: &str, why: &str| {
        Err(Error::Config(format!(
            "Kafka property {k}={v} is refused: {why}"
        )))
    };
    for (k, v) in kafka {
        let lower = v.trim().to_ascii_lowercase();
        match k.as_str() {
            "enable.auto.commit" | "enable.auto.offset.store" => return refuse(
                k,
                v,
                "managed by Postal (offsets are stored beside the effects; Kafka's copy is committed by Postal, never ahead of them)",
            ),
            "group.id" => return refuse(
                k,
                v,
                "managed by Postal: set ConsumerConfig::group, which also keys the stored offsets (another group.id would hand partitions to consumers that resume from other stored offsets)",
            ),
            "isolation.level" if lower != "read_committed" => return refuse(
                k,
                v,
                "records of aborted transactions would be processed; only read_committed is allowed",
            ),
            "auto.offset.reset" if matches!(lower.as_str(), "latest" | "largest" | "end") => {
                return refuse(
                    k,
                    v,
                    "a new group, or a stored offset no longer on the broker, would skip every record already on the topic; use earliest (default) or error",
                )
            }
            _ => {}
        }
    }
    Ok(())
}

impl ConsumerConfig {
    /// What happens to an event of the handler `handler` (none: no handler) that failed for
    /// good.
    pub(crate) fn final_failure_of(&self, handler: Option<&str>) -> FinalFailure {
        handler
            .and_then(|h| self.final_failure_by_handler.get(h).copied())
            .unwrap_or(self.final_failure)
    }

    /// Whether any failure of this consumer can hold a key.
    pub(crate) fn may_hold(&self) -> bool {
        self.final_failure == FinalFailure::HoldKey
            || self
                .final_failure_by_handler
                .values()
                .any(|f| *f == FinalFailure::HoldKey)
    }

    /// Defaults for the given brokers and consumer group (the dedup scope comes from the
    /// handlers).
    pub fn new(brokers: impl Into<String>, group: impl Into<String>) -> Self {
        ConsumerConfig {
            brokers: brokers.into(),
            group: group.into(),
            consumer: String::new(),
            max_concurrent_partitions: 8,
            max_batch: 1,
            dedup_retention: Some(Duration::from_secs(7 * 24 * 3600)),
            dead_letter_retention: None,
            cleanup_interval: Duration::from_secs(60),
            max_attempts: 10,
            backoff: Backoff {
                base: Duration::from_millis(100),
                max: Duration::from_secs(30),
            },
            unknown_types: UnknownTypes::DeadLetter,
            final_failure: FinalFailure::DeadLetter,
            final_failure_by_handler: BTreeMap::new(),
            hold_retry_after: None,
            held_bytes_limit: 256 * 1024 * 1024,
            held_poll: Duration::from_secs(1),
            dlq_suffix: ".dlq".into(),
            dlq_partitions: 1,
            dlq_replication: -1,
            kafka_commit_interval: Duration::from_secs(1),
            partition_buffer: 5000,
            partition_buffer_bytes: 16 * 1024 * 1024,
            memory_budget: None,
            max_headers: 256,
            stall_check: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(10),
            lost_connection_timeout: Some(Duration::from_secs(30)),
            ops_addr: None,
            kafka: BTreeMap::new(),
        }
    }

    /// Overrides settings from the process environment (see [`ConsumerConfig::with_vars`] for
    /// the variables), so a deployed consumer is tuned without a rebuild. Also warns, once, of
    /// `POSTAL_*` variables Postal does not read.
    pub fn with_env(self) -> Result<Self, Error> {
        postal_shared::env::warn_unknown();
        self.with_vars(|name| std::env::var(name).ok())
    }

    /// Overrides settings from variables looked up by `var`; unset variables keep the current
    /// value, an invalid one is a one-line error naming it. Durations are written `500ms`,
    /// `20s`, `7d`; `off` means never / keep forever. The names and forms are those of
    /// `postal relay` (README's configuration table lists them all):
    ///
    /// | variable | setting |
    /// |---|---|
    /// | `KAFKA_BOOTSTRAP_SERVERS` | [`brokers`](Self::brokers) |
    /// | `POSTAL_KAFKA_FILE` | a file of librdkafka properties, one `key=value` per line (`#` comments): the place for credentials |
    /// | `POSTAL_KAFKA` | extra librdkafka properties, `key=value` comma-separated (a comma splits only before the next `name=`); they override the file's |
    /// | `POSTAL_CONSUMER_GROUP` | [`group`](Self::group) (the Kafka consumer group) |
    /// | `POSTAL_MEMORY_BUDGET_BYTES` | [`memory_budget`](Self::memory_budget) |
    /// | `POSTAL_MAX_BATCH` | [`max_batch`](Self::max_batch) |
    /// | `POSTAL_MAX_CONCURRENT_PARTITIONS` | [`max_concurrent_partitions`](Self::max_concurrent_partitions) |
    /// | `POSTAL_MAX_ATTEMPTS` | [`max_attempts`](Self::max_attempts) |
    /// | `POSTAL_BACKOFF_BASE`, `POSTAL_BACKOFF_MAX` | [`backoff`](Self::backoff) |
    /// | `POSTAL_SHUTDOWN_TIMEOUT` | [`shutdown_timeout`](Self::shutdown_timeout) |
    /// | `POSTAL_METRICS_ADDR` | [`ops_addr`](Self::ops_addr) |
    /// | `POSTAL_DEDUP_RETENTION` | [`dedup_retention`](Self::dedup_retention) (`7d`; `off` = keep forever) |
    /// | `POSTAL_DEAD_LETTER_RETENTION` | [`dead_letter_retention`](Self::dead_letter_retention) (`30d`; `off` = keep forever) |
    /// | `POSTAL_CLEANUP_INTERVAL` | [`cleanup_interval`](Self::cleanup_interval) |
    /// | `POSTAL_LOST_CONNECTION_TIMEOUT` | [`lost_connection_timeout`](Self::lost_connection_timeout) (`30s`, `2m`; `off` = the server's settings) |
    /// | `POSTAL_FINAL_FAILURE` | [`final_failure`](Self::final_failure): `dead-letter` or `hold-key` |
    ///
    /// Names of earlier releases (`POSTAL_SHUTDOWN_TIMEOUT_MS`, `POSTAL_DEDUP_RETENTION_SECS`,
    /// `POSTAL_CLEANUP_INTERVAL_SECS`) are refused with the name that replaced them.
    pub fn with_vars(mut self, var: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        use postal_shared::env;
        let config = |e: String| Error::Config(e);
        env::refuse_renamed(&var).map_err(config)?;
        if let Some(v) = var("KAFKA_BOOTSTRAP_SERVERS") {
            self.brokers = v.trim().to_owned();
        }
        if let Some(path) = var("POSTAL_KAFKA_FILE") {
            let props = postal_shared::secret::read_properties_file(path.as_ref())
                .map_err(|e| Error::Config(format!("POSTAL_KAFKA_FILE: {e}")))?;
            self.kafka.extend(props);
        }
        if let Some(v) = var("POSTAL_KAFKA") {
            let props = postal_shared::secret::parse_properties(&v)
                .map_err(|e| Error::Config(format!("POSTAL_KAFKA: {e}")))?;
            self.kafka.extend(props);
        }
        if let Some(v) = var("POSTAL_CONSUMER_GROUP") {
            self.group = v.trim().to_owned();
        }
        if let Some(v) = var("POSTAL_MEMORY_BUDGET_BYTES") {
            self.memory_budget = if v.trim().eq_ignore_ascii_case("off") {
                None
            } else {
                Some(env::number("POSTAL_MEMORY_BUDGET_BYTES", &v).map_err(config)?)
            };
        }
        if let Some(v) = var("POSTAL_MAX_BATCH") {
            self.max_batch = env::number("POSTAL_MAX_BATCH", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_MAX_CONCURRENT_PARTITIONS") {
            self.max_concurrent_partitions =
                env::number("POSTAL_MAX_CONCURRENT_PARTITIONS", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_MAX_ATTEMPTS") {
            self.max_attempts = env::number("POSTAL_MAX_ATTEMPTS", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_BACKOFF_BASE") {
            self.backoff.base = env::duration("POSTAL_BACKOFF_BASE", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_BACKOFF_MAX") {
            self.backoff.max = env::duration("POSTAL_BACKOFF_MAX", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_SHUTDOWN_TIMEOUT") {
            self.shutdown_timeout = env::duration("POSTAL_SHUTDOWN_TIMEOUT", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_METRICS_ADDR") {
            self.ops_addr = if v.trim().eq_ignore_ascii_case("off") {
                None
            } else {
                Some(env::number("POSTAL_METRICS_ADDR", &v).map_err(config)?)
            };
        }
        if let Some(v) = var("POSTAL_DEDUP_RETENTION") {
            self.dedup_retention =
                env::optional_duration("POSTAL_DEDUP_RETENTION", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_DEAD_LETTER_RETENTION") {
            self.dead_letter_retention =
                env::optional_duration("POSTAL_DEAD_LETTER_RETENTION", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_CLEANUP_INTERVAL") {
            self.cleanup_interval = env::duration("POSTAL_CLEANUP_INTERVAL", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_LOST_CONNECTION_TIMEOUT") {
            self.lost_connection_timeout =
                env::optional_duration("POSTAL_LOST_CONNECTION_TIMEOUT", &v).map_err(config)?;
        }
        if let Some(v) = var("POSTAL_FINAL_FAILURE") {
            self.final_failure = match v.trim() {
                "dead-letter" => FinalFailure::DeadLetter,
                "hold-key" => FinalFailure::HoldKey,
                other => {
                    return Err(Error::Config(format!(
                        "POSTAL_FINAL_FAILURE: {} is neither dead-letter nor hold-key",
                        postal_shared::text::quoted(other)
                    )))
                }
            };
        }
        self.validate()?;
        Ok(self)
    }

    /// The statement that opens a processing transaction: `BEGIN`, plus the session settings
    /// of [`lost_connection_timeout`](Self::lost_connection_timeout) for the transaction, in
    /// one round trip.
    pub(crate) fn begin_statement(&self) -> String {
        match self.lost_connection_timeout {
            Some(d) => {
                // Linux takes keepalive times up to 32,767 s.
                let secs = d.as_secs().clamp(3, 65_534);
                let (idle, interval) = (secs / 2, (secs / 2 / 3).max(1));
                // Keepalives cover an idle connection, `tcp_user_timeout` one with data the
                // server sent unacknowledged (no keepalive is sent then: without it the kernel
                // retransmits for ~15 min), `client_connection_check_interval` a running
                // statement. Known cost: `tcp_user_timeout` also aborts a live client that
                // stops reading a result larger than both socket buffers for that long.
                format!(
                    "BEGIN; SET LOCAL tcp_keepalives_idle = {idle}; SET LOCAL tcp_keepalives_interval = {interval}; SET LOCAL tcp_keepalives_count = 3; SET LOCAL tcp_user_timeout = {}; SET LOCAL client_connection_check_interval = {}",
                    secs * 1000,
                    interval * 1000
                )
            }
            None => "BEGIN".into(),
        }
    }

    /// Checks the settings; the error names the offending one.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: &str| Err(Error::Config(m.to_owned()));
        if self.brokers.trim().is_empty() {
            return bad("brokers must not be empty");
        }
        if self.group.trim().is_empty() {
            return bad("group must not be empty");
        }
        if !self.consumer.is_empty() && self.consumer.trim().is_empty() {
            return bad("consumer name must not be blank");
        }
        if self.max_concurrent_partitions == 0 || self.max_concurrent_partitions > 1024 {
            return bad("max concurrent partitions must be between 1 and 1024");
        }
        if self.max_batch == 0 || self.max_batch > 10_000 {
            return bad("max batch must be between 1 and 10000");
        }
        if self
            .dedup_retention
            .is_some_and(|r| r < postal_shared::cleanup::MIN_DEDUP_RETENTION)
        {
            return bad("dedup retention must be at least 1h (or disabled): a shorter one lets a copy that arrives after an outage apply twice");
        }
        if self
            .dead_letter_retention
            .is_some_and(|r| r < Duration::from_secs(3600))
        {
            return bad("dead-letter retention must be at least 1h (or disabled)");
        }
        if self.held_poll.is_zero() {
            return bad("held poll must be positive");
        }
        if self.hold_retry_after.is_some_and(|d| d.is_zero()) {
            return bad("hold retry delay must be positive (or none)");
        }
        if self.cleanup_interval.is_zero() {
            return bad("cleanup interval must be positive");
        }
        if self.stall_check < Duration::from_secs(1) {
            return bad("stall check must be at least 1s");
        }
        if self.max_attempts == 0 {
            return bad("max attempts must be at least 1");
        }
        if self.dlq_suffix.is_empty() {
            return bad("dead-letter suffix must not be empty");
        }
        if postal_shared::Topic::new(format!("orders{}", self.dlq_suffix)).is_err() {
            return Err(Error::Config(format!(
                "dead-letter suffix {:?} makes no valid topic name (letters, digits, '.', '_', '-')",
                self.dlq_suffix
            )));
        }
        if self.backoff.base.is_zero() || self.backoff.max < self.backoff.base {
            return bad("backoff base must be positive and not above the backoff max");
        }
        if self.dlq_partitions < 1 {
            return bad("dead-letter topic partitions must be at least 1");
        }
        if self.dlq_replication < 1 && self.dlq_replication != -1 {
            return bad("dead-letter topic replication must be -1 (the broker's default.replication.factor) or at least 1");
        }
        if self.kafka_commit_interval.is_zero() {
            return bad("kafka commit interval must be positive");
        }
        if self.partition_buffer == 0 {
            return bad("partition buffer must be at least 1");
        }
        if self.partition_buffer_bytes < 1024 * 1024 {
            return bad("partition buffer bytes must be at least 1 MiB");
        }
        if self.memory_budget.is_some_and(|b| b < 4 * 1024 * 1024) {
            return bad("memory budget must be at least 4 MiB");
        }
        if self.max_headers < 16 {
            return bad("max headers must be at least 16 (Postal writes up to 11)");
        }
        check_overrides(&self.kafka)?;
        self.dlq_producer_config().map(drop)
    }

    /// The librdkafka consumer configuration: Postal's defaults, then the user's properties.
    ///
    /// Defaults: `enable.auto.commit=false` (Postal commits processed offsets itself),
    /// `auto.offset.reset=earliest`, `isolation.level=read_committed`,
    /// `enable.partition.eof=false`, `statistics.interval.ms=15000` (feeds the lag gauge),
    /// `topic.metadata.refresh.interval.ms=10000` (topics created later are picked up),
    /// `queued.max.messages.kbytes` = half the [`memory_budget`](Self::memory_budget), else
    /// [`partition_buffer_bytes`](Self::partition_buffer_bytes).
    pub fn client_config(&self) -> rdkafka::ClientConfig {
        let mut cfg = rdkafka::ClientConfig::new();
        cfg.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("isolation.level", "read_committed")
            .set("enable.partition.eof", "false")
            .set("statistics.interval.ms", "15000")
            // Notice subscribed topics created after start within seconds, not librdkafka's
            // default 5 minutes.
            .set("topic.metadata.refresh.interval.ms", "10000")
            // librdkafka prefetches up to 64 MiB by default: bounded to half the memory
            // budget, or to one partition buffer's size.
            .set(
                "queued.max.messages.kbytes",
                (self
                    .memory_budget
                    .map_or(self.partition_buffer_bytes, |b| b / 2)
                    / 1024)
                    .to_string(),
            )
            .set("log_level", "4");
        for (k, v) in &self.kafka {
            cfg.set(k, v);
        }
        cfg
    }

    /// The librdkafka producer configuration for dead letters: the one every Postal producer
    /// is made from ([`postal_shared::kafka_producer::config`]: idempotent, `acks=all`, Java's
    /// murmur2 partitioner), with [`kafka`](Self::kafka) but its consumer-only properties; an
    /// error for a property that would break durability or per-key order.
    pub fn dlq_producer_config(&self) -> Result<rdkafka::ClientConfig, Error> {
        postal_shared::kafka_producer::config(&self.brokers, &self.kafka)
            .map_err(|e| Error::Config(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Environment overrides apply, unset ones keep defaults, and a bad value is an error that
    /// names the variable.
    #[test]
    fn environment_overrides_and_names_bad_values() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_string())
            }
        };
        let c = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[
                (
                    "POSTAL_KAFKA",
                    "session.timeout.ms=6000, fetch.wait.max.ms=10",
                ),
                ("POSTAL_MAX_BATCH", "200"),
                ("POSTAL_METRICS_ADDR", "127.0.0.1:9464"),
                ("POSTAL_DEDUP_RETENTION", "off"),
                ("POSTAL_SHUTDOWN_TIMEOUT", "5s"),
                ("POSTAL_CLEANUP_INTERVAL", "2m"),
                ("POSTAL_BACKOFF_BASE", "50ms"),
                ("POSTAL_BACKOFF_MAX", "1m"),
                ("KAFKA_BOOTSTRAP_SERVERS", "k1:9092,k2:9092"),
            ]))
            .unwrap();
        assert_eq!(c.brokers, "k1:9092,k2:9092");
        assert_eq!(c.shutdown_timeout, Duration::from_secs(5));
        assert_eq!(c.cleanup_interval, Duration::from_secs(120));
        assert_eq!(c.backoff.base, Duration::from_millis(50));
        assert_eq!(c.backoff.max, Duration::from_secs(60));
        assert_eq!(c.max_batch, 200);
        assert_eq!(c.kafka["session.timeout.ms"], "6000");
        assert_eq!(c.kafka["fetch.wait.max.ms"], "10");
        assert_eq!(c.ops_addr, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(c.max_attempts, 10);
        assert_eq!(c.dedup_retention, None);
        let err = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_MAX_BATCH", "lots")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("POSTAL_MAX_BATCH"), "{err}");
        // The relay's names and forms: a shared env file means the same to both.
        let err = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_SHUTDOWN_TIMEOUT_MS", "5000")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("set POSTAL_SHUTDOWN_TIMEOUT instead"), "{err}");
        let err = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_SHUTDOWN_TIMEOUT", "5000")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(
                "invalid consumer configuration: POSTAL_SHUTDOWN_TIMEOUT=\"5000\" is not valid"
            ),
            "{err}"
        );
        let err = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_KAFKA", "enable.auto.commit=true")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("managed by Postal"), "{err}");
        assert_eq!(
            c.lost_connection_timeout,
            Some(Duration::from_secs(30)),
            "default"
        );
        assert_eq!(
            c.begin_statement(),
            "BEGIN; SET LOCAL tcp_keepalives_idle = 15; SET LOCAL tcp_keepalives_interval = 5; SET LOCAL tcp_keepalives_count = 3; SET LOCAL tcp_user_timeout = 30000; SET LOCAL client_connection_check_interval = 5000"
        );
        let c = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_LOST_CONNECTION_TIMEOUT", "2m")]))
            .unwrap();
        assert_eq!(c.lost_connection_timeout, Some(Duration::from_secs(120)));
        let c = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_LOST_CONNECTION_TIMEOUT", "0s")]))
            .unwrap();
        assert_eq!(
            (c.lost_connection_timeout, c.begin_statement().as_str()),
            (None, "BEGIN")
        );
        let err = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_LOST_CONNECTION_TIMEOUT", "soon")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("POSTAL_LOST_CONNECTION_TIMEOUT"), "{err}");
        assert_eq!(c.final_failure, FinalFailure::DeadLetter, "default");
        let c = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_FINAL_FAILURE", "hold-key")]))
            .unwrap();
        assert_eq!(c.final_failure, FinalFailure::HoldKey);
        let err = ConsumerConfig::new("b:9092", "g")
            .with_vars(vars(&[("POSTAL_FINAL_FAILURE", "hold")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("POSTAL_FINAL_FAILURE") && err.contains("hold-key"),
            "{err}"
        );
    }

    /// Guarantee: consumer overrides that would skip records, process aborted ones, store
    /// offsets behind Postal's back, or put dead letters on another partition than Java's
    /// partitioner picks for their key are refused with one line naming the property, its
    /// value and the reason; safe ones (and the defaults' own values) are accepted.
    #[test]
    fn skipping_or_misapplying_overrides_are_refused() {
        for (k, v) in [
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "true"),
            ("group.id", "other"),
            ("isolation.level", "read_uncommitted"),
            ("auto.offset.reset", "latest"),
            ("auto.offset.reset", "largest"),
            ("auto.offset.reset", "end"),
            ("partitioner", "consistent_random"),
            ("acks", "1"),
        ] {
            let mut c = ConsumerConfig::new("b:9092", "g");
            c.kafka.insert(k.into(), v.into());
            let err = c.validate().unwrap_err().to_string();
            assert!(
                err.contains(&format!("Kafka property {k}={v} is refused: ")),
                "{k}={v}: {err}"
            );
            assert_eq!(err.lines().count(), 1, "{err}");
        }
        for (k, v) in [
            ("isolation.level", "read_committed"),
            ("auto.offset.reset", "earliest"),
            ("auto.offset.reset", "error"),
            ("session.timeout.ms", "6000"),
            ("security.protocol", "SASL_SSL"),
        ] {
            let mut c = ConsumerConfig::new("b:9092", "g");
            c.kafka.insert(k.into(), v.into());
            c.validate()
                .unwrap_or_else(|e| panic!("{k}={v} must be accepted: {e}"));
        }
    }

    /// Secrets in Kafka properties never show in `Debug` output; bad values are rejected with
    /// the setting named.
    #[test]
    fn debug_redacts_secrets_and_validate_names_the_setting() {
        let mut c = ConsumerConfig::new("b:9092", "g");
        c.kafka.insert("sasl.password".into(), "hunter2".into());
        c.kafka.insert("ssl.key.password".into(), "s3cret".into());
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(shown.contains("<redacted>"));
        c.validate().unwrap();
        c.max_batch = 0;
        assert!(c.validate().unwrap_err().to_string().contains("max batch"));
        let mut c = ConsumerConfig::new("b:9092", "g");
        c.stall_check = Duration::from_millis(10);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("stall check"));
        let mut c = ConsumerConfig::new("b:9092", "g");
        c.kafka.insert("enable.auto.commit".into(), "true".into());
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("managed by Postal"));
    }

    /// Guarantee: dead-letter topics the consumer creates take the broker's
    /// `default.replication.factor` unless given (`-1`); an explicit factor is accepted, and
    /// 0 or another negative one is refused with the setting named.
    #[test]
    fn dead_letter_topics_take_the_brokers_replication_unless_given() {
        let c = ConsumerConfig::new("b:9092", "g");
        assert_eq!(c.dlq_replication, -1);
        c.validate().unwrap();
        for ok in [1, 3] {
            let mut c = ConsumerConfig::new("b:9092", "g");
            c.dlq_replication = ok;
            c.validate().unwrap();
        }
        for bad in [0, -2] {
            let mut c = ConsumerConfig::new("b:9092", "g");
            c.dlq_replication = bad;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("dead-letter topic replication"), "{e}");
        }
    }
}
