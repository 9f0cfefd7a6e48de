//! The embedded migrator. Postal's migrations live in the workspace's `migrations/` directory and
//! are compiled into this crate.

use std::time::{Duration, Instant};

use sqlx::migrate::Migrator;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};

use crate::Error;

/// The PostgreSQL schema that holds every Postal object, including sqlx's bookkeeping table
/// (`postal._sqlx_migrations`), so Postal never collides with an application's own migrations.
pub const POSTAL_SCHEMA: &str = "postal";

/// Advisory lock key held while migrating (`'postalmg'` as a 64-bit integer).
const MIGRATE_LOCK: i64 = 0x706f_7374_616c_6d67;

/// Postal's migrations are additive, so a service built with an older Postal keeps working on a
/// schema that a newer one already migrated: the migrator ignores applied migrations it does not
/// know instead of refusing to start (services sharing one database upgrade one at a time).
static MIGRATOR: std::sync::LazyLock<Migrator> = std::sync::LazyLock::new(|| {
    let mut migrator = sqlx::migrate!("../migrations");
    migrator.set_ignore_missing(true);
    migrator
});

/// The embedded migrator, for callers that want to inspect the migrations.
/// Use [`migrate`] to apply them: it scopes the bookkeeping table to the `postal` schema.
pub fn migrator() -> &'static Migrator {
    &MIGRATOR
}

/// Creates the `postal` schema if needed and applies Postal's pending migrations. Running it
/// again (or from several processes at once) is a no-op once the schema is current.
///
/// The migrations run on a dedicated connection whose `search_path` is `postal`, so sqlx's
/// bookkeeping table is `postal._sqlx_migrations`, separate from the application's
/// `public._sqlx_migrations`.
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    migrate_within(pool, MIGRATE_LOCK_WAIT).await
}

/// How long [`migrate`] waits for the migration lock, held by another migrator (or by any
/// session that took the same advisory lock key), before it fails with [`Error::LockBusy`].
pub const MIGRATE_LOCK_WAIT: Duration = Duration::from_secs(60);

/// The longest one migration statement waits for a table lock (`lock_timeout`) before the
/// migration is rolled back and tried again (within [`MIGRATE_LOCK_WAIT`] in all).
pub const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether a migration failed because a lock was not granted within its `lock_timeout`.
fn lock_timed_out(e: &sqlx::migrate::MigrateError) -> bool {
    use sqlx::migrate::MigrateError;
    let (MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _)) = e else {
        return false;
    };
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}

/// [`migrate`], waiting at most `lock_wait` for the migration lock (and for table locks).
pub async fn migrate_within(pool: &PgPool, lock_wait: Duration) -> Result<(), Error> {
    let options = pool.connect_options().as_ref().clone().options([
        ("search_path", POSTAL_SCHEMA.to_owned()),
        (
            "lock_timeout",
            format!("{}ms", MIGRATION_LOCK_TIMEOUT.as_millis()),
        ),
    ]);
    // Serialise concurrent migrators from the very first statement (CREATE SCHEMA IF NOT
    // EXISTS races otherwise); the session lock goes away with its connection.
    let mut lock = PgConnection::connect_with(&options).await?;
    let started = Instant::now();
    let mut logged = false;
    loop {
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(MIGRATE_LOCK)
            .fetch_one(&mut lock)
            .await?;
        if got {
            break;
        }
        // Who holds it: a session lock on a bigint key is (classid, objid) = its high and
        // low 32 bits, objsubid 1.
        let holder: Option<(i32, String)> = sqlx::query_as(
            "SELECT l.pid, coalesce(a.application_name, '') FROM pg_locks l
             LEFT JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND l.classid = ($1 >> 32)::oid AND l.objid = ($1 & 4294967295)::oid
             LIMIT 1",
        )
        .bind(MIGRATE_LOCK)
        .fetch_optional(&mut lock)
        .await?;
        let holder = holder.map_or_else(
            || "a session that has just let it go".to_owned(),
            |(pid, app)| format!("backend pid {pid} ({})", crate::text::quoted(&app)),
        );
        if started.elapsed() >= lock_wait {
            lock.close().await.ok();
            return Err(Error::LockBusy {
                what: "Postal's migration lock",
                waited: lock_wait,
                holder,
            });
        }
        if !logged {
            tracing::info!(%holder, "waiting for Postal's migration lock (another migrator is running)");
            logged = true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let result = async {
        sqlx::query("CREATE SCHEMA IF NOT EXISTS postal")
            .execute(&mut lock)
            .await?;
        // A one-connection pool whose search_path is `postal`: sqlx's bookkeeping table
        // lands in the `postal` schema.
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await?;
        // A migration that needs a lock held by a long transaction (an open claim, a
        // `pg_dump`) gives up after `MIGRATION_LOCK_TIMEOUT` and is tried again, instead of
        // queueing its exclusive lock in front of every enqueue and claim meanwhile.
        let run = loop {
            match MIGRATOR.run(&pool).await {
                Err(e) if lock_timed_out(&e) && started.elapsed() < lock_wait => {
                    tracing::warn!(error = %e, "a migration waited {MIGRATION_LOCK_TIMEOUT:?} for a table lock (a long transaction holds it); trying again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                other => break other,
            }
        };
        pool.close().await;
        if let Err(e) = &run {
            if lock_timed_out(e) {
                return Err(Error::LockBusy {
                    what: "a table lock a migration needs",
                    waited: lock_wait,
                    holder: "a long transaction on Postal's tables (see pg_stat_activity)".into(),
                });
            }
        }
        run?;
        Ok::<(), Error>(())
    }
    .await;
    lock.close().await.ok();
    result?;
    tracing::debug!("postal schema is up to date");
    Ok(())
}
