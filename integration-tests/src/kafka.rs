//! Kafka helpers for tests: readiness, reading back everything on a topic.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// One record read back from Kafka.
#[derive(Clone, Debug)]
pub struct Record {
    /// Kafka partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Record key as text.
    pub key: Option<String>,
    /// Record value.
    pub payload: Vec<u8>,
    /// Headers (last value wins).
    pub headers: BTreeMap<String, String>,
}

impl Record {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// The distinct event ids (`ce_id`) among `records`.
pub fn event_ids(records: &[Record]) -> std::collections::BTreeSet<String> {
    records
        .iter()
        .filter_map(|r| r.header(postal_shared::headers::CE_ID).map(str::to_owned))
        .collect()
}

/// Waits until the broker answers a metadata request.
pub async fn wait_ready(bootstrap: &str, timeout: Duration) -> Result<(), String> {
    let bootstrap = bootstrap.to_owned();
    tokio::task::spawn_blocking(move || {
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("log_level", "0")
            .create()
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + timeout;
        loop {
            match producer
                .client()
                .fetch_metadata(None, Duration::from_secs(2))
            {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(format!(
                        "broker at {bootstrap} unreachable after {timeout:?}: {e}"
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Waits until a fresh broker takes writes from an idempotent producer: a metadata answer
/// comes first, while the broker may still be loading its coordinators and refuse producer
/// ids ("coordinator load in progress"), which on a busy machine can outlast a test's wait.
/// Creates a throwaway topic, writes one record with `acks=all` and deletes the topic.
pub async fn wait_writable(bootstrap: &str, timeout: Duration) -> Result<(), String> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("log_level", "0")
        .create()
        .map_err(|e| e.to_string())?;
    let topic = crate::unique("postal-ready");
    let deadline = Instant::now() + timeout;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    loop {
        let created = admin
            .create_topics(
                [&NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
                &opts,
            )
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| match r.first() {
                Some(Ok(_))
                | Some(Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists))) => Ok(()),
                Some(Err((_, code))) => Err(code.to_string()),
                None => Err("no answer".into()),
            });
        match created {
            Ok(()) => break,
            Err(e) if Instant::now() > deadline => {
                return Err(format!(
                    "broker at {bootstrap} did not create a topic within {timeout:?}: {e}"
                ))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("log_level", "3")
        .create()
        .map_err(|e| e.to_string())?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_secs(5));
    let sent = producer
        .send(FutureRecord::to(&topic).key("k").payload("ready"), left)
        .await
        .map_err(|(e, _)| {
            format!("broker at {bootstrap} did not take a record within {timeout:?}: {e}")
        });
    let _ = admin.delete_topics(&[&topic], &AdminOptions::new()).await;
    sent.map(|_| ())
}

/// Number of partitions of `topic` (waits until it exists).
pub fn partitions(bootstrap: &str, topic: &str, timeout: Duration) -> Vec<i32> {
    partitions_with(bootstrap, topic, timeout, &[])
}

/// [`partitions`] with extra client properties (security settings).
fn partitions_with(
    bootstrap: &str,
    topic: &str,
    timeout: Duration,
    extra: &[(String, String)],
) -> Vec<i32> {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", bootstrap)
        .set("log_level", "0");
    for (k, v) in extra {
        cfg.set(k, v);
    }
    let producer: BaseProducer = cfg.create().expect("metadata client");
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(md) = producer
            .client()
            .fetch_metadata(Some(topic), Duration::from_secs(2))
        {
            if let Some(t) = md.topics().iter().find(|t| t.name() == topic) {
                if t.error().is_none() && !t.partitions().is_empty() {
                    return t.partitions().iter().map(|p| p.id()).collect();
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "topic {topic} did not appear within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Reads `topic` from the beginning until at least `min` records arrived (then drains what
/// is immediately available) or `timeout` passes; returns records in (partition, offset) order.
pub async fn read_all(bootstrap: &str, topic: &str, min: usize, timeout: Duration) -> Vec<Record> {
    read_all_with(bootstrap, topic, min, timeout, &[]).await
}

/// [`read_all`] with extra client properties (security settings).
pub async fn read_all_with(
    bootstrap: &str,
    topic: &str,
    min: usize,
    timeout: Duration,
    extra: &[(String, String)],
) -> Vec<Record> {
    let bootstrap = bootstrap.to_owned();
    let topic = topic.to_owned();
    let extra = extra.to_vec();
    tokio::task::spawn_blocking(move || read_all_blocking(&bootstrap, &topic, min, timeout, &extra))
        .await
        .expect("reader thread")
}

fn read_all_blocking(
    bootstrap: &str,
    topic: &str,
    min: usize,
    timeout: Duration,
    extra: &[(String, String)],
) -> Vec<Record> {
    let parts = partitions_with(bootstrap, topic, timeout, extra);
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", bootstrap)
        .set("group.id", crate::unique("reader"))
        .set("enable.auto.commit", "false")
        .set("log_level", "0");
    for (k, v) in extra {
        cfg.set(k, v);
    }
    let consumer: BaseConsumer = cfg.create().expect("reader consumer");
    let mut tpl = TopicPartitionList::new();
    for p in parts {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut idle_after_min = 0;
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                idle_after_min = 0;
                let mut headers = BTreeMap::new();
                if let Some(h) = m.headers() {
                    for hd in h.iter() {
                        headers.insert(
                            hd.key.to_owned(),
                            String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                        );
                    }
                }
                out.push(Record {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    payload: m.payload().unwrap_or_default().to_vec(),
                    headers,
                });
            }
            Some(Err(_)) => {}
            None => {
                if out.len() >= min {
                    idle_after_min += 1;
                    // Two quiet polls after reaching `min`: the topic is drained.
                    if idle_after_min >= 2 {
                        break;
                    }
                }
            }
        }
    }
    out.sort_by_key(|r| (r.partition, r.offset));
    out
}
