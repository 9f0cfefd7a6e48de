//! Consumers joining and leaving a group mid-stream.

use std::time::Duration;

use postal_consumer::Consumer;
use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, RawRecord, RunningConsumer,
};
use crate::handlers::{self, apply};

const WAIT: Duration = Duration::from_secs(120);

/// Guarantee: three consumers in one group, with members joining, one leaving gracefully and
/// one killed mid-stream, apply every event exactly once, each key's in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_join_and_leave_mid_stream() {
    join_and_leave(false).await;
}

/// Guarantee (issue 49): the same with a batch handler — partitions taken away and given back
/// while batches of up to 500 events (read in bursts of up to 256 records) are in their
/// transactions: every event applied exactly once, each key's in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_handler_members_join_and_leave_mid_stream() {
    join_and_leave(true).await;
}

async fn join_and_leave(batched: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("rebalance");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 6).await;
    let total = 3000i64;
    let batch = |from: i64, to: i64| -> Vec<RawRecord> {
        (from..to)
            .map(|n| {
                RawRecord::event(
                    Uuid::now_v7(),
                    &format!("k{}", n % 50),
                    "job",
                    json!({"n": n}),
                )
            })
            .collect()
    };
    // Each member runs on a pool of its own, as a separate process: `kill` closes it.
    let start = || async {
        let pool = db.process_pool().await;
        let consumer = Consumer::builder(
            pool.clone(),
            consumer_config(&svc.bootstrap, &group, handlers::CONSUMER),
        )
        .state(handlers::Probe::default());
        let consumer = if batched {
            consumer.on_batch(&topic, "job", handlers::apply_batch)
        } else {
            consumer.on(&topic, "job", apply)
        }
        .build()
        .unwrap();
        RunningConsumer::start(consumer).owning(pool)
    };
    let applied_at_least = |n: i64| {
        let pool = db.pool.clone();
        move || {
            let pool = pool.clone();
            async move { effects(&pool).await.1 >= n }
        }
    };

    produce(&svc.bootstrap, &topic, None, &batch(0, 1000)).await;
    let a = start().await;
    wait::until(WAIT, "300 applied", applied_at_least(300)).await;
    let b = start().await;
    produce(&svc.bootstrap, &topic, None, &batch(1000, 2000)).await;
    wait::until(WAIT, "1200 applied", applied_at_least(1200)).await;
    let c = start().await;
    wait::until(WAIT, "1500 applied", applied_at_least(1500)).await;
    a.stop().await; // leaves gracefully
    produce(&svc.bootstrap, &topic, None, &batch(2000, total)).await;
    wait::until(WAIT, "2200 applied", applied_at_least(2200)).await;
    b.kill().await; // dropped mid-flight
    wait::until(WAIT, "every event applied", applied_at_least(total)).await;
    let stats = c.stats.clone();
    c.stop().await;
    assert_eq!(
        effects(&db.pool).await,
        (total, total),
        "each event exactly once"
    );
    let dedup: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dedup, total);
    assert_eq!(stats.snapshot().dead_letters, 0);
    // Each key's events (n % 50 is the key) in the order they were produced.
    let out_of_order: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT n, lag(n) OVER (PARTITION BY n % 50 ORDER BY id) AS before FROM effects) e
         WHERE before > n",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(out_of_order, 0, "each key's events in order");
}
