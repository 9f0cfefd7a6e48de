//! The consumer's transaction protocol against real PostgreSQL, without Kafka: directed
//! regressions for the holes an adversarial review found, and a randomized test that keeps the
//! protocol's invariants under random mixes of duplicates, republished copies, failures,
//! restarts, stale owners, replays and batch sizes.
//!
//! `POSTAL_PROTOCOL_CASES` sets how many random cases run (default 40; the long run uses
//! thousands), `POSTAL_PROTOCOL_SEED` the first case's seed (default random). A failure prints
//! the case's seed: `POSTAL_PROTOCOL_SEED=<seed> POSTAL_PROTOCOL_CASES=1` runs that case again.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use postal_consumer::testing::{Delivered, Protocol, TestRecord};
use postal_consumer::{Consumer, ConsumerConfig};
use postal_integration_tests::{fresh_postgres_db, unique};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::effects_table;
use crate::handlers;

const MAX_ATTEMPTS: u32 = 3;

fn config(group: &str) -> ConsumerConfig {
    // The protocol harness never fetches; the client is created and left idle.
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let mut c = ConsumerConfig::new(&bootstrap, group);
    c.backoff = postal_producer::Backoff {
        base: Duration::from_millis(1),
        max: Duration::from_millis(2),
    };
    c.max_attempts = MAX_ATTEMPTS;
    c
}

/// A protocol driver for `topic`: the `apply` handler for type `job`, consumer `effects`.
fn protocol(pool: &PgPool, topic: &str, group: &str) -> (Consumer, Protocol) {
    protocol_with(pool, topic, group, handlers::Probe::default())
}

/// [`protocol`] whose handler reports its runs to `probe`.
fn protocol_with(
    pool: &PgPool,
    topic: &str,
    group: &str,
    probe: handlers::Probe,
) -> (Consumer, Protocol) {
    let consumer = Consumer::builder(pool.clone(), config(group))
        .state(probe)
        .on(topic, "job", handlers::apply)
        .build()
        .expect("consumer");
    let protocol = consumer.protocol();
    (consumer, protocol)
}

pub(crate) fn record(
    topic: &str,
    partition: i32,
    offset: i64,
    id: Uuid,
    key: &str,
    payload: serde_json::Value,
) -> TestRecord {
    TestRecord {
        topic: topic.into(),
        partition,
        offset,
        key: Some(key.as_bytes().to_vec()),
        payload: Some(serde_json::to_vec(&payload).unwrap()),
        headers: vec![
            ("ce_id".into(), Some(id.to_string().into_bytes())),
            ("ce_type".into(), Some(b"job".to_vec())),
            ("content-type".into(), Some(b"application/json".to_vec())),
        ],
    }
}

/// A protocol driver whose `job` handler is the batch handler [`handlers::apply_batch`].
fn protocol_batch(
    pool: &PgPool,
    topic: &str,
    group: &str,
    probe: handlers::Probe,
) -> (Consumer, Protocol) {
    let consumer = Consumer::builder(pool.clone(), config(group))
        .state(probe)
        .on_batch(topic, "job", handlers::apply_batch)
        .build()
        .expect("consumer");
    let protocol = consumer.protocol();
    (consumer, protocol)
}

/// The `effects` rows of `ids`, in the order they were written.
async fn effects_in_order(pool: &PgPool, ids: &[Uuid]) -> Vec<Uuid> {
    sqlx::query_scalar("SELECT event_id FROM effects WHERE event_id = ANY($1) ORDER BY id")
        .bind(ids)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A record without an event id (dead-lettered as `missing_event_id`).
fn junk(topic: &str, partition: i32, offset: i64) -> TestRecord {
    TestRecord {
        topic: topic.into(),
        partition,
        offset,
        key: Some(b"junk".to_vec()),
        payload: Some(b"{}".to_vec()),
        headers: vec![("ce_type".into(), Some(b"job".to_vec()))],
    }
}

async fn applied(pool: &PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn dead_lettered(pool: &PgPool, topic: &str) -> Vec<(i64, Option<Uuid>)> {
    sqlx::query_as(
        "SELECT kafka_offset, event_id FROM postal.dead_letters WHERE topic = $1 ORDER BY id",
    )
    .bind(topic)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Guarantee (hole 1): in throughput mode an applied event keeps its dedup row whatever the
/// rest of its batch does. A batch of E1 (applied), E2 (fails retryably in both passes, then
/// succeeds) and a republished copy of E1 applies E1 once — the clean-up after the retryable
/// stop used to delete E1's dedup row with the rows of the unfinished records, and the copy
/// was applied again.
#[tokio::test]
async fn an_applied_event_keeps_its_dedup_row_when_its_batch_stops_on_a_retryable_failure() {
    let db = fresh_postgres_db().await;
    effects_table(&db.pool).await;
    let topic = unique("proto");
    let (_c, p) = protocol(&db.pool, &topic, &unique("g"));
    let (e1, e2) = (Uuid::now_v7(), Uuid::now_v7());
    let batch = vec![
        record(&topic, 0, 0, e1, "k", json!({"n": 1})),
        record(
            &topic,
            0,
            1,
            e2,
            "k",
            json!({"n": 2, "fail": "retry", "retries": 2}),
        ),
        record(&topic, 0, 2, e1, "k", json!({"n": 1})),
    ];
    let own = p.claim(&topic, 0).await.unwrap();
    assert_eq!(p.deliver(&own, batch).await, Delivered::Done);
    assert_eq!(applied(&db.pool, e1).await, 1, "E1 applied exactly once");
    assert_eq!(applied(&db.pool, e2).await, 1, "E2 applied exactly once");
}

/// Guarantee (hole 3): a dead-lettered event is never applied from a later copy of it, in
/// per-message and in throughput mode: D (failing until its attempts are used up) is
/// dead-lettered, LATER (same key) applied, and D's republished copy — whose handler would
/// now succeed — is a duplicate. Before, no dedup row was written for a dead letter and the
/// copy applied D after LATER.
#[tokio::test]
async fn a_dead_lettered_event_is_never_applied_from_a_later_copy() {
    let db = fresh_postgres_db().await;
    effects_table(&db.pool).await;
    for batched in [false, true] {
        let topic = unique("proto");
        let (_c, p) = protocol(&db.pool, &topic, &unique("g"));
        let (d, later) = (Uuid::now_v7(), Uuid::now_v7());
        // D fails as often as its handler runs before it is dead-lettered (in throughput
        // mode once more: the optimistic pass's run does not count as an attempt), then
        // would succeed.
        let runs = if batched {
            MAX_ATTEMPTS + 1
        } else {
            MAX_ATTEMPTS
        };
        let d_payload = json!({"n": 1, "fail": "retry", "retries": runs});
        let records = vec![
            record(&topic, 0, 0, d, "k", d_payload.clone()),
            record(&topic, 0, 1, later, "k", json!({"n": 2})),
            record(&topic, 0, 2, d, "k", d_payload),
        ];
        let own = p.claim(&topic, 0).await.unwrap();
        if batched {
            assert_eq!(p.deliver(&own, records).await, Delivered::Done);
        } else {
            for r in records {
                assert_eq!(p.deliver(&own, vec![r]).await, Delivered::Done);
            }
        }
        assert_eq!(
            applied(&db.pool, d).await,
            0,
            "batched={batched}: D never applied"
        );
        assert_eq!(applied(&db.pool, later).await, 1, "batched={batched}");
        assert_eq!(
            dead_lettered(&db.pool, &topic).await,
            vec![(0, Some(d))],
            "batched={batched}: D is one dead letter"
        );
    }
}

/// Guarantee (hole 6, savepoints): in throughput mode a handler that swallows a database
/// error (returns Ok with its transaction failed) counts as a failed attempt and is
/// dead-lettered after `max_attempts`; the records around it commit. Before, the failed
/// `RELEASE SAVEPOINT` was retried as a database outage, forever.
#[tokio::test]
async fn a_handler_that_swallows_a_database_error_is_dead_lettered_in_throughput_mode() {
    let db = fresh_postgres_db().await;
    effects_table(&db.pool).await;
    let topic = unique("proto");
    let probe = handlers::Probe::default();
    let (_c, p) = protocol_with(&db.pool, &topic, &unique("g"), probe.clone());
    let (a, bad, b) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let records = vec![
        record(&topic, 0, 0, a, "k", json!({"n": 1})),
        record(&topic, 0, 1, bad, "k", json!({"n": 2, "fail": "swallow"})),
        record(&topic, 0, 2, b, "k", json!({"n": 3})),
    ];
    let own = p.claim(&topic, 0).await.unwrap();
    let done = tokio::time::timeout(Duration::from_secs(30), p.deliver(&own, records))
        .await
        .expect("the batch finishes instead of retrying forever");
    assert_eq!(done, Delivered::Done);
    assert_eq!(applied(&db.pool, a).await, 1);
    assert_eq!(applied(&db.pool, bad).await, 0);
    assert_eq!(applied(&db.pool, b).await, 1);
    assert_eq!(dead_lettered(&db.pool, &topic).await, vec![(1, Some(bad))]);
    // The optimistic pass's run (the whole batch together) does not count as an attempt.
    assert_eq!(probe.attempts(bad), MAX_ATTEMPTS + 1);
}

/// Guarantee: a batch handler gets a partition batch's new events in one call, in partition
/// order, each event id once: a batch holding A, B, A again, C and B again applies A, B and C
/// once each, in that order, in one call; delivered again (a restart before the Kafka commit),
/// nothing is applied.
#[tokio::test]
async fn a_batch_handler_applies_each_event_of_a_batch_once_in_order() {
    let db = fresh_postgres_db().await;
    effects_table(&db.pool).await;
    let topic = unique("proto");
    let probe = handlers::Probe::default();
    let (_c, p) = protocol_batch(&db.pool, &topic, &unique("g"), probe.clone());
    let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let log = [a, b, a, c, b];
    let records: Vec<TestRecord> = log
        .iter()
        .enumerate()
        .map(|(o, id)| record(&topic, 0, o as i64, *id, "k", json!({"n": o})))
        .collect();
    let own = p.claim(&topic, 0).await.unwrap();
    assert_eq!(p.deliver(&own, records.clone()).await, Delivered::Done);
    assert_eq!(effects_in_order(&db.pool, &[a, b, c]).await, vec![a, b, c]);
    for id in [a, b, c] {
        assert_eq!(probe.attempts(id), 1, "one call for the whole batch");
    }
    // Delivered again by a new owner from offset 0: every record is a duplicate.
    let own = p.claim(&topic, 0).await.unwrap();
    assert_eq!(p.deliver(&own, records).await, Delivered::Done);
    assert_eq!(effects_in_order(&db.pool, &[a, b, c]).await, vec![a, b, c]);
    assert_eq!(probe.attempts(a), 1, "duplicates do not reach the handler");
}

/// Guarantee: a failing event in the middle of a batch is isolated without applying any other
/// event twice — a permanent failure, a panic, a handler that swallows a database error, a
/// payload that does not decode and a retryable failure that never ends are each dead-lettered
/// alone (the last after `max_attempts` transactions), every other event is applied once and
/// in partition order.
#[tokio::test]
async fn a_failing_event_in_the_middle_of_a_batch_is_dead_lettered_alone() {
    let db = fresh_postgres_db().await;
    effects_table(&db.pool).await;
    for failure in ["permanent", "panic", "swallow", "undecodable", "retry"] {
        let topic = unique("proto");
        let probe = handlers::Probe::default();
        let (_c, p) = protocol_batch(&db.pool, &topic, &unique("g"), probe.clone());
        let ids: Vec<Uuid> = (0..9).map(|_| Uuid::now_v7()).collect();
        let bad = 5;
        let records: Vec<TestRecord> = ids
            .iter()
            .enumerate()
            .map(|(o, id)| {
                let payload = if o != bad {
                    json!({"n": o})
                } else if failure == "undecodable" {
                    json!({"n": "not a number"})
                } else {
                    json!({"n": o, "fail": failure, "retries": 1_000_000})
                };
                record(&topic, 0, o as i64, *id, "k", payload)
            })
            .collect();
        let own = p.claim(&topic, 0).await.unwrap();
        let done = tokio::time::timeout(Duration::from_secs(60), p.deliver(&own, records))
            .await
            .expect("the batch finishes");
        assert_eq!(done, Delivered::Done, "{failure}");
        let good: Vec<Uuid> = ids
            .iter()
            .enumerate()
            .filter(|(o, _)| *o != bad)
            .map(|(_, id)| *id)
            .collect();
        assert_eq!(
            effects_in_order(&db.pool, &ids).await,
            good,
            "{failure}: every other event once, in order; the culprit not at all"
        );
        assert_eq!(
            dead_lettered(&db.pool, &topic).await,
            vec![(bad as i64, Some(ids[bad]))],
            "{failure}: the culprit is the one dead letter"
        );
        let reason: String =
            sqlx::query_scalar("SELECT reason FROM postal.dead_letters WHERE topic = $1")
                .bind(&topic)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        let expected = match failure {
            "swallow" | "retry" => "retries_exhausted",
            other => other,
        };
        assert_eq!(reason, expected, "{failure}");
    }
}

/// Guarantee: `testing::deliver_batch` runs a batch handler as the runtime does — one call with
/// the new events (a repeated id once), dedup rows and effects committed together — and a
/// second delivery of the same events is all duplicates; a failing batch commits nothing.
#[tokio::test]
async fn deliver_batch_applies_new_events_once() {
    use postal_consumer::testing::deliver_batch;
    use postal_consumer::{Event, EventId, IntoBatchHandler, Outcome};
    let db = fresh_postgres_db().await;
    effects_table(&db.pool).await;
    let probe = handlers::Probe::default();
    let handler = handlers::apply_batch.into_batch_handler(&probe);
    let job = |n: i64, fail: Option<&str>| handlers::Job {
        n,
        fail: fail.map(str::to_owned),
        retries: 0,
        next: None,
    };
    let (a, b) = (EventId::new(), EventId::new());
    let events = || {
        vec![
            Event::new(a, "job", job(1, None)),
            Event::new(b, "job", job(2, None)),
            Event::new(a, "job", job(1, None)),
        ]
    };
    use Outcome::{Applied, Duplicate};
    let first = deliver_batch(&db.pool, &handler, events()).await.unwrap();
    assert_eq!(first, [Applied, Applied, Duplicate]);
    let again = deliver_batch(&db.pool, &handler, events()).await.unwrap();
    assert_eq!(again, [Duplicate, Duplicate, Duplicate]);
    let ids = [a.as_uuid(), b.as_uuid()];
    assert_eq!(effects_in_order(&db.pool, &ids).await, ids.to_vec());
    let c = EventId::new();
    let failing = vec![
        Event::new(c, "job", job(3, None)),
        Event::new(EventId::new(), "job", job(4, Some("permanent"))),
    ];
    assert!(deliver_batch(&db.pool, &handler, failing).await.is_err());
    let kept: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.processed_events WHERE event_id = $1")
            .bind(c.as_uuid())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (applied(&db.pool, c.as_uuid()).await, kept),
        (0, 0),
        "nothing of a failed batch commits"
    );
}

// ---------------------------------------------------------------------------------------------
// The randomized protocol test.

#[derive(Clone, Copy, Debug)]
enum Behavior {
    Ok,
    /// Fails this many times (fewer than MAX_ATTEMPTS), then succeeds.
    Retry(u32),
    /// Fails every attempt: dead-lettered as retries_exhausted.
    RetryForever,
    Permanent,
    Panic,
}

#[derive(Clone, Debug)]
struct Ev {
    id: Uuid,
    key: usize,
    /// Its place in the sequence of all events (per key increasing).
    n: i64,
    behavior: Behavior,
}

impl Ev {
    fn payload(&self) -> serde_json::Value {
        match self.behavior {
            Behavior::Ok => json!({"n": self.n}),
            Behavior::Retry(k) => json!({"n": self.n, "fail": "retry", "retries": k}),
            Behavior::RetryForever => json!({"n": self.n, "fail": "retry", "retries": 1_000_000}),
            Behavior::Permanent => json!({"n": self.n, "fail": "permanent"}),
            Behavior::Panic => json!({"n": self.n, "fail": "panic"}),
        }
    }

    fn dies(&self) -> bool {
        matches!(
            self.behavior,
            Behavior::RetryForever | Behavior::Permanent | Behavior::Panic
        )
    }
}

#[derive(Clone, Copy, Debug)]
enum Entry {
    /// The event's first record.
    Original(usize),
    /// A republished copy (same id) at a later offset.
    Copy(usize),
    /// A record without an event id.
    Junk,
}

/// One random case: events, the partitions' logs, and how they are delivered.
#[derive(Debug)]
struct Case {
    events: Vec<Ev>,
    logs: Vec<Vec<Entry>>,
    /// Largest batch handed over at once (1: per-message mode only).
    max_batch: usize,
    /// Whether the handler is the batch handler ([`handlers::apply_batch`]).
    batch_handler: bool,
}

fn generate(rng: &mut StdRng) -> Case {
    let partitions = rng.random_range(1..=2usize);
    let keys = rng.random_range(1..=4usize);
    let n = rng.random_range(1..=24usize);
    let events: Vec<Ev> = (0..n)
        .map(|i| Ev {
            id: Uuid::now_v7(),
            key: rng.random_range(0..keys),
            n: i as i64,
            behavior: match rng.random_range(0..20) {
                0..=11 => Behavior::Ok,
                12..=14 => Behavior::Retry(rng.random_range(1..MAX_ATTEMPTS)),
                15..=16 => Behavior::RetryForever,
                17..=18 => Behavior::Permanent,
                _ => Behavior::Panic,
            },
        })
        .collect();
    let mut logs = vec![Vec::new(); partitions];
    for (i, e) in events.iter().enumerate() {
        let log = &mut logs[e.key % partitions];
        log.push(Entry::Original(i));
        // Republished copies of earlier events of this partition (a relay that crashed
        // between the broker's ack and its commit publishes them again, later).
        while rng.random_bool(0.2) {
            let earlier: Vec<usize> = log
                .iter()
                .filter_map(|e| match e {
                    Entry::Original(i) => Some(*i),
                    _ => None,
                })
                .collect();
            log.push(Entry::Copy(earlier[rng.random_range(0..earlier.len())]));
        }
        // A copy right after the original: mostly in the same batch (a duplicate inside it).
        if rng.random_bool(0.1) {
            log.push(Entry::Copy(i));
        }
        if rng.random_bool(0.03) {
            log.push(Entry::Junk);
        }
    }
    let max_batch = match rng.random_range(0..3) {
        0 => 1,
        _ => rng.random_range(2..=8),
    };
    Case {
        events,
        logs,
        max_batch,
        batch_handler: rng.random_bool(0.5),
    }
}

fn to_record(case: &Case, topic: &str, partition: usize, offset: usize) -> TestRecord {
    let (p, o) = (partition as i32, offset as i64);
    match case.logs[partition][offset] {
        Entry::Original(i) | Entry::Copy(i) => {
            let e = &case.events[i];
            record(topic, p, o, e.id, &format!("key-{}", e.key), e.payload())
        }
        Entry::Junk => junk(topic, p, o),
    }
}

pub(crate) struct Owner {
    pub(crate) own: postal_consumer::testing::offsets::Ownership,
    /// The next offset this owner hands over.
    pub(crate) position: usize,
}

pub(crate) async fn stored(pool: &PgPool, group: &str, topic: &str, partition: usize) -> usize {
    let next: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets
         WHERE group_id = $1 AND topic = $2 AND partition = $3",
    )
    .bind(group)
    .bind(topic)
    .bind(partition as i32)
    .fetch_optional(pool)
    .await
    .unwrap();
    next.flatten().unwrap_or(0) as usize
}

/// Everything the database holds about the case's events: (effects per id in application
/// order, dead-lettered ids, dead-letter count per offset).
async fn observed(
    pool: &PgPool,
    topic: &str,
    case: &Case,
) -> (Vec<Uuid>, Vec<(i32, i64, Option<Uuid>)>) {
    let ids: Vec<Uuid> = case.events.iter().map(|e| e.id).collect();
    let effects: Vec<Uuid> =
        sqlx::query_scalar("SELECT event_id FROM effects WHERE event_id = ANY($1) ORDER BY id")
            .bind(&ids)
            .fetch_all(pool)
            .await
            .unwrap();
    let dead: Vec<(i32, i64, Option<Uuid>)> = sqlx::query_as(
        "SELECT partition, kafka_offset, event_id FROM postal.dead_letters WHERE topic = $1 ORDER BY id",
    )
    .bind(topic)
    .fetch_all(pool)
    .await
    .unwrap();
    (effects, dead)
}

/// The stored offset is never ahead of the effects: every record of `part` below it is
/// finished (applied, dead-lettered, or a copy of one of those).
async fn stored_not_ahead(
    pool: &PgPool,
    group: &str,
    topic: &str,
    case: &Case,
    part: usize,
) -> Result<(), String> {
    // The offset first: a transaction of a killed delivery may still commit meanwhile, and
    // what it commits with the offset is then visible to the later read of the effects.
    let below = stored(pool, group, topic, part).await;
    let (effects, dead) = observed(pool, topic, case).await;
    let applied: HashSet<Uuid> = effects.iter().copied().collect();
    let dead_ids: HashSet<Uuid> = dead.iter().filter_map(|d| d.2).collect();
    for o in 0..below {
        let finished = match case.logs[part][o] {
            Entry::Original(i) | Entry::Copy(i) => {
                let id = case.events[i].id;
                applied.contains(&id) || dead_ids.contains(&id)
            }
            Entry::Junk => dead.iter().any(|d| d.0 == part as i32 && d.1 == o as i64),
        };
        if !finished {
            return Err(format!(
                "stored offset {below} of partition {part} is ahead of offset {o}, which is neither applied nor dead-lettered"
            ));
        }
    }
    Ok(())
}

/// Runs one case; `Err` describes the first invariant that broke.
async fn run_case(pool: &PgPool, seed: u64) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let case = generate(&mut rng);
    let topic = unique("proto");
    let group = unique("g");
    let (_consumer, p) = if case.batch_handler {
        protocol_batch(pool, &topic, &group, handlers::Probe::default())
    } else {
        protocol(pool, &topic, &group)
    };
    let partitions = case.logs.len();
    let mut owners: Vec<Option<Owner>> = (0..partitions).map(|_| None).collect();
    // Owners that lost their partition to a later claim, still "running" somewhere.
    let mut stale: Vec<(usize, Owner)> = Vec::new();
    let mut replays = 0;
    let mut steps = 0;
    let by_id: HashMap<Uuid, &Ev> = case.events.iter().map(|e| (e.id, e)).collect();
    loop {
        steps += 1;
        if steps > 2_000 {
            return Err("no progress after 2,000 steps".into());
        }
        let mut unfinished = Vec::new();
        for part in 0..partitions {
            if stored(pool, &group, &topic, part).await < case.logs[part].len() {
                unfinished.push(part);
            }
        }
        if unfinished.is_empty() {
            break;
        }
        let part = unfinished[rng.random_range(0..unfinished.len())];
        match rng.random_range(0..20) {
            // A worker restart (crash, rebalance): the next owner claims and resumes from
            // the stored offset; the old one may still deliver (below).
            0..=1 => {
                if let Some(old) = owners[part].take() {
                    stale.push((part, old));
                }
            }
            // A stale owner delivers: it must be fenced and change nothing.
            2 if !stale.is_empty() => {
                let (sp, mut old) = stale.remove(rng.random_range(0..stale.len()));
                let len = case.logs[sp].len();
                if old.position < len {
                    let before = observed(pool, &topic, &case).await;
                    let stored_before = stored(pool, &group, &topic, sp).await;
                    let end = (old.position + rng.random_range(1..=case.max_batch)).min(len);
                    let batch = (old.position..end)
                        .map(|o| to_record(&case, &topic, sp, o))
                        .collect();
                    let r = p.deliver(&old.own, batch).await;
                    let epoch_current = owners[sp].as_ref().map(|o| o.own.epoch);
                    if r == Delivered::Done && epoch_current != Some(old.own.epoch) {
                        // Only possible when no later claim exists (it is the owner still).
                        let latest: i64 = sqlx::query_scalar(
                            "SELECT epoch FROM postal.consumer_offsets
                             WHERE group_id = $1 AND topic = $2 AND partition = $3",
                        )
                        .bind(&group)
                        .bind(&topic)
                        .bind(sp as i32)
                        .fetch_one(pool)
                        .await
                        .unwrap();
                        if latest != old.own.epoch {
                            return Err(format!(
                                "a stale owner (epoch {}) committed after epoch {latest}",
                                old.own.epoch
                            ));
                        }
                    }
                    if r == Delivered::Fenced {
                        if observed(pool, &topic, &case).await != before
                            || stored(pool, &group, &topic, sp).await != stored_before
                        {
                            return Err("a fenced owner changed the database".into());
                        }
                    } else {
                        old.position = end;
                        stale.push((sp, old));
                    }
                }
            }
            // An operator replays: the stored offset moves back (`postal consumer reset`).
            3 if replays < 2 => {
                replays += 1;
                let at = stored(pool, &group, &topic, part).await;
                let to = rng.random_range(0..=at);
                sqlx::query(
                    "UPDATE postal.consumer_offsets SET next_offset = $4, epoch = epoch + 1
                     WHERE group_id = $1 AND topic = $2 AND partition = $3",
                )
                .bind(&group)
                .bind(&topic)
                .bind(part as i32)
                .bind(to as i64)
                .execute(pool)
                .await
                .unwrap();
                if let Some(old) = owners[part].take() {
                    stale.push((part, old));
                }
            }
            // A kill -9 mid-transaction: the owner's delivery is dropped after a random number
            // of polls (each a wait on the database), whatever it was doing; the process is
            // gone, the next owner claims.
            4 if owners[part].is_some() => {
                let owner = owners[part].take().expect("owner");
                let len = case.logs[part].len();
                let end = (owner.position + rng.random_range(1..=case.max_batch)).min(len);
                let batch = (owner.position..end)
                    .map(|o| to_record(&case, &topic, part, o))
                    .collect();
                let mut polls = rng.random_range(1..=30u32);
                let delivery = p.deliver(&owner.own, batch);
                tokio::pin!(delivery);
                let _finished = std::future::poll_fn(|cx| {
                    match std::future::Future::poll(delivery.as_mut(), cx) {
                        std::task::Poll::Ready(r) => std::task::Poll::Ready(Some(r)),
                        std::task::Poll::Pending => {
                            polls -= 1;
                            if polls == 0 {
                                std::task::Poll::Ready(None)
                            } else {
                                std::task::Poll::Pending
                            }
                        }
                    }
                })
                .await;
                stored_not_ahead(pool, &group, &topic, &case, part).await?;
            }
            // The owner hands over its next records.
            _ => {
                if owners[part].is_none() {
                    let own = p
                        .claim(&topic, part as i32)
                        .await
                        .map_err(|e| e.to_string())?;
                    let position = own.next_offset.unwrap_or(0) as usize;
                    owners[part] = Some(Owner { own, position });
                }
                let owner = owners[part].as_mut().expect("owner");
                let len = case.logs[part].len();
                let end = (owner.position + rng.random_range(1..=case.max_batch)).min(len);
                let batch = (owner.position..end)
                    .map(|o| to_record(&case, &topic, part, o))
                    .collect();
                match p.deliver(&owner.own, batch).await {
                    Delivered::Done => owner.position = end,
                    Delivered::Fenced => return Err("the current owner was fenced".into()),
                    Delivered::Stopped => return Err("the worker stopped".into()),
                    Delivered::Paused => return Err("nothing pauses this group".into()),
                    Delivered::OverBound => return Err("nothing holds keys in this group".into()),
                }
                stored_not_ahead(pool, &group, &topic, &case, part).await?;
            }
        }
    }
    // The end state.
    let (effects, dead) = observed(pool, &topic, &case).await;
    let mut count: HashMap<Uuid, usize> = HashMap::new();
    for id in &effects {
        *count.entry(*id).or_default() += 1;
    }
    let mut dead_count: HashMap<Uuid, usize> = HashMap::new();
    for id in dead.iter().filter_map(|d| d.2) {
        *dead_count.entry(id).or_default() += 1;
    }
    for e in &case.events {
        let (a, d) = (
            count.get(&e.id).copied().unwrap_or(0),
            dead_count.get(&e.id).copied().unwrap_or(0),
        );
        if a > 1 {
            return Err(format!(
                "event {} ({:?}) applied {a} times",
                e.n, e.behavior
            ));
        }
        if d > 1 {
            return Err(format!(
                "event {} ({:?}) dead-lettered {d} times",
                e.n, e.behavior
            ));
        }
        if a == 1 && d == 1 {
            return Err(format!(
                "event {} ({:?}) applied and dead-lettered",
                e.n, e.behavior
            ));
        }
        if e.dies() && d != 1 {
            return Err(format!(
                "event {} ({:?}) should be a dead letter",
                e.n, e.behavior
            ));
        }
        if !e.dies() && a != 1 {
            return Err(format!(
                "event {} ({:?}) should be applied once, is {a} times",
                e.n, e.behavior
            ));
        }
    }
    // Per-key order of application.
    let mut last: HashMap<usize, i64> = HashMap::new();
    for id in &effects {
        let e = by_id[id];
        if let Some(prev) = last.insert(e.key, e.n) {
            if prev > e.n {
                return Err(format!(
                    "key {}: event {} applied after event {prev}",
                    e.key, e.n
                ));
            }
        }
    }
    Ok(())
}

/// Guarantee: under any mix of duplicates, republished copies at later offsets, retryable,
/// permanent and panicking handlers, worker restarts, stale owners delivering after a newer
/// claim, operator replays, per-message and throughput mode and interleaved partitions, every
/// event is applied at most once, every event that is not dead-lettered exactly once, no
/// dead-lettered event is applied, each key's events are applied in order, and the stored
/// offset is never ahead of the applied effects.
#[tokio::test]
async fn random_deliveries_keep_the_protocol_invariants() {
    let cases: u64 = std::env::var("POSTAL_PROTOCOL_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let first: u64 = std::env::var("POSTAL_PROTOCOL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let db = fresh_postgres_db().await;
    effects_table(&db.pool).await;
    for seed in first..first.wrapping_add(cases) {
        if let Err(e) = run_case(&db.pool, seed).await {
            let case = generate(&mut StdRng::seed_from_u64(seed));
            panic!(
                "protocol invariant broken: {e}\n  reproduce: POSTAL_PROTOCOL_SEED={seed} POSTAL_PROTOCOL_CASES=1 cargo test -p postal-integration-tests --test suite -- protocol::random\n  case: {case:?}"
            );
        }
    }
}
