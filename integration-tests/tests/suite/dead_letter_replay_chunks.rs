//! Attacks on `postal dead-letters replay` reading its dead letters a chunk at a time, on dead
//! letters keeping which headers had no value, and on `postal cleanup` counting each batch in
//! the batch's own transaction: what a replay sends (once each, in order per key), what a
//! replay killed between chunks leaves, and the cleanup's count through a transaction pooler.

use std::time::{Duration, Instant};

use postal_integration_tests::pgbouncer::{self, PgBouncer, PoolMode};
use postal_integration_tests::{kafka, services, unique};
use uuid::Uuid;

use crate::common::create_topic;
use crate::dead_letters::create_topic_with;

const WAIT: Duration = Duration::from_secs(60);

/// Records `n` dead letters of consumer `billing` from `topic`, all of record key `key`, each
/// with an event id (also as its `ce_id` header), its dedup row (as the consumer writes them
/// together) and a value of `value` random bytes; returns (dead letter id, event id), in the
/// order they were dead-lettered.
async fn dead_letters_of_key(
    pool: &sqlx::PgPool,
    topic: &str,
    key: &str,
    n: usize,
    value: usize,
) -> Vec<(i64, Uuid)> {
    use rand::RngCore;
    let mut out = Vec::new();
    for i in 0..n {
        let mut payload = vec![0u8; value];
        rand::rng().fill_bytes(&mut payload);
        let event = Uuid::now_v7();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                 kafka_offset, event_id, record_key, payload, header_names, header_values,
                 reason, error, attempts, dlq_topic)
             VALUES ('billing', 'billing', $1, 0, $2, $3, $4, $5, ARRAY['ce_id', 'ce_type'],
                     ARRAY[convert_to($3::text, 'UTF8'), convert_to('job', 'UTF8')],
                     'permanent', 'declined', 1, $1 || '.dlq')
             RETURNING id",
        )
        .bind(topic)
        .bind(i as i64)
        .bind(event)
        .bind(key.as_bytes())
        .bind(payload)
        .fetch_one(pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
             SELECT consumer_name, event_id, created_at FROM postal.dead_letters WHERE id = $1",
        )
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
        out.push((id, event));
    }
    out
}

/// The producer `postal dead-letters replay` makes (the relay's settings, none given).
fn replay_producer(bootstrap: &str) -> rdkafka::producer::FutureProducer {
    postal_shared::kafka_producer::replay_config(bootstrap, &std::collections::BTreeMap::new())
        .expect("producer settings")
        .create()
        .expect("producer")
}

/// Guarantee (docs/consumer.md: replay sends a dead letter's record back to its topic, "a
/// record the broker refuses for its size with others ... is sent again alone"; the brief:
/// a replay of several dead letters of one key keeps their order): five dead letters of one
/// key, each 400,000 random bytes, to a topic whose `max.message.bytes` is 600,000 (each fits
/// alone, two together do not) are all replayed, and arrive in the order they were
/// dead-lettered.
///
/// Checks the event ids on the topic, in offset order, against the dead letters' order; fails
/// if any is missing, doubled or out of place.
///
/// Broken (fails on r46-s6 at 9a0483f, 3 runs of 3): the topic got the five in the order
/// [4, 0, 1, 2, 3] (dead-letter positions). The chunk's records are sent together; librdkafka
/// packs them two to a record batch (batch.size 1,000,000): batches [0, 1] and [2, 3] are
/// refused by the broker for their size (MESSAGE_TOO_LARGE), batch [4] is written. The
/// replay then sends each refused record again alone, after the written one
/// (`admin/src/dead_letters.rs` `replay`: `refused_for_itself` re-sends once `join_all`
/// returned). The last dead letter of the key is applied first, the other four after it.
#[tokio::test]
async fn dead_letters_of_one_key_refused_together_are_replayed_in_their_order() {
    const N: usize = 5;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-order");
    create_topic_with(&svc.bootstrap, &topic, &[("max.message.bytes", "600000")]).await;
    let letters = dead_letters_of_key(&db.pool, &topic, "one-key", N, 400_000).await;
    let ids: Vec<i64> = letters.iter().map(|(id, _)| *id).collect();
    let producer = replay_producer(&svc.bootstrap);
    let replayed = postal_admin::dead_letters::replay(
        &db.pool,
        &producer,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "ids": ids }),
        &ids,
        |_| {},
    )
    .await
    .expect("replayed");
    assert_eq!(replayed, N as u64);
    let records = kafka::read_all(&svc.bootstrap, &topic, N, WAIT).await;
    let sent: Vec<String> = records
        .iter()
        .map(|r| r.header("ce_id").unwrap_or("-").to_owned())
        .collect();
    let expected: Vec<String> = letters.iter().map(|(_, e)| e.to_string()).collect();
    let position = |e: &String| expected.iter().position(|x| x == e);
    eprintln!(
        "replayed order (dead-letter positions): {:?}",
        sent.iter().map(position).collect::<Vec<_>>()
    );
    assert_eq!(sent, expected, "each once, in the order dead-lettered");
}

/// `postal dead-letters replay --all` on `url`, to `bootstrap`.
fn replay_command(url: &str, bootstrap: &str) -> std::process::Command {
    let mut c = std::process::Command::new(crate::procs::bin_dir().join("postal"));
    c.args(["dead-letters", "replay", "--all"])
        .env("DATABASE_URL", url)
        .env("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
        .env("POSTAL_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    c
}

/// Guarantee: a `postal dead-letters replay --all` killed (SIGKILL) between two chunks (600
/// small dead letters: a chunk of 500, then one of 100) leaves the first chunk replayed and
/// counted in its audit row (matched 600, affected 500), the second chunk open with its
/// dedup rows and unsent; run again, it replays the 100 others (matched 100, affected 100):
/// each event is on the topic exactly once and no dedup row of a replayed one is left.
///
/// The kill lands between chunks without a sleep: a transaction holds the second chunk's
/// first dead letter locked, so the second chunk's claim waits on it (seen in
/// `pg_stat_activity`); the process is killed there. Fails if a record is missing or sent
/// twice, or a count is off.
#[tokio::test]
async fn a_replay_killed_between_chunks_and_run_again_sends_each_once_and_counts_it() {
    const N: usize = 600;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-killed");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let letters = dead_letters_of_key(&db.pool, &topic, "k", N, 100).await;
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM postal.dead_letters WHERE id = $1 FOR UPDATE")
        .bind(letters[500].0)
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut child = postal_integration_tests::KillOnDrop(
        replay_command(&db.url, &svc.bootstrap).spawn().unwrap(),
    );
    let deadline = Instant::now() + WAIT;
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE 'UPDATE postal.dead_letters SET replayed_at = now()%'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the second chunk never waited");
        assert!(child.0.try_wait().unwrap().is_none(), "the replay ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    holder.rollback().await.unwrap();
    let first: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT matched, affected FROM postal.operator_audit WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(first, vec![(Some(600), 500)], "the first run's audit row");
    let out = replay_command(&db.url, &svc.bootstrap).output().unwrap();
    assert!(
        out.status.success(),
        "the second run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let audit: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT matched, affected FROM postal.operator_audit WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(audit, vec![(Some(600), 500), (Some(100), 100)]);
    let records = kafka::read_all(&svc.bootstrap, &topic, N, WAIT).await;
    let sent: Vec<String> = records
        .iter()
        .map(|r| r.header("ce_id").unwrap_or("-").to_owned())
        .collect();
    let expected: Vec<String> = letters.iter().map(|(_, e)| e.to_string()).collect();
    assert_eq!(sent.len(), N, "each once");
    assert_eq!(sent, expected, "each once, in order");
    let (open, dedup): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM postal.dead_letters WHERE replayed_at IS NULL),
                (SELECT count(*) FROM postal.processed_events)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((open, dedup), (0, 0), "all replayed, no dedup row left");
}

/// Guarantee (poolers.rs: the cleanup job works through transaction pooling, "dedup and
/// dead-letter retention share its code"; docs/operations.md: "No session state leaks.
/// Retention cleanup (published rows, dedup rows, dead letters)"; the cleanup audit fix: each
/// batch adds its count to the audit row in its own transaction): the three recorded
/// retention jobs `postal cleanup` runs (published outbox rows, one consumer's dedup rows,
/// published dead letters), called as a library through a PgBouncer in transaction mode (one
/// client connection, 2 server connections that another client keeps switching), 10 rounds
/// each deleting 6 outbox rows, 5 dedup rows and 4 dead letters older than an hour (batches of
/// 4) and keeping one young row of each, every job succeeds and the audit rows opened for them
/// add up to 60, 50 and 40. (The `postal cleanup` command itself refuses a transaction pooler
/// at start, by design: docs/operations.md#poolers.)
///
/// Fails if a job returns an error, deletes a young row, or a count is off.
///
/// Broken (3 runs of 3; not by the per-batch recording, which counted every deleted row in
/// every run, nor new in a3e58e3): `cleanup_processed_recorded` failed with `prepared statement
/// "sqlx_s_1" does not exist` (first in round 0, 1 and 1; one run deleted 25 of the 50 old dedup
/// rows, recorded 25). Its first statement, the `postal.dedup_horizon` upsert
/// (`consumer/src/retention.rs`, from 09afa9b), runs as a named, cached sqlx statement outside
/// the batch's transaction, which the pooler hands to another server session; the outbox and
/// dead-letter jobs (only `persistent(false)` statements) never failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recorded_cleanups_work_through_a_transaction_pooler() {
    const ROUNDS: i64 = 10;
    let Some(bin) = pgbouncer::binary("dead_letter_replay_chunks::cleanup_through_pooler") else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Transaction, 2, &[]);
    let through: sqlx::PgPool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(20))
        .connect(&bouncer.url(&db.name))
        .await
        .expect("connect through pgbouncer");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hammer = {
        let (url, stop) = (bouncer.url(&db.name), stop.clone());
        tokio::spawn(async move {
            use sqlx::Connection as _;
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                sqlx::Executor::execute(&mut conn, "BEGIN; SELECT pg_sleep(0.002); COMMIT")
                    .await
                    .unwrap();
            }
        })
    };
    let by = postal_admin::audit::Operator::cli("test");
    let open = |table: &'static str| {
        let (pool, by) = (db.pool.clone(), by.clone());
        async move {
            postal_admin::audit::open_uncounted(
                &pool,
                &by,
                "cleanup",
                &serde_json::json!({ "table": table }),
            )
            .await
            .unwrap()
            .id()
        }
    };
    let hour = Duration::from_secs(3600);
    let mut failed: Option<(i64, &str, String)> = None;
    let mut done = [0u64; 3];
    for round in 0..ROUNDS {
        sqlx::query(
            "WITH e AS (SELECT postal.enqueue('t', 'k' || g, 'e', '{}'::jsonb) FROM generate_series(1, 7) g)
             SELECT count(*) FROM e",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query(
            "UPDATE postal.outbox SET status = 'published',
                    published_at = CASE WHEN seq = (SELECT max(seq) FROM postal.outbox) THEN now()
                                        ELSE now() - interval '3 hours' END
             WHERE status <> 'published'",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
             SELECT 'c', gen_random_uuid(),
                    CASE WHEN g <= 5 THEN now() - interval '2 hours' ELSE now() END
             FROM generate_series(1, 6) g",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                 kafka_offset, record_key, payload, header_names, header_values,
                 reason, error, attempts, dlq_topic, created_at, published_at)
             SELECT 'c', 'c', 't', 0, g, NULL, NULL, '{}', '{}', 'permanent', 'x', 1, 't.dlq',
                    CASE WHEN g <= 4 THEN now() - interval '2 hours' ELSE now() END, now()
             FROM generate_series(1, 5) g",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let results = [
            postal_producer::retention::cleanup_published_recorded(
                &through,
                hour,
                4,
                Some(open("outbox").await),
                |_| {},
            )
            .await,
            postal_consumer::retention::cleanup_processed_recorded(
                &through,
                "c",
                hour,
                4,
                Some(open("processed_events").await),
            )
            .await,
            postal_consumer::retention::cleanup_dead_letters_recorded(
                &through,
                hour,
                4,
                Some(open("dead_letters").await),
            )
            .await,
        ];
        for (i, (r, job)) in results
            .into_iter()
            .zip(["outbox", "processed_events", "dead_letters"])
            .enumerate()
        {
            match r {
                Ok(n) => done[i] += n.unwrap_or(0),
                Err(e) => {
                    failed.get_or_insert((round, job, e.to_string()));
                }
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    hammer.await.unwrap();
    let left: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM postal.outbox), (SELECT count(*) FROM postal.processed_events),
                (SELECT count(*) FROM postal.dead_letters)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let recorded: Vec<(String, i64)> = sqlx::query_as(
        "SELECT target->>'table', sum(affected)::int8 FROM postal.operator_audit
         WHERE action = 'cleanup' GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!(
        "through the pooler: first error {failed:?}; deleted {done:?}; rows left {left:?}; recorded {recorded:?}"
    );
    assert_eq!(failed, None, "every job succeeded through the pooler");
    assert_eq!(done, [60, 50, 40], "deleted (outbox, dedup, dead letters)");
    assert_eq!(left, (10, 10, 10), "the young rows kept");
    assert_eq!(
        recorded,
        vec![
            ("dead_letters".to_owned(), 40),
            ("outbox".to_owned(), 60),
            ("processed_events".to_owned(), 50)
        ],
        "the audit counts"
    );
}

/// Guarantee (docs/consumer.md: every dead letter keeps a header without a value as one, and
/// its `.dlq` copy and a replay send it so; a copy too large leaves out its value first): a
/// record with fewer headers than `max_headers` (not packed) whose first and last headers have
/// no value, with one name three times (absent, empty, absent), and a value of 1,040,000
/// bytes its handler cannot decode is dead-lettered; its `.dlq` copy is cut (`postal_dlq_cut:
/// value`, over the dead-letter producer's 1,000,000 bytes) and still carries exactly the
/// record's headers first, absent values absent; the replay sends the record back with exactly
/// its headers. Fails if any header is moved, lost, or given a value.
#[tokio::test]
async fn absent_values_at_the_ends_survive_a_cut_dlq_copy_and_a_replay() {
    use crate::common::{consumer_config, start_apply};
    use crate::dead_letter_headers::{headers_at, produce_with, WireHeaders};
    let svc = services().await;
    let db = svc.fresh_db().await;
    crate::common::effects_table(&db.pool).await;
    let topic = unique("dl-absent-ends");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let id = Uuid::now_v7().to_string();
    let sent: WireHeaders = vec![
        ("x-first".into(), None),
        ("ce_id".into(), Some(id.as_bytes().to_vec())),
        ("ce_type".into(), Some(b"job".to_vec())),
        ("content-type".into(), Some(b"application/json".to_vec())),
        ("dup".into(), None),
        ("dup".into(), Some(Vec::new())),
        ("dup".into(), None),
        ("x-empty".into(), Some(Vec::new())),
        ("x-last".into(), None),
    ];
    produce_with(&svc.bootstrap, &topic, b"k", &vec![b'x'; 1_040_000], &sent).await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), crate::handlers::CONSUMER),
    );
    postal_integration_tests::wait::until(WAIT, "the dead letter published to .dlq", || {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT published_at IS NOT NULL FROM postal.dead_letters",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(false)
        }
    })
    .await;
    running.stop().await;
    let (dl, dlq_topic, absent): (i64, String, Vec<i32>) =
        sqlx::query_as("SELECT id, dlq_topic, header_absent FROM postal.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(absent, vec![1, 5, 7, 9], "positions from 1");
    let copy = headers_at(&svc.bootstrap, &dlq_topic, 0).await;
    let cut = copy
        .iter()
        .find(|(n, _)| n == "postal_dlq_cut")
        .and_then(|(_, v)| v.clone());
    assert_eq!(
        cut.as_deref(),
        Some(&b"value"[..]),
        "the copy is cut: {copy:?}"
    );
    assert_eq!(copy[..sent.len()], sent[..], "the cut .dlq copy's headers");
    let producer = replay_producer(&svc.bootstrap);
    let replayed = postal_admin::dead_letters::replay(
        &db.pool,
        &producer,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "ids": [dl] }),
        &[dl],
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(replayed, 1);
    let back = headers_at(&svc.bootstrap, &topic, 1).await;
    assert_eq!(back, sent, "the replayed record's headers");
}

/// Guarantee (admin/src/dead_letters.rs `replay`: "If this process dies before the commit,
/// nothing of it happened: the dead letters stand with their rows (a record that went out
/// meanwhile is a duplicate) and the replay can be run again"; docs/consumer.md: the event
/// goes through the handler once): 20 dead letters of consumer `effects` (one key, `job`
/// events `{"n": i}`, each with its dedup row). `postal dead-letters replay --all` is killed
/// (SIGKILL) after the broker acknowledged all 20 sends of its chunk, before the chunk's
/// transaction commits (held at the audit row's update by a trigger waiting on an advisory
/// lock the test holds). The consumer then reads the 20 records and applies none (each a
/// duplicate of its dead letter's dedup row); the replay run again sends them again and the
/// consumer applies each exactly once, in order; the audit rows say matched 20 / affected 0,
/// then 20 / 20.
///
/// Fails if an event is applied twice or not at all, out of order, or a count is off.
#[tokio::test]
async fn a_replay_killed_after_its_sends_before_its_commit_applies_each_event_once() {
    use crate::common::{consumer_config, effects_table, start_apply};
    const N: i64 = 20;
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("replay-killed-sent");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut events = Vec::new();
    for n in 0..N {
        let event = Uuid::now_v7();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                 kafka_offset, event_id, record_key, payload, header_names, header_values,
                 reason, error, attempts, dlq_topic)
             VALUES ($1, 'g', $2, 0, $3, $4, 'k', convert_to($5, 'UTF8'),
                     ARRAY['ce_id', 'ce_type', 'content-type'],
                     ARRAY[convert_to($4::text, 'UTF8'), convert_to('job', 'UTF8'),
                           convert_to('application/json', 'UTF8')],
                     'permanent', 'declined', 1, $2 || '.dlq')
             RETURNING id",
        )
        .bind(crate::handlers::CONSUMER)
        .bind(&topic)
        .bind(n)
        .bind(event)
        .bind(format!(r#"{{"n": {n}}}"#))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
             SELECT consumer_name, event_id, created_at FROM postal.dead_letters WHERE id = $1",
        )
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
        events.push(event);
    }
    sqlx::raw_sql(
        "CREATE FUNCTION public.hold_audit() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_advisory_xact_lock(464646); RETURN NEW; END $$;
         CREATE TRIGGER hold_audit BEFORE UPDATE ON postal.operator_audit
           FOR EACH ROW EXECUTE FUNCTION public.hold_audit();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(464646)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let mut child = postal_integration_tests::KillOnDrop(
        replay_command(&db.url, &svc.bootstrap).spawn().unwrap(),
    );
    let deadline = Instant::now() + WAIT;
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event = 'advisory'
               AND query LIKE '%UPDATE postal.operator_audit%'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the chunk never reached its audit update"
        );
        assert!(child.0.try_wait().unwrap().is_none(), "the replay ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    sqlx::query("SELECT pg_advisory_unlock(464646)")
        .execute(&mut *holder)
        .await
        .unwrap();
    drop(holder);
    // The killed process's session ends (its transaction rolled back) once it finds its
    // client gone: wait until the dead letters are open again, readable without a lock.
    let sent = kafka::read_all(&svc.bootstrap, &topic, N as usize, WAIT).await;
    assert_eq!(
        sent.len(),
        N as usize,
        "the chunk's sends went out before the kill"
    );
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), crate::handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    postal_integration_tests::wait::until(WAIT, "the 20 sent records handled", || {
        let s = stats.snapshot();
        async move { s.duplicates + s.applied + s.dead_letters >= N as u64 }
    })
    .await;
    let after_kill = (stats.snapshot().applied, stats.snapshot().duplicates);
    let open: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters WHERE replayed_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let out = replay_command(&db.url, &svc.bootstrap).output().unwrap();
    assert!(
        out.status.success(),
        "the second run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    postal_integration_tests::wait::until(WAIT, "the 40 records handled", || {
        let s = stats.snapshot();
        async move { s.duplicates + s.applied + s.dead_letters >= 2 * N as u64 }
    })
    .await;
    running.stop().await;
    let applied: Vec<(Uuid, i64)> = sqlx::query_as("SELECT event_id, n FROM effects ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let audit: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT matched, affected FROM postal.operator_audit WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let s = stats.snapshot();
    eprintln!(
        "after the kill: (applied, duplicates) {after_kill:?}, open {open}; at the end: applied {}, duplicates {}, dead letters {}; effects {}; audit {audit:?}",
        s.applied,
        s.duplicates,
        s.dead_letters,
        applied.len()
    );
    assert_eq!(
        (after_kill, open),
        ((0, N as u64), N),
        "nothing applied after the kill"
    );
    let expected: Vec<(Uuid, i64)> = events.iter().copied().zip(0..N).collect();
    assert_eq!(applied, expected, "each applied once, in order");
    assert_eq!(audit, vec![(Some(N), 0), (Some(N), N)]);
}

/// Guarantee (admin/src/dead_letters.rs `replay`: a chunk's transaction "claims the chunk (a
/// replay running at the same time waits for it, then takes none of these)"): 700 open dead
/// letters of one key (values of 1 to 20,000 random bytes: chunks of about 4 MiB, a few hundred
/// each). Replay A (all 700) is held after its first chunk's sends, before its commit (a
/// trigger on the audit row's update waits on an advisory lock the test holds); then replay B
/// (the 650 from the 51st on: its chunks start where A's do not) and a resolve of the 101st to
/// 150th start and are seen waiting on A's claimed rows; then A is let go. (B sends none: the
/// key's first 50, older and open when it started, are not in it; fe7f883.) Each dead letter
/// ends replayed or resolved, never both; each replayed one is on the topic exactly once, in
/// the order of the dead letters; the replays' audit counts add up to the records sent, the
/// resolve's to the ones resolved; the dedup rows of resolved ones stay, of replayed ones go.
///
/// Fails if a record is sent twice or never, out of order, or a count is off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_chunked_replays_and_a_resolve_at_once_send_each_once_in_order() {
    use rand::Rng;
    const N: usize = 700;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-racing");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut letters = Vec::new();
    for _ in 0..N {
        let size = rand::rng().random_range(1..=20_000);
        letters.extend(dead_letters_of_key(&db.pool, &topic, "one-key", 1, size).await);
    }
    let ids: Vec<i64> = letters.iter().map(|(id, _)| *id).collect();
    sqlx::raw_sql(
        "CREATE FUNCTION public.hold_audit() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_advisory_xact_lock(464647); RETURN NEW; END $$;
         CREATE TRIGGER hold_audit BEFORE UPDATE ON postal.operator_audit
           FOR EACH ROW EXECUTE FUNCTION public.hold_audit();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(464647)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let by = postal_admin::audit::Operator::cli("test");
    let replay = |ids: Vec<i64>| {
        let (pool, by, p) = (db.pool.clone(), by.clone(), replay_producer(&svc.bootstrap));
        tokio::spawn(async move {
            postal_admin::dead_letters::replay(
                &pool,
                &p,
                &by,
                &serde_json::json!({ "ids": ids }),
                &ids,
                |_| {},
            )
            .await
        })
    };
    let waiting = |what: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(&format!(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock' AND {what}"
            ))
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let a = replay(ids.clone());
    postal_integration_tests::wait::until(WAIT, "replay A held after its first sends", || {
        let w = waiting("wait_event = 'advisory'");
        async move { w.await >= 1 }
    })
    .await;
    let b = replay(ids[50..].to_vec());
    let resolving: Vec<i64> = ids[100..150].to_vec();
    let resolve = {
        let (pool, by) = (db.pool.clone(), by.clone());
        tokio::spawn(async move {
            postal_admin::dead_letters::resolve(
                &pool,
                &by,
                &serde_json::json!({ "ids": resolving }),
                &resolving,
            )
            .await
            .expect("resolved")
        })
    };
    // B, refused before it claims anything (see above), does not wait.
    postal_integration_tests::wait::until(WAIT, "the resolve waiting on A", || {
        let w = waiting("wait_event <> 'advisory'");
        async move { w.await >= 1 }
    })
    .await;
    sqlx::query("SELECT pg_advisory_unlock(464647)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let a = a.await.unwrap().expect("replay A");
    // B selected the key's dead letters from the 51st on while the first 50 were still open
    // (A's claim had not committed): it sends none of them ahead of those, and says so.
    let b = match b.await.unwrap() {
        Ok(n) => n,
        Err(e) if e.to_string().contains("older and still open") => 0,
        Err(e) => panic!("replay B: {e}"),
    };
    let resolved = resolve.await.unwrap();
    let (replayed_rows, resolved_rows, both): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE replayed_at IS NOT NULL),
                count(*) FILTER (WHERE resolved_at IS NOT NULL),
                count(*) FILTER (WHERE replayed_at IS NOT NULL AND resolved_at IS NOT NULL)
         FROM postal.dead_letters",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let records = kafka::read_all(&svc.bootstrap, &topic, replayed_rows as usize, WAIT).await;
    let sent: Vec<String> = records
        .iter()
        .map(|r| r.header("ce_id").unwrap_or("-").to_owned())
        .collect();
    let replayed_events: Vec<String> = sqlx::query_scalar(
        "SELECT event_id::text FROM postal.dead_letters WHERE replayed_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let dedup_left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let audit: Vec<(String, i64)> =
        sqlx::query_as("SELECT action, affected FROM postal.operator_audit ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    eprintln!(
        "replays returned A {a} and B {b}, resolve {resolved}; rows replayed {replayed_rows}, resolved {resolved_rows}, both {both}; records {}; dedup rows left {dedup_left}; audit {audit:?}",
        sent.len()
    );
    assert_eq!(both, 0, "never both");
    assert_eq!(replayed_rows + resolved_rows, N as i64, "each settled");
    assert_eq!((a + b) as i64, replayed_rows, "the replays' counts");
    assert_eq!(resolved as i64, resolved_rows, "the resolve's count");
    assert_eq!(
        sent, replayed_events,
        "each replayed one sent once, in order"
    );
    assert_eq!(
        dedup_left, resolved_rows,
        "dedup rows kept for resolved ones only"
    );
    let sum = |action: &str| -> i64 {
        audit
            .iter()
            .filter(|(a, _)| a == action)
            .map(|(_, n)| n)
            .sum()
    };
    assert_eq!(
        (sum("replay"), sum("resolve")),
        (replayed_rows, resolved_rows),
        "audit"
    );
}

/// Guarantee (the cleanup audit fix: each batch adds its count to the audit row in the
/// batch's own transaction, so the row says how many rows committed batches deleted): a batch
/// whose `COMMIT` itself fails (a deferred constraint trigger raising on the 25th of 25 old
/// published outbox rows, in the third batch of 10) rolls its count back with its deletes:
/// `postal cleanup --published-retention 1h --batch 10` fails, 20 rows are gone and its audit
/// row says 20 (not 25, not 0).
///
/// Fails if the count of the rolled-back batch stays, or a committed batch's is lost.
#[tokio::test]
async fn a_cleanup_batch_whose_commit_fails_takes_its_count_back_with_it() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    for i in 0..25 {
        sqlx::query("SELECT postal.enqueue('t', $1, 'e', '{}'::jsonb)")
            .bind(format!("k{i}"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    sqlx::query(
        "UPDATE postal.outbox SET status = 'published',
                published_at = now() - interval '3 hours' + seq * interval '1 second'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::raw_sql(
        "CREATE FUNCTION public.refuse_last() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN
                IF OLD.seq = (SELECT max(seq) FROM postal.outbox_seq_max) THEN
                  RAISE EXCEPTION 'refused at commit';
                END IF;
                RETURN NULL;
              END $$;
         CREATE TABLE postal.outbox_seq_max AS SELECT max(seq) AS seq FROM postal.outbox;
         CREATE CONSTRAINT TRIGGER refuse_last AFTER DELETE ON postal.outbox
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.refuse_last();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = std::process::Command::new(crate::procs::bin_dir().join("postal"))
        .args(["cleanup", "--published-retention", "1h", "--batch", "10"])
        .env("DATABASE_URL", &db.url)
        .env("POSTAL_LOG", "warn")
        .output()
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let recorded: Vec<i64> = sqlx::query_scalar(
        "SELECT affected FROM postal.operator_audit WHERE action = 'cleanup' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!(
        "cleanup: success {}, stderr {:?}; deleted {}, recorded {recorded:?}",
        out.status.success(),
        String::from_utf8_lossy(&out.stderr),
        25 - left
    );
    assert!(!out.status.success(), "the third batch's commit fails");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refused at commit"),
        "the commit's error is the one reported"
    );
    assert_eq!((25 - left, recorded), (20, vec![20]));
}
