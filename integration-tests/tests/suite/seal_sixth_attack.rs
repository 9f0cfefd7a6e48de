//! Adversarial review of 67e0c94 (throughput mode's sealed batch; after the seal refuses early,
//! `batch/mod.rs` `one_at_a_time` runs the rest of the poll batch through `Worker::process_after`
//! / `Worker::process`, the head's attempts carried over and capped at `max_attempts`, 9ad463b).
//! What the earlier seal modules (`seal_attack`, `seal_final_attack`, `seal_review_attack`,
//! `seal_count_attack`, `seal_handover_attack`) do not model:
//!
//! - `max_attempts` 1: the head's attempts are used up by its first counted failure, so the
//!   transaction that gives it up (dead letter or hold) is the one the refusal drops;
//! - a key already held by an earlier run of the group (held keys loaded at the takeover) whose
//!   later events are in the refused transaction, with a permanent failure of another key at
//!   the head of that transaction (held in it, then dropped with it);
//! - a batch handler whose body checks its constraints only for runs of more than one event
//!   (it refuses for some calls only), with copies of events applied by an earlier run and of
//!   events of the same poll batch interleaved;
//! - the runtime's own counters (`Stats`: applied, duplicates, dead letters, retries) compared
//!   with `max_batch` 1, besides the database's fate.
//!
//! Each scenario runs with `max_batch` 64 and 1 (one record per transaction, the yardstick), on
//! its own database, topic and group.
//!
//! Found on 67e0c94 (2 shared cores; figures in each test's comment):
//!
//! - broke (fixed since: the clock restarts after each commit), `a_progressing_one_at_a_time_run_is_not_reported_stalled`: after a
//!   refusal, a poll batch whose one-record transactions commit one after another for more than
//!   30 s is reported stalled (`/readyz` 503 from 30.4–32.4 s, stall gauge up to 35.6 s, "consumer
//!   stalled" warning); `max_batch` 1 side by side: gauge at most 0.8 s. The stall clock restarts
//!   only when the whole poll batch is done;
//! - broke (ignored, `a_deferred_constraint_satisfied_by_a_later_event_ends_as_one_at_a_time`;
//!   not the seal's doing): an event whose own transaction always fails a deferred foreign key,
//!   satisfied by a later event of the same poll batch, is applied in a batch; `max_batch` 1
//!   dead-letters it (or holds its key, and the later event with it);
//! - held: `max_attempts` 1 with the giving-up transaction dropped by a refusal (dead letter and
//!   hold); a key held before the batch and one held in the refused transaction; a batch
//!   handler refusing in bulk among copies; the deferred constraint with a refusal between —
//!   fate and counters as `max_batch` 1.
//!
//! Not attacked here, by reasoning: a consumer killed, or its partition revoked, during the
//! one-at-a-time run after a refusal. The head's carried attempts live in memory only, as one
//! record per transaction's do: a new owner starts from 0 in both modes; and the carried count
//! only changes an outcome when the head is used up (then `process_after` gives it up in its
//! first transaction, before any body runs) or, for a handler that is not deterministic, when
//! it succeeded in the refused transaction. The kill itself is covered by
//! `seal_handover_attack::a_batch_handlers_consumer_killed_after_the_switch_applies_each_event_once`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postal_consumer::{
    Batch, BatchHandler, BoxFuture, Consumer, Event, FinalFailure, Handler, HandlerError,
};
use postal_integration_tests::{services, unique};
use serde_json::json;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
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
    /// … DEFERRED`), failing with the error: the seal refuses in a batch.
    Checks,
    /// Writes its effect; a batch handler's call that holds it and at least one other event
    /// checks its deferred constraints once, after its events (a "bulk check"). As a single
    /// handler, or in a call of one event: writes only.
    ChecksInBulk,
    /// Fails retryably on every call ("event n failed").
    FailAlways,
    /// Fails for good ("event n is malformed").
    Permanent,
    /// Writes its effect and takes [`SLOW`] doing so (a call to a slow service).
    Slow,
    /// Writes its effect and a row of `children` whose parent is [`PARENT`]: a deferred foreign
    /// key, checked at the transaction's commit (or by `SET CONSTRAINTS ALL IMMEDIATE`).
    Child,
    /// Writes its effect and the row of `parents` [`PARENT`].
    Parent,
}

/// The parent an [`Act::Child`] refers to and an [`Act::Parent`] writes.
const PARENT: i64 = 100;

/// How long an [`Act::Slow`] body takes.
const SLOW: Duration = Duration::from_millis(800);

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
    fn act_of(&self, n: i64) -> Act {
        self.acts.get(&n).copied().unwrap_or(Act::Write)
    }

    async fn act(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        id: Uuid,
        n: i64,
    ) -> Result<(), HandlerError> {
        *self.calls.lock().unwrap().entry(n).or_default() += 1;
        match self.act_of(n) {
            Act::Write | Act::ChecksInBulk => insert(tx, &[(id, n)]).await?,
            Act::Checks => {
                insert(tx, &[(id, n)]).await?;
                check_constraints(tx).await?;
            }
            Act::FailAlways => {
                return Err(HandlerError::retryable(format!("event {n} failed")));
            }
            Act::Permanent => {
                return Err(HandlerError::permanent(format!("event {n} is malformed")))
            }
            Act::Slow => {
                insert(tx, &[(id, n)]).await?;
                tokio::time::sleep(SLOW).await;
            }
            Act::Child => {
                insert(tx, &[(id, n)]).await?;
                sqlx::query("INSERT INTO children (parent) VALUES ($1)")
                    .bind(PARENT)
                    .execute(&mut **tx)
                    .await?;
            }
            Act::Parent => {
                insert(tx, &[(id, n)]).await?;
                sqlx::query("INSERT INTO parents (id) VALUES ($1)")
                    .bind(PARENT)
                    .execute(&mut **tx)
                    .await?;
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
/// (the first failure fails the call); then, if the call holds more than one event and one of
/// them is [`Act::ChecksInBulk`], one constraint check for the call.
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
            let mut bulk = false;
            let mut count = 0;
            for e in events.iter() {
                let (id, n) = fields(e);
                bulk |= self.0.act_of(n) == Act::ChecksInBulk;
                count += 1;
                self.0.act(tx, id, n).await?;
            }
            if bulk && count > 1 {
                check_constraints(tx).await?;
            }
            Ok(())
        })
    }
}

/// A record of a scenario: its event id (copies share one), key and `n`.
#[derive(Clone, Copy, Debug)]
struct Rec {
    id: Uuid,
    key: &'static str,
    n: i64,
}

fn raw(r: &Rec) -> RawRecord {
    job(r.id, r.key, json!({ "n": r.n }))
}

/// Records with `n` 0.. on the keys given, each its own event.
fn keyed(keys: &[&'static str]) -> Vec<Rec> {
    keys.iter()
        .enumerate()
        .map(|(n, key)| Rec {
            id: Uuid::now_v7(),
            key,
            n: n as i64,
        })
        .collect()
}

/// A scenario: the records (on partition 0, in order), the acts, the settings. With `split`,
/// a first consumer takes the first `split` records (until the partition is past them) and
/// stops; the rest are produced then, and a second consumer of the group (a new process: it
/// loads the held keys at the takeover) takes them all in its first poll batch.
struct Scenario {
    records: Vec<Rec>,
    acts: BTreeMap<i64, Act>,
    batch_handler: bool,
    hold: bool,
    max_attempts: u32,
    split: Option<usize>,
}

/// The runtime's counters, summed over the run's consumers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counted {
    applied: u64,
    duplicates: u64,
    dead_letters: u64,
    retries: u64,
}

impl Counted {
    fn add(&mut self, s: &postal_consumer::Stats) {
        let s = s.snapshot();
        self.applied += s.applied;
        self.duplicates += s.duplicates;
        self.dead_letters += s.dead_letters;
        self.retries += s.retries;
    }
}

/// A dead letter or held key: (offset, reason, attempts, error).
type Ended = (i64, String, i32, String);

/// What a run measured.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct Measured {
    max_batch: usize,
    /// `effects.n`, in the order written.
    applied: Vec<i64>,
    twice: bool,
    dead: Vec<Ended>,
    /// Held records' offsets.
    held: Vec<i64>,
    /// Held keys (head offset, reason, attempts, error).
    heads: Vec<Ended>,
    offset: Option<i64>,
    /// The runtime's counters.
    counted: Counted,
    /// Body calls per `n`.
    calls: BTreeMap<i64, u32>,
    secs: f64,
}

/// What must be alike with `max_batch` 1.
type Fate = (
    Vec<i64>,
    Vec<Ended>,
    Vec<i64>,
    Vec<Ended>,
    Option<i64>,
    Counted,
);

impl Measured {
    fn fate(&self) -> Fate {
        (
            self.applied.clone(),
            self.dead.clone(),
            self.held.clone(),
            self.heads.clone(),
            self.offset,
            self.counted,
        )
    }

    fn calls_of(&self, n: i64) -> u32 {
        self.calls.get(&n).copied().unwrap_or(0)
    }
}

/// Polls until the partition's stored offset is `end` (or `within` passed).
async fn until_offset(pool: &PgPool, topic: &str, end: i64, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if stored_offset(pool, topic).await == Some(end) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Runs `s` with `max_batch`, until the partition's stored offset is past every record (or
/// 60 s).
async fn run(s: &Scenario, max_batch: usize) -> Measured {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    for ddl in [
        "CREATE TABLE parents (id bigint PRIMARY KEY)",
        "CREATE TABLE children (parent bigint NOT NULL REFERENCES parents (id)
             DEFERRABLE INITIALLY DEFERRED)",
    ] {
        sqlx::query(ddl).execute(&db.pool).await.unwrap();
    }
    let topic = unique("seal_sixth");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let probe = Probe {
        acts: Arc::new(s.acts.clone()),
        calls: Arc::default(),
    };
    let group = unique("g");
    let build = |pool: PgPool| {
        let mut config = consumer_config(&svc.bootstrap, &group, CONSUMER);
        config.max_batch = max_batch;
        config.max_attempts = s.max_attempts;
        if s.hold {
            config.final_failure = FinalFailure::HoldKey;
        }
        let builder = Consumer::builder(pool, config);
        let builder = if s.batch_handler {
            builder.on_batch(&topic, "job", BatchProbe(probe.clone()))
        } else {
            builder.on(&topic, "job", probe.clone())
        };
        builder.build().expect("consumer")
    };
    let started = Instant::now();
    let mut counted = Counted::default();
    let first = s.split.unwrap_or(s.records.len());
    let raws: Vec<RawRecord> = s.records[..first].iter().map(raw).collect();
    produce(&svc.bootstrap, &topic, Some(0), &raws).await;
    let pool = db.pool_of(5).await;
    let running = RunningConsumer::start(build(pool.clone()));
    until_offset(&db.pool, &topic, first as i64, Duration::from_secs(60)).await;
    let stats = running.stats.clone();
    running.stop().await;
    counted.add(&stats);
    pool.close().await;
    if s.split.is_some() {
        let raws: Vec<RawRecord> = s.records[first..].iter().map(raw).collect();
        produce(&svc.bootstrap, &topic, Some(0), &raws).await;
        let pool = db.pool_of(5).await;
        let running = RunningConsumer::start(build(pool.clone()));
        until_offset(
            &db.pool,
            &topic,
            s.records.len() as i64,
            Duration::from_secs(60),
        )
        .await;
        let stats = running.stats.clone();
        running.stop().await;
        counted.add(&stats);
        pool.close().await;
    }
    let secs = started.elapsed().as_secs_f64();
    let (applied, twice) = applied(&db.pool).await;
    let r = Measured {
        max_batch,
        applied,
        twice,
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
        heads: sqlx::query_as(
            "SELECT head_offset, reason, attempts, error FROM postal.held_keys ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap(),
        offset: stored_offset(&db.pool, &topic).await,
        counted,
        calls: probe.calls.lock().unwrap().clone(),
        secs,
    };
    eprintln!("seal sixth: {r:?}");
    assert_once_in_order(&r.applied, r.twice, &r);
    r
}

/// Runs `s` with `max_batch` 64 and 1 and asserts the same fate (counters included).
async fn as_one_at_a_time(s: &Scenario) -> (Measured, Measured) {
    let batched = run(s, 64).await;
    let single = run(s, 1).await;
    assert_eq!(
        batched.fate(),
        single.fate(),
        "as max_batch 1:\n{batched:?}\n{single:?}"
    );
    (batched, single)
}

// --- 1. max_attempts 1: the head's giving up is what the refusal drops ------------------------

/// Keys a b a b a b; event 0 (a) fails retryably on every call, event 3 (b) checks its
/// constraints; `max_attempts` 1.
fn one_attempt(hold: bool) -> Scenario {
    Scenario {
        records: keyed(&["a", "b", "a", "b", "a", "b"]),
        acts: BTreeMap::from([(0, Act::FailAlways), (3, Act::Checks)]),
        batch_handler: false,
        hold,
        max_attempts: 1,
        split: None,
    }
}

/// Guarantee attacked: with `max_attempts` 1 an event gets exactly one counted attempt and its
/// dead letter says so, in throughput mode as one record per transaction — also when the
/// transaction that dead-letters it is dropped by a later body's refusal and the head is handed
/// to `process_after` with its attempts (capped at `max_attempts`, 9ad463b). Scenario:
/// [`one_attempt`] without `HoldKey`. With `max_batch` 64: the optimistic pass fails at event 0
/// (not an attempt), the isolated pass counts its one attempt (retries: none), the next
/// transaction dead-letters it and runs 1..5, event 3 refuses: nothing commits, and the rest
/// runs one per transaction. Measured: applied, dead letters (offset, reason, attempts,
/// error), held, offset, the runtime's counters (applied, duplicates, dead letters, retries);
/// event 0's calls.
///
/// Can fail: handing the head over with 0 attempts (`one_at_a_time(own, queue, 0, "")` in
/// `process_batch`) gives event 0 a third call (the bound below) and, with the counters, no
/// other difference; a dead letter written by the refused transaction and kept would show as
/// a second dead letter (`dead`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_attempt_a_dropped_dead_letter_ends_as_one_at_a_time() {
    let (batched, single) = as_one_at_a_time(&one_attempt(false)).await;
    assert_eq!(batched.applied, vec![1, 2, 3, 4, 5], "{batched:?}");
    assert_eq!(batched.dead.len(), 1, "{batched:?}");
    assert_eq!(batched.dead[0].2, 1, "one attempt: {batched:?}");
    assert_eq!(single.calls_of(0), 1, "{single:?}");
    assert!(
        batched.calls_of(0) <= 2,
        "event 0 ran at most twice (its optimistic call and its one attempt): {batched:?}"
    );
}

/// Guarantee attacked: as [`with_one_attempt_a_dropped_dead_letter_ends_as_one_at_a_time`],
/// with `HoldKey`: event 0's key is held with one attempt, its later events (2, 4) held behind
/// it, key b applied — also when the transaction that held key a is dropped by event 3's
/// refusal. Measured as there, with the held records and keys.
///
/// Can fail: as the test above (event 0's calls); a hold written by the refused transaction
/// and kept, or key a's later events applied, show in `held`/`applied`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_attempt_a_dropped_hold_ends_as_one_at_a_time() {
    let (batched, _) = as_one_at_a_time(&one_attempt(true)).await;
    assert_eq!(batched.applied, vec![1, 3, 5], "{batched:?}");
    assert_eq!(batched.held, vec![0, 2, 4], "{batched:?}");
    assert_eq!(batched.heads.len(), 1, "{batched:?}");
    assert_eq!(batched.heads[0].2, 1, "one attempt: {batched:?}");
    assert!(batched.calls_of(0) <= 2, "{batched:?}");
}

// --- 2. A key held by an earlier run, a permanent head, a refusal ------------------------------

/// `HoldKey`, `max_attempts` 3. First run: 0 (a) fails for good (key a held), 1 (b) applied.
/// Second run, one poll batch: 2 (c) fails for good (key c held in the transaction), 3 (a),
/// 4 (b) checks its constraints (the refusal), 5 (a) checks too (held: never runs), 6 (c),
/// 7 (b), 8 (d).
fn held_before() -> Scenario {
    Scenario {
        records: keyed(&["a", "b", "c", "a", "b", "a", "c", "b", "d"]),
        acts: BTreeMap::from([
            (0, Act::Permanent),
            (2, Act::Permanent),
            (4, Act::Checks),
            (5, Act::Checks),
        ]),
        batch_handler: false,
        hold: true,
        max_attempts: 3,
        split: Some(2),
    }
}

/// Guarantee attacked: per-key order with `HoldKey` across the switch — a key held before the
/// batch (loaded at the takeover) keeps every later event held, and a key held by the refused
/// transaction itself is held again, one record per transaction, with the same head, reason,
/// attempts and error as `max_batch` 1; no event of a held key is applied. Scenario:
/// [`held_before`]. Measured: applied, held records, held keys, dead letters, offset, counters
/// (summed over both runs).
///
/// Can fail: if `one_at_a_time` did not look at the held keys (`process` instead of
/// `Worker::is_held` first), event 3 or 6 would be applied and event 5's check would run
/// (`applied`, `calls`); a hold of the refused transaction kept would double key c's hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_among_keys_held_before_and_in_the_batch_ends_as_one_at_a_time() {
    let (batched, _) = as_one_at_a_time(&held_before()).await;
    assert_eq!(batched.applied, vec![1, 4, 7, 8], "{batched:?}");
    assert_eq!(batched.held, vec![0, 2, 3, 5, 6], "{batched:?}");
    assert_eq!(
        batched.heads.iter().map(|h| h.0).collect::<Vec<_>>(),
        vec![0, 2],
        "{batched:?}"
    );
    assert_eq!(batched.calls_of(5), 0, "event 5 never ran: {batched:?}");
}

// --- 3. A batch handler that checks only in bulk, with copies -----------------------------------

/// A batch handler; `max_attempts` 3. First run: 0 (a), 1 (b), 2 (a), 3 (b) applied. Second
/// run, one poll batch: a copy of 1, 4 (a), a copy of 0, 5 (b, checks in bulk), 6 (a), a copy
/// of 5, a copy of 3, 7 (b), 8 (a) fails for good (dead letter), a copy of 8, 9 (b).
fn bulk_with_copies() -> Scenario {
    let first = keyed(&["a", "b", "a", "b"]);
    let new = |n: i64, key: &'static str| Rec {
        id: Uuid::now_v7(),
        key,
        n,
    };
    let (e4, e5, e6, e7, e8, e9) = (
        new(4, "a"),
        new(5, "b"),
        new(6, "a"),
        new(7, "b"),
        new(8, "a"),
        new(9, "b"),
    );
    let mut records = first.clone();
    records.extend([first[1], e4, first[0], e5, e6, e5, first[3], e7, e8, e8, e9]);
    Scenario {
        records,
        acts: BTreeMap::from([(5, Act::ChecksInBulk), (8, Act::Permanent)]),
        batch_handler: true,
        hold: false,
        max_attempts: 3,
        split: Some(4),
    }
}

/// Guarantee attacked: effectively once and the same counters as `max_batch` 1 for a batch
/// handler whose body refuses for some calls only (its bulk check, in calls of more than one
/// event), with copies of events applied by an earlier run and of events of the same poll batch
/// interleaved, and a permanent failure after the refusal. With `max_batch` 64 the run's first
/// call (4, 5, 6, 7, 8) refuses; one record per transaction the calls hold one event and never
/// check. Scenario: [`bulk_with_copies`]. Measured: applied, dead letters, offset, counters
/// (duplicates: the five copies; dead letters: event 8), summed over both runs.
///
/// Can fail: a copy counted as a new event (or the reverse) shows in `counted.duplicates` or
/// `applied`/`twice`; a dead letter of the refused transaction kept shows in `dead`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handler_refusing_in_bulk_among_copies_ends_as_one_at_a_time() {
    let (batched, _) = as_one_at_a_time(&bulk_with_copies()).await;
    assert_eq!(
        batched.applied,
        vec![0, 1, 2, 3, 4, 5, 6, 7, 9],
        "{batched:?}"
    );
    assert_eq!(batched.dead.len(), 1, "{batched:?}");
    assert_eq!(batched.counted.duplicates, 5, "{batched:?}");
}

// --- 4. A deferred constraint that a later event of the batch satisfies -----------------------

/// Keys o c o c o (an order's events, a customer's); `max_attempts` 3. Event 1 (c) writes a
/// child row whose parent ([`PARENT`]) does not exist yet: a deferred foreign key; event 3 (c)
/// writes that parent. With `refusal`, event 2 (o) checks its constraints (between them).
fn satisfied_later(refusal: bool, hold: bool) -> Scenario {
    let mut acts = BTreeMap::from([(1, Act::Child), (3, Act::Parent)]);
    if refusal {
        acts.insert(2, Act::Checks);
    }
    Scenario {
        records: keyed(&["o", "c", "o", "c", "o"]),
        acts,
        batch_handler: false,
        hold,
        max_attempts: 3,
        split: None,
    }
}

/// Guarantee attacked: throughput mode dead-letters (or holds) what `max_batch` 1 does — "a
/// transaction can also fail with no call to blame: at COMMIT (a deferred constraint …): the
/// runtime takes half the records, down to the first one alone, whose failures count as its
/// attempts (dead letter or held key after `max_attempts`, as with one record per
/// transaction)" (docs/consumer.md). Scenario: [`satisfied_later`] without a refusal: event 1's
/// transaction can never commit on its own (its child row's parent is written by event 3, two
/// offsets later); in a batch the commit checks the foreign key after event 3 ran. Measured:
/// applied, dead letters, held, offset, counters; `max_batch` 64 against 1.
///
/// Measured on 67e0c94 (two runs alike): `max_batch` 64 applied [0, 1, 2, 3, 4], no dead
/// letter; `max_batch` 1 applied [0, 2, 3, 4] and dead-lettered event 1 (`retries_exhausted`,
/// 3 attempts, "gave up after 3 attempts: … violates foreign key constraint …"), counters
/// applied 4 / dead letters 1 / retries 2 against 5 / 0 / 0. With `HoldKey` (run first here):
/// `max_batch` 1 holds key c at event 1 (3 attempts, the foreign key's error) with event 3
/// behind it, applied [0, 2, 4]; `max_batch` 64 applied all five, nothing held — key c's
/// events applied that one record per transaction keeps waiting. With a refusal between the two
/// events ([`a_deferred_constraint_satisfied_later_with_a_refusal_between_ends_as_one_at_a_time`])
/// throughput mode gives `max_batch` 1's fate: whether the event is applied depends on whether
/// another handler of its poll batch happened to run `SET CONSTRAINTS ALL IMMEDIATE`. Cause:
/// the batch's deferred checks run once, at its COMMIT, over every body's writes
/// (`batch/mod.rs` `attempt_in`); the split to find a culprit happens only when that COMMIT
/// fails, so an event whose own transaction fails but whose batch's does not is applied. Not
/// the seal's doing; a property of batching deferred constraints that docs/consumer.md does not
/// state (its yardstick, one record per transaction, dead-letters the event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known: deferred FK violated by event 1, satisfied by event 3: max_batch 64 applied [0..4], no dead letter/hold; max_batch 1 dead-lettered event 1 (retries_exhausted, 3 attempts), applied [0, 2, 3, 4] (HoldKey: held [1, 3])"]
async fn a_deferred_constraint_satisfied_by_a_later_event_ends_as_one_at_a_time() {
    let held = (
        run(&satisfied_later(false, true), 64).await,
        run(&satisfied_later(false, true), 1).await,
    );
    let (batched, _) = as_one_at_a_time(&satisfied_later(false, false)).await;
    assert_eq!(batched.dead.len(), 1, "{batched:?}");
    assert_eq!(held.0.fate(), held.1.fate(), "with HoldKey:\n{held:?}");
}

/// Guarantee attacked: as above, with event 2 (between the child and its parent) checking its
/// constraints: the seal refuses, and `SET CONSTRAINTS ALL IMMEDIATE` also checks event 1's
/// child row before its parent exists; the poll batch then runs one record per transaction.
/// Measured as above. Held on 67e0c94: both modes applied [0, 2, 3, 4] and dead-lettered event
/// 1 (`retries_exhausted`, 3 attempts, the foreign key's error). Can fail: if the refused
/// transaction's work were kept or the head's attempts not counted, event 1 would be applied
/// (as without the refusal, the test above) or dead-lettered with another count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_constraint_satisfied_later_with_a_refusal_between_ends_as_one_at_a_time() {
    let (batched, _) = as_one_at_a_time(&satisfied_later(true, false)).await;
    assert_eq!(batched.applied, vec![0, 2, 3, 4], "{batched:?}");
    assert_eq!(batched.dead.len(), 1, "{batched:?}");
    assert_eq!(batched.dead[0].2, 3, "{batched:?}");
}

// --- 5. The stall watchdog during the one-at-a-time run ------------------------------------------

/// What [`watched_run`] measured.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct Watched {
    max_batch: usize,
    applied: usize,
    twice: bool,
    offset: Option<i64>,
    /// The first `/readyz` 503, seconds after the records were produced.
    not_ready_after: Option<f64>,
    /// The most `postal_consumer_stalled_seconds` read for the partition.
    gauge_max: f64,
    /// Seconds from the records' production until the partition was past them.
    secs: f64,
}

/// `/readyz`'s status code, and the sum of the `postal_consumer_stalled_seconds` lines of
/// `topic`.
async fn ops(port: u16, topic: &str) -> (Option<u16>, f64) {
    let label = format!("topic=\"{topic}\"");
    tokio::task::spawn_blocking(move || {
        let status = crate::procs::http_get(port, "/readyz").and_then(|a| {
            a.lines()
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse::<u16>()
                .ok()
        });
        let gauge = crate::procs::http_get(port, "/metrics")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("postal_consumer_stalled_seconds{"))
            .filter(|l| l.contains(&label))
            .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
            .sum();
        (status, gauge)
    })
    .await
    .unwrap()
}

/// A consumer of [`watched_pair`]: its database, topic and running runtime.
struct Watch {
    max_batch: usize,
    db: postal_integration_tests::TestDb,
    topic: String,
    pool: PgPool,
    running: RunningConsumer,
}

/// Starts a consumer of `events` records of one key (event 0 checks its constraints, every
/// other event's body takes [`SLOW`]) with `max_batch`, serving `/readyz` and `/metrics` on
/// `ops_port` when given.
async fn watch(max_batch: usize, events: usize, ops_port: Option<u16>) -> Watch {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("seal_sixth_watch");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut acts: BTreeMap<i64, Act> = (1..events as i64).map(|n| (n, Act::Slow)).collect();
    acts.insert(0, Act::Checks);
    let probe = Probe {
        acts: Arc::new(acts),
        calls: Arc::default(),
    };
    let pool = db.pool_of(5).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = max_batch;
    config.max_attempts = 3;
    config.ops_addr = ops_port.map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p)));
    let running = RunningConsumer::start(
        Consumer::builder(pool.clone(), config)
            .on(&topic, "job", probe)
            .build()
            .expect("consumer"),
    );
    Watch {
        max_batch,
        db,
        topic,
        pool,
        running,
    }
}

/// Two consumers side by side, one topic and database each: `max_batch` 64 (serving `/readyz`
/// and `/metrics`: the Prometheus recorder is the process's, so it renders both consumers'
/// gauges, told apart by topic) and `max_batch` 1. Each gets `events` records of one key: event
/// 0 checks its constraints (with `max_batch` 64 the seal refuses at once and the poll batch
/// runs one record per transaction), every other event's body takes [`SLOW`]. `/readyz` (the
/// first consumer's) and each topic's stall gauge are read every 500 ms until both partitions
/// are past every record (or 120 s).
async fn watched_pair(events: usize) -> (Watched, Watched) {
    let ops_port = postal_integration_tests::free_port();
    let batched = watch(64, events, Some(ops_port)).await;
    let single = watch(1, events, None).await;
    // Both consumers own their partition before the records come (one poll batch each).
    let deadline = Instant::now() + Duration::from_secs(30);
    while ops(ops_port, &batched.topic).await.0 != Some(200) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let svc = services().await;
    for w in [&batched, &single] {
        let records: Vec<RawRecord> = keyed(&vec!["k"; events]).iter().map(raw).collect();
        produce(&svc.bootstrap, &w.topic, Some(0), &records).await;
    }
    let started = Instant::now();
    let mut seen = [(None, 0.0f64, None), (None, 0.0f64, None)];
    while started.elapsed() < Duration::from_secs(120) {
        let mut done = true;
        for (k, w) in [&batched, &single].into_iter().enumerate() {
            let (status, gauge) = ops(ops_port, &w.topic).await;
            let at = started.elapsed().as_secs_f64();
            seen[k].1 = seen[k].1.max(gauge);
            if k == 0 && status == Some(503) && seen[k].0.is_none() {
                seen[k].0 = Some(at);
            }
            if stored_offset(&w.db.pool, &w.topic).await == Some(events as i64) {
                seen[k].2.get_or_insert(at);
            } else {
                done = false;
            }
        }
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut out = Vec::new();
    for (k, w) in [batched, single].into_iter().enumerate() {
        w.running.stop().await;
        w.pool.close().await;
        let (applied, twice) = applied(&w.db.pool).await;
        out.push(Watched {
            max_batch: w.max_batch,
            applied: applied.len(),
            twice,
            offset: stored_offset(&w.db.pool, &w.topic).await,
            not_ready_after: seen[k].0,
            gauge_max: seen[k].1,
            secs: seen[k].2.unwrap_or(f64::NAN),
        });
    }
    let single = out.pop().unwrap();
    let batched = out.pop().unwrap();
    eprintln!("watched:\n{batched:?}\n{single:?}");
    (batched, single)
}

/// Guarantee attacked: the stall watchdog says a partition is stalled ("records have waited
/// 30 s with no transaction completing": `/readyz` 503, `postal_consumer_stalled_seconds` at
/// 30 s or more) only when no transaction of it completes — and throughput mode, after the
/// switch to one record per transaction, behaves as `max_batch` 1, where each committed record
/// restarts the clock. Scenario: [`watched_pair`] with 46 events (45 × 0.8 s = 36 s of
/// handlers, each record its own committed transaction after the refusal), `max_batch` 64
/// and 1 side by side. Measured: the first `/readyz` 503 after the records were produced
/// (the `max_batch` 64 consumer's), each partition's stall gauge maximum, applied, offset.
///
/// Measured on 67e0c94 (2 shared cores): `max_batch` 64: `/readyz` 503 from 30.5 s (32.4 s in
/// an earlier run), gauge up to 35.6 s and the warning "consumer stalled: … records have waited
/// 30s with no transaction completing … or a handler that keeps failing", while the partition
/// committed its 46 records one transaction each (past all after 36.0 s); `max_batch` 1, side
/// by side: gauge at most 0.8 s, never stalled; both applied 46 once each. Cause: the clock
/// (`stall::Waiting`) restarts only when the partition loop gets `Step::Done` for the whole
/// poll batch (`partition/own.rs`, `self.queued.waiting.advanced()`); `batch/mod.rs`
/// `one_at_a_time` (and `process_batch`'s own loop of transactions, e.g. after a split) commits
/// transaction after transaction without restarting it, so a poll batch whose one-at-a-time run
/// outlasts `STALL_AFTER` is reported stalled — and a `PostalConsumerStalled`-style alert or a
/// probe on `/readyz` acts on a partition that is moving. Fix: restart the clock after each
/// commit (`waiting.advanced()` in `process_after`'s success and in `process_batch` when
/// `c.done > 0`).
///
/// Fixed: the clock restarts after each committed transaction of a poll batch (both places).
/// Uses `ops_addr`: the Prometheus recorder is the process's, shared with the suite's other
/// tests that serve `/metrics` (`postal_ops::serve` installs it once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progressing_one_at_a_time_run_is_not_reported_stalled() {
    let (batched, single) = watched_pair(46).await;
    for r in [&batched, &single] {
        assert_eq!(r.offset, Some(46), "{batched:?}\n{single:?}");
        assert_eq!(r.applied, 46, "{batched:?}\n{single:?}");
        assert!(!r.twice, "{batched:?}\n{single:?}");
    }
    let stall = postal_consumer::STALL_AFTER.as_secs_f64();
    assert!(
        single.gauge_max < stall,
        "max_batch 1 is never stalled: {single:?}"
    );
    assert!(
        batched.not_ready_after.is_none() && batched.gauge_max < stall,
        "a partition committing one record per transaction is not reported stalled, as with \
         max_batch 1:\n{batched:?}\n{single:?}"
    );
}
