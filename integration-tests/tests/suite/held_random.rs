//! Held keys (`FinalFailure::HoldKey`) under random schedules, against real PostgreSQL without
//! Kafka (the protocol harness, `postal_consumer::testing::Protocol`): holds, operators'
//! releases and skips, fixes, restarts, stale owners, replays (offset resets), kills mid-
//! delivery and mid-release, duplicates and republished copies, per-message and throughput
//! mode, single-event and batch handlers.
//!
//! `POSTAL_HELD_CASES` sets how many random cases run (default 20), `POSTAL_HELD_SEED` the
//! first case's seed (default random). A failure prints the case's seed:
//! `POSTAL_HELD_SEED=<seed> POSTAL_HELD_CASES=1` runs that case again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use postal_consumer::testing::{Delivered, Protocol, TestRecord};
use postal_consumer::{Consumer, ConsumerConfig, FinalFailure};
use postal_integration_tests::{fresh_postgres_db, unique};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::held_keys::{ledger, ledger_batch, tables};
use crate::protocol::{record, stored, Owner};

fn config(group: &str, max_batch: usize) -> ConsumerConfig {
    // The harness never fetches; the client is created and left idle.
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let mut c = ConsumerConfig::new(&bootstrap, group);
    c.backoff = postal_producer::Backoff {
        base: Duration::from_millis(1),
        max: Duration::from_millis(2),
    };
    c.max_attempts = 2;
    c.max_batch = max_batch;
    c.final_failure = FinalFailure::HoldKey;
    c
}

#[derive(Clone, Debug)]
struct Ev {
    id: Uuid,
    key: usize,
    /// Its place in its key's sequence.
    n: i64,
    /// Rejected (permanently) by the handler until an operator fixes it.
    broken: bool,
}

/// One random case.
#[derive(Debug)]
struct Case {
    events: Vec<Ev>,
    /// Per partition, the events' indexes in log order (a repeated index: a republished copy).
    logs: Vec<Vec<usize>>,
    max_batch: usize,
    batch_handler: bool,
}

fn generate(rng: &mut StdRng) -> Case {
    let partitions = rng.random_range(1..=2usize);
    let keys = rng.random_range(1..=4usize);
    let n = rng.random_range(2..=20usize);
    let mut per_key = vec![0i64; keys];
    let events: Vec<Ev> = (0..n)
        .map(|_| {
            let key = rng.random_range(0..keys);
            per_key[key] += 1;
            Ev {
                id: Uuid::now_v7(),
                key,
                n: per_key[key],
                broken: rng.random_bool(0.25),
            }
        })
        .collect();
    let mut logs = vec![Vec::new(); partitions];
    for (i, e) in events.iter().enumerate() {
        let log = &mut logs[e.key % partitions];
        log.push(i);
        // A republished copy of an earlier event of this partition, or of this one.
        if rng.random_bool(0.15) {
            let j = log[rng.random_range(0..log.len())];
            log.push(j);
        }
    }
    Case {
        events,
        logs,
        max_batch: if rng.random_bool(0.4) {
            1
        } else {
            rng.random_range(2..=6)
        },
        batch_handler: rng.random_bool(0.5),
    }
}

fn to_record(case: &Case, topic: &str, partition: usize, offset: usize) -> TestRecord {
    let e = &case.events[case.logs[partition][offset]];
    let mut r = record(
        topic,
        partition as i32,
        offset as i64,
        e.id,
        &format!("key-{}", e.key),
        json!({ "n": e.n }),
    );
    for (name, value) in &mut r.headers {
        if name == "ce_type" {
            *value = Some(b"entry".to_vec());
        }
    }
    r
}

/// What the database says of the case.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    /// Ledger rows in application order: (event id, key, n).
    applied: Vec<(Uuid, String, i64)>,
    /// Dead-lettered event ids.
    dead: Vec<Uuid>,
    /// Held keys of the group: (partition, key) → whether a release was asked.
    held: BTreeMap<(i32, String), bool>,
    /// Held records: event ids.
    held_records: Vec<Uuid>,
}

/// A read-only transaction on one snapshot. A killed delivery's or release's transaction may
/// still commit while the checks read, and a held record leaves `held_records` as it is
/// applied or dead-lettered: reads in separate snapshots could see it in neither (seen once: a
/// release killed after its COMMIT was sent landed between the ledger's read and the held
/// records').
async fn snapshot(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

async fn seen(pool: &PgPool, group: &str, case: &Case) -> Seen {
    let mut tx = snapshot(pool).await;
    let s = seen_in(&mut tx, group, case).await;
    tx.commit().await.unwrap();
    s
}

async fn seen_in(db: &mut sqlx::PgConnection, group: &str, case: &Case) -> Seen {
    let ids: Vec<Uuid> = case.events.iter().map(|e| e.id).collect();
    let applied =
        sqlx::query_as("SELECT event_id, key, n FROM ledger WHERE event_id = ANY($1) ORDER BY id")
            .bind(&ids)
            .fetch_all(&mut *db)
            .await
            .unwrap();
    let dead = sqlx::query_scalar(
        "SELECT event_id FROM postal.dead_letters WHERE group_id = $1 AND event_id IS NOT NULL ORDER BY id",
    )
    .bind(group)
    .fetch_all(&mut *db)
    .await
    .unwrap();
    let held: Vec<(i32, Vec<u8>, bool)> = sqlx::query_as(
        "SELECT partition, record_key, release IS NOT NULL FROM postal.held_keys WHERE group_id = $1",
    )
    .bind(group)
    .fetch_all(&mut *db)
    .await
    .unwrap();
    let held_records = sqlx::query_scalar(
        "SELECT event_id FROM postal.held_records WHERE group_id = $1 ORDER BY kafka_offset",
    )
    .bind(group)
    .fetch_all(&mut *db)
    .await
    .unwrap();
    Seen {
        applied,
        dead,
        held: held
            .into_iter()
            .map(|(p, k, r)| ((p, String::from_utf8_lossy(&k).into_owned()), r))
            .collect(),
        held_records,
    }
}

/// Applied entries per key.
fn per_key(s: &Seen) -> HashMap<&str, usize> {
    let mut m = HashMap::new();
    for (_, k, _) in &s.applied {
        *m.entry(k.as_str()).or_default() += 1;
    }
    m
}

/// The promise between two observations: a key held before and after a step that applied no
/// release of it had nothing of it applied in between (`released`: the keys whose release the
/// step may have applied).
fn nothing_applied_while_held(
    before: &Seen,
    after: &Seen,
    released: &BTreeSet<(i32, String)>,
) -> Result<(), String> {
    let (b, a) = (per_key(before), per_key(after));
    for held in before.held.keys() {
        if released.contains(held) || !after.held.contains_key(held) {
            continue;
        }
        let key = held.1.as_str();
        if a.get(key) != b.get(key) {
            return Err(format!(
                "key {key} was applied while held: {:?} → {:?} entries",
                b.get(key),
                a.get(key)
            ));
        }
    }
    Ok(())
}

/// Every record below `part`'s stored offset is finished: applied, dead-lettered, or held.
async fn stored_not_ahead(
    pool: &PgPool,
    group: &str,
    topic: &str,
    case: &Case,
    part: usize,
) -> Result<(), String> {
    let mut tx = snapshot(pool).await;
    let next: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets
         WHERE group_id = $1 AND topic = $2 AND partition = $3",
    )
    .bind(group)
    .bind(topic)
    .bind(part as i32)
    .fetch_optional(&mut *tx)
    .await
    .unwrap();
    let below = next.flatten().unwrap_or(0) as usize;
    let s = seen_in(&mut tx, group, case).await;
    tx.commit().await.unwrap();
    for o in 0..below {
        let id = case.events[case.logs[part][o]].id;
        if !(s.applied.iter().any(|a| a.0 == id)
            || s.dead.contains(&id)
            || s.held_records.contains(&id))
        {
            return Err(format!(
                "stored offset {below} of partition {part} is ahead of offset {o}: neither applied, dead-lettered nor held"
            ));
        }
    }
    Ok(())
}

/// Drives a delivery (or a release) for a random number of polls, then drops it: a kill -9.
async fn killed<F: std::future::Future>(f: F, mut polls: u32) {
    tokio::pin!(f);
    std::future::poll_fn(|cx| match f.as_mut().poll(cx) {
        std::task::Poll::Ready(_) => std::task::Poll::Ready(()),
        std::task::Poll::Pending => {
            polls -= 1;
            if polls == 0 {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        }
    })
    .await;
}

async fn run_case(pool: &PgPool, seed: u64) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let case = generate(&mut rng);
    let topic = unique("held-rand");
    let group = unique("g");
    let builder = Consumer::builder(pool.clone(), config(&group, case.max_batch));
    let consumer = if case.batch_handler {
        builder.on_batch(&topic, "entry", ledger_batch)
    } else {
        builder.on(&topic, "entry", ledger)
    }
    .build()
    .map_err(|e| e.to_string())?;
    let p: Protocol = consumer.protocol();
    for e in case.events.iter().filter(|e| e.broken) {
        sqlx::query("INSERT INTO broken (event_id) VALUES ($1)")
            .bind(e.id)
            .execute(pool)
            .await
            .unwrap();
    }
    let partitions = case.logs.len();
    let mut owners: Vec<Option<Owner>> = (0..partitions).map(|_| None).collect();
    let mut stale: Vec<(usize, Owner)> = Vec::new();
    let mut replays = 0;
    let mut skipped: BTreeSet<Uuid> = BTreeSet::new();
    let mut steps = 0;
    loop {
        steps += 1;
        if steps > 3_000 {
            return Err("no progress after 3,000 steps".into());
        }
        // Past 1,500 steps (and whenever only held keys are left), operators fix and release.
        let mut unfinished = Vec::new();
        for part in 0..partitions {
            if stored(pool, &group, &topic, part).await < case.logs[part].len() {
                unfinished.push(part);
            }
        }
        let before = seen(pool, &group, &case).await;
        if unfinished.is_empty() && before.held.is_empty() {
            break;
        }
        let part = rng.random_range(0..partitions);
        let mut released = BTreeSet::new();
        let choice = if unfinished.is_empty() || steps > 1_500 {
            // Only held keys left: fix a head, ask a release, or let the owner apply them.
            rng.random_range(10..20)
        } else {
            rng.random_range(0..20)
        };
        match choice {
            // A restart: the next owner claims; the old one may still deliver.
            0 => {
                if let Some(old) = owners[part].take() {
                    stale.push((part, old));
                }
            }
            // A stale owner delivers: fenced, changing nothing (or still the owner).
            1 if !stale.is_empty() => {
                let (sp, mut old) = stale.remove(rng.random_range(0..stale.len()));
                let len = case.logs[sp].len();
                if old.position < len {
                    let end = (old.position + rng.random_range(1..=case.max_batch)).min(len);
                    let batch = (old.position..end)
                        .map(|o| to_record(&case, &topic, sp, o))
                        .collect();
                    let stored_before = stored(pool, &group, &topic, sp).await;
                    match p.deliver(&old.own, batch).await {
                        Delivered::Fenced => {
                            if seen(pool, &group, &case).await != before
                                || stored(pool, &group, &topic, sp).await != stored_before
                            {
                                return Err("a fenced owner changed the database".into());
                            }
                        }
                        _ => {
                            old.position = end;
                            stale.push((sp, old));
                        }
                    }
                }
            }
            // An operator replays: the stored offset moves back.
            2 if replays < 2 => {
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
            // A kill -9 mid-delivery.
            3 if owners[part].is_some() => {
                let owner = owners[part].take().expect("owner");
                let len = case.logs[part].len();
                if owner.position < len {
                    let end = (owner.position + rng.random_range(1..=case.max_batch)).min(len);
                    let batch = (owner.position..end)
                        .map(|o| to_record(&case, &topic, part, o))
                        .collect();
                    killed(p.deliver(&owner.own, batch), rng.random_range(1..=30)).await;
                }
                stored_not_ahead(pool, &group, &topic, &case, part).await?;
            }
            // An operator fixes a held key's head (or any broken event).
            10..=12 => {
                let broken: Vec<Uuid> = sqlx::query_scalar(
                    "SELECT b.event_id FROM broken b WHERE b.event_id = ANY($1) ORDER BY 1",
                )
                .bind(case.events.iter().map(|e| e.id).collect::<Vec<_>>())
                .fetch_all(pool)
                .await
                .unwrap();
                if !broken.is_empty() {
                    let id = broken[rng.random_range(0..broken.len())];
                    sqlx::query("DELETE FROM broken WHERE event_id = $1")
                        .bind(id)
                        .execute(pool)
                        .await
                        .unwrap();
                }
            }
            // An operator asks for a release (retry the head) or a skip (dead-letter it).
            13..=15 => {
                let open: Vec<&(i32, String)> = before
                    .held
                    .iter()
                    .filter(|(_, asked)| !**asked)
                    .map(|(k, _)| k)
                    .collect();
                if !open.is_empty() {
                    let (hp, key) = open[rng.random_range(0..open.len())];
                    let skip = rng.random_bool(0.3);
                    if skip {
                        let head: Option<Uuid> = sqlx::query_scalar(
                            "SELECT r.event_id FROM postal.held_records r
                             JOIN postal.held_keys k USING (group_id, topic, partition, record_key)
                             WHERE r.group_id = $1 AND r.partition = $2 AND r.record_key = $3
                               AND r.kafka_offset = k.head_offset",
                        )
                        .bind(&group)
                        .bind(hp)
                        .bind(key.as_bytes())
                        .fetch_optional(pool)
                        .await
                        .unwrap();
                        skipped.extend(head);
                    }
                    sqlx::query(
                        "UPDATE postal.held_keys SET release = $4, released_by = 'op'
                         WHERE group_id = $1 AND partition = $2 AND record_key = $3
                           AND release IS NULL",
                    )
                    .bind(&group)
                    .bind(hp)
                    .bind(key.as_bytes())
                    .bind(if skip { "skip" } else { "retry" })
                    .execute(pool)
                    .await
                    .unwrap();
                }
            }
            // The owner applies the releases asked for (sometimes killed midway).
            16..=19 => {
                if owners[part].is_none() {
                    let own = p
                        .claim(&topic, part as i32)
                        .await
                        .map_err(|e| e.to_string())?;
                    let position = own.next_offset.unwrap_or(0) as usize;
                    owners[part] = Some(Owner { own, position });
                }
                released = before
                    .held
                    .iter()
                    .filter(|((hp, _), asked)| **asked && *hp == part as i32)
                    .map(|(k, _)| k.clone())
                    .collect();
                let own = &owners[part].as_ref().expect("owner").own;
                if rng.random_bool(0.15) {
                    killed(
                        p.apply_releases(own, &topic, part as i32),
                        rng.random_range(1..=40),
                    )
                    .await;
                    if let Some(old) = owners[part].take() {
                        stale.push((part, old));
                    }
                } else {
                    match p.apply_releases(own, &topic, part as i32).await {
                        Delivered::Done => {}
                        other => return Err(format!("applying releases ended {other:?}")),
                    }
                }
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
                if owner.position < len {
                    let end = (owner.position + rng.random_range(1..=case.max_batch)).min(len);
                    let batch = (owner.position..end)
                        .map(|o| to_record(&case, &topic, part, o))
                        .collect();
                    match p.deliver(&owner.own, batch).await {
                        Delivered::Done => owner.position = end,
                        other => {
                            return Err(format!("the current owner's delivery ended {other:?}"))
                        }
                    }
                }
                stored_not_ahead(pool, &group, &topic, &case, part).await?;
            }
        }
        let after = seen(pool, &group, &case).await;
        nothing_applied_while_held(&before, &after, &released)?;
        // Per key, entries are applied in their order, each once.
        let mut last: HashMap<&str, i64> = HashMap::new();
        for (id, k, n) in &after.applied {
            if let Some(prev) = last.insert(k.as_str(), *n) {
                if prev >= *n {
                    return Err(format!(
                        "key {k}: entry {n} ({id}) applied after entry {prev}"
                    ));
                }
            }
        }
    }
    // The end: every event applied once, but the skipped heads, each dead-lettered once.
    let end = seen(pool, &group, &case).await;
    if !end.held_records.is_empty() {
        return Err(format!("held records left: {:?}", end.held_records));
    }
    let bytes: Option<i64> =
        sqlx::query_scalar("SELECT bytes FROM postal.held_bytes WHERE group_id = $1")
            .bind(&group)
            .fetch_optional(pool)
            .await
            .unwrap();
    if bytes.unwrap_or(0) != 0 {
        return Err(format!("held_bytes is {bytes:?} with nothing held"));
    }
    for e in &case.events {
        let a = end.applied.iter().filter(|x| x.0 == e.id).count();
        let d = end.dead.iter().filter(|x| **x == e.id).count();
        match (skipped.contains(&e.id), a, d) {
            (false, 1, 0) | (true, 0, 1) => {}
            (s, a, d) => {
                return Err(format!(
                    "event key {} n {} (skipped: {s}): applied {a} times, dead-lettered {d} times",
                    e.key, e.n
                ))
            }
        }
    }
    Ok(())
}

/// Guarantee (issue 48): with `FinalFailure::HoldKey`, under any mix of holds, operators'
/// fixes, releases and skips, restarts, stale owners, replays (offset resets), kills
/// mid-delivery and mid-release, republished copies, per-message and throughput mode and
/// batch handlers: no event of a held key is applied between its hold and its release; each
/// key's events are applied in order, each at most once; the stored offset never passes a
/// record that is neither applied, dead-lettered nor held; and in the end every event is
/// applied exactly once, but the heads an operator skipped, each dead-lettered once, with
/// nothing left held.
#[tokio::test]
async fn random_holds_and_releases_keep_the_held_key_invariants() {
    let cases: u64 = std::env::var("POSTAL_HELD_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let first: u64 = std::env::var("POSTAL_HELD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let db = fresh_postgres_db().await;
    tables(&db.pool).await;
    for seed in first..first.wrapping_add(cases) {
        if let Err(e) = run_case(&db.pool, seed).await {
            let case = generate(&mut StdRng::seed_from_u64(seed));
            panic!(
                "held-key invariant broken: {e}\n  reproduce: POSTAL_HELD_SEED={seed} POSTAL_HELD_CASES=1 cargo test -p postal-integration-tests --test suite -- held_random::\n  case: {case:?}"
            );
        }
    }
}
