//! The overview's charts of the last hour: what relays report of their publishing
//! (`postal.relay_minutes`), with the relay's default settings (published rows deleted at
//! once), and that the report never holds publishing back.

use std::time::Duration;

use postal_integration_tests::http::request;
use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue_batch, KafkaConfig, KafkaTransport, NewEvent};
use sqlx::PgPool;

use crate::common::{fast_config, RunningRelay};

fn transport(bootstrap: &str) -> KafkaTransport {
    let mut cfg = KafkaConfig::new(bootstrap);
    cfg.topic_partitions = 2;
    cfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    // The transport's own size check parks larger events at once (permanent failures).
    cfg.properties
        .insert("message.max.bytes".into(), "4096".into());
    KafkaTransport::new(cfg).unwrap()
}

async fn enqueue(pool: &PgPool, topic: &str, small: usize, large: usize) {
    let mut events = Vec::new();
    for i in 0..small {
        events.push(NewEvent::json(topic, format!("k{}", i % 7), "order.placed", &i).unwrap());
    }
    for i in 0..large {
        events.push(
            NewEvent::json(topic, format!("big{i}"), "order.placed", &"x".repeat(6000)).unwrap(),
        );
    }
    let mut conn = pool.acquire().await.unwrap();
    enqueue_batch(&mut conn, events).await.unwrap();
}

/// `(published, parked, lag-weighted events)` the relays reported for the last hour.
async fn reported(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(sum(published), 0)::int8, coalesce(sum(parked), 0)::int8,
                coalesce(sum(lag_events), 0)::int8
         FROM postal.relay_minutes WHERE minute >= now() - interval '1 hour'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn outbox_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Guarantee: with the relay's default settings (published rows deleted as they are recorded),
/// the overview charts every event the relay published and parked in the last hour, with
/// their end-to-end lag, within seconds; the relays' housekeeping deletes reports older than a
/// day and keeps the rest.
#[tokio::test]
async fn the_charts_count_a_default_relays_publishing_and_lag() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-charts");
    let stale = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.relay_minutes (minute, relay_id, topic, published)
         VALUES (date_trunc('minute', now()) - interval '2 days', $1, 'old', 5),
                (date_trunc('minute', now()) - interval '3 hours', $1, 'old', 7)",
    )
    .bind(stale)
    .execute(&db.pool)
    .await
    .unwrap();
    enqueue(&db.pool, &topic, 120, 2).await;
    let config = fast_config();
    assert!(
        config.delete_on_publish,
        "the default deletes published rows"
    );
    let relay = RunningRelay::start(&db.pool, transport(&svc.bootstrap), config);
    wait::until(
        Duration::from_secs(60),
        "120 published (deleted) and 2 parked",
        || async { outbox_rows(&db.pool).await == 2 },
    )
    .await;
    wait::until(
        Duration::from_secs(30),
        "the relay's report of 120 published and 2 parked",
        || async { reported(&db.pool).await == (120, 2, 120) },
    )
    .await;
    wait::until(
        Duration::from_secs(30),
        "housekeeping deletes the report of two days ago",
        || async {
            let old: Vec<i64> = sqlx::query_scalar(
                "SELECT published FROM postal.relay_minutes WHERE topic = 'old' ORDER BY minute",
            )
            .fetch_all(&db.pool)
            .await
            .unwrap();
            old == vec![7]
        },
    )
    .await;
    relay.stop().await;

    let overview = postal_admin::overview::read(&db.pool).await.unwrap();
    assert_eq!(overview.minutes.len(), 60);
    let published: i64 = overview.minutes.iter().map(|m| m.published).sum();
    let parked: i64 = overview.minutes.iter().map(|m| m.parked).sum();
    assert_eq!((published, parked), (120, 2));
    let lags: Vec<(f64, f64)> = overview
        .minutes
        .iter()
        .filter(|m| m.published > 0)
        .map(|m| (m.lag_ms.unwrap(), m.lag_max_ms.unwrap()))
        .collect();
    assert!(!lags.is_empty());
    for (avg, max) in lags {
        assert!(
            avg > 0.0 && avg <= max && max < 60_000.0,
            "lag {avg} ms, max {max} ms"
        );
    }

    let (addr, server) = postal_admin::web::serve(
        "127.0.0.1:0".parse().unwrap(),
        postal_admin::web::Dashboard::new(db.pool.clone()),
    )
    .await
    .unwrap();
    let page = request(addr, "GET", "/", &[], "").await;
    server.abort();
    let chart = |id: &str| {
        let start = page.body.find(&format!("id=\"{id}\"")).expect(id);
        let end = start + page.body[start..].find("</figure>").unwrap();
        page.body[start..end].to_owned()
    };
    assert!(
        chart("chart-published").contains("; 120 in all"),
        "{}",
        chart("chart-published")
    );
    assert!(
        chart("chart-parked").contains("; 2 in all"),
        "{}",
        chart("chart-parked")
    );
    assert!(chart("chart-lag").contains(" ms</title>"));
    // Axes (issue 48): the value axis from 0 to the largest value with its unit, the time axis
    // labelled at its start, middle and end (the last minute in UTC).
    let published = chart("chart-published");
    let ticks: Vec<&str> = published
        .split("<text class=\"tick\"")
        .skip(1)
        .map(|t| t.split('>').nth(1).unwrap().split('<').next().unwrap())
        .collect();
    assert_eq!(
        ticks.len(),
        5,
        "two value labels, three time labels: {ticks:?}"
    );
    assert!(
        ticks[0].ends_with(" events") && ticks[1] == "0",
        "{ticks:?}"
    );
    let now = chrono::Utc::now().format("%H:%M").to_string();
    let before = (chrono::Utc::now() - chrono::Duration::minutes(1))
        .format("%H:%M")
        .to_string();
    assert!(
        ticks[4] == format!("{now} UTC") || ticks[4] == format!("{before} UTC"),
        "the time axis ends at the current minute: {ticks:?}"
    );
    assert!(published.contains("events per minute"), "{published}");
}

/// Guarantee: the relay's activity report is off the publish path. While another session
/// holds `postal.relay_minutes` locked, the relay publishes and records every event as usual;
/// the counts it could not write are kept and written once the lock is gone, none lost and
/// none counted twice.
#[tokio::test]
async fn a_locked_report_table_never_holds_publishing_back() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-charts-locked");
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE postal.relay_minutes IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let relay = RunningRelay::start(&db.pool, transport(&svc.bootstrap), fast_config());
    enqueue(&db.pool, &topic, 200, 0).await;
    wait::until(
        Duration::from_secs(60),
        "200 published while the report table is locked",
        || async { outbox_rows(&db.pool).await == 0 },
    )
    .await;
    // A report comes due meanwhile, waits on the lock and gives up (its lock timeout): the
    // counts it held must survive that.
    let report_waiting = || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
             WHERE l.relation = 'postal.relay_minutes'::regclass AND NOT l.granted
               AND a.query LIKE '%INSERT INTO postal.relay_minutes%'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        waiting > 0
    };
    wait::until(
        Duration::from_secs(30),
        "a report waiting on the lock",
        &report_waiting,
    )
    .await;
    wait::until(Duration::from_secs(30), "the report giving up", || async {
        !report_waiting().await
    })
    .await;
    lock.rollback().await.unwrap();
    wait::until(
        Duration::from_secs(30),
        "the kept report written after the lock",
        || async { reported(&db.pool).await.0 >= 200 },
    )
    .await;
    relay.stop().await;
    assert_eq!(
        reported(&db.pool).await,
        (200, 0, 200),
        "each event counted once"
    );
}
