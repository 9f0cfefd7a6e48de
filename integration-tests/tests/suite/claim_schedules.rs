//! Adversarial review of commit ff640f2 (issue 45: order never rests on comparing times taken in
//! different transactions; a key is its topic and key). Deterministic schedules against real
//! PostgreSQL, driving claims by hand (`postal_producer::testing`).
//!
//! The first three tests found breaks that predated the change (a due row that another session
//! row-locks was skipped by `SKIP LOCKED` without holding its key); they fail on 9b8cf9f and
//! pass since the claim leaves a key behind a row it skipped (producer/src/skipped.rs). The
//! others are attacks that held, kept as cheap regression guards.

use std::time::Duration;

use postal_integration_tests::{fresh_postgres_db, unique};
use postal_producer::testing::{claim, lease};
use postal_producer::{enqueue, enqueue_batch, NewEvent, TopicFilter};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::common::held_up::{claim_waits_for_the_lock, connect, PartitionsLock};

const LEASE: Duration = Duration::from_secs(60);

/// A relay of `group` that holds every key partition of it.
async fn relay_in(pool: &PgPool, group: &str) -> Uuid {
    crate::common::held_up::relay_in(pool, group, LEASE).await
}

async fn exec(c: &mut PgConnection, sql: &str) {
    sqlx::query(sql).execute(c).await.unwrap();
}

async fn put(pool: &PgPool, topic: &str, key: &str, payload: &str) {
    let mut c = pool.acquire().await.unwrap();
    enqueue(&mut c, NewEvent::json(topic, key, "e", &payload).unwrap())
        .await
        .unwrap();
}

async fn seq_of(pool: &PgPool, payload: &str) -> i64 {
    sqlx::query_scalar("SELECT seq FROM postal.outbox WHERE payload = convert_to($1, 'UTF8')")
        .bind(serde_json::to_string(payload).unwrap())
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Claims up to `limit` rows of `topic` as `relay` (as the relay does: delete-on-claim).
async fn claim_of(pool: &PgPool, relay: Uuid, topic: &str, limit: usize) -> Option<claim::Claim> {
    claim::claim(
        pool,
        relay,
        &claim::all_partitions(),
        limit,
        LEASE,
        true,
        &TopicFilter::Only(vec![topic.to_string()]),
    )
    .await
    .unwrap()
}

fn payloads(c: &Option<claim::Claim>) -> Vec<String> {
    c.as_ref().map_or_else(Vec::new, |c| {
        c.events()
            .iter()
            .map(|e| serde_json::from_slice::<String>(&e.payload).unwrap())
            .collect()
    })
}

/// Both of the key's events in order, or none of them: never the later one alone.
fn in_order_or_nothing(got: &[String]) -> bool {
    got.is_empty() || got == ["first", "second"]
}

/// Claims `topic` as `relay` (completing each claim as published) until `want` events were
/// taken or 20 s passed: their payloads in the order they were taken. A key that waits for a
/// row lock is tried again a second later (`skipped::RECHECK`), hence the polling.
async fn drain(pool: &PgPool, relay: Uuid, topic: &str, want: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < want && std::time::Instant::now() < deadline {
        let Some(mut c) = claim_of(pool, relay, topic, 100).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let batch = c.take_events();
        got.extend(
            batch
                .iter()
                .map(|e| serde_json::from_slice::<String>(&e.payload).unwrap()),
        );
        let seqs: Vec<i64> = batch.iter().map(|e| e.seq).collect();
        c.complete(&batch, &seqs, &[]).await.unwrap();
    }
    got
}

// ---------------------------------------------------------------------------------------------
// Row locks the claim skips (broke order before the claim checked what it skipped)
// ---------------------------------------------------------------------------------------------

/// Guarantee: a due, pending row that some other session has row-locked — an operator's `psql`
/// transaction editing it, a reporting query `SELECT ... FOR SHARE`, anything taking `FOR KEY
/// SHARE` — holds its key: the claim skips it (`SKIP LOCKED`) and takes none of the key's later
/// events meanwhile; once the lock is gone, the key's events go out in order.
/// Schedule: enqueue first, second on (t, k); session L locks `first`; claim; L ends; drain.
/// (On 9b8cf9f the claim took `second` alone, for each of the four locks.)
#[tokio::test]
async fn a_row_lock_on_a_keys_earlier_event_holds_the_key_until_it_is_gone() {
    let db = fresh_postgres_db().await;
    let relay = relay_in(&db.pool, lease::DEFAULT_GROUP).await;
    let mut broken = Vec::new();
    for lock in [
        "SELECT 1 FROM postal.outbox WHERE seq = $1 FOR KEY SHARE",
        "SELECT 1 FROM postal.outbox WHERE seq = $1 FOR SHARE",
        "SELECT 1 FROM postal.outbox WHERE seq = $1 FOR UPDATE",
        "UPDATE postal.outbox SET headers = headers WHERE seq = $1",
    ] {
        let topic = unique("rowlock");
        put(&db.pool, &topic, "k", "first").await;
        put(&db.pool, &topic, "k", "second").await;
        let first =
            sqlx::query_scalar::<_, i64>("SELECT min(seq) FROM postal.outbox WHERE topic = $1")
                .bind(&topic)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        let mut l = connect(&db.url).await;
        exec(&mut l, "BEGIN").await;
        sqlx::query(lock).bind(first).execute(&mut l).await.unwrap();
        let c = claim_of(&db.pool, relay, &topic, 100).await;
        let got = payloads(&c);
        println!("lock {lock:?}: the claim took {got:?}");
        if let Some(c) = c {
            c.release().await.unwrap();
        }
        exec(&mut l, "ROLLBACK").await;
        let after = drain(&db.pool, relay, &topic, 2).await;
        if !in_order_or_nothing(&got) || after != ["first", "second"] {
            broken.push((lock, got, after));
        }
    }
    assert!(
        broken.is_empty(),
        "a row lock on a key's earlier event let a claim take the key's later event alone, or the key did not go out in order once the lock was gone (lock, while locked, after): {broken:?}"
    );
}

/// Guarantee (task mode): a checked-out row whose run lease has ended is due; if its relay's
/// renewal is running on it at that moment — a renewal delayed on a slow link until after the
/// run lease ended — the row is locked and the claim skips it, but the key's next task is not
/// claimed while the earlier task's run goes on, neither during the renewal nor after it.
/// (On 9b8cf9f the claim took `second` alone: a due row that is locked did not hold its key.)
/// Played by hand: `first` checked out (run 1) with its run lease over; session R runs the
/// relay's renew statement and has not committed yet; a claim runs; R commits; a claim runs.
#[tokio::test]
async fn a_renewal_racing_a_claim_after_the_run_lease_ended_holds_the_next_task() {
    let db = fresh_postgres_db().await;
    let relay = relay_in(&db.pool, lease::DEFAULT_GROUP).await;
    let topic = unique("renew");
    put(&db.pool, &topic, "k", "first").await;
    put(&db.pool, &topic, "k", "second").await;
    let first = seq_of(&db.pool, "first").await;
    // As `check_out` leaves it, with its run lease just over.
    sqlx::query(
        "UPDATE postal.outbox SET runs = 1, running = true, held = true,
                available_at = now() - interval '10 milliseconds'
         WHERE seq = $1",
    )
    .bind(first)
    .execute(&db.pool)
    .await
    .unwrap();
    let mut r = connect(&db.url).await;
    exec(&mut r, "BEGIN").await;
    // `checkout::renew`, verbatim.
    let renewed: Vec<i64> = sqlx::query_scalar(
        "UPDATE postal.outbox o SET available_at = now() + $3 * interval '1 millisecond'
         FROM unnest($1::int8[], $2::int4[]) AS r(seq, run)
         WHERE o.seq = r.seq AND o.runs = r.run AND o.running AND o.status = 'pending'
         RETURNING o.seq",
    )
    .bind(vec![first])
    .bind(vec![1i32])
    .bind(LEASE.as_millis() as i64)
    .fetch_all(&mut r)
    .await
    .unwrap();
    assert_eq!(renewed, [first]);
    let c = claim_of(&db.pool, relay, &topic, 100).await;
    let got = payloads(&c);
    println!("the claim took {got:?} while the renewal of the run of \"first\" was in progress");
    if let Some(c) = c {
        c.release().await.unwrap();
    }
    exec(&mut r, "COMMIT").await;
    let after = claim_of(&db.pool, relay, &topic, 100).await;
    let after_got = payloads(&after);
    if let Some(c) = after {
        c.release().await.unwrap();
    }
    assert!(
        got.is_empty() && after_got.is_empty(),
        "the key's next task was claimed while its earlier task's run goes on (during the renewal, after it): {got:?}, {after_got:?}"
    );
}

/// Guarantee: two relay groups whose topic filters overlap (a typo in `--exclude-topics`, say
/// `email` for `emails`) both own every partition in their group and both claim the same
/// (topic, key); while group A's claim has `first` in flight (row-locked), group B's claim
/// takes none of the key's later events, and once A recorded `first`, B takes `second`.
/// (On 9b8cf9f group B's claim skipped `first` and took `second` alone.)
#[tokio::test]
async fn two_relay_groups_with_overlapping_topic_filters_keep_a_keys_order() {
    let db = fresh_postgres_db().await;
    let a = relay_in(&db.pool, lease::DEFAULT_GROUP).await;
    let b = relay_in(&db.pool, "mailer").await;
    let topic = unique("emails");
    put(&db.pool, &topic, "k", "first").await;
    put(&db.pool, &topic, "k", "second").await;
    // Group A (every topic) claims one row: `first`, in flight.
    let in_flight = claim::claim(
        &db.pool,
        a,
        &claim::all_partitions(),
        1,
        LEASE,
        true,
        &TopicFilter::Except(vec!["email".into()]),
    )
    .await
    .unwrap();
    assert_eq!(payloads(&in_flight), ["first"]);
    let c = claim_of(&db.pool, b, &topic, 100).await;
    let got = payloads(&c);
    println!("group B took {got:?} while group A had \"first\" in flight");
    if let Some(c) = c {
        c.release().await.unwrap();
    }
    let mut in_flight = in_flight.unwrap();
    let batch = in_flight.take_events();
    in_flight
        .complete(&batch, &[batch[0].seq], &[])
        .await
        .unwrap();
    let after = drain(&db.pool, b, &topic, 1).await;
    assert!(
        got.is_empty() && after == ["second"],
        "two groups claiming the same topic published the key's later event while its earlier one was in flight, or not after it (during, after): {got:?}, {after:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Attacks that held (regression guards)
// ---------------------------------------------------------------------------------------------

/// Guarantee: an operator's requeue of a key's parked event that commits while a claim is held
/// up after its `BEGIN` (a claim whose `now()` precedes the requeue's) never lets that claim take
/// the key's later event alone: the requeued row is `held` and, not yet due by the claim's
/// `now()`, holds the key back.
#[tokio::test]
async fn a_requeue_racing_a_claim_that_began_first_keeps_the_keys_order() {
    let db = fresh_postgres_db().await;
    let relay = relay_in(&db.pool, lease::DEFAULT_GROUP).await;
    let topic = unique("requeue");
    put(&db.pool, &topic, "k", "first").await;
    put(&db.pool, &topic, "k", "second").await;
    let first = seq_of(&db.pool, "first").await;
    sqlx::query("UPDATE postal.outbox SET status = 'failed', held = true WHERE seq = $1")
        .bind(first)
        .execute(&db.pool)
        .await
        .unwrap();
    let lock = PartitionsLock::take(&db.url).await;
    let pool = db.pool.clone();
    let t = topic.clone();
    let claiming = tokio::spawn(async move { claim_of(&pool, relay, &t, 100).await });
    claim_waits_for_the_lock(&db.pool).await;
    let n = postal_admin::parked::requeue_seqs(
        &db.pool,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::Value::Null,
        &[first],
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(n, 1);
    lock.release().await;
    let c = claiming.await.unwrap();
    let got = payloads(&c);
    println!("the claim that began before the requeue took {got:?}");
    if let Some(c) = c {
        c.release().await.unwrap();
    }
    assert!(in_order_or_nothing(&got), "{got:?}");
}

/// Guarantee: a retry written back by claim C1 (`held`, due at C1's `now()` plus a zero
/// backoff) is never overtaken by its key's next event in a claim C2 that began before C1:
/// for C2 the retry is not yet due, so it holds the key back.
#[tokio::test]
async fn a_retry_written_back_is_not_overtaken_by_a_claim_that_began_earlier() {
    let db = fresh_postgres_db().await;
    let relay = relay_in(&db.pool, lease::DEFAULT_GROUP).await;
    let topic = unique("retry");
    put(&db.pool, &topic, "k", "first").await;
    let mut c2 = connect(&db.url).await;
    exec(&mut c2, "BEGIN").await;
    exec(&mut c2, "SELECT now()").await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut c1 = claim_of(&db.pool, relay, &topic, 100).await.unwrap();
    let batch = c1.take_events();
    let retry = claim::Failure {
        seq: batch[0].seq,
        counts: true,
        park: false,
        hold: true,
        retry_in: Duration::ZERO,
        reason: Some("refused".into()),
    };
    c1.complete(&batch, &[], &[retry]).await.unwrap();
    put(&db.pool, &topic, "k", "second").await;
    let sql = format!(
        "WITH c AS ({}) SELECT convert_from(payload, 'UTF8') FROM c ORDER BY seq",
        claim::CLAIM_DELETE
    );
    let got: Vec<String> = sqlx::query_scalar::<_, String>(&sql)
        .bind(None::<Vec<bool>>)
        .bind(100i64)
        .bind(Some(vec![topic.clone()]))
        .bind(None::<Vec<String>>)
        .bind(0i16)
        .bind(255i16)
        .bind(0i64)
        .bind(Vec::<i64>::new())
        .bind(Vec::<i64>::new())
        .fetch_all(&mut c2)
        .await
        .unwrap()
        .into_iter()
        .map(|p| serde_json::from_str::<String>(&p).unwrap())
        .collect();
    exec(&mut c2, "ROLLBACK").await;
    println!("C2 took {got:?}");
    assert!(in_order_or_nothing(&got), "{got:?}");
}

/// Guarantee: two writers whose transactions overlap on many keys at once (`enqueue_batch`, one
/// in key order, the other in reverse, the first to begin enqueueing last), read by a claim that
/// began between their starts, give every key's events in order or not at all.
#[tokio::test]
async fn overlapping_batch_writers_on_many_keys_keep_each_keys_order() {
    let db = fresh_postgres_db().await;
    let relay = relay_in(&db.pool, lease::DEFAULT_GROUP).await;
    let topic = unique("batch");
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let mut a = connect(&db.url).await;
    let mut b = connect(&db.url).await;
    exec(&mut a, "BEGIN").await;
    exec(&mut a, "SELECT now()").await;
    let lock = PartitionsLock::take(&db.url).await;
    let pool = db.pool.clone();
    let t = topic.clone();
    let claiming = tokio::spawn(async move { claim_of(&pool, relay, &t, 1000).await });
    claim_waits_for_the_lock(&db.pool).await;
    exec(&mut b, "BEGIN").await;
    let events = |tag: &str, rev: bool| {
        let mut ks = keys.clone();
        if rev {
            ks.reverse();
        }
        ks.iter()
            .map(|k| NewEvent::json(topic.as_str(), k.as_str(), "e", &tag).unwrap())
            .collect::<Vec<_>>()
    };
    enqueue_batch(&mut b, events("first", false)).await.unwrap();
    exec(&mut b, "COMMIT").await;
    enqueue_batch(&mut a, events("second", true)).await.unwrap();
    exec(&mut a, "COMMIT").await;
    lock.release().await;
    let c = claiming.await.unwrap().expect("the claim takes rows");
    let mut per_key: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for e in c.events() {
        per_key
            .entry(e.key.to_string())
            .or_default()
            .push(serde_json::from_slice::<String>(&e.payload).unwrap());
    }
    c.release().await.unwrap();
    let bad: Vec<_> = per_key
        .iter()
        .filter(|(_, v)| !in_order_or_nothing(v))
        .collect();
    assert!(bad.is_empty(), "keys out of order: {bad:?}");
}

/// Guarantee: an `enqueue` inside a savepoint that is released keeps its key's writer lock
/// until the transaction commits (a second writer of the key waits), so the key's sequence
/// stays its commit order.
#[tokio::test]
async fn an_enqueue_in_a_released_savepoint_keeps_its_key_locked_until_commit() {
    let db = fresh_postgres_db().await;
    let topic = unique("savepoint");
    let mut a = connect(&db.url).await;
    exec(&mut a, "BEGIN").await;
    exec(&mut a, "SAVEPOINT s").await;
    enqueue(
        &mut a,
        NewEvent::json(topic.as_str(), "k", "e", &"first").unwrap(),
    )
    .await
    .unwrap();
    exec(&mut a, "RELEASE SAVEPOINT s").await;
    let mut b = connect(&db.url).await;
    exec(&mut b, "BEGIN").await;
    exec(&mut b, "SET LOCAL lock_timeout = '300ms'").await;
    let r = sqlx::query("SELECT postal.enqueue($1, 'k', 'e', '\"second\"'::jsonb)")
        .bind(&topic)
        .execute(&mut b)
        .await;
    assert!(
        r.is_err(),
        "a second writer of the key got past the first's lock before its commit"
    );
    exec(&mut b, "ROLLBACK").await;
    exec(&mut a, "COMMIT").await;
}

/// Guarantee: the scope of a key is (topic, key): an event parked on topic A holds back the
/// key's later event on A, not its event on B, in one claim.
#[tokio::test]
async fn a_parked_event_holds_its_key_on_its_topic_only() {
    let db = fresh_postgres_db().await;
    let relay = relay_in(&db.pool, lease::DEFAULT_GROUP).await;
    let ta = unique("scope-a");
    let tb = unique("scope-b");
    put(&db.pool, &ta, "k", "a1").await;
    put(&db.pool, &tb, "k", "b1").await;
    put(&db.pool, &ta, "k", "a2").await;
    let a1 = seq_of(&db.pool, "a1").await;
    sqlx::query("UPDATE postal.outbox SET status = 'failed', held = true WHERE seq = $1")
        .bind(a1)
        .execute(&db.pool)
        .await
        .unwrap();
    let c = claim::claim(
        &db.pool,
        relay,
        &claim::all_partitions(),
        100,
        LEASE,
        true,
        &TopicFilter::All,
    )
    .await
    .unwrap();
    let got = payloads(&c);
    if let Some(c) = c {
        c.release().await.unwrap();
    }
    assert_eq!(got, ["b1"]);
}
