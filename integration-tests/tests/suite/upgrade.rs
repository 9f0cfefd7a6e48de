//! Upgrades while the outbox is in use: every migration applied under enqueues and open claims,
//! and the ways migration 9's concurrent index build can meet an earlier or unfinished one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postal_integration_tests::{services, wait};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// Applies Postal's migrations up to and including `last` (as an older release would have),
/// with the bookkeeping in the `postal` schema as `postal_shared::migrate` keeps it.
pub(crate) async fn migrate_until(pool: &PgPool, last: i64) {
    sqlx::query("CREATE SCHEMA IF NOT EXISTS postal")
        .execute(pool)
        .await
        .unwrap();
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("search_path", "postal")]);
    let one = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    let mut m = sqlx::migrate::Migrator::DEFAULT;
    m.migrations = postal_shared::migrator()
        .iter()
        .filter(|m| m.version <= last)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    m.run(&one).await.unwrap();
    one.close().await;
}

/// The worst latencies the load saw, and its errors.
#[derive(Default, Debug)]
struct Seen {
    enqueue_max: Duration,
    enqueues: u64,
    claim_max: Duration,
    claims: u64,
    long_claims: u64,
    errors: Vec<String>,
}

/// The outbox in use, with SQL every schema version since migration 1 accepts: a writer
/// enqueuing every 10 ms on `topic` (event `n`, 1, 2, …, on key `k{n % 16}`, its payload
/// `{"order_id": n, "customer": "k{n % 16}", "seq": n / 16}`, the key's events numbered in
/// order, as `procs::check_wire` reads them), a claimer taking and deleting small batches
/// every 10 ms (a relay's claims), and a long claim that holds rows locked for 1.5 s at a time
/// (a batch waiting on a slow broker). The writer runs until `stop`, the claims until
/// `claims_stop`. With `wal` (the rows are a WAL relay's to publish) there is no claimer, and
/// the long claim gives its rows back (rolls back) instead of deleting them.
async fn load(
    pool: PgPool,
    topic: String,
    wal: bool,
    stop: Arc<AtomicBool>,
    claims_stop: Arc<AtomicBool>,
    started: tokio::sync::oneshot::Sender<()>,
) -> Seen {
    let seen = Arc::new(std::sync::Mutex::new(Seen::default()));
    let failed = |seen: &std::sync::Mutex<Seen>, what: &str, e: sqlx::Error| {
        seen.lock().unwrap().errors.push(format!("{what}: {e}"));
    };
    let writer = {
        let (pool, stop, seen) = (pool.clone(), stop.clone(), seen.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                n += 1;
                let t = Instant::now();
                let key = format!("k{}", n % 16);
                let payload =
                    serde_json::json!({"order_id": n, "customer": key, "seq": n / 16}).to_string();
                let r = sqlx::query(
                    "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload)
                     VALUES ($1, $2, $3, 'e', $4)",
                )
                .bind(uuid::Uuid::now_v7())
                .bind(&topic)
                .bind(&key)
                .bind(payload.into_bytes())
                .execute(&pool)
                .await;
                match r {
                    Ok(_) => {
                        let mut s = seen.lock().unwrap();
                        s.enqueue_max = s.enqueue_max.max(t.elapsed());
                        s.enqueues += 1;
                    }
                    Err(e) => failed(&seen, "enqueue", e),
                }
            }
        })
    };
    let claim = {
        let (pool, stop, seen) = (pool.clone(), claims_stop.clone(), seen.clone());
        move |limit: i64,
              hold: Duration,
              long: bool,
              held: Option<tokio::sync::oneshot::Sender<()>>| {
            let (pool, stop, seen) = (pool.clone(), stop.clone(), seen.clone());
            async move {
                let t = Instant::now();
                let r = async {
                    let mut tx = pool.begin().await?;
                    let seqs: Vec<i64> = sqlx::query_scalar(
                        "SELECT seq FROM postal.outbox WHERE status = 'pending'
                     ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
                    )
                    .bind(limit)
                    .fetch_all(&mut *tx)
                    .await?;
                    if let Some(held) = held {
                        let _ = held.send(());
                    }
                    if !hold.is_zero() && !stop.load(Ordering::Relaxed) {
                        tokio::time::sleep(hold).await;
                    }
                    if wal {
                        return tx.rollback().await;
                    }
                    sqlx::query("DELETE FROM postal.outbox WHERE seq = ANY($1)")
                        .bind(&seqs)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await
                }
                .await;
                match r {
                    Ok(()) => {
                        let mut s = seen.lock().unwrap();
                        if long {
                            s.long_claims += 1;
                        } else {
                            s.claim_max = s.claim_max.max(t.elapsed());
                            s.claims += 1;
                        }
                    }
                    Err(e) => failed(&seen, if long { "long claim" } else { "claim" }, e),
                }
            }
        }
    };
    let claimer = {
        let stop = claims_stop.clone();
        let claim = claim.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while !wal && !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                claim(20, Duration::ZERO, false, None).await;
            }
        })
    };
    let long = {
        let stop = claims_stop.clone();
        tokio::spawn(async move {
            let mut started = Some(started);
            while !stop.load(Ordering::Relaxed) {
                claim(5, Duration::from_millis(1500), true, started.take()).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    for t in [writer, claimer, long] {
        t.await.unwrap();
    }
    Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
}

/// Guarantee (upgrades without outages): starting from earlier schema versions, upgrading
/// to the current one while the outbox is in use — enqueues and short claims every 10 ms, and
/// a claim holding outbox rows for 1.5 s at a time — succeeds, with no error (no deadlock, no
/// lock timeout) in any of those sessions, and never holds an enqueue or a claim up for more
/// than 2.5 s: each transactional migration waits at most `MIGRATION_LOCK_TIMEOUT` (1 s) for a
/// table lock with the writers queued behind it, then lets them through and tries again; the
/// index migrations build and drop CONCURRENTLY. (Before: a 5 s lock timeout held writers up
/// to 5 s per try, and migration 0009 blocked outbox writes for its whole index build and
/// could deadlock with a claim's UPDATE.) Prints each path's worst latencies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_migration_applied_under_load_keeps_enqueue_and_claims_moving() {
    let svc = services().await;
    let known = postal_shared::known_version();
    let mut report = Vec::new();
    // From the first migration (every later one applied under load), from before the outbox
    // ALTER of 0012, and from the previous release (15).
    for from in [1, 11, 15] {
        assert!(from < known);
        let db = svc.empty_db().await;
        migrate_until(&db.pool, from).await;
        let load_pool = db.pool_of(4).await;
        let stop = Arc::new(AtomicBool::new(false));
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let running = tokio::spawn(load(
            load_pool,
            "upgrade".into(),
            false,
            stop.clone(),
            stop.clone(),
            started_tx,
        ));
        // The long claim holds its rows: the migration meets it.
        started.await.unwrap();
        let t = Instant::now();
        let migrated = postal_shared::migrate(&db.pool).await;
        let took = t.elapsed();
        stop.store(true, Ordering::Relaxed);
        let seen = running.await.unwrap();
        migrated.unwrap_or_else(|e| panic!("upgrade from migration {from}: {e}"));
        assert!(
            seen.errors.is_empty(),
            "upgrade from migration {from}: the load failed: {:?}",
            seen.errors
        );
        assert!(
            seen.enqueues > 0 && seen.claims > 0 && seen.long_claims > 0,
            "{seen:?}"
        );
        let bound = Duration::from_millis(2500);
        assert!(
            seen.enqueue_max < bound && seen.claim_max < bound,
            "upgrade from migration {from} (took {took:?}) held the outbox up: {seen:?}"
        );
        report.push(format!(
            "from {from:>2}: upgrade {:>6.0} ms, enqueue max {:>5.0} ms ({} enqueues), claim max {:>5.0} ms ({} claims)",
            took.as_secs_f64() * 1e3,
            seen.enqueue_max.as_secs_f64() * 1e3,
            seen.enqueues,
            seen.claim_max.as_secs_f64() * 1e3,
            seen.claims
        ));
    }
    eprintln!("upgrades under load:\n{}", report.join("\n"));
}

/// Guarantee (upgrades without outages, WAL mode): a WAL deployment's slot and publication,
/// created as soon as the outbox exists (on schemas of migrations 1, 11 and 15), survive the
/// upgrade to the current schema under load — enqueues every 10 ms, and a claim holding outbox
/// rows for 1.5 s at a time — with no error in those sessions and no enqueue held up for 2.5 s
/// or more; and this release's WAL relay, started the moment the upgrade returns (it refuses a
/// schema behind its own, so none runs during it), publishes from the slot every event, those
/// enqueued during the upgrade (written under older forms of the outbox: from 1 and 11 across
/// migration 12's `ALTER TABLE postal.outbox`) and those enqueued meanwhile: publishing catches
/// up while enqueues go on, nothing is lost, and each key's events are first delivered in
/// order (read back by an independent client). Prints each path's worst latencies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_migration_applied_under_load_keeps_enqueue_and_claims_moving_wal() {
    let svc = services().await;
    let known = postal_shared::known_version();
    let mut report = Vec::new();
    for from in [1, 11, 15] {
        assert!(from < known);
        let db = svc.empty_db().await;
        migrate_until(&db.pool, from).await;
        // The outbox exists (migration 1): its publication and the slot, before any row, so
        // that every event is in the stream, and before the upgrade, which runs under them.
        let slot = crate::wal_relay::Slot::create(&db).await;
        let topic = postal_integration_tests::unique("upgrade-wal");
        crate::common::create_topic(&svc.bootstrap, &topic, 4).await;
        let load_pool = db.pool_of(4).await;
        let (stop, claims_stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let running = tokio::spawn(load(
            load_pool,
            topic.clone(),
            true,
            stop.clone(),
            claims_stop.clone(),
            started_tx,
        ));
        // The long claim holds its rows: the migration meets it.
        started.await.unwrap();
        let t = Instant::now();
        let migrated = postal_shared::migrate(&db.pool).await;
        let took = t.elapsed();
        // The long claim was there for the upgrade to meet; the writer goes on.
        claims_stop.store(true, Ordering::Relaxed);
        if let Err(e) = migrated {
            stop.store(true, Ordering::Relaxed);
            panic!("upgrade from migration {from}: {e}");
        }
        let relay = crate::common::RunningRelay::start(
            &db.pool,
            crate::common::kafka_transport(&svc.bootstrap),
            slot.config(),
        );
        // Publishing moves while enqueues go on: every event enqueued during the upgrade
        // (up to the highest `seq` now) is published, and the writer still writes.
        let t = Instant::now();
        let upgraded: i64 = sqlx::query_scalar("SELECT max(seq) FROM postal.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let pool = db.pool.clone();
        wait::until(
            Duration::from_secs(90),
            &format!("upgrade from {from}: the events enqueued during the upgrade published"),
            || {
                let pool = pool.clone();
                async move {
                    let left: i64 =
                        sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE seq <= $1")
                            .bind(upgraded)
                            .fetch_one(&pool)
                            .await
                            .unwrap();
                    left == 0
                }
            },
        )
        .await;
        let caught_up = t.elapsed();
        stop.store(true, Ordering::Relaxed);
        let seen = running.await.unwrap();
        assert!(
            seen.errors.is_empty(),
            "upgrade from migration {from}: the load failed: {:?}",
            seen.errors
        );
        assert!(seen.enqueues > 0 && seen.long_claims > 0, "{seen:?}");
        let bound = Duration::from_millis(2500);
        assert!(
            seen.enqueue_max < bound,
            "upgrade from migration {from} (took {took:?}) held the outbox up: {seen:?}"
        );
        wait::until(
            Duration::from_secs(90),
            &format!("upgrade from {from}: the outbox drained"),
            || {
                let pool = pool.clone();
                async move { crate::common::outbox_count(&pool).await == 0 }
            },
        )
        .await;
        let stats = relay.stop().await;
        let want: std::collections::BTreeSet<String> =
            (1..=seen.enqueues).map(|n| n.to_string()).collect();
        let wire = crate::procs::check_wire(&svc.bootstrap, &topic, want.len() as i64, &want).await;
        assert_eq!(
            wire.missing, 0,
            "upgrade from migration {from}: events missing from the topic ({} enqueued, {} distinct on it)",
            want.len(),
            wire.distinct
        );
        assert!(
            wire.out_of_order.is_empty(),
            "upgrade from migration {from}: {:?}",
            &wire.out_of_order[..wire.out_of_order.len().min(5)]
        );
        report.push(format!(
            "from {from:>2}: upgrade {:>6.0} ms, enqueue max {:>5.0} ms ({} enqueues, up to seq {} during the upgrade), published {} ({} records), caught up {:>5.0} ms after the upgrade",
            took.as_secs_f64() * 1e3,
            seen.enqueue_max.as_secs_f64() * 1e3,
            seen.enqueues,
            upgraded,
            stats.published,
            wire.records,
            caught_up.as_secs_f64() * 1e3,
        ));
        drop(slot);
    }
    eprintln!("upgrades under load, WAL relay:\n{}", report.join("\n"));
}

/// The pending index's state: (name, valid) of each index on the outbox whose name starts
/// with `outbox_pending`.
async fn pending_indexes(pool: &PgPool) -> Vec<(String, bool)> {
    sqlx::query_as(
        "SELECT c.relname::text, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid = 'postal.outbox'::regclass AND c.relname LIKE 'outbox_pending%'
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Guarantee: migration 9, which this migrator applies CONCURRENTLY, meets every earlier state:
/// a database where an earlier release ran its file (one transaction) upgrades; the concurrent
/// form records the file's checksum (earlier releases' migrators, which embed that file,
/// accept the schema: `previous_release` runs one); an interrupted build's INVALID index is
/// replaced by a valid one (not kept by `IF NOT EXISTS`); and a build another session still
/// runs (a killed migrator's backend goes on) is waited for, not dropped under it (before:
/// "tuple concurrently updated", and `postal relay --migrate` exited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_9_meets_earlier_interrupted_and_unfinished_builds() {
    let svc = services().await;

    // The file's form, as an earlier release ran it: its statements and its checksum.
    let db = svc.empty_db().await;
    migrate_until(&db.pool, 8).await;
    sqlx::query(
        "CREATE INDEX outbox_pending_seq_partition ON postal.outbox (seq, key_partition)
         WHERE status = 'pending'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("DROP INDEX postal.outbox_pending_seq")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO postal._sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (9, 'pending index with partition', true,
                 decode('3bf1f5b4163184149feda832e7ef1c31fc0ea0185be7eeb9b7854d8b7892aff8c859e71ea868ffdf0e973ffdec236c9a', 'hex'), 1)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    postal_shared::migrate(&db.pool)
        .await
        .expect("a database where an earlier release ran 0009 upgrades");
    assert_eq!(
        pending_indexes(&db.pool).await,
        vec![("outbox_pending_seq_partition".to_owned(), true)]
    );
    postal_shared::check_schema(&db.pool).await.unwrap();

    // An interrupted concurrent build: it timed out waiting for an open claim.
    let db = svc.empty_db().await;
    migrate_until(&db.pool, 8).await;
    let mut claim = db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload)
         VALUES ($1, 't', 'k', 'e', '\\x00')",
    )
    .bind(uuid::Uuid::now_v7())
    .execute(&mut *claim)
    .await
    .unwrap();
    let mut builder = db.pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '300ms'")
        .execute(&mut *builder)
        .await
        .unwrap();
    let interrupted = sqlx::query(
        "CREATE INDEX CONCURRENTLY outbox_pending_seq_partition ON postal.outbox (seq, key_partition)
         WHERE status = 'pending'",
    )
    .execute(&mut *builder)
    .await;
    assert!(interrupted.is_err(), "the build waits for the open claim");
    sqlx::query("RESET lock_timeout")
        .execute(&mut *builder)
        .await
        .unwrap();
    drop(builder);
    claim.commit().await.unwrap();
    assert!(pending_indexes(&db.pool)
        .await
        .contains(&("outbox_pending_seq_partition".to_owned(), false)));
    postal_shared::migrate(&db.pool)
        .await
        .expect("upgrades after an interrupted build");
    assert_eq!(
        pending_indexes(&db.pool).await,
        vec![("outbox_pending_seq_partition".to_owned(), true)]
    );
    let recorded: String = sqlx::query_scalar(
        "SELECT encode(checksum, 'hex') FROM postal._sqlx_migrations WHERE version = 9",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let file = postal_shared::migrator()
        .iter()
        .find(|m| m.version == 9)
        .unwrap()
        .checksum
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>();
    assert_eq!(
        recorded, file,
        "migration 9 recorded with its file's checksum"
    );

    // A build another session still runs: it waits on an open claim while the migrator starts.
    let db = svc.empty_db().await;
    migrate_until(&db.pool, 8).await;
    let mut claim = db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload)
         VALUES ($1, 't', 'k', 'e', '\\x00')",
    )
    .bind(uuid::Uuid::now_v7())
    .execute(&mut *claim)
    .await
    .unwrap();
    let pool = db.pool.clone();
    let other = tokio::spawn(async move {
        sqlx::query(
            "CREATE INDEX CONCURRENTLY outbox_pending_seq_partition ON postal.outbox (seq, key_partition)
             WHERE status = 'pending'",
        )
        .execute(&pool)
        .await
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_stat_progress_create_index WHERE relid = 'postal.outbox'::regclass")
        .fetch_one(&db.pool)
        .await
        .unwrap()
        == 0
    {
        assert!(Instant::now() < deadline, "the other build never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pool = db.pool.clone();
    let migrating = tokio::spawn(async move { postal_shared::migrate(&pool).await });
    // The migrator waits for the other build, which waits for the claim.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    claim.commit().await.unwrap();
    other
        .await
        .unwrap()
        .expect("the other session's build completes");
    migrating
        .await
        .unwrap()
        .expect("the migrator waits for the other build instead of dropping its index");
    assert_eq!(
        pending_indexes(&db.pool).await,
        vec![("outbox_pending_seq_partition".to_owned(), true)]
    );
}
