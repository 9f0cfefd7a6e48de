//! The rdkafka consumer context: rebalance callbacks that never touch the database.
//!
//! librdkafka runs these callbacks synchronously inside the poll. On revocation they cancel the
//! partition's worker (it finishes or abandons its transaction; the database epoch fences it if
//! another consumer already took over) and hand the last processed offsets to an asynchronous
//! Kafka commit; on assignment they tell the runtime, whose worker then reads the stored offset
//! from the database and seeks there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

/// A (topic, partition) pair.
pub(crate) type Tp = (String, i32);

/// State shared between the callbacks and the runtime.
#[derive(Default)]
pub(crate) struct Ownership {
    /// Cancellation of the worker of every partition this consumer owns.
    pub owned: HashMap<Tp, CancellationToken>,
    /// Offsets committed to the database but not yet to Kafka.
    pub pending_commits: HashMap<Tp, i64>,
}

/// What the callbacks tell the runtime.
#[derive(Debug)]
pub(crate) enum RebalanceEvent {
    Assigned(Vec<Tp>),
    Revoked(Vec<Tp>),
}

pub(crate) struct Context {
    pub state: Arc<Mutex<Ownership>>,
    pub events: UnboundedSender<RebalanceEvent>,
    pub group: String,
    /// Subscribed topics the broker said do not exist: since when, and whether that was
    /// warned about.
    pub missing_topics: Mutex<HashMap<String, (std::time::Instant, bool)>>,
}

/// How long a subscribed topic may be missing before the consumer warns: at a normal start the
/// consumer often subscribes before the relay created the topic with its first event.
const MISSING_TOPIC_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// librdkafka's reason for a subscribed topic the broker does not know:
/// `Subscribed topic not available: <topic>: Broker: Unknown topic or partition`.
fn missing_subscribed_topic(reason: &str) -> Option<&str> {
    let rest = reason.split("Subscribed topic not available: ").nth(1)?;
    Some(rest.split(": ").next().unwrap_or(rest))
}

impl Context {
    /// A subscribed topic does not exist (yet): said at INFO the first time (librdkafka
    /// retries; the topic is assigned once it exists), warned about once when it is still
    /// missing after [`MISSING_TOPIC_PATIENCE`].
    fn topic_missing(&self, topic: &str) {
        let mut missing = self.missing_topics.lock().expect("missing topics");
        match missing.get_mut(topic) {
            None => {
                missing.insert(topic.to_owned(), (std::time::Instant::now(), false));
                tracing::info!(
                    topic,
                    "waiting for topic {topic:?} to exist (a relay creates it with its first event)"
                );
            }
            Some((since, warned @ false)) if since.elapsed() >= MISSING_TOPIC_PATIENCE => {
                *warned = true;
                tracing::warn!(
                    topic,
                    waited_s = since.elapsed().as_secs(),
                    "topic {topic:?} still does not exist: create it, or check the topic the consumer subscribes to"
                );
            }
            Some(_) => tracing::debug!(topic, "subscribed topic still missing"),
        }
    }
}

impl ClientContext for Context {
    /// An unreachable broker is one warning every 30 s (librdkafka reports it from every
    /// thread on every failed connection attempt); other global errors are logged as errors.
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        use rdkafka::types::RDKafkaErrorCode as C;
        if matches!(
            error.rdkafka_error_code(),
            Some(C::UnknownTopicOrPartition | C::UnknownTopic)
        ) {
            if let Some(topic) = missing_subscribed_topic(reason) {
                return self.topic_missing(topic);
            }
        }
        static UNREACHABLE_LOG: std::sync::LazyLock<postal_shared::LogThrottle> =
            std::sync::LazyLock::new(|| {
                postal_shared::LogThrottle::new(std::time::Duration::from_secs(30))
            });
        let unreachable = matches!(
            error.rdkafka_error_code(),
            Some(C::AllBrokersDown | C::BrokerTransportFailure | C::Resolve)
        );
        UNREACHABLE_LOG.kafka_client_error(unreachable, &error, reason);
    }

    /// librdkafka statistics (every `statistics.interval.ms`): the per-partition lag gauge
    /// `postal_consumer_lag` (high watermark minus the last offset committed to Kafka, which
    /// trails the database by at most `kafka_commit_interval`).
    fn stats(&self, stats: rdkafka::Statistics) {
        for (topic, t) in &stats.topics {
            for p in t.partitions.values() {
                if p.partition < 0 || p.consumer_lag < 0 {
                    continue;
                }
                metrics::gauge!("postal_consumer_lag", "group" => self.group.clone(), "topic" => topic.clone(), "partition" => p.partition.to_string())
                    .set(p.consumer_lag as f64);
            }
        }
    }
}

fn pairs(tpl: &TopicPartitionList) -> Vec<Tp> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

/// Takes the pending Kafka commits, as a partition list.
pub(crate) fn take_commits(state: &mut Ownership) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), off) in state.pending_commits.drain() {
        let _ = tpl.add_partition_offset(&topic, partition, Offset::Offset(off));
    }
    tpl
}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let tps = pairs(tpl);
            {
                let mut state = self.state.lock().expect("ownership state");
                for tp in &tps {
                    if let Some(cancel) = state.owned.remove(tp) {
                        cancel.cancel();
                    }
                    // Not committed to Kafka from here: a commit issued inside the rebalance
                    // can hold up the next assignment (seen with a Kafka-protocol broker). The database has the
                    // offsets; the next owner commits to Kafka as it goes.
                    state.pending_commits.remove(tp);
                }
            }
            tracing::info!(partitions = ?tps, "partitions revoked");
            let _ = self.events.send(RebalanceEvent::Revoked(tps));
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let tps = pairs(tpl);
                tracing::info!(partitions = ?tps, "partitions assigned");
                let _ = self.events.send(RebalanceEvent::Assigned(tps));
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "consumer group rebalance failed"),
        }
    }

    fn commit_callback(
        &self,
        result: rdkafka::error::KafkaResult<()>,
        _offsets: &TopicPartitionList,
    ) {
        if let Err(e) = result {
            tracing::debug!(error = %e, "asynchronous kafka offset commit failed (the database holds the offsets)");
        }
    }
}
