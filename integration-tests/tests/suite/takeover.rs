//! Taking a partition over: a late claim from elsewhere, and a fetch position ahead of the
//! stored offset.

use std::time::Duration;

use futures::FutureExt as _;
use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, start_apply, RawRecord,
};

const WAIT: Duration = Duration::from_secs(60);

/// Moves the group's stored offset on `topic` back to `to` (bumping the epoch if `fence`, as
/// `postal consumer reset` does) and forgets the effects and dedup rows of the records from
/// `to` on, so that a replay shows as their effects coming back and a skipped record as one
/// missing.
async fn move_back(pool: &sqlx::PgPool, group: &str, topic: &str, to: i64, fence: bool) {
    let replayed: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM effects WHERE n >= $1")
        .bind(to)
        .fetch_all(pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM effects WHERE n >= $1")
        .bind(to)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM postal.processed_events WHERE event_id = ANY($1)")
        .bind(&replayed)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE postal.consumer_offsets
         SET next_offset = $3, epoch = epoch + CASE WHEN $4 THEN 1 ELSE 0 END
         WHERE group_id = $1 AND topic = $2",
    )
    .bind(group)
    .bind(topic)
    .bind(to)
    .bind(fence)
    .execute(pool)
    .await
    .unwrap();
}

/// The `n` of every effect, in the order they were applied.
async fn applied_in_order(pool: &sqlx::PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT n FROM effects ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

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
    postal_consumer::testing::offsets::claim(&db.pool, &group, &topic, 0, "revoked-elsewhere")
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
    // The replay of offsets 5.. in the database only (Kafka's group offset stays at 20).
    move_back(&db.pool, &group, &topic, 5, false).await;
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
    assert_eq!(
        applied_in_order(&db.pool).await,
        (0..30).collect::<Vec<_>>(),
        "applied in offset order"
    );
}

/// Guarantee: a worker fenced before anything was committed for its partition (no stored
/// offset yet: a new group, a newly subscribed topic, the start-up rebalance of several
/// instances) reads again what its fenced ownership dropped — the fenced batch and its
/// buffer — instead of moving on from the fetch position and skipping them. (Found by review:
/// without a stored offset there was no seek.)
#[tokio::test]
async fn a_worker_fenced_before_any_commit_does_not_skip_what_it_dropped() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("takeover");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER),
    );
    let stored = |pool: sqlx::PgPool, group: String, topic: String| async move {
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT next_offset FROM postal.consumer_offsets
             WHERE group_id = $1 AND topic = $2 AND partition = 0",
        )
        .bind(group)
        .bind(topic)
        .fetch_optional(&pool)
        .await
        .unwrap()
    };
    let pool = db.pool.clone();
    wait::until(WAIT, "the worker's claim (no stored offset yet)", || {
        stored(pool.clone(), group.clone(), topic.clone()).map(|s| s == Some(None))
    })
    .await;
    // The late claim of a worker revoked elsewhere, before anything was committed.
    postal_consumer::testing::offsets::claim(&db.pool, &group, &topic, 0, "revoked-elsewhere")
        .await
        .unwrap();
    produce(&svc.bootstrap, &topic, Some(0), &records(0, 10)).await;
    let stats = running.stats.clone();
    wait::until(WAIT, "the worker fenced", || {
        let s = stats.snapshot();
        async move { s.fenced >= 1 }
    })
    .await;
    produce(&svc.bootstrap, &topic, Some(0), &records(10, 20)).await;
    wait::until(WAIT, "stored offset 20", || {
        stored(pool.clone(), group.clone(), topic.clone()).map(|s| s == Some(Some(20)))
    })
    .await;
    running.stop().await;
    assert_eq!(
        applied_in_order(&db.pool).await,
        (0..20).collect::<Vec<_>>(),
        "every record below the stored offset applied, in order"
    );
}

/// Guarantee: a stored offset moved back while the consumer is idle (what `postal consumer
/// reset --force` does: a new next offset and a bumped epoch) is replayed without waiting for
/// a new record: the idle worker notices the epoch moved at its next stall check, takes the
/// partition again and reads from the stored offset. (From a review: before, the worker
/// learned of the reset only at its next commit, and with no traffic never.)
#[tokio::test]
async fn a_stored_offset_moved_back_while_idle_is_replayed() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("takeover");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce(&svc.bootstrap, &topic, Some(0), &records(0, 10)).await;
    let mut config = consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER);
    config.stall_check = Duration::from_secs(1);
    let running = start_apply(&db.pool, &topic, config);
    let pool = db.pool.clone();
    wait::until(WAIT, "10 applied", || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 == 10 }
    })
    .await;
    // The reset, as `postal consumer reset --force` does it (the epoch bumped).
    move_back(&db.pool, &group, &topic, 5, true).await;
    wait::until(WAIT, "the replay of offsets 5..10", || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 == 10 }
    })
    .await;
    running.stop().await;
    assert_eq!(
        applied_in_order(&db.pool).await,
        (0..10).collect::<Vec<_>>(),
        "each record applied once more from the stored offset, in order"
    );
}
