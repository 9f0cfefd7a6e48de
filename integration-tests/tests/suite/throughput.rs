//! Throughput mode, dedup retention and the handler test helpers.

use std::time::Duration;

use postal_consumer::testing::{assert_applied_once, deliver};
use postal_consumer::{retention, Event, EventId, IntoHandler, Outcome};
use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, start_apply_with, RawRecord,
};
use crate::handlers::{self, apply, Job};

const WAIT: Duration = Duration::from_secs(60);

/// Guarantee: in throughput mode (many records per transaction) every event is still applied
/// exactly once, duplicates within and across batches are skipped, and one failing record is
/// isolated — a permanent failure or panic is dead-lettered, a retryable one retried — while
/// the others of its batch commit; the offset ends past every record.
#[tokio::test]
async fn throughput_mode_isolates_failures() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("batch");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let ids: Vec<Uuid> = (0..300).map(|_| Uuid::now_v7()).collect();
    let mut records: Vec<RawRecord> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let fail = match n {
                50 => json!({"n": n, "fail": "permanent"}),
                120 => json!({"n": n, "fail": "retry", "retries": 2}),
                200 => json!({"n": n, "fail": "panic"}),
                _ => json!({"n": n}),
            };
            RawRecord::event(*id, "k", "job", fail)
        })
        .collect();
    // Duplicates: one right behind its original (same batch), one far behind (a later batch).
    records.insert(11, RawRecord::event(ids[10], "k", "job", json!({"n": 10})));
    records.push(RawRecord::event(ids[5], "k", "job", json!({"n": 5})));
    produce(&svc.bootstrap, &topic, Some(0), &records).await;

    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config.max_batch = 100;
    let probe = handlers::Probe::default();
    let running = start_apply_with(&db.pool, &topic, config, probe.clone());
    let stats = running.stats.clone();
    wait::until(WAIT, "302 records handled", || {
        let s = stats.snapshot();
        async move { s.applied + s.duplicates + s.dead_letters == 302 }
    })
    .await;
    running.stop().await;
    let s = stats.snapshot();
    assert_eq!((s.applied, s.duplicates, s.dead_letters), (298, 2, 2));
    assert_eq!(
        effects(&db.pool).await,
        (298, 298),
        "each applied event exactly once"
    );
    assert_eq!(probe.attempts(ids[120]), 3, "retried until it succeeded");
    let dead: Vec<(Option<Uuid>, String)> =
        sqlx::query_as("SELECT event_id, reason FROM postal.dead_letters ORDER BY kafka_offset")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        dead,
        [
            (Some(ids[50]), "permanent".to_owned()),
            (Some(ids[200]), "panic".to_owned())
        ]
    );
    let dedup: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        dedup, 300,
        "one dedup row per event, dead letters included (no copy of them is ever applied)"
    );
    let next: Option<i64> =
        sqlx::query_scalar("SELECT next_offset FROM postal.consumer_offsets WHERE topic = $1")
            .bind(&topic)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(next, Some(302));
}

/// Guarantee: dedup retention deletes only the given consumer's rows older than the window,
/// and only one instance cleans at a time (a second one finds the lock taken and does nothing).
#[tokio::test]
async fn dedup_retention_deletes_only_expired_rows_one_instance_at_a_time() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
         SELECT c, gen_random_uuid(), now() - age * interval '1 day'
         FROM unnest(ARRAY['billing', 'shipping']) c,
              unnest(ARRAY[0, 3, 10, 20]) age,
              generate_series(1, 2500)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let week = Duration::from_secs(7 * 24 * 3600);

    // Another instance of `billing` is cleaning: this one does nothing.
    let mut other = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1, hashtext('billing'))")
        .bind(retention::DEDUP_CLEANUP_LOCK)
        .execute(&mut *other)
        .await
        .unwrap();
    let skipped = retention::cleanup_processed(&db.pool, "billing", week, 1000)
        .await
        .unwrap();
    assert_eq!(skipped, None);
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext('billing'))")
        .bind(retention::DEDUP_CLEANUP_LOCK)
        .execute(&mut *other)
        .await
        .unwrap();

    let deleted = retention::cleanup_processed(&db.pool, "billing", week, 1000)
        .await
        .unwrap();
    assert_eq!(
        deleted,
        Some(5000),
        "the 10- and 20-day-old rows, in batches of 1000"
    );
    let left: Vec<(String, i64)> = sqlx::query_as(
        "SELECT consumer_name, count(*) FROM postal.processed_events GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        left,
        [
            ("billing".to_owned(), 5000),
            ("shipping".to_owned(), 10_000)
        ]
    );
}

/// Guarantee: the documented test helpers deliver an event to a handler against a real
/// database without a broker: applied on the first delivery, a duplicate on the second, and a
/// failing handler leaves nothing behind.
#[tokio::test]
async fn handler_test_helpers() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let job = |fail: Option<&str>| Job {
        n: 1,
        fail: fail.map(str::to_owned),
        retries: 0,
        next: None,
    };
    let handler = apply.into_handler(&handlers::Probe::default());
    let id = EventId::new();
    // `Job` is not `Clone`: deliver twice by hand; `assert_applied_once` (below) needs a
    // clonable payload.
    assert_eq!(
        deliver(&db.pool, &handler, Event::new(id, "job", job(None)))
            .await
            .unwrap(),
        Outcome::Applied
    );
    assert_eq!(
        deliver(&db.pool, &handler, Event::new(id, "job", job(None)))
            .await
            .unwrap(),
        Outcome::Duplicate
    );
    let failing = EventId::new();
    assert!(deliver(
        &db.pool,
        &handler,
        Event::new(failing, "job", job(Some("permanent")))
    )
    .await
    .is_err());
    assert_eq!(effects(&db.pool).await, (1, 1));
    let dedup: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dedup, 1, "nothing left behind by the failure");

    assert_applied_once(
        &db.pool,
        &handlers::apply_value,
        Event::new(EventId::new(), "job", json!({"n": 2})),
    )
    .await
    .unwrap();
    assert_eq!(effects(&db.pool).await, (2, 2));
}

/// Guarantee: `testing::TestDatabase` gives each test a database of its own with Postal's
/// schema (a stateful handler delivered there is applied once, and its rows are not seen from
/// another test database), and `remove` drops it.
#[tokio::test]
async fn test_databases_are_separate_and_removed() {
    use postal_consumer::testing::{assert_applied_once, TestDatabase};
    let url = services().await.database_url.clone();
    let (a, b) = (
        TestDatabase::create_at(&url).await.unwrap(),
        TestDatabase::create_at(&url).await.unwrap(),
    );
    assert_ne!(a.name, b.name);
    effects_table(&a.pool).await;
    let handler = handlers::apply_value.into_handler(&());
    let event = Event::new(EventId::new(), "job", json!({"n": 1}));
    assert_applied_once(&a.pool, &handler, event).await.unwrap();
    let seen = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.processed_events")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(seen(a.pool.clone()).await, 1);
    assert_eq!(seen(b.pool.clone()).await, 0, "another test's database");
    // Its URL reaches it too.
    let again = sqlx::PgPool::connect(&a.url).await.unwrap();
    assert_eq!(seen(again.clone()).await, 1);
    again.close().await;
    let name = a.name.clone();
    a.remove().await.unwrap();
    b.remove().await.unwrap();
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(&name)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(left, 0, "removed");
}
