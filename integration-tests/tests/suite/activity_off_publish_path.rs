//! Review of the relay's activity reporting (`postal.relay_minutes`, migration 0018;
//! `producer/src/activity.rs`): attacks on its claim to be entirely off the publish path.
//!
//! Most scenarios put a small PostgreSQL wire-protocol proxy (`common::pg_proxy`) between the relay's
//! pool and the server. It passes everything through, and on request: delays the `BEGIN`
//! statements (a slow database or link), holds the next execution of the activity upsert (a
//! write in flight), or cuts the connection right after the server committed the activity
//! upsert, before its answer reaches the relay (a connection lost at commit).

use std::sync::atomic::Ordering;
use std::time::Duration;

use postal_integration_tests::{fresh_postgres_db, unique, wait, TestDb};
use postal_producer::{enqueue, enqueue_batch, NewEvent};
use sqlx::PgPool;

use crate::common::pg_proxy::{pool_through, proxy_for, Acking};
use crate::common::{fast_config, RunningRelay};

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Events charted published, over every relay and minute.
async fn charted(pool: &PgPool) -> i64 {
    scalar(
        pool,
        "SELECT coalesce(sum(published), 0)::int8 FROM postal.relay_minutes",
    )
    .await
}

async fn enqueue_n(pool: &PgPool, topic: &str, n: usize) {
    let events = (0..n)
        .map(|i| {
            NewEvent::json(topic, format!("k{i}"), "t", &serde_json::json!({ "i": i })).unwrap()
        })
        .collect();
    let mut tx = pool.begin().await.unwrap();
    enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
}

async fn wait_published(pool: &PgPool) {
    wait::until(
        Duration::from_secs(30),
        "the outbox to be published",
        || async { scalar(pool, "SELECT count(*) FROM postal.outbox").await == 0 },
    )
    .await;
}

async fn wait_leases(pool: &PgPool) {
    wait::until(
        Duration::from_secs(30),
        "the relay to hold every key partition",
        || async {
            scalar(
                pool,
                "SELECT count(*) FROM postal.relay_partitions
                 WHERE owner IS NOT NULL AND lease_until > now()",
            )
            .await
                == 256
        },
    )
    .await;
}

/// Sessions of the test database that sit inside a transaction, as `pid state since-xact-start`.
async fn idle_in_transaction(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT format('pid %s %s since %s, last statement %L', pid, state, xact_start, query)
         FROM pg_stat_activity
         WHERE datname = $1 AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()",
    )
    .bind(&db.name)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Found by review, fixed (lose an event; the pool Postal shares with the application is left dirty).
///
/// Guarantee: the relay's work on the pool it is given (which the application shares: an
/// embedded relay) stays correct when it is dropped at a deadline — here the relay's stop,
/// whose last activity flush is cut off after one second "so that a stop does not wait on an
/// unreachable database". After the stop, a statement the application runs on a bare pooled
/// connection commits on its own, as `enqueue`'s documentation promises ("A bare connection
/// (`&mut *pool.acquire().await?`) … commits the event on its own").
///
/// The attack: the database answers slowly when the relay stops (every `BEGIN` takes 1.5 s).
/// Before the fix, the final flush (`activity::write`) opened its transaction with sqlx's own
/// `pool.begin()`, not `postal_shared::cancel_safe::begin`; the 1 s timeout drops it while `BEGIN` is in
/// flight, and sqlx (transact-rs/sqlx#4393) returns that connection to the pool inside the
/// transaction the server then opened. The application's next `enqueue` on it returns `Ok`
/// but is not committed; when the pool closes, the event is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_on_a_slow_database_leaves_no_pooled_connection_inside_a_transaction() {
    let db = fresh_postgres_db().await;
    let proxy = proxy_for(&db).await;
    let pool = pool_through(&db, &proxy, 10).await;
    let topic = unique("activity");
    // The lanes claim when woken by an enqueue (LISTEN), so at the stop they are idle. A
    // 30 s lease spaces housekeeping (whose checks also begin with `pool.begin()`, from
    // before this change) 15 s apart: it ran at the start and is not due again at the stop,
    // so what the stop cuts off is the activity flush.
    let relay = RunningRelay::start(
        &pool,
        Acking,
        fast_config()
            .poll_interval(Duration::from_secs(60))
            .lease(Duration::from_secs(30)),
    );
    wait_leases(&db.pool).await;
    // Line up with the relay's report: the first events charted mean a flush just happened,
    // and the next comes 5 s later.
    enqueue_n(&db.pool, &topic, 5).await;
    wait_published(&db.pool).await;
    wait::until(
        Duration::from_secs(20),
        "the first events to be charted",
        || async { charted(&db.pool).await >= 5 },
    )
    .await;
    // One more event: its count is in memory when the relay stops.
    enqueue_n(&db.pool, &topic, 1).await;
    wait_published(&db.pool).await;
    proxy.ctl.begin_delay_ms.store(1500, Ordering::SeqCst);
    let stats = relay.stop().await;
    proxy.ctl.begin_delay_ms.store(0, Ordering::SeqCst);
    assert_eq!(stats.published, 6);
    // Every connection back in the pool (a dropped one returns after its pending answers).
    wait::until(
        Duration::from_secs(20),
        "every pooled connection to be idle",
        || async { pool.num_idle() == pool.size() as usize },
    )
    .await;
    let stuck = idle_in_transaction(&db).await;

    // The application goes on using its pool: one event on each connection, each on its own.
    let mut conns = Vec::new();
    for _ in 0..pool.size() {
        conns.push(pool.acquire().await.unwrap());
    }
    let mut ids = Vec::new();
    for (i, c) in conns.iter_mut().enumerate() {
        // A key each: an enqueue inside a stale transaction keeps its key's lock, and the
        // next enqueue of that key would wait for it forever.
        let e = NewEvent::json(
            topic.as_str(),
            format!("after-stop-{i}"),
            "t",
            &serde_json::json!({}),
        )
        .unwrap();
        let id = tokio::time::timeout(Duration::from_secs(10), enqueue(c, e))
            .await
            .expect("enqueue returns")
            .expect("enqueue on a bare pooled connection");
        ids.push(id.as_uuid());
    }
    drop(conns);
    let committed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE event_id = ANY($1)")
            .bind(&ids)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    // The application shuts down: what was not committed is gone for good.
    pool.close().await;
    let kept: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE event_id = ANY($1)")
            .bind(&ids)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        committed == ids.len() as i64 && kept == ids.len() as i64,
        "{} enqueues returned Ok on the pool after the relay stopped; {committed} were committed, \
         {kept} are left after the pool closed. Sessions left inside a transaction by the stop: {stuck:?}",
        ids.len()
    );
}

/// Found by review, fixed (counts double-counted when the write fails and is retried).
///
/// Guarantee (the claim under review): activity counts are neither lost nor double-counted
/// when writing them fails and is retried: after a clean stop, the events charted published
/// equal the relay's own total (`RelayStats::published`).
///
/// The attack: the connection is lost at the commit of an activity upsert — the server
/// committed it, the answer never arrives. `Activity::flush` takes the error for "not
/// written", puts the tallies back and adds them again on the next flush (before the fix;
/// now the totals are written as they stand, and a row only grows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lost_at_its_commit_is_not_counted_twice() {
    let db = fresh_postgres_db().await;
    let proxy = proxy_for(&db).await;
    let pool = pool_through(&db, &proxy, 10).await;
    let topic = unique("activity");
    let relay = RunningRelay::start(&pool, Acking, fast_config());
    wait_leases(&db.pool).await;
    proxy.ctl.cut_minutes_commit.store(true, Ordering::SeqCst);
    enqueue_n(&db.pool, &topic, 20).await;
    wait_published(&db.pool).await;
    wait::until(
        Duration::from_secs(20),
        "an activity upsert cut at its commit",
        || async { proxy.ctl.cuts.load(Ordering::SeqCst) == 1 },
    )
    .await;
    let stats = relay.stop().await;
    assert_eq!(stats.published, 20);
    let charted = charted(&db.pool).await;
    assert_eq!(
        charted, stats.published as i64,
        "the relay published {} events; the charts say {charted}",
        stats.published
    );
}

/// Found by review, fixed (counts lost at a clean stop; minor: charts only).
///
/// Guarantee: a relay that stops cleanly, with the database up, charts every event it
/// published (the module: only "a relay that dies loses its last few seconds of counts").
///
/// The attack: the stop comes while a periodic activity write is in flight (here held at the
/// proxy; in production a slow database, or the table locked for up to its 1 s lock timeout).
/// The report task is aborted with the other background tasks; the tallies it had taken out
/// of memory go with it, and the stop's last flush finds nothing left to write (before the
/// fix; now totals stay in memory until a write of them went through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_during_an_activity_write_keeps_its_counts() {
    let db = fresh_postgres_db().await;
    let proxy = proxy_for(&db).await;
    let pool = pool_through(&db, &proxy, 10).await;
    let topic = unique("activity");
    let relay = RunningRelay::start(&pool, Acking, fast_config());
    wait_leases(&db.pool).await;
    proxy.ctl.hold_minutes.store(true, Ordering::SeqCst);
    enqueue_n(&db.pool, &topic, 20).await;
    wait_published(&db.pool).await;
    wait::until(
        Duration::from_secs(20),
        "a periodic activity write to be in flight",
        || async { proxy.ctl.held.load(Ordering::SeqCst) == 1 },
    )
    .await;
    let stats = relay.stop().await;
    proxy.ctl.release.send_replace(true);
    wait::until(
        Duration::from_secs(20),
        "every pooled connection to be idle",
        || async { pool.num_idle() == pool.size() as usize },
    )
    .await;
    assert_eq!(stats.published, 20);
    let charted = charted(&db.pool).await;
    assert_eq!(
        charted, stats.published as i64,
        "the relay published {} events and stopped cleanly; the charts say {charted}",
        stats.published
    );
}

/// REGRESSION CHECK (attack that did not break): the activity table locked by someone else
/// (`ACCESS EXCLUSIVE`, held for the whole run) while a relay with a pool of exactly the size
/// it asks for (`lanes + in-flight + 3`) publishes. Guarantee: publishing does not wait for the
/// table (every event is published while it stays locked), the stop is not held up by it, and
/// the counts the failed writes kept in memory are written once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_activity_table_holds_up_neither_publishing_nor_the_stop() {
    let db = fresh_postgres_db().await;
    let config = fast_config().max_in_flight_batches(2).batch_size(50);
    let pool = db
        .pool_of(postal_producer::Relay::<Acking>::connections_wanted(
            &config,
        ))
        .await;
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE postal.relay_minutes IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let topic = unique("activity");
    let relay = RunningRelay::start(&pool, Acking, config);
    for _ in 0..10 {
        enqueue_n(&db.pool, &topic, 100).await;
    }
    wait_published(&db.pool).await;
    wait::until(
        Duration::from_secs(30),
        "a write of the activity to wait on the lock",
        || async {
            scalar(
                &db.pool,
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                 WHERE c.relname = 'relay_minutes' AND NOT l.granted",
            )
            .await
                > 0
        },
    )
    .await;
    enqueue_n(&db.pool, &topic, 100).await;
    wait_published(&db.pool).await;
    lock.rollback().await.unwrap();
    let started = std::time::Instant::now();
    let stats = relay.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "stop took {:?}",
        started.elapsed()
    );
    assert_eq!(stats.published, 1100);
    assert_eq!(charted(&db.pool).await, 1100);
}

/// REGRESSION CHECK (attack that did not break): a relay role granted before migration 0018
/// (`postal grant --relay` of the previous release: nothing on `postal.relay_minutes`).
/// Guarantee: every event is published and the relay stops normally; only the charts are
/// empty (the writes and prunes are refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_role_without_rights_on_the_activity_table_still_publishes() {
    let db = fresh_postgres_db().await;
    let (_role, pool) = crate::common::roles::pre18_relay_pool(&db, 8).await;
    let topic = unique("activity");
    let relay = RunningRelay::start(&pool, Acking, fast_config());
    enqueue_n(&db.pool, &topic, 300).await;
    wait_published(&db.pool).await;
    // The stop's last flush has counts to write, and is refused.
    let started = std::time::Instant::now();
    let stats = tokio::time::timeout(Duration::from_secs(30), relay.stop())
        .await
        .expect("the relay stops");
    assert!(started.elapsed() < Duration::from_secs(15));
    assert_eq!(stats.published, 300);
    assert_eq!(charted(&db.pool).await, 0);
}
