//! Adversarial review of 048f92b (throughput mode's seal counts its refusals in the session,
//! migration 0041; after a refusal the rest of the poll batch runs through `Worker::process`,
//! `batch/mod.rs` `one_at_a_time`). What `seal_attack`, `seal_final_attack` and
//! `seal_review_attack` do not model:
//!
//! - the switch to one record per transaction when the head of the transaction that refused
//!   had already used up its attempts (its dead letter was in the refused transaction);
//! - a batch handler meeting the refusal, with copies of an event, a record without an
//!   envelope, an undecodable payload and an unknown type in the rest of the poll batch;
//! - `FinalFailure::HoldKey` with a key held in the transaction that refused (two keys);
//! - a body that resets the session's sequence state (`DISCARD SEQUENCES`) after catching the
//!   refusal in its own savepoint.
//!
//! Every scenario runs against `max_batch` 1 (one record per transaction, the yardstick) too.
//!
//! Found on 048f92b (2 shared cores, 3 runs alike):
//!
//! - broke: an event whose attempts were used up, dead-lettered in a transaction that a later
//!   body's `SET CONSTRAINTS ALL IMMEDIATE` then dropped, runs again with `max_attempts` new
//!   attempts in `Worker::process`: a handler that fails its first 4 calls is applied (5 calls;
//!   `max_batch` 1 dead-letters it after 3), one that always fails runs 7 times and its dead
//!   letter says 3 attempts;
//! - broke (contrived): a body that catches the refusal in its own savepoint and then runs
//!   `DISCARD SEQUENCES` resets the count to the 0 a fresh session opened with: the refusal is
//!   never seen and the batch commits the body's other branch (6 of 6 rejected; `max_batch` 1:
//!   6 applied);
//! - held: a batch handler (and a single one) meeting the refusal with a copy of an event, a
//!   record without an envelope, an undecodable payload, an unknown type and a copied event in
//!   the rest of the poll batch; a key held (`HoldKey`) in the transaction that refused, with a
//!   second key on the partition — all as `max_batch` 1.
//!
//! Both breaks fixed since: the head's attempts and last error go on into the first
//! `Worker::process_after` call (used up: dead-lettered or held without running, as throughput
//! mode would have); and a session with no number (a new one, or one whose numbers `DISCARD
//! SEQUENCES` forgot) takes a fresh one when the count is read, so the count after a discard
//! never equals the one read at open. The figures before the fixes are in each test's comment.
//!
//! Not attacked here: a transaction pooler (the consumer refuses one at start,
//! `poolers::relay_consumer_and_commands_refuse_transaction_pooling_with_one_line`; and the
//! count read at `Session::open` and the seal's read could only differ falsely there — a new
//! refusal's number is always above any number read before it, so none is missed).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postal_consumer::{
    Batch, BatchHandler, BoxFuture, Consumer, Event, FinalFailure, Handler, HandlerError,
};
use postal_integration_tests::{services, unique};
use serde_json::json;
use sqlx::{Connection, PgConnection, Postgres, Transaction};
use uuid::Uuid;

use crate::batch_fixtures::job;
use crate::batch_sixth_attack::{applied, assert_once_in_order, fields, insert, stored_offset};
use crate::common::{
    consumer_config, create_topic, effects_table, produce, RawRecord, RunningConsumer,
};

const CONSUMER: &str = crate::batch_sixth_attack::CONSUMER;

/// What a body does for an event (by its `n`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    /// Writes its effect.
    Write,
    /// Writes its effect and checks its deferred constraints (`SET CONSTRAINTS ALL IMMEDIATE;
    /// … DEFERRED`), failing with the error if the check fails: the seal refuses in a batch.
    Checks,
    /// Fails retryably on its first `k` calls ("the rates service is starting"), then writes
    /// its effect.
    FailFirst(u32),
    /// Fails for good (a permanent failure).
    Permanent,
    /// In a savepoint: writes its effect and checks its constraints; if the check fails, rolls
    /// the savepoint back, runs `DISCARD SEQUENCES` (a library resetting the session's cached
    /// sequence state) and records the event as rejected instead.
    RejectAndDiscard,
}

#[derive(Clone)]
struct Probe {
    acts: Arc<BTreeMap<i64, Act>>,
    calls: Arc<Mutex<BTreeMap<i64, u32>>>,
}

async fn check_constraints(tx: &mut PgConnection) -> Result<(), sqlx::Error> {
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
        let call = {
            let mut calls = self.calls.lock().unwrap();
            let c = calls.entry(n).or_default();
            *c += 1;
            *c
        };
        match self.acts.get(&n).copied().unwrap_or(Act::Write) {
            Act::Write => insert(tx, &[(id, n)]).await?,
            Act::Checks => {
                insert(tx, &[(id, n)]).await?;
                check_constraints(tx).await?;
            }
            Act::FailFirst(k) => {
                if call <= k {
                    return Err(HandlerError::retryable("the rates service is starting"));
                }
                insert(tx, &[(id, n)]).await?;
            }
            Act::Permanent => return Err(HandlerError::permanent("the order is malformed")),
            Act::RejectAndDiscard => {
                let mut sp = Connection::begin(&mut **tx).await?;
                insert(&mut sp, &[(id, n)]).await?;
                match check_constraints(&mut sp).await {
                    Ok(()) => sp.commit().await?,
                    Err(_) => {
                        sp.rollback().await?;
                        sqlx::query("DISCARD SEQUENCES").execute(&mut **tx).await?;
                        sqlx::query("INSERT INTO rejected (event_id, n) VALUES ($1, $2)")
                            .bind(id)
                            .bind(n)
                            .execute(&mut **tx)
                            .await?;
                    }
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

/// [`Probe`] as a batch handler: one call for the events of a run, each event's act in turn
/// (the first failure fails the call).
#[derive(Clone)]
struct BatchProbe(Probe);

impl BatchHandler for BatchProbe {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "batch_probe"
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        events: Batch<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            for e in events.iter() {
                let (id, n) = fields(e);
                self.0.act(tx, id, n).await?;
            }
            Ok(())
        })
    }
}

/// A scenario: the records (on partition 0, in order), the acts, the settings.
struct Scenario {
    records: Vec<RawRecord>,
    acts: BTreeMap<i64, Act>,
    batch_handler: bool,
    hold: bool,
}

/// What a run measured.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct Measured {
    max_batch: usize,
    /// `effects.n`, in the order written.
    applied: Vec<i64>,
    twice: bool,
    /// `rejected.n`.
    rejected: Vec<i64>,
    /// Dead letters: (offset, reason, attempts, error).
    dead: Vec<(i64, String, i32, String)>,
    /// Held records' offsets.
    held: Vec<i64>,
    offset: Option<i64>,
    /// Body calls per `n`.
    calls: BTreeMap<i64, u32>,
    secs: f64,
}

/// Runs `s` with `max_batch` and `max_attempts` 3, until the partition's stored offset is past
/// every record (or 60 s).
async fn run(s: &Scenario, max_batch: usize) -> Measured {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    sqlx::query("CREATE TABLE rejected (event_id uuid NOT NULL, n bigint NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let topic = unique("seal_count");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce(&svc.bootstrap, &topic, Some(0), &s.records).await;
    let end = s.records.len() as i64;
    let probe = Probe {
        acts: Arc::new(s.acts.clone()),
        calls: Arc::default(),
    };
    let pool = db.pool_of(5).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    if s.hold {
        config.final_failure = FinalFailure::HoldKey;
    }
    let builder = Consumer::builder(pool.clone(), config);
    let builder = if s.batch_handler {
        builder.on_batch(&topic, "job", BatchProbe(probe.clone()))
    } else {
        builder.on(&topic, "job", probe.clone())
    };
    let consumer = builder.build().expect("consumer");
    let started = Instant::now();
    let running = RunningConsumer::start(consumer);
    let _ = tokio::time::timeout(Duration::from_secs(60), async {
        while stored_offset(&db.pool, &topic).await != Some(end) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let secs = started.elapsed().as_secs_f64();
    running.stop().await;
    pool.close().await;
    let (applied, twice) = applied(&db.pool).await;
    let r = Measured {
        max_batch,
        applied,
        twice,
        rejected: sqlx::query_scalar("SELECT n FROM rejected ORDER BY n")
            .fetch_all(&db.pool)
            .await
            .unwrap(),
        dead: sqlx::query_as(
            "SELECT kafka_offset, reason, attempts, error FROM postal.dead_letters
             ORDER BY kafka_offset",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap(),
        held: sqlx::query_scalar("SELECT kafka_offset FROM postal.held_records ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap(),
        offset: stored_offset(&db.pool, &topic).await,
        calls: probe.calls.lock().unwrap().clone(),
        secs,
    };
    eprintln!("seal count: {r:?}");
    assert_once_in_order(&r.applied, r.twice, &r);
    r
}

/// `n` events `job` of `key` with `n` 0..n.
fn jobs(key: &str, n: i64) -> Vec<RawRecord> {
    (0..n)
        .map(|n| job(Uuid::now_v7(), key, json!({ "n": n })))
        .collect()
}

// --- 1. An exhausted head in the transaction that refused ------------------------------------

/// The event whose body checks its constraints in [`exhausted_head`].
const CHECKS: i64 = 2;

/// 6 events of one key; event 0 fails retryably on its first 4 calls and writes its effect
/// after; event [`CHECKS`] checks its constraints when `checks`.
fn exhausted_head(checks: bool) -> Scenario {
    let mut acts = BTreeMap::from([(0, Act::FailFirst(4))]);
    if checks {
        acts.insert(CHECKS, Act::Checks);
    }
    Scenario {
        records: jobs("k", 6),
        acts,
        batch_handler: false,
        hold: false,
    }
}

/// Guarantee attacked: throughput mode dead-letters what one record per transaction
/// dead-letters — an event's handler gets `max_attempts` attempts, "as with one record per
/// transaction" — also when a later body sets the seal off (the switch to `Worker::process`).
/// Scenario: 6 events of one key, one poll batch, `max_batch` 64, `max_attempts` 3; event 0
/// fails retryably on its first 4 calls (a dependency that takes a while to come back), event
/// 2 checks its constraints (`SET CONSTRAINTS ALL IMMEDIATE`, the seal refuses). Measured:
/// event 0's calls and fate, dead letters, offset; against `max_batch` 1 and against
/// `max_batch` 64 without the check (the controls below).
///
/// Measured on 048f92b (3 runs alike, 2 shared cores): `max_batch` 64 applied [0, 1, 2, 3, 4,
/// 5], no dead letter, offset 6, event 0 called 5 times (events 1 and 2 twice); `max_batch` 1:
/// event 0 dead-lettered (`retries_exhausted`, attempts 3, "gave up after 3 attempts: the rates
/// service is starting", 3 calls), [1..5] applied, offset 6; `max_batch` 64 without the check:
/// event 0 dead-lettered (attempts 3) after 4 calls (the optimistic pass's failure is not an
/// attempt), [1..5] applied. With a head that always fails
/// ([`an_always_failing_head_runs_at_most_max_attempts_and_one`]) the dead letter says 3
/// attempts after 7 calls.
///
/// Cause: `batch/mod.rs` `process_batch`: once the head's attempts are used up
/// (`head_attempts >= max_attempts`), the next transaction dead-letters it without running it
/// (`attempt_in`, `gave_up`) *and goes on with the records after it in the same transaction*
/// (the limit is not cut for a retryable stop). Event 2's refusal then drops that transaction,
/// the head's dead letter with it (`ended::Sealed::RefusedEarly` / `refused_early`, `c.done`
/// 0), and `one_at_a_time` hands the whole queue, head first, to `Worker::process`, which
/// starts the head's attempts again from 0 (`partition/process.rs` `process`, `attempts`): the
/// head's used-up attempts are forgotten and its handler runs up to `max_attempts` more times.
/// Passing the head's attempts (and last error) to the first `process` call — or dead-lettering
/// an exhausted head in a transaction of its own — would keep the rule.
///
/// Fixed: `one_at_a_time` hands the head's attempts and last error to
/// `Worker::process_after`, which goes on counting from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_head_is_not_given_new_attempts_by_a_later_bodys_refusal() {
    let r = run(&exhausted_head(true), 64).await;
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert_eq!(r.applied, vec![1, 2, 3, 4, 5], "events 1..5 applied: {r:?}");
    assert_eq!(r.dead.len(), 1, "event 0 dead-lettered: {r:?}");
    assert_eq!(r.dead[0].0, 0, "event 0 dead-lettered: {r:?}");
    assert_eq!(r.dead[0].1, "retries_exhausted", "{r:?}");
}

/// The control: one record per transaction dead-letters event 0 after 3 calls (event 2's check
/// passes: no seal). Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_an_event_failing_its_first_four_calls_is_dead_lettered() {
    let r = run(&exhausted_head(true), 1).await;
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert_eq!(r.applied, vec![1, 2, 3, 4, 5], "events 1..5 applied: {r:?}");
    assert_eq!(r.dead.len(), 1, "event 0 dead-lettered: {r:?}");
    assert_eq!(r.dead[0].0, 0, "event 0 dead-lettered: {r:?}");
    assert_eq!(r.calls.get(&0), Some(&3), "event 0 ran 3 times: {r:?}");
}

/// The control: throughput mode without the check dead-letters event 0 too (after 4 calls: the
/// optimistic pass's failure is not an attempt). Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_refusal_an_event_failing_its_first_four_calls_is_dead_lettered() {
    let r = run(&exhausted_head(false), 64).await;
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert_eq!(r.applied, vec![1, 2, 3, 4, 5], "events 1..5 applied: {r:?}");
    assert_eq!(r.dead.len(), 1, "event 0 dead-lettered: {r:?}");
    assert_eq!(r.dead[0].0, 0, "event 0 dead-lettered: {r:?}");
}

/// Guarantee attacked: a dead letter's `attempts` says how many times its handler ran (at most
/// `max_attempts`, plus the optimistic pass's uncounted call). Scenario: as
/// [`an_exhausted_head_is_not_given_new_attempts_by_a_later_bodys_refusal`], but event 0 fails
/// every call. Measured: event 0's calls and its dead letter.
///
/// Measured on 048f92b: event 0 ran 7 times (4 before the refusal, 3 after), its dead letter
/// said 3 attempts; `max_batch` 1: 3 calls. Cause: the same (`one_at_a_time` restarted the
/// head's attempts in `Worker::process`). Fixed with it (`Worker::process_after`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_always_failing_head_runs_at_most_max_attempts_and_one() {
    let mut s = exhausted_head(true);
    s.acts.insert(0, Act::FailFirst(u32::MAX));
    let r = run(&s, 64).await;
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert_eq!(r.applied, vec![1, 2, 3, 4, 5], "events 1..5 applied: {r:?}");
    assert_eq!(r.dead.len(), 1, "event 0 dead-lettered: {r:?}");
    assert!(
        r.calls.get(&0).copied().unwrap_or(0) <= 4,
        "event 0 ran at most max_attempts + 1 times: {r:?}"
    );
}

// --- 2. A batch handler meets the refusal; odd records in the rest of the queue ---------------

/// 9 records of one key: events 0, 1, 2 (2 checks its constraints), a copy of event 1 (same
/// id), a record without an envelope (no `ce_id`), an undecodable payload, an unknown type,
/// event 7 and a copy of it.
fn odd_queue(batch_handler: bool) -> Scenario {
    let mut records = jobs("k", 3);
    records.push(RawRecord {
        key: records[1].key.clone(),
        payload: records[1].payload.clone(),
        headers: records[1].headers.clone(),
    });
    records.push(RawRecord {
        key: Some("k".into()),
        payload: serde_json::to_vec(&json!({ "n": 4 })).unwrap(),
        headers: vec![("content-type", "application/json".to_owned())],
    });
    let mut undecodable = job(Uuid::now_v7(), "k", json!({ "n": 5 }));
    undecodable.payload = b"{not json".to_vec();
    records.push(undecodable);
    records.push(RawRecord::event(
        Uuid::now_v7(),
        "k",
        "other",
        json!({ "n": 6 }),
    ));
    let seventh = job(Uuid::now_v7(), "k", json!({ "n": 7 }));
    records.push(RawRecord {
        key: seventh.key.clone(),
        payload: seventh.payload.clone(),
        headers: seventh.headers.clone(),
    });
    records.push(seventh);
    Scenario {
        records,
        acts: BTreeMap::from([(2, Act::Checks)]),
        batch_handler,
        hold: false,
    }
}

/// Guarantee attacked: after a refusal the rest of the poll batch runs "exactly as with
/// `max_batch` 1": each event applied once, copies counted duplicates, records without an
/// envelope, undecodable payloads and unknown types dead-lettered once, the offset past all.
/// Scenario: [`odd_queue`] with a batch handler (one call for the run [0, 1, 2]; event 2's
/// check makes the seal refuse in the call, the copy of event 1 is inside the run), one poll
/// batch, `max_batch` 64. Measured: applied, dead letters (offset, reason), offset; compared
/// with `max_batch` 1.
///
/// Held on 048f92b: applied [0, 1, 2, 7], dead letters at offsets 4 (`missing_event_id`), 5
/// (`undecodable`), 6 (`unknown_type`), offset 9, no event twice — as `max_batch` 1 (events 0..2
/// called 3 times: the optimistic pass, the isolated pass that refused, then `Worker::process`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handlers_refusal_then_odd_records_end_as_one_at_a_time() {
    let batched = run(&odd_queue(true), 64).await;
    let single = run(&odd_queue(true), 1).await;
    for r in [&batched, &single] {
        assert_eq!(r.offset, Some(9), "the offset past all: {r:?}");
    }
    let fate = |r: &Measured| {
        (
            r.applied.clone(),
            r.dead
                .iter()
                .map(|d| (d.0, d.1.clone()))
                .collect::<Vec<_>>(),
        )
    };
    assert_eq!(
        fate(&batched),
        fate(&single),
        "as max_batch 1: {batched:?} / {single:?}"
    );
    assert_eq!(batched.applied, vec![0, 1, 2, 7], "{batched:?}");
}

/// As [`a_batch_handlers_refusal_then_odd_records_end_as_one_at_a_time`] with a single-event
/// handler. Held on 048f92b: the same figures as with the batch handler, as `max_batch` 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_then_odd_records_end_as_one_at_a_time() {
    let batched = run(&odd_queue(false), 64).await;
    let single = run(&odd_queue(false), 1).await;
    for r in [&batched, &single] {
        assert_eq!(r.offset, Some(9), "the offset past all: {r:?}");
    }
    let fate = |r: &Measured| {
        (
            r.applied.clone(),
            r.dead
                .iter()
                .map(|d| (d.0, d.1.clone()))
                .collect::<Vec<_>>(),
        )
    };
    assert_eq!(
        fate(&batched),
        fate(&single),
        "as max_batch 1: {batched:?} / {single:?}"
    );
}

// --- 3. A key held in the transaction that refused --------------------------------------------

/// Two keys on one partition, `FinalFailure::HoldKey`: A0 writes, A1 fails for good (its key
/// is held), A2 (held), B3 checks its constraints (the seal refuses), A4 (held), B5 writes.
fn held_before_refusal() -> Scenario {
    let keys = ["a", "a", "a", "b", "a", "b"];
    let records = keys
        .iter()
        .enumerate()
        .map(|(n, k)| job(Uuid::now_v7(), k, json!({ "n": n as i64 })))
        .collect();
    Scenario {
        records,
        acts: BTreeMap::from([(1, Act::Permanent), (3, Act::Checks)]),
        batch_handler: false,
        hold: true,
    }
}

/// Guarantee attacked: per-key order with `FinalFailure::HoldKey` across the switch, when the
/// key was held in the very transaction the refusal drops (the hold rolled back with it): the
/// key's later events stay held, the other key's applied. Scenario: [`held_before_refusal`],
/// one poll batch, `max_batch` 64, `max_attempts` 3. Measured: applied, held records, dead
/// letters, offset; against `max_batch` 1.
///
/// Held on 048f92b: applied [0, 3, 5], held [1, 2, 4], no dead letter, offset 6, as
/// `max_batch` 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_in_the_refused_transaction_stays_held() {
    let batched = run(&held_before_refusal(), 64).await;
    let single = run(&held_before_refusal(), 1).await;
    for r in [&batched, &single] {
        assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
        assert_eq!(r.applied, vec![0, 3, 5], "{r:?}");
        assert_eq!(r.held, vec![1, 2, 4], "{r:?}");
        assert!(r.dead.is_empty(), "no dead letter: {r:?}");
    }
}

// --- 4. A body that resets the session's sequence state ---------------------------------------

/// Guarantee attacked: a refusal the body caught in its own savepoint leaves the batch
/// uncommitted (the count, migration 0041), whatever else the body does in the session.
/// Scenario: 6 events of one key, one poll batch, `max_batch` 64; each body, in a savepoint,
/// writes its effect and checks its constraints; on a failed check it rolls the savepoint back,
/// runs `DISCARD SEQUENCES` (allowed in a transaction; a library resetting cached session
/// state) and records the event as rejected ([`Act::RejectAndDiscard`]). Measured: applied,
/// rejected, offset; against `max_batch` 1.
///
/// Measured on 048f92b: `max_batch` 64 applied [], rejected [0, 1, 2, 3, 4, 5], offset 6, each
/// body called once (the refusal was never found); `max_batch` 1 applied all 6, rejected none.
/// Cause: the count is the sequence's `currval`
/// (`postal.batch_seal_refusals()`, 0 when the session has none), and `DISCARD SEQUENCES`
/// forgets it: on a session whose count was 0 when the batch opened it (every fresh pooled
/// connection; and after each such batch it is 0 again) the sealing statement
/// (`dedup::seal`) reads 0 again, `ended::sealed_or_ended` returns `Sealed::Ours`, and the
/// batch commits the body's "rejected" branch. Contrived (the body resets session state the
/// runtime relies on), kept as the count's edge: a count that `DISCARD` cannot reset (e.g.
/// read `last_value` of a per-session sequence, or compare `nextval` taken at open) would
/// close it.
///
/// Fixed: a session with no number takes a fresh one when the count is read (migration
/// 0041's `postal.batch_seal_refusals()`), so the count read at the seal after a discard is
/// never the one read at open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_discards_sequences_after_a_caught_refusal_applies_what_one_at_a_time_applies()
{
    let s = Scenario {
        records: jobs("k", 6),
        acts: (0..6).map(|n| (n, Act::RejectAndDiscard)).collect(),
        batch_handler: false,
        hold: false,
    };
    let r = run(&s, 64).await;
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert!(r.rejected.is_empty(), "no event rejected: {r:?}");
    assert_eq!(r.applied, (0..6).collect::<Vec<_>>(), "all applied: {r:?}");
}

/// The control: one record per transaction applies every event (no seal). Expected to hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_body_that_discards_sequences_applies_every_event() {
    let s = Scenario {
        records: jobs("k", 6),
        acts: (0..6).map(|n| (n, Act::RejectAndDiscard)).collect(),
        batch_handler: false,
        hold: false,
    };
    let r = run(&s, 1).await;
    assert_eq!(r.offset, Some(6), "the offset past all: {r:?}");
    assert!(r.rejected.is_empty(), "no event rejected: {r:?}");
    assert_eq!(r.applied, (0..6).collect::<Vec<_>>(), "all applied: {r:?}");
}
