//! Schema: Postal's objects and migration bookkeeping stay in the `postal` schema.

use postal_integration_tests::services;

static APP_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("tests/app_migrations");

/// Guarantee: an application with its own sqlx migrations and Postal's migrations can run both,
/// in either order, twice, without either seeing the other's bookkeeping.
#[tokio::test]
async fn app_and_postal_migrations_coexist_and_rerun_as_no_ops() {
    let db = services().await.empty_db().await;
    APP_MIGRATOR.run(&db.pool).await.expect("app migrations");
    postal_shared::migrate(&db.pool)
        .await
        .expect("postal migrations");
    // Twice, in the other order: no-ops.
    postal_shared::migrate(&db.pool)
        .await
        .expect("postal migrations again");
    APP_MIGRATOR
        .run(&db.pool)
        .await
        .expect("app migrations again");

    let app_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM public._sqlx_migrations")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let postal_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM postal._sqlx_migrations")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        app_rows, 1,
        "public bookkeeping holds only the app's migration"
    );
    assert_eq!(
        postal_rows as usize,
        postal_shared::migrator().iter().count(),
        "postal bookkeeping holds exactly Postal's migrations"
    );
    // Postal's tables are in `postal`, the app's in `public`.
    let misplaced: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables
         WHERE table_schema = 'public' AND table_name IN ('outbox', 'processed_events')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(misplaced, 0);
    let pk: Vec<String> = sqlx::query_scalar(
        "SELECT a.attname FROM pg_index i
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
         WHERE i.indrelid = 'postal.processed_events'::regclass AND i.indisprimary ORDER BY a.attname",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(pk, vec!["consumer_name".to_owned(), "event_id".to_owned()]);
}

/// Guarantee: several processes migrating at once all succeed and leave one schema.
#[tokio::test]
async fn concurrent_migrations_are_safe() {
    let db = services().await.empty_db().await;
    let runs = (0..4).map(|_| {
        let pool = db.pool.clone();
        tokio::spawn(async move { postal_shared::migrate(&pool).await })
    });
    for r in futures::future::join_all(runs).await {
        r.unwrap().expect("concurrent migrate");
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM postal._sqlx_migrations")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n as usize, postal_shared::migrator().iter().count());
}

/// Guarantee: a service built with an older Postal still starts on a schema that a newer Postal
/// already migrated (services sharing a database upgrade one at a time): migrations it does not
/// know are ignored, not an error.
#[tokio::test]
async fn older_postal_starts_on_a_newer_schema() {
    let db = services().await.empty_db().await;
    postal_shared::migrate(&db.pool)
        .await
        .expect("postal migrations");
    // What a newer Postal would leave behind: one more applied migration.
    sqlx::query(
        "INSERT INTO postal._sqlx_migrations
             (version, description, success, checksum, execution_time)
         VALUES (99990101000000, 'from a newer postal', true, '\\x00'::bytea, 1)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    postal_shared::migrate(&db.pool)
        .await
        .expect("an older migrator accepts a newer schema");
}

/// Guarantee: a session that holds Postal's migration lock (any login can take an advisory
/// lock) stalls a migrator only for a bounded time: it then fails with one line naming the
/// holder's backend pid, and succeeds once the lock is free. Before, it waited without end.
#[tokio::test]
async fn a_held_migration_lock_is_waited_for_a_bounded_time_naming_the_holder() {
    let db = services().await.fresh_db().await;
    let mut squatter = db.pool.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *squatter)
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock(x'706f7374616c6d67'::bigint)")
        .execute(&mut *squatter)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let err = postal_shared::migrate_within(&db.pool, std::time::Duration::from_secs(1))
        .await
        .expect_err("the lock is held");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    let shown = err.to_string();
    assert!(
        matches!(err, postal_shared::Error::LockBusy { .. }),
        "{shown}"
    );
    assert!(shown.contains(&format!("backend pid {pid}")), "{shown}");
    assert!(!shown.contains('\n'), "{shown}");
    sqlx::query("SELECT pg_advisory_unlock(x'706f7374616c6d67'::bigint)")
        .execute(&mut *squatter)
        .await
        .unwrap();
    postal_shared::migrate_within(&db.pool, std::time::Duration::from_secs(1))
        .await
        .expect("migrates once the lock is free");
}

/// Guarantee: a long transaction holding a table a migration needs (here sqlx's bookkeeping
/// table, locked exclusively) makes the migrator give up each try after its `lock_timeout`
/// and fail after its wait with one line, instead of waiting behind the transaction for as
/// long as it runs (with its own exclusive lock queued in front of every enqueue and claim
/// meanwhile); once the transaction ends, migrating succeeds.
#[tokio::test]
async fn a_migration_behind_a_long_transaction_gives_up_after_its_lock_timeout() {
    let db = services().await.fresh_db().await;
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE postal._sqlx_migrations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        postal_shared::migrate_within(&db.pool, std::time::Duration::from_secs(1)),
    )
    .await
    .expect("the migrator returns while the transaction still runs")
    .expect_err("the table is locked");
    let shown = err.to_string();
    assert!(
        matches!(err, postal_shared::Error::LockBusy { .. }),
        "{shown}"
    );
    assert!(!shown.contains('\n'), "{shown}");
    holder.rollback().await.unwrap();
    postal_shared::migrate_within(&db.pool, std::time::Duration::from_secs(1))
        .await
        .expect("migrates once the transaction ended");
}

/// Runs a relay (a transport that is never reached) on `pool` until it stops by itself; the
/// error it stopped with.
async fn relay_refusal(pool: &sqlx::PgPool) -> String {
    let transport = crate::common::kafka_transport("127.0.0.1:9");
    let relay =
        postal_producer::Relay::new(pool.clone(), transport, crate::common::fast_config()).unwrap();
    let stopped = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        relay.run(std::future::pending()),
    )
    .await
    .expect("the relay stops by itself");
    stopped.expect_err("the relay refuses to run").to_string()
}

/// Guarantee (the upgrade contract, checked at start): a relay refuses, with one line saying
/// what to do, a database without Postal's schema, a schema that lacks a migration it needs,
/// and a schema whose contract admits only newer binaries; it runs on a schema with a newer
/// additive migration it does not know. (Before, a relay on a database without the schema
/// logged "cannot renew partition leases (database unreachable?)" every two seconds, for
/// good, and nothing checked versions.)
#[tokio::test]
async fn a_relay_checks_the_schema_against_the_upgrade_contract_at_start() {
    let svc = services().await;
    let bare = postal_integration_tests::create_db(&svc.database_url).await;
    let missing = relay_refusal(&bare.pool).await;
    assert!(
        missing.contains("Postal's schema is missing in database")
            && missing.contains("postal migrate"),
        "{missing}"
    );
    assert!(!missing.contains('\n'), "{missing}");

    let db = svc.fresh_db().await;
    let known = postal_shared::known_version();
    sqlx::query("DELETE FROM postal._sqlx_migrations WHERE version = $1")
        .bind(known)
        .execute(&db.pool)
        .await
        .unwrap();
    // The migration before it (numbers may skip: branches take theirs ahead of merging).
    let previous: i64 = sqlx::query_scalar("SELECT max(version) FROM postal._sqlx_migrations")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let behind = relay_refusal(&db.pool).await;
    assert!(
        behind.contains(&format!("at migration {previous}"))
            && behind.contains(&format!("needs migration {known}"))
            && behind.contains("postal migrate"),
        "{behind}"
    );

    // A newer additive migration this binary does not know: fine.
    let db = svc.fresh_db().await;
    sqlx::query(
        "INSERT INTO postal._sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES ($1, 'a newer additive migration', true, '\\x00', 0)",
    )
    .bind(known + 1)
    .execute(&db.pool)
    .await
    .unwrap();
    postal_shared::check_schema(&db.pool)
        .await
        .expect("a newer additive schema admits this binary");

    // A newer migration that older binaries must not run on.
    sqlx::query("UPDATE postal.schema_contract SET oldest_compatible = $1")
        .bind(known + 1)
        .execute(&db.pool)
        .await
        .unwrap();
    let too_new = relay_refusal(&db.pool).await;
    assert!(
        too_new.contains(&format!("know migration {} or later", known + 1))
            && too_new.contains("upgrade it"),
        "{too_new}"
    );
}
