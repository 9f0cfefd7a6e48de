//! A dead letter keeps every header of its record: what it keeps of a
//! record's headers, what its `.dlq` copy and a replay send back, byte for byte and in order
//! (values absent vs empty, binary values, repeated names, odd names).

use std::time::{Duration, Instant};

use postal_integration_tests::raw_produce::produce_raw;
use postal_integration_tests::{services, unique, wait};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use uuid::Uuid;

use crate::common::{consumer_config, create_topic, effects, effects_table, start_apply};
use crate::handlers;

const WAIT: Duration = Duration::from_secs(60);

/// A record's headers as the wire has them: name, value (`None`: no value), in order.
pub(crate) type WireHeaders = Vec<(String, Option<Vec<u8>>)>;

/// Produces one record to partition 0 of `topic` with exactly `headers`.
pub(crate) async fn produce_with(
    bootstrap: &str,
    topic: &str,
    key: &[u8],
    payload: &[u8],
    headers: &WireHeaders,
) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("message.max.bytes", "10000000")
        .create()
        .expect("producer");
    let mut h = OwnedHeaders::new_with_capacity(headers.len());
    for (n, v) in headers {
        h = h.insert(Header {
            key: n.as_str(),
            value: v.as_deref(),
        });
    }
    producer
        .send(
            FutureRecord::to(topic)
                .partition(0)
                .key(key)
                .payload(payload)
                .headers(h),
            Duration::from_secs(15),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produced");
}

/// The headers of the record at `offset` of partition 0 of `topic`, as the wire has them.
pub(crate) async fn headers_at(bootstrap: &str, topic: &str, offset: i64) -> WireHeaders {
    let (bootstrap, topic) = (bootstrap.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", unique("reader"))
            .set("enable.auto.commit", "false")
            .set("log_level", "0")
            .create()
            .expect("reader");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Offset(offset))
            .expect("partition");
        consumer.assign(&tpl).expect("assign");
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
                if m.offset() != offset {
                    continue;
                }
                return m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                            .collect()
                    })
                    .unwrap_or_default();
            }
        }
        panic!("no record at offset {offset} of {topic}");
    })
    .await
    .unwrap()
}

/// 300 headers (more than the default `max_headers`, 256): Postal's envelope, then headers
/// without a value, with an empty value, with binary values (NUL, bytes that are not UTF-8),
/// the same name three times (in an order to keep), names with an escape sequence, a bidi
/// override and a non-ASCII letter, a value of 8,000 bytes, and ordinary ones to fill.
fn hostile_headers(id: &str) -> WireHeaders {
    let mut h: WireHeaders = vec![
        ("ce_id".into(), Some(id.as_bytes().to_vec())),
        ("ce_type".into(), Some(b"job".to_vec())),
        ("content-type".into(), Some(b"application/json".to_vec())),
        ("x-absent".into(), None),
        ("x-empty".into(), Some(Vec::new())),
        ("x-binary".into(), Some(vec![0, 0xff, 0xfe, 0x80, 0])),
        ("dup".into(), Some(b"first".to_vec())),
        ("x-between".into(), None),
        ("dup".into(), Some(b"second".to_vec())),
        ("dup".into(), None),
        ("odd\u{1b}[31m\u{202e}name".into(), Some(b"v".to_vec())),
        ("x-\u{e9}".into(), Some("\u{e9}".as_bytes().to_vec())),
        ("x-large".into(), Some(vec![b'L'; 8000])),
    ];
    let fill = 300 - h.len();
    h.extend((0..fill).map(|i| (format!("h{i:03}"), Some(format!("value {i}").into_bytes()))));
    h
}

/// Guarantee (issue 46: the dead letter keeps the record whole, and replay sends it back): a
/// record with more headers than `max_headers` is dead-lettered, and both its `.dlq` copy and
/// `postal dead-letters replay` carry exactly the record's headers, in order — a header
/// without a value still without one, an empty value empty, binary values byte for byte, a
/// repeated name with each of its values in place.
///
/// Broken: the dead-letter row stored a header without a value as an empty value
/// (`v.unwrap_or_default()`), and the `.dlq` copy and the replay sent every value as
/// `Some(..)`: a consumer that tells "no value" from "empty" (Kafka does) got another record.
#[tokio::test]
async fn a_dead_letters_headers_go_back_byte_for_byte_with_absent_values_absent() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dl-headers");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let id = Uuid::now_v7().to_string();
    let sent = hostile_headers(&id);
    produce_with(&svc.bootstrap, &topic, b"k", br#"{"n": 0}"#, &sent).await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "the record dead-lettered", || {
        let s = stats.snapshot();
        async move { s.dead_letters == 1 }
    })
    .await;
    // The `.dlq` copy: the record's headers first, then Postal's `postal_dlq_*`.
    wait::until(WAIT, "the dead letter published to its .dlq topic", || {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT published_at IS NOT NULL FROM postal.dead_letters",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(false)
        }
    })
    .await;
    running.stop().await;
    let (dl, dlq_topic): (i64, String) =
        sqlx::query_as("SELECT id, dlq_topic FROM postal.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let copy = headers_at(&svc.bootstrap, &dlq_topic, 0).await;
    assert!(
        copy.len() > sent.len(),
        "the copy carries Postal's headers too"
    );
    assert_eq!(copy[..sent.len()], sent[..], "the .dlq copy's headers");

    let producer = postal_shared::kafka_producer::replay_config(
        &svc.bootstrap,
        &std::collections::BTreeMap::new(),
    )
    .expect("producer settings")
    .create()
    .expect("producer");
    let replayed = postal_admin::dead_letters::replay(
        &db.pool,
        &producer,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "ids": [dl] }),
        &[dl],
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(replayed, 1);
    let back = headers_at(&svc.bootstrap, &topic, 1).await;
    assert_eq!(back, sent, "the replayed record's headers");
}

/// Guarantee: a record whose header names hold a NUL (valid UTF-8, which no PostgreSQL text
/// can hold; sent byte by byte) and whose payload its handler cannot decode is dead-lettered
/// like any other, each header in its place, and the partition moves on: the next record is
/// applied. The names are kept as the Kafka client reads them, up to the NUL (`x\0y` as `x`):
/// a limit of librdkafka's header accessor, not of the row.
///
/// Would be broken if a NUL reached the row: writing the dead letter would fail
/// (`header_names text[]`), and the partition would stay on the record. Passes on main.
#[tokio::test]
async fn a_header_name_with_a_nul_is_dead_lettered_and_the_partition_moves_on() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dl-nul-name");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let bad = Uuid::now_v7().to_string();
    let good = Uuid::now_v7().to_string();
    let envelope = |id: &str| -> WireHeaders {
        vec![
            ("ce_id".into(), Some(id.as_bytes().to_vec())),
            ("ce_type".into(), Some(b"job".to_vec())),
            ("content-type".into(), Some(b"application/json".to_vec())),
        ]
    };
    // Sent byte by byte: librdkafka would cut a name at its NUL.
    let (b, t, i) = (svc.bootstrap.clone(), topic.clone(), bad.clone());
    tokio::task::spawn_blocking(move || {
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b"ce_id", i.as_bytes()),
            (b"ce_type", b"job"),
            (b"content-type", b"application/json"),
            (b"x\0y", b"v"),
            (b"x-\0", b""),
        ];
        let code = produce_raw(&b, &t, 0, b"k", b"not json", &headers).expect("raw produce");
        assert_eq!(code, 0, "the broker stored the raw record");
    })
    .await
    .unwrap();
    produce_with(
        &svc.bootstrap,
        &topic,
        b"k",
        br#"{"n": 1}"#,
        &envelope(&good),
    )
    .await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    wait::until(WAIT, "the next record applied", || {
        let pool = db.pool.clone();
        async move { effects(&pool).await.1 == 1 }
    })
    .await;
    running.stop().await;
    let kept: (Vec<String>, String) =
        sqlx::query_as("SELECT header_names, event_id::text FROM postal.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(kept.1, bad, "the record is the dead letter");
    // The Kafka client reads a header name as a C string: up to its first NUL.
    assert_eq!(
        kept.0,
        ["ce_id", "ce_type", "content-type", "x", "x-"],
        "every header has its place"
    );
}

/// Writes `n` open dead letters of `topic` as a consumer before migration 32 wrote them (no
/// `header_absent`): key `k`, a payload of `bytes` bytes, headers `ce_id` and `x-empty` (an
/// empty value); their ids.
async fn old_dead_letters(pool: &sqlx::PgPool, topic: &str, n: i32, bytes: i32) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition, kafka_offset,
             event_id, event_type, record_key, payload, header_names, header_values, reason,
             error, attempts, dlq_topic)
         SELECT 'c', 'g', $1, 0, i, gen_random_uuid(), 'job', '\\x6b'::bytea,
                convert_to(repeat('p', $3), 'UTF8'), ARRAY['ce_id', 'x-empty'],
                ARRAY[convert_to(i::text, 'UTF8'), '\\x'::bytea], 'permanent', 'refused', 1,
                $1 || '.dlq'
         FROM generate_series(1, $2) AS i ORDER BY i RETURNING id",
    )
    .bind(topic)
    .bind(n)
    .bind(bytes)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Guarantee (upgrade): a dead letter written before migration 32 (no `header_absent`) replays
/// as it did: its headers in order, an empty value empty.
#[tokio::test]
async fn a_dead_letter_written_before_absent_values_were_kept_replays_as_before() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dl-old-row");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let ids = old_dead_letters(&db.pool, &topic, 1, 10).await;
    let producer = postal_shared::kafka_producer::replay_config(
        &svc.bootstrap,
        &std::collections::BTreeMap::new(),
    )
    .expect("producer settings")
    .create()
    .expect("producer");
    let replayed = postal_admin::dead_letters::replay(
        &db.pool,
        &producer,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "ids": ids }),
        &ids,
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(replayed, 1);
    assert_eq!(
        headers_at(&svc.bootstrap, &topic, 0).await,
        vec![
            ("ce_id".to_owned(), Some(b"1".to_vec())),
            ("x-empty".to_owned(), Some(Vec::new()))
        ]
    );
}

/// Guarantee: `postal dead-letters replay --all` holds a bounded part of the dead letters it
/// replays, not all of them: 200 dead letters of 900 KB (180 MB) are all replayed with the
/// CLI's peak RSS under 100 MiB (54,964 KiB measured; chunks of about 4 MiB).
///
/// Broken: every selected dead letter was read whole into memory before the first was sent
/// (rows whose records' headers are kept whole, however many, made that worse): 326,788 KiB.
#[tokio::test]
async fn replaying_many_large_dead_letters_holds_a_chunk_at_a_time() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dl-replay-big");
    create_topic(&svc.bootstrap, &topic, 1).await;
    old_dead_letters(&db.pool, &topic, 200, 900_000).await;
    let run = std::process::Command::new(crate::procs::bin_dir().join("peak_rss"))
        .arg(crate::procs::bin_dir().join("postal"))
        .args(["dead-letters", "replay", "--all"])
        .env("DATABASE_URL", &db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("run the postal CLI");
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "replay: {stderr}");
    let peak_kib: i64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix("peak_rss_kib="))
        .unwrap_or_else(|| panic!("no peak reported: {stderr}"))
        .parse()
        .unwrap();
    let open: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters WHERE replayed_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(open, 0, "all 200 replayed");
    eprintln!("dead-letters replay of 200 x 900 KB: peak RSS {peak_kib} KiB");
    assert!(
        peak_kib < 100 * 1024,
        "the replay's peak RSS was {peak_kib} KiB for 180 MB of dead letters"
    );
}

/// Guarantee: replaying a dead letter whose record no longer fits its topic (300 headers of
/// 400 random bytes, which no compression shrinks, and a 10 kB value, a topic whose `max.message.bytes` is 100,000) ends as a
/// failure that says so, every time it is run, and changes nothing: the dead letter stays open
/// with its dedup row, and the audit row records it matched 1 and affected 0. No send is
/// retried without end. Passes on main (and with replay's chunks).
#[tokio::test]
async fn replaying_a_dead_letter_its_topic_no_longer_takes_fails_and_leaves_it_open() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dl-replay-over");
    crate::dead_letters::create_topic_with(
        &svc.bootstrap,
        &topic,
        &[("max.message.bytes", "100000")],
    )
    .await;
    let (id, event): (i64, Uuid) = sqlx::query_as(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition, kafka_offset,
             event_id, event_type, record_key, payload, header_names, header_values, reason,
             error, attempts, dlq_topic)
         SELECT 'c', 'g', $1, 0, 0, gen_random_uuid(), 'job', '\\x6b'::bytea,
                convert_to(repeat('p', 10000), 'UTF8'),
                (SELECT array_agg('h' || i ORDER BY i) FROM generate_series(1, 300) AS i),
                (SELECT array_agg((SELECT decode(string_agg(md5(random()::text || i || g), ''), 'hex')
                                    FROM generate_series(1, 25) AS g))
                 FROM generate_series(1, 300) AS i),
                'undecodable', 'too many headers', 1, $1 || '.dlq'
         RETURNING id, event_id",
    )
    .bind(&topic)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // The dedup row a dead letter writes in its own transaction (at its time).
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
         SELECT consumer_name, event_id, created_at FROM postal.dead_letters",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let producer = postal_shared::kafka_producer::replay_config(
        &svc.bootstrap,
        &std::collections::BTreeMap::new(),
    )
    .expect("producer settings")
    .create()
    .expect("producer");
    for run in 1..=2 {
        let err = postal_admin::dead_letters::replay(
            &db.pool,
            &producer,
            &postal_admin::audit::Operator::cli("test"),
            &serde_json::json!({ "ids": [id] }),
            &[id],
            |_| {},
        )
        .await
        .expect_err("the topic refuses the record")
        .to_string();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!("dead letter {id}")),
            "run {run}: {err}"
        );
        let (open, dedup): (bool, i64) = sqlx::query_as(
            "SELECT replayed_at IS NULL AND resolved_at IS NULL,
                    (SELECT count(*) FROM postal.processed_events WHERE event_id = $2)
             FROM postal.dead_letters WHERE id = $1",
        )
        .bind(id)
        .bind(event)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            (open, dedup),
            (true, 1),
            "run {run}: still open, dedup row kept"
        );
    }
    let rows: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT matched, affected FROM postal.operator_audit WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows, [(Some(1), 0), (Some(1), 0)]);
}

/// Guarantee: `max_headers` (256 by default) is the most a record may carry: one with exactly
/// 256 headers is applied, one with 257 is dead-lettered with all 257 in its row, in order,
/// and the partition moves on. Passes on main.
#[tokio::test]
async fn exactly_max_headers_is_applied_and_one_more_is_dead_lettered_whole() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dl-at-limit");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let record = |id: &str, count: usize| -> WireHeaders {
        let mut h: WireHeaders = vec![
            ("ce_id".into(), Some(id.as_bytes().to_vec())),
            ("ce_type".into(), Some(b"job".to_vec())),
            ("content-type".into(), Some(b"application/json".to_vec())),
        ];
        h.extend((h.len()..count).map(|i| (format!("h{i}"), Some(vec![b'v'; i % 7]))));
        h
    };
    let (at, over) = (Uuid::now_v7().to_string(), Uuid::now_v7().to_string());
    let over_headers = record(&over, 257);
    produce_with(
        &svc.bootstrap,
        &topic,
        b"k",
        br#"{"n": 0}"#,
        &record(&at, 256),
    )
    .await;
    produce_with(&svc.bootstrap, &topic, b"k", br#"{"n": 1}"#, &over_headers).await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "one applied, one dead-lettered", || {
        let s = stats.snapshot();
        let pool = db.pool.clone();
        async move { s.dead_letters == 1 && effects(&pool).await.1 == 1 }
    })
    .await;
    running.stop().await;
    let (event, names): (String, Vec<String>) =
        sqlx::query_as("SELECT event_id::text, header_names FROM postal.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(event, over, "the 257-header record is the dead letter");
    let sent: Vec<String> = over_headers.into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, sent, "all 257 kept, in order");
}
