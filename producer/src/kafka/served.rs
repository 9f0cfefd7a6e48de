//! Whether every partition of a topic is served by its leader, before the relay's first records
//! go to it.
//!
//! A topic's partitions exist in the cluster's metadata a little before their leader has loaded
//! them (tens of milliseconds after `CreateTopics` returns, more under load). A produce request
//! that arrives in between fails (`NOT_LEADER_OR_FOLLOWER`) and is retried, but a second request
//! of the same idempotent producer, already in flight behind it, may arrive just after the
//! partition came up. A broker before Kafka 4.5 accepts *any* first sequence number from a
//! producer it has no state for on a partition (KIP-360; KAFKA-15591 changed that), so it
//! appends the second request; librdkafka then takes that success as proof that the first
//! request was written too and reports its records delivered ("implicitly acked"), though they
//! never were. The relay would delete their rows: lost events. Seen here: one event of 20,000 in
//! about one run of ten of `relay::graceful_shutdown_leaves_nothing_claimed`, on a topic the relay
//! had just created.
//!
//! So a topic becomes ready for the relay only once every one of its partitions answers a
//! `ListOffsets` request at its leader (librdkafka's watermark query), which the leader can only
//! do for a partition it has loaded: the same condition its produce path needs. The delivery
//! callback also refuses an acknowledgement without an offset (see `acks`), in case a record is
//! implicitly acked all the same.

use std::time::{Duration, Instant};

use rdkafka::producer::Producer;
use rdkafka::util::Timeout;

use crate::transport::{FailureKind, PublishError};

/// How long the relay waits for a topic's partitions to be served before it uses the topic all
/// the same (with a WARN line): a partition that stays unserved this long is offline, not being
/// created, and its records fail or wait rather than race its start.
const SERVED_WAIT: Duration = Duration::from_secs(10);

/// Between two looks at a topic whose partitions are not all served yet.
const SERVED_RECHECK: Duration = Duration::from_millis(50);

/// Waits until every partition of `topic` is served by its leader (see the module), for at most
/// [`SERVED_WAIT`]; returns the partitions still unserved then (logged by the caller). An error
/// only when the cluster cannot be asked at all.
pub(super) async fn await_partitions_served(
    producer: super::SharedProducer,
    topic: &str,
) -> Result<Vec<i32>, PublishError> {
    let deadline = Instant::now() + SERVED_WAIT;
    loop {
        let p = producer.clone();
        let name = topic.to_owned();
        let unserved = tokio::task::spawn_blocking(move || unserved_partitions(&p, &name))
            .await
            .map_err(|e| PublishError::new(FailureKind::Transient, e.to_string()))??;
        if unserved.is_empty() || Instant::now() >= deadline {
            return Ok(unserved);
        }
        tokio::time::sleep(SERVED_RECHECK).await;
    }
}

/// The partitions of `topic` whose leader does not answer for them yet (a topic without
/// partitions in the metadata counts as one unserved partition, `-1`).
fn unserved_partitions(
    producer: &super::SharedProducer,
    topic: &str,
) -> Result<Vec<i32>, PublishError> {
    let timeout = Timeout::After(Duration::from_secs(5));
    let metadata = producer
        .client()
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| {
            PublishError::new(
                super::classify::classify(&e),
                format!("metadata for {topic:?}: {e}"),
            )
        })?;
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(vec![-1]);
    };
    if t.partitions().is_empty() {
        return Ok(vec![-1]);
    }
    Ok(t.partitions()
        .iter()
        .filter(|p| {
            p.leader() < 0
                || producer
                    .client()
                    .fetch_watermarks(topic, p.id(), timeout)
                    .is_err()
        })
        .map(|p| p.id())
        .collect())
}
