//! Adversarial review (2) of `postal.offset_marks` (a318162): marks pruned by `mark_offsets`'s
//! `keep` (retention + 1 day from now) while a lagging dedup horizon still needs them. Fixed:
//! pruning folds old marks into one per partition (highest position, latest time) instead of
//! dropping them.

use std::time::Duration;

use postal_integration_tests::{services, unique};
use serde_json::json;
use uuid::Uuid;

use crate::common::{consumer_config, effects, effects_table};

async fn create_topic_keep_forever(bootstrap: &str, topic: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let res = admin
        .create_topics(
            [&NewTopic::new(topic, 1, TopicReplication::Fixed(1)).set("retention.ms", "-1")],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    for r in res {
        r.unwrap();
    }
}

async fn produce_jobs_at(bootstrap: &str, topic: &str, jobs: &[(i64, i64)]) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    for &(n, ts) in jobs {
        let id = Uuid::now_v7().to_string();
        let payload = serde_json::to_vec(&json!({"n": n})).unwrap();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "ce_id",
                value: Some(id.as_str()),
            })
            .insert(Header {
                key: "ce_type",
                value: Some("job"),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json"),
            });
        producer
            .send(
                FutureRecord::to(topic)
                    .partition(0)
                    .key("k")
                    .payload(payload.as_slice())
                    .headers(headers)
                    .timestamp(ts),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
}

fn reset(url: &str, bootstrap: &str, group: &str, topic: &str, to: &str) -> (bool, String) {
    let bin = crate::procs::bin_dir().join("postal");
    let out = std::process::Command::new(&bin)
        .args([
            "consumer", "reset", "--group", group, "--topic", topic, "--to", to,
        ])
        .env("DATABASE_URL", url)
        .env("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("run the postal CLI");
    let text = format!(
        "stdout: {}stderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("reset --to {to}: success={} {text}", out.status.success());
    (out.status.success(), text)
}

async fn run_until(pool: &sqlx::PgPool, bootstrap: &str, group: &str, topic: &str, secs: u64) {
    let running = crate::common::start_apply(
        pool,
        topic,
        consumer_config(bootstrap, group, crate::handlers::CONSUMER),
    );
    tokio::time::sleep(Duration::from_secs(secs)).await;
    running.stop().await;
}

async fn marks(pool: &sqlx::PgPool, group: &str) -> Vec<(i64, String)> {
    sqlx::query_as(
        "SELECT next_offset, (now() - marked_at)::text FROM postal.offset_marks
         WHERE group_id = $1 ORDER BY marked_at",
    )
    .bind(group)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Timeline (database clock; D = 8 days 10 minutes ago; dedup retention 7 d, so the running
/// consumer's `mark_offsets` keeps marks for 8 d):
/// - D: the group applies ten records (dedup rows processed_at = D); stored offset 10.
/// - D + 1 min: legitimate `postal consumer reset --to 0` (no horizon yet): pre-move mark 10.
/// - D + 1 .. D + 30 min: the partition stalls at 0 (its handler retries a downstream outage,
///   or the group's other process runs): housekeeping marks 0 at D + 11 and D + 22.
/// - D + 30 min: it recovers, replays 0..10 as dedup skips (rows keep processed_at = D), marks
///   10 at D + 33 and on until now; then the consumer name is idle for about a day.
/// - Retention (7 d) deletes the rows: horizon = D + 12 min (an event of another partition of
///   the same consumer name processed then).
/// - now: the consumer's housekeeping prunes marks older than 8 d: the pre-move mark 10 at
///   D + 1 goes, while D + 11 (<= horizon, so "covered") and D + 22 (the first >= horizon +
///   10 min) stay. Bound = max(0, 0) = 0.
/// Guarantee: `--to 3` (record 3 stamped by a relay whose clock runs ahead, past horizon + 5
/// min) is still refused after the pruning. (Failed when pruning dropped old marks: accepted,
/// and the replay applied 3..10 a second time.)
#[tokio::test]
async fn pruning_old_marks_keeps_a_reset_from_replaying_deleted_rows() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("marks2");
    let group = unique("g");
    create_topic_keep_forever(&svc.bootstrap, &topic).await;
    let now = chrono::Utc::now().timestamp_millis();
    let d = now - (8 * 24 * 60 + 10) * 60 * 1000;
    let jobs: Vec<(i64, i64)> = (0..10)
        .map(|n| {
            (
                n,
                if n == 3 {
                    d + 20 * 60 * 1000
                } else {
                    d - 3600 * 1000 + n
                },
            )
        })
        .collect();
    produce_jobs_at(&svc.bootstrap, &topic, &jobs).await;
    run_until(&db.pool, &svc.bootstrap, &group, &topic, 8).await;
    assert_eq!(effects(&db.pool).await, (10, 10), "first pass applied all");
    let (ok_back, text_back) = reset(&db.url, &svc.bootstrap, &group, &topic, "0");
    assert!(ok_back, "{text_back}");
    run_until(&db.pool, &svc.bootstrap, &group, &topic, 8).await;
    assert_eq!(effects(&db.pool).await, (10, 10), "replay deduplicated");
    eprintln!("real marks: {:?}", marks(&db.pool, &group).await);
    // Shift the history back (see the timeline).
    sqlx::query(
        "UPDATE postal.processed_events SET processed_at = now() - interval '8 days 10 minutes'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
         VALUES ($1, $2, now() - interval '8 days 10 minutes' + interval '12 minutes')",
    )
    .bind(crate::handlers::CONSUMER)
    .bind(Uuid::now_v7())
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM postal.offset_marks WHERE group_id = $1")
        .bind(&group)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO postal.offset_marks (group_id, topic, partition, next_offset, marked_at)
         SELECT $1, $2, 0, o, now() - interval '8 days 10 minutes' + m * interval '1 minute'
         FROM (VALUES (10, 1), (0, 11), (0, 22), (10, 33)) v(o, m)
         UNION ALL SELECT $1, $2, 0, 10, now() - interval '1 minute'",
    )
    .bind(&group)
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let deleted = postal_consumer::retention::cleanup_processed(
        &db.pool,
        crate::handlers::CONSUMER,
        Duration::from_secs(7 * 24 * 3600),
        1000,
    )
    .await
    .unwrap();
    assert_eq!(deleted, Some(11));
    let h: String = sqlx::query_scalar(
        "SELECT (now() - horizon)::text FROM postal.dedup_horizon WHERE consumer_name = $1",
    )
    .bind(crate::handlers::CONSUMER)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    eprintln!(
        "horizon age: {h}; marks: {:?}",
        marks(&db.pool, &group).await
    );
    // Control: with the pre-move mark still there, --to 3 is refused (bound 10).
    let (ok_before, text_before) = reset(&db.url, &svc.bootstrap, &group, &topic, "3");
    assert!(
        !ok_before,
        "control: refused while the pre-move mark exists: {text_before}"
    );
    // What the running consumer's housekeeping does every cleanup_interval (retention 7 d).
    postal_consumer::retention::mark_offsets(&db.pool, &group, Duration::from_secs(8 * 24 * 3600))
        .await
        .unwrap();
    eprintln!(
        "marks after mark_offsets: {:?}",
        marks(&db.pool, &group).await
    );
    let (ok3, text3) = reset(&db.url, &svc.bootstrap, &group, &topic, "3");
    if ok3 {
        run_until(&db.pool, &svc.bootstrap, &group, &topic, 8).await;
    }
    let after = effects(&db.pool).await;
    eprintln!("after replay: effects (rows, distinct) = {after:?}");
    assert!(
        !ok3 && after == (10, 10),
        "--to 3 accepted={ok3} ({text3}); effects {after:?}"
    );
}
