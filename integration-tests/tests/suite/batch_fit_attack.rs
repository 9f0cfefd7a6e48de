//! Adversarial review of da943dc (consumer/src/batch.rs, issue 49): three new mechanisms of the
//! throughput mode's split. (1) `database_answers()`: a transaction of the head alone that
//! fails as "unavailable" counts as one of the head's attempts when a new session's `SELECT 1`
//! succeeds. (2) `fit`: after the server ends a multi-record transaction's session, the worker
//! keeps half of its size as what fits, grown by 1/16 per commit. (3) `abandon()`: a body
//! failure of the optimistic pass whose ROLLBACK finds the session gone becomes an
//! `Unavailable` attempt. Attacks on "an outage never counts as an attempt", "each event once,
//! none lost, a key's events in order, the partition moves on" and on the throughput after an
//! outage.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postal_consumer::{Batch, BatchHandler, BoxFuture, Consumer, Event, Handler, HandlerError};
use postal_integration_tests::private::PrivatePostgres;
use postal_integration_tests::{create_db, services, unique, wait, TestDb};
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use crate::batch_fixtures::{dead_letter_count, job, order};
use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, RawRecord, RunningConsumer,
};

const WAIT: Duration = Duration::from_secs(90);
const CONSUMER: &str = "effects";

/// A request to the test's killer task: end every session of the test's database, then answer.
type Kill = oneshot::Sender<()>;

/// Writes `effects (event_id, n)` for its events, in order. While `kills` is positive (and, with
/// `only_batches`, only for a call of more than one event), a call first asks the test's killer
/// to end every session of the database (a PostgreSQL restart, a pooler restart, a failover,
/// a DBA's `pg_terminate_backend`) and waits until it is done: the write then finds its session
/// gone. An event whose payload has `"suicide": true` ends its own session
/// (`pg_terminate_backend(pg_backend_pid())`: a handler that breaks its connection).
#[derive(Clone)]
struct Writer {
    kills: Arc<AtomicU32>,
    only_batches: Arc<AtomicBool>,
    killer: mpsc::UnboundedSender<Kill>,
    /// Each call first waits this long outside the database (a batched call to another
    /// service: one round trip per call, whatever its size).
    call_ms: Arc<AtomicU64>,
    /// Events per call, in call order.
    sizes: Arc<Mutex<Vec<usize>>>,
}

impl Writer {
    async fn run(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        events: Vec<(Uuid, i64, bool)>,
    ) -> Result<(), HandlerError> {
        self.sizes.lock().unwrap().push(events.len());
        let call_ms = self.call_ms.load(Ordering::SeqCst);
        if call_ms > 0 {
            tokio::time::sleep(Duration::from_millis(call_ms)).await;
        }
        let kill = (!self.only_batches.load(Ordering::SeqCst) || events.len() > 1)
            && self
                .kills
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |k| k.checked_sub(1))
                .is_ok();
        if kill {
            let (done, answered) = oneshot::channel();
            self.killer.send(done).expect("killer task");
            let _ = answered.await;
        }
        for (_, _, suicide) in &events {
            if *suicide {
                sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                    .execute(&mut **tx)
                    .await?;
            }
        }
        let ids: Vec<Uuid> = events.iter().map(|e| e.0).collect();
        let ns: Vec<i64> = events.iter().map(|e| e.1).collect();
        sqlx::query(
            "INSERT INTO effects (event_id, n, consumer)
             SELECT id, n, $3 FROM unnest($1::uuid[], $2::bigint[]) WITH ORDINALITY AS t(id, n, i)
             ORDER BY i",
        )
        .bind(&ids)
        .bind(&ns)
        .bind(CONSUMER)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

fn fields(e: &Event<serde_json::Value>) -> (Uuid, i64, bool) {
    (
        e.id.as_uuid(),
        e.payload["n"].as_i64().unwrap_or(-1),
        e.payload["suicide"].as_bool() == Some(true),
    )
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
        Box::pin(async move { self.run(tx, events.iter().map(fields).collect()).await })
    }
}

/// The same writer as a single-event handler (one record per transaction with `max_batch` 1).
#[derive(Clone)]
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
        Box::pin(async move { self.0.run(tx, vec![fields(&event)]).await })
    }
}

/// The test's database, topic, a writer and its killer task (which ends every session of the
/// database each time the writer asks, through an admin session of its own).
struct Rig {
    db: TestDb,
    topic: String,
    writer: Writer,
    /// Sessions ended: one entry per kill.
    killed: Arc<Mutex<Vec<i64>>>,
}

/// How the killer task ends the consumer's sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// `pg_terminate_backend` of every session of the test's database but its own (on the
    /// shared server).
    Terminate,
    /// The test's own PostgreSQL server crashes and is started again (waits until it accepts
    /// connections).
    Restart,
}

async fn rig(prefix: &str) -> Rig {
    rig_with(prefix, Fault::Terminate).await
}

async fn rig_with(prefix: &str, fault: Fault) -> Rig {
    let svc = services().await;
    let (db, mut pg) = match fault {
        Fault::Terminate => (svc.fresh_db().await, None),
        Fault::Restart => {
            let pg = PrivatePostgres::start().await;
            let db = create_db(&pg.url()).await;
            postal_shared::migrate(&db.pool).await.expect("migrate");
            (db, Some(pg))
        }
    };
    effects_table(&db.pool).await;
    let topic = unique(prefix);
    create_topic(&svc.bootstrap, &topic, 1).await;
    let (killer, mut requests) = mpsc::unbounded_channel::<Kill>();
    let killed = Arc::new(Mutex::new(Vec::new()));
    let mut admin = PgConnection::connect(&db.url).await.expect("admin session");
    let name = db.name.clone();
    let log = killed.clone();
    tokio::spawn(async move {
        while let Some(done) = requests.recv().await {
            let n: i64 = match pg.as_mut() {
                None => sqlx::query_scalar(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = $1 AND pid <> pg_backend_pid()) t",
                )
                .bind(&name)
                .fetch_one(&mut admin)
                .await
                .unwrap(),
                Some(pg) => {
                    pg.crash();
                    pg.restart().await;
                    0
                }
            };
            log.lock().unwrap().push(n);
            let _ = done.send(());
        }
    });
    let writer = Writer {
        kills: Arc::new(AtomicU32::new(0)),
        only_batches: Arc::new(AtomicBool::new(false)),
        killer,
        call_ms: Arc::new(AtomicU64::new(0)),
        sizes: Arc::new(Mutex::new(Vec::new())),
    };
    Rig {
        db,
        topic,
        writer,
        killed,
    }
}

fn start(rig: &Rig, pool: &PgPool, config: postal_consumer::ConsumerConfig) -> RunningConsumer {
    let builder = Consumer::builder(pool.clone(), config.clone());
    let builder = if config.max_batch > 1 {
        builder.on_batch(&rig.topic, "job", rig.writer.clone())
    } else {
        builder.on(&rig.topic, "job", WriterOne(rig.writer.clone()))
    };
    RunningConsumer::start(builder.build().expect("consumer"))
}

/// The partition's stored offset (`None` also when the query's session was just terminated by
/// the test's own outage: polled again).
async fn stored_offset(pool: &PgPool, topic: &str) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets WHERE topic = $1 AND partition = 0",
    )
    .bind(topic)
    .fetch_optional(pool)
    .await
    .ok()
    .flatten()
    .flatten()
}

/// What [`outage_run`] measured (printed, and shown by failed assertions).
#[derive(Debug)]
#[allow(dead_code)]
struct Outage {
    applied: u64,
    dead_letters: i64,
    retries: u64,
    kills: usize,
    sizes: Vec<usize>,
}

/// 4 events on one partition; the server ends the consumer's sessions while the handler runs,
/// `kills` times in a row (a PostgreSQL restarting, a pooler restarting, connections
/// terminated in a loop: between two kills the database answers a new session at once); then
/// no more. Waits until the partition is past the 4 records.
async fn outage_run(max_batch: usize, kills: u32, fault: Fault, events: usize) -> Outage {
    let svc = services().await;
    let rig = rig_with("fit_outage", fault).await;
    let pool = rig.db.pool_of(5).await;
    let records: Vec<RawRecord> = (0..events)
        .map(|n| job(Uuid::now_v7(), "k", json!({ "n": n })))
        .collect();
    rig.writer.kills.store(kills, Ordering::SeqCst);
    produce(&svc.bootstrap, &rig.topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    let running = start(&rig, &pool, config);
    wait::until(WAIT, "the partition past the records", || {
        let pool = rig.db.pool.clone();
        let topic = rig.topic.clone();
        async move { stored_offset(&pool, &topic).await == Some(events as i64) }
    })
    .await;
    let stats = running.stats.clone();
    running.stop().await;
    let s = stats.snapshot();
    let (rows, distinct) = effects(&rig.db.pool).await;
    assert_eq!(rows, distinct, "no event applied twice");
    let applied = order(&rig.db.pool).await;
    assert!(
        applied.windows(2).all(|w| w[0] < w[1]),
        "in offset order: {applied:?}"
    );
    let r = Outage {
        applied: s.applied,
        dead_letters: dead_letter_count(&rig.db.pool).await,
        retries: s.retries,
        kills: rig.killed.lock().unwrap().len(),
        sizes: rig.writer.sizes.lock().unwrap().clone(),
    };
    assert_eq!(
        r.applied as i64 + r.dead_letters,
        events as i64,
        "none lost: {r:?}"
    );
    eprintln!("max_batch {max_batch}, {kills} x {fault:?}: {r:?}");
    pool.close().await;
    r
}

/// Guarantee attacked: an outage of the database never counts as one of an event's attempts
/// (it waits, uncounted, with backoff: "database or dependency unavailable; retrying (does not
/// count as an attempt)"), so an outage cannot dead-letter an innocent event. da943dc counts a
/// failure of the head alone as an attempt when, after it, a new session's `SELECT 1` succeeds
/// (`database_answers()`), meant for a handler that alone outlasts the DBA's
/// `idle_in_transaction_session_timeout`. But a real outage that ends sessions and is over
/// within the probe's 5 s (a PostgreSQL restart, a pooler restart, a failover, connections
/// terminated in a loop, a flapping network) looks the same: the session is gone and the
/// database answers again. 4 innocent events, `max_attempts` 3; the server ends every session
/// of the database while the handler runs, 6 times in a row, then no more: all 4 applied, no
/// dead letter, as one record per transaction does (the control below).
///
/// Measured on da943dc (2 shared cores): throughput mode 3 applied and the first event
/// dead-lettered ("gave up after 3 attempts", `retries_exhausted`), handler calls of sizes
/// [4, 2, 1, 1, 1, 2, 1, 2]: two outages halve the batch to the head alone (and `fit` to 1),
/// the next three are counted as its attempts (`retries` 2), and the next transaction
/// dead-letters it without running its handler; one at a time: 4 applied, 0 dead letters,
/// `retries` 0 (each outage "does not count as an attempt"). Cause (consumer/src/batch.rs,
/// `process_batch`): the arm `Err(Attempt::Unavailable(e)) if take == 1 &&
/// self.database_answers().await` cannot tell a session the server ended because the head
/// outlasted `idle_in_transaction_session_timeout` from one an outage ended; the probe runs
/// after the failure, when a short outage is already over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_while_the_head_runs_alone_does_not_dead_letter_it() {
    let r = outage_run(64, 6, Fault::Terminate, 4).await;
    assert_eq!(
        (r.applied, r.dead_letters),
        (4, 0),
        "an outage dead-lettered an innocent event: {r:?}"
    );
}

/// Control for the test above, one record per transaction (`max_batch` 1): the 6 outages are
/// waited out uncounted, all 4 events applied, no dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_an_outage_while_the_head_runs_does_not_dead_letter_it() {
    let r = outage_run(1, 6, Fault::Terminate, 4).await;
    assert_eq!((r.applied, r.dead_letters), (4, 0), "{r:?}");
}

/// What [`fit_run`] measured.
#[derive(Debug)]
struct Fit {
    /// Events per second before the outage (`events` events).
    before: f64,
    /// Events per second of the first `events` events after it.
    after: f64,
    /// Events per second of the next `events` events.
    later: f64,
    /// Handler calls after the outage until one took at least `max_batch / 2` events.
    calls_to_recover: Option<usize>,
    sizes_after: Vec<usize>,
}

/// `events` events applied through a batch handler (`max_batch`), timed; then an outage that
/// ends the consumer's sessions while a multi-record transaction runs, `kills` times in a row
/// (each retry, halved, is ended again: a database restarting for a few seconds), then 1 event
/// alone passes; then `events` events more, timed.
async fn fit_run(max_batch: usize, events: usize, kills: u32, call_ms: u64) -> Fit {
    let svc = services().await;
    let rig = rig("fit_collapse").await;
    rig.writer.call_ms.store(call_ms, Ordering::SeqCst);
    let pool = rig.db.pool_of(5).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.partition_buffer = max_batch * 4;
    config.max_attempts = 3;
    let running = start(&rig, &pool, config);
    let stats = running.stats.clone();
    let batch = |from: usize, n: usize| -> Vec<RawRecord> {
        (from..from + n)
            .map(|n| job(Uuid::now_v7(), "k", json!({ "n": n })))
            .collect()
    };
    // Warm up (the consumer joined and owns the partition).
    produce(&svc.bootstrap, &rig.topic, Some(0), &batch(0, 1)).await;
    wait::until(WAIT, "the first event", || {
        let s = stats.snapshot();
        async move { s.applied == 1 }
    })
    .await;
    let timed = |from: usize| {
        let records = batch(from, events);
        let stats = stats.clone();
        let bootstrap = svc.bootstrap.clone();
        let topic = rig.topic.clone();
        async move {
            let started = Instant::now();
            produce(&bootstrap, &topic, Some(0), &records).await;
            let want = (from + events) as u64;
            wait::until(WAIT, "the timed events applied", || {
                let s = stats.snapshot();
                async move { s.applied >= want }
            })
            .await;
            events as f64 / started.elapsed().as_secs_f64()
        }
    };
    let before = timed(1).await;
    let calls_timed_before = rig.writer.sizes.lock().unwrap().len() - 1;
    // The outage: every multi-record transaction ended, `kills` times.
    let from = 1 + events;
    rig.writer.only_batches.store(true, Ordering::SeqCst);
    rig.writer.kills.store(kills, Ordering::SeqCst);
    produce(&svc.bootstrap, &rig.topic, Some(0), &batch(from, max_batch)).await;
    let want = (from + max_batch) as u64;
    wait::until(WAIT, "the outage's events applied", || {
        let s = stats.snapshot();
        async move { s.applied >= want }
    })
    .await;
    let calls_before = rig.writer.sizes.lock().unwrap().len();
    let after = timed(from + max_batch).await;
    let later = timed(from + max_batch + events).await;
    running.stop().await;
    let s = stats.snapshot();
    let sizes_after = rig.writer.sizes.lock().unwrap()[calls_before..].to_vec();
    let calls_to_recover = sizes_after
        .iter()
        .position(|&n| n >= max_batch / 2)
        .map(|i| i + 1);
    let (rows, distinct) = effects(&rig.db.pool).await;
    assert_eq!(rows, distinct, "no event applied twice");
    assert_eq!(rows as u64, s.applied);
    assert_eq!(s.dead_letters, 0, "no dead letter");
    let applied = order(&rig.db.pool).await;
    assert_eq!(
        applied,
        (0..(1 + 3 * events + max_batch) as i64).collect::<Vec<_>>(),
        "each once, in offset order"
    );
    let f = Fit {
        before,
        after,
        later,
        calls_to_recover,
        sizes_after,
    };
    eprintln!(
        "max_batch {max_batch}, call {call_ms} ms, {kills} kills ({:?} sessions ended): {:.0} events/s before ({calls_timed_before} calls), {:.0} after, {:.0} next; {:?} calls to reach {}; {} calls after: {:?}",
        rig.killed.lock().unwrap(),
        f.before,
        f.after,
        f.later,
        f.calls_to_recover,
        max_batch / 2,
        f.sizes_after.len(),
        f.sizes_after
    );
    pool.close().await;
    f
}

/// Guarantee attacked: throughput mode is there for throughput, and a passing outage does not
/// take it away for good. da943dc keeps `fit`, half the size of a multi-record transaction
/// whose session the server ended, across poll batches, and grows it by a sixteenth per commit
/// (at least 1): an outage that ends every retry of a batch (halved each time) leaves `fit` at
/// 1. A handler that waits 25 ms per call outside the database (a batched call to another
/// service: the cost throughput mode amortizes); `max_batch` 256; 2,000 events timed, then an
/// outage that ends 8 multi-record transactions in a row (256 down to 2: `fit` 1), then two
/// windows of 2,000 events timed: a call of at least 128 events again within 80 calls. Each
/// event once, in order, no dead letter. The windows' events per second are printed, not
/// asserted: a ratio of two timed windows failed a CI rehearsal on a machine loaded by builds
/// beside the tests (speed belongs to the benchmarks); the call sizes say whether throughput
/// mode came back.
///
/// Held on da943dc (2 shared cores, two runs): 2,471 and 2,513 events/s before (8 calls);
/// the first window after, 1,072 and 1,422 events/s (0.43x and 0.57x), the second 1,579
/// (0.63x); 36 calls to a call of 128 again, calls back at 256 after about 47 calls (about
/// 4,000 events). Not for good, but the outage is paid for some 4,000 events after it is over
/// (before da943dc the limit started from the poll batch's size again at each poll batch), and
/// while `fit` is under the poll batch each poll batch costs two calls (e.g. 154 + 102).
/// Since then `fit` is lowered only when the database's `idle_in_transaction_session_timeout`
/// ended the session (none here): an outage leaves it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_does_not_collapse_throughput_for_good() {
    let f = fit_run(256, 2000, 8, 25).await;
    assert!(f.calls_to_recover.is_some_and(|c| c <= 80), "{f:?}");
}

/// What [`self_kill_run`] measured (`sizes` shown by failed assertions).
#[derive(Debug)]
#[allow(dead_code)]
struct SelfKill {
    applied: u64,
    dead_letters: i64,
    offset: Option<i64>,
    sizes: Vec<usize>,
}

/// 12 events on one partition, keys `a` and `b` in turn; the event at offset 5 (key `b`) ends
/// its own session each time its handler runs (a handler that breaks its connection). Runs
/// for at most `limit`.
async fn self_kill_run(max_batch: usize, limit: Duration) -> SelfKill {
    let svc = services().await;
    let rig = rig("fit_self_kill").await;
    let pool = rig.db.pool_of(5).await;
    let records: Vec<RawRecord> = (0..12)
        .map(|n| {
            let key = if n % 2 == 0 { "a" } else { "b" };
            job(Uuid::now_v7(), key, json!({ "n": n, "suicide": n == 5 }))
        })
        .collect();
    produce(&svc.bootstrap, &rig.topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    let running = start(&rig, &pool, config);
    let _ = tokio::time::timeout(limit, async {
        while stored_offset(&rig.db.pool, &rig.topic).await != Some(12) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let stats = running.stats.clone();
    running.stop().await;
    let s = stats.snapshot();
    let (rows, distinct) = effects(&rig.db.pool).await;
    assert_eq!(rows, distinct, "no event applied twice");
    let applied = order(&rig.db.pool).await;
    assert!(
        applied.windows(2).all(|w| w[0] < w[1]) && !applied.contains(&5),
        "in offset order, the self-killing event never applied: {applied:?}"
    );
    let r = SelfKill {
        applied: s.applied,
        dead_letters: dead_letter_count(&rig.db.pool).await,
        offset: stored_offset(&rig.db.pool, &rig.topic).await,
        sizes: rig.writer.sizes.lock().unwrap().clone(),
    };
    eprintln!("max_batch {max_batch}: {r:?}");
    pool.close().await;
    r
}

/// Guarantee attacked: each event once, in offset order, none lost, and the partition moves on,
/// when a handler breaks its own connection (`pg_terminate_backend(pg_backend_pid())` for one
/// event: its transaction's ROLLBACK then finds the session gone, which da943dc's `abandon()`
/// turns into an `Unavailable` attempt that halves the batch, down to the event alone, whose
/// failures `database_answers()` then counts). 12 events, the 6th breaks its session every
/// time: the 11 others applied once, in order, the 6th dead-lettered after `max_attempts` (3),
/// the stored offset at 12, within 20 s. (Held on da943dc: calls of sizes [12, 6, 3, 4, 2, 3,
/// 1, 1, 1, 2, 3, 1]; 11 applied in order, 1 dead letter.) Since the fix of the outage
/// breaks above, a lost session counts as an attempt only when the server says it ended it for
/// idling (SQLSTATE 25P03, `idle_in_transaction_session_timeout`): a terminated backend is an
/// outage, as one at a time (the ignored test below), so this event stalls its partition too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known, as one at a time: a handler that terminates its own backend is taken for an outage (not counted), the partition waits"]
async fn a_handler_that_ends_its_own_session_is_dead_lettered_and_the_rest_flow() {
    let r = self_kill_run(64, Duration::from_secs(20)).await;
    assert_eq!(
        (r.applied, r.dead_letters, r.offset),
        (11, 1, Some(12)),
        "{r:?}"
    );
}

/// The same one record per transaction (`max_batch` 1), for comparison: there the handler's
/// own broken session is an outage (`57P01`/I/O: unavailable), never counted, so the event is
/// retried for good and the partition stalls behind it. Not da943dc's code (the one-at-a-time
/// path, consumer/src/partition/process.rs), but the two modes now disagree on the same event:
/// throughput mode dead-letters it (the test above), one at a time stalls.
///
/// Measured on da943dc: 5 applied, stored offset 5, 0 dead letters, 136 handler calls in 20 s,
/// each failure logged "does not count as an attempt".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known (one at a time, not da943dc): a handler that ends its own session stalls the partition for good: 5 of 12 applied in 20 s, 136 calls, 0 dead letters"]
async fn one_at_a_time_a_handler_that_ends_its_own_session_is_dead_lettered_and_the_rest_flow() {
    let r = self_kill_run(1, Duration::from_secs(20)).await;
    assert_eq!(
        (r.applied, r.dead_letters, r.offset),
        (11, 1, Some(12)),
        "{r:?}"
    );
}

/// Guarantee attacked: as [`an_outage_while_the_head_runs_alone_does_not_dead_letter_it`], with
/// a real outage: the test's own PostgreSQL server crashes and restarts (in about 2 s) while
/// the handler runs, 4 times in a row (2 events, `max_attempts` 3; a poll batch of one record
/// takes the one-at-a-time path, hence 2): both events, innocent, are applied once the server
/// stays up, as one record per transaction does (the control below).
///
/// Measured on da943dc: throughput mode 1 applied, the first event dead-lettered after the
/// 4 restarts ("gave up after 3 attempts"; calls of sizes [2, 1, 1, 1, 1]: the first restart
/// halves, the next three are counted as the head's attempts, "transaction failed; retrying
/// attempt=1", "attempt=2"); one at a time: 2 applied, 0 dead letters, each restart logged
/// "database or dependency unavailable; retrying (does not count as an attempt)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_while_the_head_runs_alone_does_not_dead_letter_it() {
    let r = outage_run(64, 4, Fault::Restart, 2).await;
    assert_eq!(
        (r.applied, r.dead_letters),
        (2, 0),
        "restarts dead-lettered an innocent event: {r:?}"
    );
}

/// Control for the test above, one record per transaction (`max_batch` 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_postgres_restart_while_the_head_runs_does_not_dead_letter_it() {
    let r = outage_run(1, 4, Fault::Restart, 2).await;
    assert_eq!((r.applied, r.dead_letters), (2, 0), "{r:?}");
}

/// 20 events on one partition, each handler call waiting 150 ms outside the database; every
/// session of the database is terminated every 250 ms for 6 s from the first handler call on
/// (connections terminated in a
/// loop: a flapping network, a pooler restarting again and again), not in step with the
/// handler; then no more. Returns (applied, dead letters, attempts counted: `retries`) once
/// the partition is past the 20.
async fn flap_run(max_batch: usize) -> (u64, i64, u64) {
    let svc = services().await;
    let rig = rig("fit_flap").await;
    rig.writer.call_ms.store(150, Ordering::SeqCst);
    let pool = rig.db.pool_of(5).await;
    let records: Vec<RawRecord> = (0..20)
        .map(|n| job(Uuid::now_v7(), "k", json!({ "n": n })))
        .collect();
    produce(&svc.bootstrap, &rig.topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    let running = start(&rig, &pool, config);
    // From the first handler call on (the consumer has joined and owns the partition).
    let sizes = rig.writer.sizes.clone();
    wait::until(WAIT, "the first handler call", || {
        let called = !sizes.lock().unwrap().is_empty();
        async move { called }
    })
    .await;
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    while started.elapsed() < Duration::from_secs(6) {
        tick.tick().await;
        let (done, answered) = oneshot::channel();
        rig.writer.killer.send(done).expect("killer task");
        let _ = answered.await;
    }
    wait::until(WAIT, "the partition past the 20 records", || {
        let pool = rig.db.pool.clone();
        let topic = rig.topic.clone();
        async move { stored_offset(&pool, &topic).await == Some(20) }
    })
    .await;
    let stats = running.stats.clone();
    running.stop().await;
    let s = stats.snapshot();
    let (rows, distinct) = effects(&rig.db.pool).await;
    assert_eq!(rows, distinct, "no event applied twice");
    let applied = order(&rig.db.pool).await;
    assert!(
        applied.windows(2).all(|w| w[0] < w[1]),
        "in offset order: {applied:?}"
    );
    let dead = dead_letter_count(&rig.db.pool).await;
    assert_eq!(s.applied as i64 + dead, 20, "none lost");
    eprintln!(
        "max_batch {max_batch}, {} terminations: applied {}, dead letters {dead}, retries {}, calls of sizes {:?}",
        rig.killed.lock().unwrap().len(),
        s.applied,
        s.retries,
        rig.writer.sizes.lock().unwrap()
    );
    pool.close().await;
    (s.applied, dead, s.retries)
}

/// Guarantee attacked: as [`an_outage_while_the_head_runs_alone_does_not_dead_letter_it`], with
/// terminations not in step with the handler: every session terminated every 250 ms for 6 s.
/// No attempt counted (`retries` 0: "does not count as an attempt") and no innocent event
/// dead-lettered, in throughput mode as one at a time (run first).
///
/// Measured on da943dc (2 shared cores): one at a time 20 applied, `retries` 0, 0 dead letters
/// (25 terminations, 40 and 44 calls); throughput mode 20 applied, 0 dead letters, but
/// `retries` 10 and 11 (two runs): that many of the outages were counted as attempts of innocent heads (calls of sizes [20, 10, 5, 2,
/// 3, 1, 1, 2, 1, 1, 2, …]: the batch halved to 1 at once, then each head alone); the heads
/// passed with 1 or 2 of their 3 attempts used, so `max_attempts` 3 was not reached this time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_terminated_in_a_loop_count_no_attempt() {
    let single = flap_run(1).await;
    let batched = flap_run(64).await;
    eprintln!("one at a time {single:?}, throughput mode {batched:?}");
    assert_eq!(
        (single.1, single.2, batched.1, batched.2),
        (0, 0, 0, 0),
        "dead letters and attempts counted, one at a time then in throughput mode"
    );
}
