//! Attacks on the Kafka transport's per-topic size check (`kafka::topics::topic_limit`,
//! `acks::Ack::fits_alone`, the "alone in its key" fence in `transport::send`) and on the
//! dead-letter replay's hold-backs (`admin::dead_letters::replay`): what the tests that came
//! with them (`wal_attack::an_event_over_the_topics_size_limit_is_parked_alone*`,
//! `replay_attack::`) do not model — a record whose estimate misses bytes the broker counts
//! (the key again as `ce_subject`, with compression off), a topic's limit lowered under a
//! running relay (the limit is cached for five minutes), records refused only together, a
//! compressible record over the limit, and a replay of dead letters of two consumers of one
//! topic and key.
//! Breaks are marked `#[ignore = "known: …"]` with what was measured.

use std::time::{Duration, Instant};

use postal_integration_tests::kafka::read_all;
use postal_integration_tests::{services, unique};
use postal_producer::{enqueue_batch, KafkaConfig, KafkaTransport, NewEvent};
use sqlx::PgPool;

use crate::common::{fast_config, RunningRelay};

/// Polls `check` every 100 ms until it holds or `within` passed; whether it held.
async fn holds_within<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn admin(bootstrap: &str) -> rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client")
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

/// Random alphanumeric text of `n` characters (lz4 finds next to nothing to compress in it).
fn noise(seed: u64, n: usize) -> String {
    use rand::{distr::Alphanumeric, Rng, SeedableRng};
    rand::rngs::StdRng::seed_from_u64(seed)
        .sample_iter(&Alphanumeric)
        .take(n)
        .map(char::from)
        .collect()
}

/// The outbox as (key's and event type's first 8 bytes, status, attempts), in seq order.
async fn rows(pool: &PgPool) -> Vec<(String, String, String, i32)> {
    sqlx::query_as(
        "SELECT left(event_key, 8), left(event_type, 8), status::text, attempts FROM postal.outbox ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The transport's size estimate of a record (`KafkaTransport::record_size`: payload, key,
/// user headers, 512 bytes), for an event without user headers.
fn estimate(payload_json: usize, key: usize) -> usize {
    payload_json + key + 512
}

/// Promise (change 1, `Ack::fits_alone`): a record the broker refuses for its size *by itself*
/// is parked (as `wal_attack::an_event_over_the_topics_size_limit_is_parked_alone` shows for
/// one over the limit), and a refusal is "for its neighbours" (sent again, no attempt) only
/// when the record really fits alone.
///
/// The estimate counts the key once, but every record carries it twice (the key and the
/// `ce_subject` header), and does not count the event type, content type or source header
/// values. With `compression.type=none` (documented: "turns it off") and a 4,096-byte key
/// (`MAX_KEY_LEN`), a record whose estimate plus 1 % fits a topic of `max.message.bytes`
/// 100,000 is over 100,000 on the wire. The broker refuses it alone, `fits_alone` says it was
/// refused for its neighbours, and it is held back — no attempt used — and sent again at once,
/// for ever.
///
/// What happened (6 runs of 6): after 20 s the event was still `pending` with 0 attempts, never
/// parked nor published; the relay's `held_back` count 1,595 in one run (a hot loop: every
/// round a produce request the broker refuses; estimate 99,010 bytes, +1 % = 100,000). Fix: count every byte the record carries
/// (the key twice, event type, content type, source, the fixed header names) in
/// `record_size`, or, better, do not trust a fits-alone verdict twice: a record refused for
/// its size that was sent alone (no other record of its partition in its produce request, or
/// simply: its second refusal) counts an attempt / is parked.
#[tokio::test]
/// Since a334947 (the estimate counts the key twice; a refusal of a record that fits alone
/// is transient, attempts counted) it is not resent without attempts; it now meets an older
/// limit: a key this long (4,096 bytes) cannot be parked, since `outbox_held_key_seq`
/// refuses the index row (4,120 bytes, btree maximum 2,704), so the park fails and the event is
/// published again and again (seen 20:10, one run).
async fn a_record_refused_by_itself_is_not_resent_for_ever() {
    refused_by_itself(Some("none"), 100_000, 4096, 8, 16).await;
}

/// [`a_record_refused_by_itself_is_not_resent_for_ever`] with Postal's default compression
/// (lz4, which folds the key's second copy): what the estimate misses then is the event type
/// and content type (each up to 255 bytes, `MAX_NAME_LEN`), the source and the nine header
/// names, about 800 bytes against its 512-byte allowance plus 1 %. A topic of
/// `max.message.bytes` 10,000, an event type and content type of 255 random characters.
///
/// What happened: see the `#[ignore]` line (same loop as with compression off).
#[tokio::test]
/// Fixed by a334947 (the estimate counts the event and content types and the source).
async fn a_record_refused_by_itself_is_not_resent_for_ever_with_lz4() {
    refused_by_itself(None, 10_000, 8, 255, 255).await;
}

/// One event whose estimate plus 1 % just fits a topic of `max.message.bytes` `limit`: a
/// key of `key_len`, event type of `type_len`, content type of `content_type_len` random
/// characters, a random payload; the producer's `compression.type` if given.
async fn refused_by_itself(
    compression: Option<&str>,
    limit: usize,
    key_len: usize,
    type_len: usize,
    content_type_len: usize,
) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("size-fence-alone");
    crate::dead_letters::create_topic_with(
        &svc.bootstrap,
        &topic,
        &[("max.message.bytes", &limit.to_string())],
    )
    .await;
    let key = noise(7, key_len);
    let event_type = noise(9, type_len);
    let content_type = format!("a/{}", noise(10, content_type_len - 2));
    // The largest payload whose estimate passes `size + size / 100 <= limit`.
    let mut payload_len = limit;
    while {
        let size = estimate(payload_len, key.len());
        size + size / 100 > limit
    } {
        payload_len -= 1;
    }
    let size = estimate(payload_len, key.len());
    let payload = noise(8, payload_len).into_bytes();
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![NewEvent::bytes(
            topic.as_str(),
            key.as_str(),
            event_type.as_str(),
            content_type.as_str().try_into().unwrap(),
            payload,
        )
        .unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let mut cfg = KafkaConfig::new(&svc.bootstrap);
    cfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    if let Some(c) = compression {
        cfg.properties.insert("compression.type".into(), c.into());
    }
    let transport = KafkaTransport::new(cfg).expect("kafka transport");
    let relay = RunningRelay::start(&db.pool, transport, fast_config());
    let settled = holds_within(Duration::from_secs(20), || async {
        rows(&db.pool).await.iter().all(|r| r.2 != "pending")
    })
    .await;
    let stats = relay.stop().await;
    let rows = rows(&db.pool).await;
    let on_wire = read_all(&svc.bootstrap, &topic, 1, Duration::from_secs(2)).await;
    assert!(
        settled,
        "a record of {size} estimated bytes (+1 % = {}, topic limit {limit}) was neither parked \
         nor published in 20 s: {rows:?}; held back {} times, parked {}, published {}, {} on the \
         topic",
        size + size / 100,
        stats.held_back,
        stats.parked,
        stats.published,
        on_wire.len()
    );
}

/// Promise (change 1): an event larger than its topic's `max.message.bytes` is parked and its
/// key's next event waits behind it (`wal_attack::an_event_over_the_topics_size_limit_is_parked_alone_by_polling`),
/// also when the operator lowered the topic's limit while the relay runs.
///
/// The relay reads the limit once per five minutes (`TOPIC_LIMIT_RECHECK`). Here a first event
/// makes it read 1,048,588 (the broker's default); then the limit is lowered to 4,000 and a
/// 20,000-character event of key `a` is enqueued with a small one of the same key behind it.
/// With the stale limit the big record "fits alone", so the broker's refusal is taken for its
/// neighbours': held back, no attempt, sent again at once — until the cache expires.
///
/// What happened (6 runs of 6; the order seen broken in each of the 5 whose output was kept): key `a`'s order broken — its
/// `after` event was published (`on the topic: ["first", "after"]`) while its `big` event,
/// earlier, stayed `pending` with 0 attempts, neither parked nor published after 30 s; the
/// relay's `held_back` count 1,353-2,937 (a hot loop of produce requests the broker refuses). The
/// big record is not "alone" by the stale limit, so `after` goes out in the same hand-over,
/// in a later produce request the broker takes. By the code the loop lasts up to five
/// minutes, then the big one is parked — behind its key's later event. Fix: on a
/// `MessageSizeTooLarge` refusal, forget the cached limit of its topic (read it again before
/// the next batch), and treat a refused record whose key's later records went out in the same
/// hand-over as what it is (the key's order is already at stake: fence the key, as a record
/// over the limit is); or send any record over a fraction of the *producer's* limit alone
/// while the topic limit is older than a few seconds.
#[tokio::test]
/// a334947 (a size refusal forgets the topic's cached limit; the record counts an attempt)
/// was not enough: in CI the key's later event, in a later produce request, was written after
/// the broker refused the big one (librdkafka renumbers and sends the rest). Fixed by
/// `enable.gapless.guarantee=true` (the producer stops instead, and is replaced); with one
/// record per request this test failed 3 of 3 without it and passes 3 of 3 with it.
async fn a_limit_lowered_under_a_running_relay_parks_the_big_event() {
    limit_lowered_under_a_running_relay(false).await;
}

/// Guarantee: the same with a WAL relay: the big event is parked with the broker's reason and
/// its key's later event waits behind it, unpublished.
#[tokio::test]
async fn a_limit_lowered_under_a_running_wal_relay_parks_the_big_event() {
    limit_lowered_under_a_running_relay(true).await;
}

/// With the WAL relay when `wal`, else with a polling relay.
async fn limit_lowered_under_a_running_relay(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("size-fence-lowered");
    crate::dead_letters::create_topic_with(&svc.bootstrap, &topic, &[]).await;
    // Dropped (with its publication) at the end of the test, not before.
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let relay = if let Some(slot) = &slot {
        RunningRelay::start(
            &db.pool,
            crate::common::kafka_transport(&svc.bootstrap),
            slot.config(),
        )
    } else {
        // One record per produce request (`batch.num.messages=1`): the big event and the
        // key's later one always travel in separate requests, the later one while the big one
        // is in flight, which is what broke order when the broker refused the big one (in CI
        // once; by chance of timing with Postal's defaults).
        let mut cfg = postal_producer::KafkaConfig::new(&svc.bootstrap);
        cfg.topic_partitions = 4;
        cfg.properties
            .insert("message.timeout.ms".into(), "1000".into());
        cfg.properties
            .insert("batch.num.messages".into(), "1".into());
        RunningRelay::start(
            &db.pool,
            postal_producer::KafkaTransport::new(cfg).expect("kafka transport"),
            crate::common::fast_config(),
        )
    };
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![NewEvent::json(topic.as_str(), "first", "first", &0).unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(
        holds_within(Duration::from_secs(20), || async {
            rows(&db.pool).await.is_empty()
        })
        .await,
        "the first event was not published"
    );
    alter_topic(&svc.bootstrap, &topic, &[("max.message.bytes", "4000")]).await;
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![
            NewEvent::json(topic.as_str(), "a", "big", &noise(50, 20_000)).unwrap(),
            NewEvent::json(topic.as_str(), "a", "after", &0).unwrap(),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let settled = holds_within(Duration::from_secs(30), || async {
        rows(&db.pool)
            .await
            .iter()
            .any(|r| r.1 == "big" && r.2 == "failed")
    })
    .await;
    let stats = relay.stop().await;
    let rows = rows(&db.pool).await;
    let on_wire = read_all(&svc.bootstrap, &topic, 3, Duration::from_secs(2)).await;
    let types: Vec<String> = on_wire
        .iter()
        .map(|r| r.header("ce_type").unwrap_or("?").to_owned())
        .collect();
    assert_eq!(
        types,
        vec!["first"],
        "nothing of key a may be published before its big event; outbox: {rows:?}; held back {} \
         times, parked {}, published {}",
        stats.held_back,
        stats.parked,
        stats.published
    );
    assert!(
        settled,
        "the big event (over the lowered limit of 4000) was not parked in 30 s: {rows:?}; held back \
         {} times, parked {}, published {}",
        stats.held_back, stats.parked, stats.published
    );
}

/// Promise (change 1, "refused for its neighbours"): records that each fit their topic's
/// `max.message.bytes` but not together (the producer packs a partition's queued records into
/// one record batch up to its own `message.max.bytes`, and the broker checks the whole batch)
/// are all published, once each and in key order, and none is parked — `keys` distinct keys
/// (`same_key`: one key) of twelve 2,500-byte random payloads, a one-partition topic of limit
/// 4,000 (two records together are over it).
async fn neighbours_over_the_limit_together(same_key: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("size-fence-neigh");
    crate::dead_letters::create_topic_with(
        &svc.bootstrap,
        &topic,
        &[("max.message.bytes", "4000")],
    )
    .await;
    let mut events = Vec::new();
    for i in 0..12u64 {
        let key = if same_key {
            "k".to_owned()
        } else {
            format!("k{i}")
        };
        events.push(
            NewEvent::json(topic.as_str(), key.as_str(), "n", &noise(100 + i, 2_500)).unwrap(),
        );
    }
    let mut tx = db.pool.begin().await.unwrap();
    let ids: Vec<String> = enqueue_batch(&mut tx, events)
        .await
        .unwrap()
        .iter()
        .map(|id| id.to_string())
        .collect();
    tx.commit().await.unwrap();
    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let settled = holds_within(Duration::from_secs(30), || async {
        rows(&db.pool).await.is_empty()
    })
    .await;
    let stats = relay.stop().await;
    eprintln!(
        "neighbours (same key: {same_key}): held back {}, parked {}, published {}",
        stats.held_back, stats.parked, stats.published
    );
    let rows = rows(&db.pool).await;
    let on_wire = read_all(&svc.bootstrap, &topic, 12, Duration::from_secs(10)).await;
    let got: Vec<String> = on_wire
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    assert!(
        settled,
        "not all published in 30 s: outbox {rows:?}; held back {} times, parked {}, published {}, {} on the topic",
        stats.held_back,
        stats.parked,
        stats.published,
        got.len()
    );
    if same_key {
        assert_eq!(got, ids, "key k once each, in order");
    } else {
        let mut once = got.clone();
        once.sort();
        let mut want = ids.clone();
        want.sort();
        assert_eq!(once, want, "each once");
    }
}

/// [`neighbours_over_the_limit_together`], twelve keys. Holds (3 of 3; the relay held back
/// 90-113 refusals per run, so the case was met): models records refused only for sharing a
/// record batch, none over the limit, which no other test does.
#[tokio::test]
async fn records_over_the_limit_only_together_are_all_published() {
    neighbours_over_the_limit_together(false).await;
}

/// [`neighbours_over_the_limit_together`], one key: each refusal for the neighbours holds the
/// key's later records back; none may be written ahead of an earlier one. Holds (3 of 3; 79-117
/// held back per run).
#[tokio::test]
async fn records_of_one_key_over_the_limit_only_together_are_published_in_order() {
    neighbours_over_the_limit_together(true).await;
}

/// Promise (change 1): a record over its topic's limit before compression that the broker
/// takes (it compresses below the limit) is published, and its key's later records follow it
/// in order, without the key being fenced for good (the fence lasts until the batch is
/// recorded). A 20,000-byte run of one character (lz4: a few hundred bytes) of key `a`, then
/// five more of `a`, a topic of limit 4,000. Holds: models a compressible record over the limit,
/// which the existing tests (random payloads) do not. 3 of 3 (5 held back per run: the key's
/// later records, once).
#[tokio::test]
async fn a_compressible_record_over_the_limit_is_published_and_its_key_follows() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("size-fence-lz4");
    crate::dead_letters::create_topic_with(
        &svc.bootstrap,
        &topic,
        &[("max.message.bytes", "4000")],
    )
    .await;
    let mut events = vec![NewEvent::json(topic.as_str(), "a", "big", &"x".repeat(20_000)).unwrap()];
    for i in 0..5 {
        events.push(NewEvent::json(topic.as_str(), "a", "after", &i).unwrap());
    }
    let mut tx = db.pool.begin().await.unwrap();
    let ids: Vec<String> = enqueue_batch(&mut tx, events)
        .await
        .unwrap()
        .iter()
        .map(|id| id.to_string())
        .collect();
    tx.commit().await.unwrap();
    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let settled = holds_within(Duration::from_secs(20), || async {
        rows(&db.pool).await.is_empty()
    })
    .await;
    let stats = relay.stop().await;
    eprintln!(
        "compressible: held back {}, parked {}, published {}",
        stats.held_back, stats.parked, stats.published
    );
    let rows = rows(&db.pool).await;
    let got: Vec<String> = read_all(&svc.bootstrap, &topic, 6, Duration::from_secs(10))
        .await
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    assert!(
        settled,
        "not all published in 20 s: {rows:?}; held back {}, parked {}",
        stats.held_back, stats.parked
    );
    assert_eq!(got, ids, "key a once each, in order");
}

/// Records a dead letter of `consumer` on `topic` with `key` (its event id also as its
/// `ce_id` header) with its dedup row, as the consumer writes them together; returns (dead
/// letter id, event id).
async fn dead_letter(pool: &PgPool, consumer: &str, topic: &str, key: &str) -> (i64, uuid::Uuid) {
    let event = uuid::Uuid::now_v7();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
             kafka_offset, event_id, record_key, payload, header_names, header_values,
             reason, error, attempts, dlq_topic)
         VALUES ($1, $1, $2, 0, 0, $3, $4, '\\x00', ARRAY['ce_id', 'ce_type'],
                 ARRAY[convert_to($3::text, 'UTF8'), convert_to('job', 'UTF8')],
                 'permanent', 'declined', 1, $2 || '.dlq')
         RETURNING id",
    )
    .bind(consumer)
    .bind(topic)
    .bind(event)
    .bind(key.as_bytes().to_vec())
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
    (id, event)
}

/// Promise (change 2, fe7f883: "a keyed dead letter waits while an older open one of its
/// *consumer*, topic and key is outside the replay"): the hold-back is per consumer — a dead
/// letter of consumer `ship` is replayed although consumer `billing` has an older open dead
/// letter of the same topic and key outside the replay, also when the replay holds one of
/// `billing`'s later dead letters of that key back for it.
///
/// Dead letters, all of topic T and key `k`: 1 `billing` (left out), 2 `billing`, 3 `ship`;
/// the replay of [2, 3] (an operator's filter by reason, say). By the code the replay groups a
/// chunk's dead letters by (topic, key) only, and a dead letter that waits holds back the rest
/// of its group: `ship`'s 3 is held back behind `billing`'s 2, which waits for `billing`'s 1.
///
/// Broke before the fix (4 runs of 4): nothing on the topic; open after the replay [1, 2, 3]; the
/// replay's error "replaying dead letter 2 … failed: not sent: dead letter 1 of its key, older
/// and still open, is not in this replay (replay it with this one) (0 of 2 replayed; …)":
/// `ship`'s dead letter stays open as long as `billing`'s 1 does, and the error does not name
/// it. The same holds across chunks: `held_keys` is keyed by (topic, key), not by consumer.
/// Fixed: the chunk is grouped and `held_keys` keyed by (consumer, topic, key) (each
/// consumer's order is its own; the other consumers' copies of a replayed record are
/// duplicates their dedup rows drop).
#[tokio::test]
async fn a_replay_holds_back_a_key_per_consumer() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("size-fence-replay-consumers");
    crate::common::create_topic(&svc.bootstrap, &topic, 1).await;
    let left_out = dead_letter(&db.pool, "billing", &topic, "k").await;
    let billing = dead_letter(&db.pool, "billing", &topic, "k").await;
    let ship = dead_letter(&db.pool, "ship", &topic, "k").await;
    let producer = postal_shared::kafka_producer::replay_config(
        &svc.bootstrap,
        &std::collections::BTreeMap::new(),
    )
    .expect("producer settings")
    .create::<rdkafka::producer::FutureProducer>()
    .expect("producer");
    let ids = [billing.0, ship.0];
    let outcome = postal_admin::dead_letters::replay(
        &db.pool,
        &producer,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "ids": ids }),
        &ids,
        |_| {},
    )
    .await;
    let sent: Vec<String> = read_all(&svc.bootstrap, &topic, 1, Duration::from_secs(5))
        .await
        .iter()
        .map(|r| r.header("ce_id").unwrap_or("-").to_owned())
        .collect();
    let open: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM postal.dead_letters WHERE replayed_at IS NULL AND resolved_at IS NULL ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        sent,
        vec![ship.1.to_string()],
        "ship's dead letter {} replayed (billing's {} waits for {}); open now {open:?}; replay: {outcome:?}",
        ship.0,
        billing.0,
        left_out.0
    );
}
