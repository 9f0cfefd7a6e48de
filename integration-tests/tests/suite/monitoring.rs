//! What an operator's monitoring sees: each test makes the condition an alert of
//! `deploy/prometheus-alerts.yml` is about, on a running `postal relay`, and watches the
//! metric the alert reads change on its `/metrics`.

use std::path::Path;
use std::time::{Duration, Instant};

use postal_integration_tests::services;

use crate::procs::{bin_dir, http_get, Proc};

/// The value of a metric (`name` with its labels, as exposed) on `/metrics`, if it is there.
fn metric(port: u16, name: &str) -> Option<f64> {
    let text = http_get(port, "/metrics")?;
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Waits until `check` holds for the metric's value; panics after `within`.
async fn until_metric(
    relay: &mut Proc,
    port: u16,
    name: &str,
    within: Duration,
    check: impl Fn(f64) -> bool,
) {
    let deadline = Instant::now() + within;
    loop {
        if metric(port, name).is_some_and(&check) {
            return;
        }
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "{name} did not reach the expected value within {within:?} (last: {:?})",
            metric(port, name)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A `postal relay` process with metrics on a free port, and that port.
fn relay(
    dir: &Path,
    logs: &Path,
    database_url: &str,
    bootstrap: &str,
    args: &[&str],
) -> (Proc, u16) {
    let port = postal_integration_tests::free_port();
    let mut all = vec!["relay"];
    all.extend_from_slice(args);
    let relay = Proc::new(dir, logs, "relay", "postal", &all).env(&[
        ("DATABASE_URL", database_url.to_owned()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.to_owned()),
        ("POSTAL_METRICS_ADDR", format!("127.0.0.1:{port}")),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ]);
    (relay, port)
}

/// Guarantee (alerts `PostalHistoryMaintenanceFailing`, `PostalRelayChecksFailing`): a relay
/// in history mode whose housekeeping cannot do its work — a long transaction holds the history
/// (a row of today waits in its default partition) and locks the outbox exclusively — reports
/// `postal_relay_history_maintenance_ok 0` and counts the failed checks by kind, logs them,
/// keeps running, and reports 1 once the next maintenance succeeds. (Before, the history
/// failure was only a WARN line, the backlog check waited behind the lock with every gauge at
/// its last value, and neither had a metric.)
#[tokio::test]
async fn failing_housekeeping_shows_on_metrics_until_it_succeeds() {
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
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM postal.outbox_history")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("LOCK TABLE postal.outbox IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (mut relay, port) = relay(
        &dir,
        &logs,
        &db.url,
        &svc.bootstrap,
        &[
            "--history",
            "3d",
            "--lease",
            "20s",
            "--kafka",
            "message.timeout.ms=9000",
        ],
    );
    relay.start();
    let within = Duration::from_secs(60);
    until_metric(
        &mut relay,
        port,
        "postal_relay_history_maintenance_ok",
        within,
        |v| v == 0.0,
    )
    .await;
    until_metric(
        &mut relay,
        port,
        "postal_relay_check_failures_total{check=\"backlog\"}",
        within,
        |v| v >= 1.0,
    )
    .await;
    assert!(relay.logged("history maintenance step failed"));
    assert!(relay.logged("relay housekeeping failed"));
    holder.rollback().await.unwrap();
    // The next maintenance (every 15 s) succeeds.
    until_metric(
        &mut relay,
        port,
        "postal_relay_history_maintenance_ok",
        within,
        |v| v == 1.0,
    )
    .await;
    let in_default: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox_history_default")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(in_default, 0, "today's row moved into today's partition");
    relay.stop();
}

/// Guarantee (alerts `PostalPartitionsUnowned`, `PostalRelayAbsent`): a relay reports the key
/// partitions it owns (256, the whole group, alone); when the database goes away it reports 0
/// once its leases ran out — it owns nothing then, whatever it held — and 256 again once it
/// renews them. (Before, the gauge kept its last value, 256, for as long as the outage lasted.)
#[tokio::test]
async fn partitions_owned_drop_to_zero_once_the_leases_lapse() {
    let svc = services().await;
    let mut pg = postal_integration_tests::private::PrivatePostgres::start().await;
    let db = postal_integration_tests::create_db(&pg.url()).await;
    postal_shared::migrate(&db.pool).await.unwrap();
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (mut relay, port) = relay(
        &dir,
        &logs,
        &db.url,
        &svc.bootstrap,
        &["--lease", "8s", "--kafka", "message.timeout.ms=3000"],
    );
    relay.start();
    let owned = "postal_relay_partitions_owned{group=\"default\"}";
    let within = Duration::from_secs(60);
    until_metric(&mut relay, port, owned, within, |v| v == 256.0).await;
    pg.crash();
    until_metric(&mut relay, port, owned, within, |v| v == 0.0).await;
    pg.restart().await;
    until_metric(&mut relay, port, owned, within, |v| v == 256.0).await;
    relay.stop();
}

/// Guarantee (alert `PostalBatchRecordFailures`): when the broker acknowledged a batch but its
/// commit fails (here a deferred trigger refuses it), the relay counts it
/// (`postal_relay_record_failures_total`), publishes the events again, and once commits go
/// through again the outbox drains. (Before, only a log line said so.)
#[tokio::test]
async fn failed_batch_commits_are_counted() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = postal_integration_tests::unique("record-failures");
    sqlx::query(
        "CREATE FUNCTION postal.refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'commit refused by the test'; END $$",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE CONSTRAINT TRIGGER refuse_commit AFTER DELETE ON postal.outbox
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION postal.refuse_commit()",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    {
        let mut tx = db.pool.begin().await.unwrap();
        let e = postal_producer::NewEvent::json(topic.as_str(), "k", "e", &1).unwrap();
        postal_producer::enqueue(&mut tx, e).await.unwrap();
        tx.commit().await.unwrap();
    }
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (mut relay, port) = relay(
        &dir,
        &logs,
        &db.url,
        &svc.bootstrap,
        &["--lease", "20s", "--kafka", "message.timeout.ms=9000"],
    );
    relay.start();
    let within = Duration::from_secs(60);
    until_metric(
        &mut relay,
        port,
        "postal_relay_record_failures_total",
        within,
        |v| v >= 1.0,
    )
    .await;
    sqlx::query("DROP TRIGGER refuse_commit ON postal.outbox")
        .execute(&db.pool)
        .await
        .unwrap();
    postal_integration_tests::wait::until(within, "outbox drained", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop();
}
