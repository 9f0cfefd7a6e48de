//! No silent idle: a running consumer or relay that makes no progress although work is
//! pending shows it within a minute — a log line, `/readyz`, a metric (which an alert rule of
//! `deploy/prometheus-alerts.yml` reads) and `postal status` — on real processes.

use std::time::{Duration, Instant};

use postal_integration_tests::{services, unique};

use crate::procs::{bin_dir, http_get, Proc};

/// The sum of the metric lines named `name` whose labels contain every one of `labels`.
fn metric_sum(port: u16, name: &str, labels: &[&str]) -> f64 {
    let text = http_get(port, "/metrics").unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (set, value) = match rest.strip_prefix('{') {
                Some(r) => r.rsplit_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            labels
                .iter()
                .all(|want| set.split(',').any(|have| have == *want))
                .then(|| value.trim().parse::<f64>().ok())?
        })
        .sum()
}

/// Whether `/readyz` answers 503.
fn not_ready(port: u16) -> bool {
    http_get(port, "/readyz")
        .unwrap_or_default()
        .lines()
        .next()
        .is_some_and(|l| l.contains(" 503"))
}

/// Whether `/readyz` answers 200.
fn ready(port: u16) -> bool {
    http_get(port, "/readyz")
        .unwrap_or_default()
        .lines()
        .next()
        .is_some_and(|l| l.contains(" 200"))
}

/// Polls `check` every 200 ms until it holds; panics with `what` (and the process's log end,
/// if it died) after `within`.
async fn until(proc: &mut Proc, within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    loop {
        if check() {
            return;
        }
        proc.assert_alive();
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Guarantee (alert `PostalConsumerStalled`): a consumer whose records wait while no
/// transaction of their partition completes — here a session holds the table its handler
/// writes locked — shows it within a minute: one "consumer stalled" line naming the partition,
/// `/readyz` 503, and `postal_consumer_stalled_seconds` for the partition at 30 s or more;
/// while the database still answers `SELECT 1` (the old readiness check) and the lag alert's
/// 10k records are far away (20 records). Once the lock goes, every record is applied once, the
/// gauge falls to 0 and `/readyz` answers 200 again. (Before: no metric, no line, ready.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_records_wait_shows_within_a_minute() {
    use crate::common::{create_topic, produce, RawRecord};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let orders = unique("orders-idle");
    create_topic(&svc.bootstrap, &orders, 1).await;
    let order = |n: i64| {
        RawRecord::event(
            uuid::Uuid::now_v7(),
            "c1",
            "order.created",
            serde_json::json!({"order_id": n, "customer": "c1", "seq": n}),
        )
    };
    let dir = bin_dir();
    let logs = dir.join(format!("idle-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let mut billing = Proc::new(&dir, &logs, "billing", "billing_service", &[])
        .env(&[
            ("DATABASE_URL", db.url.clone()),
            ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
            ("ORDERS_TOPIC", orders.clone()),
            ("INVOICES_TOPIC", unique("invoices")),
            ("POSTAL_CONSUMER_GROUP", unique("billing-idle")),
            ("RUST_LOG", "info,rdkafka=warn".into()),
        ])
        .with_metrics();
    billing.start();
    let port = billing.metrics_port().unwrap();
    let ledger_rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
    };
    produce(&svc.bootstrap, &orders, None, &[order(0)]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while ledger_rows().await < 1 {
        billing.assert_alive();
        assert!(Instant::now() < deadline, "the first order was not booked");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let topic_label = format!("topic=\"{orders}\"");
    until(
        &mut billing,
        Duration::from_secs(10),
        "ready and no stall",
        || {
            ready(port)
                && metric_sum(port, "postal_consumer_stalled_seconds", &[&topic_label]) == 0.0
        },
    )
    .await;
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE ledger IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let behind: Vec<RawRecord> = (1..=20).map(order).collect();
    produce(&svc.bootstrap, &orders, None, &behind).await;
    let started = Instant::now();
    let stall = postal_consumer::STALL_AFTER.as_secs_f64();
    until(
        &mut billing,
        Duration::from_secs(60),
        "the stall in the log, /readyz and postal_consumer_stalled_seconds",
        || {
            billing_logged(&logs, "consumer stalled")
                && not_ready(port)
                && metric_sum(port, "postal_consumer_stalled_seconds", &[&topic_label]) >= stall
        },
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(60));
    let log = std::fs::read_to_string(logs.join("billing.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("consumer stalled"))
        .unwrap();
    assert!(
        line.contains(&format!("partition {orders}/0")),
        "names the partition: {line}"
    );
    sqlx::query("SELECT 1").execute(&db.pool).await.unwrap();
    lock.rollback().await.unwrap();
    until(
        &mut billing,
        Duration::from_secs(60),
        "drained, the gauge at 0 and ready again",
        || {
            ready(port)
                && metric_sum(port, "postal_consumer_stalled_seconds", &[&topic_label]) == 0.0
        },
    )
    .await;
    assert_eq!(ledger_rows().await, 21, "each order booked once");
    billing.stop();
    std::fs::remove_dir_all(&logs).ok();
}

fn billing_logged(logs: &std::path::Path, text: &str) -> bool {
    std::fs::read_to_string(logs.join("billing.log"))
        .unwrap_or_default()
        .contains(text)
}

/// `postal status` (text) against `database_url`.
fn status(database_url: &str) -> String {
    let out = std::process::Command::new(bin_dir().join("postal"))
        .arg("status")
        .env("DATABASE_URL", database_url)
        .env_remove("KAFKA_BOOTSTRAP_SERVERS")
        .output()
        .expect("postal status runs");
    assert!(
        out.status.success(),
        "postal status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A `postal relay` process with metrics.
fn relay(logs: &std::path::Path, database_url: &str, bootstrap: &str, args: &[&str]) -> Proc {
    let mut all = vec!["relay"];
    all.extend_from_slice(args);
    Proc::new(&bin_dir(), logs, "relay", "postal", &all)
        .env(&[
            ("DATABASE_URL", database_url.to_owned()),
            ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.to_owned()),
            ("RUST_LOG", "info,rdkafka=warn".into()),
        ])
        .with_metrics()
}

/// Guarantee (alert `PostalRelayTopicStuck`): a topic whose events wait while the relay
/// publishes another — here its topic does not exist and the relay may not create it — shows
/// per topic: `postal_relay_topic_oldest_pending_seconds{topic}` holds its oldest due event's
/// age while the other topic's falls to 0 as it publishes, and `postal status` marks the
/// waiting topic STALLED (with why it waits) and not the other. (Before: one gauge for the
/// whole outbox, and `PostalRelayStuck` quiet while any topic published.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stuck_topic_shows_while_another_publishes() {
    use postal_producer::{enqueue_batch, NewEvent};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let flowing = unique("idle-flowing");
    let stuck = unique("idle-missing");
    crate::common::create_topic(&svc.bootstrap, &flowing, 1).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let events = vec![
        NewEvent::json(stuck.as_str(), "k", "e", &0).unwrap(),
        NewEvent::json(flowing.as_str(), "k", "e", &0).unwrap(),
    ];
    enqueue_batch(&mut conn, events).await.unwrap();
    // The stuck topic's event has waited 10 minutes already (the test need not).
    sqlx::query(
        "UPDATE postal.outbox SET created_at = now() - interval '10 minutes' WHERE topic = $1",
    )
    .bind(&stuck)
    .execute(&mut *conn)
    .await
    .unwrap();
    drop(conn);
    let logs = bin_dir().join(format!("idle-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let mut relay = relay(&logs, &db.url, &svc.bootstrap, &["--no-create-topics"]);
    relay.start();
    let port = relay.metrics_port().unwrap();
    let (stuck_label, flowing_label) =
        (format!("topic=\"{stuck}\""), format!("topic=\"{flowing}\""));
    until(
        &mut relay,
        Duration::from_secs(60),
        "the stuck topic's gauge at 600 s, the other's published",
        || {
            metric_sum(
                port,
                "postal_relay_topic_oldest_pending_seconds",
                &[&stuck_label],
            ) >= 600.0
                && metric_sum(port, "postal_relay_published_total", &[]) >= 1.0
        },
    )
    .await;
    // More events of the flowing topic publish while the stuck one waits.
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue_batch(
        &mut conn,
        vec![NewEvent::json(flowing.as_str(), "k", "e", &1).unwrap()],
    )
    .await
    .unwrap();
    drop(conn);
    until(
        &mut relay,
        Duration::from_secs(60),
        "the flowing topic drained",
        || metric_sum(port, "postal_relay_published_total", &[]) >= 2.0,
    )
    .await;
    until(
        &mut relay,
        Duration::from_secs(40),
        "the flowing topic's gauge at 0",
        || {
            metric_sum(
                port,
                "postal_relay_topic_oldest_pending_seconds",
                &[&flowing_label],
            ) == 0.0
                && metric_sum(
                    port,
                    "postal_relay_topic_oldest_pending_seconds",
                    &[&stuck_label],
                ) >= 600.0
        },
    )
    .await;
    let text = status(&db.url);
    let mut lines = text.lines();
    let at = lines
        .position(|l| l.starts_with(stuck.as_str()))
        .unwrap_or_else(|| panic!("{stuck} in postal status:\n{text}"));
    let next = text.lines().nth(at + 1).unwrap_or_default();
    assert!(
        next.contains("STALLED"),
        "the stuck topic marked STALLED:\n{text}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with(flowing.as_str()))
            || !text.contains(&format!("{flowing}\n  STALLED")),
        "the flowing topic not marked:\n{text}"
    );
    relay.stop();
    std::fs::remove_dir_all(&logs).ok();
}

/// Guarantee (alert `PostalHistoryMaintenanceFailing`): a relay in history mode whose
/// maintenance finds its lock held by another session — every run skipped — says so: a
/// "history maintenance skipped" line naming the holder's pid,
/// `postal_relay_history_maintenance_skipped_total` counting the skips, and
/// `postal_relay_history_maintenance_age_seconds` growing (the alert fires when every relay's
/// is above 30 minutes); once the lock goes, maintenance runs and the age falls back. (Before:
/// a skip reported nothing, and the alert's gauge kept its last value.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_maintenance_skipped_behind_its_lock_shows() {
    use sqlx::Connection as _;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(postal_producer::retention::HISTORY_LOCK)
        .fetch_one(&mut holder)
        .await
        .unwrap();
    assert!(locked);
    let logs = bin_dir().join(format!("idle-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let mut relay = relay(&logs, &db.url, &svc.bootstrap, &["--history=3d"]);
    relay.start();
    let port = relay.metrics_port().unwrap();
    until(
        &mut relay,
        Duration::from_secs(60),
        "two skips counted, the age past 15 s, the line",
        || {
            metric_sum(port, "postal_relay_history_maintenance_skipped_total", &[]) >= 2.0
                && metric_sum(port, "postal_relay_history_maintenance_age_seconds", &[]) >= 15.0
        },
    )
    .await;
    let log = std::fs::read_to_string(&relay.log).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("history maintenance skipped"))
        .unwrap_or_else(|| panic!("no skip line:\n{log}"));
    assert!(
        line.contains(&format!("pid {pid}")),
        "names the holder: {line}"
    );
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut holder)
        .await
        .unwrap();
    until(
        &mut relay,
        Duration::from_secs(40),
        "maintenance ran again",
        || metric_sum(port, "postal_relay_history_maintenance_age_seconds", &[]) < 15.0,
    )
    .await;
    relay.stop();
    std::fs::remove_dir_all(&logs).ok();
}

/// Guarantee: a relay and a consumer that are running when a migration raises
/// `postal.schema_contract` above what their binary knows stop within a minute (the contract
/// is checked again every `SCHEMA_RECHECK`, 30 s), gracefully, each with one line that says to
/// upgrade the binary — instead of running on a schema they must not. (Before: checked at
/// start only; both kept running.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_raised_under_running_processes_stops_them_with_one_line() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let logs = bin_dir().join(format!("idle-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let mut relay = relay(&logs, &db.url, &svc.bootstrap, &[]);
    let mut billing = Proc::new(&bin_dir(), &logs, "billing", "billing_service", &[]).env(&[
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("ORDERS_TOPIC", unique("orders-contract")),
        ("INVOICES_TOPIC", unique("invoices")),
        ("POSTAL_CONSUMER_GROUP", unique("billing-contract")),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ]);
    relay.start();
    billing.start();
    relay
        .await_log("relay started", Duration::from_secs(30))
        .await;
    billing
        .await_log("consumer started", Duration::from_secs(30))
        .await;
    let newer = postal_shared::known_version() + 1;
    sqlx::query("UPDATE postal.schema_contract SET oldest_compatible = $1")
        .bind(newer)
        .execute(&db.pool)
        .await
        .unwrap();
    let changed = Instant::now();
    let deadline = changed + Duration::from_secs(60);
    let (mut relay_exit, mut billing_exit) = (None, None);
    while relay_exit.is_none() || billing_exit.is_none() {
        relay_exit = relay_exit.or_else(|| relay.exited());
        billing_exit = billing_exit.or_else(|| billing.exited());
        assert!(
            Instant::now() < deadline,
            "still running a minute after the contract changed: relay {relay_exit:?}, consumer {billing_exit:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!relay_exit.unwrap().success() && !billing_exit.unwrap().success());
    let wanted = format!("needs binaries that know migration {newer} or later");
    for proc in [&relay, &billing] {
        let log = std::fs::read_to_string(&proc.log).unwrap();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(&wanted)).collect();
        assert_eq!(
            lines.len(),
            1,
            "{}: one line saying what to do:\n{log}",
            proc.name
        );
        assert!(lines[0].contains("upgrade it"), "{}", lines[0]);
    }
    sqlx::query("UPDATE postal.schema_contract SET oldest_compatible = 12")
        .execute(&db.pool)
        .await
        .unwrap();
    std::fs::remove_dir_all(&logs).ok();
}
