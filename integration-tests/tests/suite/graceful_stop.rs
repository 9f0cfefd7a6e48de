//! The fourth review's reproductions: a graceful stop that aborted a lane (stuck in a claim)
//! dropped its running tasks without giving them back, and a RabbitMQ refusal counted as an
//! outage (pausing the relay) once the channel was closing, republishing stored messages under
//! steady traffic; the fifth review's: a stopped `spawn_blocking` handler overlapping the next
//! run, and clones of one task runner sharing a stop; the sixth review's: a busy drive taking
//! a stopped task for an ordinary one; plus the stop's documented limit (a handler blocking
//! past the stop grace).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postal_integration_tests::rabbit::{self, PrivateRabbit};
use postal_integration_tests::{fresh_postgres_db, services, unique, wait};
use postal_producer::{
    enqueue_batch, NewEvent, RabbitConfig, RabbitTransport, Task, TaskConfig, TaskError,
    TaskTransport, Transport,
};

use crate::common::{fast_config, RunningRelay};

#[derive(Default)]
struct Seen {
    active: usize,
    overlaps: Vec<(i32, &'static str)>,
    runs: Vec<(i32, &'static str, f64)>,
}

fn blocking(
    seen: Arc<Mutex<Seen>>,
    who: &'static str,
    block: Duration,
    t0: std::time::Instant,
) -> TaskTransport {
    TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
        let seen = seen.clone();
        async move {
            {
                let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                s.active += 1;
                if s.active > 1 {
                    s.overlaps.push((t.attempt, who));
                }
                s.runs.push((t.attempt, who, t0.elapsed().as_secs_f64()));
            }
            struct Out(Arc<Mutex<Seen>>);
            impl Drop for Out {
                fn drop(&mut self) {
                    if let Ok(mut s) = self.0.lock() {
                        s.active -= 1;
                    }
                }
            }
            let _out = Out(seen.clone());
            if who == "B" {
                return Ok::<_, TaskError>(());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            // synchronous stretch longer than the run lease
            tokio::task::block_in_place(|| std::thread::sleep(block));
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, TaskError>(())
        }
    })
}

/// Known limit, documented (docs/relay.md, "In-process task handlers"): a graceful stop waits for
/// aborted handlers to end for `STOP_GRACE` (4 s) only; a handler in blocking code for 10 s
/// is left like a crashed one, and in a process that lives on, the task's next run (after its
/// run lease) overlaps it. (In a relay process that exits after its stop, the handler ends
/// with it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
#[ignore = "known and documented: a handler blocking past the stop grace in a process that lives on"]
async fn a_handler_blocking_past_the_stop_grace_can_overlap_its_next_run() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev4-block");
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![NewEvent::json(topic.as_str(), "k", "job", &1).unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let cfg = fast_config()
        .lease(Duration::from_secs(3))
        .shutdown_timeout(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let a = RunningRelay::start(
        &db.pool,
        blocking(seen.clone(), "A", Duration::from_secs(10), t0),
        cfg.clone(),
    );
    while seen.lock().unwrap().runs.is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(700)).await; // A is inside std::thread::sleep
    a.stop().await;
    eprintln!("A stopped at {:?}", t0.elapsed());
    let b = RunningRelay::start(
        &db.pool,
        blocking(seen.clone(), "B", Duration::ZERO, t0),
        cfg.clone(),
    );
    wait::until(Duration::from_secs(30), "B ran the task", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox WHERE status='pending'")
            .fetch_one(&db.pool)
            .await
            .unwrap()
            == 0
    })
    .await;
    b.stop().await;
    let s = seen.lock().unwrap();
    eprintln!("runs {:?} overlaps {:?}", s.runs, s.overlaps);
    assert!(
        s.overlaps.is_empty(),
        "two runs at once: {:?} runs {:?}",
        s.overlaps,
        s.runs
    );
}

async fn refusal_batch(good_first: usize, good_after: usize) {
    let db = services().await.fresh_db().await;
    let mq = PrivateRabbit::start().await;
    let good = unique("rmq4-allowed");
    let bad = unique("rmq4-refused");
    let bad2 = unique("rmq4-refused2");
    mq.ctl(&["add_user", "relay", "pw"]);
    let write = format!("^{good}$");
    mq.ctl(&["set_permissions", "-p", "/", "relay", ".*", &write, ".*"]);
    let gq = rabbit::bind_queue(&mq.url(), &good, "#").await;
    let _bq = rabbit::bind_queue(&mq.url(), &bad, "#").await;
    let _bq2 = rabbit::bind_queue(&mq.url(), &bad2, "#").await;
    let url = mq.url().replace("guest:guest", "relay:pw");
    let mut cfg = RabbitConfig::new(url);
    cfg.confirm_timeout = Duration::from_secs(2);
    let mut events = Vec::new();
    for i in 0..good_first {
        events.push(NewEvent::json(good.as_str(), format!("a{i}"), "e", &i).unwrap());
    }
    events.push(NewEvent::json(bad.as_str(), "kb", "e", &0).unwrap());
    for i in 0..good_after {
        events.push(NewEvent::json(good.as_str(), format!("g{i}"), "e", &i).unwrap());
        if i == good_after / 2 {
            events.push(NewEvent::json(bad2.as_str(), "kb2", "e", &0).unwrap());
        }
    }
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    let mut claimed = crate::common::claim_as_doomed_relay(&db.pool).await;
    let batch = claimed.take_events();
    let t = RabbitTransport::new(cfg).unwrap();
    let acks = t.send(&batch).await.await;
    let mut hist: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut acked_good = 0;
    for (e, a) in batch.iter().zip(&acks) {
        let kind = match a {
            Ok(()) => "Ok".to_string(),
            Err(err) => format!("{:?}", err.kind),
        };
        if a.is_ok() && e.topic == good {
            acked_good += 1;
        }
        let ex = if e.topic == good {
            "good"
        } else if e.topic == bad {
            "bad"
        } else {
            "bad2"
        };
        *hist.entry((ex.to_string(), kind)).or_default() += 1;
    }
    for (e, a) in batch.iter().zip(&acks) {
        if e.topic != good {
            eprintln!("{} -> {:?}", e.topic, a);
        }
    }
    if let Some((_, Err(e))) = batch
        .iter()
        .zip(&acks)
        .find(|(_, a)| matches!(a, Err(e) if e.kind == postal_producer::FailureKind::Unavailable))
    {
        eprintln!("an Unavailable: {}", e.reason);
    }
    drop(claimed);
    let msgs = rabbit::read_all(&mq.url(), &gq, 0, Duration::from_secs(3)).await;
    eprintln!(
        "outcomes {hist:?}; good acked {acked_good}, good in queue {}",
        msgs.len()
    );
    assert!(
        !hist.keys().any(|(_, k)| k == "Unavailable"),
        "a refusal counted as an outage (pauses the relay): {hist:?}"
    );
}

/// Guarantee: a relay that keeps running renews the run lease of a handler in blocking code,
/// so another relay joining meanwhile never starts a second run beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn a_relay_joining_beside_a_blocking_handler_never_runs_its_task_again() {
    let db = fresh_postgres_db().await;
    let topic = unique("rev4-ctl");
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![NewEvent::json(topic.as_str(), "k", "job", &1).unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let cfg = fast_config()
        .lease(Duration::from_secs(3))
        .shutdown_timeout(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let a = RunningRelay::start(
        &db.pool,
        blocking(seen.clone(), "A", Duration::from_secs(10), t0),
        cfg.clone(),
    );
    while seen.lock().unwrap().runs.is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = RunningRelay::start(
        &db.pool,
        blocking(seen.clone(), "B", Duration::ZERO, t0),
        cfg.clone(),
    );
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (runs, overlaps) = {
        let s = seen.lock().unwrap();
        (s.runs.clone(), s.overlaps.clone())
    };
    eprintln!("control runs {runs:?} overlaps {overlaps:?}");
    assert!(overlaps.is_empty());
    b.stop().await;
    a.kill().await;
}

/// Guarantee: a publish refusal seen while the channel is closing is no outage: with the
/// refused event first and 400 permitted events (distinct keys) after it in one batch, no
/// outcome is "unavailable" (which would pause the relay). (Before: 399 were, from lapin's
/// "invalid channel state: Closing".)
#[tokio::test]
async fn a_refusal_then_many_keys_is_no_outage() {
    refusal_batch(0, 400).await;
}

/// Guarantee: the same with 200 permitted events before the refused one (their confirms are
/// cut by the channel's close: released for the next claim, no outage).
#[tokio::test]
async fn permitted_events_before_a_refusal_are_no_outage() {
    refusal_batch(200, 10).await;
}

/// Guarantee: steady traffic on a permitted exchange beside new events for a refused one
/// (40 + 1 every 250 ms for 15 s): every permitted event arrives, and the refusal is not paid
/// again and again — after the first, the refused exchange's events wait without being
/// published — so duplicates stay within the first batch's size. (Before: 979 duplicates of
/// 2,400 events and 39 relay pauses.)
#[tokio::test]
async fn steady_traffic_beside_a_refused_exchange_duplicates_little() {
    let db = services().await.fresh_db().await;
    let mq = PrivateRabbit::start().await;
    let good = unique("rmq4s-allowed");
    let bad = unique("rmq4s-refused");
    mq.ctl(&["add_user", "relay", "pw"]);
    let write = format!("^{good}$");
    mq.ctl(&["set_permissions", "-p", "/", "relay", ".*", &write, ".*"]);
    let gq = rabbit::bind_queue(&mq.url(), &good, "#").await;
    let _bq = rabbit::bind_queue(&mq.url(), &bad, "#").await;
    let url = mq.url().replace("guest:guest", "relay:pw");
    let mut cfg = RabbitConfig::new(url);
    cfg.confirm_timeout = Duration::from_secs(1);
    let relay = RunningRelay::start(&db.pool, RabbitTransport::new(cfg).unwrap(), fast_config());
    let t0 = std::time::Instant::now();
    let mut n_good = 0usize;
    for round in 0..60 {
        let mut events = Vec::new();
        for i in 0..30 {
            events.push(NewEvent::json(good.as_str(), format!("g{round}-{i}"), "e", &i).unwrap());
        }
        n_good += 30;
        events.push(NewEvent::json(bad.as_str(), format!("b{round}"), "e", &0).unwrap());
        for i in 30..40 {
            events.push(NewEvent::json(good.as_str(), format!("g{round}-{i}"), "e", &i).unwrap());
        }
        n_good += 10;
        let mut tx = db.pool.begin().await.unwrap();
        enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let enq = t0.elapsed();
    wait::until(Duration::from_secs(60), "good drained", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox WHERE topic = $1")
            .bind(&good)
            .fetch_one(&db.pool)
            .await
            .unwrap()
            == 0
    })
    .await;
    let drained = t0.elapsed();
    let stats = relay.stop().await;
    let msgs = rabbit::read_all(&mq.url(), &gq, n_good, Duration::from_secs(10)).await;
    let mut ids = std::collections::HashSet::new();
    for m in &msgs {
        ids.insert(m.message_id.clone());
    }
    eprintln!(
        "good events {n_good}; in queue {} ({} distinct, {} duplicates); enqueued over {enq:?}, drained at {drained:?}; stats {stats:?}",
        msgs.len(),
        ids.len(),
        msgs.len() - ids.len()
    );
    assert_eq!(ids.len(), n_good, "every permitted event arrived");
    assert!(
        msgs.len() - ids.len() <= 100,
        "{} duplicates: the refusal was paid again and again",
        msgs.len() - ids.len()
    );
}

/// Guarantee: a graceful stop whose lane is aborted (its check-out waits on a lock past twice
/// `shutdown_timeout`) still gives its running task back without counting an attempt: the
/// next relay (`max_attempts` 1) runs it. (Before: the lane took the task's drive with it, the
/// row stayed `running`, and the next relay parked it unrun.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_graceful_stop_that_aborts_a_lane_gives_its_tasks_back() {
    use sqlx::Connection;
    let db = fresh_postgres_db().await;
    let topic = unique("rev4-lane");
    let mut conn = db.pool.acquire().await.unwrap();
    postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k1", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let started = Arc::new(tokio::sync::Notify::new());
    let st = started.clone();
    let cfg = fast_config()
        .lease(Duration::from_secs(12))
        .shutdown_timeout(Duration::from_secs(1))
        .lanes(1)
        .max_attempts(1);
    let a = RunningRelay::start(
        &db.pool,
        TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
            let st = st.clone();
            async move {
                if t.key == "k1" {
                    st.notify_one();
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
                Ok::<_, TaskError>(())
            }
        }),
        cfg.clone(),
    );
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .unwrap();
    // k2 comes due in 1.5 s.
    let mut tx = db.pool.begin().await.unwrap();
    postal_producer::enqueue(
        &mut tx,
        NewEvent::json(topic.as_str(), "k2", "job", &2).unwrap(),
    )
    .await
    .unwrap();
    sqlx::query(
        "UPDATE postal.outbox SET available_at = now() + interval '1.5 s', held = true WHERE event_key = 'k2'",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let mut locker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut ltx = locker.begin().await.unwrap();
    sqlx::query("LOCK TABLE postal.outbox IN SHARE MODE")
        .execute(&mut *ltx)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2500 / 1000 + 1)).await; // lane now blocked in check-out
    let stopping = tokio::spawn(a.stop());
    tokio::time::sleep(Duration::from_millis(2300)).await; // past 2 x shutdown_timeout
    ltx.commit().await.unwrap();
    let stats = stopping.await.unwrap();
    let rows: Vec<(String, String, i32, i32, bool, Option<String>)> = sqlx::query_as(
        "SELECT event_key, status, attempts, runs, running, last_error FROM postal.outbox ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!("after graceful stop: {rows:?} stats {stats:?}");
    // Next relay, max_attempts 1.
    sqlx::query("UPDATE postal.outbox SET available_at = now()")
        .execute(&db.pool)
        .await
        .unwrap();
    let b = RunningRelay::start(
        &db.pool,
        TaskTransport::new(TaskConfig::default())
            .on("job", |_t: Task| async { Ok::<_, TaskError>(()) }),
        cfg.clone(),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    b.stop().await;
    let rows: Vec<(String, String, i32, i32, bool, Option<String>)> = sqlx::query_as(
        "SELECT event_key, status, attempts, runs, running, last_error FROM postal.outbox ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!("after next relay: {rows:?}");
    assert!(
        !rows.iter().any(|r| r.1 == "failed"),
        "parked after a graceful stop: {rows:?}"
    );
}

async fn one_job(pool: &sqlx::PgPool, topic: &str, key: &str) {
    let mut tx = pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![NewEvent::json(topic, key, "job", &1).unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

async fn pending(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox WHERE status='pending'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Fifth review, finding 1. Guarantee: a handler doing its synchronous work the usual way
/// (`spawn_blocking`, 3 s, within its 6 s run lease) and aborted by a graceful stop is given
/// back due only at the end of its run lease: the next relay never runs the task while the
/// first run's blocking work still runs. (Before: aborting ended the handler's future at once, the task came back due at once,
/// and the next relay ran it beside the blocking work.)
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn a_stopped_spawn_blocking_handler_never_overlaps_the_next_run() {
    let db = fresh_postgres_db().await;
    let topic = unique("r5-sb");
    one_job(&db.pool, &topic, "k").await;
    let active = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let t0 = std::time::Instant::now();
    let mk = |who: &'static str| {
        let active = active.clone();
        let overlaps = overlaps.clone();
        let log = log.clone();
        TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
            let active = active.clone();
            let overlaps = overlaps.clone();
            let log = log.clone();
            async move {
                log.lock().unwrap().push(format!(
                    "{who} start attempt {} at {:.2}",
                    t.attempt,
                    t0.elapsed().as_secs_f64()
                ));
                let r = tokio::task::spawn_blocking(move || {
                    if active.fetch_add(1, Ordering::SeqCst) > 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    log.lock().unwrap().push(format!(
                        "{who} blocking work begins at {:.2}",
                        t0.elapsed().as_secs_f64()
                    ));
                    std::thread::sleep(Duration::from_secs(if who == "A" { 3 } else { 0 }));
                    log.lock().unwrap().push(format!(
                        "{who} blocking work ends at {:.2}",
                        t0.elapsed().as_secs_f64()
                    ));
                    active.fetch_sub(1, Ordering::SeqCst);
                })
                .await;
                r.map_err(|e| TaskError::Retryable(e.to_string()))
            }
        })
    };
    let cfg = fast_config()
        .lease(Duration::from_secs(6))
        .shutdown_timeout(Duration::from_millis(300));
    let a = RunningRelay::start(&db.pool, mk("A"), cfg.clone());
    while log.lock().unwrap().len() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.stop().await;
    eprintln!("A stopped at {:.2}", t0.elapsed().as_secs_f64());
    let b = RunningRelay::start(&db.pool, mk("B"), cfg.clone());
    wait::until(Duration::from_secs(30), "B ran it", || async {
        pending(&db.pool).await == 0
    })
    .await;
    b.stop().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    eprintln!("log: {:#?}", log.lock().unwrap());
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two runs of the task's work at once"
    );
}

/// Fifth review, finding 2. Guarantee: two relays (separate databases) given clones of one
/// `TaskTransport`: stopping relay A aborts only A's handlers; B's running task finishes and
/// runs once. (Before: the clones shared the stop, and A's stop aborted B's handler.)
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn stopping_one_relay_leaves_another_relays_handlers_running() {
    let db1 = fresh_postgres_db().await;
    let db2 = fresh_postgres_db().await;
    let ta = unique("r5-a");
    let tb = unique("r5-b");
    let starts = Arc::new(Mutex::new(Vec::<(String, i32, f64)>::new()));
    let t0 = std::time::Instant::now();
    let s2 = starts.clone();
    let transport = TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
        let s = s2.clone();
        async move {
            s.lock()
                .unwrap()
                .push((t.topic.clone(), t.attempt, t0.elapsed().as_secs_f64()));
            tokio::time::sleep(Duration::from_secs(if t.topic.starts_with("r5-a") {
                60
            } else {
                3
            }))
            .await;
            Ok::<_, TaskError>(())
        }
    });
    let cfg = fast_config().shutdown_timeout(Duration::from_millis(300));
    one_job(&db1.pool, &ta, "k").await;
    one_job(&db2.pool, &tb, "k").await;
    let a = RunningRelay::start(&db1.pool, transport.clone(), cfg.clone());
    let b = RunningRelay::start(&db2.pool, transport.clone(), cfg.clone());
    while starts.lock().unwrap().len() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    a.stop().await;
    eprintln!("A stopped at {:.2}", t0.elapsed().as_secs_f64());
    wait::until(Duration::from_secs(30), "B done", || async {
        pending(&db2.pool).await == 0
    })
    .await;
    b.stop().await;
    let s = starts.lock().unwrap();
    eprintln!("starts: {:#?}", s);
    let b_starts = s.iter().filter(|(t, _, _)| t.starts_with("r5-b")).count();
    assert_eq!(
        b_starts, 1,
        "relay B's task was started {b_starts} times (aborted by relay A's stop)"
    );
}

/// Sixth review. Guarantee: a task aborted by the stop is given back due at its run lease end
/// also when its drive was busy (here: recording another task of its batch, whose row a
/// session holds locked) and met the aborted outcome before it noticed the stop itself.
/// (Before: that drive recorded it as an ordinary "held back", due at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_noticed_late_by_a_busy_drive_still_gives_tasks_back_at_lease_end() {
    use sqlx::Connection as _;
    let db = fresh_postgres_db().await;
    let topic = unique("adv-race");
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let go = Arc::new(tokio::sync::Notify::new());
    let (s2, g2) = (started.clone(), go.clone());
    let cfg = fast_config()
        .lease(Duration::from_secs(20))
        .shutdown_timeout(Duration::from_millis(500))
        .lanes(1);
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![
            NewEvent::json(topic.as_str(), "k1", "job", &1).unwrap(),
            NewEvent::json(topic.as_str(), "k2", "job", &2).unwrap(),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let a = RunningRelay::start(
        &db.pool,
        TaskTransport::new(TaskConfig::default()).on("job", move |t: Task| {
            let (s, g) = (s2.clone(), g2.clone());
            async move {
                s.add_permits(1);
                if t.key == "k1" {
                    g.notified().await;
                    return Ok::<_, TaskError>(());
                }
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(())
            }
        }),
        cfg,
    );
    tokio::time::timeout(Duration::from_secs(10), started.acquire_many(2))
        .await
        .unwrap()
        .unwrap()
        .forget();
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![NewEvent::json(topic.as_str(), "k3", "job", &3).unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), started.acquire())
        .await
        .unwrap()
        .unwrap()
        .forget();
    let mut locker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut ltx = locker.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM postal.outbox WHERE event_key='k1' FOR UPDATE")
        .execute(&mut *ltx)
        .await
        .unwrap();
    go.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await; // drive of k1,k2 blocked in settle(k1)
    let t_stop = std::time::Instant::now();
    let stopping = tokio::spawn(a.stop());
    tokio::time::sleep(Duration::from_millis(2000)).await; // release fired; k3's drive aborted all
    ltx.commit().await.unwrap();
    stopping.await.unwrap();
    eprintln!("stop took {:?}", t_stop.elapsed());
    let rows: Vec<(String, String, i32, i32, bool, bool, f64)> = sqlx::query_as(
        "SELECT event_key, status, attempts, runs, running, held, extract(epoch from available_at - now())::float8 FROM postal.outbox ORDER BY seq")
        .fetch_all(&db.pool).await.unwrap();
    eprintln!("rows (key,status,attempts,runs,running,held,due_in_s): {rows:#?}");
    let k2 = rows.iter().find(|r| r.0 == "k2").unwrap();
    let k3 = rows.iter().find(|r| r.0 == "k3").unwrap();
    assert!(
        k3.6 > 5.0,
        "k3 (control) given back due at lease end: {k3:?}"
    );
    assert!(
        k2.6 > 5.0,
        "k2 stopped by the stop should be due at its run lease end, got {k2:?}"
    );
}
