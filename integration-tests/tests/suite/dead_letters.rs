//! Malformed records become dead letters, recorded with the offset advance and published to
//! `<topic>.dlq`; the partition moves on.

use std::time::Duration;

use postal_consumer::UnknownTypes;
use postal_integration_tests::{kafka, services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, start_apply, RawRecord,
};
use crate::handlers::{self};

const WAIT: Duration = Duration::from_secs(60);

/// Guarantee: a non-JSON record, a record without an event id and a record of a type with no
/// handler are recorded in `postal.dead_letters` (with their reasons) in the transaction that
/// moves the offset past them, then published to `<topic>.dlq` with the original key, value and
/// headers plus the error; the valid record after them is applied.
#[tokio::test]
async fn malformed_records_become_dead_letters() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dlq");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let (garbage, unknown, good) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let mut not_json = RawRecord::event(garbage, "k1", "job", json!({}));
    not_json.payload = b"\x00\x01 definitely not json".to_vec();
    let mut no_id = RawRecord::event(Uuid::now_v7(), "k2", "job", json!({"n": 1}));
    no_id.headers.retain(|(k, _)| *k != "ce_id");
    no_id.headers.push(("x-origin", "legacy-service".into()));
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[
            not_json,
            no_id,
            RawRecord::event(unknown, "k3", "job.unheard_of", json!({"n": 2})),
            RawRecord::event(good, "k4", "job", json!({"n": 3})),
        ],
    )
    .await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "four records handled", || {
        let s = stats.snapshot();
        async move { s.applied + s.dead_letters == 4 }
    })
    .await;
    let dlq = kafka::read_all(&svc.bootstrap, &format!("{topic}.dlq"), 3, WAIT).await;
    running.stop().await;

    assert_eq!(
        effects(&db.pool).await,
        (1, 1),
        "only the valid record applied"
    );
    let rows: Vec<(i64, String, String, Option<Uuid>, bool)> = sqlx::query_as(
        "SELECT kafka_offset, reason, error, event_id, published_at IS NOT NULL
         FROM postal.dead_letters ORDER BY kafka_offset",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let reasons: Vec<(i64, &str)> = rows.iter().map(|r| (r.0, r.1.as_str())).collect();
    assert_eq!(
        reasons,
        [
            (0, "undecodable"),
            (1, "missing_event_id"),
            (2, "unknown_type")
        ]
    );
    assert!(rows[0].2.contains("not the expected JSON"), "{}", rows[0].2);
    assert!(rows[1].2.contains("ce_id"), "{}", rows[1].2);
    assert!(rows[2].2.contains("job.unheard_of"), "{}", rows[2].2);
    assert_eq!(rows[0].3, Some(garbage));
    assert!(
        rows.iter().all(|r| r.4),
        "every dead letter marked published"
    );

    assert_eq!(dlq.len(), 3, "one DLQ record per dead letter");
    let by_reason = |reason: &str| {
        dlq.iter()
            .find(|r| r.header("postal_dlq_reason") == Some(reason))
            .unwrap_or_else(|| panic!("no DLQ record with reason {reason}"))
    };
    let g = by_reason("undecodable");
    assert_eq!(g.payload, b"\x00\x01 definitely not json", "original value");
    assert_eq!(g.key.as_deref(), Some("k1"), "original key");
    assert_eq!(
        g.header("ce_id"),
        Some(garbage.to_string().as_str()),
        "original headers"
    );
    assert_eq!(g.header("postal_dlq_topic"), Some(topic.as_str()));
    assert_eq!(g.header("postal_dlq_offset"), Some("0"));
    assert_eq!(g.header("postal_dlq_consumer"), Some(handlers::CONSUMER));
    let n = by_reason("missing_event_id");
    assert_eq!(n.header("x-origin"), Some("legacy-service"));
    assert!(n.header("postal_dlq_error").unwrap().contains("ce_id"));
    by_reason("unknown_type");
}

/// Guarantee: with `UnknownTypes::Skip`, records of types without a handler are skipped and
/// counted, not dead-lettered, and the offset moves past them.
#[tokio::test]
async fn unknown_types_can_be_skipped() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("skip");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[
            RawRecord::event(Uuid::now_v7(), "k", "other.type", json!({"n": 1})),
            RawRecord::event(Uuid::now_v7(), "k", "job", json!({"n": 2})),
        ],
    )
    .await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config.unknown_types = UnknownTypes::Skip;
    let running = start_apply(&db.pool, &topic, config);
    let stats = running.stats.clone();
    wait::until(WAIT, "both records handled", || {
        let s = stats.snapshot();
        async move { s.applied + s.skipped == 2 }
    })
    .await;
    running.stop().await;
    assert_eq!(stats.snapshot().dead_letters, 0);
    assert_eq!(effects(&db.pool).await, (1, 1));
    let next: Option<i64> =
        sqlx::query_scalar("SELECT next_offset FROM postal.consumer_offsets WHERE topic = $1")
            .bind(&topic)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(next, Some(2));
}

/// Guarantee (dead-letter retention): a running consumer deletes its own dead letters older
/// than `dead_letter_retention` once they reached their dead-letter topic; it keeps the ones
/// not published yet (the table is their only copy), younger ones, and other consumers'.
/// (Before, nothing expired dead letters but a manual `postal cleanup`.)
#[tokio::test]
async fn a_consumer_expires_its_own_published_dead_letters() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dlq-retention");
    create_topic(&svc.bootstrap, &topic, 1).await;
    for (consumer, age_days, published) in [
        (handlers::CONSUMER, 40, true),
        (handlers::CONSUMER, 40, false),
        (handlers::CONSUMER, 1, true),
        ("someone-else", 40, true),
    ] {
        sqlx::query(
            "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                                              kafka_offset, reason, error, dlq_topic,
                                              created_at, published_at)
             VALUES ($1, 'g', $2, 0, 0, 'permanent', 'bad', $2 || '.dlq',
                     now() - $3 * interval '1 day',
                     CASE WHEN $4 THEN now() - $3 * interval '1 day' END)",
        )
        .bind(consumer)
        .bind(&topic)
        .bind(age_days as f64)
        .bind(published)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config.dead_letter_retention = Some(Duration::from_secs(30 * 86_400));
    config.cleanup_interval = Duration::from_millis(200);
    // The consumer publishes its unpublished dead letters: a lock keeps it from this one (its
    // publisher skips locked rows), so that it stays unpublished while retention runs.
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM postal.dead_letters WHERE published_at IS NULL FOR UPDATE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let running = start_apply(&db.pool, &topic, config);
    wait::until(
        WAIT,
        "the expired published dead letter deleted",
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.dead_letters")
                .fetch_one(&db.pool)
                .await
                .unwrap()
                == 3
        },
    )
    .await;
    running.stop().await;
    lock.rollback().await.unwrap();
    let left: Vec<(String, bool, i64)> = sqlx::query_as(
        "SELECT consumer_name, published_at IS NOT NULL,
                extract(day FROM now() - created_at)::bigint
         FROM postal.dead_letters ORDER BY 1, 2, 3",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        !left
            .iter()
            .any(|(c, p, age)| c == handlers::CONSUMER && *p && *age >= 30),
        "{left:?}"
    );
    assert_eq!(
        left,
        [
            ("someone-else".to_owned(), true, 40),
            (handlers::CONSUMER.to_owned(), false, 40),
            (handlers::CONSUMER.to_owned(), true, 1),
        ]
        .into_iter()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect::<Vec<_>>(),
        "the unpublished, the young and the other consumer's stay"
    );
}

// Adversarial review of dead-letter publishing (issue 46 item 2 and after): what a real
// cluster does to `.dlq` topics that no test modelled before.

/// An admin client for `bootstrap`.
fn admin(bootstrap: &str) -> rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client")
}

/// Creates `topic` (one partition, one replica) with the topic settings `config`.
pub(crate) async fn create_topic_with(bootstrap: &str, topic: &str, config: &[(&str, &str)]) {
    use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
    let mut new = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    for (k, v) in config {
        new = new.set(k, v);
    }
    for r in admin(bootstrap)
        .create_topics([&new], &AdminOptions::new())
        .await
        .expect("create topic")
    {
        r.expect("topic created");
    }
}

/// Sets the topic settings of `topic` to `config`.
async fn alter_topic(bootstrap: &str, topic: &str, config: &[(&str, &str)]) {
    use rdkafka::admin::{AdminOptions, AlterConfig, ResourceSpecifier};
    let mut alter = AlterConfig::new(ResourceSpecifier::Topic(topic));
    for (k, v) in config {
        alter = alter.set(k, v);
    }
    for r in admin(bootstrap)
        .alter_configs([&alter], &AdminOptions::new())
        .await
        .expect("alter topic")
    {
        r.expect("topic altered");
    }
}

/// The value of the setting `name` of `topic`, as the broker describes it.
async fn topic_setting(bootstrap: &str, topic: &str, name: &str) -> Option<String> {
    use rdkafka::admin::{AdminOptions, ResourceSpecifier};
    let described = admin(bootstrap)
        .describe_configs([&ResourceSpecifier::Topic(topic)], &AdminOptions::new())
        .await
        .ok()?;
    let resource = described.into_iter().next()?.ok()?;
    resource.get(name)?.value.clone()
}

/// How many of the dead letters match `condition` (SQL over `postal.dead_letters`).
async fn dead_letters_where(pool: &sqlx::PgPool, condition: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM postal.dead_letters WHERE {condition}"
    ))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `n` records without `ce_id` (dead letters `missing_event_id`), each with a value of `value`
/// random bytes (which no compression shrinks) and a header of its own.
fn incompressible_records(n: usize, value: usize) -> Vec<RawRecord> {
    use rand::RngCore;
    (0..n)
        .map(|i| {
            let mut payload = vec![0u8; value];
            rand::rng().fill_bytes(&mut payload);
            RawRecord {
                key: Some(format!("k{i}")),
                payload,
                headers: vec![("x-origin", format!("legacy-{i}"))],
            }
        })
        .collect()
}

/// Dead letters that each fit their `.dlq` topic alone, published together after the topic's
/// `max.message.bytes` was raised to `limit`: returns their copies once all are published.
async fn publish_together_under(limit: usize, value: usize, kafka: &[(&str, &str)]) {
    const N: usize = 30;
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dlq-together");
    let dlq = format!("{topic}.dlq");
    create_topic(&svc.bootstrap, &topic, 1).await;
    // At first the topic takes nothing: every dead letter waits, marked, in the table.
    create_topic_with(&svc.bootstrap, &dlq, &[("max.message.bytes", "1")]).await;
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &incompressible_records(N, value),
    )
    .await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    for (k, v) in kafka {
        config.kafka.insert((*k).into(), (*v).into());
    }
    let running = start_apply(&db.pool, &topic, config.clone());
    wait::until(WAIT, "every dead letter refused and marked", || async {
        dead_letters_where(&db.pool, "dlq_unpublishable IS NOT NULL").await == N as i64
    })
    .await;
    // Now each copy fits the topic, whole, on its own (a few hundred bytes of Postal's headers
    // on top of the value). The limit is raised while the consumer is stopped, which starts
    // again once the broker describes the new limit: a pass under way when the limit changes
    // sees a copy refused whole under the old one and takes it cut under the new one (rightly,
    // but not what this test is about). Such a pass can start right as the last dead letter is
    // marked (a dead letter's wake may come after the pass that already took it); with the
    // limit raised during a pass, one copy of the 30 was cut in each of 5 runs of 5.
    running.stop().await;
    alter_topic(
        &svc.bootstrap,
        &dlq,
        &[("max.message.bytes", &limit.to_string())],
    )
    .await;
    wait::until(WAIT, "the broker applies the new limit", || async {
        topic_setting(&svc.bootstrap, &dlq, "max.message.bytes").await == Some(limit.to_string())
    })
    .await;
    let running = start_apply(&db.pool, &topic, config);
    wait::until(WAIT, "every dead letter published", || async {
        dead_letters_where(&db.pool, "published_at IS NOT NULL").await == N as i64
    })
    .await;
    let copies = kafka::read_all(&svc.bootstrap, &dlq, N, WAIT).await;
    running.stop().await;
    assert_eq!(copies.len(), N, "one copy per dead letter");
    for c in &copies {
        let key = c.key.as_deref().unwrap_or("(no key)");
        assert_eq!(
            c.header("postal_dlq_cut"),
            None,
            "{key}: its copy fits the topic alone, yet it was cut"
        );
        assert_eq!(c.payload.len(), value, "{key}: value kept");
        assert!(
            c.header("x-origin")
                .is_some_and(|o| o.starts_with("legacy-")),
            "{key}: original headers kept"
        );
    }
    assert_eq!(
        dead_letters_where(&db.pool, "dlq_unpublishable IS NOT NULL").await,
        0
    );
}

/// Guarantee (docs/consumer.md: a copy is cut only when it does not fit): dead letters whose
/// copies each fit their `.dlq` topic reach it whole, also when many are published at once.
///
/// Broken: the publisher hands a batch's copies to its producer together; librdkafka packs
/// them into one record batch, and the broker checks the whole batch against the topic's
/// `max.message.bytes` (MESSAGE_TOO_LARGE for all of them). Each copy was then taken as too
/// large itself and sent again with Postal's headers only: key, value and original headers
/// dropped (`postal_dlq_cut: value,headers,key`), though each fits whole (30 copies of about
/// 4.5 kB under a limit of 20,000 bytes).
#[tokio::test]
async fn dead_letters_that_fit_their_topic_alone_are_not_cut_for_sharing_a_batch() {
    publish_together_under(20_000, 4_000, &[]).await;
}

/// Guarantee (docs/consumer.md: only a dead letter whose copy the broker refuses even without
/// value, headers and key is marked unpublishable, and a topic that takes it takes it):
/// dead letters whose copies each fit their `.dlq` topic are all published.
///
/// Broken: as above, with `compression.type=none` and a topic that takes one copy (about
/// 390 bytes whole with a 50-byte value; a record batch of one copy of Postal's headers only is
/// about 355 bytes, of two about 660) but not two: the copies of Postal's headers only were
/// sent together too, over the topic's 540 bytes, and marked `dlq_unpublishable`; they went out
/// on later passes only when librdkafka happened to send one in a batch of its own, and then
/// without key, value and original headers, though each copy, whole, fits alone.
#[tokio::test]
async fn dead_letters_that_fit_their_topic_alone_are_never_marked_unpublishable() {
    publish_together_under(540, 50, &[("compression.type", "none")]).await;
}

/// Deletes `topic`.
async fn delete_topic(bootstrap: &str, topic: &str) {
    use rdkafka::admin::AdminOptions;
    for r in admin(bootstrap)
        .delete_topics(&[topic], &AdminOptions::new())
        .await
        .expect("delete topic")
    {
        r.expect("topic deleted");
    }
}

/// A record without `ce_id` (a dead letter `missing_event_id`) with key `key`.
fn without_id(key: &str) -> RawRecord {
    RawRecord {
        key: Some(key.into()),
        payload: format!("{key} without ce_id").into_bytes(),
        headers: vec![("x-origin", "legacy".into())],
    }
}

/// Whether the dead letter of the record with key `key` is marked published.
async fn published(pool: &sqlx::PgPool, key: &str) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM postal.dead_letters
         WHERE record_key = $1 AND published_at IS NOT NULL)",
    )
    .bind(key.as_bytes())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Guarantee: every dead letter reaches its `.dlq` topic; one deleted under a running consumer
/// (an operator's cleanup, a topic re-created with other settings) is created again, as at
/// start, and the dead letters after the deletion go out.
///
/// Broken: the publisher remembers the topics it created and never looks again; with the topic
/// gone (and auto-creation off, as Postal sets it) every later dead letter of that topic failed
/// with "unknown topic" on every pass, until the consumer restarted.
#[tokio::test]
async fn a_dead_letter_topic_deleted_under_a_running_consumer_is_created_again() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dlq-deleted");
    let dlq = format!("{topic}.dlq");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    produce(&svc.bootstrap, &topic, None, &[without_id("before")]).await;
    wait::until(WAIT, "the first dead letter published", || {
        published(&db.pool, "before")
    })
    .await;
    delete_topic(&svc.bootstrap, &dlq).await;
    wait::until(WAIT, "the dead-letter topic gone", || async {
        !crate::missing_topic::topic_exists(&svc.bootstrap, &dlq)
    })
    .await;
    produce(&svc.bootstrap, &topic, None, &[without_id("after")]).await;
    wait::until(WAIT, "the dead letter after the deletion published", || {
        published(&db.pool, "after")
    })
    .await;
    let copies = kafka::read_all(&svc.bootstrap, &dlq, 1, WAIT).await;
    running.stop().await;
    assert!(
        copies.iter().any(|c| c.key.as_deref() == Some("after")),
        "the copy is on the re-created topic: {:?}",
        copies.iter().map(|c| c.key.clone()).collect::<Vec<_>>()
    );
}

/// Guarantee (dead_letter.rs: "a topic that cannot take its dead letters holds back only its
/// own"): dead letters of a topic whose `.dlq` topic cannot be created do not hold back those
/// of other topics, however many they are.
///
/// Broken: each pass takes the consumer's oldest 100 unpublished dead letters. Here 101 come
/// from a topic `<x>.a` whose dead-letter topic `<x>.a.dlq` the broker refuses to create (it
/// collides with an existing `<x>_a_dlq`: Kafka takes `.` and `_` as the same): every pass
/// took those 100, failed to create their topic, and backed off; the other topic's dead letter
/// was never taken, never published.
#[tokio::test]
async fn dead_letters_of_a_topic_that_cannot_be_created_do_not_hold_back_other_topics() {
    const STUCK: usize = 101;
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let stuck = format!("{}.a", unique("dlq-collide"));
    let other = unique("dlq-other");
    create_topic(&svc.bootstrap, &stuck, 1).await;
    create_topic(&svc.bootstrap, &other, 1).await;
    create_topic(&svc.bootstrap, &format!("{stuck}.dlq").replace('.', "_"), 1).await;
    let consumer = postal_consumer::Consumer::builder(
        db.pool.clone(),
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    )
    .state(handlers::Probe::default())
    .on(&stuck, "job", handlers::apply)
    .on(&other, "job", handlers::apply)
    .build()
    .expect("valid consumer");
    let running = crate::common::RunningConsumer::start(consumer);
    let records: Vec<RawRecord> = (0..STUCK).map(|i| without_id(&format!("s{i}"))).collect();
    produce(&svc.bootstrap, &stuck, None, &records).await;
    wait::until(WAIT, "the stuck topic's dead letters recorded", || async {
        dead_letters_where(&db.pool, "true").await == STUCK as i64
    })
    .await;
    produce(&svc.bootstrap, &other, None, &[without_id("other")]).await;
    wait::until(WAIT, "the other topic's dead letter published", || {
        published(&db.pool, "other")
    })
    .await;
    running.stop().await;
    assert_eq!(
        dead_letters_where(&db.pool, "published_at IS NULL").await,
        STUCK as i64,
        "the stuck ones wait in the table"
    );
}

/// Records `n` dead letters of consumer `billing` from `topic`, each with an event id, its
/// dedup row (as the consumer writes them together) and a value of `value` random bytes;
/// returns their ids.
async fn dead_letters_of(pool: &sqlx::PgPool, topic: &str, n: usize, value: usize) -> Vec<i64> {
    let mut ids = Vec::new();
    for (i, r) in incompressible_records(n, value).into_iter().enumerate() {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                 kafka_offset, event_id, record_key, payload, header_names, header_values,
                 reason, error, attempts, dlq_topic)
             VALUES ('billing', 'billing', $1, 0, $2, $3, $4, $5, ARRAY['ce_id', 'ce_type'],
                     ARRAY[convert_to($3::text, 'UTF8'), convert_to('job', 'UTF8')],
                     'permanent', 'declined', 1, $1 || '.dlq')
             RETURNING id",
        )
        .bind(topic)
        .bind(i as i64)
        .bind(Uuid::now_v7())
        .bind(r.key.unwrap().into_bytes())
        .bind(r.payload)
        .fetch_one(pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
             SELECT consumer_name, event_id, created_at FROM postal.dead_letters WHERE id = $1",
        )
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
        ids.push(id);
    }
    ids
}

/// The producer `postal dead-letters replay` makes (the relay's settings, none given).
fn replay_producer(bootstrap: &str) -> rdkafka::producer::FutureProducer {
    postal_shared::kafka_producer::replay_config(bootstrap, &std::collections::BTreeMap::new())
        .expect("producer settings")
        .create()
        .expect("producer")
}

/// Replays `ids` as `postal dead-letters replay` does.
async fn replay(
    pool: &sqlx::PgPool,
    producer: &rdkafka::producer::FutureProducer,
    ids: &[i64],
) -> Result<u64, postal_admin::Error> {
    postal_admin::dead_letters::replay(
        pool,
        producer,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "ids": ids }),
        ids,
        |_| {},
    )
    .await
}

/// Guarantee (docs/consumer.md: `postal dead-letters replay` sends the original record back to
/// its topic): dead letters each of which fits its topic are replayed, also many at once.
///
/// Broken: replay sends a chunk's records together; librdkafka packs them into one record batch
/// and the broker checks the whole batch against the topic's `max.message.bytes` (here 20,000
/// bytes, 10 records of 4,000): all refused with MESSAGE_TOO_LARGE, the replay failed, and
/// every run of it failed the same way though each record, alone, is one the topic took.
#[tokio::test]
async fn dead_letters_that_fit_their_topic_alone_are_replayed_together() {
    const N: usize = 10;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-together");
    create_topic_with(&svc.bootstrap, &topic, &[("max.message.bytes", "20000")]).await;
    let ids = dead_letters_of(&db.pool, &topic, N, 4_000).await;
    let producer = replay_producer(&svc.bootstrap);
    let replayed = replay(&db.pool, &producer, &ids).await.expect("replayed");
    assert_eq!(replayed, N as u64);
    let records = kafka::read_all(&svc.bootstrap, &topic, N, WAIT).await;
    assert_eq!(records.len(), N, "each replayed once");
    assert!(records.iter().all(|r| r.payload.len() == 4_000));
    let dedup: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        dedup, 0,
        "their dedup rows removed: each is applied once more"
    );
}

/// Guarantee (docs/consumer.md: a dead letter too large for its `.dlq` copy "keeps the record
/// whole for `postal dead-letters replay`"): a dead letter as large as its topic took (a record
/// of 1,040,000 bytes, under the broker's default limit of 1,048,588) is replayed.
///
/// Broken: the replay producer is made as the relay's, whose `message.max.bytes` is
/// librdkafka's 1,000,000: it refused the record itself ("Message size too large"), so the
/// dead letters of issue 46's item 2 — the ones kept whole for replay — could not be replayed
/// without knowing to pass `--kafka message.max.bytes=…`.
#[tokio::test]
async fn a_dead_letter_as_large_as_its_topic_took_is_replayed() {
    const BIG: usize = 1_040_000;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-big");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let ids = dead_letters_of(&db.pool, &topic, 1, BIG).await;
    let producer = replay_producer(&svc.bootstrap);
    let replayed = replay(&db.pool, &producer, &ids).await.expect("replayed");
    assert_eq!(replayed, 1);
    let records = kafka::read_all(&svc.bootstrap, &topic, 1, WAIT).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].payload.len(), BIG, "whole");
}

/// Guarantee (docs/consumer.md: a dead letter refused even cut "is tried again when a batch
/// has room, so that a topic whose limit an operator raises takes it"): once the topic takes
/// them, dead letters refused before are published, however many older ones it still refuses.
///
/// Broken: a `.dlq` topic that took nothing (`max.message.bytes=1`) got 100 dead letters whose
/// copies are large even cut (a 3,000-byte string where `job` takes a number, quoted in their
/// decode error, makes Postal's headers alone over 2 kB), then 20 small ones; all were marked. The operator raised the
/// limit to 1,200 bytes, which the small ones fit. But every pass took the oldest 100 marked
/// dead letters — the large ones, refused again — so the small ones were never tried again,
/// never published.
#[tokio::test]
async fn dead_letters_a_raised_limit_takes_are_published_behind_many_it_still_refuses() {
    const OLD: usize = 100;
    const NEW: usize = 20;
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dlq-behind");
    let dlq = format!("{topic}.dlq");
    create_topic(&svc.bootstrap, &topic, 1).await;
    create_topic_with(&svc.bootstrap, &dlq, &[("max.message.bytes", "1")]).await;
    // `job` takes {"n": <integer>}: serde's decode error quotes the string, and the dead
    // letter's error (bounded at 2,000 bytes) travels in Postal's headers.
    let old: Vec<RawRecord> = (0..OLD)
        .map(|i| {
            RawRecord::event(
                Uuid::now_v7(),
                &format!("old{i}"),
                "job",
                json!({"n": "b".repeat(3_000)}),
            )
        })
        .collect();
    produce(&svc.bootstrap, &topic, None, &old).await;
    // Uncompressed, so that the copies' sizes are the bytes counted here.
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config
        .kafka
        .insert("compression.type".into(), "none".into());
    let running = start_apply(&db.pool, &topic, config);
    wait::until(
        WAIT,
        "the large dead letters refused and marked",
        || async {
            dead_letters_where(&db.pool, "dlq_unpublishable IS NOT NULL").await == OLD as i64
        },
    )
    .await;
    let new: Vec<RawRecord> = (0..NEW).map(|i| without_id(&format!("new{i}"))).collect();
    produce(&svc.bootstrap, &topic, None, &new).await;
    wait::until(
        WAIT,
        "the small dead letters refused and marked",
        || async {
            dead_letters_where(&db.pool, "dlq_unpublishable IS NOT NULL").await
                == (OLD + NEW) as i64
        },
    )
    .await;
    alter_topic(&svc.bootstrap, &dlq, &[("max.message.bytes", "1200")]).await;
    wait::until(WAIT, "every small dead letter published", || async {
        dead_letters_where(
            &db.pool,
            "published_at IS NOT NULL AND convert_from(record_key, 'UTF8') LIKE 'new%'",
        )
        .await
            == NEW as i64
    })
    .await;
    running.stop().await;
    assert_eq!(
        dead_letters_where(&db.pool, "published_at IS NULL").await,
        OLD as i64,
        "the large ones wait, marked"
    );
}

/// Guarantee (docs/consumer.md: a copy cut to fit "leaves out its value …, and the row in
/// `postal.dead_letters` keeps the record whole for `postal dead-letters replay`"; retention
/// never deletes a dead letter whose only copy is the table): dead-letter retention keeps a
/// dead letter published cut until it is replayed or resolved, while it deletes the whole ones
/// as old.
///
/// Broken: retention deleted every dead letter published longer ago than the retention, cut or
/// not. A 1,040,000-byte record's copy went to `.dlq` without its value; 30 days later the
/// consumer's retention deleted the row, the only copy of the value left anywhere (the `.dlq`
/// copy never had it), though the dead letter was neither replayed nor resolved.
#[tokio::test]
async fn a_dead_letter_published_cut_is_kept_until_replayed_or_resolved() {
    const BIG: usize = 1_040_000;
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dlq-cut-kept");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let big = RawRecord {
        key: Some("big".into()),
        payload: vec![b'x'; BIG],
        headers: vec![("x-origin", "legacy".into())],
    };
    crate::oversized::produce_large(&svc.bootstrap, &topic, &[big, without_id("whole")]).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config.dead_letter_retention = Some(Duration::from_secs(30 * 86_400));
    config.cleanup_interval = Duration::from_millis(200);
    let running = start_apply(&db.pool, &topic, config);
    for key in ["big", "whole"] {
        wait::until(WAIT, "both dead letters published", || {
            published(&db.pool, key)
        })
        .await;
    }
    let copies = kafka::read_all(&svc.bootstrap, &format!("{topic}.dlq"), 2, WAIT).await;
    let cut = copies
        .iter()
        .find(|c| c.key.as_deref() == Some("big"))
        .expect("the big one's copy");
    assert_eq!(cut.header("postal_dlq_cut"), Some("value"));
    assert!(cut.payload.is_empty(), "the copy lacks the value");
    // Both 40 days old: past the retention.
    sqlx::query(
        "UPDATE postal.dead_letters SET created_at = now() - interval '40 days',
                                        published_at = now() - interval '40 days'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let exists = |key: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM postal.dead_letters WHERE record_key = $1)",
            )
            .bind(key.as_bytes())
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    wait::until(WAIT, "retention deleted the old whole one", || async {
        !exists("whole").await
    })
    .await;
    let kept: Option<i32> = sqlx::query_scalar(
        "SELECT octet_length(payload) FROM postal.dead_letters WHERE record_key = 'big'",
    )
    .fetch_optional(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        kept,
        Some(BIG as i32),
        "the cut one stays whole while neither replayed nor resolved"
    );
    // `postal cleanup --dead-letter-retention` keeps it too.
    postal_consumer::retention::cleanup_dead_letters(&db.pool, Duration::from_secs(86_400), 100)
        .await
        .unwrap();
    assert!(exists("big").await, "postal cleanup kept it");
    // Resolved, it goes as the others.
    let id: i64 = sqlx::query_scalar("SELECT id FROM postal.dead_letters WHERE record_key = 'big'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    postal_admin::dead_letters::resolve(
        &db.pool,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "ids": [id] }),
        &[id],
    )
    .await
    .unwrap();
    wait::until(WAIT, "retention deleted it once resolved", || async {
        !exists("big").await
    })
    .await;
    running.stop().await;
}

/// The values of `topic`'s partition 0 on `mock` (waits up to 10 s for at least `n`).
fn mock_values(
    mock: &rdkafka::mocking::MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    topic: &str,
    n: usize,
) -> Vec<Vec<u8>> {
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
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut values = Vec::new();
    while values.len() < n && std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            values.push(m.payload().unwrap_or_default().to_vec());
        }
    }
    values
}

/// Guarantee (`postal_shared::kafka_producer::written`): a replay whose record the producer
/// reports delivered without an offset — librdkafka's "implicit ack", inferred from a later
/// request's success on a partition whose earlier request was refused, which before Kafka 4.5
/// can leave the record unwritten (KAFKA-15591) — is not reported as replayed: the dead letter
/// stands again with its dedup row, and whatever replay reports as replayed is in the topic.
/// librdkafka's mock cluster refuses the first produce request (`NOT_LEADER_FOR_PARTITION`)
/// and appends a later one sent while it is in flight, as those brokers did. (Held: replay
/// checked the offset already; no test modelled it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_reported_delivered_without_an_offset_is_not_taken_as_replayed() {
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::FutureRecord;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mock = MockCluster::new(1).expect("mock cluster");
    mock.create_topic("jobs", 1, 1).expect("topic");
    let producer = replay_producer(mock.bootstrap_servers().as_str());
    // The producer has its id and a connection before the refused request.
    let warm = || FutureRecord::<[u8], [u8]>::to("jobs").payload(b"warm".as_slice());
    producer
        .send(warm(), Duration::from_secs(10))
        .await
        .expect("warm-up record");
    let ids = dead_letters_of(&db.pool, "jobs", 1, 16).await;
    mock.broker_round_trip_time(1, Duration::from_millis(200))
        .expect("round trip time");
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION],
    );
    // The replay's record in a request of its own (refused), another record sent behind it
    // while it is in flight (appended).
    let behind = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        producer
            .send(
                FutureRecord::<[u8], [u8]>::to("jobs").payload(b"behind".as_slice()),
                Duration::from_secs(10),
            )
            .await
    };
    let (replayed, _) = tokio::join!(replay(&db.pool, &producer, &ids), behind);
    let payload: Vec<u8> = sqlx::query_scalar("SELECT payload FROM postal.dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let (open, dedup): (bool, i64) = sqlx::query_as(
        "SELECT replayed_at IS NULL,
                (SELECT count(*) FROM postal.processed_events)
         FROM postal.dead_letters",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    match replayed {
        Ok(n) => {
            assert_eq!(n, 1);
            assert!(!open, "reported replayed: marked so");
            assert_eq!(dedup, 0, "reported replayed: its dedup row removed");
            let values = mock_values(&mock, "jobs", 3);
            assert!(
                values.contains(&payload),
                "reported replayed, but the record is not in the topic ({} records)",
                values.len()
            );
        }
        Err(e) => {
            assert!(open, "not replayed: the dead letter stands again ({e})");
            assert_eq!(dedup, 1, "not replayed: its dedup row is back ({e})");
        }
    }
}
