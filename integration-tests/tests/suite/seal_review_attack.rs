//! Adversarial review of 8ee87a8 (throughput mode's seal: the mark the seal leaves in the
//! session when it refuses, migration 0041, and the unsealed fallback on a plain session,
//! `batch::session::Session::open` with `sealed` false). What `seal_attack`,
//! `seal_final_attack` and `batch_sixth_attack` do not model:
//!
//! - a handler that catches the seal's refusal of its `SET CONSTRAINTS ALL IMMEDIATE` in its
//!   own savepoint and goes on (the mark is left on the connection, and the batch commits);
//! - a stale mark meeting a later, unrelated failing body;
//! - a body's `ROLLBACK` (meant for its savepoint) followed by a write, after the switch to
//!   unsealed records: the session is no longer read-only there;
//! - a consumer killed in the middle of an unsealed run, and the records redelivered.
//!
//! Every scenario runs against `max_batch` 1 (one record per transaction, the yardstick) as
//! well.
//!
//! Found on 8ee87a8 (2 shared cores, 3 runs alike):
//!
//! - broke: a handler that catches the seal's refusal of its `SET CONSTRAINTS ALL IMMEDIATE`
//!   in its own savepoint and takes another branch ("rejected") returns `Ok`: the runtime never
//!   reads the mark after an `Ok` body nor at the commit, so every event took the wrong branch
//!   in throughput mode (0 of 6 applied, 6 rejected; `max_batch` 1: 6 applied);
//! - broke: after the switch to unsealed records (a plain session now), a body's `ROLLBACK`
//!   followed by a write autocommits that write on every run of the body, and the runtime runs
//!   it again until `max_attempts` and dead-letters it (4 writes and a dead letter;
//!   `max_batch` 1: 1 write, no dead letter);
//! - held: a stale mark costs a needless switch to unsealed records only; a `COMMIT` then a
//!   retryable failure, a held key, and a consumer killed mid unsealed run all end as with
//!   `max_batch` 1.
//!
//! Both breaks fixed since: the seal counts its refusals in the session (migration 0041, a
//! sequence's `currval`, read with statements the batch runs anyway: when its session is
//! opened and in the statement that seals it), so a refusal the body caught is found at the
//! commit and nothing of the batch is committed; and after a refusal the rest of the poll
//! batch runs through the one-record-per-transaction path itself (`Worker::process`), not
//! the batch machinery on a plain session. The advisory-lock mark the review attacked is
//! gone: there is no mark left to go stale.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postal_consumer::{BoxFuture, Consumer, Event, Handler, HandlerError};
use postal_integration_tests::{services, unique};
use serde_json::json;
use sqlx::{Connection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::batch_fixtures::job;
use crate::batch_sixth_attack::{
    applied, assert_once_in_order, dead_letters, fields, insert, stored_offset, CONSUMER,
};
use crate::common::{
    consumer_config, create_topic, effects_table, produce, RawRecord, RunningConsumer,
};
use crate::seal_attack::until_offset;

/// Events per run (one key, one partition, produced before the consumer starts: one poll
/// batch).
const EVENTS: i64 = 6;
/// The event whose body checks its deferred constraints (`SET CONSTRAINTS ALL IMMEDIATE; …
/// DEFERRED`): the switch to unsealed records for the rest of the poll batch.
const CHECKS: i64 = 1;
/// The event of the scenario's odd body.
const ODD: i64 = 3;

/// What a body does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Every event: in a savepoint (`tx.begin()`), writes its effect and checks its deferred
    /// constraints with `SET CONSTRAINTS ALL IMMEDIATE`; if the check fails, rolls its
    /// savepoint back and records the event as rejected (`rejected`) instead: a business rule
    /// ("an order whose constraints do not hold is rejected, not retried"). No event breaks a
    /// constraint of the application's.
    RejectOnFailedCheck,
    /// Event [`CHECKS`] runs its constraint check in a savepoint of its own and, if it fails,
    /// rolls that back and goes on ("best effort"), then writes its effect; event [`ODD`]
    /// fails retryably on its first two calls (a transient); every other event writes its
    /// effect.
    StaleMark,
    /// Event [`CHECKS`] writes its effect and checks its constraints (the switch to unsealed,
    /// when `checks`); event [`ODD`] takes a savepoint, writes its effect, and "discards it"
    /// with `ROLLBACK` (meant as `ROLLBACK TO SAVEPOINT`), then writes an audit row
    /// (`audit`: "discarded") and returns `Ok`; every other event writes its effect.
    RollbackThenAudit { checks: bool },
    /// Event [`CHECKS`] writes its effect and checks its constraints (the switch); event
    /// [`ODD`]'s first call writes its effect and then waits 30 s (the consumer is killed
    /// meanwhile); every other event writes its effect.
    KilledMidUnsealed,
    /// Event [`CHECKS`] writes its effect and checks its constraints (the switch); event
    /// [`ODD`] writes its effect, runs `COMMIT` (a checkpoint) and then fails retryably, every
    /// call ("the rates service timed out"); every other event writes its effect.
    CommitThenFail,
    /// `FinalFailure::HoldKey`. Event [`CHECKS`] writes its effect and checks its constraints
    /// (the switch); event [`ODD`] fails for good (a permanent failure: its key is held, and
    /// the events after it of that key with it); every other event writes its effect.
    HeldAfterSwitch,
}

#[derive(Clone)]
struct Probe {
    mode: Mode,
    calls_of_odd: Arc<AtomicU32>,
}

async fn check_constraints(tx: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SET CONSTRAINTS ALL IMMEDIATE")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SET CONSTRAINTS ALL DEFERRED")
        .execute(&mut *tx)
        .await?;
    Ok(())
}

impl Probe {
    async fn act(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        id: Uuid,
        n: i64,
    ) -> Result<(), HandlerError> {
        let odd_call = if n == ODD {
            self.calls_of_odd.fetch_add(1, Ordering::SeqCst) + 1
        } else {
            0
        };
        match self.mode {
            Mode::RejectOnFailedCheck => {
                let mut sp = Connection::begin(&mut **tx).await?;
                insert(&mut sp, &[(id, n)]).await?;
                match check_constraints(&mut sp).await {
                    Ok(()) => sp.commit().await?,
                    Err(_) => {
                        sp.rollback().await?;
                        sqlx::query("INSERT INTO rejected (event_id, n) VALUES ($1, $2)")
                            .bind(id)
                            .bind(n)
                            .execute(&mut **tx)
                            .await?;
                    }
                }
            }
            Mode::StaleMark => {
                if n == CHECKS {
                    let mut sp = Connection::begin(&mut **tx).await?;
                    match check_constraints(&mut sp).await {
                        Ok(()) => sp.commit().await?,
                        Err(_) => sp.rollback().await?,
                    }
                }
                if n == ODD && odd_call <= 2 {
                    return Err(HandlerError::retryable("the rates service timed out"));
                }
                insert(tx, &[(id, n)]).await?;
            }
            Mode::RollbackThenAudit { checks } => {
                if n == ODD {
                    sqlx::query("SAVEPOINT before_effects")
                        .execute(&mut **tx)
                        .await?;
                    insert(tx, &[(id, n)]).await?;
                    // Meant: ROLLBACK TO SAVEPOINT before_effects.
                    sqlx::query("ROLLBACK").execute(&mut **tx).await?;
                    sqlx::query("INSERT INTO audit (event_id, note) VALUES ($1, 'discarded')")
                        .bind(id)
                        .execute(&mut **tx)
                        .await?;
                    return Ok(());
                }
                insert(tx, &[(id, n)]).await?;
                if checks && n == CHECKS {
                    check_constraints(tx).await?;
                }
            }
            Mode::CommitThenFail | Mode::HeldAfterSwitch => {
                if n == ODD && self.mode == Mode::HeldAfterSwitch {
                    return Err(HandlerError::permanent("the order is malformed"));
                }
                insert(tx, &[(id, n)]).await?;
                if n == CHECKS {
                    check_constraints(tx).await?;
                }
                if n == ODD {
                    sqlx::query("COMMIT").execute(&mut **tx).await?;
                    return Err(HandlerError::retryable("the rates service timed out"));
                }
            }
            Mode::KilledMidUnsealed => {
                insert(tx, &[(id, n)]).await?;
                if n == CHECKS {
                    check_constraints(tx).await?;
                }
                if n == ODD && odd_call == 1 {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
            }
        }
        Ok(())
    }
}

impl Handler for Probe {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "probe"
    }

    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let (id, n) = fields(&event);
            self.act(tx, id, n).await
        })
    }
}

/// What a run measured.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct Measured {
    mode: Mode,
    max_batch: usize,
    /// `effects.n`, in the order written.
    applied: Vec<i64>,
    twice: bool,
    /// `rejected.n` ([`Mode::RejectOnFailedCheck`]).
    rejected: Vec<i64>,
    /// Rows in `audit` ([`Mode::RollbackThenAudit`]).
    audit_rows: i64,
    dead: Vec<String>,
    /// Rows in `postal.held_records` ([`Mode::HeldAfterSwitch`]).
    held: i64,
    offset: Option<i64>,
    calls_of_odd: u32,
    secs: f64,
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// [`EVENTS`] events of one key on one partition, [`Probe`] in `mode`, `max_batch`,
/// `max_attempts` 3; until the partition is past them (or 60 s). With
/// [`Mode::KilledMidUnsealed`], the first consumer is killed while event [`ODD`]'s first call
/// waits, and a second one (a new process: its own pool) takes over.
async fn run(mode: Mode, max_batch: usize) -> Measured {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    for ddl in [
        "CREATE TABLE rejected (event_id uuid NOT NULL, n bigint NOT NULL)",
        "CREATE TABLE audit (event_id uuid NOT NULL, note text NOT NULL)",
    ] {
        sqlx::query(ddl).execute(&db.pool).await.unwrap();
    }
    let topic = unique("seal_review");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let records: Vec<RawRecord> = (0..EVENTS)
        .map(|n| job(Uuid::now_v7(), "k", json!({ "n": n })))
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let group = unique("g");
    let probe = Probe {
        mode,
        calls_of_odd: Arc::new(AtomicU32::new(0)),
    };
    let build = |pool: PgPool| {
        let mut config = consumer_config(&svc.bootstrap, &group, CONSUMER);
        config.max_batch = max_batch;
        config.max_attempts = 3;
        if mode == Mode::HeldAfterSwitch {
            config.final_failure = postal_consumer::FinalFailure::HoldKey;
        }
        Consumer::builder(pool, config)
            .on(&topic, "job", probe.clone())
            .build()
            .expect("consumer")
    };
    let started = Instant::now();
    let pool = if mode == Mode::KilledMidUnsealed {
        let first_pool = db.pool_of(5).await;
        let first = RunningConsumer::start(build(first_pool.clone())).owning(first_pool);
        let deadline = Instant::now() + Duration::from_secs(60);
        while probe.calls_of_odd.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        first.kill().await;
        let pool = db.pool_of(5).await;
        let second = RunningConsumer::start(build(pool.clone()));
        until_offset(&db.pool, &topic, EVENTS, Duration::from_secs(60)).await;
        second.stop().await;
        pool
    } else {
        let pool = db.pool_of(5).await;
        let running = RunningConsumer::start(build(pool.clone()));
        until_offset(&db.pool, &topic, EVENTS, Duration::from_secs(60)).await;
        running.stop().await;
        pool
    };
    let secs = started.elapsed().as_secs_f64();
    pool.close().await;
    let (applied, twice) = applied(&db.pool).await;
    let rejected: Vec<i64> = sqlx::query_scalar("SELECT n FROM rejected ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let r = Measured {
        mode,
        max_batch,
        applied,
        twice,
        rejected,
        audit_rows: scalar(&db.pool, "SELECT count(*) FROM audit").await,
        dead: dead_letters(&db.pool)
            .await
            .into_iter()
            .map(|(_, e)| e)
            .collect(),
        held: scalar(&db.pool, "SELECT count(*) FROM postal.held_records").await,
        offset: stored_offset(&db.pool, &topic).await,
        calls_of_odd: probe.calls_of_odd.load(Ordering::SeqCst),
        secs,
    };
    eprintln!("seal review: {r:?}");
    r
}

fn all() -> Vec<i64> {
    (0..EVENTS).collect()
}

// --- 1. A handler that catches the seal's refusal and takes another path ---------------------

/// Guarantee attacked: throughput mode applies what one record per transaction applies (the
/// seal is the runtime's, invisible to a correct handler; its `SET CONSTRAINTS ALL IMMEDIATE`
/// "runs that handler's records one per transaction, unsealed, as `max_batch` 1 does").
/// Scenario: 6 events of one key, one poll batch, `max_batch` 64; each body writes its effect
/// in a savepoint, runs `SET CONSTRAINTS ALL IMMEDIATE`, and on a failed check rolls its
/// savepoint back and records the event as rejected ([`Mode::RejectOnFailedCheck`]). No
/// constraint of the application's is broken.
///
/// Measured on 8ee87a8 (3 runs alike): `max_batch` 64 applied [] and rejected [0, 1, 2, 3, 4,
/// 5], offset 6, no dead letter, 1 seal mark still held by a pooled connection after the
/// stop; `max_batch` 1 (the control below): applied all 6, rejected none.
///
/// Cause: the seal's refusal (migration 0040/0041, `postal.batch_commit_sealed`) is the only
/// deferred check that fails; the handler takes it for its own constraint failing, rolls back
/// its savepoint and returns `Ok`. The runtime reads the seal's mark only after a *failed* body
/// in the isolated pass (`consumer/src/batch/ended.rs` `set_off_early`: `if !sealed ||
/// r.is_ok() { return Ok(false) }`), never in the first pass and never at the commit
/// (`ended::sealed_or_ended` / `dedup::seal` do not look at it): the batch commits the
/// handler's "rejected" branch for every event, and the mark stays on the pooled connection
/// (`batch_attempt`'s `refusals` is false after a clean commit, `Session::close`). Reading
/// (and releasing) the mark in the sealing statement, and running the batch again unsealed
/// from the first body when it is set, would close it at no statement per event.
///
/// Fixed: the statement that seals the batch reads the seal's count of refusals in the
/// session (migration 0041); a refusal since the session was opened leaves the batch
/// uncommitted and runs its records one per transaction (`ended::Sealed::RefusedEarly`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_catches_the_seals_refusal_applies_what_one_at_a_time_applies() {
    let r = run(Mode::RejectOnFailedCheck, 64).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.applied, all(), "every event applied: {r:?}");
    assert!(r.rejected.is_empty(), "no event rejected: {r:?}");
}

/// The control: one record per transaction, the same handler applies every event (its check
/// passes: no seal). Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_handler_that_checks_in_a_savepoint_applies_every_event() {
    let r = run(Mode::RejectOnFailedCheck, 1).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.applied, all(), "every event applied: {r:?}");
    assert!(r.rejected.is_empty(), "no event rejected: {r:?}");
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
}

// --- 2. A stale mark meets a later, unrelated failure ----------------------------------------

/// Guarantee attacked: a stale seal mark (left by a body that swallowed the seal's refusal in
/// its own savepoint) never makes the runtime skip, double, reorder or dead-letter an event.
/// Scenario: 6 events of one key, one poll batch, `max_batch` 64, `max_attempts` 3; event 1
/// runs a "best effort" constraint check in a savepoint of its own and goes on when it fails
/// (the mark is set, the body returns `Ok`); event 3 fails retryably on its first two calls
/// ([`Mode::StaleMark`]). In the isolated pass event 3's ordinary failure finds event 1's mark
/// (`ended::set_off_early`) and switches the rest of the poll batch to unsealed records.
/// Measured: applied, dead letters, offset, event 3's calls; against `max_batch` 1.
///
/// Held on 8ee87a8: applied [0..5] once in order, no dead letter, offset 6, event 3 called 3
/// times (as `max_batch` 1), the switch logged: a needless switch to unsealed records, nothing
/// more. Since the count replaced the mark, event 1's caught refusal is found at event 3's
/// failure (or the commit) of the same attempt: the switch is no longer needless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_seal_mark_costs_only_the_switch_to_unsealed() {
    let r = run(Mode::StaleMark, 64).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.applied, all(), "every event applied: {r:?}");
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
    assert_eq!(r.calls_of_odd, 3, "event {ODD} ran 3 times: {r:?}");
}

/// The control: [`Mode::StaleMark`] one record per transaction. Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_stale_mark_scenario_applies_every_event() {
    let r = run(Mode::StaleMark, 1).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.applied, all(), "every event applied: {r:?}");
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
}

// --- 3. ROLLBACK and a write, after the switch to unsealed -----------------------------------

/// Guarantee attacked: an event's effects happen at most once, and the unsealed fallback runs
/// records "as `max_batch` 1 does" (new in 8ee87a8: on a session that is not read-only).
/// Scenario: 6 events of one key, one poll batch, `max_batch` 64, `max_attempts` 3; event 1
/// checks its constraints (the switch to unsealed for the rest of the poll batch); event 3
/// takes a savepoint, writes its effect, "discards" it with `ROLLBACK` (meant as `ROLLBACK TO
/// SAVEPOINT`), writes an audit row and returns `Ok` ([`Mode::RollbackThenAudit`]).
///
/// Measured on 8ee87a8 (3 runs alike): `max_batch` 64 applied [0, 1, 2, 4, 5], event 3's
/// audit row written 4 times (1 + `max_attempts` 3: its body ran 4 times), event 3
/// dead-lettered ("gave up after 3 attempts: handler \"probe\" ended the transaction it was
/// given …"), offset 6. `max_batch` 1: 1 audit row, no dead letter
/// (`one_at_a_time_a_rollback_then_write_is_written_once`); sealed, without the switch, 0 audit
/// rows and event 3 dead-lettered (the read-only session refuses the write:
/// `sealed_a_rollback_then_write_is_never_written`).
///
/// Cause: after the switch (`batch/mod.rs` `process_batch`, `unsealed`) the records run through
/// the same batch machinery — dedup row up front, the body, then `ended::sealed_or_ended`
/// finds the transaction ended, `ended_unnamed` → isolated rerun → `settle_ended` finds no row
/// kept → `rolled_back` → `head_failed`, an attempt each, dead-lettered after `max_attempts` —
/// but now on a session that is not read-only (`batch/session.rs` `Session::open` with `sealed`
/// false): every run of the body autocommits its audit write after the `ROLLBACK`. That loop
/// (retry a body that ended its transaction, then dead-letter it) is only safe on the
/// read-only session, which 8ee87a8 dropped for unsealed records; one record per transaction
/// (`partition/process.rs` `attempt`) never retries it (its offset autocommits, once).
///
/// Fixed: after the switch the rest of the poll batch goes through `Worker::process`, the
/// one-record-per-transaction path itself (`batch/mod.rs` `one_at_a_time`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_switch_to_unsealed_a_rollback_then_write_is_written_once() {
    let r = run(Mode::RollbackThenAudit { checks: true }, 64).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert!(
        r.audit_rows <= 1,
        "event {ODD}'s write after its ROLLBACK kept at most once: {r:?}"
    );
}

/// The control: one record per transaction writes the audit row once (the event's effect and
/// dedup row are rolled back, its offset autocommits). Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_rollback_then_write_is_written_once() {
    let r = run(Mode::RollbackThenAudit { checks: true }, 1).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.audit_rows, 1, "one audit row: {r:?}");
}

/// The control: sealed (no event checks its constraints), the write after the `ROLLBACK` is
/// refused by the read-only session every time and event 3 is dead-lettered. Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_a_rollback_then_write_is_never_written() {
    let r = run(Mode::RollbackThenAudit { checks: false }, 64).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.audit_rows, 0, "no audit row: {r:?}");
}

// --- 4. A consumer killed in the middle of an unsealed run -----------------------------------

/// Guarantee attacked: effectively once across a crash, after the switch to unsealed records.
/// Scenario: 6 events of one key, one poll batch, `max_batch` 64; event 1 checks its
/// constraints (the switch); event 3's first call writes its effect and waits; the consumer is
/// killed then (its pool closed, as a process's death), and a new one redelivers from the
/// stored offset ([`Mode::KilledMidUnsealed`]). Measured: applied once each, in order, offset,
/// dead letters, event 3's calls; against `max_batch` 1.
///
/// Held on 8ee87a8: applied [0..5] once in order, offset 6, no dead letter, event 3 called
/// twice (the killed call's transaction rolled back with its session; the unsealed records
/// before it were committed one by one with their offsets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_mid_unsealed_run_applies_each_event_once() {
    let r = run(Mode::KilledMidUnsealed, 64).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.applied, all(), "every event applied: {r:?}");
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
    assert_eq!(r.calls_of_odd, 2, "event {ODD} ran again once: {r:?}");
}

/// The control: the same, one record per transaction. Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_consumer_killed_mid_run_applies_each_event_once() {
    let r = run(Mode::KilledMidUnsealed, 1).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.applied, all(), "every event applied: {r:?}");
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
}

// --- 5. A COMMIT and then a retryable failure, after the switch to unsealed -----------------

/// Guarantee attacked: the unsealed fallback runs records as `max_batch` 1 does, when a body
/// checkpoints with `COMMIT` and then fails retryably (every call, past `max_attempts`).
/// Scenario: 6 events of one key, one poll batch, `max_batch` 64, `max_attempts` 3; event 1
/// checks its constraints (the switch); event 3 writes its effect, runs `COMMIT`, then fails
/// retryably ([`Mode::CommitThenFail`]). One record per transaction: the `COMMIT` keeps the
/// effect with the dedup row, the next attempt finds the row and counts a duplicate (effect
/// once, no dead letter). Measured: applied once each in order, dead letters, offset, event
/// 3's calls, against `max_batch` 1.
///
/// Held on 8ee87a8: applied [0..5] once, offset 6, no dead letter, event 3 called once (its
/// `COMMIT` kept its dedup row; the isolated rerun counts it a duplicate), as `max_batch` 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_switch_to_unsealed_a_commit_then_a_failure_is_kept_once() {
    let r = run(Mode::CommitThenFail, 64).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.applied, all(), "every event applied: {r:?}");
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
}

/// The control: [`Mode::CommitThenFail`] one record per transaction. Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_commit_then_a_failure_is_kept_once() {
    let r = run(Mode::CommitThenFail, 1).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(r.applied, all(), "every event applied: {r:?}");
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
}

// --- 6. A held key after the switch to unsealed ----------------------------------------------

/// Guarantee attacked: per-key order with `FinalFailure::HoldKey`, across the switch to
/// unsealed records: a failed event holds its key, and the key's later events are held, not
/// applied. Scenario: 6 events of one key, one poll batch, `max_batch` 64; event 1 checks its
/// constraints (the switch); event 3 fails for good ([`Mode::HeldAfterSwitch`]). Measured:
/// applied, held records, dead letters, offset, against `max_batch` 1.
///
/// Held on 8ee87a8: applied [0, 1, 2], 3 held records, no dead letter, offset 6, as
/// `max_batch` 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_switch_to_unsealed_a_failed_event_holds_its_key() {
    let r = run(Mode::HeldAfterSwitch, 64).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(
        r.applied,
        vec![0, 1, 2],
        "the events before the culprit: {r:?}"
    );
    assert_eq!(
        r.held, 3,
        "the culprit and the key's two later events held: {r:?}"
    );
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
}

/// The control: [`Mode::HeldAfterSwitch`] one record per transaction. Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_failed_event_holds_its_key() {
    let r = run(Mode::HeldAfterSwitch, 1).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(EVENTS), "the offset past all: {r:?}");
    assert_eq!(
        r.applied,
        vec![0, 1, 2],
        "the events before the culprit: {r:?}"
    );
    assert_eq!(
        r.held, 3,
        "the culprit and the key's two later events held: {r:?}"
    );
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
}
