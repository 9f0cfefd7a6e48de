//! Held keys (`FinalFailure::HoldKey`, issue 48): an event that fails for good holds its key —
//! it and every later record of the key on the partition are stored, not applied, while
//! other keys flow — until the key is released (by an operator, or the retry policy); the
//! release applies the held records in offset order, exactly once, also across a consumer
//! killed mid-release and a change of owner.

use std::collections::{BTreeMap, HashSet};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use postal_consumer::{idempotent, Event, FinalFailure, HandlerError};
use postal_integration_tests::{services, unique, wait, Services, TestDb};
use serde::Deserialize;
use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::common::{consumer_config, create_topic, produce, RawRecord, RunningConsumer};

const WAIT: Duration = Duration::from_secs(60);
const CONSUMER: &str = "held";

/// A ledger entry: `n` is its place in its key's sequence.
#[derive(Debug, Deserialize)]
pub(crate) struct Entry {
    n: i64,
}

/// Events whose handler run waits (mid-transaction, its effect written) while listed.
static BLOCKED: LazyLock<Mutex<HashSet<Uuid>>> = LazyLock::new(Default::default);
/// Blocked events whose handler run has started.
static ENTERED: LazyLock<Mutex<HashSet<Uuid>>> = LazyLock::new(Default::default);

/// Appends the entry to `ledger` (its row id is the order of application); fails
/// permanently while the event is listed in `broken`.
#[idempotent(consumer = "held")]
pub(crate) async fn ledger(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<Entry>,
) -> Result<(), HandlerError> {
    let id = event.id.as_uuid();
    let broken: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM broken WHERE event_id = $1)")
            .bind(id)
            .fetch_one(&mut **tx)
            .await?;
    if broken {
        return Err(HandlerError::permanent("rejected by the ledger"));
    }
    sqlx::query("INSERT INTO ledger (event_id, key, n) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(event.key.as_deref().unwrap_or(""))
        .bind(event.payload.n)
        .execute(&mut **tx)
        .await?;
    if BLOCKED.lock().unwrap().contains(&id) {
        ENTERED.lock().unwrap().insert(id);
        while BLOCKED.lock().unwrap().contains(&id) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(())
}

/// [`ledger`] as a batch handler: the batch's entries in one statement, in order; fails
/// permanently if any of them is listed in `broken`.
#[idempotent(consumer = "held")]
pub(crate) async fn ledger_batch(
    tx: &mut Transaction<'_, Postgres>,
    events: &[Event<Entry>],
) -> Result<(), HandlerError> {
    let ids: Vec<Uuid> = events.iter().map(|e| e.id.as_uuid()).collect();
    let broken: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM broken WHERE event_id = ANY($1))")
            .bind(&ids)
            .fetch_one(&mut **tx)
            .await?;
    if broken {
        return Err(HandlerError::permanent("rejected by the ledger"));
    }
    let keys: Vec<String> = events
        .iter()
        .map(|e| e.key.clone().unwrap_or_default())
        .collect();
    let ns: Vec<i64> = events.iter().map(|e| e.payload.n).collect();
    sqlx::query(
        "INSERT INTO ledger (event_id, key, n)
         SELECT id, k, n FROM unnest($1::uuid[], $2::text[], $3::bigint[])
             WITH ORDINALITY AS t(id, k, n, i)
         ORDER BY i",
    )
    .bind(&ids)
    .bind(&keys)
    .bind(&ns)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

pub(crate) async fn tables(pool: &PgPool) {
    for sql in [
        "CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL,
                              n bigint NOT NULL)",
        "CREATE TABLE broken (event_id uuid PRIMARY KEY)",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

/// A topic's events by key, produced in the order given, with their ids.
struct Events {
    ids: BTreeMap<(String, i64), Uuid>,
}

impl Events {
    fn id(&self, key: &str, n: i64) -> Uuid {
        self.ids[&(key.to_owned(), n)]
    }
}

/// Produces `(key, n)` entries to `partition` of `topic`, in order; those in `broken` fail
/// until they are taken out of the `broken` table.
async fn entries(
    svc: &Services,
    pool: &PgPool,
    topic: &str,
    partition: i32,
    list: &[(&str, i64)],
    broken: &[(&str, i64)],
) -> Events {
    let mut ids = BTreeMap::new();
    let mut records = Vec::new();
    for &(k, n) in list {
        let id = Uuid::now_v7();
        ids.insert((k.to_owned(), n), id);
        if broken.contains(&(k, n)) {
            sqlx::query("INSERT INTO broken VALUES ($1)")
                .bind(id)
                .execute(pool)
                .await
                .unwrap();
        }
        records.push(RawRecord::event(id, k, "entry", json!({ "n": n })));
    }
    produce(&svc.bootstrap, topic, Some(partition), &records).await;
    Events { ids }
}

/// The entries of `key` in the order they were applied.
async fn applied(pool: &PgPool, key: &str) -> Vec<i64> {
    sqlx::query_scalar("SELECT n FROM ledger WHERE key = $1 ORDER BY id")
        .bind(key)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Held records of `key`.
async fn held(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.held_records WHERE record_key = $1")
        .bind(key.as_bytes())
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Ledger rows applied more than once (by event id).
async fn applied_twice(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) - count(DISTINCT event_id) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn config(svc: &Services, group: &str, max_batch: usize) -> postal_consumer::ConsumerConfig {
    let mut c = consumer_config(&svc.bootstrap, group, CONSUMER);
    c.final_failure = FinalFailure::HoldKey;
    c.max_attempts = 2;
    c.max_batch = max_batch;
    c.held_poll = Duration::from_millis(100);
    c
}

fn start(
    pool: &PgPool,
    topic: &str,
    config: postal_consumer::ConsumerConfig,
    batched: bool,
) -> RunningConsumer {
    let b = postal_consumer::Consumer::builder(pool.clone(), config);
    let b = if batched {
        b.on_batch(topic, "entry", ledger_batch)
    } else {
        b.on(topic, "entry", ledger)
    };
    RunningConsumer::start(b.build().expect("valid consumer"))
}

async fn release(pool: &PgPool, group: &str, topic: &str, key: &str, skip_head: bool) {
    let by = postal_admin::audit::Operator::cli("tester");
    postal_admin::held::release(pool, &by, group, topic, key.as_bytes(), skip_head)
        .await
        .expect("release asked");
}

async fn until_applied(pool: &PgPool, key: &str, want: &[i64]) {
    wait::until(WAIT, &format!("key {key} applied as {want:?}"), || async {
        applied(pool, key).await == want
    })
    .await;
}

async fn until_held(pool: &PgPool, key: &str, n: i64) {
    wait::until(WAIT, &format!("{n} records of key {key} held"), || async {
        held(pool, key).await == n
    })
    .await;
}

/// The scenario of the first guarantee, one record per transaction or in batches (with a
/// plain handler or a batch handler).
async fn hold_then_release(max_batch: usize, batched: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("held");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    let first = [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
        ("a", 3),
        ("b", 3),
    ];
    entries(svc, &db.pool, &topic, 0, &first, &[("a", 1)]).await;
    let running = start(&db.pool, &topic, config(svc, &group, max_batch), batched);
    until_applied(&db.pool, "b", &[0, 1, 2, 3]).await;
    until_held(&db.pool, "a", 3).await;
    assert_eq!(
        applied(&db.pool, "a").await,
        [0],
        "nothing of key a after its failure"
    );
    let (reason, due): (String, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT reason, due_at FROM postal.held_keys WHERE record_key = 'a'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((reason.as_str(), due), ("permanent", None));
    // Later records of the held key are held as they come; other keys still flow.
    entries(svc, &db.pool, &topic, 0, &[("a", 4), ("b", 4)], &[]).await;
    until_applied(&db.pool, "b", &[0, 1, 2, 3, 4]).await;
    until_held(&db.pool, "a", 4).await;
    assert_eq!(applied(&db.pool, "a").await, [0]);
    let b4_row: i64 = sqlx::query_scalar("SELECT max(id) FROM ledger WHERE key = 'b'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // The failure is fixed; the operator releases the key.
    sqlx::query("DELETE FROM broken")
        .execute(&db.pool)
        .await
        .unwrap();
    release(&db.pool, &group, &topic, "a", false).await;
    until_applied(&db.pool, "a", &[0, 1, 2, 3, 4]).await;
    wait::until(WAIT, "the key's row gone", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.held_keys")
            .fetch_one(&db.pool)
            .await
            .unwrap()
            == 0
    })
    .await;
    let released_after: i64 =
        sqlx::query_scalar("SELECT min(id) FROM ledger WHERE key = 'a' AND n > 0")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        released_after > b4_row,
        "held events applied only after the release"
    );
    // Once released, the key flows again.
    entries(svc, &db.pool, &topic, 0, &[("a", 5)], &[]).await;
    until_applied(&db.pool, "a", &[0, 1, 2, 3, 4, 5]).await;
    running.stop().await;
    assert_eq!(applied_twice(&db.pool).await, 0, "no event applied twice");
    assert_eq!(held(&db.pool, "a").await, 0);
    let bytes: i64 = sqlx::query_scalar("SELECT bytes FROM postal.held_bytes")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(bytes, 0, "the group's held bytes back to zero");
    let audit: (String, i64) = sqlx::query_as(
        "SELECT action, matched FROM postal.operator_audit WHERE action = 'release-held'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        ("release-held".to_owned(), 4),
        "the release is audited"
    );
}

/// Guarantee: with `FinalFailure::HoldKey`, an event that fails for good holds its key: it and
/// every later record of the key are stored (`postal.held_records`), none applied, while
/// the other key of the partition flows; released after the fix, the held events are applied
/// in offset order, after everything applied while they were held, each exactly once; the key
/// then flows again and the group's held bytes are back to zero. Before: the event became a
/// dead letter and the key's later events were applied without it.
#[tokio::test]
async fn a_held_key_waits_while_others_flow_and_its_release_applies_it_in_order() {
    hold_then_release(1, false).await;
}

/// Guarantee: the same in throughput mode (`max_batch` 50): a held key's records are taken
/// out of each batch, in the batch's transaction, and the rest of the batch is applied.
#[tokio::test]
async fn a_held_key_is_taken_out_of_batches() {
    hold_then_release(50, false).await;
}

/// Guarantee: the same with a batch handler in throughput mode: the culprit found by
/// splitting the batch holds its key, and the batch's later records of the key are not run.
#[tokio::test]
async fn a_batch_handler_holds_the_failing_key() {
    hold_then_release(50, true).await;
}

/// Guarantee: `--skip-head` dead-letters the head (with its dedup row: a later copy is not
/// applied) and applies the rest of the key's held records in order, exactly once.
#[tokio::test]
async fn skipping_the_head_dead_letters_it_and_applies_the_rest() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("held-skip");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    let ev = entries(
        svc,
        &db.pool,
        &topic,
        0,
        &[("a", 0), ("a", 1), ("a", 2), ("a", 3)],
        &[("a", 1)],
    )
    .await;
    let running = start(&db.pool, &topic, config(svc, &group, 1), false);
    until_held(&db.pool, "a", 3).await;
    release(&db.pool, &group, &topic, "a", true).await;
    until_applied(&db.pool, "a", &[0, 2, 3]).await;
    until_held(&db.pool, "a", 0).await;
    running.stop().await;
    let dead: Vec<(Option<Uuid>, String)> =
        sqlx::query_as("SELECT event_id, reason FROM postal.dead_letters")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(dead, [(Some(ev.id("a", 1)), "permanent".to_owned())]);
    assert_eq!(applied_twice(&db.pool).await, 0);
}

/// Guarantee: with a retry policy (`hold_retry_after`), the consumer retries a held key's head
/// on its own when due, and once it succeeds applies the rest in order: no operator needed.
#[tokio::test]
async fn the_retry_policy_releases_a_key_once_its_head_succeeds() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("held-due");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    entries(
        svc,
        &db.pool,
        &topic,
        0,
        &[("a", 0), ("a", 1), ("a", 2)],
        &[("a", 1)],
    )
    .await;
    let mut c = config(svc, &group, 1);
    c.hold_retry_after = Some(Duration::from_millis(300));
    let running = start(&db.pool, &topic, c, false);
    until_held(&db.pool, "a", 2).await;
    // Retried when due, and failing again: the key stays held, the head's attempts grow.
    wait::until(WAIT, "the head retried by the policy", || async {
        sqlx::query_scalar::<_, i32>("SELECT attempts FROM postal.held_keys")
            .fetch_one(&db.pool)
            .await
            .unwrap()
            >= 3
    })
    .await;
    assert_eq!(applied(&db.pool, "a").await, [0]);
    sqlx::query("DELETE FROM broken")
        .execute(&db.pool)
        .await
        .unwrap();
    until_applied(&db.pool, "a", &[0, 1, 2]).await;
    until_held(&db.pool, "a", 0).await;
    running.stop().await;
    assert_eq!(applied_twice(&db.pool).await, 0);
}

/// Guarantee: a consumer killed in the middle of a release (two held events applied, the
/// third's transaction open) leaves the rest to the next owner, which goes on with the
/// release from the first event not committed: every held event applied exactly once, in
/// order. The killed transaction's effect is rolled back with it.
#[tokio::test]
async fn a_consumer_killed_mid_release_applies_nothing_twice() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("held-kill");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    let ev = entries(
        svc,
        &db.pool,
        &topic,
        0,
        &[("a", 0), ("a", 1), ("a", 2), ("a", 3), ("a", 4)],
        &[("a", 1)],
    )
    .await;
    let blocked = ev.id("a", 3);
    BLOCKED.lock().unwrap().insert(blocked);
    let own_pool = db.process_pool().await;
    let first = start(&own_pool, &topic, config(svc, &group, 1), false).owning(own_pool);
    until_held(&db.pool, "a", 4).await;
    sqlx::query("DELETE FROM broken")
        .execute(&db.pool)
        .await
        .unwrap();
    release(&db.pool, &group, &topic, "a", false).await;
    wait::until(
        WAIT,
        "the release mid-way (a3's transaction open)",
        || async { ENTERED.lock().unwrap().contains(&blocked) },
    )
    .await;
    assert_eq!(applied(&db.pool, "a").await, [0, 1, 2], "a3 not committed");
    first.kill().await;
    BLOCKED.lock().unwrap().remove(&blocked);
    let second = start(&db.pool, &topic, config(svc, &group, 1), false);
    until_applied(&db.pool, "a", &[0, 1, 2, 3, 4]).await;
    until_held(&db.pool, "a", 0).await;
    second.stop().await;
    assert_eq!(applied_twice(&db.pool).await, 0, "no event applied twice");
}

/// Guarantee: a held key stays held across a change of the partition's owner: the next owner
/// reads the held keys when it takes the partition over, holds the key's new records, lets
/// other keys flow, and applies the release in order.
#[tokio::test]
async fn a_held_key_survives_a_change_of_owner() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("held-owner");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    entries(
        svc,
        &db.pool,
        &topic,
        0,
        &[("a", 0), ("a", 1), ("a", 2), ("b", 0)],
        &[("a", 1)],
    )
    .await;
    let first = start(&db.pool, &topic, config(svc, &group, 1), false);
    until_held(&db.pool, "a", 2).await;
    until_applied(&db.pool, "b", &[0]).await;
    first.stop().await;
    let second = start(&db.pool, &topic, config(svc, &group, 1), false);
    entries(svc, &db.pool, &topic, 0, &[("a", 3), ("b", 1)], &[]).await;
    until_applied(&db.pool, "b", &[0, 1]).await;
    until_held(&db.pool, "a", 3).await;
    assert_eq!(
        applied(&db.pool, "a").await,
        [0],
        "held across the change of owner"
    );
    sqlx::query("DELETE FROM broken")
        .execute(&db.pool)
        .await
        .unwrap();
    release(&db.pool, &group, &topic, "a", false).await;
    until_applied(&db.pool, "a", &[0, 1, 2, 3]).await;
    second.stop().await;
    assert_eq!(applied_twice(&db.pool).await, 0);
}

/// Guarantee: past `held_bytes_limit` the partition waits (counted in
/// `partitions_held_full`, with a log line and the `postal_consumer_held_full` gauge): the
/// record that would pass the bound is neither held nor applied, nor is anything after it on
/// the partition, and nothing is dropped: once the held key is released the partition
/// resumes and every record is applied, in order.
#[tokio::test]
async fn past_the_byte_bound_the_partition_waits_and_drops_nothing() {
    let svc = services().await;
    let db: TestDb = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("held-bound");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    entries(
        svc,
        &db.pool,
        &topic,
        0,
        &[("a", 0), ("a", 1), ("a", 2), ("b", 0)],
        &[("a", 1)],
    )
    .await;
    let mut c = config(svc, &group, 1);
    // The group holds one record (a group holding nothing always takes one), no second.
    c.held_bytes_limit = 1;
    let running = start(&db.pool, &topic, c, false);
    let stats = running.stats.clone();
    wait::until(WAIT, "the partition waiting at the bound", || {
        let s = stats.snapshot();
        async move { s.partitions_held_full == 1 }
    })
    .await;
    assert_eq!(held(&db.pool, "a").await, 1, "only the head held");
    assert!(
        applied(&db.pool, "b").await.is_empty(),
        "nothing after the bound applied"
    );
    let next: Option<i64> =
        sqlx::query_scalar("SELECT next_offset FROM postal.consumer_offsets WHERE group_id = $1")
            .bind(&group)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(next, Some(2), "the stored offset waits at a2");
    sqlx::query("DELETE FROM broken")
        .execute(&db.pool)
        .await
        .unwrap();
    release(&db.pool, &group, &topic, "a", false).await;
    until_applied(&db.pool, "a", &[0, 1, 2]).await;
    until_applied(&db.pool, "b", &[0]).await;
    wait::until(WAIT, "the partition no longer waiting", || {
        let s = stats.snapshot();
        async move { s.partitions_held_full == 0 }
    })
    .await;
    running.stop().await;
    assert_eq!(applied_twice(&db.pool).await, 0);
}

/// Guarantee: a replay below a held key's records (the stored offset moved back, as `postal
/// consumer reset` does) holds the key's records delivered again once each (the group's held
/// bytes count them once), and holds the copies below the head too, behind it: a skip then
/// still dead-letters the event that failed, not an earlier copy, and applies nothing twice.
/// Before: the copy of a held record failed its insert on every attempt (the partition
/// stalled), and a copy below the head was taken for the head by a skip.
#[tokio::test]
async fn a_replay_below_a_held_key_holds_each_record_once_and_skips_the_right_head() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let topic = unique("held-replay");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    let ev = entries(
        svc,
        &db.pool,
        &topic,
        0,
        &[("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0)],
        &[("a", 1)],
    )
    .await;
    let first = start(&db.pool, &topic, config(svc, &group, 1), false);
    until_held(&db.pool, "a", 3).await;
    until_applied(&db.pool, "b", &[0]).await;
    first.stop().await;
    sqlx::query("UPDATE postal.consumer_offsets SET next_offset = 0 WHERE group_id = $1")
        .bind(&group)
        .execute(&db.pool)
        .await
        .unwrap();
    let second = start(&db.pool, &topic, config(svc, &group, 1), false);
    // a0 comes again behind the held key: held too (below the head).
    until_held(&db.pool, "a", 4).await;
    wait::until(WAIT, "the replay read to the end", || async {
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT next_offset FROM postal.consumer_offsets WHERE group_id = $1",
        )
        .bind(&group)
        .fetch_one(&db.pool)
        .await
        .unwrap()
            == Some(5)
    })
    .await;
    let (counted, stored): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT bytes FROM postal.held_bytes),
                (SELECT sum(bytes)::bigint FROM postal.held_records)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(counted, stored, "each held record counted once");
    release(&db.pool, &group, &topic, "a", true).await;
    until_applied(&db.pool, "a", &[0, 2, 3]).await;
    until_held(&db.pool, "a", 0).await;
    second.stop().await;
    let dead: Vec<Option<Uuid>> = sqlx::query_scalar("SELECT event_id FROM postal.dead_letters")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        dead,
        [Some(ev.id("a", 1))],
        "the skip dead-letters the event that failed"
    );
    assert_eq!(applied(&db.pool, "b").await, [0]);
    assert_eq!(applied_twice(&db.pool).await, 0, "no event applied twice");
}
