//! Cancellation: Postal's work on a pool it shares with the application, dropped at any
//! moment (a task aborted at a shutdown deadline, a killed runtime), leaves that pool clean.

use std::time::Duration;

use postal_integration_tests::{services, wait};
use postal_shared::cleanup::{delete_in_batches, CleanupLock};
use sqlx::postgres::PgConnection;
use sqlx::Connection as _;

/// Guarantee: a transaction begun through `postal_shared::cancel_safe::begin` and dropped at
/// any point of its `BEGIN` leaves no connection of the pool inside a transaction: the next
/// statements on the pool's only connection run in transactions of their own. (sqlx's own
/// `pool.begin()` does not: transact-rs/sqlx#4393.)
#[tokio::test]
async fn a_begin_dropped_midway_leaves_no_connection_inside_a_transaction() {
    let db = services().await.fresh_db().await;
    let pool = db.pool_of(1).await;
    let mut cancelled = 0;
    for step in 0..400u64 {
        // Even steps: dropped after its first poll (it has sent `BEGIN` or is waiting for the
        // connection, and cannot have its answer yet). Odd steps: dropped at a deadline that
        // grows from 0 to 2 ms, so that every later point of the round trip is hit too.
        let after = Duration::from_micros(step * 5);
        if step % 2 == 0 {
            let mut begin = Box::pin(postal_shared::cancel_safe::begin(&pool));
            if futures::poll!(begin.as_mut()).is_pending() {
                cancelled += 1;
            }
            drop(begin);
        } else {
            let begun = tokio::time::timeout(after, postal_shared::cancel_safe::begin(&pool)).await;
            if begun.is_err() {
                cancelled += 1;
            }
            drop(begun);
        }
        // Outside a transaction block each statement is a transaction of its own, with a
        // later start time; inside one, `now()` is the block's start both times.
        let now = || async {
            sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT now()")
                .fetch_one(&pool)
                .await
                .unwrap()
        };
        let (first, second) = (now().await, now().await);
        assert!(
            second > first,
            "after a begin dropped at {after:?} the pool's connection was still inside a transaction"
        );
    }
    assert!(cancelled > 0, "no begin was dropped before it finished");
}

/// Guarantee: a cleanup job dropped while it holds its session advisory lock does not leave
/// that lock on a pooled connection: its connection is closed, and another instance can take
/// the lock at once after.
#[tokio::test]
async fn a_cleanup_dropped_midway_does_not_keep_its_lock() {
    let db = services().await.fresh_db().await;
    let pool = db.pool_of(2).await;
    const KEY: i64 = 424_242;
    // Stands in for a long DELETE: holds the lock for two seconds.
    const SLOW: &str = "SELECT pg_sleep(2), $1::bigint, $2::bigint";
    let mut job = Box::pin(delete_in_batches(
        &pool,
        CleanupLock::Key(KEY),
        SLOW,
        Duration::from_secs(1),
        10,
        |_| {},
    ));
    // Dropped once it holds the lock (seen from outside), not after a guessed delay.
    let locked = wait::until(
        Duration::from_secs(10),
        "the job to take its lock",
        || async {
            let mut other = PgConnection::connect(&db.url).await.unwrap();
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted
               AND classid = 0 AND objid = $1::bigint::oid AND objsubid = 1)",
            )
            .bind(KEY)
            .fetch_one(&mut other)
            .await
            .unwrap()
        },
    );
    tokio::select! {
        _ = &mut job => panic!("the job finished before it was dropped"),
        () = locked => {}
    }
    drop(job);
    // Checked from a connection outside the pool: a pooled one could be the very session
    // that holds the lock, and advisory locks are re-entrant within a session.
    wait::until(Duration::from_secs(10), "the lock to be free", || async {
        let mut other = PgConnection::connect(&db.url).await.unwrap();
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(KEY)
            .fetch_one(&mut other)
            .await
            .unwrap();
        if got {
            let _: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                .bind(KEY)
                .fetch_one(&mut other)
                .await
                .unwrap();
        }
        got
    })
    .await;
}
