//! Adversarial review of commit 5bda228 (consumer/src/batch.rs): a throughput-mode transaction
//! that fails with no handler to blame (at COMMIT) is split in halves until the failing record
//! is alone, whose failures then count as its attempts; a session the server ends
//! mid-transaction is tried again with half the records; the limit doubles after each commit.
//! Attacks on "each event once, none lost, a key's events in order, the partition moves on"
//! through that split: a failure that outlasts the head's attempts, a culprit whose key is held,
//! copies and undecodable records on both sides of the split point, an event whose own idle gap
//! passes the DBA's timeout, and the throughput of the halving under that timeout.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postal_consumer::{
    Batch, BatchHandler, BoxFuture, Consumer, Event, FinalFailure, Handler, HandlerError,
};
use postal_integration_tests::{services, unique, wait, TestDb};
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::batch_fixtures::{dead_letter_count, job, order};
use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, RawRecord, RunningConsumer,
};

const WAIT: Duration = Duration::from_secs(90);
const CONSUMER: &str = "effects";

/// Writes `effects (event_id, n, parent)`; `parent` is a deferred foreign key (checked at
/// COMMIT only), so an event whose payload names a missing parent makes its transaction fail
/// at COMMIT with no handler to blame; an event with `"refuse": true` fails permanently in the
/// handler. Before writing, waits the payload's `sleep_ms` outside
/// the database (an enrichment call to another service: the transaction idle meanwhile).
/// As a batch handler it writes the whole batch in one statement, in the batch's order.
#[derive(Clone, Default)]
struct Writer {
    /// Handler calls so far.
    calls: Arc<AtomicU32>,
    /// Events per call, in call order.
    sizes: Arc<Mutex<Vec<usize>>>,
}

/// (id, n, parent, ms to wait before the insert, ms to wait after it).
type Fields = (Uuid, i64, i64, u64, u64);

fn fields(e: &Event<serde_json::Value>) -> Result<Fields, HandlerError> {
    if e.payload["refuse"].as_bool() == Some(true) {
        return Err(HandlerError::permanent(format!("event {} refused", e.id)));
    }
    Ok((
        e.id.as_uuid(),
        e.payload["n"].as_i64().unwrap_or(-1),
        e.payload["parent"].as_i64().unwrap_or(1),
        e.payload["sleep_ms"].as_u64().unwrap_or(0),
        e.payload["sleep_after_ms"].as_u64().unwrap_or(0),
    ))
}

async fn write(tx: &mut Transaction<'_, Postgres>, rows: &[Fields]) -> Result<(), HandlerError> {
    let sleep: u64 = rows.iter().map(|r| r.3).sum();
    if sleep > 0 {
        tokio::time::sleep(Duration::from_millis(sleep)).await;
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    let ns: Vec<i64> = rows.iter().map(|r| r.1).collect();
    let parents: Vec<i64> = rows.iter().map(|r| r.2).collect();
    sqlx::query(
        "INSERT INTO effects (event_id, n, consumer, parent)
         SELECT id, n, $4, p FROM unnest($1::uuid[], $2::bigint[], $3::bigint[])
         WITH ORDINALITY AS t(id, n, p, i) ORDER BY i",
    )
    .bind(&ids)
    .bind(&ns)
    .bind(&parents)
    .bind(CONSUMER)
    .execute(&mut **tx)
    .await?;
    let after: u64 = rows.iter().map(|r| r.4).sum();
    if after > 0 {
        // Outside the database after its last statement: the server's error reaches the
        // runtime's next statement, not the handler.
        tokio::time::sleep(Duration::from_millis(after)).await;
    }
    Ok(())
}

impl BatchHandler for Writer {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "writer"
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        events: Batch<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.sizes.lock().unwrap().push(events.len());
            let rows = events.iter().map(fields).collect::<Result<Vec<_>, _>>()?;
            write(tx, &rows).await
        })
    }
}

/// The same writer as a single-event handler (one record per transaction, or throughput mode
/// with `on`).
#[derive(Clone, Default)]
struct WriterOne(Writer);

impl Handler for WriterOne {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "writer_one"
    }

    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            self.0.calls.fetch_add(1, Ordering::SeqCst);
            self.0.sizes.lock().unwrap().push(1);
            write(tx, &[fields(&event)?]).await
        })
    }
}

/// `effects` with a deferred foreign key `parent` to `parents` (which holds 1).
async fn tables(pool: &PgPool) {
    effects_table(pool).await;
    for sql in [
        "CREATE TABLE parents (id bigint PRIMARY KEY)",
        "INSERT INTO parents VALUES (1)",
        "ALTER TABLE effects ADD COLUMN parent bigint NOT NULL DEFAULT 1
             REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

async fn dead_letters(pool: &PgPool) -> Vec<Uuid> {
    let mut dead: Vec<Uuid> =
        sqlx::query_scalar("SELECT event_id FROM postal.dead_letters WHERE event_id IS NOT NULL")
            .fetch_all(pool)
            .await
            .unwrap();
    dead.sort();
    dead
}

async fn stored_offset(pool: &PgPool, topic: &str) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets WHERE topic = $1 AND partition = 0",
    )
    .bind(topic)
    .fetch_optional(pool)
    .await
    .unwrap()
    .flatten()
}

/// Terminates every session of the test's database but `admin`'s (a failover, a DBA's
/// `pg_terminate_backend`): the pools reconnect, with the database's settings as they are now.
async fn terminate_sessions(admin: &mut PgConnection, db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = $1 AND pid <> pg_backend_pid()) t",
    )
    .bind(&db.name)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Transactions rolled back in the test's database so far (as flushed to the statistics:
/// a busy backend flushes at least once a second).
async fn rollbacks(admin: &mut PgConnection, db: &TestDb) -> i64 {
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *admin)
        .await
        .unwrap();
    sqlx::query_scalar("SELECT xact_rollback FROM pg_stat_database WHERE datname = $1")
        .bind(&db.name)
        .fetch_one(admin)
        .await
        .unwrap()
}

/// What [`read_only_run`] measured.
#[derive(Debug)]
struct ReadOnly {
    /// Transactions rolled back per second once the head's attempts were used up, while the
    /// database refused writes.
    rollbacks_per_s: f64,
    applied: u64,
    dead_letters: i64,
}

/// Guarantee attacked: a failure goes on being retried with backoff (the consumer's `backoff`,
/// here at most 200 ms) and is logged, however long it lasts, in throughput mode as one at a
/// time. 5bda228 counts a failure of the head alone (`take == 1`) as one of its attempts and
/// waits only while `head_attempts < max_attempts`; once they are used up, the next transaction
/// dead-letters (or holds) the head without its handler. But a failure that is not the
/// handler's (the database refuses every write: a failover to a standby not yet promoted, a
/// maintenance window with `default_transaction_read_only`; a revoked grant; a full disk) fails
/// that transaction too, at the dedup insert: `head_attempts` is then past `max_attempts`, so
/// the loop neither waits nor logs, and runs the transaction again at once, for as long as the
/// failure lasts.
///
/// 21 events on one partition (the first applied before the spell, so the partition is owned);
/// the database made read-only (`ALTER DATABASE … SET default_transaction_read_only`, sessions
/// terminated: they reconnect read-only); 20 events produced; once the head's attempts are
/// counted (`retries` = `max_attempts` − 1), the rollbacks of the database are counted for 3 s.
/// Then writes are allowed again: every event is finished (the head, innocent, ends as a dead
/// letter in both modes: the read-only error, 25006, is a retryable failure by the documented
/// classification).
///
/// Measured on 5bda228 (before the fix) (2 shared cores, two runs): 273 and 341 transactions
/// rolled back per second through the spell in throughput mode (`max_batch` 64), against 5 to
/// 8 per second one at a time (the control below, which also logs each failure: "cannot record the outcome;
/// retrying"); no log line in the loop (the "transaction failed; retrying" warning is logged
/// only while `head_attempts < max_attempts`: the watchdog's "consumer stalled" after 30 s is
/// the only sign; in the second run's log: the head's attempts 1 and 2, then nothing for the
/// ~1,000 transactions of the window, against 38 "cannot record the outcome" lines one at a
/// time), and `retries` stays at 2. The split's own warning on the way down also misleads:
/// "batch transaction failed with no handler to blame" for an error of the dedup insert. Nothing is lost
/// or applied twice: once writes are allowed, 20 applied and the head dead-lettered (as one at
/// a time). Cause (consumer/src/batch.rs, `process_batch`): the arm for a failure of the head
/// alone waits only `if head_attempts < max_attempts`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_out_of_attempts_in_a_read_only_spell_is_retried_with_backoff() {
    let r = read_only_run(64).await;
    assert!(
        r.rollbacks_per_s < 40.0,
        "a retry loop without backoff: {r:?}"
    );
}

/// Control for the test above: one at a time (`max_batch` 1), the head whose attempts are used
/// up is dead-lettered by `write_with_retry`, which logs and backs off while the database
/// refuses the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_read_only_spell_is_retried_with_backoff() {
    let r = read_only_run(1).await;
    assert!(
        r.rollbacks_per_s < 40.0,
        "a retry loop without backoff: {r:?}"
    );
}

async fn read_only_run(max_batch: usize) -> ReadOnly {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let mut admin = PgConnection::connect(&db.url).await.expect("admin session");
    let pool = db.pool_of(5).await;
    let topic = unique("split_read_only");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let ids: Vec<Uuid> = (0..21).map(|_| Uuid::now_v7()).collect();
    let records: Vec<RawRecord> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| job(*id, "k", json!({"n": n})))
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records[..1]).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    let writer = Writer::default();
    let builder = Consumer::builder(pool.clone(), config);
    let builder = if max_batch > 1 {
        builder.on_batch(&topic, "job", writer.clone())
    } else {
        builder.on(&topic, "job", WriterOne(writer.clone()))
    };
    let running = RunningConsumer::start(builder.build().expect("consumer"));
    let stats = running.stats.clone();
    wait::until(WAIT, "the first event applied", || {
        let s = stats.snapshot();
        async move { s.applied == 1 }
    })
    .await;

    // The spell: every session from now on is read-only.
    sqlx::query(&format!(
        "ALTER DATABASE \"{}\" SET default_transaction_read_only = on",
        db.name
    ))
    .execute(&mut admin)
    .await
    .unwrap();
    terminate_sessions(&mut admin, &db).await;
    produce(&svc.bootstrap, &topic, Some(0), &records[1..]).await;
    wait::until(WAIT, "the head's attempts counted", || {
        let s = stats.snapshot();
        async move { s.retries >= 2 }
    })
    .await;
    let before = rollbacks(&mut admin, &db).await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = rollbacks(&mut admin, &db).await;
    let rollbacks_per_s = (after - before) as f64 / started.elapsed().as_secs_f64();

    // Writes allowed again.
    sqlx::query(&format!(
        "ALTER DATABASE \"{}\" RESET default_transaction_read_only",
        db.name
    ))
    .execute(&mut admin)
    .await
    .unwrap();
    terminate_sessions(&mut admin, &db).await;
    wait::until(WAIT, "all 21 finished", || {
        let s = stats.snapshot();
        async move { s.applied + s.dead_letters >= 21 }
    })
    .await;
    running.stop().await;
    let s = stats.snapshot();
    let r = ReadOnly {
        rollbacks_per_s,
        applied: s.applied,
        dead_letters: dead_letter_count(&db.pool).await,
    };
    eprintln!(
        "max_batch {max_batch}: {r:?}, retries {}, handler calls {}",
        s.retries,
        writer.calls.load(Ordering::SeqCst)
    );
    let (rows, distinct) = effects(&db.pool).await;
    assert_eq!(rows, distinct, "no event applied twice");
    assert_eq!(rows as u64, s.applied);
    assert_eq!(r.applied as i64 + r.dead_letters, 21, "none lost");
    pool.close().await;
    r
}

/// Guarantee attacked: with `FinalFailure::HoldKey` (an ordered consumer), an event that fails
/// for good holds its key: it and every later record of its key are kept back (stored, not
/// applied), and the other keys flow, in offset order. Here the failure surfaces only at
/// COMMIT (a deferred foreign key), so the culprit is found by 5bda228's split, and its key
/// must be held from the culprit on even though the later records of that key were in the
/// batches being split. 16 events, keys `a` and `b` alternating, `a`'s 4th event (offset 6)
/// the culprit: `a`'s first three and all eight of `b` applied, in offset order; the culprit
/// and `a`'s four later events held; no dead letter. (Held on the code under review.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_culprit_of_an_ordered_consumer_holds_its_key_and_the_other_key_flows() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("split_hold");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let ids: Vec<Uuid> = (0..16).map(|_| Uuid::now_v7()).collect();
    let records: Vec<RawRecord> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let key = if n % 2 == 0 { "a" } else { "b" };
            let parent = if n == 6 { 999 } else { 1 };
            job(*id, key, json!({"n": n, "parent": parent}))
        })
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = 64;
    config.max_attempts = 3;
    config.final_failure = FinalFailure::HoldKey;
    let writer = Writer::default();
    let consumer = Consumer::builder(db.pool.clone(), config)
        .on_batch(&topic, "job", writer.clone())
        .build()
        .expect("consumer");
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    wait::until(WAIT, "the partition past all 16 records", || {
        let pool = db.pool.clone();
        let topic = topic.clone();
        async move { stored_offset(&pool, &topic).await == Some(16) }
    })
    .await;
    running.stop().await;
    let s = stats.snapshot();
    eprintln!(
        "applied {}, dead letters {}, retries {}, handler calls {} of sizes {:?}",
        s.applied,
        s.dead_letters,
        s.retries,
        writer.calls.load(Ordering::SeqCst),
        writer.sizes.lock().unwrap()
    );
    assert_eq!(
        order(&db.pool).await,
        vec![0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15],
        "a's events before the culprit and all of b, once, in offset order"
    );
    assert_eq!(effects(&db.pool).await, (11, 11));
    let held: Vec<(Vec<u8>, i64)> = sqlx::query_as(
        "SELECT record_key, kafka_offset FROM postal.held_records ORDER BY kafka_offset",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let want: Vec<(Vec<u8>, i64)> = [6, 8, 10, 12, 14]
        .iter()
        .map(|&o| (b"a".to_vec(), o))
        .collect();
    assert_eq!(held, want, "the culprit and a's later events held");
    let keys: Vec<Vec<u8>> = sqlx::query_scalar("SELECT record_key FROM postal.held_keys")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(keys, vec![b"a".to_vec()]);
    assert_eq!(dead_letter_count(&db.pool).await, 0);
}

/// Guarantee attacked: each event once, in offset order, none lost, when the split of 5bda228
/// cuts through copies and undecodable records: 40 records on one partition through a batch
/// handler, with a COMMIT-time culprit (a deferred foreign key) at offset 20; copies placed
/// after it of events before it (offset 25: a copy of offset 3; offset 33: of offset 14), of
/// the culprit itself (offset 30: it must stay a dead letter, never applied) and of an event
/// after it (offset 36: of offset 22); a payload that is not JSON at offsets 9 and 27
/// (undecodable: dead letters, found by the handler's halving inside a batch that is itself
/// being split); and a record without `ce_id` at offset 17 (no envelope: a dead letter without
/// an event id). Expected: the 32 other events applied once, in offset order; 4 dead letters
/// (the culprit, the two undecodable payloads, the record without envelope); the 4 copies
/// counted duplicates; the stored offset past the last record. (Held on the code under
/// review.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_through_copies_and_undecodable_records_keeps_each_event_once_in_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("split_mixed");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let ids: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
    let mut applied_n: Vec<i64> = Vec::new();
    let mut records: Vec<RawRecord> = Vec::new();
    let mut dead_ids: Vec<Uuid> = Vec::new();
    let copies = [(25usize, 3usize), (30, 20), (33, 14), (36, 22)];
    for (o, id) in ids.iter().enumerate() {
        if let Some((_, of)) = copies.iter().find(|(at, _)| *at == o) {
            records.push(job(ids[*of], "k", json!({"n": *of})));
        } else if o == 9 || o == 27 {
            let mut r = job(*id, "k", json!({}));
            r.payload = b"{not json".to_vec();
            records.push(r);
            dead_ids.push(*id);
        } else if o == 17 {
            let mut r = job(*id, "k", json!({"n": o}));
            r.headers.retain(|(name, _)| *name != "ce_id");
            records.push(r);
        } else if o == 20 {
            records.push(job(*id, "k", json!({"n": o, "parent": 999})));
            dead_ids.push(*id);
        } else {
            records.push(job(*id, "k", json!({"n": o})));
            applied_n.push(o as i64);
        }
    }
    dead_ids.sort();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = 64;
    config.max_attempts = 3;
    let writer = Writer::default();
    let consumer = Consumer::builder(db.pool.clone(), config)
        .on_batch(&topic, "job", writer.clone())
        .build()
        .expect("consumer");
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    wait::until(WAIT, "the partition past all 40 records", || {
        let pool = db.pool.clone();
        let topic = topic.clone();
        async move { stored_offset(&pool, &topic).await == Some(40) }
    })
    .await;
    running.stop().await;
    let s = stats.snapshot();
    eprintln!(
        "applied {}, duplicates {}, dead letters {}, retries {}, handler calls {} of sizes {:?}",
        s.applied,
        s.duplicates,
        s.dead_letters,
        s.retries,
        writer.calls.load(Ordering::SeqCst),
        writer.sizes.lock().unwrap()
    );
    assert_eq!(
        order(&db.pool).await,
        applied_n,
        "once each, in offset order"
    );
    assert_eq!(
        effects(&db.pool).await,
        (applied_n.len() as i64, applied_n.len() as i64)
    );
    assert_eq!(
        dead_letters(&db.pool).await,
        dead_ids,
        "dead letters with an id"
    );
    assert_eq!(
        dead_letter_count(&db.pool).await,
        4,
        "and the record without envelope"
    );
    assert_eq!(
        (s.applied, s.duplicates, s.dead_letters),
        (applied_n.len() as u64, 4, 4)
    );
}

/// Where a handler waits outside the database: before its insert, or after it (its last
/// statement: the runtime's next one meets the server's error).
#[derive(Clone, Copy, PartialEq)]
enum Wait {
    Before,
    After,
}

/// Runs `events` events, each waiting `sleep_of(n)` ms outside the database (`wait`), under the
/// DBA's `idle_in_transaction_session_timeout` of 1 s, with `max_batch`; returns (seconds until
/// all were applied or `limit` passed, events applied, handler calls, call sizes, the dead
/// letters' errors).
async fn idle_run(
    max_batch: usize,
    events: usize,
    sleep_of: impl Fn(usize) -> u64,
    wait: Wait,
    limit: Duration,
) -> (f64, u64, u32, Vec<usize>, Vec<String>) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    sqlx::query(&format!(
        "ALTER DATABASE \"{}\" SET idle_in_transaction_session_timeout = '1s'",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let pool = db.pool_of(5).await;
    let timeout: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(timeout, "1s", "the DBA's setting applies");
    let topic = unique("split_idle");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let records: Vec<RawRecord> = (0..events)
        .map(|n| {
            job(
                Uuid::now_v7(),
                "k",
                if wait == Wait::Before {
                    json!({"n": n, "sleep_ms": sleep_of(n)})
                } else {
                    json!({"n": n, "sleep_after_ms": sleep_of(n)})
                },
            )
        })
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    let writer = Writer::default();
    let builder = Consumer::builder(pool.clone(), config);
    let builder = if max_batch > 1 {
        builder.on_batch(&topic, "job", writer.clone())
    } else {
        builder.on(&topic, "job", WriterOne(writer.clone()))
    };
    let started = Instant::now();
    let running = RunningConsumer::start(builder.build().expect("consumer"));
    let stats = running.stats.clone();
    let _ = tokio::time::timeout(limit, async {
        loop {
            let s = stats.snapshot();
            if s.applied + s.dead_letters >= events as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    running.stop().await;
    let s = stats.snapshot();
    let (rows, distinct) = effects(&db.pool).await;
    assert_eq!(rows, distinct, "no event applied twice");
    let applied_n = order(&db.pool).await;
    assert!(
        applied_n.windows(2).all(|w| w[0] < w[1]),
        "in offset order: {applied_n:?}"
    );
    pool.close().await;
    let errors: Vec<String> =
        sqlx::query_scalar("SELECT error FROM postal.dead_letters ORDER BY kafka_offset")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let sizes = writer.sizes.lock().unwrap().clone();
    eprintln!(
        "max_batch {max_batch}: {elapsed:.1} s, applied {}, dead letters {}, retries {}, handler calls {}",
        s.applied,
        s.dead_letters,
        s.retries,
        writer.calls.load(Ordering::SeqCst)
    );
    (
        elapsed,
        s.applied,
        writer.calls.load(Ordering::SeqCst),
        sizes,
        errors,
    )
}

/// Guarantee attacked: throughput mode is there for throughput; under a DBA's
/// `idle_in_transaction_session_timeout` (1 s) and a handler that waits 40 ms per event outside
/// the database (an enrichment call), 5bda228 halves a batch the server ended until it fits (at
/// most 24 events here), then doubles the limit after each commit, so every other transaction
/// is again too large and killed, and every new poll batch starts at full size. 100 events
/// through a batch handler (`max_batch` 64): the first too-large batch and its half are paid
/// (96 events handled in vain at most: what fits is not known before), then what fitted is
/// kept (the times of both, one at a time run first in the same test, are printed).
///
/// Measured on 5bda228 (before the fix) (2 shared cores, two runs): one at a time 6.6 s and 5.3 s
/// (100 calls); batches 20.1 s and 19.0 s, 3 to 3.6 times slower, each time in 15 calls of
/// sizes [64, 64, 32, 16, 32, 32, 16, 32, 32, 16, 16, 36, 36, 18, 18]: 9 of the 15 calls (64, 64, 32, 32, 32, 32, 32, 36, 36: too large ones,
/// each waiting out its whole batch before the server's error shows) were ended by the server;
/// 360 of the 460 events handled were handled in vain.
/// Cause: the limit doubles after every commit and each poll batch starts from its full size,
/// so the halving is paid again and again; and each too-large transaction is run twice (the
/// optimistic pass fails with the handler's error, 25P03, and only the isolated rerun's
/// savepoint rollback reports the dead connection that halves the batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_halved_under_the_dbas_idle_timeout_pays_the_halving_once() {
    let (single, applied_single, ..) = idle_run(1, 100, |_| 40, Wait::Before, WAIT).await;
    assert_eq!(applied_single, 100);
    let (batched, applied, calls, sizes, _) = idle_run(64, 100, |_| 40, Wait::Before, WAIT).await;
    eprintln!(
        "one at a time {single:.1} s; batches {batched:.1} s in {calls} calls of sizes {sizes:?}"
    );
    assert_eq!(applied, 100);
    // The first batch that is too large, and its half, are paid once: what fits is then kept
    // (from one poll batch to the next) and grown slowly.
    // The events handled in vain say it; the two times (printed above) are not compared: a
    // ratio of timed runs belongs to the benchmarks (one such ratio failed a CI rehearsal on a
    // machine loaded by builds beside the tests, `batch_fit_attack::`).
    let in_vain = sizes.iter().sum::<usize>() - 100;
    assert!(
        in_vain <= 64 + 32,
        "throughput mode {batched:.1} s, one at a time {single:.1} s; {in_vain} events handled in vain ({calls} calls: {sizes:?})"
    );
}

/// Guarantee attacked: the partition moves on: an event the database cannot take is retried,
/// then dead-lettered after `max_attempts`, and the events after it are applied. 5bda228 halves
/// a batch whose session the server ended until it fits (the whole batch's idle time under the
/// DBA's `idle_in_transaction_session_timeout`, 1 s); an event whose own wait outside the
/// database (1.5 s here: an enrichment call that is slow for that one event) passes the timeout
/// never fits. 10 events, the 4th slow, `max_attempts` 3: 9 applied within 20 s, in order, and
/// the 4th dead-lettered with the reason said (the server's idle timeout).
///
/// Measured on 5bda228 (before the fix) (two runs alike): 3 of 10 applied in 20 s, no dead letter,
/// no retry counted, 15 handler calls of sizes [10, 10, 5, 2, 4, 4, 2, 1, 2, 2, 1, 1, 1, 1, 1]: the slow
/// event alone at the head, again and again, for good (one at a time: 9 applied and it
/// dead-lettered after 3 attempts). Cause (consumer/src/batch.rs): the isolated pass runs the
/// body under a savepoint; the body fails with 25P03, and the rollback of the savepoint on the
/// dead connection fails with an I/O error, which `Attempt::db` makes `Unavailable`: an outage,
/// never an attempt, and "half the records" of one record is one record. Still so at 195cde2
/// (a lost session never an attempt, since counting one by timing dead-lettered innocent events
/// on outages). Now the server's own word (SQLSTATE 25P03, on the first statement after the
/// wait) makes it the head's attempt; an outage (a restart, a terminated backend) still never
/// is (`batch_fit_attack::`, `batch_rule_attack::`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_alone_over_the_dbas_idle_timeout_does_not_stall_the_partition() {
    over_the_idle_timeout(64, Wait::Before).await;
}

/// As above, the handler waiting after its last statement (the runtime's next statement meets
/// the server's 25P03, not the handler).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_alone_idle_after_its_last_statement_does_not_stall_the_partition() {
    over_the_idle_timeout(64, Wait::After).await;
}

/// Control for the tests above, one at a time (`max_batch` 1): the same event, ended by the
/// server in each of its transactions, fails with `25P03` in its handler: after 3 attempts it
/// is dead-lettered and the 9 others are applied, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_an_event_over_the_dbas_idle_timeout_does_not_stall_the_partition() {
    over_the_idle_timeout(1, Wait::Before).await;
}

/// One at a time, the handler waiting after its last statement: the runtime's own statement
/// (the offset's) meets the server's 25P03; the same outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_an_event_idle_after_its_last_statement_does_not_stall_the_partition() {
    over_the_idle_timeout(1, Wait::After).await;
}

/// 10 events, the 4th waiting 1.5 s outside the database (`wait`), under the DBA's 1 s
/// `idle_in_transaction_session_timeout`: the 9 others applied (in order: `idle_run`), the 4th
/// dead-lettered once, saying why.
async fn over_the_idle_timeout(max_batch: usize, wait: Wait) {
    let (_, applied, calls, sizes, errors) = idle_run(
        max_batch,
        10,
        |n| if n == 3 { 1500 } else { 0 },
        wait,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        applied, 9,
        "applied {applied} of 10 in 20 s ({calls} handler calls of sizes {sizes:?})"
    );
    assert_eq!(errors.len(), 1, "one dead letter: {errors:?}");
    assert!(
        errors[0].contains("idle_in_transaction_session_timeout"),
        "the reason is said: {errors:?}"
    );
}

/// Guarantee attacked: each event once, a partition's events in offset order, none lost, when
/// the partition changes hands while 5bda228's split is under way (the culprit of a COMMIT-time
/// failure alone at the head, its attempts being counted with backoff): a second member joins
/// the group (a rebalance moves a partition to it), or the first is killed (`kill -9`: its
/// connections closed, nothing finished) or stopped and a new one takes over. 2 partitions of 30 events
/// each, a deferred-FK culprit at offset 10 of each; `max_attempts` 8 with a backoff of
/// 300 ms to 1 s, so the head's attempts last seconds. Expected: 58 events applied once each,
/// each partition's in offset order, the 2 culprits dead-lettered once each, both stored
/// offsets at 30.
async fn handover_run(handover: Handover) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("split_handover");
    create_topic(&svc.bootstrap, &topic, 2).await;
    let mut culprits = Vec::new();
    for p in 0..2i32 {
        let records: Vec<RawRecord> = (0..30)
            .map(|o| {
                let id = Uuid::now_v7();
                let parent = if o == 10 {
                    culprits.push(id);
                    999
                } else {
                    1
                };
                job(
                    id,
                    &format!("p{p}"),
                    json!({"n": i64::from(p) * 100 + o, "parent": parent}),
                )
            })
            .collect();
        produce(&svc.bootstrap, &topic, Some(p), &records).await;
    }
    culprits.sort();
    let group = unique("g");
    let config = || {
        let mut c = consumer_config(&svc.bootstrap, &group, CONSUMER);
        c.max_batch = 64;
        c.max_attempts = 8;
        c.backoff = postal_consumer::Backoff {
            base: Duration::from_millis(300),
            max: Duration::from_secs(1),
        };
        c
    };
    let start = |pool: PgPool| {
        let consumer = Consumer::builder(pool.clone(), config())
            .on_batch(&topic, "job", Writer::default())
            .build()
            .expect("consumer");
        RunningConsumer::start(consumer).owning(pool)
    };
    let first = start(db.process_pool().await);
    let stats = first.stats.clone();
    wait::until(
        WAIT,
        "a culprit alone at the head, its attempts counted",
        || {
            let s = stats.snapshot();
            async move { s.retries >= 2 }
        },
    )
    .await;
    let done = |pool: PgPool, topic: String| async move {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM postal.consumer_offsets WHERE topic = $1 AND next_offset = 30",
        )
        .bind(&topic)
        .fetch_one(&pool)
        .await
        .unwrap();
        n == 2
    };
    let second = if handover == Handover::Stop {
        let stopping = Instant::now();
        first.stop().await;
        let took = stopping.elapsed();
        eprintln!("graceful stop mid-split took {took:?}");
        assert!(took < Duration::from_secs(10), "the stop waited {took:?}");
        let second = start(db.process_pool().await);
        wait::until(WAIT, "both partitions past their 30 records", || {
            done(db.pool.clone(), topic.clone())
        })
        .await;
        second
    } else if handover == Handover::Kill {
        first.kill().await;
        let second = start(db.process_pool().await);
        wait::until(WAIT, "both partitions past their 30 records", || {
            done(db.pool.clone(), topic.clone())
        })
        .await;
        second
    } else {
        let second = start(db.process_pool().await);
        let second_stats = second.stats.clone();
        wait::until(WAIT, "both partitions past their 30 records", || {
            done(db.pool.clone(), topic.clone())
        })
        .await;
        let s = second_stats.snapshot();
        eprintln!(
            "second member: applied {}, dead letters {}, fenced {}",
            s.applied, s.dead_letters, s.fenced
        );
        first.stop().await;
        second
    };
    second.stop().await;
    let rows: Vec<i64> = order(&db.pool).await;
    eprintln!("applied in this order: {rows:?}");
    assert_eq!(effects(&db.pool).await, (58, 58), "each event once");
    for p in 0..2i64 {
        let mine: Vec<i64> = rows.iter().copied().filter(|n| n / 100 == p).collect();
        let want: Vec<i64> = (0..30).filter(|o| *o != 10).map(|o| p * 100 + o).collect();
        assert_eq!(mine, want, "partition {p}: once each, in offset order");
    }
    assert_eq!(dead_letters(&db.pool).await, culprits, "each culprit once");
    assert_eq!(dead_letter_count(&db.pool).await, 2);
}

/// How the partition changes hands in [`handover_run`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Handover {
    /// A second member joins the group.
    Join,
    /// The consumer is killed; a new one starts.
    Kill,
    /// The consumer is stopped gracefully (within 10 s: it does not wait out the split); a
    /// new one starts.
    Stop,
}

/// [`handover_run`] with a second member joining the group mid-split. (Held on the code under
/// review.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_while_a_commit_culprit_is_isolated_loses_and_repeats_nothing() {
    handover_run(Handover::Join).await;
}

/// [`handover_run`] with the consumer stopped gracefully mid-split (the stop returns within
/// 10 s) and a new one taking over. (Held on the code under review.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_stopped_while_a_commit_culprit_is_isolated_loses_and_repeats_nothing() {
    handover_run(Handover::Stop).await;
}

/// [`handover_run`] with the consumer killed mid-split and a new one taking over. (Held on the
/// code under review.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_while_a_commit_culprit_is_isolated_loses_and_repeats_nothing() {
    handover_run(Handover::Kill).await;
}

/// Guarantee attacked: as [`a_commit_culprit_of_an_ordered_consumer_holds_its_key_and_the_other_key_flows`],
/// with two culprits of two keys in one batch: key `a`'s event at offset 6 refused by the
/// handler (permanent: found by the handler's halving under savepoints, its key held inside
/// the transaction) and key `b`'s at offset 13 failing at COMMIT (found by the split, which
/// rolls back the transaction that had held `a`). 24 events, keys `a`, `b`, `c` in turn:
/// `a`'s 2 events before its culprit, `b`'s 4 and all 8 of `c` applied once, in offset order;
/// `a`'s culprit and its 5 later events, `b`'s culprit and its 3 later events held; no dead
/// letter. (Held on the code under review.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_culprit_and_a_commit_culprit_of_two_keys_in_one_batch_hold_both_keys() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("split_hold2");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let keys = ["a", "b", "c"];
    let records: Vec<RawRecord> = (0..24)
        .map(|o| {
            let payload = match o {
                6 => json!({"n": o, "refuse": true}),
                13 => json!({"n": o, "parent": 999}),
                _ => json!({"n": o}),
            };
            job(Uuid::now_v7(), keys[o % 3], payload)
        })
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = 64;
    config.max_attempts = 3;
    config.final_failure = FinalFailure::HoldKey;
    let writer = Writer::default();
    let consumer = Consumer::builder(db.pool.clone(), config)
        .on_batch(&topic, "job", writer.clone())
        .build()
        .expect("consumer");
    let running = RunningConsumer::start(consumer);
    wait::until(WAIT, "the partition past all 24 records", || {
        let pool = db.pool.clone();
        let topic = topic.clone();
        async move { stored_offset(&pool, &topic).await == Some(24) }
    })
    .await;
    running.stop().await;
    eprintln!("handler calls of sizes {:?}", writer.sizes.lock().unwrap());
    // `a` from its culprit at offset 6 on, `b` from its culprit at offset 13 on.
    let held_at = |o: i64| (o % 3 == 0 && o >= 6) || (o % 3 == 1 && o >= 13);
    let applied: Vec<i64> = (0..24i64).filter(|o| !held_at(*o)).collect();
    assert_eq!(order(&db.pool).await, applied, "once each, in offset order");
    assert_eq!(effects(&db.pool).await, (14, 14));
    let held: Vec<(Vec<u8>, i64)> = sqlx::query_as(
        "SELECT record_key, kafka_offset FROM postal.held_records ORDER BY kafka_offset",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let want: Vec<(Vec<u8>, i64)> = (0..24i64)
        .filter(|o| held_at(*o))
        .map(|o| (keys[o as usize % 3].as_bytes().to_vec(), o))
        .collect();
    assert_eq!(
        held, want,
        "both culprits and their keys' later events held"
    );
    let mut held_keys: Vec<Vec<u8>> = sqlx::query_scalar("SELECT record_key FROM postal.held_keys")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    held_keys.sort();
    assert_eq!(held_keys, vec![b"a".to_vec(), b"b".to_vec()]);
    assert_eq!(dead_letter_count(&db.pool).await, 0);
}

/// Guarantee attacked: the split costs throughput only while it isolates the culprit: after
/// the culprit is dead-lettered, the limit grows back (doubles after each commit) to the whole
/// batch, it does not stay at one record. 400 events in one poll batch (`max_batch` 400), a
/// COMMIT culprit at offset 2: after the culprit's last call alone, a handler call takes at
/// least 128 events. (Held on the code under review.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_culprit_the_limit_grows_back() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("split_grow");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let records: Vec<RawRecord> = (0..400)
        .map(|o| {
            let parent = if o == 2 { 999 } else { 1 };
            job(Uuid::now_v7(), "k", json!({"n": o, "parent": parent}))
        })
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = 400;
    config.partition_buffer = 1000;
    config.max_attempts = 3;
    let writer = Writer::default();
    let consumer = Consumer::builder(db.pool.clone(), config)
        .on_batch(&topic, "job", writer.clone())
        .build()
        .expect("consumer");
    let started = Instant::now();
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    wait::until(WAIT, "all 400 finished", || {
        let s = stats.snapshot();
        async move { s.applied + s.dead_letters >= 400 }
    })
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    running.stop().await;
    let sizes = writer.sizes.lock().unwrap().clone();
    eprintln!("400 events in {elapsed:.1} s, handler calls of sizes {sizes:?}");
    assert_eq!(effects(&db.pool).await, (399, 399));
    assert_eq!(
        order(&db.pool).await,
        (0..400).filter(|o| *o != 2).collect::<Vec<i64>>()
    );
    let last_alone = sizes
        .iter()
        .rposition(|&n| n == 1)
        .expect("the culprit alone");
    let after = sizes[last_alone + 1..].iter().copied().max().unwrap_or(0);
    assert!(
        after >= 128,
        "after the culprit: {:?}",
        &sizes[last_alone + 1..]
    );
}

/// Guarantee attacked: the split does not dead-letter an event for COMMIT failures that were
/// not its own more readily than one record per transaction does. The first 6 COMMITs that
/// carry effects fail with a serialization failure (`40001`, raised by a deferred constraint
/// trigger counting them in a sequence: a burst of conflicts with a concurrent writer), then
/// none. 64 events, `max_attempts` 3: the batch's dead letters are at most one at a time's.
///
/// Measured on the code under review: throughput mode 0 dead letters (the burst is spent on
/// the halving, 64, 64, 32, 16, 8, 4, which counts no attempt); one at a time 2 dead letters
/// (the first two events, 3 failed COMMITs each, none of them their own). (Held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_transient_commit_failures_dead_letters_no_more_than_one_at_a_time() {
    let single = transient_commit_run(1).await;
    let batched = transient_commit_run(64).await;
    eprintln!("dead letters: one at a time {single}, throughput mode {batched}");
    assert!(
        batched <= single,
        "throughput mode {batched}, one at a time {single}"
    );
}

/// Runs [`a_burst_of_transient_commit_failures_dead_letters_no_more_than_one_at_a_time`]'s
/// stream with `max_batch`; returns the dead letters.
async fn transient_commit_run(max_batch: usize) -> i64 {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    for sql in [
        "CREATE SEQUENCE commits",
        "CREATE FUNCTION burst() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF nextval('commits') <= 6 THEN
             RAISE EXCEPTION 'could not serialize access (burst)' USING ERRCODE = '40001';
           END IF;
           RETURN NULL;
         END $$",
        "CREATE CONSTRAINT TRIGGER burst AFTER INSERT ON effects
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION burst()",
    ] {
        sqlx::query(sql).execute(&db.pool).await.unwrap();
    }
    let topic = unique("split_burst");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let records: Vec<RawRecord> = (0..64)
        .map(|o| job(Uuid::now_v7(), "k", json!({"n": o})))
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    let writer = Writer::default();
    let builder = Consumer::builder(db.pool.clone(), config);
    let builder = if max_batch > 1 {
        builder.on_batch(&topic, "job", writer.clone())
    } else {
        builder.on(&topic, "job", WriterOne(writer.clone()))
    };
    let running = RunningConsumer::start(builder.build().expect("consumer"));
    let stats = running.stats.clone();
    wait::until(WAIT, "all 64 finished", || {
        let s = stats.snapshot();
        async move { s.applied + s.dead_letters >= 64 }
    })
    .await;
    running.stop().await;
    let s = stats.snapshot();
    eprintln!(
        "max_batch {max_batch}: applied {}, dead letters {}, retries {}, handler calls of sizes {:?}",
        s.applied,
        s.dead_letters,
        s.retries,
        writer.sizes.lock().unwrap()
    );
    let (rows, distinct) = effects(&db.pool).await;
    assert_eq!((rows, distinct), (s.applied as i64, s.applied as i64));
    dead_letter_count(&db.pool).await
}
