//! A second adversarial review (c15bcf2): the consumer's lost-connection limit against slow
//! handlers, and `postal consumer reset`'s dedup-horizon check against targets below the log
//! start and future record timestamps.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use postal_consumer::{idempotent, Event, HandlerError};
use postal_integration_tests::{services, unique};
use serde::Deserialize;
use serde_json::json;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects_table, produce, RawRecord, RunningConsumer,
};

#[derive(Debug, Deserialize)]
pub struct Slow {
    n: i64,
    /// Sleep this long inside the transaction (ms) on attempts <= `slow_runs`.
    sleep_ms: u64,
    #[serde(default = "forever")]
    slow_runs: u32,
    /// Run a statement after sleeping (and return its error with `?`).
    #[serde(default)]
    after: bool,
}
fn forever() -> u32 {
    u32::MAX
}

static RUNS: LazyLock<Mutex<HashMap<Uuid, u32>>> = LazyLock::new(Default::default);
fn runs(id: Uuid) -> u32 {
    RUNS.lock().unwrap().get(&id).copied().unwrap_or(0)
}

#[idempotent(consumer = "effects")]
pub async fn slow(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<Slow>,
) -> Result<(), HandlerError> {
    let id = event.id.as_uuid();
    let run = {
        let mut r = RUNS.lock().unwrap();
        let c = r.entry(id).or_default();
        *c += 1;
        *c
    };
    sqlx::query("INSERT INTO effects (event_id, n, consumer) VALUES ($1, $2, 'effects')")
        .bind(id)
        .bind(event.payload.n)
        .execute(&mut **tx)
        .await?;
    if run <= event.payload.slow_runs {
        tokio::time::sleep(Duration::from_millis(event.payload.sleep_ms)).await;
        if event.payload.after {
            sqlx::query("SELECT 1").execute(&mut **tx).await?;
        }
    }
    Ok(())
}

struct Outcome {
    runs: u32,
    effects_slow: i64,
    effects_next: i64,
    dead: i64,
}

/// One slow event then one normal event on one partition; waits `observe`, reports.
async fn scenario(max_batch: usize, slow_payload: serde_json::Value, observe: Duration) -> Outcome {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("idle");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let slow_id = Uuid::now_v7();
    let next_id = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[
            RawRecord::event(slow_id, "k", "slow", slow_payload),
            RawRecord::event(next_id, "k", "slow", json!({"n": 2, "sleep_ms": 0})),
        ],
    )
    .await;
    let mut c = consumer_config(&svc.bootstrap, &group, "effects");
    c.lost_connection_timeout = Some(Duration::from_secs(3));
    c.max_attempts = 3;
    c.max_batch = max_batch;
    let consumer = postal_consumer::Consumer::builder(db.pool.clone(), c)
        .on(&topic, "slow", slow)
        .build()
        .unwrap();
    let running = RunningConsumer::start(consumer);
    let deadline = std::time::Instant::now() + observe;
    loop {
        let (next,): (i64,) = sqlx::query_as("SELECT count(*) FROM effects WHERE event_id = $1")
            .bind(next_id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if next > 0 || std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let count = |id: Uuid| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE event_id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let out = Outcome {
        runs: runs(slow_id),
        effects_slow: count(slow_id).await,
        effects_next: count(next_id).await,
        dead: sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap(),
    };
    // The application's pool still works, and carries no leaked settings (a new connection's
    // values: 0 shows as the system's keepalive defaults).
    let baseline: (String, String) = {
        use sqlx::Connection;
        let mut fresh = sqlx::PgConnection::connect(&db.url).await.unwrap();
        (
            sqlx::query_scalar("SHOW tcp_keepalives_idle")
                .fetch_one(&mut fresh)
                .await
                .unwrap(),
            sqlx::query_scalar("SHOW client_connection_check_interval")
                .fetch_one(&mut fresh)
                .await
                .unwrap(),
        )
    };
    let mut conns = Vec::new();
    for _ in 0..5 {
        let mut conn = db.pool.acquire().await.expect("pool usable");
        let v: String = sqlx::query_scalar("SHOW tcp_keepalives_idle")
            .fetch_one(&mut *conn)
            .await
            .expect("pool connection usable");
        let t: String = sqlx::query_scalar("SHOW client_connection_check_interval")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!((v, t), baseline, "leaked SET LOCAL");
        conns.push(conn);
    }
    drop(conns);
    running.kill().await;
    eprintln!(
        "max_batch={max_batch}: slow runs={} slow effects={} next effects={} dead letters={}",
        out.runs, out.effects_slow, out.effects_next, out.dead
    );
    out
}

/// Guarantee: a handler that keeps its transaction idle far longer than
/// `lost_connection_timeout` (6 s against 3 s) on a live host is not cut off: its host answers
/// the keepalive probes. It is applied once on its first run, in per-message and in throughput
/// mode, and the next event follows; the pool's connections carry no leaked settings. (With
/// `idle_in_transaction_session_timeout`, the first version, throughput mode retried it
/// forever.)
#[tokio::test]
async fn a_slow_handler_on_a_live_host_is_not_cut_off() {
    for max_batch in [1, 10] {
        let o = scenario(
            max_batch,
            json!({"n": 1, "sleep_ms": 6000, "slow_runs": 1, "after": true}),
            Duration::from_secs(40),
        )
        .await;
        assert_eq!(
            (o.runs, o.effects_slow, o.dead, o.effects_next),
            (1, 1, 0, 1),
            "max_batch {max_batch}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// `postal consumer reset` horizon check (c15bcf2, --clock-tolerance)
// ---------------------------------------------------------------------------------------

/// Produces job events n in `ns` to `topic[0]`, each with an explicit CreateTime.
pub(crate) async fn produce_jobs_at(bootstrap: &str, topic: &str, jobs: &[(i64, i64)]) {
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

struct Applied {
    db: postal_integration_tests::TestDb,
    topic: String,
    group: String,
    bootstrap: String,
}

/// Consumes everything in `topic` (10 events), then dedup retention (1 s) deletes all rows.
async fn consumed_then_expired(jobs: &[(i64, i64)]) -> Applied {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("review");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce_jobs_at(&svc.bootstrap, &topic, jobs).await;
    let running = crate::common::start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER),
    );
    let n = jobs.len() as i64;
    let pool = db.pool.clone();
    postal_integration_tests::wait::until(Duration::from_secs(60), "all applied", || {
        let pool = pool.clone();
        async move { crate::common::effects(&pool).await.1 == n }
    })
    .await;
    running.stop().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    postal_consumer::retention::cleanup_processed(
        &db.pool,
        crate::handlers::CONSUMER,
        Duration::from_secs(1),
        1000,
    )
    .await
    .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "all dedup rows deleted by retention");
    Applied {
        db,
        topic,
        group,
        bootstrap: svc.bootstrap.clone(),
    }
}

fn reset(a: &Applied, to: &str) -> (bool, String) {
    let bin = crate::procs::bin_dir().join("postal");
    let out = std::process::Command::new(&bin)
        .args([
            "consumer",
            "reset",
            "--execute",
            "--group",
            &a.group,
            "--topic",
            &a.topic,
            "--to",
            to,
        ])
        .env("DATABASE_URL", &a.db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &a.bootstrap)
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

/// Replays with a fresh consumer for `secs`, returns (rows, distinct events) in effects.
async fn replay(a: &Applied, secs: u64) -> (i64, i64) {
    let running = crate::common::start_apply(
        &a.db.pool,
        &a.topic,
        consumer_config(&a.bootstrap, &a.group, crate::handlers::CONSUMER),
    );
    tokio::time::sleep(Duration::from_secs(secs)).await;
    running.stop().await;
    crate::common::effects(&a.db.pool).await
}

/// Two relay hosts publish to one partition; one's clock is 20 min ahead (Kafka 4 accepts up
/// to 1 h ahead by default). Offset 3 comes from it, 0..3 and 4..10 from the correct one. All
/// ten were processed and their dedup rows deleted by retention.
///
/// Guarantee: a reset that would replay records whose dedup rows are gone is refused without
/// --force-past-retention, also at `--to 3` and at a time target that lands on offset 3: the
/// group's offset marks decide (here none after the horizon: the stored offset does), not the
/// record at the target. (Failed before the marks: both were accepted, as only the record at
/// the target was checked, and offsets 3..10 were applied twice.)
#[tokio::test]
async fn a_future_timestamp_at_the_target_hides_older_records_after_it() {
    let now = chrono::Utc::now().timestamp_millis();
    let ahead = now + 20 * 60 * 1000;
    let jobs: Vec<(i64, i64)> = (0..10)
        .map(|n| (n, if n == 3 { ahead } else { now + n }))
        .collect();
    let a = consumed_then_expired(&jobs).await;
    assert_eq!(crate::common::effects(&a.db.pool).await, (10, 10));
    // Control: earliest is refused.
    let (ok0, _) = reset(&a, "earliest");
    assert!(!ok0, "control: earliest refused");
    // A time target 10 min from now (after the horizon + tolerance): lands on offset 3.
    let t = chrono::DateTime::from_timestamp_millis(now + 10 * 60 * 1000)
        .unwrap()
        .to_rfc3339();
    let (ok_t, text_t) = reset(&a, &t);
    let (ok3, text3) = reset(&a, "3");
    let effects = replay(&a, 8).await;
    eprintln!("after replay: effects (rows, distinct) = {effects:?}");
    assert!(!ok_t && !ok3 && effects == (10, 10), "time target accepted={ok_t} ({text_t}); --to 3 accepted={ok3} ({text3}); effects {effects:?}");
}

/// Kafka retention removed offsets 0..5 (log start 5); dedup retention removed every row.
/// Guarantee: `--to 0` (replay everything still there) is refused like `--to earliest`.
/// (Failed before: no record was found at offset 0, the reset was accepted and offsets 5..9
/// were applied twice.)
#[tokio::test]
async fn a_target_below_the_log_start_is_checked() {
    let now = chrono::Utc::now().timestamp_millis();
    let jobs: Vec<(i64, i64)> = (0..10).map(|n| (n, now + n)).collect();
    let a = consumed_then_expired(&jobs).await;
    {
        use rdkafka::admin::{AdminClient, AdminOptions};
        let admin: AdminClient<rdkafka::client::DefaultClientContext> =
            rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &a.bootstrap)
                .create()
                .unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset(&a.topic, 0, rdkafka::Offset::Offset(5))
            .unwrap();
        let res = admin
            .delete_records(&tpl, &AdminOptions::new())
            .await
            .unwrap();
        for e in res.elements() {
            e.error().unwrap();
        }
    }
    let (ok_e, _) = reset(&a, "earliest");
    assert!(!ok_e, "control: earliest refused");
    let (ok0, text0) = reset(&a, "0");
    let effects = if ok0 {
        replay(&a, 10).await
    } else {
        crate::common::effects(&a.db.pool).await
    };
    eprintln!("after replay: effects (rows, distinct) = {effects:?}");
    assert!(
        !ok0 && effects == (10, 10),
        "--to 0 accepted={ok0} ({text0}); effects {effects:?}"
    );
}

/// Guarantee: `postal consumer reset` never replays records whose dedup rows retention
/// deleted without `--force-past-retention` — also when the operator names the group's dedup
/// scope with `--consumer` and gets it wrong (the scope is now stated only by the handlers'
/// `#[idempotent(consumer = ..)]`, not in the consumer's configuration; the group's name is an
/// easy guess).
///
/// (Before, `--consumer` restricted the horizon lookup to the names given; a name with no
/// horizon (a typo, the group's name) found none, and the reset went ahead with no check and
/// no word: every record was applied a second time. Now an unknown name is refused.)
#[tokio::test]
async fn a_wrong_consumer_name_does_not_skip_the_horizon_check() {
    let now = chrono::Utc::now().timestamp_millis();
    let jobs: Vec<(i64, i64)> = (0..10).map(|n| (n, now + n)).collect();
    let a = consumed_then_expired(&jobs).await;
    let (ok_e, _) = reset(&a, "earliest");
    assert!(!ok_e, "control: earliest refused");
    let bin = crate::procs::bin_dir().join("postal");
    let out = std::process::Command::new(&bin)
        .args([
            "consumer",
            "reset",
            "--execute",
            "--group",
            &a.group,
            "--topic",
            &a.topic,
            "--to",
            "earliest",
            "--consumer",
            &a.group,
        ])
        .env("DATABASE_URL", &a.db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &a.bootstrap)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("run the postal CLI");
    let ok = out.status.success();
    let text = format!(
        "stdout: {}stderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let effects = if ok {
        replay(&a, 8).await
    } else {
        crate::common::effects(&a.db.pool).await
    };
    assert!(
        !ok && effects == (10, 10),
        "reset --to earliest --consumer {:?} accepted={ok} ({text}); effects (rows, distinct) {effects:?}",
        a.group
    );
}
