//! Where teams run Postal (issue 51), nothing is lost or leaked: topics
//! re-created with another partition count, PgBouncer in transaction mode under the
//! application's savepoints, `SET LOCAL` and prepared statements, and a transaction pooler
//! too busy for the start-up probe.

use std::time::Duration;

use postal_integration_tests::wait::until;
use postal_integration_tests::{services, unique};
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects_table, produce, RawRecord, RunningConsumer, RunningRelay,
};
use crate::recreated_topic::{applied_in, delete_topic, job, postal, recreate_topic, status_rows};

fn consumer(pool: &PgPool, bootstrap: &str, group: &str, topic: &str) -> RunningConsumer {
    let mut config = consumer_config(bootstrap, group, crate::handlers::CONSUMER);
    config.stall_check = Duration::from_secs(1);
    RunningConsumer::start(
        postal_consumer::Consumer::builder(pool.clone(), config)
            .state(crate::handlers::Probe::default())
            .on(topic, "job", crate::handlers::apply)
            .build()
            .expect("valid consumer"),
    )
}

async fn stopped_in_status(url: &str, bootstrap: &str, group: &str, topic: &str) -> bool {
    let (u, b, g, t) = (
        url.to_owned(),
        bootstrap.to_owned(),
        group.to_owned(),
        topic.to_owned(),
    );
    tokio::task::spawn_blocking(move || {
        status_rows(&u, &b, &g, &t)
            .iter()
            .any(|r| r["stopped"] == true)
    })
    .await
    .unwrap()
}

/// Topic `orders` with 3 partitions is consumed up to offsets 2, 2 and 20 (one hot key on
/// partition 2), then deleted and re-created with 2 partitions (fewer: to re-partition it),
/// and its new log gets 5 records on each partition before the consumers come back.
///
/// Guarantee (docs/operations.md, "Re-created topics": Postal never skips the new records;
/// what it cannot see is a re-created topic that already holds as many records *on every
/// partition* as the group had stored): no record of the new log is lost. Partition 2's
/// stored offset (20) belongs to a partition the topic no longer has, which a topic's normal
/// life never produces (Kafka cannot remove partitions), so the consumer must stop the topic
/// (or apply the new log from its start), not resume partitions 0 and 1 at offset 2 of the
/// new log and never read their first two records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_recreated_with_fewer_partitions_loses_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (orders, group) = (unique("fewer"), unique("g"));
    create_topic(&svc.bootstrap, &orders, 3).await;
    // Old log: n 0..2 on [0], 100..102 on [1], 200..220 on [2].
    for (p, range) in [(0, 0..2), (1, 100..102), (2, 200..220)] {
        let recs: Vec<RawRecord> = range.map(|n| job(Uuid::now_v7(), n)).collect();
        produce(&svc.bootstrap, &orders, Some(p), &recs).await;
    }
    let running = consumer(&db.pool, &svc.bootstrap, &group, &orders);
    until(
        Duration::from_secs(60),
        "the 24 old events applied",
        || async { crate::common::effects(&db.pool).await.0 == 24 },
    )
    .await;
    running.stop().await;

    delete_topic(&svc.bootstrap, &orders).await;
    recreate_topic(&svc.bootstrap, &orders, 2).await;
    // New log: n 300..305 on [0], 400..405 on [1].
    for (p, range) in [(0, 300..305), (1, 400..405)] {
        let recs: Vec<RawRecord> = range.map(|n| job(Uuid::now_v7(), n)).collect();
        produce(&svc.bootstrap, &orders, Some(p), &recs).await;
    }

    let running = consumer(&db.pool, &svc.bootstrap, &group, &orders);
    // Either the whole new log is applied, or the topic shows stopped; or (the failure) the
    // consumer resumed at offset 2 and shows lag 0.
    let mut outcome = "neither";
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if applied_in(&db.pool, 300..305).await + applied_in(&db.pool, 400..405).await == 10 {
            outcome = "all applied";
            break;
        }
        if stopped_in_status(&db.url, &svc.bootstrap, &group, &orders).await {
            outcome = "stopped";
            break;
        }
        // The failure's shape: the tail of the new log applied, its head never.
        if applied_in(&db.pool, 302..305).await == 3 && applied_in(&db.pool, 402..405).await == 3 {
            tokio::time::sleep(Duration::from_secs(10)).await;
            if applied_in(&db.pool, 300..302).await + applied_in(&db.pool, 400..402).await == 0 {
                outcome = "resumed mid-log";
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let skipped = running.stats.snapshot().replays_skipped;
    running.stop().await;
    let rows = {
        let (u, b, g, t) = (
            db.url.clone(),
            svc.bootstrap.clone(),
            group.clone(),
            orders.clone(),
        );
        tokio::task::spawn_blocking(move || status_rows(&u, &b, &g, &t))
            .await
            .unwrap()
    };
    eprintln!(
        "[topology] fewer partitions: outcome {outcome}; new log applied: [0] {} of 5, [1] {} of 5; skipped below stored offset {skipped}; postal status rows {rows:?}",
        applied_in(&db.pool, 300..305).await,
        applied_in(&db.pool, 400..405).await,
    );
    assert!(
        outcome == "all applied" || outcome == "stopped",
        "records of the re-created topic lost: outcome {outcome}; status {rows:?}"
    );
    if outcome == "stopped" {
        // The documented way on applies the whole new log, and the consumer goes on.
        let stdout = reset_to_earliest(&db.url, &svc.bootstrap, &group, &orders);
        eprintln!("[topology] reset: {stdout}");
        let running = consumer(&db.pool, &svc.bootstrap, &group, &orders);
        until(
            Duration::from_secs(60),
            "the new log applied after the reset",
            || async {
                applied_in(&db.pool, 300..305).await + applied_in(&db.pool, 400..405).await == 10
            },
        )
        .await;
        // No stop again on a partition the topic no longer has.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            !stopped_in_status(&db.url, &svc.bootstrap, &group, &orders).await,
            "stopped again after the reset"
        );
        running.stop().await;
    }
    let (rows, distinct) = crate::common::effects(&db.pool).await;
    assert_eq!(
        (rows, distinct),
        (34, 34),
        "each event applied exactly once"
    );
}

/// Topic `orders` with 1 partition consumed up to offset 20, re-created with 3 partitions (more),
/// its new log with 3 records on each partition.
///
/// Guarantee: nothing of the new log is lost or applied twice: the topic stops (partition 0's
/// stored offset is above its new high watermark), and after `postal consumer reset --to
/// earliest` every new record is applied exactly once, whatever the new partitions applied
/// before the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_recreated_with_more_partitions_loses_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (orders, group) = (unique("more"), unique("g"));
    create_topic(&svc.bootstrap, &orders, 1).await;
    let old: Vec<RawRecord> = (0..20).map(|n| job(Uuid::now_v7(), n)).collect();
    produce(&svc.bootstrap, &orders, Some(0), &old).await;
    let running = consumer(&db.pool, &svc.bootstrap, &group, &orders);
    until(
        Duration::from_secs(60),
        "the 20 old events applied",
        || async { crate::common::effects(&db.pool).await.0 == 20 },
    )
    .await;
    running.stop().await;

    delete_topic(&svc.bootstrap, &orders).await;
    recreate_topic(&svc.bootstrap, &orders, 3).await;
    for (p, range) in [(0, 300..303), (1, 400..403), (2, 500..503)] {
        let recs: Vec<RawRecord> = range.map(|n| job(Uuid::now_v7(), n)).collect();
        produce(&svc.bootstrap, &orders, Some(p), &recs).await;
    }
    let running = consumer(&db.pool, &svc.bootstrap, &group, &orders);
    until(Duration::from_secs(60), "the topic stopped", || {
        stopped_in_status(&db.url, &svc.bootstrap, &group, &orders)
    })
    .await;
    let before_reset = (
        applied_in(&db.pool, 300..303).await,
        applied_in(&db.pool, 400..403).await,
        applied_in(&db.pool, 500..503).await,
    );
    running.stop().await;
    let stdout = reset_to_earliest(&db.url, &svc.bootstrap, &group, &orders);
    let running = consumer(&db.pool, &svc.bootstrap, &group, &orders);
    until(
        Duration::from_secs(60),
        "the new log applied after the reset",
        || async {
            applied_in(&db.pool, 300..303).await
                + applied_in(&db.pool, 400..403).await
                + applied_in(&db.pool, 500..503).await
                == 9
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    running.stop().await;
    let (rows, distinct) = crate::common::effects(&db.pool).await;
    eprintln!(
        "[topology] more partitions: applied before the reset {before_reset:?}; reset: {stdout}; effects {rows} rows, {distinct} events"
    );
    assert_eq!(
        (rows, distinct),
        (29, 29),
        "each event applied exactly once"
    );
}

/// The application's load on a transaction pooler: `clients` connections, each holding a
/// server in a `hold`-long transaction, back to back, until `stop`.
fn busy_application(
    url: String,
    clients: usize,
    hold: Duration,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|_| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                use sqlx::Connection as _;
                let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
                let sql = format!("BEGIN; SELECT pg_sleep({}); COMMIT", hold.as_secs_f64());
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    sqlx::Executor::execute(&mut conn, sql.as_str()).await.ok();
                }
            })
        })
        .collect()
}

/// PgBouncer in transaction mode (2 server connections) whose application keeps both servers
/// busy in 10 s transactions (a batch job at peak) while `postal relay` starts through it; the
/// application's load ends 20 s later.
///
/// Guarantee (issue 51, docs/operations.md#poolers: the relay "refused at start", "stop with
/// one line instead of looping on 'claim failed'"): the relay stops with the one
/// transaction-pooler line within a minute, whatever the pooler's load when it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_through_a_busy_transaction_pooler_is_still_refused() {
    use postal_integration_tests::pgbouncer::{self, PgBouncer, PoolMode};
    let Some(bin) = pgbouncer::binary("production_topology::busy_transaction_pooler_relay") else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("busy");
    let mut conn = db.pool.acquire().await.unwrap();
    let events = (0..50)
        .map(|i| {
            postal_producer::NewEvent::json(topic.as_str(), format!("k{}", i % 5), "e", &i).unwrap()
        })
        .collect();
    postal_producer::enqueue_batch(&mut conn, events)
        .await
        .unwrap();
    drop(conn);
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Transaction, 2, &[]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let app = busy_application(
        bouncer.url(&db.name),
        2,
        Duration::from_secs(10),
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let dir = crate::poolers::tempdir();
    let mut relay = crate::procs::Proc::new(
        &crate::procs::bin_dir(),
        &dir,
        "relay",
        "postal",
        &["relay"],
    )
    .env(&[
        ("DATABASE_URL", bouncer.url(&db.name)),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ])
    .with_metrics();
    relay.start();
    let started = std::time::Instant::now();
    let mut app = Some(app);
    let exited = loop {
        if let Some(status) = relay.exited() {
            break Some(status);
        }
        if started.elapsed() > Duration::from_secs(20) {
            if let Some(app) = app.take() {
                stop.store(true, std::sync::atomic::Ordering::SeqCst);
                for h in app {
                    h.await.ok();
                }
                eprintln!(
                    "[topology] the application's load ended at {:.1}s",
                    started.elapsed().as_secs_f64()
                );
            }
        }
        if started.elapsed() > Duration::from_secs(80) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let log = std::fs::read_to_string(&relay.log).unwrap_or_default();
    let outbox = crate::common::outbox_count(&db.pool).await;
    let lines = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    eprintln!(
        "[topology] busy transaction pooler: relay exited {exited:?} after {:.1}s; outbox rows left {outbox} of 50; lines: 'could not tell' {}, 'transaction pooler' {}, 'claim failed' {}, 'relay stalled' {}, ERROR {}, WARN {}\n--- relay log (head) ---\n{}",
        started.elapsed().as_secs_f64(),
        lines("could not tell"),
        lines("transaction pooler"),
        lines("claim failed"),
        lines("relay stalled"),
        lines("ERROR"),
        lines("WARN"),
        log.lines().take(40).collect::<Vec<_>>().join("\n"),
    );
    if exited.is_none() {
        relay.kill();
    }
    let refused = log
        .lines()
        .filter(|l| {
            l.contains("error")
                && l.contains("transaction pooler")
                && l.contains("session-mode pool")
        })
        .count();
    assert!(
        exited.is_some_and(|s| !s.success()) && refused == 1 && lines("sqlx_s_") == 0 && lines("claim failed") == 0,
        "the relay ran through a transaction pooler (the start-up probe answered 'unknown' while the application held every server connection): exited {exited:?}, refusal lines {refused}; log: {log}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `postal migrate` on an empty database through a transaction pooler whose application keeps
/// both servers busy in 10 s transactions, then stops 20 s later.
///
/// Guarantee (docs/operations.md#poolers: migrate "refused at start"; "no session state
/// leaks"): migrate refuses with the one line, writes nothing, and no server session of the
/// pooler keeps the migrator's `search_path` or `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_through_a_busy_transaction_pooler_is_refused_and_leaks_nothing() {
    migrate_through_a_busy_transaction_pooler(Duration::from_secs(10)).await;
}

/// As above, the application's transactions 40 s long: longer than the probe waits (30 s).
///
/// Broken before: the probe's "could not tell" let migrate run, and it left `search_path =
/// postal` and `lock_timeout = 1s` on a server session; migrate now refuses an unknown answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_through_a_transaction_pooler_busy_longer_than_the_probe_waits() {
    migrate_through_a_busy_transaction_pooler(Duration::from_secs(40)).await;
}

async fn migrate_through_a_busy_transaction_pooler(hold: Duration) {
    use postal_integration_tests::pgbouncer::{self, PgBouncer, PoolMode};
    let Some(bin) = pgbouncer::binary("production_topology::busy_transaction_pooler_migrate")
    else {
        return;
    };
    let svc = services().await;
    let db = svc.empty_db().await;
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Transaction, 2, &[]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let app = busy_application(bouncer.url(&db.name), 2, hold, stop.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let url = bouncer.url(&db.name);
    let stopper = {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(hold * 2).await;
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            for h in app {
                h.await.ok();
            }
        })
    };
    let started = std::time::Instant::now();
    let (exited, ok, stderr) = tokio::task::spawn_blocking(move || {
        crate::poolers::postal(&url, &["migrate"], Duration::from_secs(150))
    })
    .await
    .unwrap();
    stopper.await.unwrap();
    let took = started.elapsed();
    let (applied, public): (Option<i64>, bool) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = 'postal' AND c.relname = '_sqlx_migrations'),
                to_regclass('public._sqlx_migrations') IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // Every server session of the pooler, as the application's next transactions get them.
    let mut a = sqlx::PgConnection::connect(&bouncer.url(&db.name))
        .await
        .unwrap();
    let mut b = sqlx::PgConnection::connect(&bouncer.url(&db.name))
        .await
        .unwrap();
    use sqlx::{Connection as _, Executor as _, Row as _};
    a.execute("BEGIN").await.unwrap();
    b.execute("BEGIN").await.unwrap();
    let mut settings = Vec::new();
    for conn in [&mut a, &mut b] {
        let row = conn
            .fetch_one("SELECT current_setting('search_path'), current_setting('lock_timeout'), pg_backend_pid()")
            .await
            .unwrap();
        settings.push((
            row.get::<String, _>(0),
            row.get::<String, _>(1),
            row.get::<i32, _>(2),
        ));
    }
    eprintln!(
        "[topology] migrate through a busy transaction pooler: exited {exited}, success {ok} after {:.1}s; postal._sqlx_migrations present {applied:?}, public._sqlx_migrations {public}; server sessions (search_path, lock_timeout, pid): {settings:?}; stderr: {stderr}",
        took.as_secs_f64()
    );
    for (path, timeout, _) in &settings {
        assert_eq!(
            (path.as_str(), timeout.as_str()),
            ("\"$user\", public", "0"),
            "the migrator's session settings leaked to the application's server sessions"
        );
    }
    assert!(
        exited && !ok && stderr.contains("transaction pooler"),
        "migrate ran through a transaction pooler: {stderr}"
    );
}

/// The application's own transactions through PgBouncer in transaction mode (2 servers, 6
/// clients): `SET LOCAL` statement settings, savepoints (an `enqueue` in a savepoint rolled
/// back, one in a savepoint released, one after a failed statement rolled back to its
/// savepoint), sqlx's named prepared statements of its own on another pool, and
/// `enqueue_batch`.
///
/// Guarantee: exactly the events of committed, not-rolled-back savepoints are in the outbox,
/// each once, each key's in enqueue order; enqueue sees and keeps the caller's `SET LOCAL`
/// only within that transaction (no `SET LOCAL` of the caller leaks to another client's
/// transaction on the same server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_through_transaction_pooling_inside_savepoints_and_set_local() {
    use postal_integration_tests::pgbouncer::{self, PgBouncer, PoolMode};
    use postal_producer::{enqueue, enqueue_batch, NewEvent};
    let Some(bin) = pgbouncer::binary("production_topology::enqueue_savepoints") else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Transaction, 2, &[]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .connect(&bouncer.url(&db.name))
        .await
        .unwrap();
    let topic = unique("sp");
    let writers = (0..6).map(|w| {
        let (pool, topic) = (pool.clone(), topic.clone());
        tokio::spawn(async move {
            let mut kept = Vec::new();
            for i in 0..20i64 {
                let key = format!("k{}", w % 3);
                let ev = |tag: &str| {
                    NewEvent::json(topic.as_str(), key.as_str(), "e", &serde_json::json!({"w": w, "i": i, "tag": tag})).unwrap()
                };
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("SET LOCAL statement_timeout = '7s'")
                    .persistent(false)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                sqlx::query("SET LOCAL application_name = 'review-writer'")
                    .persistent(false)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                // A savepoint rolled back: its event is gone.
                sqlx::query("SAVEPOINT a").persistent(false).execute(&mut *tx).await.unwrap();
                enqueue(&mut tx, ev("rolled-back")).await.unwrap();
                sqlx::query("ROLLBACK TO SAVEPOINT a").persistent(false).execute(&mut *tx).await.unwrap();
                // A savepoint released: its event stays.
                sqlx::query("SAVEPOINT b").persistent(false).execute(&mut *tx).await.unwrap();
                enqueue(&mut tx, ev("released")).await.unwrap();
                sqlx::query("RELEASE SAVEPOINT b").persistent(false).execute(&mut *tx).await.unwrap();
                kept.push((key.clone(), w, i, "released"));
                // A failed statement rolled back to its savepoint, then a batch.
                sqlx::query("SAVEPOINT c").persistent(false).execute(&mut *tx).await.unwrap();
                assert!(sqlx::query("SELECT 1/0").persistent(false).execute(&mut *tx).await.is_err());
                sqlx::query("ROLLBACK TO SAVEPOINT c").persistent(false).execute(&mut *tx).await.unwrap();
                enqueue_batch(&mut tx, vec![ev("batch-1"), ev("batch-2")]).await.unwrap();
                kept.push((key.clone(), w, i, "batch-1"));
                kept.push((key.clone(), w, i, "batch-2"));
                // The caller's SET LOCAL still holds after enqueue, in its transaction.
                let (timeout, app): (String, String) = sqlx::query_as(
                    "SELECT current_setting('statement_timeout'), current_setting('application_name')",
                )
                .persistent(false)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
                assert_eq!((timeout.as_str(), app.as_str()), ("7s", "review-writer"));
                // Every fourth transaction rolls back whole.
                if i % 4 == 3 {
                    tx.rollback().await.unwrap();
                    kept.truncate(kept.len() - 3);
                } else {
                    tx.commit().await.unwrap();
                }
            }
            kept
        })
    });
    // Another client on the same servers, outside those transactions: no SET LOCAL leaks.
    let mut leaks = 0;
    let probe = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&bouncer.url(&db.name))
        .await
        .unwrap();
    let mut expected = Vec::new();
    let handles: Vec<_> = writers.collect();
    for _ in 0..50 {
        let mut tx = probe.begin().await.unwrap();
        let (timeout, app): (String, String) = sqlx::query_as(
            "SELECT current_setting('statement_timeout'), current_setting('application_name')",
        )
        .persistent(false)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        if timeout != "0" || app == "review-writer" {
            leaks += 1;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for h in handles {
        expected.extend(
            h.await
                .expect("a writer failed through transaction pooling"),
        );
    }
    let rows: Vec<(String, serde_json::Value)> = sqlx::query_as(
        "SELECT event_key, convert_from(payload, 'UTF8')::jsonb FROM postal.outbox WHERE topic = $1 ORDER BY seq",
    )
    .bind(&topic)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let got: Vec<(String, i64, i64, String)> = rows
        .iter()
        .map(|(k, p)| {
            (
                k.clone(),
                p["w"].as_i64().unwrap(),
                p["i"].as_i64().unwrap(),
                p["tag"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let rolled_back = got.iter().filter(|g| g.3 == "rolled-back").count();
    let mut want: Vec<(String, i64, i64, String)> = expected
        .iter()
        .map(|(k, w, i, t)| (k.clone(), *w as i64, *i, t.to_string()))
        .collect();
    // Per writer, its events in enqueue order (a writer's key is fixed).
    let mut order_breaks = 0;
    for w in 0..6i64 {
        let mine: Vec<&(String, i64, i64, String)> = got.iter().filter(|g| g.1 == w).collect();
        let wanted: Vec<&(String, i64, i64, String)> = want.iter().filter(|g| g.1 == w).collect();
        if mine != wanted {
            order_breaks += 1;
        }
    }
    let mut g_sorted = got.clone();
    g_sorted.sort();
    want.sort();
    eprintln!(
        "[topology] enqueue in savepoints through transaction pooling: {} rows (want {}), rolled-back savepoint rows {rolled_back}, writers out of order {order_breaks}, SET LOCAL leaks seen by another client {leaks} of 50",
        got.len(),
        want.len()
    );
    assert_eq!(g_sorted, want, "exactly the kept events, once each");
    assert_eq!(rolled_back, 0);
    assert_eq!(order_breaks, 0);
    assert_eq!(leaks, 0);
    pool.close().await;
    probe.close().await;
}

/// The live shape of the first test: a relay and a consumer running through a session-mode
/// PgBouncer, writers enqueuing through a transaction-mode PgBouncer (12 customers, each
/// order with the customer's next `seq`), topic `orders` with 3 partitions. The writers pause
/// and everything is applied; the topic is deleted and, while the writers go on, re-created
/// with 2 partitions (the relay creates no topics: its events wait meanwhile); the batch the
/// relay had in flight to the old topic and its cached partition count (3) meet the new one.
///
/// Guarantee: no loss, no duplicate effect, no order break, no silent stall: the consumer
/// stops the topic (partition 2 is gone; partitions 0 and 1 may already hold more records than
/// their stored offsets), `postal consumer reset --to earliest` through the session pooler
/// lifts it, and then every order is applied exactly once, each customer's in `seq` order
/// (judged on the effects' insertion order), nothing parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_topic_recreated_with_fewer_partitions_behind_poolers() {
    use postal_integration_tests::pgbouncer::{self, PgBouncer, PoolMode};
    use postal_producer::{enqueue, NewEvent};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let Some(bin) = pgbouncer::binary("production_topology::live_fewer_partitions") else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    sqlx::query("ALTER TABLE effects ADD COLUMN key text, ADD COLUMN seq int")
        .execute(&db.pool)
        .await
        .unwrap();
    let session = PgBouncer::start(&bin, &svc.database_url, PoolMode::Session, 40, &[]);
    let txn = PgBouncer::start(&bin, &svc.database_url, PoolMode::Transaction, 3, &[]);
    let (orders, group) = (unique("livefewer"), unique("g"));
    create_topic(&svc.bootstrap, &orders, 3).await;
    let relay_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&session.url(&db.name))
        .await
        .unwrap();
    let mut kcfg = postal_producer::KafkaConfig::new(&svc.bootstrap);
    kcfg.create_topics = false;
    kcfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    let relay = RunningRelay::start(
        &relay_pool,
        postal_producer::KafkaTransport::new(kcfg).unwrap(),
        crate::common::fast_config(),
    );
    let consumer_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&session.url(&db.name))
        .await
        .unwrap();
    let start_consumer = || {
        let mut config = consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER);
        config.stall_check = Duration::from_secs(1);
        RunningConsumer::start(
            postal_consumer::Consumer::builder(consumer_pool.clone(), config)
                .on(&orders, "order", record_order)
                .build()
                .expect("valid consumer"),
        )
    };
    let mut running = Some(start_consumer());

    let stop = Arc::new(AtomicBool::new(false));
    let paused = Arc::new(AtomicBool::new(false));
    let written: Arc<Mutex<Vec<(String, i32)>>> = Arc::default();
    let writers: Vec<_> = (0..3)
        .map(|w| {
            let (url, topic, stop, paused, written) = (
                txn.url(&db.name),
                orders.clone(),
                stop.clone(),
                paused.clone(),
                written.clone(),
            );
            tokio::spawn(async move {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .unwrap();
                let mut seq = [0i32; 12];
                let mut n = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    if paused.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    let k = w + 3 * (n % 4);
                    n += 1;
                    seq[k] += 1;
                    let key = format!("c{k}");
                    let mut tx = pool.begin().await.unwrap();
                    enqueue(
                        &mut tx,
                        NewEvent::json(
                            topic.as_str(),
                            key.as_str(),
                            "order",
                            &serde_json::json!({"key": key, "seq": seq[k]}),
                        )
                        .unwrap(),
                    )
                    .await
                    .unwrap();
                    tx.commit().await.unwrap();
                    written.lock().unwrap().push((key, seq[k]));
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
            })
        })
        .collect();
    let applied = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT event_id) FROM effects")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    tokio::time::sleep(Duration::from_secs(6)).await;
    paused.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = written.lock().unwrap().len() as i64;
    until(
        Duration::from_secs(60),
        "everything written so far applied",
        || async { applied().await >= before },
    )
    .await;
    let offsets: Vec<(i32, Option<i64>)> = sqlx::query_as(
        "SELECT partition, next_offset FROM postal.consumer_offsets WHERE group_id = $1 AND topic = $2 ORDER BY partition",
    )
    .bind(&group)
    .bind(&orders)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    delete_topic(&svc.bootstrap, &orders).await;
    paused.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    recreate_topic(&svc.bootstrap, &orders, 2).await;
    let t_recreated = std::time::Instant::now();
    // Stopped, or (the failure) the new log's head skipped.
    let stopped = loop {
        if stopped_in_status(&db.url, &svc.bootstrap, &group, &orders).await {
            break true;
        }
        if t_recreated.elapsed() > Duration::from_secs(60) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let shown_after = t_recreated.elapsed();
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    running.take().unwrap().stop().await;
    let (ok, stdout, stderr) = postal(
        &session.url(&db.name),
        &svc.bootstrap,
        &[
            "consumer",
            "reset",
            "--group",
            &group,
            "--topic",
            &orders,
            "--to",
            "earliest",
            "--execute",
        ],
    );
    assert!(ok, "reset through the session pooler: {stderr}");
    let _ = stdout;
    let running = start_consumer();
    let total = written.lock().unwrap().len() as i64;
    let drained = tokio::time::timeout(Duration::from_secs(90), async {
        while applied().await < total {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .is_ok();
    tokio::time::sleep(Duration::from_secs(2)).await;
    running.stop().await;
    let stats = relay.stop().await;
    let rows: Vec<(String, i32, Uuid)> =
        sqlx::query_as("SELECT key, seq, event_id FROM effects ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let mut per_id = std::collections::HashMap::new();
    for r in &rows {
        *per_id.entry(r.2).or_insert(0) += 1;
    }
    let duplicates: i32 = per_id.values().map(|n| n - 1).sum();
    let distinct = per_id.len() as i64;
    let mut last = std::collections::HashMap::new();
    let mut breaks = 0;
    for (k, s, _) in &rows {
        let prev = last.entry(k.clone()).or_insert(0);
        if *s <= *prev {
            breaks += 1;
        }
        *prev = (*prev).max(*s);
    }
    let (parked, pending): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'failed'), count(*) FILTER (WHERE status = 'pending') FROM postal.outbox",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    eprintln!(
        "[topology] live fewer partitions: stored offsets before the deletion {offsets:?}; stopped {stopped} ({:.1}s after the re-creation); orders written {total}, applied {distinct} (drained {drained}), duplicate effects {duplicates}, order breaks {breaks}, parked {parked}, pending {pending}; relay {stats:?}",
        shown_after.as_secs_f64()
    );
    relay_pool.close().await;
    consumer_pool.close().await;
    assert!(stopped, "the re-created topic was not stopped");
    assert!(
        drained && distinct == total,
        "lost: {} of {total}",
        total - distinct
    );
    assert_eq!((duplicates, breaks, parked, pending), (0, 0, 0, 0));
}

#[derive(serde::Deserialize)]
struct Order {
    key: String,
    seq: i32,
}

/// Records an order in `effects` (event id, key, seq).
#[postal_consumer::idempotent(consumer = "effects")]
async fn record_order(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    event: postal_consumer::Event<Order>,
) -> Result<(), postal_consumer::HandlerError> {
    sqlx::query(
        "INSERT INTO effects (event_id, n, consumer, key, seq) VALUES ($1, 0, 'effects', $2, $3)",
    )
    .bind(event.id.as_uuid())
    .bind(&event.payload.key)
    .bind(event.payload.seq)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The other side of the first test's fix: partitions *added* to a topic (its normal life)
/// under a running consumer, records on the new partition applied, then consumers restarted
/// (every partition taken over again, with a stored offset on the new partition).
///
/// Guarantee: no stop (no false "re-created" from the stored partitions' count), every record
/// applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_added_to_a_topic_do_not_stop_it() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (orders, group) = (unique("added"), unique("g"));
    create_topic(&svc.bootstrap, &orders, 2).await;
    for (p, range) in [(0, 0..3), (1, 100..103)] {
        let recs: Vec<RawRecord> = range.map(|n| job(Uuid::now_v7(), n)).collect();
        produce(&svc.bootstrap, &orders, Some(p), &recs).await;
    }
    let running = consumer(&db.pool, &svc.bootstrap, &group, &orders);
    until(Duration::from_secs(60), "the first 6 applied", || async {
        crate::common::effects(&db.pool).await.0 == 6
    })
    .await;
    crate::row_locks_ended_claims::add_partitions(&svc.bootstrap, &orders, 4).await;
    for (p, range) in [(2, 200..203), (3, 300..303)] {
        let recs: Vec<RawRecord> = range.map(|n| job(Uuid::now_v7(), n)).collect();
        produce(&svc.bootstrap, &orders, Some(p), &recs).await;
    }
    // librdkafka finds the new partitions at its next metadata refresh (topic.metadata.refresh.interval.ms).
    until(
        Duration::from_secs(120),
        "the new partitions' records applied",
        || async {
            applied_in(&db.pool, 200..203).await + applied_in(&db.pool, 300..303).await == 6
        },
    )
    .await;
    running.stop().await;
    for round in 0..2 {
        let running = consumer(&db.pool, &svc.bootstrap, &group, &orders);
        let recs: Vec<RawRecord> = (0..4)
            .map(|i| job(Uuid::now_v7(), 1000 + round * 10 + i))
            .collect();
        for (i, r) in recs.into_iter().enumerate() {
            produce(&svc.bootstrap, &orders, Some(i as i32), &[r]).await;
        }
        until(
            Duration::from_secs(60),
            "this round's 4 applied",
            || async { applied_in(&db.pool, 1000 + round * 10..1000 + round * 10 + 4).await == 4 },
        )
        .await;
        assert!(
            !stopped_in_status(&db.url, &svc.bootstrap, &group, &orders).await,
            "a topic whose partitions were added was stopped (round {round})"
        );
        running.stop().await;
    }
    let (rows, distinct) = crate::common::effects(&db.pool).await;
    assert_eq!((rows, distinct), (20, 20));
}

/// Runs `postal consumer reset --to earliest --execute` for `group` on `topic`, the documented
/// way on from a stopped (re-created) topic; returns its output, panicking when it fails.
fn reset_to_earliest(url: &str, bootstrap: &str, group: &str, topic: &str) -> String {
    let (ok, stdout, stderr) = postal(
        url,
        bootstrap,
        &[
            "consumer",
            "reset",
            "--group",
            group,
            "--topic",
            topic,
            "--to",
            "earliest",
            "--execute",
        ],
    );
    assert!(ok, "reset: {stderr}");
    stdout
}
