//! The configuration of every Kafka producer Postal makes: the relay's, the consumer's
//! dead-letter producer, and the dead-letter replays of `postal dead-letters replay` and the
//! dashboard. All of them put a key on the partition Java clients pick for it, write
//! idempotently with `acks=all`, and take the given librdkafka properties (TLS, SASL, tuning)
//! the same way: over Postal's defaults, without the consumer-only ones, and refused when they
//! would break what Postal promises.
//!
//! Postal forgets a record once the broker acknowledged it (an outbox row is deleted or marked,
//! a dead letter marked published or replayed), and promises per-key order on the topic. So it
//! needs: acknowledgement by every in-sync replica (`acks=all`), retries that cannot reorder
//! (the idempotent producer with at most 5 requests in flight), retries at all, and the Java-compatible murmur2 partitioner (every Postal
//! producer and every Kafka client put a key on the same partition; another partitioner moves
//! keys between partitions, and the consumers process partitions independently).

use std::collections::BTreeMap;

use rdkafka::ClientConfig;

use crate::Error;

/// Properties librdkafka applies to consumers only (scope `C` in librdkafka 2.12's
/// CONFIGURATION.md). A producer would ignore them with a warning each; they come along when
/// one set of properties serves a process's consumers too (a consumer's dead letters, the
/// CLI, the dashboard).
const CONSUMER_ONLY: &[&str] = &[
    "auto.commit.enable",
    "auto.commit.interval.ms",
    "auto.offset.reset",
    "check.crcs",
    "consume.callback.max.messages",
    "consume_cb",
    "coordinator.query.interval.ms",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "enable.partition.eof",
    "fetch.error.backoff.ms",
    "fetch.max.bytes",
    "fetch.message.max.bytes",
    "fetch.min.bytes",
    "fetch.queue.backoff.ms",
    "fetch.wait.max.ms",
    "group.id",
    "group.instance.id",
    "group.protocol",
    "group.protocol.type",
    "group.remote.assignor",
    "heartbeat.interval.ms",
    "isolation.level",
    "max.partition.fetch.bytes",
    "max.poll.interval.ms",
    "offset.store.method",
    "offset.store.path",
    "offset.store.sync.interval.ms",
    "offset_commit_cb",
    "partition.assignment.strategy",
    "queued.max.messages.kbytes",
    "queued.min.messages",
    "rebalance_cb",
    "session.timeout.ms",
];

/// The librdkafka configuration of a Postal producer for `bootstrap_servers`: Postal's
/// defaults, then `properties` (but consumer-only ones), each checked first; a property that
/// would break durability or per-key order is an error naming it, its value and why.
///
/// Defaults: `enable.idempotence=true`, `acks=all`, `partitioner=murmur2_random` (keys land
/// where Java clients and Debezium put them), `linger.ms=0`, `compression.type=lz4`,
/// `message.timeout.ms=20000`, `queue.buffering.max.messages=1000000`,
/// `queue.buffering.max.kbytes=1048576`, `allow.auto.create.topics=false`,
/// `topic.metadata.propagation.max.ms=3000`.
///
/// `topic.metadata.propagation.max.ms` is 3 s (librdkafka's default is 30 s): how long the
/// client holds records for a topic its metadata does not show before failing them as
/// unknown. Postal looks a topic up (and creates it when allowed) before it sends to it, so
/// the wait only matters for a topic deleted under a running relay: its records then fail
/// within seconds, the relay finds the topic missing and its events wait, and the batches they
/// shared with other topics' events are not held up for half a minute
/// (`missing_topic::deleted_topic_*`).
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
/// others need a codec installed. `compression.type=none` turns it off.
pub fn config<'a>(
    bootstrap_servers: &str,
    properties: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<ClientConfig, Error> {
    let properties = producer_properties(properties);
    check(&properties)?;
    Ok(build(bootstrap_servers, &properties))
}

/// The configuration of a producer that replays dead letters (`postal dead-letters replay`, the
/// dashboard): [`config`], with `message.max.bytes` at [`REPLAY_MESSAGE_MAX_BYTES`] unless
/// given. A replay sends a record back to the topic it was read from, which took it: the topic
/// decides whether it still fits, not librdkafka's default of 1,000,000 bytes (below the
/// broker's default record limit of 1,048,588, so a record near that limit, the kind whose
/// `.dlq` copy is cut and whose dead letter is kept whole for replay, could not be replayed).
pub fn replay_config<'a>(
    bootstrap_servers: &str,
    properties: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<ClientConfig, Error> {
    let properties = producer_properties(properties);
    check(&properties)?;
    let mut cfg = build(bootstrap_servers, &properties);
    if !properties.contains_key("message.max.bytes") {
        cfg.set("message.max.bytes", REPLAY_MESSAGE_MAX_BYTES.to_string());
    }
    Ok(cfg)
}

/// A replay producer's `message.max.bytes` unless given: within a broker's default
/// `socket.request.max.bytes` (104,857,600), far above any topic's usual record limit.
pub const REPLAY_MESSAGE_MAX_BYTES: usize = 100_000_000;

/// Whether a send failed because of the record itself (its size or form), so that sending it
/// again as it is, to the same topic, can never succeed. A refusal for size of a record sent
/// with others may be the record batch's: the broker checks a whole batch against the topic's
/// `max.message.bytes`, and librdkafka packs records sent together into one batch (it does not
/// split a refused batch as the Java client does). Send such a record again alone to know.
pub fn refused_for_itself(e: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::error::RDKafkaErrorCode;
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::MessageBatchTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
        )
    )
}

/// [`config`] without the check, to read the settings of properties checked before (the
/// relay's `KafkaConfig::client_config`).
pub fn config_unchecked<'a>(
    bootstrap_servers: &str,
    properties: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> ClientConfig {
    build(bootstrap_servers, &producer_properties(properties))
}

/// The properties a producer takes: all but the consumer-only ones.
fn producer_properties<'a>(
    properties: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> BTreeMap<&'a str, &'a str> {
    properties
        .into_iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .filter(|(k, _)| !CONSUMER_ONLY.contains(k))
        .collect()
}

fn build(bootstrap_servers: &str, properties: &BTreeMap<&str, &str>) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "0")
        .set("compression.type", "lz4")
        .set("message.timeout.ms", "20000")
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .set("allow.auto.create.topics", "false")
        .set("topic.metadata.propagation.max.ms", "3000")
        .set("log_level", "4");
    for (k, v) in properties {
        cfg.set(*k, *v);
    }
    cfg
}

/// Refuses the properties that would break durability or per-key order on top of Postal's
/// defaults; the error names the property, its value and why.
fn check(properties: &BTreeMap<&str, &str>) -> Result<(), Error> {
    let get = |names: &[&'static str]| -> Option<(&'static str, &str)> {
        names
            .iter()
            .find_map(|&n| properties.get(n).map(|v| (n, v.trim())))
    };
    let refuse = |name: &str, value: &str, why: &str| {
        Err(Error::KafkaPropertyRefused {
            name: name.to_owned(),
            value: value.to_owned(),
            why: why.to_owned(),
        })
    };
    if let Some((k, v)) = get(&["acks", "request.required.acks"]) {
        if !matches!(v.to_ascii_lowercase().as_str(), "all" | "-1") {
            return refuse(
                k,
                v,
                "Postal forgets a record once the broker acknowledged it, and only acks=all keeps acknowledged records through a leader change",
            );
        }
    }
    if let Some((k, v)) = get(&["partitioner"]) {
        if !matches!(v, "murmur2_random" | "murmur2") {
            return refuse(
                k,
                v,
                "per-key order needs every key on the partition Kafka's default (murmur2) partitioner picks; another partitioner moves keys between partitions",
            );
        }
    }
    if let Some((k, v)) = get(&["retries", "message.send.max.retries"]) {
        if v == "0" {
            return refuse(
                k,
                v,
                "without retries a failed record is sent again later by Postal, behind records of the same key sent after it",
            );
        }
    }
    if let Some((k, v)) = get(&["queuing.strategy"]) {
        if v != "fifo" {
            return refuse(k, v, "records must be sent in the order they were produced");
        }
    }
    if let Some((k, v)) = get(&["enable.gapless.guarantee"]) {
        if matches!(v.to_ascii_lowercase().as_str(), "false" | "f" | "0") {
            return refuse(
                k,
                v,
                "without it a record the broker refuses for good (over a topic limit lowered since it was read, a topic it may no longer write) leaves a gap that the relay's producer fills with its key's later records, out of order; with it the producer stops, is replaced, and the later records go again after the refused one is settled",
            );
        }
    }
    if let Some((k, v)) = get(&["enable.idempotence"]) {
        if matches!(v.to_ascii_lowercase().as_str(), "false" | "f" | "0") {
            return refuse(
                k,
                v,
                "without the idempotent producer a record refused for good is followed on the topic by its key's later records (even with one request in flight), and a retried request can land behind later ones",
            );
        }
    }
    let in_flight = get(&["max.in.flight.requests.per.connection", "max.in.flight"]);
    if let Some((k, v)) = in_flight {
        if v.parse::<i64>().is_ok_and(|n| n > 5) {
            return refuse(
                k,
                v,
                "the idempotent producer keeps order across retries only with at most 5 requests in flight",
            );
        }
    }
    Ok(())
}

/// What a producer that hands a key's records over without waiting for each one's
/// acknowledgement (the relay's) adds to [`config`]: `enable.gapless.guarantee=true`. Without
/// it, when the broker refuses a record for good (over a topic's limit lowered since the relay
/// read it, a topic it may no longer write), librdkafka renumbers and writes the key's later
/// records already handed over: past the refused one, out of order. With it the producer stops
/// for good instead and the relay replaces it, holding those records back
/// (`size_fence_attack::a_limit_lowered_under_a_running_relay_parks_the_big_event` failed 3 of 3
/// without it). Producers that send a key's records one at a time (dead-letter copies and
/// replays) do without it: a stopped producer would fail the records it sends alone after a
/// refusal to find the ones that fit.
pub fn pipelined(config: &mut ClientConfig) {
    config.set("enable.gapless.guarantee", "true");
}

/// Whether a delivery report shows the record written: with `acks=all` the broker gives the
/// record's offset. librdkafka reports a record delivered without one when it infers the record
/// from a later request's success ("implicitly acked"), an inference that is wrong on a
/// partition the broker had just started before Kafka 4.5 (KAFKA-15591): the record was lost.
/// Such a record must be treated as not sent.
pub fn written(offset: i64) -> bool {
    offset >= 0
}

/// The error for a delivery report without an offset (see [`written`]).
pub const UNCONFIRMED: &str = "the producer reported the record delivered without an offset (inferred from a later request's success), which does not show it was written";

#[cfg(test)]
mod tests {
    use rdkafka::producer::BaseProducer;

    /// Creates a producer (clients connect lazily: no broker needed) from [`super::config`]
    /// with these properties.
    fn producer(pairs: &[(&str, &str)]) -> Result<BaseProducer, String> {
        let properties: std::collections::BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        super::config("127.0.0.1:1", &properties)
            .map_err(|e| e.to_string())?
            .create()
            .map_err(|e| e.to_string())
    }

    /// Guarantee: no Postal producer is configured with a property that breaks
    /// acknowledged-means-durable or per-key order; the error is one line naming the property,
    /// its value and the reason.
    #[test]
    fn ordering_and_durability_breaking_overrides_are_refused() {
        let refused: &[(&[(&str, &str)], &str)] = &[
            (&[("acks", "1")], "acks=1"),
            (&[("acks", "0")], "acks=0"),
            (&[("request.required.acks", "1")], "request.required.acks=1"),
            (
                &[("partitioner", "consistent_random")],
                "partitioner=consistent_random",
            ),
            (&[("partitioner", "fnv1a")], "partitioner=fnv1a"),
            (&[("retries", "0")], "retries=0"),
            (
                &[("message.send.max.retries", "0")],
                "message.send.max.retries=0",
            ),
            (&[("queuing.strategy", "lifo")], "queuing.strategy=lifo"),
            (
                &[("enable.gapless.guarantee", "false")],
                "enable.gapless.guarantee=false",
            ),
            (
                &[("max.in.flight.requests.per.connection", "6")],
                "max.in.flight.requests.per.connection=6",
            ),
            (&[("max.in.flight", "100")], "max.in.flight=100"),
            (
                &[("enable.idempotence", "false")],
                "enable.idempotence=false",
            ),
            (
                &[
                    ("enable.idempotence", "false"),
                    ("max.in.flight.requests.per.connection", "1"),
                ],
                "enable.idempotence=false",
            ),
        ];
        for (pairs, named) in refused {
            let err = producer(pairs).map(drop).unwrap_err();
            assert!(err.contains(named), "{pairs:?}: {err}");
            assert!(err.contains("is refused: "), "{pairs:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{pairs:?}: one line: {err}");
        }
    }

    /// Guarantee: properties that keep the guarantees (including stricter or equivalent
    /// values of the checked ones) still make a producer, and so do a consumer's own
    /// properties given with them (left out: a producer would only warn about each).
    #[test]
    fn safe_overrides_are_accepted() {
        let accepted: &[&[(&str, &str)]] = &[
            &[],
            &[("compression.type", "gzip"), ("linger.ms", "5")],
            &[("acks", "all")],
            &[("acks", "-1")],
            &[("partitioner", "murmur2")],
            &[("partitioner", "murmur2_random")],
            &[("retries", "5")],
            &[("max.in.flight.requests.per.connection", "5")],
            &[("enable.idempotence", "true"), ("max.in.flight", "1")],
            &[("enable.gapless.guarantee", "true")],
            &[("session.timeout.ms", "6000"), ("group.id", "g")],
        ];
        for pairs in accepted {
            producer(pairs).unwrap_or_else(|e| panic!("{pairs:?}: {e}"));
        }
    }

    /// Guarantee: a replay producer takes any record its topic takes (a record of
    /// 1,040,000 bytes under the broker's default limit was refused by librdkafka's default
    /// `message.max.bytes` of 1,000,000), keeps a `message.max.bytes` given, and is checked as
    /// every Postal producer is.
    #[test]
    fn replay_producers_take_records_as_large_as_their_topic_does() {
        let none = std::collections::BTreeMap::<String, String>::new();
        let cfg = super::replay_config("b:9092", &none).unwrap();
        assert_eq!(cfg.get("message.max.bytes"), Some("100000000"));
        assert_eq!(cfg.get("acks"), Some("all"));
        let given: std::collections::BTreeMap<String, String> =
            [("message.max.bytes".to_owned(), "2000000".to_owned())].into();
        let cfg = super::replay_config("b:9092", &given).unwrap();
        assert_eq!(cfg.get("message.max.bytes"), Some("2000000"));
        let refused: std::collections::BTreeMap<String, String> =
            [("acks".to_owned(), "1".to_owned())].into();
        assert!(super::replay_config("b:9092", &refused).is_err());
        cfg.create::<rdkafka::producer::BaseProducer>()
            .expect("a producer");
    }

    /// Guarantee: every Postal producer partitions with murmur2 (Java's partitioner), is
    /// idempotent and waits for `acks=all` unless told otherwise by an accepted property; the
    /// given connection and security properties reach it, a consumer's own ones do not.
    #[test]
    fn defaults_then_the_given_properties_but_consumer_only_ones() {
        let properties: std::collections::BTreeMap<String, String> = [
            ("security.protocol", "SASL_SSL"),
            ("enable.ssl.certificate.verification", "false"),
            ("client.id", "billing"),
            ("linger.ms", "5"),
            ("session.timeout.ms", "6000"),
            ("isolation.level", "read_committed"),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
        let cfg = super::config("broker:9092", &properties).unwrap();
        for (k, v) in [
            ("bootstrap.servers", "broker:9092"),
            ("partitioner", "murmur2_random"),
            ("enable.idempotence", "true"),
            ("acks", "all"),
            ("security.protocol", "SASL_SSL"),
            ("enable.ssl.certificate.verification", "false"),
            ("client.id", "billing"),
            ("linger.ms", "5"),
        ] {
            assert_eq!(cfg.get(k), Some(v), "{k}");
        }
        assert_eq!(cfg.get("session.timeout.ms"), None);
        assert_eq!(cfg.get("isolation.level"), None);
    }
}
