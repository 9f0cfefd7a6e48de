//! Adversarial review of ac4445f (consumer/src/batch/ended.rs: a handler body that ends the
//! transaction it was given, noticed after each body by `still_ours` and settled by
//! `settle_ended` in a new transaction) and fa35d83 (consumer/src/idle_end.rs `ended_idle`:
//! PgBouncer's FATAL 08P01 "query timeout" read as the transaction's own doing, an attempt).
//! What `batch_sixth_attack::` (its `Ends` cases), `idle_end_attack::` and the other batch
//! modules do not model:
//!
//! - a process that dies *between* a body's `COMMIT` and the settle (a deploy's SIGKILL, an
//!   OOM kill, a node lost while the script's statements after its `COMMIT` still run): the
//!   `COMMIT` took the dedup rows `record_many_with_xid` wrote for *every* event of the batch,
//!   and only the settle deletes those of events not applied;
//! - a process that dies after the settle but before the batch's next commit, when a batch
//!   handler's isolating pass had found a culprit (a permanent failure, not yet written as a
//!   dead letter) *before* the call that committed: the settle moves the stored offset to the
//!   committing call's first record, past the culprit, and deletes its dedup row;
//! - an operator's row lock on the partition's offset row (a `psql` session's
//!   `SELECT … FOR UPDATE` before editing offsets by hand; a migration's lock) that outlasts
//!   PgBouncer's `query_timeout`: the runtime's own offset `UPDATE` waits, PgBouncer closes
//!   the connection with 08P01 "query timeout", which fa35d83 reads as the head's attempt.
//!
//! Found (ac4445f, 2 shared cores; figures in each test's `#[ignore]` reason and comment):
//!
//! - broke, throughput mode: a process dying after a body's `COMMIT`, before the settle, loses
//!   the batch's later events (10 events, event 3 commits: 4–9 never applied, the next owner
//!   counts them duplicates); a database outage at the same point loses them without any
//!   death (`still_ours` answers "ours" on the dead session, the retry finds every dedup row
//!   present). One at a time: nothing lost (held, the control);
//! - broke, throughput mode with a batch handler: a poison found by the isolating pass before
//!   the call that commits is neither applied nor dead-lettered once the process dies after
//!   the settle (the settle stored offset 4, past it, and deleted its dedup row);
//! - broke, both modes: an operator's row lock on the offset row held for about 5–8 s behind
//!   PgBouncer's `query_timeout = 1` dead-letters the event at the head, whose handler never
//!   failed (fa35d83); the same under the server's `statement_timeout` (older than fa35d83);
//! - broke, under the server's `statement_timeout` (older than fa35d83): `postal pause` waiting
//!   5 s for a slow transaction (a handler waiting 10 s inside it) and giving up dead-letters
//!   the innocent head of another partition (its `BEGIN`'s shared lock queued behind the
//!   pause). Held behind PgBouncer's `query_timeout = 1`: PgBouncer 1.18 ends the slow
//!   transaction itself after 1 s ("query timeout" also closes a transaction idle between
//!   statements), so the pause succeeds at once;
//! - 08P01 texts: `ended_idle` matches PgBouncer's "query timeout" and "idle transaction
//!   timeout" exactly; its other 08P01 closings ("query_wait_timeout", "client_idle_timeout",
//!   "server conn crashed?", …) stay outages (read, not run).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postal_consumer::{Batch, BatchHandler, BoxFuture, Consumer, Event, Handler, HandlerError};
use postal_integration_tests::pgbouncer::{self, Options, PgBouncer, PoolMode};
use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::batch_fixtures::job;
use crate::batch_sixth_attack::{
    applied, assert_once_in_order, dead_letters, fields, insert, limited_pool, stored_offset,
    Limit, CONSUMER,
};
use crate::common::{
    consumer_config, create_topic, effects_table, produce, RawRecord, RunningConsumer,
};

const WAIT: Duration = Duration::from_secs(60);

/// How many `processed_events` rows the database holds.
async fn dedup_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Whether `id` has a `processed_events` row.
async fn has_dedup_row(pool: &PgPool, id: Uuid) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM postal.processed_events WHERE event_id = $1)")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

// --- 1 and 2. A process that dies around a body's COMMIT ------------------------------------

/// What the handler of the first process does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Crash {
    /// Each event writes its effect; event [`COMMITTER`]'s handler then commits (a script's
    /// `COMMIT`, meant for its own `BEGIN`) and goes on with work outside the transaction —
    /// during which the process dies (the test kills it at the handler's signal).
    AfterTheBodysCommit,
    /// A batch handler: a call holding event [`CULPRIT`] fails permanently ("the order's total
    /// is negative": a poison, to be dead-lettered); a call holding event [`COMMITTER`]
    /// writes its effects and commits (a script's `COMMIT`). The process dies in the next call
    /// after that `COMMIT` (the test kills it at the handler's signal).
    AfterTheSettle,
    /// As [`Crash::AfterTheBodysCommit`], but nothing dies: while the handler's work after its
    /// `COMMIT` runs, the database ends every session of the test's database (a restart, a
    /// failover: the test terminates the backends), then the handler returns `Ok`.
    OutageAfterTheBodysCommit,
}

/// The event whose handler commits the transaction it was given (once: the first process).
const COMMITTER: i64 = 3;
/// [`Crash::AfterTheSettle`]: the poison, before [`BATCH_COMMITTER`] in its batch.
const CULPRIT: i64 = 1;
/// [`Crash::AfterTheSettle`]: the event whose batch call commits.
const BATCH_COMMITTER: i64 = 5;

#[derive(Clone)]
struct Dying {
    crash: Crash,
    /// The first process's handler (the second's is the same code, where the `COMMIT` is spent
    /// and nothing dies).
    first: bool,
    committed: Arc<AtomicBool>,
    /// Told when the first process reaches the point where it dies.
    dies: Arc<Notify>,
    /// [`Crash::OutageAfterTheBodysCommit`]: the handler's work after its `COMMIT` ends.
    resume: Arc<Notify>,
}

impl Dying {
    async fn act(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        events: &[(Uuid, i64)],
    ) -> Result<(), HandlerError> {
        let has = |n: i64| events.iter().any(|e| e.1 == n);
        match self.crash {
            Crash::AfterTheBodysCommit => {
                insert(tx, events).await?;
                if self.first && has(COMMITTER) && !self.committed.swap(true, Ordering::SeqCst) {
                    // Its result unread, as a script's (refused since the seal, 0040).
                    let _ = sqlx::query("COMMIT").execute(&mut **tx).await;
                    // The script's statements after its COMMIT (a report, a VACUUM, a call to
                    // another service) still run when the process is killed.
                    self.dies.notify_one();
                    std::future::pending::<()>().await;
                }
            }
            Crash::OutageAfterTheBodysCommit => {
                insert(tx, events).await?;
                if has(COMMITTER) && !self.committed.swap(true, Ordering::SeqCst) {
                    // Its result unread, as a script's (refused since the seal, 0040).
                    let _ = sqlx::query("COMMIT").execute(&mut **tx).await;
                    self.dies.notify_one();
                    self.resume.notified().await;
                }
            }
            Crash::AfterTheSettle => {
                if self.first && self.committed.load(Ordering::SeqCst) {
                    // The batch runs again after the settle: the process dies here.
                    self.dies.notify_one();
                    std::future::pending::<()>().await;
                }
                if has(CULPRIT) {
                    return Err(HandlerError::permanent("the order's total is negative"));
                }
                insert(tx, events).await?;
                if self.first
                    && has(BATCH_COMMITTER)
                    && !self.committed.swap(true, Ordering::SeqCst)
                {
                    // Its result unread, as a script's (refused since the seal, 0040).
                    let _ = sqlx::query("COMMIT").execute(&mut **tx).await;
                }
            }
        }
        Ok(())
    }
}

impl Handler for Dying {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "dying"
    }

    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move { self.act(tx, &[fields(&event)]).await })
    }
}

/// [`Dying`] as a batch handler: one call for the events of a run.
#[derive(Clone)]
struct BatchDying(Dying);

impl BatchHandler for BatchDying {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "batch_dying"
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        events: Batch<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let events: Vec<(Uuid, i64)> = events.events().iter().map(fields).collect();
            self.0.act(tx, &events).await
        })
    }
}

/// What [`crash_run`] measured.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct CrashRun {
    /// At the first process's death: the stored offset, the dead letters, the dedup rows.
    offset_at_death: Option<i64>,
    dead_letters_at_death: usize,
    dedup_rows_at_death: i64,
    /// [`CULPRIT`]'s dedup row at the death.
    culprit_row_at_death: bool,
    /// After the second process got past every record.
    applied: Vec<i64>,
    twice: bool,
    offset: Option<i64>,
    /// The dead letters' `n`s (their event ids mapped back).
    dead_letters: Vec<i64>,
    /// The second process's counters.
    second_applied: u64,
    second_duplicates: u64,
    secs: f64,
}

/// `events` events (`n` 0..events) of one key on one partition. A first process (its own
/// pool, `kill`ed as a process dies) runs [`Dying`] with `crash` (as a batch handler with
/// `batch`); at the handler's signal it is killed and a second process of the same group
/// takes over with the same handler (nothing dies there, nothing commits under the runtime)
/// until the partition is past every record (at most 60 s).
async fn crash_run(crash: Crash, max_batch: usize, events: i64, batch: bool) -> CrashRun {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("ended_crash");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let ids: Vec<Uuid> = (0..events).map(|_| Uuid::now_v7()).collect();
    let records: Vec<RawRecord> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| job(*id, "k", json!({ "n": n })))
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let committed = Arc::new(AtomicBool::new(false));
    let dies = Arc::new(Notify::new());
    let resume = Arc::new(Notify::new());
    let start = |first: bool| {
        let handler = Dying {
            crash,
            first,
            committed: committed.clone(),
            dies: dies.clone(),
            resume: resume.clone(),
        };
        let db = &db;
        let topic = &topic;
        let group = &group;
        let bootstrap = svc.bootstrap.clone();
        async move {
            let pool = db.process_pool().await;
            let mut config = consumer_config(&bootstrap, group, CONSUMER);
            config.max_batch = max_batch;
            config.max_attempts = 3;
            let builder = Consumer::builder(pool.clone(), config);
            let builder = if batch {
                builder.on_batch(topic, "job", BatchDying(handler))
            } else {
                builder.on(topic, "job", handler)
            };
            RunningConsumer::start(builder.build().expect("consumer")).owning(pool)
        }
    };
    let started = Instant::now();
    let first = start(true).await;
    tokio::time::timeout(WAIT, dies.notified())
        .await
        .expect("the first process reached the point where it dies");
    let culprit_row_at_death = has_dedup_row(&db.pool, ids[CULPRIT as usize]).await;
    let offset_at_death = stored_offset(&db.pool, &topic).await;
    let dead_letters_at_death = dead_letters(&db.pool).await.len();
    let dedup_rows_at_death = dedup_rows(&db.pool).await;
    let second = if crash == Crash::OutageAfterTheBodysCommit {
        // The outage: every other session of the database ended, as a restart ends them.
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        resume.notify_one();
        first
    } else {
        first.kill().await;
        start(false).await
    };
    // Measured, not asserted, here: a run that never gets past the records ends after 60 s.
    let _ = tokio::time::timeout(WAIT, async {
        while stored_offset(&db.pool, &topic).await != Some(events) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let secs = started.elapsed().as_secs_f64();
    let stats = second.stats.clone();
    second.stop().await;
    let s = stats.snapshot();
    let (applied, twice) = applied(&db.pool).await;
    let r = CrashRun {
        offset_at_death,
        dead_letters_at_death,
        dedup_rows_at_death,
        culprit_row_at_death,
        applied,
        twice,
        offset: stored_offset(&db.pool, &topic).await,
        dead_letters: dead_letters(&db.pool)
            .await
            .into_iter()
            .filter_map(|d| ids.iter().position(|id| *id == d.0).map(|n| n as i64))
            .collect(),
        second_applied: s.applied,
        second_duplicates: s.duplicates,
        secs,
    };
    eprintln!("{crash:?}, max_batch {max_batch}, batch handler {batch}: {r:?}");
    assert_once_in_order(&r.applied, r.twice, &r);
    r
}

/// Guarantee attacked: "each event's effects happen exactly once" across a process's death —
/// in throughput mode, when the process dies while a handler's statements after its own
/// `COMMIT` (a `psql` script's `BEGIN; …; COMMIT;` followed by more work, ac4445f's first
/// case) still run: a deploy's SIGKILL, an OOM kill. 10 events of one key, event 3's handler
/// commits; `max_batch` 64, a single-event handler. One at a time this loses nothing (the
/// control below).
///
/// Measured on ac4445f: see the `#[ignore]` reason. Cause: `record_many_with_xid` writes the
/// dedup rows of *every* event of the batch before the first body; the body's `COMMIT` commits
/// them all (events 4–9's too, not applied), and only `settle_ended` — after the body returns —
/// deletes those. A process that dies in between (the body's own statements after the
/// `COMMIT`, `end_what_the_body_left`, the settle's own transaction, or a database outage
/// when the settle begins: `Attempt::db` → waited out, and the batch's next try finds every
/// row present) leaves them for good: the next owner, starting at the stored offset (0: the
/// body's `COMMIT` took no offset), counts events 4–9 duplicates and moves past them. Possible
/// fix: no dedup row of an event whose body has not run may be in the transaction when a body
/// runs — record each run's rows just before its body (one `INSERT … RETURNING` per body or
/// batch-handler run instead of one per batch: a round trip per body, as `still_ours` already
/// costs), or write the batch's rows up front as pending (a column the batch's last statement
/// clears, which the dedup check treats as absent and the next owner overwrites).
#[tokio::test]
async fn a_process_dying_after_a_handlers_commit_loses_no_later_event_of_its_batch() {
    let r = crash_run(Crash::AfterTheBodysCommit, 64, 10, false).await;
    assert_eq!(r.applied, (0..10).collect::<Vec<_>>(), "{r:?}");
    assert_eq!(r.offset, Some(10), "{r:?}");
}

/// Guarantee attacked: "each event's effects happen exactly once" through a database
/// outage (a restart, a failover: "Failover to a replica; a restart", REVIEW-CHECKLIST) — in
/// throughput mode, when the outage comes while a handler's statements after its own `COMMIT`
/// still run; no process dies. 10 events of one key, event 3's handler commits; `max_batch`
/// 64, a single-event handler. One at a time this loses nothing (the control below shares
/// the assertion, with a death instead of the outage).
///
/// Measured on ac4445f: see the `#[ignore]` reason. Cause: as
/// [`a_process_dying_after_a_handlers_commit_loses_no_later_event_of_its_batch`]: the body's
/// `COMMIT` committed the dedup rows of events 4–9; `still_ours` fails on the dead session
/// and answers "still ours" (its `Err(_) => true`), so no settle runs; the next statement
/// fails, the attempt is an outage, and the batch's next try finds every dedup row present:
/// events 4–9 counted duplicates and the offset moved past them. The settle cannot repair
/// what it never gets to run; the same possible fix (no dedup row of an event not yet run in
/// the transaction a body can commit).
#[tokio::test]
async fn an_outage_after_a_handlers_commit_loses_no_later_event_of_its_batch() {
    let r = crash_run(Crash::OutageAfterTheBodysCommit, 64, 10, false).await;
    assert_eq!(r.applied, (0..10).collect::<Vec<_>>(), "{r:?}");
    assert_eq!(r.offset, Some(10), "{r:?}");
}

/// The control: the same handler and death, one record per transaction: event 3's `COMMIT`
/// takes only its own dedup row and effect; the second process applies 4–9. It can fail: the
/// same assertion fails in throughput mode (above).
#[tokio::test]
async fn one_at_a_time_a_process_dying_after_a_handlers_commit_loses_no_event() {
    let r = crash_run(Crash::AfterTheBodysCommit, 1, 10, false).await;
    assert_eq!(r.applied, (0..10).collect::<Vec<_>>(), "{r:?}");
    assert_eq!(r.offset, Some(10), "{r:?}");
    assert!(r.dead_letters.is_empty(), "{r:?}");
}

/// Guarantee attacked: a poison event is dead-lettered (or applied), never dropped — "bad
/// input … loses nothing" — across a process's death, in throughput mode with a batch
/// handler whose isolating pass found the poison (event 1, permanent failure) in an earlier
/// split than the call that committed (events 4–7's call runs a script's `COMMIT`). 8 events
/// of one key, `max_batch` 64. The first process dies in the batch's next try, after the
/// settle (the test kills it at the handler's signal), as a deploy would.
///
/// Measured on ac4445f: see the `#[ignore]` reason. Cause: in `batch_attempt`'s batch path
/// the settle's `EndedAt` is built from the committing call's first record (`part[0]`, here
/// 4), while the run's culprits (`run.dead`) are written as dead letters only after
/// `batch_run` returns — which it never does normally here. `settle_ended` then deletes the
/// culprit's dedup row (not in `finished` nor in `at.ids`) and advances the stored offset to
/// `queue[part[0] - 1].offset + 1`, past the culprit, while the `Committed` it returns has
/// `done` = the records before the run (0): the same process runs the culprit again (and
/// would dead-letter it), but the stored offset already says it is done. Possible fix: build
/// `EndedAt` with `before` = the run's first record (`i`) when the run has culprits (or
/// write `run.dead`'s dead letters in the settle's transaction, and keep their dedup rows), so
/// that the stored offset never passes a record that is neither applied nor dead-lettered.
#[tokio::test]
async fn a_poison_before_a_batch_handlers_commit_is_dead_lettered_across_a_death() {
    let r = crash_run(Crash::AfterTheSettle, 64, 8, true).await;
    assert_eq!(
        r.dead_letters,
        vec![CULPRIT],
        "the poison dead-lettered: {r:?}"
    );
    assert_eq!(r.applied, vec![0, 2, 3, 4, 5, 6, 7], "{r:?}");
    assert_eq!(r.offset, Some(8), "{r:?}");
}

// --- 3. An operator's lock on the offset row behind PgBouncer's query_timeout ---------------

/// Writes `effects` for its events; never fails.
#[derive(Clone)]
struct Plain;

impl Handler for Plain {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "plain"
    }

    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            insert(tx, &[fields(&event)]).await?;
            Ok(())
        })
    }
}

impl BatchHandler for Plain {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "plain_batch"
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        events: Batch<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let events: Vec<(Uuid, i64)> = events.events().iter().map(fields).collect();
            insert(tx, &events).await?;
            Ok(())
        })
    }
}

/// What [`lock_run`] measured.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct LockRun {
    applied: Vec<i64>,
    twice: bool,
    offset: Option<i64>,
    dead_letters: Vec<String>,
    retries: u64,
    /// PgBouncer's log: lines saying it closed a connection for the query timeout.
    bouncer_timeouts: usize,
    /// How long the operator held the lock.
    lock_secs: f64,
    /// The runtime's statements seen waiting for the lock and ended by the limit.
    ended_waits: usize,
}

/// Sessions of `db` waiting for a lock: (pid, query start).
async fn lock_waiters(pool: &PgPool, db: &str) -> Vec<(i32, String)> {
    sqlx::query_as(
        "SELECT pid, query_start::text FROM pg_stat_activity
         WHERE datname = $1 AND wait_event_type = 'Lock'",
    )
    .bind(db)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Two events (`n` 0 and 1, keys k0 and k1) on one partition, through a session-mode
/// PgBouncer limited as `limit` says; `max_attempts` 3. After event 0 is applied an operator
/// locks the partition's offset row (`SELECT … FOR UPDATE` in an open transaction), event 1 is
/// produced, and the lock is held until 4 of the runtime's statements have waited for it and
/// been ended by the limit (or 60 s), then committed.
async fn lock_run(limit: Limit, max_batch: usize) -> LockRun {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (bouncer, pool) = limited_pool(&svc.database_url, &db, limit, "ended_attack").await;
    let topic = unique("ended_lock");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    let builder = Consumer::builder(pool.clone(), config);
    let builder = if max_batch > 1 {
        builder.on_batch(&topic, "job", Plain)
    } else {
        builder.on(&topic, "job", Plain)
    };
    let running = RunningConsumer::start(builder.build().expect("consumer"));
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[job(Uuid::now_v7(), "k0", json!({ "n": 0 }))],
    )
    .await;
    wait::until(WAIT, "event 0 applied", || {
        let pool = db.pool.clone();
        let topic = topic.clone();
        async move { stored_offset(&pool, &topic).await == Some(1) }
    })
    .await;
    // The operator's psql session (not through the pooler, no statement_timeout of its own).
    let mut operator = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *operator)
        .await
        .unwrap();
    sqlx::query(
        "SELECT next_offset FROM postal.consumer_offsets WHERE topic = $1 AND partition = 0
         FOR UPDATE",
    )
    .bind(&topic)
    .execute(&mut *operator)
    .await
    .unwrap();
    let locked = Instant::now();
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[job(Uuid::now_v7(), "k1", json!({ "n": 1 }))],
    )
    .await;
    let stats = running.stats.clone();
    // Held until 4 of the runtime's statements met the limit while waiting for it (enough for
    // 3 attempts and the try after them, if they count), or 60 s: each is seen waiting, then
    // gone.
    let deadline = Instant::now() + WAIT;
    let mut waiting: Vec<(i32, String)> = Vec::new();
    let mut ended = 0;
    while ended < 4 && Instant::now() < deadline {
        let now = lock_waiters(&db.pool, &db.name).await;
        ended += waiting.iter().filter(|w| !now.contains(w)).count();
        waiting = now;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    operator.commit().await.unwrap();
    let lock_secs = locked.elapsed().as_secs_f64();
    // Measured, not asserted, here.
    let _ = tokio::time::timeout(WAIT, async {
        while stored_offset(&db.pool, &topic).await != Some(2) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    running.stop().await;
    pool.close().await;
    let log = bouncer.log();
    drop(bouncer);
    let (applied, twice) = applied(&db.pool).await;
    let r = LockRun {
        applied,
        twice,
        offset: stored_offset(&db.pool, &topic).await,
        dead_letters: dead_letters(&db.pool)
            .await
            .into_iter()
            .map(|d| d.1)
            .collect(),
        retries: stats.snapshot().retries,
        bouncer_timeouts: log
            .lines()
            .filter(|l| l.contains("closing because: query timeout"))
            .count(),
        lock_secs,
        ended_waits: ended,
    };
    eprintln!("{limit:?}, max_batch {max_batch}: {r:?}");
    assert_once_in_order(&r.applied, r.twice, &r);
    r
}

/// Event 1 applied, nothing dead-lettered, the partition past both records.
fn assert_innocent_applied(r: &LockRun) {
    assert!(
        r.dead_letters.is_empty(),
        "no innocent event dead-lettered: {r:?}"
    );
    assert_eq!(r.applied, vec![0, 1], "{r:?}");
    assert_eq!(r.offset, Some(2), "{r:?}");
}

/// Guarantee attacked: an event whose handler never failed is not dead-lettered; a lock held
/// by an operator or a migration ("A lock held by VACUUM FULL, pg_repack, a migration, … an
/// operator's psql", REVIEW-CHECKLIST) is waited out, never blamed on the event at the head.
/// Here: an operator's `SELECT … FOR UPDATE` on the partition's offset row held for a few
/// seconds, behind PgBouncer's `query_timeout = 1` (session mode). Throughput mode
/// (`max_batch` 64, a batch handler that never fails).
///
/// Measured on ac4445f: see the `#[ignore]` reason. Cause (fa35d83): the runtime's own
/// offset `UPDATE` waits for the row lock; PgBouncer ends the client with 08P01 "query
/// timeout"; `idle_end::ended_idle` reads that text as the transaction's own doing
/// (`Attempt::SessionEnded`), and the head alone counts it as its attempt (`head_failed`):
/// after `max_attempts` the next transaction dead-letters it without running its handler,
/// as soon as the lock is gone. "query timeout" says only that a statement outlasted the
/// pooler's limit, not whose statement it was: a handler's own slow query, or the runtime's
/// statement behind a lock, a slow or stalled server. Possible fix: count a query timeout as
/// the head's attempt only when a handler body's statement met it (in the body's error chain,
/// or at the rollback/release right after a body), and wait out (as an outage) one met by
/// the runtime's own statements (the dedup insert, the offset `UPDATE`, the dead-letter and
/// hold writes, `COMMIT`).
#[tokio::test]
#[ignore = "known: event 1 (its handler never failed) dead-lettered 'gave up after 3 attempts: … query timeout' (lock held 7.0 s and 8.2 s, 8 and 10 PgBouncer closings, two runs)"]
async fn an_operators_lock_on_the_offset_row_behind_pgbouncers_query_timeout_dead_letters_no_event()
{
    let r = lock_run(Limit::BouncerQueryTimeout, 64).await;
    assert_innocent_applied(&r);
}

/// As [`an_operators_lock_on_the_offset_row_behind_pgbouncers_query_timeout_dead_letters_no_event`],
/// one record per transaction. Measured on ac4445f (`process.rs` counts `SessionEnded` as
/// `Retryable`): event 1 dead-lettered ("gave up after 3 attempts: … query timeout"), applied
/// [0], the lock held 5.7 s and 8.3 s, 6 and 10 PgBouncer closings, `retries` 2 (two runs).
/// Same cause and fix.
#[tokio::test]
#[ignore = "known: event 1 (its handler never failed) dead-lettered 'gave up after 3 attempts: … query timeout' (lock held 5.7 s and 8.3 s, two runs)"]
async fn one_at_a_time_an_operators_lock_on_the_offset_row_behind_pgbouncers_query_timeout_dead_letters_no_event(
) {
    let r = lock_run(Limit::BouncerQueryTimeout, 1).await;
    assert_innocent_applied(&r);
}

/// The same lock under the server's `statement_timeout` (1 s) instead, PgBouncer's
/// `query_timeout` 3 s above it (its manual's advice): whether the runtime's own statement
/// meeting 57014 behind a lock costs the head an attempt too (before fa35d83).
///
/// Measured on ac4445f: it does — event 1 dead-lettered ("gave up after 3 attempts: … canceling
/// statement due to statement timeout"), applied [0], the lock held 4.7 s (two runs), `retries` 2. So the
/// blame of a runtime statement's timeout on the head is older than fa35d83 (`Attempt::db`
/// makes 57014 `Retryable`, whoever's statement it was); fa35d83 extends it to PgBouncer's
/// `query_timeout`. Possible fix: as above — a timeout met by the runtime's own statements
/// (not inside a body, nor at the release/rollback right after one) is waited out, not
/// counted; or run them under a `SET LOCAL statement_timeout`/`lock_timeout` of the
/// runtime's own whose 57014/55P03 it tells apart.
#[tokio::test]
#[ignore = "known: event 1 (its handler never failed) dead-lettered 'gave up after 3 attempts: … canceling statement due to statement timeout' (lock held 4.7 s, two runs)"]
async fn an_operators_lock_on_the_offset_row_under_statement_timeout_dead_letters_no_event() {
    let r = lock_run(Limit::StatementTimeoutBelow, 64).await;
    assert_innocent_applied(&r);
}

// --- 4. `postal pause` waiting for a slow transaction, behind PgBouncer's query_timeout -----

/// Writes `effects` for its events; the first call holding event 0 first waits `slow` inside
/// its transaction (a call to another service), after telling `started`.
#[derive(Clone)]
struct SlowFirst {
    slow: Duration,
    slowed: Arc<AtomicBool>,
    started: Arc<Notify>,
}

impl SlowFirst {
    async fn act(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        events: &[(Uuid, i64)],
    ) -> Result<(), HandlerError> {
        if events.iter().any(|e| e.1 == 0) && !self.slowed.swap(true, Ordering::SeqCst) {
            self.started.notify_one();
            tokio::time::sleep(self.slow).await;
        }
        insert(tx, events).await?;
        Ok(())
    }
}

impl Handler for SlowFirst {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "slow_first"
    }

    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move { self.act(tx, &[fields(&event)]).await })
    }
}

impl BatchHandler for SlowFirst {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "slow_first_batch"
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        events: Batch<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let events: Vec<(Uuid, i64)> = events.events().iter().map(fields).collect();
            self.act(tx, &events).await
        })
    }
}

/// `topic`'s stored next offset on `partition`.
async fn stored_offset_of(pool: &PgPool, topic: &str, partition: i32) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets WHERE topic = $1 AND partition = $2",
    )
    .bind(topic)
    .bind(partition)
    .fetch_optional(pool)
    .await
    .ok()
    .flatten()
    .flatten()
}

/// Which limit ends the consumer's statements waiting behind the pause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PauseLimit {
    /// A session-mode PgBouncer with `query_timeout = 1`.
    BouncerQueryTimeout,
    /// The server's `statement_timeout` (1 s, a DBA's setting on the database), no pooler.
    ServerStatementTimeout,
}

/// What [`pause_run`] measured.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct PauseRun {
    /// What the operator's `postal pause` said.
    pause: Result<bool, String>,
    applied: Vec<i64>,
    twice: bool,
    offsets: (Option<i64>, Option<i64>),
    dead_letters: Vec<String>,
    retries: u64,
    bouncer_timeouts: usize,
}

/// A topic of 2 partitions, one consumer (limited as `limit` says, `max_attempts` 3). Event 0 (partition 0) has a handler that waits 10 s inside its
/// transaction. While it waits, an operator runs `postal pause` on the topic with a 5 s wait
/// (it waits for the transactions in flight: event 0's outlasts it, so the pause gives up,
/// "still running"; if it does not, the operator resumes at once); meanwhile event 1 arrives
/// on partition 1. Runs until both partitions are past their record (at most 60 s).
async fn pause_run(limit: PauseLimit, max_batch: usize) -> PauseRun {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (bouncer, pool) = match limit {
        PauseLimit::BouncerQueryTimeout => {
            let Some(bin) = pgbouncer::binary("ended_attack") else {
                panic!("no PgBouncer binary (scripts/stack.sh pooler-up installs it)");
            };
            let mut options = Options::default();
            options.settings.push("query_timeout = 1".into());
            let bouncer =
                PgBouncer::start_with(&bin, &svc.database_url, PoolMode::Session, 20, &[], options);
            let pool = PgPoolOptions::new()
                .max_connections(5)
                .acquire_timeout(Duration::from_secs(20))
                .connect(&bouncer.url(&db.name))
                .await
                .expect("connect through pgbouncer");
            (Some(bouncer), pool)
        }
        PauseLimit::ServerStatementTimeout => {
            sqlx::query(&format!(
                "ALTER DATABASE \"{}\" SET statement_timeout = '1s'",
                db.name
            ))
            .execute(&db.pool)
            .await
            .unwrap();
            (None, db.pool_of(5).await)
        }
    };
    let topic = unique("ended_pause");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 2).await;
    let handler = SlowFirst {
        slow: Duration::from_secs(10),
        slowed: Arc::default(),
        started: Arc::default(),
    };
    let mut config = consumer_config(&svc.bootstrap, &group, CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    let builder = Consumer::builder(pool.clone(), config);
    let builder = if max_batch > 1 {
        builder.on_batch(&topic, "job", handler.clone())
    } else {
        builder.on(&topic, "job", handler.clone())
    };
    let running = RunningConsumer::start(builder.build().expect("consumer"));
    produce(
        &svc.bootstrap,
        &topic,
        Some(0),
        &[job(Uuid::now_v7(), "k0", json!({ "n": 0 }))],
    )
    .await;
    tokio::time::timeout(WAIT, handler.started.notified())
        .await
        .expect("event 0's handler started");
    // The operator's `postal pause --wait 5s` (directly on the database).
    let scope = postal_admin::pauses::Scope::consumer(&group, Some(&topic)).unwrap();
    let operator_pool = db.pool.clone();
    let pausing = tokio::spawn(async move {
        let mut tx = operator_pool.begin().await.unwrap();
        // The operator's session has no statement_timeout of its own (its --wait is the limit).
        sqlx::query("SET LOCAL statement_timeout = 0")
            .execute(&mut *tx)
            .await
            .unwrap();
        let r = postal_admin::pauses::pause(
            &mut tx,
            &postal_admin::audit::Operator::cli("operator"),
            &scope,
            Some("deploy"),
            Duration::from_secs(5),
        )
        .await;
        match r {
            Ok(new) => {
                tx.commit().await.unwrap();
                Ok(new)
            }
            Err(e) => Err(e.to_string()),
        }
    });
    wait::until(WAIT, "the pause waiting for event 0's transaction", || {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_locks
                 WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND NOT granted",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                > 0
        }
    })
    .await;
    produce(
        &svc.bootstrap,
        &topic,
        Some(1),
        &[job(Uuid::now_v7(), "k1", json!({ "n": 1 }))],
    )
    .await;
    let pause = pausing.await.unwrap();
    if pause.is_ok() {
        // The operator resumes at once.
        let scope = postal_admin::pauses::Scope::consumer(&group, Some(&topic)).unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        postal_admin::pauses::resume(
            &mut tx,
            &postal_admin::audit::Operator::cli("operator"),
            &scope,
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    // Measured, not asserted, here.
    let _ = tokio::time::timeout(WAIT, async {
        while stored_offset_of(&db.pool, &topic, 0).await != Some(1)
            || stored_offset_of(&db.pool, &topic, 1).await != Some(1)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let stats = running.stats.clone();
    running.stop().await;
    pool.close().await;
    let log = bouncer.as_ref().map(|b| b.log()).unwrap_or_default();
    drop(bouncer);
    let (mut applied, twice) = applied(&db.pool).await;
    applied.sort_unstable();
    let r = PauseRun {
        pause,
        applied,
        twice,
        offsets: (
            stored_offset_of(&db.pool, &topic, 0).await,
            stored_offset_of(&db.pool, &topic, 1).await,
        ),
        dead_letters: dead_letters(&db.pool)
            .await
            .into_iter()
            .map(|d| d.1)
            .collect(),
        retries: stats.snapshot().retries,
        bouncer_timeouts: log
            .lines()
            .filter(|l| l.contains("closing because: query timeout"))
            .count(),
    };
    eprintln!("pause, {limit:?}, max_batch {max_batch}: {r:?}");
    assert!(!r.twice, "{r:?}");
    r
}

/// Guarantee attacked: an event whose handler never failed is not dead-lettered — here when
/// an operator runs `postal pause` (docs/operations.md, "Pausing": it waits for the consumer
/// transactions in flight) while another partition's handler is slow (10 s inside its
/// transaction, a call to another service), behind PgBouncer's `query_timeout = 1`. The pause
/// queues for its exclusive lock; every later consumer transaction of the topic queues behind
/// it at its `BEGIN`'s shared lock, for longer than the pooler's limit. The pause gives up
/// after its 5 s wait ("still running"), nothing is paused. Throughput mode (`max_batch` 64).
///
/// Held on ac4445f (two runs): PgBouncer 1.18's `query_timeout` also closes a client whose
/// transaction sits idle between statements (event 0's handler ran no statement during its
/// wait) with the same "query timeout": event 0's transaction is ended after about 1 s, the
/// pause gets its lock in 1.1–1.2 s and succeeds (the test resumes at once); event 0 counts
/// one attempt (its own slowness), then both events are applied, no dead letter, `retries` 1,
/// 2 PgBouncer closings. So behind PgBouncer's `query_timeout` alone no transaction outlives
/// it to hold a pause up. It can fail: the same assertions fail under the server's
/// `statement_timeout` (below).
#[tokio::test]
async fn a_pause_waiting_for_a_slow_transaction_behind_pgbouncers_query_timeout_dead_letters_no_event(
) {
    let r = pause_run(PauseLimit::BouncerQueryTimeout, 64).await;
    assert!(
        r.dead_letters.is_empty(),
        "no innocent event dead-lettered: {r:?}"
    );
    assert_eq!(r.applied, vec![0, 1], "{r:?}");
    assert_eq!(r.offsets, (Some(1), Some(1)), "{r:?}");
}

/// As [`a_pause_waiting_for_a_slow_transaction_behind_pgbouncers_query_timeout_dead_letters_no_event`],
/// under the server's `statement_timeout` (1 s, set on the database by a DBA) instead of
/// PgBouncer: the slow transaction (no statement running while its handler waits) outlives
/// it, so the pause waits its full 5 s and every consumer transaction of the topic that
/// begins meanwhile waits behind it at its `BEGIN`'s shared lock past the timeout (57014).
///
/// Measured on ac4445f: the pause gives up ("consumer transactions of consumer group … still
/// running after 5 s"), nothing is paused — and event 1, on the other partition, whose handler
/// never ran, is dead-lettered ("gave up after 3 attempts: error returned from database:
/// canceling statement due to statement timeout"; in the second run "… current transaction is
/// aborted, commands ignored until end of transaction block": a dead letter whose error names
/// neither the lock nor the pause), `retries` 2; applied [0] (two runs). Cause (older than
/// fa35d83): `begin_for`'s shared advisory lock waits behind the pause's exclusive request;
/// `Attempt::db` makes the 57014 `Retryable`, and the head alone counts it (`head_failed`), so
/// the operator's failed pause blames the innocent head of every partition of the topic that
/// began a transaction while it waited. Possible fix: as for the offset row's lock — a timeout
/// met by the runtime's own statements (here the `BEGIN`'s lock) is waited out, not counted;
/// e.g. take the pause locks with `SET LOCAL lock_timeout` (55P03, told apart) or
/// `pg_try_advisory_xact_lock_shared` in a loop, so a pause never reaches the head's attempts.
#[tokio::test]
#[ignore = "known: event 1 (other partition, handler never ran) dead-lettered 'gave up after 3 attempts: …' (57014, or 25P02 'current transaction is aborted') while a postal pause waited 5 s and gave up"]
async fn a_pause_waiting_for_a_slow_transaction_under_statement_timeout_dead_letters_no_event() {
    let r = pause_run(PauseLimit::ServerStatementTimeout, 64).await;
    assert!(
        r.dead_letters.is_empty(),
        "no innocent event dead-lettered: {r:?}"
    );
    assert_eq!(r.applied, vec![0, 1], "{r:?}");
    assert_eq!(r.offsets, (Some(1), Some(1)), "{r:?}");
}
