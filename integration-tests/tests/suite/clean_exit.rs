//! A consumer process that exits cleanly leaves its Kafka group before it exits, so that
//! `postal consumer reset` (which refuses a group with live members) works right after it —
//! not only once the broker expires the member after its session timeout (45 s by default).

use std::time::{Duration, Instant};

use postal_integration_tests::{services, unique};

use crate::common::{create_topic, produce, RawRecord};
use crate::procs::{bin_dir, http_get, Proc};

/// `postal consumer reset --to earliest --execute` for `group` on `topic`: (success, stderr).
fn reset(database_url: &str, bootstrap: &str, group: &str, topic: &str) -> (bool, String) {
    let out = std::process::Command::new(bin_dir().join("postal"))
        .args([
            "consumer",
            "reset",
            "--group",
            group,
            "--topic",
            topic,
            "--to",
            "earliest",
            "--execute",
        ])
        .env("DATABASE_URL", database_url)
        .env("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("postal consumer reset runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Guarantee: a consumer process (`billing_service`, serving `/metrics` and `/readyz` as in
/// production) stopped with SIGTERM has left its consumer group when it has exited: a
/// `postal consumer reset --execute` run right after its exit succeeds at the first attempt,
/// five stops in a row, each after its `/readyz` was asked. (Before: the `/readyz` handler kept a handle on the Kafka client, so the
/// group was left only by a thread racing the process exit; the pooler soak saw the reset
/// refused — "live member" — for the 45 s session timeout after 2 of 7 clean exits.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanly_stopped_consumer_has_left_its_group_when_it_exits() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let orders = unique("orders-exit");
    let group = unique("billing-exit");
    create_topic(&svc.bootstrap, &orders, 3).await;
    let dir = bin_dir();
    let logs = dir.join(format!("clean-exit-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let mut billing = Proc::new(&dir, &logs, "billing", "billing_service", &[])
        .env(&[
            ("DATABASE_URL", db.url.clone()),
            ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
            ("ORDERS_TOPIC", orders.clone()),
            ("INVOICES_TOPIC", unique("invoices-exit")),
            ("POSTAL_CONSUMER_GROUP", group.clone()),
            ("RUST_LOG", "info,rdkafka=warn".into()),
        ])
        .with_metrics();
    let port = billing.metrics_port().unwrap();
    let booked = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
    };
    let mut failures = Vec::new();
    for round in 0..5i64 {
        billing.start();
        // At work: it owns the topic's partitions and applied this round's order.
        let order = RawRecord::event(
            uuid::Uuid::now_v7(),
            &format!("c{round}"),
            "order.created",
            serde_json::json!({"order_id": round, "customer": format!("c{round}"), "seq": 1}),
        );
        produce(&svc.bootstrap, &orders, None, &[order]).await;
        let deadline = Instant::now() + Duration::from_secs(90);
        while booked().await < round + 1 {
            billing.assert_alive();
            assert!(
                Instant::now() < deadline,
                "round {round}: the order was not booked"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Its endpoint answered a readiness check (as a probe would).
        assert!(http_get(port, "/readyz").is_some());
        billing.stop();
        let (ok, stderr) = reset(&db.url, &svc.bootstrap, &group, &orders);
        if !ok {
            failures.push(format!("round {round}: {}", stderr.trim()));
        }
    }
    assert!(
        failures.is_empty(),
        "postal consumer reset refused right after a clean exit: {failures:?}"
    );
    std::fs::remove_dir_all(&logs).ok();
}
