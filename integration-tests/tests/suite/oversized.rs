//! Sizes that cannot reach a destination are refused or parked, never an outage: header
//! values and their total at `enqueue` (Rust and SQL), again at the relay for rows written
//! before the limits existed, RabbitMQ's one content-header frame per message (negotiated
//! `frame_max`), and dead-letter copies larger than the producer takes.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use postal_integration_tests::rabbit::{self, Rabbit};
use postal_integration_tests::{kafka, services, unique, wait};
use postal_producer::{enqueue, NewEvent, RabbitConfig, RabbitTransport};
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects_table, fast_config, outbox_count, start_apply, Counting,
    FailureCounts, RawRecord, RunningRelay,
};
use crate::handlers;

const WAIT: Duration = Duration::from_secs(60);

/// The parked rows' keys and reasons, in outbox order.
async fn parked(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT event_key, coalesce(last_error, '') FROM postal.outbox WHERE status = 'failed' ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Enqueues `n` small events on `topic` over five keys `ok0`..`ok4`; returns their ids.
async fn small_events(pool: &PgPool, topic: &str, n: usize) -> BTreeSet<String> {
    let mut conn = pool.acquire().await.unwrap();
    let mut ids = BTreeSet::new();
    for i in 0..n {
        let e = NewEvent::json(topic, format!("ok{}", i % 5), "order.created", &i).unwrap();
        ids.insert(enqueue(&mut conn, e).await.unwrap().to_string());
    }
    ids
}

/// A relay on RabbitMQ at `url` whose failures are counted by kind.
fn rabbit_relay(pool: &PgPool, url: &str) -> (RunningRelay, FailureCounts) {
    let mut cfg = RabbitConfig::new(url);
    cfg.confirm_timeout = Duration::from_secs(1);
    let counts = FailureCounts::default();
    let transport = Counting {
        inner: RabbitTransport::new(cfg).unwrap(),
        counts: counts.clone(),
    };
    (
        RunningRelay::start(pool, transport, fast_config().max_attempts(3)),
        counts,
    )
}

/// Guarantee: `postal.enqueue` refuses a header value over 8 KiB (a 200 kB one here), and
/// headers over 64 KiB together, with a one-line error naming the limit (SQLSTATE 22023), and
/// writes nothing. (Before, it wrote them, and on RabbitMQ the relay's connection was closed
/// on every try.)
#[tokio::test]
async fn sql_enqueue_refuses_oversized_headers() {
    let db = services().await.fresh_db().await;
    let call = |headers: serde_json::Value| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, Uuid>(
                "SELECT postal.enqueue('orders', 'k', 'order.created', '{}'::jsonb, $1)",
            )
            .bind(headers)
            .fetch_one(&pool)
            .await
        }
    };
    let big = serde_json::json!({ "x-big": "v".repeat(200_000) });
    let err = call(big).await.expect_err("a 200 kB header is refused");
    let db_err = err.as_database_error().expect("a database error");
    assert_eq!(db_err.code().as_deref(), Some("22023"), "{err}");
    let message = db_err.message();
    assert!(
        message.contains("\"x-big\"")
            && message.contains("200000 bytes")
            && message.contains("8192"),
        "{message}"
    );
    assert!(!message.contains('\n'), "one line: {message}");
    let many: serde_json::Map<String, serde_json::Value> = (0..9)
        .map(|i| (format!("h{i}"), "v".repeat(8000).into()))
        .collect();
    let err = call(many.into())
        .await
        .expect_err("72 kB of headers are refused");
    let message = err.as_database_error().unwrap().message().to_owned();
    assert!(message.contains("65536"), "{message}");
    assert_eq!(outbox_count(&db.pool).await, 0, "nothing written");
    // At the limits: written.
    let fits: serde_json::Map<String, serde_json::Value> = (0..8)
        .map(|i| (format!("h{i}"), "v".repeat(8190).into()))
        .collect();
    call(fits.into()).await.expect("64 KiB of headers fit");
    assert_eq!(outbox_count(&db.pool).await, 1);
}

/// Guarantee: the Rust `enqueue` refuses the same headers at the call (`with_header`), with a
/// one-line error naming the header and the limit, before anything touches the database.
#[tokio::test]
async fn rust_enqueue_refuses_oversized_headers() {
    let db = services().await.fresh_db().await;
    let event = NewEvent::json("orders", "k", "order.created", &1).unwrap();
    let err = event
        .clone()
        .with_header("x-big", "v".repeat(200_000))
        .expect_err("a 200 kB header is refused")
        .to_string();
    assert!(
        err.contains("\"x-big\"") && err.contains("200000 bytes") && err.contains("8192"),
        "{err}"
    );
    assert!(!err.contains('\n'), "one line: {err}");
    let mut e = event;
    for i in 0..8 {
        e = e.with_header(format!("h{i}"), "v".repeat(8190)).unwrap();
    }
    let err = e.clone().with_header("h8", "v").unwrap_err().to_string();
    assert!(err.contains("65536"), "{err}");
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue(&mut conn, e).await.expect("64 KiB of headers fit");
    assert_eq!(outbox_count(&db.pool).await, 1);
}

/// Guarantee: a row with a 200 kB header written before the limit existed (here: a raw
/// INSERT around `enqueue`) is parked at once with a reason naming the header, without one
/// "unavailable" outcome (the relay never sends it, so RabbitMQ never closes the connection),
/// and other keys' events flow meanwhile. (Before, RabbitMQ closed the relay's connection
/// with FRAME_ERROR on every try; the row was retried forever as an outage and never parked.)
#[tokio::test]
async fn a_stored_oversized_header_is_parked_and_the_connection_stays_up() {
    let db = services().await.fresh_db().await;
    let mq = Rabbit::get().await;
    let topic = unique("rmq-big-header");
    let queue = rabbit::bind_queue(&mq.url(), &topic, "#").await;
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, schema_version,
                                    occurred_at, content_type, payload, headers)
         VALUES ($1, $2, 'big', 'order.created', 1, now(), 'application/json', '{}',
                 jsonb_build_object('x-big', repeat('v', 200000)))",
    )
    .bind(Uuid::now_v7())
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let ids = small_events(&db.pool, &topic, 50).await;
    let (relay, counts) = rabbit_relay(&db.pool, &mq.url());
    wait::until(
        WAIT,
        "the oversized row parked, the rest published",
        || async { parked(&db.pool).await.len() == 1 && outbox_count(&db.pool).await == 1 },
    )
    .await;
    relay.stop().await;
    let p = parked(&db.pool).await;
    assert_eq!(p[0].0, "big");
    assert!(
        p[0].1.contains("\"x-big\"") && p[0].1.contains("8192"),
        "{}",
        p[0].1
    );
    assert_eq!(
        counts.unavailable.load(Ordering::Relaxed),
        0,
        "the connection was never cut"
    );
    let messages = rabbit::read_all(&mq.url(), &queue, ids.len(), WAIT).await;
    let seen: BTreeSet<String> = messages
        .iter()
        .filter_map(|m| m.message_id.clone())
        .collect();
    assert_eq!(seen, ids, "other keys flowed");
}

/// Guarantee: a message whose properties and headers do not fit in one frame of the
/// connection's negotiated `frame_max` (16 KiB here, asked for in the URI; headers within
/// `enqueue`'s limits) is parked before it is sent, with a reason naming `frame_max`, and the
/// connection is never cut: no "unavailable" outcome, other keys flow. (Before, RabbitMQ
/// closed the connection on it on every try.)
#[tokio::test]
async fn a_message_over_frame_max_is_parked_before_it_is_sent() {
    let db = services().await.fresh_db().await;
    let mq = Rabbit::get().await;
    let topic = unique("rmq-frame");
    let queue = rabbit::bind_queue(&mq.url(), &topic, "#").await;
    let mut event = NewEvent::json(topic.as_str(), "wide", "order.created", &1).unwrap();
    for i in 0..3 {
        event = event
            .with_header(format!("x-part{i}"), "v".repeat(7000))
            .unwrap();
    }
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue(&mut conn, event).await.unwrap();
    drop(conn);
    let ids = small_events(&db.pool, &topic, 50).await;
    let url = mq.url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let (relay, counts) = rabbit_relay(&db.pool, &format!("{url}{sep}frame_max=16384"));
    wait::until(
        WAIT,
        "the wide event parked, the rest published",
        || async { parked(&db.pool).await.len() == 1 && outbox_count(&db.pool).await == 1 },
    )
    .await;
    relay.stop().await;
    let p = parked(&db.pool).await;
    assert_eq!(p[0].0, "wide");
    assert!(p[0].1.contains("frame_max of 16384"), "{}", p[0].1);
    assert_eq!(
        counts.unavailable.load(Ordering::Relaxed),
        0,
        "the connection was never cut"
    );
    let messages = rabbit::read_all(&mq.url(), &queue, ids.len(), WAIT).await;
    let seen: BTreeSet<String> = messages
        .iter()
        .filter_map(|m| m.message_id.clone())
        .collect();
    assert_eq!(seen, ids, "other keys flowed");
}

/// Guarantee: dead letters whose copy would exceed what the dead-letter producer takes
/// (101 records of 1,040,000 bytes without `ce_id`: the broker takes them, the copy with
/// Postal's headers exceeds the producer's 1,000,000) reach `<topic>.dlq` without their value,
/// marked `postal_dlq_cut: value`, and stay whole in `postal.dead_letters`; a small dead letter
/// after them reaches `.dlq` whole. (Before, every pass retried the oldest 100 unpublished
/// dead letters, all refused, so no later dead letter ever reached the topic.)
#[tokio::test]
async fn oversized_dead_letters_do_not_block_later_ones() {
    const BIG: usize = 1_040_000;
    const N: usize = 101;
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dlq-big");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut records: Vec<RawRecord> = (0..N)
        .map(|i| RawRecord {
            key: Some(format!("big{i}")),
            payload: vec![b'x'; BIG],
            headers: vec![("x-origin", "legacy".into())],
        })
        .collect();
    records.push(RawRecord {
        key: Some("small".into()),
        payload: b"small and without ce_id".to_vec(),
        headers: vec![("x-origin", "legacy".into())],
    });
    produce_large(&svc.bootstrap, &topic, &records).await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
    );
    let dlq_topic = format!("{topic}.dlq");
    wait::until(
        Duration::from_secs(120),
        "every dead letter published",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM postal.dead_letters WHERE published_at IS NOT NULL",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap()
                == N as i64 + 1
        },
    )
    .await;
    let dlq = kafka::read_all(&svc.bootstrap, &dlq_topic, N + 1, WAIT).await;
    running.stop().await;
    assert_eq!(dlq.len(), N + 1, "one copy per dead letter");
    let small = dlq
        .iter()
        .find(|r| r.key.as_deref() == Some("small"))
        .expect("the small dead letter reached .dlq");
    assert_eq!(small.payload, b"small and without ce_id", "whole");
    assert_eq!(small.header("postal_dlq_cut"), None);
    assert_eq!(small.header("x-origin"), Some("legacy"));
    for r in dlq.iter().filter(|r| r.key.as_deref() != Some("small")) {
        assert_eq!(r.header("postal_dlq_cut"), Some("value"), "{:?}", r.key);
        assert!(r.payload.is_empty(), "{:?}", r.key);
        assert_eq!(
            r.header("x-origin"),
            Some("legacy"),
            "original headers kept"
        );
        assert_eq!(r.header("postal_dlq_reason"), Some("missing_event_id"));
    }
    let whole: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM postal.dead_letters
         WHERE octet_length(payload) = $1 AND dlq_unpublishable IS NULL",
    )
    .bind(BIG as i32)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(whole, N as i64, "the table keeps them whole");
}

/// Writes `records` (each up to about 1 MiB) to `topic`, with a producer that takes them.
pub(crate) async fn produce_large(bootstrap: &str, topic: &str, records: &[RawRecord]) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("message.max.bytes", "1048000")
        .create()
        .expect("producer");
    for r in records {
        let mut h = OwnedHeaders::new();
        for (k, v) in &r.headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_str()),
            });
        }
        let mut rec: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic)
            .payload(r.payload.as_slice())
            .headers(h);
        if let Some(k) = &r.key {
            rec = rec.key(k.as_str());
        }
        producer
            .send(rec, Duration::from_secs(30))
            .await
            .expect("record acknowledged");
    }
}
