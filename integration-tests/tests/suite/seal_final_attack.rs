//! Adversarial review of 9dd640a (throughput mode's sealed batch, and its newest part: a body
//! that sets the seal off early with `SET CONSTRAINTS ALL IMMEDIATE` makes the rest of its poll
//! batch run one record per transaction, unsealed; `batch::ended::refused`/`warn_early`,
//! `process_batch`'s `unsealed`). What `seal_attack` does not model:
//!
//! - a handler that adds context to its database errors (`anyhow`'s `.context`, an error type
//!   of its own): the seal's refusal then reaches the runtime without its text;
//! - the unsealed fallback together with the read-only session default: a body whose script
//!   commits there is not refused, but its next transaction (plain `BEGIN`) is read-only.
//!
//! Found on 9dd640a (2 shared cores), both fixed since (migration 0041 and
//! the one-record-per-transaction path after a refusal); the figures before the fix are in
//! each test's comment:
//!
//! - broke: `SET CONSTRAINTS ALL IMMEDIATE` whose error the handler wraps with context: every
//!   event of a correct handler was dead-lettered in throughput mode (the early seal was told
//!   from the error's text only). Now the seal counts its refusals in the session (a
//!   sequence's `currval`, which the savepoint's rollback does not undo) and the runtime reads
//!   the count after a failed body and when it seals the batch;
//! - broke: after the switch to unsealed, a `psql`-style script (`BEGIN; …; COMMIT; BEGIN; …;
//!   COMMIT;`) kept its first transaction and failed its second (read-only): the event was
//!   counted a duplicate, its second part never applied, no dead letter, no retry. Now the
//!   rest of the poll batch runs through `Worker::process`, the `max_batch` 1 path itself.

use std::time::{Duration, Instant};

use postal_consumer::{BoxFuture, Consumer, Event, Handler, HandlerError};
use postal_integration_tests::{services, unique};
use serde_json::json;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::batch_fixtures::job;
use crate::batch_sixth_attack::{
    applied, assert_once_in_order, dead_letters, fields, insert, script_run, stored_offset,
    CONSUMER,
};
use crate::common::{
    consumer_config, create_topic, effects_table, produce, RawRecord, RunningConsumer,
};
use crate::seal_attack::{assert_all_applied, constraints_run, until_offset};

// --- 1. The seal's refusal, wrapped with context ----------------------------------------------

/// Guarantee attacked: a correct handler's events are applied, never dead-lettered, and
/// throughput mode applies what one record per transaction applies (what 6fab02f fixed for
/// `seal_attack::a_handler_that_checks_its_deferred_constraints_applies_every_event`).
/// Scenario: 4 events of one key, `max_batch` 64, `max_attempts` 2; the handler writes its
/// effect and runs `SET CONSTRAINTS ALL IMMEDIATE` with `anyhow`'s `.context("checking the
/// order's deferred constraints")?` (then `… ALL DEFERRED`). The only difference from
/// `seal_attack`'s handler is the context on the error.
///
/// Measured on 9dd640a (two runs alike), before the fix: max_batch 64 applied 0 of 4, 4 dead
/// letters "gave up after 2 attempts: checking the order's deferred constraints"; max_batch 1
/// applied 4, no dead letter
/// (`one_at_a_time_a_handler_that_wraps_its_constraint_check_applies_every_event`).
/// Cause: `consumer/src/batch/ended.rs` `refused` (`f.error().contains(REFUSAL)`): the early
/// seal is recognised by the seal's message in the body's error *text*, and the text a
/// `BodyFailure` carries is the handler error's `Display` (`partition/process.rs`
/// `body_outcome`, `bounded(&e)`), which for `anyhow` with context (or any error type of the
/// application's own wrapping the `sqlx::Error`) is the outermost message only. So
/// `batch/mod.rs`'s isolated pass takes the body's failure for an ordinary retryable one
/// (`early` false), the record is retried `max_attempts` times in sealed transactions and
/// dead-lettered; the next record met the same. Fixed: the seal counts its refusals in the
/// session (migration 0041) and the isolated pass reads the count after a failed body
/// (`batch::ended::set_off_early`), whatever the body's error says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_wraps_its_constraint_check_applies_every_event() {
    let r = constraints_run(64, 4, true).await;
    assert_all_applied(&r, 4);
}

/// The control: the same handler one record per transaction (not sealed) applies every event.
/// Held on 9dd640a (see the figures in the ignored test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_handler_that_wraps_its_constraint_check_applies_every_event() {
    let r = constraints_run(1, 4, true).await;
    assert_all_applied(&r, 4);
}

// --- 2. A script's two transactions after the switch to unsealed ------------------------------

/// Which event ([`SCRIPTED`]) runs a `psql` script of two transactions, and which
/// ([`CHECKS`]) checks its deferred constraints (`SET CONSTRAINTS ALL IMMEDIATE; … DEFERRED`,
/// the switch to unsealed); every other event writes its effect.
const CHECKS: i64 = 1;
const SCRIPTED: i64 = 3;

/// The handler of [`script_run_of`]: event [`CHECKS`] checks its constraints (when `checks`),
/// event [`SCRIPTED`] runs `BEGIN; <effect>; COMMIT; BEGIN; <second part>; COMMIT;` (a
/// legacy script run as `psql -f` would, statement after statement in one simple query): its
/// effect row in `effects`, its second part in `script_parts`.
#[derive(Clone)]
struct Scripted {
    checks: bool,
}

impl Handler for Scripted {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "scripted"
    }

    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let (id, n) = fields(&event);
            if n == SCRIPTED {
                let script = format!(
                    "BEGIN;
                     INSERT INTO effects (event_id, n, consumer) VALUES ('{id}', {n}, '{CONSUMER}');
                     COMMIT;
                     BEGIN;
                     INSERT INTO script_parts (event_id) VALUES ('{id}');
                     COMMIT;"
                );
                script_run(tx, &script).await?;
                return Ok(());
            }
            insert(tx, &[(id, n)]).await?;
            if self.checks && n == CHECKS {
                sqlx::query("SET CONSTRAINTS ALL IMMEDIATE")
                    .execute(&mut **tx)
                    .await?;
                sqlx::query("SET CONSTRAINTS ALL DEFERRED")
                    .execute(&mut **tx)
                    .await?;
            }
            Ok(())
        })
    }
}

/// What [`script_run_of`] measured.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct ScriptRun {
    max_batch: usize,
    checks: bool,
    applied: Vec<i64>,
    twice: bool,
    /// Rows of the scripted event's second transaction.
    second_parts: i64,
    dead: Vec<String>,
    offset: Option<i64>,
    secs: f64,
}

/// 6 events of one key on one partition (one poll batch), [`Scripted`], `max_attempts` 2;
/// until the partition is past them (or 60 s).
async fn script_run_of(max_batch: usize, checks: bool) -> ScriptRun {
    let events = 6;
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    sqlx::query("CREATE TABLE script_parts (event_id uuid NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let topic = unique("seal_script");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let records: Vec<RawRecord> = (0..events)
        .map(|n| job(Uuid::now_v7(), "k", json!({ "n": n })))
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let pool = db.pool_of(5).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 2;
    let consumer = Consumer::builder(pool.clone(), config)
        .on(&topic, "job", Scripted { checks })
        .build()
        .expect("consumer");
    let started = Instant::now();
    let running = RunningConsumer::start(consumer);
    until_offset(&db.pool, &topic, events, Duration::from_secs(60)).await;
    let secs = started.elapsed().as_secs_f64();
    running.stop().await;
    pool.close().await;
    let (applied, twice) = applied(&db.pool).await;
    let second_parts: i64 = sqlx::query_scalar("SELECT count(*) FROM script_parts")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let r = ScriptRun {
        max_batch,
        checks,
        applied,
        twice,
        second_parts,
        dead: dead_letters(&db.pool)
            .await
            .into_iter()
            .map(|(_, e)| e)
            .collect(),
        offset: stored_offset(&db.pool, &topic).await,
        secs,
    };
    eprintln!("a script's two transactions: {r:?}");
    r
}

/// Guarantee attacked: an event is applied whole or not counted processed (retried, then
/// dead-lettered); the unsealed fallback runs records "as `max_batch` 1 does".
/// Scenario: 6 events of one key in one poll batch, `max_batch` 64, `max_attempts` 2; event 1
/// checks its deferred constraints (`SET CONSTRAINTS ALL IMMEDIATE; … DEFERRED`: the switch to
/// one unsealed record per transaction for the rest of the poll batch), event 3 runs a `psql`
/// script of two transactions (`BEGIN; effect; COMMIT; BEGIN; second part; COMMIT;`).
///
/// Measured on 9dd640a (two runs alike), before the fix: offset 6, no dead letter, event 3's
/// second part 0 rows (max_batch 1: 1 row): event 3's first transaction was kept (its effect
/// and, with it, its dedup row), its second part never written, and the event taken for a
/// duplicate on the next attempt. One record per transaction (`max_batch` 1) writes both parts
/// (`one_at_a_time_a_scripts_two_transactions_are_both_applied`); sealed (no event checks its
/// constraints) the script's `COMMIT` is refused and the event is dead-lettered, saying why.
/// Cause: the unsealed fallback (`consumer/src/batch/mod.rs` `process_batch`, `unsealed` →
/// `batch_attempt(!unsealed, …)`, `partition/mod.rs` `batch_begin_statement` without `SET LOCAL
/// postal.batch`) drops the seal but keeps the read-only session (`batch/session.rs`
/// `Session::open`, `BEGIN READ WRITE` after `default_transaction_read_only = on`): the
/// script's `COMMIT` goes through with the dedup row, its next plain `BEGIN` opens a read-only
/// transaction whose `INSERT` fails (25006). The body's failure in the savepoint-free pass is
/// only a cue to isolate (`Err(Attempt::Retryable(_)) if !isolate`, no log), and the isolated
/// rerun finds the dedup row committed: a duplicate. The read-only default is what keeps a
/// *sealed* batch safe (nothing of a refused commit is kept, so a failing write after it is
/// retried whole); without the seal it turns a script that one record per transaction applies
/// into a silent half. Fixed: after the switch the records go through `Worker::process`, the
/// `max_batch` 1 path itself (`batch/mod.rs` `one_at_a_time`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_switch_to_unsealed_a_scripts_two_transactions_are_both_applied() {
    let r = script_run_of(64, true).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert!(
        r.second_parts == 1 || !r.dead.is_empty(),
        "event {SCRIPTED} applied whole (its second part written) or dead-lettered, not counted \
         processed with half its effects: {r:?}"
    );
}

/// The control: one record per transaction (not sealed, session read-write) applies both
/// transactions of the script. Held on 9dd640a.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_scripts_two_transactions_are_both_applied() {
    let r = script_run_of(1, true).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert_eq!(r.second_parts, 1, "both parts of event {SCRIPTED}: {r:?}");
    assert!(r.dead.is_empty(), "no dead letter: {r:?}");
}

/// The control: sealed (no event checks its constraints), the script's `COMMIT` is refused and
/// its event, whose effects are then all rolled back, is dead-lettered: half an event is never
/// counted processed. Held on 9dd640a.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_a_scripts_event_is_dead_lettered_not_halved() {
    let r = script_run_of(64, false).await;
    assert_once_in_order(&r.applied, r.twice, &r);
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert_eq!(r.dead.len(), 1, "event {SCRIPTED} dead-lettered: {r:?}");
    assert!(
        !r.applied.contains(&SCRIPTED) && r.second_parts == 0,
        "nothing of the dead-lettered event kept: {r:?}"
    );
}
