//! Topics: whether a topic exists (created when allowed), and the state of each as last seen,
//! so that a missing topic's events wait and are rechecked every few seconds.

use std::time::Duration;

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::Producer;
use rdkafka::util::Timeout;

use super::classify::{classify, classify_code};
use super::KafkaTransport;
use crate::transport::{FailureKind, PublishError};

#[derive(Clone, Debug)]
pub(super) enum TopicState {
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
pub(super) fn not_authorised(topic: &str) -> String {
    format!(
        "the relay is not authorised for topic {topic:?}: grant its Kafka principal WRITE and DESCRIBE on the topic (Kafka ACLs); its events wait until then"
    )
}

fn missing_topic(topic: &str, why: &str) -> String {
    format!(
        "topic {topic:?} does not exist and {why}: create it (kafka-topics.sh --bootstrap-server <broker> --create --topic {topic}); its events wait until it exists"
    )
}

/// A topic's own `max.message.bytes` (the effective value: the topic's, else the broker's
/// default), when it could be read, and when it was asked.
#[derive(Clone, Copy, Debug)]
pub(super) struct TopicLimit {
    bytes: Option<usize>,
    asked: std::time::Instant,
}

/// How long a topic's `max.message.bytes` is taken as read before it is asked again.
const TOPIC_LIMIT_RECHECK: Duration = Duration::from_secs(300);

impl KafkaTransport {
    /// The topic's own `max.message.bytes`, asked of the cluster at most every
    /// [`TOPIC_LIMIT_RECHECK`] (`None`: it could not be read, e.g. no `DescribeConfigs`
    /// right; asked again as late). The broker checks a whole record batch, after compression,
    /// against it; the transport compares a record's size before compression: a record over
    /// it may still be taken, and goes out alone in its key (see `transport::send`).
    pub(super) async fn topic_limit(&self, topic: &str) -> Option<usize> {
        if let Some(l) = self.limits.lock().expect("topic limits").get(topic) {
            if l.asked.elapsed() < TOPIC_LIMIT_RECHECK {
                return l.bytes;
            }
        }
        let opts =
            AdminOptions::new().request_timeout(Some(Timeout::After(Duration::from_secs(5))));
        let asked = self
            .admin
            .describe_configs(&[rdkafka::admin::ResourceSpecifier::Topic(topic)], &opts)
            .await;
        let bytes = match asked {
            Ok(results) => results.into_iter().find_map(|r| {
                r.ok()?
                    .get("max.message.bytes")?
                    .value
                    .as_deref()?
                    .parse()
                    .ok()
            }),
            Err(e) => {
                tracing::debug!(topic, error = %e, "cannot read the topic's max.message.bytes");
                None
            }
        };
        self.limits.lock().expect("topic limits").insert(
            topic.to_owned(),
            TopicLimit {
                bytes,
                asked: std::time::Instant::now(),
            },
        );
        bytes
    }

    /// Makes sure `topic` exists before records go to it. A topic that is missing (topic
    /// creation off, or refused by the cluster) is not the events' fault: they wait, retried
    /// without using up attempts, and the relay logs which topic to create and how.
    pub(super) async fn ensure_topic(&self, topic: &str) -> Result<(), PublishError> {
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
            Ok(true) => self.served(topic).await,
            Ok(false) if self.config.create_topics => match self.create_topic(topic).await {
                Ok(()) => self.served(topic).await,
                Err(e) => Err(e),
            },
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

    /// Waits until the leaders serve every partition of `topic` (see [`super::served`]): the
    /// relay's first records must not race a partition's start. A partition still unserved
    /// after the wait is said once; the topic is used all the same.
    async fn served(&self, topic: &str) -> Result<(), PublishError> {
        let unserved = super::served::await_partitions_served(self.producer(), topic).await?;
        if !unserved.is_empty() {
            tracing::warn!(
                topic,
                ?unserved,
                "partitions of topic {topic:?} are still not served by a leader; its records to them wait for the broker"
            );
        }
        Ok(())
    }

    async fn topic_exists(&self, topic: &str) -> Result<bool, PublishError> {
        topic_exists(self.producer(), topic).await
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
        // Several lanes (and relays) find a new topic missing at once and each asks to create
        // it: only the request that created it says so.
        let mut created = false;
        for r in results {
            match r {
                Ok(_) => created = true,
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((_, RDKafkaErrorCode::InvalidTopic)) => {
                    // The client does not pass the broker's message on; a name of valid
                    // characters and length is refused for colliding with a topic whose name
                    // differs only in `.` against `_` (Kafka's metric names cannot tell them
                    // apart).
                    let valid_chars = topic.len() <= 249
                        && !matches!(topic, "." | "..")
                        && topic
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
                    let why = if valid_chars {
                        "it collides with an existing topic whose name differs only in '.' and '_' (Kafka refuses such pairs)"
                    } else {
                        "Kafka takes only letters, digits, '.', '_' and '-', at most 249 of them, and not '.' or '..'"
                    };
                    return Err(PublishError::new(
                        FailureKind::Permanent,
                        format!("invalid topic {topic:?}: {why}"),
                    ));
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
        if created {
            let replication = match self.config.topic_replication {
                -1 => "the broker's default".to_owned(),
                n => n.to_string(),
            };
            tracing::info!(
                topic,
                partitions = self.config.topic_partitions,
                %replication,
                "created topic"
            );
        } else {
            tracing::debug!(topic, "topic created meanwhile by another lane or relay");
        }
        Ok(())
    }
}

/// How long a batch's look-up of a topic whose records failed as if it were gone may take
/// before its failures stand as they are.
const GONE_LOOKUP: Duration = Duration::from_secs(5);

/// After a batch settled: looks up each topic whose records failed as unknown or timed out
/// (`suspects`: index in the batch, topic). A topic that no longer exists — deleted under the
/// running relay — is cached missing again (said once), and those records' failures become
/// `Waiting`: no attempt used, the relay not paused, their keys held in order; the next batches
/// hold the topic's events back until it exists again. With topic creation on, the topic is
/// forgotten instead and its records released at once (`HeldBack`): the next claim creates
/// it again. A topic that exists, or a look-up that fails (the cluster is unreachable), leaves
/// every failure as it is.
pub(super) async fn gone(
    producer: super::SharedProducer,
    cache: &std::sync::Mutex<std::collections::HashMap<String, TopicState>>,
    create: bool,
    suspects: &[(usize, &str)],
    outcomes: &mut [Result<(), PublishError>],
) {
    let mut looked: Vec<&str> = Vec::new();
    for &(_, topic) in suspects {
        if looked.contains(&topic) {
            continue;
        }
        looked.push(topic);
        let exists = tokio::time::timeout(GONE_LOOKUP, topic_exists(producer.clone(), topic)).await;
        let reason = match exists {
            Ok(Ok(false)) if create => {
                // Created again by the next claim's look-up (`ensure_topic`): its events go
                // back at once, without an attempt, ahead of their keys' later events.
                let was = cache.lock().expect("topic cache").remove(topic);
                if matches!(was, Some(TopicState::Ready)) {
                    tracing::warn!(
                        topic,
                        "topic {topic:?} was deleted after the relay found it; the relay creates it again"
                    );
                }
                for &(i, t) in suspects {
                    if t == topic {
                        outcomes[i] = Err(PublishError::new(
                            FailureKind::HeldBack,
                            format!("topic {topic:?} was deleted; it is created again"),
                        ));
                    }
                }
                continue;
            }
            Ok(Ok(false)) => missing_topic(
                topic,
                "was deleted after the relay found it (topic creation is off)",
            ),
            // It exists: the failures stand as they are.
            Ok(Ok(true)) => continue,
            _ => continue,
        };
        let was = cache.lock().expect("topic cache").insert(
            topic.to_owned(),
            TopicState::Missing {
                reason: reason.clone(),
                since: std::time::Instant::now(),
            },
        );
        if !matches!(was, Some(TopicState::Missing { .. })) {
            tracing::warn!(topic, "{reason}");
        }
        for &(i, t) in suspects {
            if t == topic {
                outcomes[i] = Err(PublishError::new(FailureKind::Waiting, reason.clone()));
            }
        }
    }
}

/// Whether `topic` exists by the cluster's metadata (asked through `producer`), with the
/// errors that say why it cannot be used.
pub(super) async fn topic_exists(
    producer: super::SharedProducer,
    topic: &str,
) -> Result<bool, PublishError> {
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
