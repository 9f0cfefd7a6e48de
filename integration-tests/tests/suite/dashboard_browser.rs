//! The dashboard in a real browser: Debian's chromium driven by Playwright
//! (`admin/browser/dashboard.mjs`) through the pages an operator uses at 3 a.m., on events a
//! real relay parked on a real Kafka broker.
//!
//! Needs `node`, `admin/browser/node_modules` (`npm ci --prefix admin/browser`) and chromium
//! (`CHROMIUM`, default `/usr/bin/chromium`). Without them the test says so and passes, unless
//! `POSTAL_REQUIRE_BROWSER=1` (as in CI), when it fails. Screenshots go to `POSTAL_SCREENSHOTS`
//! (default `target/dashboard-screenshots`).

use std::path::PathBuf;
use std::time::Duration;

use postal_admin::web::{serve, Dashboard};
use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue_batch, KafkaConfig, KafkaTransport, NewEvent};
use sqlx::PgPool;

use crate::common::{fast_config, RunningRelay};

fn browser_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../admin/browser")
}

/// Why the browser test cannot run here, if it cannot.
fn missing() -> Option<String> {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if !std::path::Path::new(&chromium).exists() {
        return Some(format!(
            "no chromium at {chromium} (apt-get install chromium)"
        ));
    }
    if !browser_dir().join("node_modules/playwright-core").exists() {
        return Some("no playwright-core (npm ci --prefix admin/browser)".into());
    }
    if std::process::Command::new("node")
        .arg("--version")
        .output()
        .is_err()
    {
        return Some("no node".into());
    }
    None
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn transport(bootstrap: &str, max_bytes: Option<&str>) -> KafkaTransport {
    let mut cfg = KafkaConfig::new(bootstrap);
    cfg.topic_partitions = 2;
    cfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    if let Some(m) = max_bytes {
        // The transport's own pre-send size check uses it: larger events are parked at once.
        cfg.properties.insert("message.max.bytes".into(), m.into());
    }
    KafkaTransport::new(cfg).unwrap()
}

/// Guarantee: in chromium, an operator sees the relay's publishing charted and a consumer
/// group's lag read from the broker on the overview, sees a poison event the relay parked (its `<script>`
/// key shown as text, never run, under the dashboard's CSP, with no console error), requeues
/// it with the button and a confirmation and watches it publish, discards another with a
/// confirmation, requeues three by a filter, releases a blocked key (its head, then the three
/// events behind it, reach Kafka in order), looks up a dedup row, and finds the four actions in
/// the audit trail. Screenshots of each page are saved.
#[tokio::test]
async fn an_operator_recovers_poison_events_in_a_browser() {
    if let Some(why) = missing() {
        assert!(
            std::env::var("POSTAL_REQUIRE_BROWSER").as_deref() != Ok("1"),
            "POSTAL_REQUIRE_BROWSER=1 but the browser test cannot run: {why}"
        );
        eprintln!("dashboard_browser: skipped: {why}");
        return;
    }
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-browser");
    let big = "x".repeat(6000);
    let poison = NewEvent::json(
        topic.as_str(),
        "<script>window.__pwned=1</script>",
        "invoice.issued",
        &big,
    )
    .unwrap();
    let discard = NewEvent::json(topic.as_str(), "discard-me", "invoice.issued", &big).unwrap();
    let (poison_id, discard_id) = (poison.id(), discard.id());
    let mut events = vec![poison, discard];
    for i in 0..3 {
        events
            .push(NewEvent::json(topic.as_str(), format!("bulk-{i}"), "bulk.retry", &big).unwrap());
    }
    events.push(NewEvent::json(topic.as_str(), "held", "ledger.head", &big).unwrap());
    for n in 1..=3 {
        events.push(NewEvent::json(topic.as_str(), "held", "ledger.tail", &n).unwrap());
    }
    for i in 0..50 {
        events.push(
            NewEvent::json(topic.as_str(), format!("k{}", i % 10), "order.placed", &i).unwrap(),
        );
    }
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue_batch(&mut conn, events).await.unwrap();
    drop(conn);
    // A relay with a 4 KiB record limit parks the six large events; the held key's tail waits.
    let config = fast_config().delete_on_publish(false);
    let relay = RunningRelay::start(
        &db.pool,
        transport(&svc.bootstrap, Some("4096")),
        config.clone(),
    );
    wait::until(
        Duration::from_secs(60),
        "6 parked, 50 published",
        || async {
            count(
                &db.pool,
                "SELECT count(*) FROM postal.outbox WHERE status = 'failed'",
            )
            .await
                == 6
                && count(
                    &db.pool,
                    "SELECT count(*) FROM postal.outbox WHERE status = 'published'",
                )
                .await
                    == 50
        },
    )
    .await;
    relay.stop().await;
    // The cause fixed: a relay with the broker's own limit.
    let relay = RunningRelay::start(&db.pool, transport(&svc.bootstrap, None), config);
    // A dead letter and a dedup row, for those pages.
    let looked_up = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition, kafka_offset,
             event_id, reason, error, attempts, dlq_topic)
         VALUES ('billing', 'billing', $1, 0, 42, $2, 'permanent', 'card <b>declined</b>', 1, $1 || '.dlq')",
    )
    .bind(&topic)
    .bind(uuid::Uuid::now_v7())
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id) VALUES ('billing', $1)",
    )
    .bind(looked_up)
    .execute(&db.pool)
    .await
    .unwrap();

    // A consumer group that stored offset 0 on both partitions: its lag is every record there.
    sqlx::query(
        "INSERT INTO postal.consumer_offsets (group_id, topic, partition, next_offset)
         VALUES ('billing', $1, 0, 0), ('billing', $1, 1, 0)",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    // A key held by a consumer group (`FinalFailure::HoldKey`): its head and one record after.
    sqlx::query(
        "INSERT INTO postal.held_keys (group_id, topic, partition, record_key, head_offset,
             consumer_name, reason, error)
         VALUES ('billing', $1, 1, 'acct-held', 3, 'billing', 'permanent', 'balance below zero')",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO postal.held_records (group_id, topic, partition, kafka_offset, record_key,
             event_id, event_type, bytes)
         SELECT 'billing', $1, 1, o, 'acct-held', gen_random_uuid(), 'account.debited', 100
         FROM generate_series(3, 4) AS o",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let mut kafka = rdkafka::ClientConfig::new();
    kafka.set("bootstrap.servers", &svc.bootstrap);
    let (addr, server) = serve(
        "127.0.0.1:0".parse().unwrap(),
        Dashboard::new(db.pool.clone()).actions(true).kafka(kafka),
    )
    .await
    .unwrap();
    let shots = std::env::var("POSTAL_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/dashboard-screenshots")
        });
    std::fs::create_dir_all(&shots).unwrap();
    let out = tokio::process::Command::new("node")
        .arg(browser_dir().join("dashboard.mjs"))
        .env("DASHBOARD_URL", format!("http://{addr}"))
        .env("POISON_ID", poison_id.to_string())
        .env("DISCARD_ID", discard_id.to_string())
        .env("HELD_KEY", "held")
        .env("LOOKUP_CONSUMER", "billing")
        .env("LOOKUP_EVENT", looked_up.to_string())
        .env("LAG_GROUP", "billing")
        .env("HELD_GROUP_KEY", "acct-held")
        .env("LAG_TOTAL", "50")
        .env("SHOTS", &shots)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(240), out)
        .await
        .expect("the browser steps finish within 4 minutes")
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "browser steps failed:\n{stdout}\n{stderr}"
    );
    relay.stop().await;
    server.abort();

    // What the browser did, seen in the outbox and on the broker.
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM postal.outbox WHERE status <> 'published'"
        )
        .await,
        0
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM postal.outbox").await,
        58,
        "59 enqueued, one discarded"
    );
    let records = postal_integration_tests::kafka::read_all(
        &svc.bootstrap,
        &topic,
        58,
        Duration::from_secs(60),
    )
    .await;
    let held: Vec<&str> = records
        .iter()
        .filter(|r| r.key.as_deref() == Some("held"))
        .filter_map(|r| r.header("ce_type"))
        .collect();
    assert_eq!(
        held,
        vec!["ledger.head", "ledger.tail", "ledger.tail", "ledger.tail"],
        "the head, then its tail"
    );
    let tail: Vec<String> = records
        .iter()
        .filter(|r| r.header("ce_type") == Some("ledger.tail"))
        .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
        .collect();
    assert_eq!(tail, vec!["1", "2", "3"], "the tail in order");
    for name in [
        "overview",
        "parked",
        "event",
        "confirm",
        "blocked",
        "dead-letters",
        "lookup",
        "audit",
    ] {
        let f = shots.join(format!("{name}.png"));
        assert!(
            std::fs::metadata(&f)
                .map(|m| m.len() > 5000)
                .unwrap_or(false),
            "{} saved",
            f.display()
        );
    }
}
