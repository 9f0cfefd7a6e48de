//! Taking a partition over: a late claim from elsewhere, and a fetch position ahead of the
//! stored offset.

use std::time::Duration;

use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, start_apply, RawRecord,
};

const WAIT: Duration = Duration::from_secs(60);

fn records(from: i64, to: i64) -> Vec<RawRecord> {
    (from..to)
        .map(|n| RawRecord::event(Uuid::now_v7(), "k", "job", json!({"n": n})))
        .collect()
}

/// Guarantee: a worker fenced by another owner's claim while Kafka still assigns it the
/// partition (a revoked worker elsewhere whose delayed claim landed after its own) takes the
/// partition over again and goes on, instead of leaving it unprocessed until the next
/// rebalance; nothing is applied twice.
#[tokio::test]
async fn a_worker_fenced_by_a_late_claim_takes_its_partition_back() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("takeover");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce(&svc.bootstrap, &topic, Some(0), &records(0, 10)).await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER),
    );
    let pool = db.pool.clone();
    wait::until(WAIT, "the first 10 applied", || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 == 10 }
    })
    .await;
    // The late claim of a revoked worker in another process.
    postal_consumer::offsets::claim(&db.pool, &group, &topic, 0, "revoked-elsewhere")
        .await
        .unwrap();
    produce(&svc.bootstrap, &topic, Some(0), &records(10, 20)).await;
    wait::until(WAIT, "the next 10 applied after the late claim", || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 == 20 }
    })
    .await;
    let stats = running.stats.clone();
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (20, 20), "each event exactly once");
    assert!(stats.snapshot().fenced >= 1, "the worker was fenced once");
}

/// Guarantee: a replay asked for in the database (stored offset moved back, e.g. by a `postal
/// consumer reset` whose Kafka commit did not happen) is not skipped when the consumer's fetch
/// starts from Kafka's later group offset and records above it arrive first: the worker seeks
/// to the stored offset, waits for the seek and drops what came before, so every record from
/// the stored offset on is handled.
#[tokio::test]
async fn records_fetched_above_the_stored_offset_do_not_skip_a_replay() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("takeover");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce(&svc.bootstrap, &topic, Some(0), &records(0, 20)).await;
    let config = || consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER);
    let running = start_apply(&db.pool, &topic, config());
    let pool = db.pool.clone();
    wait::until(WAIT, "20 applied", || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 == 20 }
    })
    .await;
    // Stopping commits offset 20 to Kafka too.
    running.stop().await;
    // The replay of offsets 5.. in the database only; their effects and dedup rows are gone,
    // so a replayed record is applied again and a skipped one is missing.
    let replayed: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM effects WHERE n >= 5")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM effects WHERE n >= 5")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM postal.processed_events WHERE event_id = ANY($1)")
        .bind(&replayed)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE postal.consumer_offsets SET next_offset = 5 WHERE group_id = $1 AND topic = $2",
    )
    .bind(&group)
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    // Records above Kafka's group offset, where the fetch starts.
    produce(&svc.bootstrap, &topic, Some(0), &records(20, 30)).await;
    // The worker's takeover in the database waits behind this lock while the fetch from
    // Kafka's group offset delivers records 20.. into its buffer: they are there before its
    // seek to the stored offset is even issued.
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM postal.consumer_offsets WHERE group_id = $1 FOR UPDATE")
        .bind(&group)
        .execute(&mut *blocker)
        .await
        .unwrap();
    let running = start_apply(&db.pool, &topic, config());
    wait::until(WAIT, "the worker's takeover waiting for the lock", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%consumer_offsets%'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                > 0
        }
    })
    .await;
    // Not a synchronization: the outcome must be the same however long this is; it only
    // gives the fetch time to fill the buffer, the situation the worker must handle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    blocker.rollback().await.unwrap();
    wait::until(WAIT, "offsets 20..30 handled", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE n >= 20")
                .fetch_one(&pool)
                .await
                .unwrap()
                == 10
        }
    })
    .await;
    let pool = db.pool.clone();
    wait::until(WAIT, "the replay of offsets 5..20", || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 == 30 }
    })
    .await;
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (30, 30), "each event exactly once");
    let order: Vec<i64> = sqlx::query_scalar("SELECT n FROM effects ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        order,
        (0..30).collect::<Vec<_>>(),
        "applied in offset order"
    );
}
