//! In-process task handlers run by the relay instead of publishing: retries, crashes, and
//! mutual exclusion across relays.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postal_integration_tests::{services, unique, wait};
use postal_producer::{
    enqueue, enqueue_batch, NewEvent, State, Task, TaskConfig, TaskError, TaskTransport,
};
use sqlx::PgPool;

use crate::common::{fast_config, outbox_count, RunningRelay};

async fn status_of(
    pool: &PgPool,
    id: postal_producer::EventId,
) -> Option<(String, Option<String>)> {
    sqlx::query_as("SELECT status, last_error FROM postal.outbox WHERE event_id = $1")
        .bind(id.as_uuid())
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// What the report handler saw: the task runner's state.
#[derive(Clone, Default)]
struct Reports {
    runs: Arc<Mutex<Vec<(String, i32)>>>,
    done: Arc<AtomicU64>,
}

/// Fails twice (retryable), then succeeds, recording each run in the runner's state.
async fn make_report(State(reports): State<Reports>, task: Task) -> Result<(), TaskError> {
    let n: u32 = task.json()?;
    reports
        .runs
        .lock()
        .unwrap()
        .push((task.id.to_string(), task.attempt));
    if task.attempt <= 2 {
        return Err(TaskError::retryable(format!("report store busy ({n})")));
    }
    reports.done.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Guarantee: a handler that fails twice (retryable) and then succeeds runs three times and
/// completes once, with its attempt number; a permanent failure, an undecodable payload and an
/// event type without a handler are parked with their reasons, not retried. (The report handler
/// takes the runner's state, `State<Reports>`; the e-mail handler is a plain closure.)
#[tokio::test]
async fn failing_twice_then_succeeding_completes_once() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks");
    let reports = Reports::default();
    let (runs, done) = (reports.runs.clone(), reports.done.clone());
    let tasks = TaskTransport::new(TaskConfig::default())
        .state(reports)
        .on("report.requested", make_report)
        .on("email.requested", |_task: Task| async move {
            Err(TaskError::permanent("mailbox does not exist"))
        });
    let mut conn = db.pool.acquire().await.unwrap();
    let report = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "r1", "report.requested", &7).unwrap(),
    )
    .await
    .unwrap();
    let email = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "e1", "email.requested", &1).unwrap(),
    )
    .await
    .unwrap();
    let garbled = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "r2", "report.requested", &"not a number").unwrap(),
    )
    .await
    .unwrap();
    let unknown = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "u1", "fax.requested", &1).unwrap(),
    )
    .await
    .unwrap();
    let relay = RunningRelay::start(&db.pool, tasks, fast_config().max_attempts(5));
    wait::until(Duration::from_secs(30), "report task done", || async {
        status_of(&db.pool, report).await.is_none()
    })
    .await;
    wait::until(Duration::from_secs(30), "others parked", || async {
        let mut parked = 0;
        for id in [email, garbled, unknown] {
            if status_of(&db.pool, id)
                .await
                .is_some_and(|(s, _)| s == "failed")
            {
                parked += 1;
            }
        }
        parked == 3
    })
    .await;
    relay.stop().await;
    assert_eq!(done.load(Ordering::SeqCst), 1, "completed once");
    let runs = runs.lock().unwrap().clone();
    let report_runs: Vec<i32> = runs
        .iter()
        .filter(|(id, _)| *id == report.to_string())
        .map(|(_, a)| *a)
        .collect();
    assert_eq!(
        report_runs,
        vec![1, 2, 3],
        "three runs with their attempt numbers"
    );
    let reason = |id| {
        let pool = db.pool.clone();
        async move { status_of(&pool, id).await.unwrap().1.unwrap_or_default() }
    };
    assert!(reason(email).await.contains("mailbox does not exist"));
    assert!(reason(garbled).await.contains("payload is not a valid"));
    assert!(reason(unknown).await.contains("no task handler"));
    let (attempts,): (i32,) =
        sqlx::query_as("SELECT attempts FROM postal.outbox WHERE event_id = $1")
            .bind(email.as_uuid())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 1, "a permanent failure is not retried");
}

/// Guarantee: a task whose worker dies mid-run is not lost: it runs again on another relay once
/// its run lease has ended (not before), with the next run number, and the dead worker's
/// handler is stopped with it. While a handler runs — longer than the lease — the relay keeps
/// no transaction open: the row is checked out (run 1, running, held, its run lease renewed).
#[tokio::test]
async fn task_of_a_killed_worker_is_retried_after_the_lease() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks-kill");
    let lease = Duration::from_secs(3);
    let cfg = fast_config().lease(lease);
    // Worker A: its handler outlives the lease, then hangs.
    let started = Arc::new(tokio::sync::Notify::new());
    let a_alive = Arc::new(AtomicU64::new(0));
    let (s, alive) = (started.clone(), a_alive.clone());
    let slow = TaskTransport::new(TaskConfig::default()).on("report.requested", move |_t: Task| {
        let (s, alive) = (s.clone(), alive.clone());
        async move {
            struct Running(Arc<AtomicU64>);
            impl Drop for Running {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, Ordering::SeqCst);
                }
            }
            alive.fetch_add(1, Ordering::SeqCst);
            let _running = Running(alive.clone());
            s.notify_one();
            std::future::pending::<()>().await;
            Ok(())
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    let id = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "r1", "report.requested", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let a_pool = db.process_pool().await;
    let a = RunningRelay::start(&a_pool, slow, cfg.clone()).owning(a_pool);
    started.notified().await;
    tokio::time::sleep(lease).await;
    // A lease later: no transaction of the relay has been open while the task ran (a claim the
    // relay's other lanes make meanwhile lasts milliseconds: only a transaction open for more
    // than 2 s of the 3 s the task has run counts), and the row is checked out to run 1 with
    // its run lease renewed (it comes due more than half a lease from now).
    let open: Vec<(Option<String>, String)> = sqlx::query_as(
        "SELECT state, coalesce(query, '') FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
           AND xact_start < now() - interval '2 seconds'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        open.is_empty(),
        "no transaction stays open while a task runs: {open:?}"
    );
    let (runs, running, held, due_in): (i32, bool, bool, f64) = sqlx::query_as(
        "SELECT runs, running, held, extract(epoch FROM available_at - now())::float8
         FROM postal.outbox WHERE event_id = $1",
    )
    .bind(id.as_uuid())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (runs, running, held),
        (1, true, true),
        "checked out to run 1"
    );
    assert!(
        due_in > lease.as_secs_f64() / 2.0,
        "the run lease is renewed while the handler runs (due in {due_in} s)"
    );

    a.kill().await;
    // Counted from the moment A is gone (its pool closed), so a slow kill cannot make B's
    // wait look longer than it was.
    let killed_at = Instant::now();
    let ran = Arc::new(Mutex::new(None::<(Instant, i32)>));
    let r = ran.clone();
    let quick = TaskTransport::new(TaskConfig::default()).on("report.requested", move |t: Task| {
        let r = r.clone();
        async move {
            r.lock().unwrap().get_or_insert((Instant::now(), t.attempt));
            Ok(())
        }
    });
    let b = RunningRelay::start(&db.pool, quick, cfg);
    wait::until(Duration::from_secs(30), "task done by B", || async {
        status_of(&db.pool, id).await.is_none()
    })
    .await;
    b.stop().await;
    assert_eq!(
        a_alive.load(Ordering::SeqCst),
        0,
        "the killed worker's handler was stopped"
    );
    let (ran_at, attempt) = ran.lock().unwrap().expect("B ran the task");
    let waited = ran_at - killed_at;
    assert!(
        waited >= lease / 2,
        "B waited for A's run lease to end first (ran after {waited:?})"
    );
    assert_eq!(attempt, 2, "B's run knows it is the second");
}

/// Guarantee: with two relays (and a third joining midway, so partitions move), no task ever
/// runs on two relays at once, no two tasks of one key overlap, and every task completes.
#[tokio::test]
async fn two_relays_never_run_the_same_task_at_once() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks-excl");
    let running_ids = Arc::new(Mutex::new(HashSet::<String>::new()));
    let running_keys = Arc::new(Mutex::new(HashSet::<String>::new()));
    let violations = Arc::new(Mutex::new(Vec::<String>::new()));
    let completed = Arc::new(Mutex::new(BTreeMap::<String, u32>::new()));
    let make = |relay: &'static str| {
        let (ids, keys, v, c) = (
            running_ids.clone(),
            running_keys.clone(),
            violations.clone(),
            completed.clone(),
        );
        TaskTransport::new(TaskConfig::default().concurrency(8)).on("job", move |t: Task| {
            let (ids, keys, v, c) = (ids.clone(), keys.clone(), v.clone(), c.clone());
            async move {
                let id = t.id.to_string();
                if !ids.lock().unwrap().insert(id.clone()) {
                    v.lock()
                        .unwrap()
                        .push(format!("{relay}: task {id} already running"));
                }
                if !keys.lock().unwrap().insert(t.key.clone()) {
                    v.lock()
                        .unwrap()
                        .push(format!("{relay}: key {} already busy", t.key));
                }
                tokio::time::sleep(Duration::from_millis(
                    5 + (t.id.as_uuid().as_u128() % 15) as u64,
                ))
                .await;
                keys.lock().unwrap().remove(&t.key);
                ids.lock().unwrap().remove(&id);
                *c.lock().unwrap().entry(id).or_insert(0) += 1;
                Ok(())
            }
        })
    };
    let mut conn = db.pool.acquire().await.unwrap();
    let mut all = Vec::new();
    for chunk in (0..1500).collect::<Vec<_>>().chunks(500) {
        let events = chunk
            .iter()
            .map(|i| NewEvent::json(topic.as_str(), format!("k{}", i % 30), "job", i).unwrap())
            .collect();
        all.extend(enqueue_batch(&mut conn, events).await.unwrap());
    }
    let cfg = fast_config().batch_size(50);
    let a = RunningRelay::start(&db.pool, make("a"), cfg.clone());
    let b = RunningRelay::start(&db.pool, make("b"), cfg.clone());
    wait::until(
        Duration::from_secs(60),
        "a third of the tasks done",
        || async { outbox_count(&db.pool).await <= 1000 },
    )
    .await;
    let c = RunningRelay::start(&db.pool, make("c"), cfg);
    wait::until(Duration::from_secs(120), "all tasks done", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    for r in [a, b, c] {
        r.stop().await;
    }
    assert_eq!(violations.lock().unwrap().clone(), Vec::<String>::new());
    let completed = completed.lock().unwrap().clone();
    assert_eq!(completed.len(), all.len(), "every task completed");
    assert!(
        completed.values().all(|&n| n == 1),
        "none ran to completion twice"
    );
}

/// Guarantee: one outbox shared by topic between two relay groups — a Kafka relay for every
/// topic except the task topic, and two task relays (their own group) for the task topic only:
/// every broker event reaches Kafka, every task runs to completion once, nothing is parked or
/// left behind (with one shared group, each relay would own only part of the key partitions
/// and the rows of the other's topics there would never be claimed).
#[tokio::test]
async fn relay_groups_share_one_outbox_by_topic() {
    use postal_integration_tests::kafka;
    use postal_producer::TopicFilter;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let events = unique("groups-events");
    let reports = unique("groups-reports");
    let broker_ids = crate::relay::seed(&db.pool, &events, 500, 50).await;
    let task_ids = crate::relay::seed(&db.pool, &reports, 500, 50).await;
    let completed = Arc::new(Mutex::new(BTreeMap::<String, u32>::new()));
    let tasks = || {
        let c = completed.clone();
        TaskTransport::new(TaskConfig::default()).on("e", move |t: Task| {
            let c = c.clone();
            async move {
                *c.lock().unwrap().entry(t.id.to_string()).or_insert(0) += 1;
                Ok(())
            }
        })
    };
    let broker_relay = RunningRelay::start(
        &db.pool,
        crate::common::kafka_transport(&svc.bootstrap),
        fast_config().topics(TopicFilter::Except(vec![reports.clone()])),
    );
    let task_cfg = fast_config()
        .group("reports".into())
        .topics(TopicFilter::Only(vec![reports.clone()]));
    let t1 = RunningRelay::start(&db.pool, tasks(), task_cfg.clone());
    let t2 = RunningRelay::start(&db.pool, tasks(), task_cfg);
    wait::until(Duration::from_secs(60), "outbox drained", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    let parked = broker_relay.stop().await.parked + t1.stop().await.parked + t2.stop().await.parked;
    assert_eq!(parked, 0, "nothing parked");
    let completed = completed.lock().unwrap().clone();
    assert_eq!(
        completed
            .keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        task_ids,
        "every task ran (and no broker event was run as a task)"
    );
    assert!(
        completed.values().all(|&n| n == 1),
        "each task completed once"
    );
    let records = kafka::read_all(&svc.bootstrap, &events, 500, Duration::from_secs(30)).await;
    assert_eq!(
        kafka::event_ids(&records),
        broker_ids,
        "every broker event reached Kafka"
    );
}

/// The task worker fixture's binary (`src/bin/report_worker.rs`, built with this suite; next to
/// the test binary, or in `POSTAL_BIN_DIR`).
fn report_worker() -> std::path::PathBuf {
    let bin = crate::procs::bin_dir().join("report_worker");
    assert!(
        bin.is_file(),
        "{} missing: cargo build -p postal-integration-tests --bins",
        bin.display()
    );
    bin
}

/// Guarantee (real process, kill -9): a task-worker process killed while its handlers run
/// loses no task and stores no report twice: another worker process runs the killed tasks
/// once the dead one's lease has passed (not before), and every request gets exactly one report.
#[tokio::test]
async fn task_worker_process_killed_mid_run_loses_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let worker = |reports: &str, work_ms: &str, exit_when_done: &str| {
        std::process::Command::new(report_worker())
            .env("DATABASE_URL", &db.url)
            .env("REPORTS", reports)
            .env("REPORT_MS", work_ms)
            .env("POSTAL_LEASE", "3s")
            .env("EXIT_WHEN_DONE", exit_when_done)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn report_worker")
    };
    // 20 requests over 5 customers (keys), 1.5 s of work each: 4 s+ per key, run per key in order.
    let mut a = worker("20", "1500", "0");
    let reports = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM reports")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
    };
    wait::until(Duration::from_secs(60), "the first reports stored", || {
        let pool = db.pool.clone();
        async move { reports(pool).await > 0 }
    })
    .await;
    let done_before = reports(db.pool.clone()).await;
    assert!(
        done_before < 20,
        "killed mid-run ({done_before} of 20 done)"
    );
    a.kill().expect("kill -9");
    a.wait().unwrap();
    let killed_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let mut b = worker("0", "50", "1");
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(s) = b.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "worker B did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "worker B exited with {status}");
    let (requests, reports_n, distinct): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM report_requests), (SELECT count(*) FROM reports),
                (SELECT count(DISTINCT request_id) FROM reports)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (requests, reports_n, distinct),
        (20, 20, 20),
        "one report per request"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "no task pending or parked");
    let first_by_b: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT min(created_at) FROM reports WHERE created_at > $1")
            .bind(killed_at)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let waited = (first_by_b - killed_at).to_std().unwrap_or_default();
    assert!(
        waited >= Duration::from_millis(1500),
        "B ran the killed tasks only after A's lease (3 s, renewed every 0.75 s) ran out: {waited:?}"
    );
}

/// Guarantee: a long-running task holds back only its own key. While one handler is still
/// running, a task of another key enqueued afterwards runs and completes.
#[tokio::test]
async fn a_long_task_does_not_hold_back_other_keys() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks");
    let release = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(tokio::sync::Notify::new());
    let done = Arc::new(AtomicU64::new(0));
    let (rel, st, d) = (release.clone(), started.clone(), done.clone());
    let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |task: Task| {
        let (release, started, done) = (rel.clone(), st.clone(), d.clone());
        async move {
            if task.key == "slow" {
                started.notify_one();
                release.notified().await;
            }
            done.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    let slow = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "slow", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    let relay = RunningRelay::start(&db.pool, tasks, fast_config());
    tokio::time::timeout(Duration::from_secs(30), started.notified())
        .await
        .expect("the slow task starts");
    let fast = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "fast", "job", &2).unwrap(),
    )
    .await
    .unwrap();
    wait::until(
        Duration::from_secs(30),
        "the other key's task to complete while the slow one runs",
        || async { status_of(&db.pool, fast).await.is_none() },
    )
    .await;
    assert_eq!(done.load(Ordering::SeqCst), 1, "only the fast task is done");
    assert!(
        status_of(&db.pool, slow).await.is_some(),
        "the slow task is still claimed"
    );
    release.notify_one();
    wait::until(
        Duration::from_secs(30),
        "the slow task to complete",
        || async { status_of(&db.pool, slow).await.is_none() },
    )
    .await;
    relay.stop().await;
}

/// Guarantee: with batches in flight at once, a key's later task never runs before a retry of
/// its earlier one. A slow task of another key keeps the first batch (with the key's first
/// task, which fails once) from being recorded; the key's second task, claimed meanwhile in a
/// batch of its own, runs only after the first task's retry succeeded.
#[tokio::test]
async fn a_later_task_waits_for_the_retry_of_an_earlier_one_in_a_batch_still_in_flight() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks");
    let release = Arc::new(tokio::sync::Notify::new());
    let first_failed = Arc::new(tokio::sync::Notify::new());
    let runs = Arc::new(Mutex::new(Vec::<(String, i32)>::new()));
    let (rel, ff, r) = (release.clone(), first_failed.clone(), runs.clone());
    let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |task: Task| {
        let (release, first_failed, runs) = (rel.clone(), ff.clone(), r.clone());
        async move {
            let n: u32 = task.json()?;
            if task.key == "slow" {
                release.notified().await;
                return Ok(());
            }
            runs.lock().unwrap().push((format!("k{n}"), task.attempt));
            if n == 1 && task.attempt == 1 {
                first_failed.notify_one();
                return Err(TaskError::retryable("first try fails"));
            }
            Ok(())
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    // One transaction, so that the relay claims both in one batch.
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![
            NewEvent::json(topic.as_str(), "slow", "job", &0).unwrap(),
            NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // One lane: the two keys are claimed in one batch whatever their partitions.
    let relay = RunningRelay::start(&db.pool, tasks, fast_config().lanes(1));
    tokio::time::timeout(Duration::from_secs(30), first_failed.notified())
        .await
        .expect("the key's first task runs and fails");
    let second = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &2).unwrap(),
    )
    .await
    .unwrap();
    // The second task is claimed (its row locked by a claim) while the first batch waits for
    // the slow task.
    wait::until(
        Duration::from_secs(30),
        "the second task to be claimed",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM (SELECT 1 FROM postal.outbox WHERE event_id = $1
                                   FOR UPDATE SKIP LOCKED) AS free",
            )
            .bind(second.as_uuid())
            .fetch_one(&db.pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
    release.notify_one();
    wait::until(Duration::from_secs(30), "every task done", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    assert_eq!(
        runs.lock().unwrap().clone(),
        vec![("k1".into(), 1), ("k1".into(), 2), ("k2".into(), 1)],
        "the key's tasks in outbox order, the retry before the later task"
    );
}

/// Guarantee: a relay that is alive but can no longer renew the run lease of a running task
/// stops that task before the lease ends, and another relay runs the key's tasks, in order,
/// only after it has ended, the first with run number 2. Relay A's writes to the outbox and
/// its heartbeats start failing (triggers reject them) while its handler for the key's first
/// task runs.
#[tokio::test]
async fn a_relay_that_cannot_renew_a_run_lease_stops_its_task_before_another_runs_it() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks-fence");
    let cfg_lease = Duration::from_secs(3);
    let cfg = fast_config().lease(cfg_lease);
    // Handler runs in the order they happened: (relay, task number, what).
    type Log = Arc<Mutex<Vec<(&'static str, u32, &'static str)>>>;
    // The first time something happened, by the wall clock (comparable with the database's:
    // same host).
    type When = Arc<Mutex<Option<chrono::DateTime<chrono::Utc>>>>;
    let log: Log = Arc::default();
    let stopped_at: When = Arc::default();
    let started = Arc::new(tokio::sync::Notify::new());
    let (l, s, st) = (log.clone(), started.clone(), stopped_at.clone());
    let on_a = TaskTransport::new(TaskConfig::default()).on("job", move |task: Task| {
        let (log, started, stopped_at) = (l.clone(), s.clone(), st.clone());
        async move {
            struct Running {
                log: Log,
                task: u32,
                stopped_at: When,
            }
            impl Drop for Running {
                fn drop(&mut self) {
                    self.stopped_at
                        .lock()
                        .unwrap()
                        .get_or_insert_with(chrono::Utc::now);
                    self.log.lock().unwrap().push(("A", self.task, "stopped"));
                }
            }
            let n: u32 = task.json()?;
            log.lock().unwrap().push(("A", n, "start"));
            let _running = Running {
                log: log.clone(),
                task: n,
                stopped_at: stopped_at.clone(),
            };
            started.notify_one();
            std::future::pending::<()>().await;
            Ok(())
        }
    });
    // B's first start: when, and its run number.
    type First = Arc<Mutex<Option<(chrono::DateTime<chrono::Utc>, i32)>>>;
    let b_first: First = Arc::default();
    let (l, bs) = (log.clone(), b_first.clone());
    let on_b = TaskTransport::new(TaskConfig::default()).on("job", move |task: Task| {
        let (log, b_first) = (l.clone(), bs.clone());
        async move {
            let n: u32 = task.json()?;
            b_first
                .lock()
                .unwrap()
                .get_or_insert_with(|| (chrono::Utc::now(), task.attempt));
            log.lock().unwrap().push(("B", n, "start"));
            tokio::task::yield_now().await;
            log.lock().unwrap().push(("B", n, "end"));
            Ok(())
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    let first = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    let second = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &2).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let a_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(
            db.url
                .parse::<sqlx::postgres::PgConnectOptions>()
                .unwrap()
                .application_name("relay-a"),
        )
        .await
        .unwrap();
    let a = RunningRelay::start(&a_pool, on_a, cfg.clone()).owning(a_pool);
    tokio::time::timeout(Duration::from_secs(30), started.notified())
        .await
        .expect("A starts the first task");
    // From now on every write of A to the outbox fails (its run lease renewals among them),
    // and so do its heartbeats: its partitions pass to B once their leases end.
    sqlx::raw_sql(
        "CREATE FUNCTION public.reject_relay_a() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF current_setting('application_name') = 'relay-a' THEN
             RAISE EXCEPTION 'outbox write rejected by the test';
           END IF;
           RETURN coalesce(NEW, OLD);
         END $$;
         CREATE TRIGGER reject_relay_a BEFORE UPDATE OR DELETE ON postal.outbox
           FOR EACH ROW EXECUTE FUNCTION public.reject_relay_a();
         CREATE TRIGGER reject_relay_a BEFORE INSERT OR UPDATE ON postal.relay_instances
           FOR EACH ROW EXECUTE FUNCTION public.reject_relay_a();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Creating the trigger waited for any renewal in progress: the first task's run lease
    // ends here for good (the database's clock; the test runs on the same host).
    let lease_end: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT available_at FROM postal.outbox WHERE event_id = $1")
            .bind(first.as_uuid())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let b = RunningRelay::start(&db.pool, on_b, cfg);
    wait::until(Duration::from_secs(30), "B to run both tasks", || async {
        status_of(&db.pool, first).await.is_none() && status_of(&db.pool, second).await.is_none()
    })
    .await;
    b.stop().await;
    a.kill().await;
    let log = log.lock().unwrap().clone();
    let at = |entry: (&'static str, u32, &'static str)| {
        log.iter()
            .position(|e| *e == entry)
            .unwrap_or_else(|| panic!("{entry:?} missing from {log:?}"))
    };
    let stopped = stopped_at.lock().unwrap().expect("A's handler was stopped");
    let (b_started, b_attempt) = b_first.lock().unwrap().expect("B ran a task");
    assert!(
        stopped + cfg_lease / 8 < lease_end,
        "A stopped its handler at {stopped}, well before its run lease ran out at {lease_end}"
    );
    assert!(
        b_started >= lease_end,
        "B started the key's tasks at {b_started}, after A's run lease ran out at {lease_end}"
    );
    assert_eq!(b_attempt, 2, "B's run of the first task is its second");
    assert!(
        at(("A", 1, "stopped")) < at(("B", 1, "start")),
        "A's run of the first task was stopped before B started it: {log:?}"
    );
    assert!(
        at(("B", 1, "end")) < at(("B", 2, "start")),
        "B ran the key's tasks in order: {log:?}"
    );
    assert!(
        !log.contains(&("A", 2, "start")),
        "A never started the second task: {log:?}"
    );
}

/// Guarantee: a key's next task starts only after the outcome of the one before is recorded,
/// even when both came in one claim with a long task of another key. Killed while that long
/// task runs, the relay leaves nothing to run twice: on the next relay, the key's run log reads
/// 1, 2 (each once), and the long task runs again with run number 2. (Before check-out, the
/// second task started as soon as the first succeeded, its batch unrecorded behind the long
/// task, and the log read 1, 2, 1 with run number 1 both times.)
#[tokio::test]
async fn a_keys_next_task_waits_for_the_record_of_the_one_before() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks-record");
    let cfg = fast_config().lease(Duration::from_secs(3));
    // (relay, key, task number, run number, whether task n's row was still in the outbox).
    type Log = Arc<Mutex<Vec<(&'static str, String, u32, i32, bool)>>>;
    let log: Log = Arc::default();
    let long_started = Arc::new(tokio::sync::Notify::new());
    let handler =
        |relay: &'static str, log: Log, pool: PgPool, long: Option<Arc<tokio::sync::Notify>>| {
            TaskTransport::new(TaskConfig::default()).on("job", move |task: Task| {
                let (log, pool, long) = (log.clone(), pool.clone(), long.clone());
                async move {
                    let n: u32 = task.json()?;
                    let earlier_pending: bool = sqlx::query_scalar(
                        "SELECT EXISTS (SELECT 1 FROM postal.outbox
                                    WHERE event_key = $1 AND payload = $2::text::bytea)",
                    )
                    .bind(&task.key)
                    .bind((n.saturating_sub(1)).to_string())
                    .fetch_one(&pool)
                    .await
                    .map_err(TaskError::retryable)?;
                    log.lock().unwrap().push((
                        relay,
                        task.key.clone(),
                        n,
                        task.attempt,
                        n > 1 && earlier_pending,
                    ));
                    if task.key == "long" {
                        if let Some(long) = long {
                            long.notify_one();
                            std::future::pending::<()>().await;
                        }
                    }
                    Ok(())
                }
            })
        };
    let mut conn = db.pool.acquire().await.unwrap();
    let mut events = vec![NewEvent::json(topic.as_str(), "long", "job", &1).unwrap()];
    for n in 1..=2u32 {
        events.push(NewEvent::json(topic.as_str(), "k", "job", &n).unwrap());
    }
    enqueue_batch(&mut conn, events).await.unwrap();
    drop(conn);
    let a_pool = db.process_pool().await;
    let a = RunningRelay::start(
        &a_pool,
        handler(
            "A",
            log.clone(),
            db.pool.clone(),
            Some(long_started.clone()),
        ),
        cfg.clone(),
    )
    .owning(a_pool);
    tokio::time::timeout(Duration::from_secs(30), long_started.notified())
        .await
        .expect("A starts the long task");
    wait::until(
        Duration::from_secs(30),
        "A to run the key's two tasks",
        || async { log.lock().unwrap().iter().filter(|e| e.1 == "k").count() == 2 },
    )
    .await;
    a.kill().await;
    let b = RunningRelay::start(
        &db.pool,
        handler("B", log.clone(), db.pool.clone(), None),
        cfg,
    );
    wait::until(Duration::from_secs(30), "the outbox to drain", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    b.stop().await;
    let log = log.lock().unwrap().clone();
    let k: Vec<(u32, i32)> = log
        .iter()
        .filter(|e| e.1 == "k")
        .map(|e| (e.2, e.3))
        .collect();
    assert_eq!(
        k,
        vec![(1, 1), (2, 1)],
        "the key's tasks ran once each, in order: {log:?}"
    );
    assert!(
        log.iter().all(|e| !e.4),
        "no task started while its predecessor's row was still in the outbox: {log:?}"
    );
    let long: Vec<(&str, i32)> = log
        .iter()
        .filter(|e| e.1 == "long")
        .map(|e| (e.0, e.3))
        .collect();
    assert_eq!(
        long,
        vec![("A", 1), ("B", 2)],
        "the long task ran again as run 2: {log:?}"
    );
}

/// Guarantee: the outcome of a stale run is never recorded. A relay runs a task; its run lease
/// is ended from outside (as when the relay was frozen past it), so the task is checked out
/// again and runs as run 2, which lets run 1 finish and then fails permanently. Run 1's
/// success, arriving while run 2 holds the row, is refused: the row ends parked by run 2
/// (attempts 2), and the relay counts nothing published.
#[tokio::test]
async fn the_outcome_of_a_stale_run_is_refused() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks-stale");
    // Long enough that run 1's renewal (every quarter of the lease) does not notice run 2
    // before run 1 finishes: its outcome must meet the fence of the record itself.
    let cfg = fast_config().lease(Duration::from_secs(8));
    let run1_started = Arc::new(tokio::sync::Notify::new());
    let run1_release = Arc::new(tokio::sync::Notify::new());
    let run1_done = Arc::new(tokio::sync::Notify::new());
    let runs = Arc::new(Mutex::new(Vec::new()));
    let (st, rel, done, r) = (
        run1_started.clone(),
        run1_release.clone(),
        run1_done.clone(),
        runs.clone(),
    );
    let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
        let (st, rel, done, r) = (st.clone(), rel.clone(), done.clone(), r.clone());
        async move {
            r.lock().unwrap().push(t.attempt);
            if t.attempt == 1 {
                st.notify_one();
                rel.notified().await;
                done.notify_one();
                Ok(())
            } else {
                rel.notify_one();
                done.notified().await;
                // Run 1's outcome is on its way to the database: give it the lead (an
                // ordering aid only; the assertions hold in either order if the fence works).
                tokio::time::sleep(Duration::from_millis(500)).await;
                Err(TaskError::permanent("run 2 parks it"))
            }
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    let id = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let relay = RunningRelay::start(&db.pool, tasks, cfg);
    tokio::time::timeout(Duration::from_secs(30), run1_started.notified())
        .await
        .expect("run 1 starts");
    sqlx::query("UPDATE postal.outbox SET available_at = now() WHERE event_id = $1")
        .bind(id.as_uuid())
        .execute(&db.pool)
        .await
        .unwrap();
    wait::until(
        Duration::from_secs(30),
        "run 2 to park the task",
        || async {
            status_of(&db.pool, id)
                .await
                .is_some_and(|(s, _)| s == "failed")
        },
    )
    .await;
    let stats = relay.stop().await;
    let (status, attempts): (String, i32) =
        sqlx::query_as("SELECT status, attempts FROM postal.outbox WHERE event_id = $1")
            .bind(id.as_uuid())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), attempts),
        ("failed", 2),
        "parked by run 2, untouched by run 1"
    );
    assert_eq!(*runs.lock().unwrap(), vec![1, 2]);
    assert_eq!(stats.published, 0, "run 1's success was not recorded");
}

/// Guarantee: a graceful stop lets a running task finish (within the shutdown timeout) and
/// records its outcome before the relay returns: the task ran once and its row is gone.
#[tokio::test]
async fn a_graceful_stop_waits_for_a_running_task_and_records_it() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("tasks-stop");
    let started = Arc::new(tokio::sync::Notify::new());
    let runs = Arc::new(AtomicU64::new(0));
    let (st, r) = (started.clone(), runs.clone());
    let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |_t: Task| {
        let (st, r) = (st.clone(), r.clone());
        async move {
            st.notify_one();
            tokio::time::sleep(Duration::from_millis(1500)).await;
            r.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    });
    let mut conn = db.pool.acquire().await.unwrap();
    let id = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let relay = RunningRelay::start(&db.pool, tasks, fast_config());
    tokio::time::timeout(Duration::from_secs(30), started.notified())
        .await
        .expect("the task starts");
    let stats = relay.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran to its end");
    assert_eq!(stats.published, 1, "its outcome was recorded");
    assert!(status_of(&db.pool, id).await.is_none(), "its row is gone");
}
