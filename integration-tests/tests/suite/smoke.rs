//! Smoke test: the whole producer path against the services of this run.

use std::collections::BTreeSet;
use std::time::Duration;

use postal_integration_tests::{kafka, services, unique, wait, Mode};
use postal_producer::{enqueue, NewEvent};

use crate::common::{outbox_count, RunningRelay};

/// Guarantee: events committed with a business row reach Kafka with their ids, keys,
/// CloudEvents headers and payloads, and the outbox is emptied behind them.
#[tokio::test]
async fn smoke_round_trip() {
    let svc = services().await;
    eprintln!("smoke test services mode: {:?}", svc.mode);
    if std::env::var("POSTAL_EXPECT_MODE").as_deref() == Ok("testcontainers") {
        assert_eq!(
            svc.mode,
            Mode::Testcontainers,
            "this run must use testcontainers"
        );
    }
    let db = svc.fresh_db().await;
    sqlx::query("CREATE TABLE orders (id bigint PRIMARY KEY, customer text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let topic = unique("smoke");
    let mut ids = BTreeSet::new();
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..10i64 {
        let customer = format!("c-{}", i % 3);
        sqlx::query("INSERT INTO orders VALUES ($1, $2)")
            .bind(i)
            .bind(&customer)
            .execute(&mut *tx)
            .await
            .unwrap();
        let ev = NewEvent::json(
            topic.as_str(),
            customer.as_str(),
            "order.created",
            &serde_json::json!({"order": i}),
        )
        .unwrap();
        ids.insert(enqueue(&mut tx, ev).await.unwrap().to_string());
    }
    tx.commit().await.unwrap();

    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let records = kafka::read_all(&svc.bootstrap, &topic, 10, Duration::from_secs(60)).await;
    let seen: BTreeSet<String> = kafka::event_ids(&records);
    assert_eq!(seen, ids, "every committed event arrives, with its id");
    for r in &records {
        assert_eq!(r.header("ce_type"), Some("order.created"));
        assert_eq!(r.header("ce_specversion"), Some("1.0"));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.key.as_deref(), r.header("ce_subject"));
        let body: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        assert!(body["order"].is_i64());
    }
    wait::until(Duration::from_secs(30), "outbox drained", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    let stats = relay.stop().await;
    assert_eq!(stats.published, 10);
}
