//! Hostile input: records no Kafka client library would write, sent byte by byte, on the
//! consumer's decode path; outbox rows written around `postal.enqueue` on the relay's.

use std::time::Duration;

use postal_integration_tests::raw_produce::produce_raw;
use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, start_apply, start_apply_with,
    RawRecord,
};
use crate::handlers;

const WAIT: Duration = Duration::from_secs(60);

/// Guarantee: a record with a header name that is not valid UTF-8 (the Kafka client library
/// panics reading it) neither crashes nor stops the consumer: it is dead-lettered as
/// undecodable with a one-line reason naming the header, and the records after it are
/// applied. Before, the consumer panicked outside any handler and exited, and did the same
/// after every restart with the offset never moving.
#[tokio::test]
async fn a_header_name_that_is_not_utf8_is_dead_lettered_and_the_partition_moves_on() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("hostile");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let bad = Uuid::now_v7().to_string();
    let (b, t) = (svc.bootstrap.clone(), topic.clone());
    let code = tokio::task::spawn_blocking(move || {
        produce_raw(
            &b,
            &t,
            0,
            b"k",
            br#"{"n": 0}"#,
            &[
                (b"ce_id", bad.as_bytes()),
                (b"ce_type", b"job"),
                (b"content-type", b"application/json"),
                (&[0xff, 0xfe, b'x'], b"v"),
            ],
        )
    })
    .await
    .unwrap()
    .expect("raw produce");
    assert_eq!(code, 0, "the broker stored the raw record");
    let good = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[RawRecord::event(good, "k", "job", json!({"n": 1}))],
    )
    .await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(
        WAIT,
        "the bad record dead-lettered and the good one applied",
        || {
            let s = stats.snapshot();
            async move { s.dead_letters == 1 && s.applied == 1 }
        },
    )
    .await;
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (1, 1));
    let (reason, error): (String, String) =
        sqlx::query_as("SELECT reason, error FROM postal.dead_letters WHERE topic = $1")
            .bind(&topic)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "undecodable");
    assert_eq!(error, "header #3 has a name that is not valid UTF-8");
}

/// Guarantee: a record carrying one of Postal's headers twice (here `ce_type`: a spoofed type
/// after the real one) is not handled as either: it is dead-lettered as undecodable with a
/// one-line reason naming the header, and the records after it are applied. Before, the
/// consumer read the last value and ran the spoofed type's handler.
#[tokio::test]
async fn a_record_with_a_reserved_header_twice_is_dead_lettered() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("hostile-dup");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let bad = Uuid::now_v7().to_string();
    let (b, t) = (svc.bootstrap.clone(), topic.clone());
    let code = tokio::task::spawn_blocking(move || {
        produce_raw(
            &b,
            &t,
            0,
            b"k",
            br#"{"n": 0}"#,
            &[
                (b"ce_id", bad.as_bytes()),
                (b"ce_type", b"audit.noop"),
                (b"content-type", b"application/json"),
                (b"ce_type", b"job"),
            ],
        )
    })
    .await
    .unwrap()
    .expect("raw produce");
    assert_eq!(code, 0, "the broker stored the raw record");
    let good = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[RawRecord::event(good, "k", "job", json!({"n": 1}))],
    )
    .await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(
        WAIT,
        "the spoofed record dead-lettered and the good one applied",
        || {
            let s = stats.snapshot();
            async move { s.dead_letters == 1 && s.applied == 1 }
        },
    )
    .await;
    running.stop().await;
    assert_eq!(
        effects(&db.pool).await,
        (1, 1),
        "only the good record applied"
    );
    let (reason, error): (String, String) =
        sqlx::query_as("SELECT reason, error FROM postal.dead_letters WHERE topic = $1")
            .bind(&topic)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "undecodable");
    assert_eq!(
        error,
        "header ce_type appears 2 times (Postal writes it once)"
    );
}

/// Guarantee: an outbox row written around `postal.enqueue` with a stored header that Postal
/// sets itself (`ce_id` naming another event) is never published with two ids: the relay parks
/// it with a one-line reason naming the header, and the other events flow. Before, it went
/// out carrying both ids, and the consumer took it for the other event (a duplicate, dropped).
#[tokio::test]
async fn a_stored_row_with_a_reserved_header_is_parked_not_published() {
    a_stored_row_with_a_reserved_header_is_parked_not_published_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the test's rows).
#[tokio::test]
async fn a_stored_row_with_a_reserved_header_is_parked_not_published_wal() {
    a_stored_row_with_a_reserved_header_is_parked_not_published_with(true).await;
}

async fn a_stored_row_with_a_reserved_header_is_parked_not_published_with(wal: bool) {
    use postal_producer::NewEvent;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("hostile-row");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let other = Uuid::now_v7();
    let spoofer = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, headers)
         VALUES ($1, $2, 'k1', 'audit.noop', '{}'::bytea, jsonb_build_object('ce_id', $3::text))",
    )
    .bind(spoofer)
    .bind(&topic)
    .bind(other.to_string())
    .execute(&db.pool)
    .await
    .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let fine = postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k2", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let relay = crate::common::RunningRelay::start(
        &db.pool,
        crate::common::kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    wait::until(
        WAIT,
        "the spoofing row parked and the other published",
        || async {
            let left: Vec<(Uuid, String)> =
                sqlx::query_as("SELECT event_id, status FROM postal.outbox")
                    .fetch_all(&db.pool)
                    .await
                    .unwrap();
            left == vec![(spoofer, "failed".to_string())]
        },
    )
    .await;
    relay.stop().await;
    let reason: String =
        sqlx::query_scalar("SELECT last_error FROM postal.outbox WHERE event_id = $1")
            .bind(spoofer)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(reason.contains("\"ce_id\" is reserved"), "{reason}");
    assert_eq!(reason.lines().count(), 1);
    let records = postal_integration_tests::kafka::read_all(
        &svc.bootstrap,
        &topic,
        1,
        Duration::from_secs(30),
    )
    .await;
    let ids: Vec<String> = records
        .iter()
        .filter_map(|r| r.header("ce_id").map(str::to_owned))
        .collect();
    assert_eq!(
        ids,
        vec![fine.to_string()],
        "only the other event on the topic"
    );
}

/// Guarantee: an oversized field never becomes an oversized error. A record whose `ce_id` is
/// 600 KB (with an escape sequence at its start) is dead-lettered with a reason of at most
/// about 2 KB, control characters written as escapes, and its copy reaches `<topic>.dlq`; a
/// record whose payload fails to decode with a 600 KB string quoted in the decode error gets a
/// bounded reason too. Before, the reason was the whole 600 KB field (a 600 KB log line and
/// `dead_letters.error`, and a copy over the producer's message size limit).
#[tokio::test]
async fn oversized_fields_give_bounded_escaped_dead_letter_reasons() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("hostile-big");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let huge_id = format!("\u{1b}]0;pwned\u{7}{}", "a".repeat(600_000));
    let (b, t) = (svc.bootstrap.clone(), topic.clone());
    let code = tokio::task::spawn_blocking(move || {
        produce_raw(
            &b,
            &t,
            0,
            b"k",
            br#"{"n": 0}"#,
            &[
                (b"ce_id", huge_id.as_bytes()),
                (b"ce_type", b"job"),
                (b"content-type", b"application/json"),
            ],
        )
    })
    .await
    .unwrap()
    .expect("raw produce");
    assert_eq!(code, 0, "the broker stored the raw record");
    // `job` expects {"n": <integer>}: a 600 KB string there fails decoding, and serde's error
    // quotes it.
    let bad_payload = Uuid::now_v7();
    let good = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[
            RawRecord::event(bad_payload, "k", "job", json!({"n": "b".repeat(600_000)})),
            RawRecord::event(good, "k", "job", json!({"n": 1})),
        ],
    )
    .await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "two dead-lettered and the good one applied", || {
        let s = stats.snapshot();
        async move { s.dead_letters == 2 && s.applied == 1 }
    })
    .await;
    let pool = db.pool.clone();
    wait::until(
        WAIT,
        "both copies published to the dead-letter topic",
        || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM postal.dead_letters WHERE published_at IS NOT NULL",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
                    == 2
            }
        },
    )
    .await;
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (1, 1));
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT reason, error FROM postal.dead_letters ORDER BY kafka_offset")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows[0].0, "missing_event_id");
    assert_eq!(rows[1].0, "undecodable");
    for (_, error) in &rows {
        assert!(error.len() <= 2_100, "reason of {} bytes", error.len());
        assert!(
            !error.contains('\u{1b}') && !error.contains('\u{7}'),
            "{error:.200}"
        );
    }
    assert!(rows[0].0 == "missing_event_id" && rows[0].1.contains("\\u{1b}]0;pwned\\u{7}aaa"));
    assert!(rows[0].1.contains("more bytes)"), "{:.300}", rows[0].1);
}

/// Guarantee: a relay publishes only to topics its allow-list names, and creates no other:
/// rows naming another topic, or a dead-letter topic (`….dlq`, which even a matching prefix
/// does not allow), are parked with a one-line reason, and neither topic comes to exist; the
/// same key's event on an allowed topic is published (a key's scope is its topic and key).
/// Before, the relay created and published to whatever topic a row named.
#[tokio::test]
async fn rows_naming_topics_outside_the_allow_list_are_parked_and_nothing_is_created() {
    rows_naming_topics_outside_the_allow_list_are_parked_and_nothing_is_created_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the test's rows).
#[tokio::test]
async fn rows_naming_topics_outside_the_allow_list_are_parked_and_nothing_is_created_wal() {
    rows_naming_topics_outside_the_allow_list_are_parked_and_nothing_is_created_with(true).await;
}

async fn rows_naming_topics_outside_the_allow_list_are_parked_and_nothing_is_created_with(
    wal: bool,
) {
    use crate::missing_topic::topic_exists;
    use postal_producer::{enqueue, KafkaConfig, KafkaTransport, NewEvent, TopicAllowList};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let allowed = unique("allow-ok");
    let other = unique("allow-no");
    let dlq = format!("{allowed}.dlq");
    let mut conn = db.pool.acquire().await.unwrap();
    for (topic, key) in [(&allowed, "a"), (&other, "b"), (&dlq, "c"), (&allowed, "b")] {
        enqueue(
            &mut conn,
            NewEvent::json(topic.as_str(), key, "e", &1).unwrap(),
        )
        .await
        .unwrap();
    }
    drop(conn);
    let mut cfg = KafkaConfig::new(&svc.bootstrap);
    cfg.topic_partitions = 4;
    cfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    cfg.allowed_topics = TopicAllowList::only([format!("{allowed}*")]).unwrap();
    let relay = crate::common::RunningRelay::start(
        &db.pool,
        KafkaTransport::new(cfg).unwrap(),
        crate::wal_relay::config_for(&slot),
    );
    let pool = db.pool.clone();
    wait::until(WAIT, "one published, two parked", || {
        let pool = pool.clone();
        async move {
            let (left, parked): (i64, i64) = sqlx::query_as(
                "SELECT count(*), count(*) FILTER (WHERE status = 'failed') FROM postal.outbox",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            left == 2 && parked == 2
        }
    })
    .await;
    relay.stop().await;
    let rows: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT topic, status, last_error FROM postal.outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0].0.as_str(), rows[0].1.as_str()),
        (other.as_str(), "failed")
    );
    assert!(rows[0]
        .2
        .as_deref()
        .unwrap()
        .contains("not in this relay's topic allow-list"));
    assert_eq!(
        (rows[1].0.as_str(), rows[1].1.as_str()),
        (dlq.as_str(), "failed")
    );
    assert!(rows[1]
        .2
        .as_deref()
        .unwrap()
        .contains("is a dead-letter topic"));
    // Key `b`'s event on the allowed topic went out: its parked event is on another topic.
    let read = postal_integration_tests::kafka::read_all(&svc.bootstrap, &allowed, 2, WAIT).await;
    assert_eq!(read.len(), 2);
    assert!(!topic_exists(&svc.bootstrap, &other), "{other} was created");
    assert!(!topic_exists(&svc.bootstrap, &dlq), "{dlq} was created");
}

/// The process's resident set size now, in bytes (Linux), for the record only: other tests
/// share the process, so it is printed, not asserted.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

/// Guarantee: a record with more headers than `max_headers` (here 30 records of 99,990 empty
/// headers each, 2 bytes apiece on the wire but about 48 bytes each in a copy) is
/// dead-lettered as undecodable with its headers kept whole in its row, in order, without
/// being copied one by one: they are held packed, about as large as on the wire (the
/// consumer's buffered peak stays under the 30 records' own size), and the partition moves on.
/// Before, the consumer copied them all (30 such records took its RSS from 13 MB to 167 MB);
/// then it kept only Postal's three headers, and the row lost the other 99,990.
#[tokio::test]
async fn records_with_huge_header_counts_are_dead_lettered_whole_without_copying_them() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("hostile-headers");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let (b, t) = (svc.bootstrap.clone(), topic.clone());
    tokio::task::spawn_blocking(move || {
        for _ in 0..30 {
            let id = Uuid::now_v7().to_string();
            let mut headers: Vec<(&[u8], &[u8])> = vec![
                (b"ce_id", id.as_bytes()),
                (b"ce_type", b"job"),
                (b"content-type", b"application/json"),
            ];
            headers.extend(std::iter::repeat_n((&b""[..], &b""[..]), 99_990));
            let code = produce_raw(&b, &t, 0, b"k", br#"{"n": 0}"#, &headers).expect("raw produce");
            assert_eq!(code, 0, "the broker stored the raw record");
        }
    })
    .await
    .unwrap();
    let good = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[RawRecord::event(good, "k", "job", json!({"n": 1}))],
    )
    .await;
    let before = rss_bytes();
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "30 dead-lettered and the good one applied", || {
        let s = stats.snapshot();
        async move { s.dead_letters == 30 && s.applied == 1 }
    })
    .await;
    let peak = stats.snapshot().buffered_bytes_peak;
    running.stop().await;
    eprintln!(
        "huge header counts: buffered peak {peak} bytes; process RSS {} MB before, {} MB after",
        before / 1_000_000,
        rss_bytes() / 1_000_000
    );
    // Headers packed: no more than the records' own size (about 200 KB each on the wire),
    // even all at once; copied one by one they were about 4.8 MB each.
    assert!(peak < 7_500_000, "buffered peak {peak} bytes");
    let rows: Vec<(String, Option<Uuid>, Vec<String>)> = sqlx::query_as(
        "SELECT error, event_id, header_names FROM postal.dead_letters ORDER BY kafka_offset",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 30);
    assert_eq!(
        rows[0].0,
        "record has 99993 headers, more than the consumer's max_headers (the dead letter keeps them all)"
    );
    // Dead-lettered as itself: its id (and dedup row, so no later copy is applied) and all
    // its headers, in order, from which `postal dead-letters replay` republishes it.
    assert!(rows.iter().all(|r| r.1.is_some()));
    for r in &rows {
        assert_eq!(r.2.len(), 99_993);
        assert_eq!(r.2[..3], ["ce_id", "ce_type", "content-type"]);
        assert!(r.2[3..].iter().all(String::is_empty));
    }
    let dedup: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        dedup, 31,
        "30 dead letters and the applied event keep dedup rows"
    );
}

/// Fills `partitions` partitions with 1 blocking record and `behind` records of about 200 KB
/// each, runs a consumer with `config` until each blocked handler has `fill` buffered bytes
/// behind it in total, releases them, waits until all are applied once, and returns the
/// consumer's peak of buffered bytes.
async fn peak_behind_blocked_handlers(
    partitions: i32,
    behind: usize,
    fill: u64,
    tweak: impl FnOnce(&mut postal_consumer::ConsumerConfig),
) -> u64 {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("hostile-bytes");
    create_topic(&svc.bootstrap, &topic, partitions).await;
    let pad = "x".repeat(200_000);
    let mut blocked = Vec::new();
    for p in 0..partitions {
        let first = Uuid::now_v7();
        blocked.push(first);
        let mut records = vec![RawRecord::event(
            first,
            "k",
            "job",
            json!({"n": 0, "fail": "block"}),
        )];
        for n in 0..behind {
            records.push(RawRecord::event(
                Uuid::now_v7(),
                "k",
                "job",
                json!({"n": n, "pad": pad}),
            ));
        }
        produce(&svc.bootstrap, &topic, Some(p), &records).await;
    }
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    tweak(&mut config);
    let probe = handlers::Probe::default();
    let running = start_apply_with(&db.pool, &topic, config, probe.clone());
    let stats = running.stats.clone();
    // The handlers hold their first records until the buffers have filled.
    wait::until(WAIT, "the buffers filled while the handlers block", || {
        let s = stats.snapshot();
        let all_entered = blocked.iter().all(|id| probe.entered(*id));
        async move { all_entered && s.buffered_bytes >= fill }
    })
    .await;
    for id in &blocked {
        probe.release(*id);
    }
    let total = partitions as u64 * (behind as u64 + 1);
    wait::until(WAIT, "all applied", || {
        let s = stats.snapshot();
        async move { s.applied == total }
    })
    .await;
    let peak = stats.snapshot().buffered_bytes_peak;
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (total as i64, total as i64));
    peak
}

/// Guarantee: a partition's buffer is bounded in bytes, not only in records: with a handler
/// blocked on the first of 150 records of about 200 KB each (30 MB in all), the consumer holds
/// at most `partition_buffer_bytes` (2 MiB here) plus three records (one past the limit, up to
/// two librdkafka hands over before the pause takes effect), then pauses fetching until
/// the handler drains it; everything is applied once released. Before, it buffered up to 1,000
/// records whatever their size (here 28 MB of the 30).
#[tokio::test]
async fn a_partition_buffer_is_bounded_in_bytes() {
    const LIMIT: usize = 2 * 1024 * 1024;
    let peak = peak_behind_blocked_handlers(1, 149, LIMIT as u64, |c| {
        c.partition_buffer_bytes = LIMIT;
    })
    .await;
    eprintln!("byte-bounded buffer: peak {peak} bytes for a limit of {LIMIT}");
    assert!(
        peak <= (LIMIT + 3 * 210_000) as u64,
        "buffered peak {peak} bytes, limit {LIMIT}"
    );
}

/// Guarantee: `memory_budget` bounds the whole consumer: with two partitions, each with a
/// handler blocked in front of 100 records of about 200 KB, a budget of 4 MiB gives each
/// partition's buffer a 1 MiB share (the other half is librdkafka's prefetch queue), so the
/// consumer buffers at most 2 MiB plus three records per partition (one past the share, and up
/// to two that librdkafka hands over before the pause takes effect: 2,606,448 bytes, 2.4
/// records past 2 MiB, seen under a load average of 11), where the per-partition default alone
/// would let it hold 16 MiB each.
#[tokio::test]
async fn a_memory_budget_bounds_the_whole_consumer() {
    const BUDGET: usize = 4 * 1024 * 1024;
    let peak = peak_behind_blocked_handlers(2, 100, (BUDGET / 2) as u64, |c| {
        c.memory_budget = Some(BUDGET);
    })
    .await;
    eprintln!("memory budget: peak {peak} bytes buffered for a budget of {BUDGET}");
    assert!(
        peak <= (BUDGET / 2 + 2 * 3 * 210_000) as u64,
        "buffered peak {peak} bytes, budget {BUDGET}"
    );
}

/// Guarantee: a consumer process's memory stays small on records with huge header counts. A
/// `billing_service` process reads 30 records of 99,990 empty headers each (about 300 KB apiece
/// on the wire, some 5 MB each as copied headers) and dead-letters them; its peak resident set
/// (`VmHWM`) stays under 120 MB. Before, the copies alone took about 150 MB (the issue measured
/// RSS going from 13 MB to 167 MB).
#[tokio::test]
async fn a_consumer_process_stays_small_on_records_with_huge_header_counts() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("hostile-rss");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let (b, t) = (svc.bootstrap.clone(), topic.clone());
    tokio::task::spawn_blocking(move || {
        for _ in 0..30 {
            let id = Uuid::now_v7().to_string();
            let mut headers: Vec<(&[u8], &[u8])> = vec![
                (b"ce_id", id.as_bytes()),
                (b"ce_type", b"order.created"),
                (b"content-type", b"application/json"),
            ];
            headers.extend(std::iter::repeat_n((&b""[..], &b""[..]), 99_990));
            let code = produce_raw(&b, &t, 0, b"k", b"{}", &headers).expect("raw produce");
            assert_eq!(code, 0, "the broker stored the raw record");
        }
    })
    .await
    .unwrap();
    let program = crate::procs::bin_dir().join("billing_service");
    assert!(
        program.is_file(),
        "{} is missing: build the binaries first (cargo build -p postal-cli -p postal-demo -p postal-integration-tests --bins)",
        program.display()
    );
    let child = postal_integration_tests::KillOnDrop(
        std::process::Command::new(&program)
            .env("DATABASE_URL", &db.url)
            .env("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap)
            .env("ORDERS_TOPIC", &topic)
            .env("INVOICES_TOPIC", unique("hostile-rss-out"))
            // A group of its own: members of killed processes in the shared `billing` group
            // would hold up its join for their session timeout.
            .env("POSTAL_CONSUMER_GROUP", unique("hostile-rss-g"))
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("billing_service"),
    );
    let pid = child.id();
    let pool = db.pool.clone();
    wait::until(WAIT, "all 30 records processed", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, Option<i64>>(
                "SELECT max(next_offset) FROM postal.consumer_offsets",
            )
            .fetch_one(&pool)
            .await
            .ok()
            .flatten()
                == Some(30)
        }
    })
    .await;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
    drop(child);
    let peak_kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .expect("VmHWM");
    eprintln!(
        "billing_service on 30 records of 99,990 headers: peak RSS {} MB",
        peak_kb / 1024
    );
    assert!(peak_kb < 120 * 1024, "peak RSS {} MB", peak_kb / 1024);
}

/// Guarantee (issue 46: the dead-letter table keeps the original whole): a record with more
/// headers than `max_headers` (300 distinct headers, the default limit 256) is dead-lettered
/// with all 300 in its row, names and values in order, and `postal dead-letters replay` sends
/// them all back to the topic.
///
/// Broken: the row kept only Postal's own headers (`ce_id`, `ce_type`, `content-type`): the
/// other 297 were lost for good, and a replay sent the record without them.
#[tokio::test]
async fn a_record_with_more_headers_than_max_headers_is_dead_lettered_and_replayed_whole() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("hostile-many-headers");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let id = Uuid::now_v7().to_string();
    let extra: Vec<(String, String)> = (0..297)
        .map(|i| (format!("h{i:03}"), format!("value {i}")))
        .collect();
    let (b, t, i, x) = (
        svc.bootstrap.clone(),
        topic.clone(),
        id.clone(),
        extra.clone(),
    );
    tokio::task::spawn_blocking(move || {
        let mut headers: Vec<(&[u8], &[u8])> = vec![
            (b"ce_id", i.as_bytes()),
            (b"ce_type", b"job"),
            (b"content-type", b"application/json"),
        ];
        headers.extend(x.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        let code = produce_raw(&b, &t, 0, b"k", br#"{"n": 0}"#, &headers).expect("raw produce");
        assert_eq!(code, 0, "the broker stored the raw record");
    })
    .await
    .unwrap();
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
    running.stop().await;
    let (dl, names, values): (i64, Vec<String>, Vec<Vec<u8>>) =
        sqlx::query_as("SELECT id, header_names, header_values FROM postal.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(names.len(), 300, "all the record's headers kept");
    assert_eq!(names[..3], ["ce_id", "ce_type", "content-type"]);
    for (i, (n, v)) in extra.iter().enumerate() {
        assert_eq!((&names[i + 3], &values[i + 3]), (n, &v.as_bytes().to_vec()));
    }

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
        &json!({ "ids": [dl] }),
        &[dl],
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(replayed, 1);
    let read = postal_integration_tests::kafka::read_all(&svc.bootstrap, &topic, 2, WAIT).await;
    let copy = read
        .iter()
        .find(|r| r.offset == 1)
        .expect("the replayed record");
    for (n, v) in &extra {
        assert_eq!(copy.header(n), Some(v.as_str()), "header {n} replayed");
    }
    assert_eq!(copy.header("ce_id"), Some(id.as_str()));
}
