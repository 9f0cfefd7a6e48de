//! The reviews of task check-out: their reproductions, each of which failed before its fix —
//! a given-up check-out let the next claim run a key's tasks out of order and at once;
//! `postal failed requeue` and outcomes that do not count repeated run numbers; runs cut off
//! by crashes were never parked; a late check-out, a graceful stop and a lowered
//! `max_attempts` used up or parked tasks whose handlers never failed; a stale run could
//! record over a requeued task; a graceful stop let a task run twice at once — and the modes
//! they found to hold.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use postal_integration_tests::{fresh_postgres_db, unique, wait};
use postal_producer::{enqueue_batch, NewEvent, Task, TaskConfig, TaskError, TaskTransport};
use sqlx::{Connection, Executor};

use crate::common::{fast_config, RunningRelay};

/// Finding 1. Guarantee: a check-out that takes long (here its UPDATE waits 2.6 s behind a
/// `SHARE` lock on `postal.outbox`, what a plain `CREATE INDEX` takes, with a 4 s lease) is
/// waited for, never given up while its transaction still holds the claimed rows: a key's
/// tasks run one at a time, in order. (Before: the lane gave the check-out up after a quarter
/// of the lease, its next claim skipped the key's locked first rows, read them as not held and
/// ran a later task first, then the first one beside it.)
#[tokio::test]
async fn a_slow_checkout_never_lets_the_next_claim_skip_a_keys_first_tasks() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev-stuck");
    let n = 12usize;
    let log = Arc::new(Mutex::new(Vec::<(i64, &'static str)>::new()));
    let running = Arc::new(AtomicI64::new(0));
    let max_running = Arc::new(AtomicI64::new(0));
    let (l, r, m) = (log.clone(), running.clone(), max_running.clone());
    let tasks =
        TaskTransport::new(TaskConfig::default().concurrency(2)).on("job", move |t: Task| {
            let (l, r, m) = (l.clone(), r.clone(), m.clone());
            async move {
                let i: i64 = t.json()?;
                let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                l.lock().unwrap().push((i, "start"));
                tokio::time::sleep(Duration::from_millis(if i == 2 { 2500 } else { 300 })).await;
                l.lock().unwrap().push((i, "end"));
                r.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, TaskError>(())
            }
        });
    let mut conn = db.pool.acquire().await.unwrap();
    let events = (0..n as i64)
        .map(|i| NewEvent::json(topic.as_str(), "one-key", "job", &i).unwrap())
        .collect();
    enqueue_batch(&mut conn, events).await.unwrap();
    drop(conn);

    // Something else holds a SHARE lock on the outbox for a while (a CREATE INDEX, a LOCK
    // TABLE in a migration): UPDATEs of the outbox wait, SELECT … FOR UPDATE does not.
    let mut blocker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    blocker.execute("BEGIN").await.unwrap();
    blocker
        .execute("LOCK TABLE postal.outbox IN SHARE MODE")
        .await
        .unwrap();

    let relay_pool = db.pool_of(16).await;
    let relay = RunningRelay::start(
        &relay_pool,
        tasks,
        fast_config().lease(Duration::from_secs(4)),
    )
    .owning(relay_pool.clone());
    // Let the first check-out block and be given up (after 1 s), and the next claim run.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let locks: Vec<(i32, String)> = sqlx::query_as(
        "SELECT count(*)::int4, coalesce(max(left(query, 60)), '') FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!("backends waiting on a lock before the release: {locks:?}");
    blocker.execute("COMMIT").await.unwrap();

    wait::until(Duration::from_secs(60), "all tasks done", || async {
        log.lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| *s == "end")
            .count()
            >= n
    })
    .await;
    relay.stop().await;
    let log = log.lock().unwrap().clone();
    eprintln!("run log: {log:?}");
    let starts: Vec<i64> = log
        .iter()
        .filter(|(_, s)| *s == "start")
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(
        max_running.load(Ordering::SeqCst),
        1,
        "a key's tasks ran concurrently: {log:?}"
    );
    assert_eq!(
        starts,
        (0..n as i64).collect::<Vec<_>>(),
        "a key's tasks ran out of order"
    );
}

/// Finding 2. Guarantee: `postal failed requeue` (its statement, from cli/src/failed.rs) resets
/// a parked task's attempts, not its run number: `Task::attempt` keeps strictly increasing
/// across its runs, so a downstream fencing by it never refuses the requeued runs. (Before:
/// 1, 2, 1.)
#[tokio::test]
async fn a_requeued_task_keeps_raising_its_run_number() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev-requeue");
    let seen = Arc::new(Mutex::new(Vec::<i32>::new()));
    let succeed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s, ok) = (seen.clone(), succeed.clone());
    let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
        let (s, ok) = (s.clone(), ok.clone());
        async move {
            s.lock().unwrap().push(t.attempt);
            if ok.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err(TaskError::retryable("downstream busy"))
            }
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    let id = postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let relay = RunningRelay::start(&db.pool, tasks, fast_config().max_attempts(2));
    wait::until(Duration::from_secs(30), "parked", || async {
        sqlx::query_scalar::<_, String>("SELECT status FROM postal.outbox WHERE event_id = $1")
            .bind(id.as_uuid())
            .fetch_optional(&db.pool)
            .await
            .unwrap()
            .as_deref()
            == Some("failed")
    })
    .await;
    succeed.store(true, Ordering::SeqCst);
    // `postal failed requeue --id <id>`.
    sqlx::query(
        "WITH batch AS (
             SELECT seq FROM postal.outbox WHERE status = 'failed'
             AND (cardinality($1::uuid[]) = 0 OR event_id = ANY($1))
             AND ($2::text IS NULL OR topic = $2)
             ORDER BY seq LIMIT 1000 FOR UPDATE)
         UPDATE postal.outbox o
            SET status = 'pending', attempts = 0, held = false,
                available_at = now(),
                last_error = 'requeued by operator; previous error: ' || coalesce(o.last_error, '-')
           FROM batch WHERE o.seq = batch.seq",
    )
    .bind(vec![id.as_uuid()])
    .bind(None::<String>)
    .execute(&db.pool)
    .await
    .unwrap();
    wait::until(Duration::from_secs(30), "done", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "Task::attempt is not strictly increasing across the runs of one task: {seen:?}"
    );
}

/// Finding 3. Guarantee: an outcome that does not count as an attempt (`Unavailable` from a
/// broker behind a `Router` that also holds a task runner) does not repeat the run number of
/// the row's next check-out. (Before: 1, 1, 1, 1.)
#[tokio::test]
async fn a_non_counting_outcome_still_raises_the_run_number() {
    use futures::future::BoxFuture;
    use futures::FutureExt;
    use postal_producer::{FailureKind, OutboundEvent, PublishError, Router, Transport};

    #[derive(Clone)]
    struct Flaky(Arc<Mutex<Vec<i32>>>);
    impl Transport for Flaky {
        type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;
        async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
            let mut seen = self.0.lock().unwrap();
            let out = batch
                .iter()
                .map(|e| {
                    seen.push(e.attempts + 1);
                    if seen.len() < 4 {
                        Err(PublishError::new(FailureKind::Unavailable, "broker down"))
                    } else {
                        Ok(())
                    }
                })
                .collect();
            async move { out }.boxed()
        }
    }
    let db = fresh_postgres_db().await;
    let topic = unique("rev-router");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let router = Router::new()
        .destination("tasks", TaskTransport::new(TaskConfig::default()))
        .destination("broker", Flaky(seen.clone()))
        .route("tasks.*", "tasks")
        .unwrap()
        .fallback("broker")
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "order.placed", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let relay = RunningRelay::start(&db.pool, router, fast_config());
    wait::until(Duration::from_secs(60), "published", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "run numbers of one checked-out row repeat: {seen:?}"
    );
}

/// Finding 4. A run that ends without an outcome (process killed, run lease lost) counts as a
/// failed attempt: a task whose runs keep "killing the process" is parked once its
/// `max_attempts` are used up, with a reason that says so, instead of running forever (and
/// taking down every task beside it each time). (Before: run numbers 1, 2, 3, 4, … and the
/// row pending for good.)
#[tokio::test]
async fn runs_cut_off_by_crashes_are_counted_and_parked() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev-poison");
    let seen = Arc::new(Mutex::new(Vec::<i32>::new()));
    let started = Arc::new(tokio::sync::Notify::new());
    let mut conn = db.pool.acquire().await.unwrap();
    let id = postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let cfg = fast_config().max_attempts(2).lease(Duration::from_secs(2));
    let status = |pool: sqlx::PgPool| async move {
        sqlx::query_as::<_, (String, i32, Option<String>)>(
            "SELECT status, attempts, last_error FROM postal.outbox WHERE event_id = $1",
        )
        .bind(id.as_uuid())
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    for _crash in 0..4 {
        let (s, st) = (seen.clone(), started.clone());
        let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
            let (s, st) = (s.clone(), st.clone());
            async move {
                s.lock().unwrap().push(t.attempt);
                st.notify_one();
                // The handler "kills the process" (the test kills the relay).
                std::future::pending::<()>().await;
                Ok::<_, TaskError>(())
            }
        });
        let pool = db.process_pool().await;
        let relay = RunningRelay::start(&pool, tasks, cfg.clone()).owning(pool);
        let ran = started.notified();
        tokio::pin!(ran);
        wait::until(
            Duration::from_secs(20),
            "the task to run again or be parked",
            || {
                let ran = ran.as_mut().now_or_never().is_some();
                let pool = db.pool.clone();
                async move { ran || status(pool).await.0 == "failed" }
            },
        )
        .await;
        relay.kill().await;
        if status(db.pool.clone()).await.0 == "failed" {
            break;
        }
    }
    let (row_status, attempts, reason) = status(db.pool.clone()).await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, vec![1, 2], "two runs, then no more");
    assert_eq!(
        row_status, "failed",
        "parked (attempts {attempts}, {reason:?})"
    );
    assert!(
        reason
            .as_deref()
            .unwrap_or("")
            .contains("without an outcome"),
        "{reason:?}"
    );
}

/// Held: history mode and keep-published mode record checked-out tasks once, with the failed
/// attempts before the success in history, and the published row unheld.
#[tokio::test]
async fn history_and_keep_published_modes_record_tasks_once() {
    for keep in [false, true] {
        let db = fresh_postgres_db().await;
        let topic = unique("rev-modes");
        let tasks = TaskTransport::new(TaskConfig::default()).on("job", |t: Task| async move {
            if t.attempt == 1 {
                Err(TaskError::retryable("first run fails"))
            } else {
                Ok(())
            }
        });
        let mut conn = db.pool.acquire().await.unwrap();
        let events = (0..5i64)
            .map(|i| NewEvent::json(topic.as_str(), format!("k{}", i % 2), "job", &i).unwrap())
            .collect();
        enqueue_batch(&mut conn, events).await.unwrap();
        drop(conn);
        let cfg = if keep {
            fast_config()
                .delete_on_publish(false)
                .retention(Some(Duration::from_secs(3600)))
        } else {
            fast_config().history(Some(Duration::from_secs(3 * 86400)))
        };
        let relay = RunningRelay::start(&db.pool, tasks, cfg);
        wait::until(Duration::from_secs(30), "all recorded", || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM postal.outbox WHERE status = 'pending'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap()
                == 0
        })
        .await;
        relay.stop().await;
        let rows: Vec<(i32, bool)> = if keep {
            sqlx::query_as("SELECT attempts, held FROM postal.outbox WHERE status = 'published'")
                .fetch_all(&db.pool)
                .await
                .unwrap()
        } else {
            sqlx::query_as("SELECT attempts, false FROM postal.outbox_history")
                .fetch_all(&db.pool)
                .await
                .unwrap()
        };
        eprintln!("keep={keep}: {rows:?}");
        assert_eq!(rows.len(), 5);
        assert!(rows.iter().all(|(_, held)| !held));
    }
}

async fn only_row(pool: &sqlx::PgPool) -> Option<(String, i32, i32, Option<String>)> {
    sqlx::query_as("SELECT status, attempts, runs, last_error FROM postal.outbox")
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Second review, R1. Guarantee: a check-out that commits after its hand-over deadline (its
/// UPDATE waited 3.4 s behind a `SHARE` lock, what a plain `CREATE INDEX` takes, with a 4 s
/// lease) is not handed over but given back without counting an attempt: the task runs (here
/// with `max_attempts = 1`). (Before: parked at its next check-out, "ended without an outcome",
/// its handler never run.)
#[tokio::test]
async fn a_late_checkout_is_given_back_and_runs() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev2-late");
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |_t: Task| {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, TaskError>(())
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let mut blocker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    blocker.execute("BEGIN").await.unwrap();
    blocker
        .execute("LOCK TABLE postal.outbox IN SHARE MODE")
        .await
        .unwrap();
    let relay = RunningRelay::start(
        &db.pool,
        tasks,
        fast_config().lease(Duration::from_secs(4)).max_attempts(1),
    );
    // Wait until the check-out's UPDATE waits on the lock, then hold it 3.4 s more.
    wait::until(Duration::from_secs(20), "check-out blocked", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
             AND wait_event_type = 'Lock' AND query LIKE '%SET runs%'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
            > 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(3400)).await;
    blocker.execute("COMMIT").await.unwrap();
    // The run lease (4 s) ends; the task is claimed again.
    let _ = tokio::time::timeout(Duration::from_secs(12), async {
        loop {
            if only_row(&db.pool).await.is_none() || only_row(&db.pool).await.unwrap().0 == "failed"
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let r = only_row(&db.pool).await;
    relay.stop().await;
    eprintln!("handler runs: {}, row: {r:?}", ran.load(Ordering::SeqCst));
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "the task never ran, and its row is {r:?}"
    );
}

/// Second review, R2. Guarantee: a graceful stop that outlasts `shutdown_timeout` aborts the
/// running handler and gives its task back without counting an attempt: graceful restarts
/// (deploys) during one long task never park it. (Before: each counted as a failed attempt.)
#[tokio::test]
async fn graceful_stops_never_use_up_a_long_tasks_attempts() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev2-stop");
    let mut conn = db.pool.acquire().await.unwrap();
    postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let seen = Arc::new(Mutex::new(Vec::<i32>::new()));
    let cfg = fast_config()
        .lease(Duration::from_secs(2))
        .max_attempts(2)
        .shutdown_timeout(Duration::from_millis(500));
    for _deploy in 0..3 {
        let s = seen.clone();
        let started = Arc::new(tokio::sync::Notify::new());
        let st = started.clone();
        let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
            let (s, st) = (s.clone(), st.clone());
            async move {
                s.lock().unwrap().push(t.attempt);
                st.notify_one();
                tokio::time::sleep(Duration::from_secs(30)).await; // a long task
                Ok::<_, TaskError>(())
            }
        });
        let relay = RunningRelay::start(&db.pool, tasks, cfg.clone());
        let ok = tokio::time::timeout(Duration::from_secs(8), started.notified()).await;
        relay.stop().await; // graceful
        if ok.is_err() {
            break;
        }
    }
    let r = only_row(&db.pool).await;
    let seen = seen.lock().unwrap().clone();
    eprintln!("runs seen: {seen:?}, row: {r:?}");
    assert_ne!(
        r.as_ref().map(|r| r.0.as_str()),
        Some("failed"),
        "parked after graceful stops only: {r:?} (runs {seen:?})"
    );
}

/// Second review, R3. Guarantee: a task waiting for its retry with 3 attempts used, whose runs
/// all ended with an outcome, still runs when `max_attempts` is lowered to 3 (as a broker event
/// does): only a run cut off without an outcome is counted at check-out. (Before: parked unrun,
/// with a reason saying its last run ended without an outcome.)
#[tokio::test]
async fn a_lowered_max_attempts_still_runs_a_waiting_task() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev2-lowered");
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |_t: Task| {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, TaskError>(())
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    // Three earlier runs failed with an outcome (as settle leaves such a row).
    sqlx::query(
        "UPDATE postal.outbox SET attempts = 3, runs = 3, held = true,
         last_error = 'downstream busy'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let relay = RunningRelay::start(&db.pool, tasks, fast_config().max_attempts(3));
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        while only_row(&db.pool).await.is_some_and(|r| r.0 == "pending") {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let r = only_row(&db.pool).await;
    relay.stop().await;
    eprintln!("handler runs: {}, row: {r:?}", ran.load(Ordering::SeqCst));
    assert_eq!(ran.load(Ordering::SeqCst), 1, "never ran; row {r:?}");
}

/// Second review, R4. Guarantee: a run cut off and then parked at another check-out (its
/// attempts used up) can never record its outcome over the task once `postal failed requeue`
/// made it pending again: parking at check-out raises the run number too. Emulated: while run
/// 1's handler is still going, the row is set as another relay's check-out parks it, then
/// requeued with the CLI's statement; run 1 then finishes (a relay whose settle was delayed),
/// and its outcome is refused: the requeued task runs again. (Before: run 1's outcome deleted
/// the requeued row, which never ran again.)
#[tokio::test]
async fn a_stale_run_never_records_over_a_requeued_task() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev2-stale");
    let seen = Arc::new(Mutex::new(Vec::<i32>::new()));
    let go = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(tokio::sync::Notify::new());
    let (s, g, st) = (seen.clone(), go.clone(), started.clone());
    let tasks =
        TaskTransport::new(TaskConfig::default().concurrency(1)).on("job", move |t: Task| {
            let (s, g, st) = (s.clone(), g.clone(), st.clone());
            async move {
                s.lock().unwrap().push(t.attempt);
                st.notify_one();
                if t.attempt == 1 {
                    g.notified().await;
                }
                Ok::<_, TaskError>(())
            }
        });
    let mut conn = db.pool.acquire().await.unwrap();
    let id = postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let relay = RunningRelay::start(
        &db.pool,
        tasks,
        fast_config().max_attempts(1).lease(Duration::from_secs(20)),
    );
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .unwrap();
    // What the other relay's check-out does to the row (its run 1 cut off, attempts used up).
    sqlx::query(
        "UPDATE postal.outbox SET status = 'failed', held = true, runs = runs + 1,
         running = false, attempts = 1,
         last_error = 'parked: 1 attempts used, the last ended without an outcome'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // `postal failed requeue --id <id>` (cli/src/failed.rs).
    sqlx::query(
        "WITH batch AS (SELECT seq FROM postal.outbox WHERE status = 'failed'
             AND event_id = ANY($1) ORDER BY seq LIMIT 1000 FOR UPDATE)
         UPDATE postal.outbox o SET status = 'pending', attempts = 0, held = false,
             available_at = now(),
             last_error = 'requeued by operator; previous error: ' || coalesce(o.last_error, '-')
           FROM batch WHERE o.seq = batch.seq",
    )
    .bind(vec![id.as_uuid()])
    .execute(&db.pool)
    .await
    .unwrap();
    let before = only_row(&db.pool).await;
    go.notify_one(); // the stale run 1 delivers its outcome
    wait::until(
        Duration::from_secs(20),
        "the requeued task to run and finish",
        || async { only_row(&db.pool).await.is_none() },
    )
    .await;
    let after = only_row(&db.pool).await;
    relay.stop().await;
    let seen = seen.lock().unwrap().clone();
    eprintln!("requeued row: {before:?}; after the stale outcome: {after:?}; runs: {seen:?}");
    assert!(
        seen.len() >= 2,
        "the requeued task never ran: run 1's stale outcome was recorded over it (row now {after:?})"
    );
}

#[derive(Default)]
struct Seen {
    active: HashMap<String, usize>,
    overlaps: Vec<(String, i32)>,
    runs: Vec<(String, i32, &'static str)>,
}

fn stop_transport(
    seen: Arc<Mutex<Seen>>,
    go: tokio::sync::watch::Receiver<bool>,
    who: &'static str,
) -> TaskTransport {
    TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
        let (seen, mut go) = (seen.clone(), go.clone());
        async move {
            {
                let mut s = seen.lock().unwrap();
                let n = s.active.entry(t.key.clone()).or_default();
                *n += 1;
                if *n > 1 {
                    s.overlaps.push((t.key.clone(), t.attempt));
                }
                s.runs.push((t.key.clone(), t.attempt, who));
            }
            // Leave the count on abort too.
            struct Out(Arc<Mutex<Seen>>, String);
            impl Drop for Out {
                fn drop(&mut self) {
                    *self.0.lock().unwrap().active.get_mut(&self.1).unwrap() -= 1;
                }
            }
            let _out = Out(seen.clone(), t.key.clone());
            if who == "B" {
                return Ok::<_, TaskError>(());
            }
            let _ = go.wait_for(|g| *g).await;
            // A synchronous stretch of work (CPU-bound report generation): no await inside.
            std::thread::sleep(Duration::from_secs(2));
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, TaskError>(())
        }
    })
}

/// Third review, finding 1. Guarantee: a graceful stop that aborts handlers in the middle of
/// a synchronous stretch (2 s without an `.await`) never lets another relay start the same
/// task while they still run: their rows are given back counting nothing but stay due at the
/// end of their run leases. Relay A runs tasks on 4 keys, B joins and takes half the
/// partitions, A stops; B then runs each task once, as run 2, never beside A's run 1.
/// (Before: the rows were due at once, and B ran all four while A's were still running.)
#[tokio::test(flavor = "multi_thread", worker_threads = 12)]
async fn a_graceful_stop_never_lets_a_task_run_twice_at_once() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev3-rel");
    let mut conn = db.pool.acquire().await.unwrap();
    for k in 0..4 {
        postal_producer::enqueue(
            &mut conn,
            NewEvent::json(topic.as_str(), format!("k{k}"), "job", &k).unwrap(),
        )
        .await
        .unwrap();
    }
    drop(conn);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (go_tx, go) = tokio::sync::watch::channel(false);
    let cfg = fast_config()
        .lease(Duration::from_secs(6))
        .shutdown_timeout(Duration::from_millis(300));
    let a = RunningRelay::start(
        &db.pool,
        stop_transport(seen.clone(), go.clone(), "A"),
        cfg.clone(),
    );
    // All four started under A.
    let t0 = std::time::Instant::now();
    while seen.lock().unwrap().runs.len() < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "A never started its tasks"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b = RunningRelay::start(
        &db.pool,
        stop_transport(seen.clone(), go.clone(), "B"),
        cfg.clone(),
    );
    // Wait until both relays own partitions.
    let t0 = std::time::Instant::now();
    loop {
        let owners: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT owner) FROM postal.relay_partitions WHERE owner IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if owners >= 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "B never got partitions"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    go_tx.send(true).unwrap(); // A's handlers enter their synchronous stretch
    tokio::time::sleep(Duration::from_millis(50)).await;
    a.stop().await;
    wait::until(
        Duration::from_secs(60),
        "B to run the four tasks",
        || async { crate::common::outbox_count(&db.pool).await == 0 },
    )
    .await;
    b.stop().await;
    let s = seen.lock().unwrap();
    let (overlaps, runs) = (s.overlaps.clone(), s.runs.clone());
    drop(s);
    let by_b: Vec<i32> = runs.iter().filter(|r| r.2 == "B").map(|r| r.1).collect();
    assert_eq!(
        by_b,
        vec![2, 2, 2, 2],
        "B ran each task once, as run 2: {runs:?}"
    );
    eprintln!("runs: {runs:?}\noverlaps: {overlaps:?}");
    assert!(
        overlaps.is_empty(),
        "two runs of one task at once: {overlaps:?} (runs {runs:?})"
    );
}
