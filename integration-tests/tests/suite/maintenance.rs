//! Maintenance seen from outside: what an operator's monitoring sees of it.

use std::time::{Duration, Instant};

use postal_integration_tests::services;

use crate::procs::{bin_dir, http_get, Proc};

/// The value of an unlabelled metric on the process's `/metrics`, if it is there.
fn gauge(port: u16, name: &str) -> Option<f64> {
    let text = http_get(port, "/metrics")?;
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Guarantee (alert `PostalHistoryMaintenanceFailing`): a relay in history mode whose
/// maintenance cannot do its work — a long reader holds the history while a row of today waits
/// in the default partition — reports `postal_relay_history_maintenance_ok 0` on `/metrics`
/// (and logs the step), keeps running, and reports 1 once the next maintenance succeeds.
/// (Before, the only sign was a WARN line, every 15 s, forever.)
#[tokio::test]
async fn a_failing_history_maintenance_shows_on_metrics_until_it_succeeds() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    sqlx::query(
        "INSERT INTO postal.outbox_history (seq, event_id, topic, event_key, event_type,
             schema_version, occurred_at, content_type, payload, headers, attempts,
             created_at, published_at)
         VALUES (0, gen_random_uuid(), 't', 'k', 'e', 1, now(), 'application/json', '',
                 '{}', 0, now(), now())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut reader = db.pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM postal.outbox_history")
        .execute(&mut *reader)
        .await
        .unwrap();
    let dir = bin_dir();
    let logs = dir.join(format!("maintenance-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let port = postal_integration_tests::free_port();
    let mut relay = Proc::new(
        &dir,
        &logs,
        "relay",
        "postal",
        &[
            "relay",
            "--history",
            "3d",
            "--lease",
            "20s",
            "--kafka",
            "message.timeout.ms=9000",
        ],
    )
    .env(&[
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("POSTAL_METRICS_ADDR", format!("127.0.0.1:{port}")),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ]);
    relay.start();
    let until = |want: f64, within: Duration| {
        let deadline = Instant::now() + within;
        async move {
            loop {
                if gauge(port, "postal_relay_history_maintenance_ok") == Some(want) {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "postal_relay_history_maintenance_ok did not become {want} within {within:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    until(0.0, Duration::from_secs(60)).await;
    relay.assert_alive();
    assert!(relay.logged("history maintenance step failed"));
    reader.rollback().await.unwrap();
    // The next maintenance (every 15 s) succeeds.
    until(1.0, Duration::from_secs(60)).await;
    let in_default: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox_history_default")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(in_default, 0, "today's row moved into today's partition");
    relay.stop();
}
