//! Postal behind a real PgBouncer (Debian's 1.18; `integration-tests/src/pgbouncer.rs` starts a
//! private instance per test): what works through transaction pooling (the application's
//! enqueue, cleanup), what refuses it at start with one line (relay, consumer, commands,
//! migrate), and what a session pooler needs (docs/operations.md#poolers).

use std::time::{Duration, Instant};

use postal_integration_tests::pgbouncer::{self, PgBouncer, PoolMode};
use postal_integration_tests::{services, wait};
use postal_producer::{enqueue, enqueue_batch, enqueue_once, EventId, NewEvent};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection as _, PgConnection, PgPool};

use crate::procs::bin_dir;

/// A pool through `bouncer` to database `db`.
async fn pool_through(bouncer: &PgBouncer, db: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(20))
        .connect(&bouncer.url(db))
        .await
        .expect("connect through pgbouncer")
}

/// Runs `postal ARGS` with `DATABASE_URL=url` until it exits or `limit` passes (then it is
/// killed): (exited in time, success, stderr).
pub(crate) fn postal(url: &str, args: &[&str], limit: Duration) -> (bool, bool, String) {
    let dir = tempdir();
    let err_path = dir.join("stderr");
    let mut child = std::process::Command::new(bin_dir().join("postal"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
        .env("POSTAL_CONNECT_TIMEOUT", "10s")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("postal runs");
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    std::fs::remove_dir_all(&dir).ok();
    (
        status.is_some(),
        status.is_some_and(|s| s.success()),
        stderr,
    )
}

pub(crate) fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(postal_integration_tests::unique("postal-poolers"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Guarantee: the application's enqueue works through PgBouncer in transaction mode — many
/// clients over few server connections, `enqueue`, `enqueue_batch`, `enqueue_once` (also its
/// repeat) inside transactions, and the SQL function `postal.enqueue` — with every event written once and each key's events in
/// enqueue order. (Named prepared statements, sqlx's default, fail there: "prepared statement
/// … does not exist" / "already exists".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_works_through_transaction_pooling() {
    let Some(bin) = pgbouncer::binary("poolers::enqueue_works_through_transaction_pooling") else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    // 2 server connections for 8 clients: each client's transactions land on either.
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Transaction, 2, &[]);
    let pool = pool_through(&bouncer, &db.name, 8).await;
    let writers = (0..8).map(|w| {
        let pool = pool.clone();
        tokio::spawn(async move {
            for i in 0..15 {
                let key = format!("k{}", (w + i) % 5);
                let mut tx = pool.begin().await.unwrap();
                match i % 4 {
                    0 => {
                        enqueue(
                            &mut tx,
                            NewEvent::json("orders", key.as_str(), "e", &(w, i)).unwrap(),
                        )
                        .await
                        .unwrap();
                    }
                    1 => {
                        let events = (0..3)
                            .map(|j| {
                                NewEvent::json("orders", key.as_str(), "e", &(w, i, j)).unwrap()
                            })
                            .collect();
                        enqueue_batch(&mut tx, events).await.unwrap();
                    }
                    2 => {
                        let id = EventId::derived(EventId::new(), &format!("{w}-{i}"));
                        let once = || {
                            NewEvent::json("orders", key.as_str(), "e", &(w, i))
                                .unwrap()
                                .with_id(id)
                        };
                        enqueue_once(&mut tx, once()).await.unwrap();
                        enqueue_once(&mut tx, once()).await.unwrap();
                    }
                    _ => {
                        sqlx::query("SELECT postal.enqueue('orders', $1, 'e', $2)")
                            .bind(&key)
                            .bind(serde_json::json!([w, i]))
                            .persistent(false)
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                    }
                }
                tx.commit().await.unwrap();
                // (Outside a transaction, through a transaction pooler, an unnamed statement's
                // round trips may reach two server sessions; enqueue never opens a transaction
                // of its own, which would commit one its caller opened with plain `BEGIN`.)
            }
        })
    });
    for w in writers {
        w.await
            .expect("a writer failed through transaction pooling");
    }
    // 8 writers × 15 rounds: 1 + 3 + 1 + 1 events by round kind.
    let per_writer: i64 = (0..15).map(|i| [1, 3, 1, 1][i % 4]).sum();
    let (total, ids): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM postal.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(total, 8 * per_writer, "every event written once");
    assert_eq!(ids, total, "no event id twice");
    pool.close().await;
}

/// Guarantee: through PgBouncer in transaction mode, `postal relay` (polling or reading the
/// WAL), `postal status` and
/// `postal migrate` stop at start, within seconds, with one line that names the transaction
/// pooler and says to connect directly or through a session pool — the relay never loops on
/// "claim failed", and migrate writes nothing into `public`; a consumer's `run` returns the
/// same error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_consumer_and_commands_refuse_transaction_pooling_with_one_line() {
    let Some(bin) =
        pgbouncer::binary("poolers::relay_consumer_and_commands_refuse_transaction_pooling")
    else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let empty = svc.empty_db().await;
    // As the reviewer ran it: `options` ignored, so a startup option is dropped silently.
    let bouncer = PgBouncer::start(
        &bin,
        &svc.database_url,
        PoolMode::Transaction,
        4,
        &["options"],
    );
    let says_what_to_do = |what: &str, stderr: &str| {
        let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
        assert_eq!(lines.len(), 1, "{what}: one error line: {stderr}");
        assert!(
            lines[0].contains("transaction pooler")
                && lines[0].contains("directly")
                && lines[0].contains("session-mode pool"),
            "{what}: {stderr}"
        );
        assert!(!stderr.contains("claim failed"), "{what}: {stderr}");
    };
    let (exited, ok, stderr) = postal(&bouncer.url(&db.name), &["relay"], Duration::from_secs(30));
    assert!(exited && !ok, "postal relay must stop at start: {stderr}");
    says_what_to_do("postal relay", &stderr);
    // A WAL relay too (its slot need not exist: the pooler is refused first).
    let (exited, ok, stderr) = postal(
        &bouncer.url(&db.name),
        &["relay", "--read-from", "wal"],
        Duration::from_secs(30),
    );
    assert!(
        exited && !ok,
        "postal relay --read-from wal must stop at start: {stderr}"
    );
    says_what_to_do("postal relay --read-from wal", &stderr);
    let (exited, ok, stderr) = postal(&bouncer.url(&db.name), &["status"], Duration::from_secs(30));
    assert!(exited && !ok, "postal status must refuse: {stderr}");
    says_what_to_do("postal status", &stderr);
    let (exited, ok, stderr) = postal(
        &bouncer.url(&empty.name),
        &["migrate"],
        Duration::from_secs(30),
    );
    assert!(
        exited && !ok,
        "postal migrate must refuse, not run forever: {stderr}"
    );
    says_what_to_do("postal migrate", &stderr);
    let public: bool =
        sqlx::query_scalar("SELECT to_regclass('public._sqlx_migrations') IS NOT NULL")
            .fetch_one(&empty.pool)
            .await
            .unwrap();
    assert!(
        !public,
        "postal migrate wrote sqlx's bookkeeping into public"
    );

    // The consumer runtime checks the same way before it joins its group.
    let pool = pool_through(&bouncer, &db.name, 4).await;
    let consumer = crate::common::apply_consumer(
        &pool,
        &postal_integration_tests::unique("poolers"),
        crate::common::consumer_config(
            &svc.bootstrap,
            &postal_integration_tests::unique("g"),
            "effects",
        ),
    );
    let run = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run(std::future::pending::<()>()),
    )
    .await
    .expect("the consumer must stop at start, not wait");
    let err = run
        .expect_err("the consumer must refuse a transaction pooler")
        .to_string();
    assert!(err.contains("transaction pooler"), "{err}");
    pool.close().await;
}

/// Guarantee: the cleanup job (published-row retention; dedup and dead-letter retention share
/// its code) holds no session state: run again and again through a transaction pooler whose
/// server connections other clients keep switching, it never finds its own lock left taken
/// ("another instance"), and afterwards no advisory lock is held and no server session of the
/// pooler has a `lock_timeout` set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_through_transaction_pooling_leaves_no_session_state() {
    let Some(bin) = pgbouncer::binary("poolers::cleanup_through_transaction_pooling") else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Transaction, 2, &[]);
    let pool = pool_through(&bouncer, &db.name, 2).await;
    // Other clients: short transactions on both servers all the time.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hammer = {
        let (url, stop) = (bouncer.url(&db.name), stop.clone());
        tokio::spawn(async move {
            let mut conn = PgConnection::connect(&url).await.unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                sqlx::Executor::execute(&mut conn, "BEGIN; SELECT pg_sleep(0.002); COMMIT")
                    .await
                    .unwrap();
            }
        })
    };
    for run in 0..30 {
        let mut conn = db.pool.acquire().await.unwrap();
        let events = (0..5)
            .map(|i| NewEvent::json("t", format!("k{i}"), "e", &i).unwrap())
            .collect();
        enqueue_batch(&mut conn, events).await.unwrap();
        sqlx::query(
            "UPDATE postal.outbox SET status = 'published', published_at = now() - interval '2 hours'",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let done = postal_producer::retention::cleanup_published(
            &pool,
            Duration::from_secs(3600),
            2,
            |_| {},
        )
        .await
        .unwrap_or_else(|e| panic!("cleanup run {run} failed through the pooler: {e}"));
        assert_eq!(done, Some(5), "cleanup run {run}: skipped or incomplete");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    hammer.await.unwrap();
    let locks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(locks, 0, "an advisory lock outlived the cleanup");
    // Both server sessions at once: two clients each inside a transaction.
    let mut a = PgConnection::connect(&bouncer.url(&db.name)).await.unwrap();
    let mut b = PgConnection::connect(&bouncer.url(&db.name)).await.unwrap();
    sqlx::Executor::execute(&mut a, "BEGIN").await.unwrap();
    sqlx::Executor::execute(&mut b, "BEGIN").await.unwrap();
    for conn in [&mut a, &mut b] {
        use sqlx::{Executor as _, Row as _};
        let timeout: String = conn.fetch_one("SHOW lock_timeout").await.unwrap().get(0);
        assert_eq!(
            timeout, "0",
            "a lock_timeout leaked to another client's session"
        );
    }
    pool.close().await;
}

/// Guarantee: `postal migrate` through a session-mode PgBouncer (startup `options` refused, as
/// by default) applies every migration, keeps sqlx's bookkeeping in `postal._sqlx_migrations`
/// and writes nothing into `public`; a second run is a no-op; and the migrator's session
/// settings do not reach the next client of its server connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_through_a_session_pooler_keeps_its_bookkeeping_in_postal() {
    let Some(bin) = pgbouncer::binary("poolers::migrate_through_a_session_pooler") else {
        return;
    };
    let svc = services().await;
    let db = svc.empty_db().await;
    // One server connection: the next client gets the migrator's server session.
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Session, 3, &[]);
    for round in 0..2 {
        let (exited, ok, stderr) = postal(
            &bouncer.url(&db.name),
            &["migrate"],
            Duration::from_secs(120),
        );
        assert!(
            exited && ok,
            "postal migrate (round {round}) through a session pooler: {stderr}"
        );
    }
    let (applied, public): (i64, bool) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM postal._sqlx_migrations WHERE success),
                to_regclass('public._sqlx_migrations') IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        applied,
        postal_shared::migrator().iter().count() as i64,
        "every migration recorded in postal._sqlx_migrations"
    );
    assert!(!public, "sqlx's bookkeeping landed in public");
    postal_shared::check_schema(&db.pool).await.unwrap();
    // Every server session of the pooler, as the next clients get them.
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(PgConnection::connect(&bouncer.url(&db.name)).await.unwrap());
    }
    for conn in &mut conns {
        use sqlx::{Executor as _, Row as _};
        let row = conn
            .fetch_one("SELECT current_setting('search_path'), current_setting('lock_timeout')")
            .await
            .unwrap();
        let (path, timeout): (String, String) = (row.get(0), row.get(1));
        assert_eq!(
            (path.as_str(), timeout.as_str()),
            ("\"$user\", public", "0")
        );
    }
}

/// Guarantee: a relay behind a session-mode PgBouncer whose pool is smaller than the relay's
/// (4 server connections for a pool of 12) does not idle without a sign: within a minute it
/// logs one "relay stalled" line saying what to change, `/readyz` answers not ready, and
/// `postal_relay_claim_waiting_seconds` shows the wait; and `postal status` shows the relay
/// STALLED with that line (before issue 51's last part it showed only the heartbeat).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_pool_smaller_than_the_relays_shows_within_a_minute() {
    let Some(bin) = pgbouncer::binary("poolers::a_session_pool_smaller_than_the_relays") else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = postal_integration_tests::unique("poolers");
    let mut conn = db.pool.acquire().await.unwrap();
    let events = (0..50)
        .map(|i| NewEvent::json(topic.as_str(), format!("k{i}"), "e", &i).unwrap())
        .collect();
    enqueue_batch(&mut conn, events).await.unwrap();
    drop(conn);
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Session, 4, &[]);
    let dir = tempdir();
    let mut relay = crate::procs::Proc::new(&bin_dir(), &dir, "relay", "postal", &["relay"])
        .env(&[
            ("DATABASE_URL", bouncer.url(&db.name)),
            ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ])
        .with_metrics();
    relay.start();
    let port = relay.metrics_port().unwrap();
    let started = Instant::now();
    let shown = || async {
        let readyz = crate::procs::http_get(port, "/readyz").unwrap_or_default();
        let metrics = crate::procs::http_get(port, "/metrics").unwrap_or_default();
        let waiting = metrics
            .lines()
            .find(|l| l.starts_with("postal_relay_claim_waiting_seconds"))
            .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        relay.logged("relay stalled")
            && readyz.lines().next().is_some_and(|l| l.contains(" 503"))
            && waiting >= postal_producer::STALL_AFTER.as_secs_f64()
    };
    wait::until(
        Duration::from_secs(60),
        "the stall in the log, /readyz and the metric",
        shown,
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(60));
    let log = std::fs::read_to_string(&relay.log).unwrap();
    let line = log.lines().find(|l| l.contains("relay stalled")).unwrap();
    assert!(
        line.contains("default_pool_size"),
        "says what to change: {line}"
    );
    // `postal status` (connected directly) shows the relay STALLED with the same line, as the
    // relay records it in its row of postal.relay_instances.
    let status = || {
        let out = std::process::Command::new(bin_dir().join("postal"))
            .arg("status")
            .env("DATABASE_URL", &db.url)
            .env_remove("KAFKA_BOOTSTRAP_SERVERS")
            .output()
            .expect("postal status runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    wait::until(
        Duration::from_secs(60),
        "the stall in postal status",
        || async {
            status().lines().any(|l| {
                let l = l.trim_start();
                l.starts_with("STALLED: ") && l.contains(" has waited")
            })
        },
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(90));
    // Killed: a stalled relay's graceful stop waits for its claims (up to twice
    // POSTAL_SHUTDOWN_TIMEOUT).
    relay.kill();
    std::fs::remove_dir_all(&dir).ok();
}

/// The value of the unlabelled metric `name` on `port`'s `/metrics` (0 when absent).
fn gauge(port: u16, name: &str) -> f64 {
    crate::procs::http_get(port, "/metrics")
        .unwrap_or_default()
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Guarantee (alert `PostalRelayClaimsWaiting`): a relay publishing a steady flow through a
/// session-mode PgBouncer that freezes (SIGSTOP: every connection stays open, nothing
/// answers) shows it within a minute of the freeze — one "relay stalled" line,
/// `postal_relay_claim_waiting_seconds` at 30 s or more and `/readyz` 503 — whatever its claim
/// path was waiting on when the pooler froze (a claim, or the commit recording a published
/// batch, which holds the slot the next claim needs); and once the pooler runs again the
/// relay says it resumes, the gauge falls to 0 and every event is published. (Before: the
/// gauge stayed 0 and no line was logged, because the waits were in the batches' commits
/// and the lanes waited for slots, not in a claim: the pooler soak's frozen cycle.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_pooler_shows_as_a_relay_stall_within_a_minute() {
    let Some(bin) = pgbouncer::binary("poolers::a_frozen_pooler_shows_as_a_relay_stall") else {
        return;
    };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = postal_integration_tests::unique("frozen");
    let bouncer = PgBouncer::start(&bin, &svc.database_url, PoolMode::Session, 20, &[]);
    let dir = tempdir();
    let mut relay = crate::procs::Proc::new(&bin_dir(), &dir, "relay", "postal", &["relay"])
        .env(&[
            ("DATABASE_URL", bouncer.url(&db.name)),
            ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
            ("RUST_LOG", "info,rdkafka=warn".into()),
        ])
        .with_metrics();
    relay.start();
    let port = relay.metrics_port().unwrap();
    // A steady flow, written straight to PostgreSQL (not through the pooler).
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let writer = {
        let (pool, topic, writing) = (db.pool.clone(), topic.clone(), writing.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while writing.load(std::sync::atomic::Ordering::SeqCst) {
                let events = (0..20)
                    .map(|i| {
                        NewEvent::json(topic.as_str(), format!("k{}", (n + i) % 64), "e", &(n + i))
                            .unwrap()
                    })
                    .collect();
                let mut conn = pool.acquire().await.unwrap();
                enqueue_batch(&mut conn, events).await.unwrap();
                drop(conn);
                n += 20;
                tokio::time::sleep(Duration::from_millis(20)).await; // the flow's pace
            }
            n
        })
    };
    let published = || gauge(port, "postal_relay_published_total");
    wait::until(Duration::from_secs(60), "the relay publishing", || async {
        published() >= 200.0
    })
    .await;
    bouncer.signal("STOP");
    let frozen = Instant::now();
    let stall = postal_producer::STALL_AFTER.as_secs_f64();
    let mut seen = Vec::new();
    let shown = loop {
        relay.assert_alive();
        let waiting = gauge(port, "postal_relay_claim_waiting_seconds");
        let not_ready = crate::procs::http_get(port, "/readyz")
            .unwrap_or_default()
            .lines()
            .next()
            .is_some_and(|l| l.contains(" 503"));
        let line = relay.logged("relay stalled");
        if seen.last().map(|s: &(u64, f64, bool, bool)| s.1) != Some(waiting) {
            seen.push((frozen.elapsed().as_secs(), waiting, not_ready, line));
        }
        if waiting >= stall && not_ready && line {
            break true;
        }
        if frozen.elapsed() > Duration::from_secs(60) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    bouncer.signal("CONT");
    assert!(
        shown,
        "within a minute of the freeze: the gauge at {stall}s or more, /readyz 503 and a 'relay stalled' line; seen (s, gauge, 503, line): {seen:?}"
    );
    let log = std::fs::read_to_string(&relay.log).unwrap();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("relay stalled"))
        .collect();
    assert_eq!(lines.len(), 1, "one line: {log}");
    assert!(
        lines[0].contains(" has waited "),
        "says what waits: {}",
        lines[0]
    );
    eprintln!(
        "shown {:.1}s after the freeze: {}",
        frozen.elapsed().as_secs_f64(),
        lines[0]
    );
    writing.store(false, std::sync::atomic::Ordering::SeqCst);
    let written = writer.await.unwrap();
    wait::until(
        Duration::from_secs(120),
        "every event published, the gauge at 0 and 'relay resumes' logged",
        || async {
            published() >= written as f64
                && gauge(port, "postal_relay_claim_waiting_seconds") == 0.0
                && relay.logged("relay resumes")
        },
    )
    .await;
    relay.stop();
    std::fs::remove_dir_all(&dir).ok();
}
