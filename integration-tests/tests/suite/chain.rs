//! Consume-transform-produce: a handler enqueues outbox events in its own transaction, so a
//! chain of services stays effectively-once end to end.

use std::time::Duration;

use postal_consumer::Consumer;
use postal_integration_tests::{kafka, services, unique, wait};
use postal_producer::{enqueue_batch, KafkaConfig, KafkaTransport, NewEvent};

use crate::common::{
    consumer_config, create_topic, effects, effects_table, fast_config, RunningConsumer,
    RunningRelay,
};
use crate::handlers::{self, apply, forward};

const WAIT: Duration = Duration::from_secs(120);

/// A Kafka transport on Postal's defaults except a 1 s delivery timeout, which the tests' 3 s
/// lease needs (half a lease must exceed it) so that a killed relay's partitions move on soon.
fn transport(bootstrap: &str) -> KafkaTransport {
    let mut cfg = KafkaConfig::new(bootstrap);
    cfg.topic_partitions = 3;
    cfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    KafkaTransport::new(cfg).expect("kafka transport")
}

/// Guarantee: origin → middle → sink, where the middle service's handler records its effect
/// and enqueues the next event in one transaction, and the middle service's consumer and relay
/// are both killed mid-stream and restarted: every event has exactly one effect in the middle
/// and exactly one in the sink, although the wire may carry duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hop_chain_survives_a_crash_in_the_middle() {
    let svc = services().await;
    let (origin, middle, sink) = (
        svc.fresh_db().await,
        svc.fresh_db().await,
        svc.fresh_db().await,
    );
    effects_table(&middle.pool).await;
    effects_table(&sink.pool).await;
    let (first, second) = (unique("hop1"), unique("hop2"));
    create_topic(&svc.bootstrap, &first, 3).await;
    create_topic(&svc.bootstrap, &second, 3).await;
    let total = 600i64;

    let mut tx = origin.pool.begin().await.unwrap();
    let events: Vec<NewEvent> = (0..total)
        .map(|n| {
            NewEvent::json(
                first.as_str(),
                format!("k{}", n % 20).as_str(),
                "job",
                &serde_json::json!({"n": n, "next": second}),
            )
            .unwrap()
        })
        .collect();
    enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();

    let origin_relay = RunningRelay::start(&origin.pool, transport(&svc.bootstrap), fast_config());
    let middle_group = unique("middle");
    // The middle service's consumer and relay each run on a pool of their own, as separate
    // processes: killing them closes their connections (a connection left inside a
    // transaction in the test's pool once held a lock that stalled the restarted consumer).
    let start_middle = || async {
        let pool = middle.process_pool().await;
        let consumer = Consumer::builder(
            pool.clone(),
            consumer_config(&svc.bootstrap, &middle_group, "middle"),
        )
        .on(&first, "job", forward)
        .build()
        .unwrap();
        let relay_pool = middle.process_pool().await;
        (
            RunningConsumer::start(consumer).owning(pool),
            RunningRelay::start(&relay_pool, transport(&svc.bootstrap), fast_config())
                .owning(relay_pool),
        )
    };
    let sink_consumer = RunningConsumer::start(
        Consumer::builder(
            sink.pool.clone(),
            consumer_config(&svc.bootstrap, &unique("sink"), handlers::CONSUMER),
        )
        .state(handlers::Probe::default())
        .on(&second, "job", apply)
        .build()
        .unwrap(),
    );

    let (consumer, relay) = start_middle().await;
    wait::until(WAIT, "the middle service to be part-way", || {
        let pool = middle.pool.clone();
        async move { effects(&pool).await.1 >= total / 3 }
    })
    .await;
    consumer.kill().await;
    relay.kill().await;
    let (consumer, relay) = start_middle().await;
    // On a timeout, say where the events stopped: the broker's high watermarks of both hops
    // next to the offsets the middle and sink consumers stored (a stall seen once in CI left
    // one partition of the restarted middle consumer behind without a log line).
    let through = tokio::time::timeout(WAIT, async {
        while effects(&sink.pool).await.1 < total {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if through.is_err() {
        let mut report = String::new();
        for (topic, pool, who) in [
            (&first, &middle.pool, "middle"),
            (&second, &sink.pool, "sink"),
        ] {
            let (bootstrap, t) = (svc.bootstrap.clone(), topic.clone());
            let high = tokio::task::spawn_blocking(move || high_watermarks(&bootstrap, &t, 3))
                .await
                .unwrap();
            let stored: Vec<(i32, Option<i64>, i64)> = sqlx::query_as(
                "SELECT partition, next_offset, epoch FROM postal.consumer_offsets
                 WHERE topic = $1 ORDER BY partition",
            )
            .bind(topic.as_str())
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            report.push_str(&format!(
                "\n  {topic}: broker high watermarks {high:?}, {who} stored (partition, next offset, epoch) {stored:?}, {who} effects {:?}",
                effects(pool).await
            ));
        }
        let (bootstrap, group) = (svc.bootstrap.clone(), middle_group.clone());
        let members = tokio::task::spawn_blocking(move || group_members(&bootstrap, &group))
            .await
            .unwrap();
        panic!("timed out after {WAIT:?} waiting for every event through the sink:{report}\n  middle group members: {members:?}");
    }
    consumer.stop().await;
    relay.stop().await;
    sink_consumer.stop().await;
    origin_relay.stop().await;

    assert_eq!(
        effects(&middle.pool).await,
        (total, total),
        "middle: exactly once"
    );
    assert_eq!(
        effects(&sink.pool).await,
        (total, total),
        "sink: exactly once"
    );
    let wire = kafka::read_all(&svc.bootstrap, &second, total as usize, WAIT).await;
    eprintln!(
        "second hop: {} records on the wire for {} events",
        wire.len(),
        kafka::event_ids(&wire).len()
    );
    assert_eq!(kafka::event_ids(&wire).len(), total as usize);
}

/// High watermark of each of the `partitions` partitions of `topic` (`None` where the broker
/// did not answer).
fn high_watermarks(bootstrap: &str, topic: &str, partitions: i32) -> Vec<Option<i64>> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let Ok(client) = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create::<BaseConsumer>()
    else {
        return vec![None; partitions as usize];
    };
    (0..partitions)
        .map(|p| {
            client
                .fetch_watermarks(topic, p, Duration::from_secs(5))
                .ok()
                .map(|(_, high)| high)
        })
        .collect()
}

/// Members of consumer group `group` as the broker reports them (`None` if it cannot say).
fn group_members(bootstrap: &str, group: &str) -> Option<usize> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let client: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .ok()?;
    let list = client
        .fetch_group_list(Some(group), Duration::from_secs(5))
        .ok()?;
    Some(
        list.groups()
            .iter()
            .filter(|g| g.name() == group)
            .map(|g| g.members().len())
            .sum(),
    )
}

/// Guarantee: a consume-transform-produce handler that derives its output's id from its input
/// (`EventId::derived`) and enqueues it with `enqueue_once` emits the same event whenever the
/// input is applied again — here after its dedup row expired and the consumer's offset was
/// reset — so the next hop applies the output once. Re-applying while the first output is
/// still in the outbox writes nothing; after the relay removed it, the same id is written
/// again and the next hop recognises the copy. With fresh random ids the next hop applied two
/// outputs.
#[tokio::test]
async fn a_reapplied_input_emits_the_same_output_and_the_next_hop_applies_it_once() {
    use postal_consumer::testing::{Delivered, TestRecord};
    let middle = postal_integration_tests::fresh_postgres_db().await;
    let sink = postal_integration_tests::fresh_postgres_db().await;
    effects_table(&middle.pool).await;
    effects_table(&sink.pool).await;
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let (first, second) = (unique("hop1"), unique("hop2"));
    let middle_consumer = Consumer::builder(
        middle.pool.clone(),
        consumer_config(&bootstrap, &unique("g"), "middle"),
    )
    .on(&first, "job", forward)
    .build()
    .unwrap();
    let sink_consumer = Consumer::builder(
        sink.pool.clone(),
        consumer_config(&bootstrap, &unique("g"), handlers::CONSUMER),
    )
    .state(handlers::Probe::default())
    .on(&second, "job", apply)
    .build()
    .unwrap();
    let (m, s) = (middle_consumer.protocol(), sink_consumer.protocol());
    let input = uuid::Uuid::now_v7();
    let record = |topic: &str, offset: i64, id: String, payload: serde_json::Value| TestRecord {
        topic: topic.into(),
        partition: 0,
        offset,
        key: Some(b"k".to_vec()),
        payload: Some(serde_json::to_vec(&payload).unwrap()),
        headers: vec![
            ("ce_id".into(), Some(id.into_bytes())),
            ("ce_type".into(), Some(b"job".to_vec())),
            ("content-type".into(), Some(b"application/json".to_vec())),
        ],
    };
    let input_record = record(
        &first,
        0,
        input.to_string(),
        serde_json::json!({"n": 7, "next": second}),
    );
    let outbox = || async {
        sqlx::query_as::<_, (uuid::Uuid, Vec<u8>)>(
            "SELECT event_id, payload FROM postal.outbox ORDER BY seq",
        )
        .fetch_all(&middle.pool)
        .await
        .unwrap()
    };
    // Re-application: the dedup row gone (retention), the stored offset moved back (reset).
    let reapply = || async {
        sqlx::query("DELETE FROM postal.processed_events")
            .execute(&middle.pool)
            .await
            .unwrap();
        let own = m.claim(&first, 0).await.unwrap();
        sqlx::query("UPDATE postal.consumer_offsets SET next_offset = 0")
            .execute(&middle.pool)
            .await
            .unwrap();
        assert_eq!(
            m.deliver(&own, vec![input_record.clone()]).await,
            Delivered::Done
        );
    };

    let own = m.claim(&first, 0).await.unwrap();
    assert_eq!(
        m.deliver(&own, vec![input_record.clone()]).await,
        Delivered::Done
    );
    let emitted = outbox().await;
    assert_eq!(emitted.len(), 1);
    // Applied again while the output is still in the outbox: nothing new is written.
    reapply().await;
    assert_eq!(outbox().await, emitted, "the same output, written once");
    // The relay published the output and removed it; the input is applied once more.
    sqlx::query("DELETE FROM postal.outbox")
        .execute(&middle.pool)
        .await
        .unwrap();
    reapply().await;
    let again = outbox().await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].0, emitted[0].0, "the output keeps its id");
    // The next hop gets both copies (the first publish, the republish): applied once.
    let own = s.claim(&second, 0).await.unwrap();
    let out_id = emitted[0].0.to_string();
    let copies = vec![
        record(&second, 0, out_id.clone(), serde_json::json!({"n": 7})),
        record(&second, 1, out_id, serde_json::json!({"n": 7})),
    ];
    assert_eq!(s.deliver(&own, copies).await, Delivered::Done);
    assert_eq!(effects(&sink.pool).await, (1, 1), "the output applied once");
    assert_eq!(
        effects(&middle.pool).await,
        (3, 1),
        "the input applied three times"
    );
}
