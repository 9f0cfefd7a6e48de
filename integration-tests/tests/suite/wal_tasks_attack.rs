//! Attack: a WAL relay given the in-process task runner (`TaskTransport`).
//!
//! The task runner's promises (docs/relay.md, "In-process task handlers"): one run at a time per
//! key, in outbox order, and a task never starts again after a later task of its key started;
//! `task.attempt` strictly increases across a task's runs (a fencing token). A polling relay
//! keeps them by checking the rows out (`Transport::checks_out`). The WAL relay's stream does
//! not check out: it hands the rows to `Transport::send` inside the transaction that took them
//! (`wal/rows.rs` `take`/`lock`), which PostgreSQL ends once it has been idle for half the
//! slot's lease (`idle_in_transaction_session_timeout`). Nothing refuses the combination
//! (`RelayConfig::validate`, `wal::run`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postal_integration_tests::services;
use postal_producer::{enqueue, NewEvent, Task, TaskConfig, TaskError, TaskTransport};

use crate::common::RunningRelay;
use crate::wal_relay::{outbox_pending, Slot};

/// Guarantee (docs/relay.md, tasks): with a WAL relay as with a polling one, a key's tasks
/// complete, each task's runs carry strictly increasing `task.attempt`, and no task starts
/// again after a later task of its key started — here two tasks of one key, enqueued in one
/// transaction, whose handlers take a second each (together longer than half the lease).
#[tokio::test]
#[ignore = "reproduces: the WAL relay's stream runs tasks inside its take/lock transaction without checking them out; PostgreSQL ends the idle transaction after lease/2, the mark fails, and the stream runs the batch again: runs [(1, 1), (2, 1), (1, 1), (2, 1)] (task, attempt)"]
async fn a_wal_relay_running_tasks_runs_each_once_in_key_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    // (task number, attempt, when it started)
    let runs: Arc<Mutex<Vec<(u32, i32, Instant)>>> = Arc::default();
    let tasks = TaskTransport::new(TaskConfig::default()).on("slow.requested", {
        let runs = runs.clone();
        move |task: Task| {
            let runs = runs.clone();
            async move {
                let n: u32 = task.json()?;
                runs.lock().unwrap().push((n, task.attempt, Instant::now()));
                tokio::time::sleep(Duration::from_millis(1000)).await;
                Ok::<_, TaskError>(())
            }
        }
    });
    // Lease 3 s (fast_config): the stream's transaction may stay idle for 1.5 s.
    let relay = RunningRelay::start(&db.pool, tasks, slot.config());
    // Give the relay its slot lease and stream first (the rows then come from the stream).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut tx = db.pool.begin().await.unwrap();
    for n in 1..=2u32 {
        enqueue(
            &mut tx,
            NewEvent::json("wal-tasks", "k", "slow.requested", &n).unwrap(),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(25);
    while outbox_pending(&db.pool).await > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pending = outbox_pending(&db.pool).await;
    relay.stop().await;
    let runs = runs.lock().unwrap().clone();
    let shown: Vec<(u32, i32)> = runs.iter().map(|(n, a, _)| (*n, *a)).collect();
    eprintln!("task runs (task, attempt) in start order: {shown:?}; pending after 25 s: {pending}");
    // No task starts again after a later task of its key started.
    let mut latest = 0u32;
    for (n, _, _) in &runs {
        assert!(
            *n >= latest,
            "task {n} started again after task {latest} of its key had started: {shown:?}"
        );
        latest = latest.max(*n);
    }
    // Each task's attempts strictly increase.
    for task in 1..=2u32 {
        let attempts: Vec<i32> = runs
            .iter()
            .filter(|(n, _, _)| *n == task)
            .map(|(_, a, _)| *a)
            .collect();
        assert!(
            attempts.windows(2).all(|w| w[0] < w[1]),
            "task {task} ran with attempts {attempts:?} (not strictly increasing): {shown:?}"
        );
    }
    assert_eq!(pending, 0, "tasks still pending after 25 s: {shown:?}");
}

/// Guarantee (docs/relay.md, tasks): a task whose handler takes longer than half the lease (a
/// handler may run for minutes: that is why tasks are checked out) runs once when it succeeds,
/// never twice at the same time, and completes.
#[tokio::test]
#[ignore = "reproduces: the WAL relay's stream runs a task inside its take/lock transaction, not checked out; a handler longer than half the slot's lease has that transaction ended by PostgreSQL (idle_in_transaction_session_timeout), the row is free while the handler still runs, and the sweep checks it out and runs it again: runs: 2 (attempts [1, 1]), overlapping starts: 1"]
async fn a_wal_relay_runs_a_long_task_once() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    // (attempt, started, ended)
    let runs: Arc<Mutex<Vec<(i32, Instant, Option<Instant>)>>> = Arc::default();
    let tasks = TaskTransport::new(TaskConfig::default()).on("long.requested", {
        let runs = runs.clone();
        move |task: Task| {
            let runs = runs.clone();
            async move {
                let i = {
                    let mut r = runs.lock().unwrap();
                    r.push((task.attempt, Instant::now(), None));
                    r.len() - 1
                };
                tokio::time::sleep(Duration::from_millis(2000)).await;
                runs.lock().unwrap()[i].2 = Some(Instant::now());
                Ok::<_, TaskError>(())
            }
        }
    });
    // Lease 3 s (fast_config): the stream's transaction may stay idle for 1.5 s.
    let relay = RunningRelay::start(&db.pool, tasks, slot.config());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue(
        &mut conn,
        NewEvent::json("wal-tasks", "k", "long.requested", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let deadline = Instant::now() + Duration::from_secs(20);
    while outbox_pending(&db.pool).await > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pending = outbox_pending(&db.pool).await;
    relay.stop().await;
    let runs = runs.lock().unwrap().clone();
    let attempts: Vec<i32> = runs.iter().map(|r| r.0).collect();
    let overlapping = runs
        .windows(2)
        .filter(|w| w[0].2.is_none_or(|end| end > w[1].1))
        .count();
    eprintln!(
        "runs: {} (attempts {attempts:?}), overlapping starts: {overlapping}, pending after 20 s: {pending}",
        runs.len()
    );
    assert_eq!(
        overlapping, 0,
        "runs of the task overlapped: attempts {attempts:?}"
    );
    assert_eq!(
        pending, 0,
        "the task is still pending after 20 s: attempts {attempts:?}"
    );
    assert_eq!(
        runs.len(),
        1,
        "the task ran more than once: attempts {attempts:?}"
    );
}
