//! Order never rests on comparing times taken in different transactions: directed regressions
//! for the class an adversarial review found (issue 45), each a deterministic schedule of
//! writers and a claim against real PostgreSQL, with no fault at all.
//!
//! `now()` is the start of the transaction that reads it. `enqueue` stored the *writer's*
//! `now()` as `available_at`, and the claim kept rows with `available_at <= now()` — the
//! *claim's* start — while a row that was not due held its key back only when `held` was set.
//! A writer that began first and enqueued last got the higher sequence number and the earlier
//! time; a claim that began between the two writers' starts and claimed after both commits
//! took the key's later event alone. Each test below failed on the code before the fix (commit
//! 26a357e): the claim returned the later event without the earlier one.
//!
//! Where a test needs a claim that began earlier than it claims, it holds the claim up right
//! after its `BEGIN` the way production does: another session holds a lock on
//! `postal.relay_partitions` (a migration, `VACUUM FULL` or `pg_repack` of it), and the test
//! waits until PostgreSQL reports the claim's backend waiting for that lock.

use std::time::Duration;

use postal_integration_tests::{fresh_postgres_db, unique, wait};
use postal_producer::testing::{claim, lease};
use postal_producer::{enqueue, NewEvent, TopicFilter};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::common::held_up::{self, claim_waits_for_the_lock, connect, PartitionsLock};

/// A relay that holds every key partition for `lease_for`.
async fn relay_with_lease(pool: &PgPool, lease_for: Duration) -> Uuid {
    held_up::relay_in(pool, lease::DEFAULT_GROUP, lease_for).await
}

/// Starts a claim of up to 100 rows of every partition as `relay`, in a task.
fn spawn_claim(
    pool: &PgPool,
    relay: Uuid,
    lease_for: Duration,
) -> tokio::task::JoinHandle<Option<claim::Claim>> {
    let pool = pool.clone();
    tokio::spawn(async move {
        claim::claim(
            &pool,
            relay,
            &claim::all_partitions(),
            100,
            lease_for,
            true,
            &TopicFilter::All,
        )
        .await
        .unwrap()
    })
}

/// The payloads (JSON strings) of the claim's events, in claim order.
fn payloads(c: &claim::Claim) -> Vec<String> {
    c.events()
        .iter()
        .map(|e| serde_json::from_slice::<String>(&e.payload).unwrap())
        .collect()
}

/// How the "first" writer enqueues.
#[derive(Clone, Copy, Debug)]
enum First {
    /// `postal_producer::enqueue`.
    Rust,
    /// The SQL function `postal.enqueue`.
    Sql,
    /// `enqueue` with `deliver_at` a moment ago: due at once by its writer's clock, but later
    /// than the start of the claim's transaction.
    DueAtOnce,
}

/// The schedule of the review: writer A begins; the claim begins (and is held up); writer B
/// begins, enqueues `first` for key k and commits; A enqueues `second` for k and commits; then
/// the claim runs. B's event has the lower sequence number: the claim must take both, in
/// order, or neither — never `second` alone.
async fn writer_that_began_first_and_enqueued_last(first: First) {
    let db = fresh_postgres_db().await;
    let topic = unique("overlap");
    let lease_for = Duration::from_secs(60);
    let relay = relay_with_lease(&db.pool, lease_for).await;
    let mut a = connect(&db.url).await;
    let mut b = connect(&db.url).await;
    sqlx::query("BEGIN").execute(&mut a).await.unwrap();
    // A's transaction has started (its `now()` is fixed from here).
    sqlx::query("SELECT now()").execute(&mut a).await.unwrap();
    let lock = PartitionsLock::take(&db.url).await;
    let claiming = spawn_claim(&db.pool, relay, lease_for);
    claim_waits_for_the_lock(&db.pool).await;
    // The claim's transaction has begun. Only now does B take a time, or begin.
    let deliver_at = chrono::Utc::now();
    sqlx::query("BEGIN").execute(&mut b).await.unwrap();
    match first {
        First::Rust => {
            enqueue(
                &mut b,
                NewEvent::json(topic.as_str(), "k", "e", &"first").unwrap(),
            )
            .await
            .unwrap();
        }
        First::DueAtOnce => {
            let event = NewEvent::json(topic.as_str(), "k", "e", &"first")
                .unwrap()
                .deliver_at(deliver_at);
            enqueue(&mut b, event).await.unwrap();
        }
        First::Sql => {
            sqlx::query("SELECT postal.enqueue($1, 'k', 'e', '\"first\"'::jsonb)")
                .bind(&topic)
                .execute(&mut b)
                .await
                .unwrap();
        }
    }
    sqlx::query("COMMIT").execute(&mut b).await.unwrap();
    enqueue(
        &mut a,
        NewEvent::json(topic.as_str(), "k", "e", &"second").unwrap(),
    )
    .await
    .unwrap();
    sqlx::query("COMMIT").execute(&mut a).await.unwrap();
    lock.release().await;
    let claimed = claiming
        .await
        .unwrap()
        .expect("the claim takes the key's events");
    let got = payloads(&claimed);
    claimed.release().await.unwrap();
    assert_eq!(
        got,
        ["first", "second"],
        "{first:?}: the claim took the key's events out of order (or the later one alone)"
    );
}

/// Guarantee: a writer transaction that began before another writer's but enqueued after it
/// (through `postal_producer::enqueue`) never lets a claim that began between their starts take
/// the key's later event without its earlier one. (Failed before the fix: `["second"]`.)
#[tokio::test]
async fn a_writer_that_began_first_and_enqueued_last_never_overtakes() {
    writer_that_began_first_and_enqueued_last(First::Rust).await;
}

/// Guarantee: the same when the earlier event was written by the SQL function
/// `postal.enqueue` (services in other languages). (Failed before the fix.)
#[tokio::test]
async fn the_same_through_the_sql_enqueue_function() {
    writer_that_began_first_and_enqueued_last(First::Sql).await;
}

/// Guarantee: an event scheduled for a moment that had already passed when its writer began
/// (`deliver_at`, due at once and so not held) is not held back behind its key's later event
/// by a claim that began before that moment. (Failed before the fix.)
#[tokio::test]
async fn an_event_due_at_once_by_its_writers_clock_is_not_overtaken() {
    writer_that_began_first_and_enqueued_last(First::DueAtOnce).await;
}

/// Guarantee: a row the relay writes back as held back (a later event of a key whose earlier
/// one failed in the same batch; no attempt used) is never overtaken by its key's next event,
/// whatever the start times of the transactions that wrote them and of the claim that reads
/// them. Schedule: writer W begins; claim C2 begins (a connection of its own, playing a claim
/// held up after its `BEGIN`); claim C1 takes the key's event and writes it back held back;
/// W enqueues the key's next event and commits; C2 claims. Before the fix the write-back stored
/// C1's start as `available_at` without `held`, and C2, which began before C1, took the next
/// event alone.
#[tokio::test]
async fn a_held_back_row_is_never_overtaken_by_its_keys_next_event() {
    let db = fresh_postgres_db().await;
    let topic = unique("heldback");
    let lease_for = Duration::from_secs(60);
    let relay = relay_with_lease(&db.pool, lease_for).await;
    {
        let mut c = db.pool.acquire().await.unwrap();
        enqueue(
            &mut c,
            NewEvent::json(topic.as_str(), "k", "e", &"first").unwrap(),
        )
        .await
        .unwrap();
    }
    let mut w = connect(&db.url).await;
    sqlx::query("BEGIN").execute(&mut w).await.unwrap();
    sqlx::query("SELECT now()").execute(&mut w).await.unwrap();
    let mut c2 = connect(&db.url).await;
    sqlx::query("BEGIN").execute(&mut c2).await.unwrap();
    sqlx::query("SELECT now()").execute(&mut c2).await.unwrap();
    // C1: claims "first" and writes it back held back (as the verdict does for a key whose
    // earlier event in the batch failed).
    let mut c1 = spawn_claim(&db.pool, relay, lease_for)
        .await
        .unwrap()
        .expect("C1 claims the first event");
    let batch = c1.take_events();
    assert_eq!(batch.len(), 1);
    let held_back = claim::Failure {
        seq: batch[0].seq,
        counts: false,
        park: false,
        hold: false,
        retry_in: Duration::ZERO,
        reason: None,
    };
    c1.complete(&batch, &[], &[held_back]).await.unwrap();
    enqueue(
        &mut w,
        NewEvent::json(topic.as_str(), "k", "e", &"second").unwrap(),
    )
    .await
    .unwrap();
    sqlx::query("COMMIT").execute(&mut w).await.unwrap();
    // C2's claim statement, as the relay runs it (all partitions, no topic filter).
    let got: Vec<String> = claimed_payloads(&mut c2).await;
    sqlx::query("ROLLBACK").execute(&mut c2).await.unwrap();
    assert_eq!(
        got,
        ["first", "second"],
        "a claim took the key's next event without the held-back one before it"
    );
}

/// Runs the claim statement on `conn` (in its open transaction) and returns the claimed
/// payloads in sequence order.
async fn claimed_payloads(conn: &mut PgConnection) -> Vec<String> {
    let sql = format!(
        "WITH c AS ({}) SELECT payload FROM c ORDER BY seq",
        claim::CLAIM_DELETE
    );
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(&sql)
        .bind(None::<Vec<bool>>)
        .bind(100i64)
        .bind(None::<Vec<String>>)
        .bind(None::<Vec<String>>)
        .bind(0i16)
        .bind(255i16)
        .bind(0i64)
        .bind(Vec::<i64>::new())
        .bind(Vec::<i64>::new())
        .fetch_all(conn)
        .await
        .unwrap();
    rows.iter()
        .map(|p| serde_json::from_slice::<String>(p).unwrap())
        .collect()
}

/// Guarantee: a claim held up after its `BEGIN` (here: waiting for a lock on the partitions
/// table) never claims from partitions whose lease has less left than a claim may outlive
/// (`lease_reserve`, 55 % of the lease) by the time it checks. Before the fix the check read
/// the transaction's start, so a claim that waited took rows with its lease nearly gone.
#[tokio::test]
async fn a_claim_held_up_after_begin_never_counts_on_lease_time_gone_by() {
    let db = fresh_postgres_db().await;
    let topic = unique("stale-lease");
    let lease_for = Duration::from_secs(4);
    let relay = relay_with_lease(&db.pool, lease_for).await;
    {
        let mut c = db.pool.acquire().await.unwrap();
        enqueue(
            &mut c,
            NewEvent::json(topic.as_str(), "k", "e", &"x").unwrap(),
        )
        .await
        .unwrap();
    }
    // When the lease ends (read before the partitions table is locked).
    let until: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT min(lease_until) FROM postal.relay_partitions")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let lock = PartitionsLock::take(&db.url).await;
    let claiming = spawn_claim(&db.pool, relay, lease_for);
    claim_waits_for_the_lock(&db.pool).await;
    // Until the lease has less than the reserve left (by the database's clock), plus a margin.
    let reserve = postal_producer::testing::claim::lease_reserve(lease_for);
    wait::until(
        Duration::from_secs(10),
        "the lease has less than the reserve left",
        || async {
            let left: f64 =
                sqlx::query_scalar("SELECT extract(epoch FROM $1 - clock_timestamp())::float8")
                    .bind(until)
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            left < reserve.as_secs_f64() - 0.3
        },
    )
    .await;
    lock.release().await;
    let claimed = claiming.await.unwrap();
    let n = claimed.as_ref().map_or(0, |c| c.events().len());
    if let Some(c) = claimed {
        c.release().await.unwrap();
    }
    assert_eq!(
        n, 0,
        "a claim that waited after its BEGIN claimed with less lease left than the reserve"
    );
}
