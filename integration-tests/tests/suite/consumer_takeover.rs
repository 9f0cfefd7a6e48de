//! An adversarial review of the consumer's takeover, idle epoch check and strictly increasing
//! offsets (402a26d). The loss and the two older problems it found are fixed and their tests
//! run; its randomized reset test runs with `--ignored` (it takes minutes).

use std::time::Duration;

use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, start_apply, RawRecord,
};

const WAIT: Duration = Duration::from_secs(60);

fn records(from: i64, to: i64) -> Vec<RawRecord> {
    (from..to)
        .map(|n| RawRecord::event(Uuid::now_v7(), "k", "job", json!({"n": n})))
        .collect()
}

async fn applied_in_order(pool: &sqlx::PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT n FROM effects ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Polls `check` until it holds (true) or `timeout` passes (false).
async fn try_until<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

/// Deletes the records of `topic[0]` below `before` (as retention does): the log start offset
/// becomes `before`.
async fn delete_records(bootstrap: &str, topic: &str, before: i64) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, rdkafka::Offset::Offset(before))
        .unwrap();
    let res = admin
        .delete_records(&tpl, &AdminOptions::new())
        .await
        .expect("delete records");
    for e in res.elements() {
        e.error().expect("records deleted");
    }
}

/// The takeover's second seek "lands" only when a record at or below the first one seen
/// (`seen`) arrives. If the records up to `seen` are gone from the broker when the seek is
/// issued (retention / delete-records moved the log start past `seen`), the stored offset is
/// out of range, the fetch restarts at the log start (> `seen`), and every record from then
/// on is dropped as "from before the seek" — forever, re-seeking every `stall_check`.
///
/// Guarantee: the records still on the broker (25..) and every new one are applied (with a
/// warning that the records in between were removed, and the 20 removed records counted in
/// `postal_consumer_records_expired_total`, alert `PostalConsumerRecordsExpired`). The second
/// seek goes to the log start and lands at or below it. (Failed before: nothing was applied,
/// ever; and before issue 51 the removed records were a warning only.)
#[tokio::test]
async fn a_second_seek_landing_above_the_first_record_seen_does_not_stall_the_partition() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("review");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce(&svc.bootstrap, &topic, Some(0), &records(0, 20)).await;
    let config = || {
        let mut c = consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER);
        c.stall_check = Duration::from_secs(1);
        c
    };
    let running = start_apply(&db.pool, &topic, config());
    let pool = db.pool.clone();
    wait::until(WAIT, "20 applied", || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 == 20 }
    })
    .await;
    running.stop().await;
    // The stored offset behind Kafka's group offset (20): a reset in the database only (as in
    // takeover::records_fetched_above_the_stored_offset_do_not_skip_a_replay).
    sqlx::query("UPDATE postal.consumer_offsets SET next_offset = 5 WHERE group_id = $1")
        .bind(&group)
        .execute(&db.pool)
        .await
        .unwrap();
    produce(&svc.bootstrap, &topic, Some(0), &records(20, 30)).await;
    // Hold the takeover so the fetch from Kafka's group offset fills the buffer (20..30).
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM postal.consumer_offsets WHERE group_id = $1 FOR UPDATE")
        .bind(&group)
        .execute(&mut *blocker)
        .await
        .unwrap();
    let running = start_apply(&db.pool, &topic, config());
    wait::until(WAIT, "the worker's takeover waiting for the lock", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%consumer_offsets%'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                > 0
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Retention moves the log start to 25, past the first record the worker will see (20).
    delete_records(&svc.bootstrap, &topic, 25).await;
    blocker.rollback().await.unwrap();
    // New records keep coming.
    produce(&svc.bootstrap, &topic, Some(0), &records(30, 40)).await;
    let stats = running.stats.clone();
    let result = try_until(Duration::from_secs(30), || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE n >= 25")
                .fetch_one(&pool)
                .await
                .unwrap()
                >= 15
        }
    })
    .await;
    let snapshot = stats.snapshot();
    running.stop().await;
    let applied = applied_in_order(&db.pool).await;
    assert!(
        result,
        "records 25..40 still on the broker were never applied (stats {snapshot:?}); applied: {applied:?}"
    );
    assert_eq!(
        snapshot.records_expired, 20,
        "the 20 records removed before they were processed (5..25) are counted"
    );
}

/// Randomized: bursts of records on 3 partitions, idle gaps, and stored offsets moved back
/// with a bumped epoch (what `postal consumer reset --force` does in the database) at random
/// moments — racing in-flight transactions, idle epoch checks, takeovers' second seeks — while
/// a second member (throughput mode) joins and leaves. The dedup rows are kept, so a replay
/// must apply nothing: every event exactly once, and per partition in offset order.
/// `REVIEW_SEED` / `REVIEW_ROUNDS` (default random / 60).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "randomized, minutes long: run with --ignored"]
async fn random_resets_back_racing_batches_and_a_rebalance() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("REVIEW_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let rounds: usize = std::env::var("REVIEW_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    // REVIEW_FORWARD=1: resets also move ahead (skipping records): then only "never twice"
    // and "in offset order" are checked, not completeness.
    let forward = std::env::var("REVIEW_FORWARD").is_ok_and(|v| v == "1");
    eprintln!("REVIEW_SEED={seed} REVIEW_ROUNDS={rounds} REVIEW_FORWARD={forward}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("review");
    let group = unique("g");
    let parts = 3i32;
    create_topic(&svc.bootstrap, &topic, parts).await;
    let start = |max_batch: usize| {
        let db = &db;
        let (bootstrap, group, topic) = (svc.bootstrap.clone(), group.clone(), topic.clone());
        async move {
            let pool = db.process_pool().await;
            let mut c = consumer_config(&bootstrap, &group, crate::handlers::CONSUMER);
            c.stall_check = Duration::from_secs(1);
            c.max_batch = max_batch;
            c.partition_buffer = 20;
            crate::common::RunningConsumer::start(crate::common::apply_consumer(&pool, &topic, c))
                .owning(pool)
        }
    };
    let mut seq = vec![0i64; parts as usize];
    let mut total = 0i64;
    let mut resets = 0;
    let mut a = Some(start(1).await);
    let mut b = None;
    for round in 0..rounds {
        if round == rounds / 3 {
            b = Some(start(16).await);
        }
        if round == 2 * rounds / 3 {
            if let Some(b) = b.take() {
                b.stop().await;
            }
        }
        if round == rounds / 2 {
            // The first member leaves and comes back (throughput mode this time).
            if let Some(a) = a.take() {
                a.stop().await;
            }
            a = Some(start(8).await);
        }
        let p = rng.random_range(0..parts);
        let n = rng.random_range(0..40i64);
        let burst: Vec<RawRecord> = (0..n)
            .map(|i| {
                RawRecord::event(
                    Uuid::now_v7(),
                    "k",
                    "job",
                    json!({"n": p as i64 * 1_000_000 + seq[p as usize] + i}),
                )
            })
            .collect();
        seq[p as usize] += n;
        total += n;
        produce(&svc.bootstrap, &topic, Some(p), &burst).await;
        if rng.random_bool(0.6) {
            let rp = rng.random_range(0..parts);
            let back = if forward {
                // Ahead only (a skip), capped at the high watermark: a replay of skipped
                // records after a later move back would be out of order by design.
                rng.random_range(-30..0i64)
            } else {
                rng.random_range(1..40i64)
            };
            // As `postal consumer reset` stores it: a new next offset, the epoch bumped.
            sqlx::query(
                "UPDATE postal.consumer_offsets
                 SET next_offset = LEAST(GREATEST(next_offset - $4, 0), $5), epoch = epoch + 1,
                     owner = 'postal consumer reset', updated_at = now()
                 WHERE group_id = $1 AND topic = $2 AND partition = $3 AND next_offset IS NOT NULL",
            )
            .bind(&group)
            .bind(&topic)
            .bind(rp)
            .bind(back)
            .bind(seq[rp as usize])
            .execute(&db.pool)
            .await
            .unwrap();
            resets += 1;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..700))).await;
    }
    let pool = db.pool.clone();
    let (topic_, group_) = (topic.clone(), group.clone());
    let all = try_until(Duration::from_secs(90), || {
        let pool = pool.clone();
        let (topic, group) = (topic_.clone(), group_.clone());
        let seq = seq.clone();
        async move {
            if !forward {
                return effects(&pool).await.1 >= total;
            }
            // Every partition's stored offset at its end.
            let stored: Vec<(i32, Option<i64>)> =
                postal_consumer::testing::offsets::stored(&pool, &group, &topic)
                    .await
                    .unwrap();
            stored.len() == parts as usize
                && stored.iter().all(|(p, o)| *o == Some(seq[*p as usize]))
        }
    })
    .await;
    // Replays still running end here; give them a moment to (not) apply anything.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stats = a.as_ref().unwrap().stats.snapshot();
    a.unwrap().stop().await;
    if let Some(b) = b {
        b.stop().await;
    }
    let (rows, distinct) = effects(&db.pool).await;
    eprintln!("seed {seed}: total {total}, resets {resets}, rows {rows}, distinct {distinct}, stats of the last member {stats:?}");
    assert!(
        all,
        "seed {seed}: not every event applied / not at the end: {distinct} of {total}"
    );
    assert_eq!(rows, distinct, "seed {seed}: an event applied twice");
    if !forward {
        assert_eq!(
            (rows, distinct),
            (total, total),
            "seed {seed}: each event exactly once"
        );
    }
    for p in 0..parts as i64 {
        let ns: Vec<i64> =
            sqlx::query_scalar("SELECT n FROM effects WHERE n >= $1 AND n < $2 ORDER BY id")
                .bind(p * 1_000_000)
                .bind((p + 1) * 1_000_000)
                .fetch_all(&db.pool)
                .await
                .unwrap();
        if forward {
            assert!(
                ns.windows(2).all(|w| w[0] < w[1]),
                "seed {seed}: partition {p} not applied in offset order: {ns:?}"
            );
        } else {
            let expected: Vec<i64> = (0..seq[p as usize]).map(|i| p * 1_000_000 + i).collect();
            assert_eq!(
                ns, expected,
                "seed {seed}: partition {p} applied in offset order"
            );
        }
    }
}

/// `postal consumer reset` decides "older than the dedup horizon" from the records' Kafka
/// timestamps (CreateTime: the relay host's clock; Postal's Kafka transport sets none), but
/// the horizon is `max(processed_at)` of the deleted dedup rows (the database's clock). With
/// the relay host's clock a few seconds ahead of the database's, records whose dedup rows were
/// deleted carry timestamps newer than the horizon.
///
/// Guarantee: the reset is refused all the same — records up to `--clock-tolerance` (5 min)
/// newer than the horizon count as older than it — so the replay cannot apply them twice.
/// (Failed before: the reset was accepted and the ten events were applied twice.)
///
/// Needs the CLI binary: `cargo build -p postal-cli` (`scripts/test.sh` builds it).
#[tokio::test]
async fn a_relay_clock_ahead_of_the_database_does_not_defeat_the_reset_horizon_check() {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let bin = crate::procs::bin_dir().join("postal");
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("review");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    // Ten events published by a relay whose clock is 5 s ahead of the database's.
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &svc.bootstrap)
        .create()
        .unwrap();
    let skewed = chrono::Utc::now().timestamp_millis() + 5_000;
    for n in 0..10i64 {
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
                FutureRecord::to(&topic)
                    .partition(0)
                    .key("k")
                    .payload(payload.as_slice())
                    .headers(headers)
                    .timestamp(skewed + n),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    let config = || consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER);
    let running = start_apply(&db.pool, &topic, config());
    let pool = db.pool.clone();
    wait::until(WAIT, "10 applied", || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 == 10 }
    })
    .await;
    running.stop().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Dedup retention deletes the rows (what the consumer's housekeeping runs; 1 s here
    // instead of days).
    let deleted = postal_consumer::retention::cleanup_processed(
        &db.pool,
        crate::handlers::CONSUMER,
        Duration::from_secs(1),
        1000,
    )
    .await
    .unwrap();
    eprintln!("dedup rows deleted: {deleted:?}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the dedup rows of the 10 events were deleted");
    // The operator replays from the start without --force-past-retention: must be refused.
    let out = std::process::Command::new(&bin)
        .args([
            "consumer",
            "reset",
            "--execute",
            "--group",
            &group,
            "--topic",
            &topic,
            "--to",
            "earliest",
        ])
        .env("DATABASE_URL", &db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap)
        .output()
        .expect("run the postal CLI");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    eprintln!(
        "reset: status {:?}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    if out.status.success() {
        let running = start_apply(&db.pool, &topic, config());
        let _ = try_until(Duration::from_secs(20), || {
            let pool = pool.clone();
            async move { effects(&pool).await.0 >= 20 }
        })
        .await;
        running.stop().await;
    }
    let (rows, distinct) = effects(&db.pool).await;
    assert!(
        !out.status.success(),
        "the reset past the dedup horizon was accepted without --force-past-retention; effects: {rows} rows for {distinct} events"
    );
    assert!(
        stderr.contains("dedup retention horizon"),
        "refused for the horizon: {stderr}"
    );
}

/// New in 402a26d: an idle worker fenced at its stall check returns `Fenced(lowest)` with
/// `lowest = None` (it received nothing). With no stored offset yet (a new group; the late
/// claim of a worker revoked elsewhere, as in
/// `takeover::a_worker_fenced_before_any_commit_does_not_skip_what_it_dropped`), `run` then
/// waits its backoff, DRAINS the records that arrived meanwhile, and the next ownership has
/// neither a stored offset nor a floor: no seek, the fetch goes on after the drained records,
/// which are never handled. (When fenced at a commit, `lowest` covers them: the fenced batch
/// is at or below everything drained.)
///
/// Backoff 10 s (full jitter: the wait is 0..10 s; default is 100 ms doubling to 30 s and the
/// fence count never resets) only widens the window; records arriving at any point of the
/// wait are lost.
#[tokio::test]
async fn records_arriving_while_an_idle_fenced_worker_backs_off_are_lost() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("review");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut config = consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER);
    config.stall_check = Duration::from_secs(1);
    config.backoff = postal_consumer::Backoff {
        base: Duration::from_secs(10),
        max: Duration::from_secs(10),
    };
    let running = start_apply(&db.pool, &topic, config);
    let stored = |pool: sqlx::PgPool, group: String, topic: String| async move {
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT next_offset FROM postal.consumer_offsets
             WHERE group_id = $1 AND topic = $2 AND partition = 0",
        )
        .bind(group)
        .bind(topic)
        .fetch_optional(&pool)
        .await
        .unwrap()
    };
    let pool = db.pool.clone();
    wait::until(WAIT, "the worker's claim (no stored offset yet)", || {
        let fut = stored(pool.clone(), group.clone(), topic.clone());
        async move { fut.await == Some(None) }
    })
    .await;
    // The late claim of a worker revoked elsewhere, before anything was committed.
    postal_consumer::testing::offsets::claim(&db.pool, &group, &topic, 0, "revoked-elsewhere")
        .await
        .unwrap();
    let stats = running.stats.clone();
    wait::until(WAIT, "the idle worker noticing the epoch", || {
        let s = stats.snapshot();
        async move { s.fenced >= 1 }
    })
    .await;
    // Records arrive while it backs off before taking the partition again.
    produce(&svc.bootstrap, &topic, Some(0), &records(0, 10)).await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    produce(&svc.bootstrap, &topic, Some(0), &records(10, 20)).await;
    let ok = try_until(Duration::from_secs(30), || {
        let pool = pool.clone();
        async move { effects(&pool).await.1 >= 20 }
    })
    .await;
    let s = stats.snapshot();
    let at = stored(db.pool.clone(), group.clone(), topic.clone()).await;
    running.stop().await;
    let applied = applied_in_order(&db.pool).await;
    assert!(
        ok,
        "records lost: applied {applied:?}, stored offset {at:?}, stats {s:?}"
    );
    assert_eq!(applied, (0..20).collect::<Vec<_>>());
}
