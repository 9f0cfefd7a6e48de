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
