//! The embedded migrator. Postal's migrations live in the workspace's `migrations/` directory
//! (linked as `shared/migrations`, so the packaged crate carries them) and are compiled into
//! this crate.

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
    let mut migrator = sqlx::migrate!("./migrations");
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

/// The longest one statement of a transactional migration waits for a table lock
/// (`lock_timeout`) before the migration is rolled back and tried again (within
/// [`MIGRATE_LOCK_WAIT`] in all). While it waits, the outbox's writers queue behind its
/// request: short, so that enqueue and claims are held up at most this long per attempt.
pub const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(1);

/// The pauses between attempts of a migration that timed out on a lock grow up to this, so
/// that a long transaction (a claim open for seconds) is outlasted without holding the
/// outbox's writers up for more than [`MIGRATION_LOCK_TIMEOUT`] at a time.
const MIGRATION_RETRY_PAUSE_MAX: Duration = Duration::from_secs(8);

/// Migration 9 (`outbox_pending_seq_partition`) as its SQL file has it builds the index and
/// drops the old one in one transaction, blocking every outbox write for the whole build. This
/// migrator does the same CONCURRENTLY instead (see [`concurrent_9`]) and records migration 9
/// with the file's checksum, so binaries of every release (which embed that file) accept it.
const CONCURRENT_VERSION: i64 = 9;

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

/// Versions applied (successfully) so far; empty before the first migration.
async fn applied(conn: &mut PgConnection) -> Result<Vec<i64>, sqlx::Error> {
    let exists: bool =
        sqlx::query_scalar("SELECT to_regclass('postal._sqlx_migrations') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    if !exists {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT version FROM postal._sqlx_migrations WHERE success")
        .fetch_all(&mut *conn)
        .await
}

/// Migration 9 without blocking writers: waits for an index build on the outbox that another
/// session still runs (a killed migrator's backend goes on building), drops the invalid index
/// an interrupted build left (`IF NOT EXISTS` would keep it), builds the index and drops the
/// old one CONCURRENTLY (each waits for open claims to end without blocking anyone), then
/// records migration 9 as sqlx would. Runs on a connection without `lock_timeout`.
async fn concurrent_9(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    let started = Instant::now();
    let mut logged = false;
    loop {
        let building: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_progress_create_index
             WHERE relid = 'postal.outbox'::regclass AND pid <> pg_backend_pid()
               AND datid = (SELECT oid FROM pg_database WHERE datname = current_database()))",
        )
        .fetch_one(&mut *conn)
        .await?;
        if !building {
            break;
        }
        if !logged {
            tracing::info!("waiting for an index build on postal.outbox that another session runs");
            logged = true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let invalid: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_index
         WHERE indexrelid = to_regclass('postal.outbox_pending_seq_partition')
           AND NOT indisvalid)",
    )
    .fetch_one(&mut *conn)
    .await?;
    if invalid {
        tracing::info!("dropping the invalid index an interrupted build of migration 9 left");
        sqlx::query("DROP INDEX CONCURRENTLY IF EXISTS postal.outbox_pending_seq_partition")
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query(
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_pending_seq_partition
         ON postal.outbox (seq, key_partition) WHERE status = 'pending'",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query("DROP INDEX CONCURRENTLY IF EXISTS postal.outbox_pending_seq")
        .execute(&mut *conn)
        .await?;
    let m = MIGRATOR
        .iter()
        .find(|m| m.version == CONCURRENT_VERSION)
        .expect("migration 9 is embedded");
    sqlx::query(
        "INSERT INTO postal._sqlx_migrations
             (version, description, success, checksum, execution_time)
         VALUES ($1, $2, true, $3, $4) ON CONFLICT (version) DO NOTHING",
    )
    .bind(m.version)
    .bind(&*m.description)
    .bind(m.checksum.as_ref())
    .bind(i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The embedded migrations up to and including `last`, as a migrator of their own.
fn up_to(last: i64) -> Migrator {
    let mut m = Migrator::DEFAULT;
    m.migrations = MIGRATOR
        .iter()
        .filter(|m| m.version <= last)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    m.set_ignore_missing(true);
    // Migrators are serialised by Postal's own lock (held on a connection of its own). sqlx's
    // lock is a session lock it does not release when a migration fails: the connection of
    // the transactional runs would keep it and the concurrent run on the other would wait on
    // it forever.
    m.locking = false;
    m
}

/// Applies the pending migrations: the transactional ones on `pool` (short `lock_timeout`), in
/// runs up to migration 9, which [`concurrent_9`] applies on `wait` (no `lock_timeout`: a
/// concurrent index build blocks nobody while it waits for open transactions to end). With
/// nothing pending, sqlx still checks the applied migrations (a modified or failed one).
async fn apply(
    lock: &mut PgConnection,
    pool: &PgPool,
    wait: &PgPool,
) -> Result<(), sqlx::migrate::MigrateError> {
    loop {
        let done = applied(lock).await?;
        let pending: Vec<&sqlx::migrate::Migration> = MIGRATOR
            .iter()
            .filter(|m| !done.contains(&m.version))
            .collect();
        let Some(first) = pending.first() else {
            return up_to(i64::MAX).run(pool).await;
        };
        if first.version == CONCURRENT_VERSION {
            concurrent_9(&mut *wait.acquire().await?).await?;
        } else {
            let last = pending
                .iter()
                .take_while(|m| m.version != CONCURRENT_VERSION)
                .last()
                .map_or(first.version, |m| m.version);
            up_to(last).run(pool).await?;
            if !applied(lock).await?.contains(&last) {
                // sqlx recorded it elsewhere (a search_path that is not `postal`): stop
                // instead of applying it again and again.
                return Err(sqlx::migrate::MigrateError::Execute(sqlx::Error::Protocol(
                    format!("migration {last} ran but postal._sqlx_migrations does not record it"),
                )));
            }
        }
    }
}

/// What a migrator's connection resets before it closes: a session pooler hands its server
/// session to the next client (PgBouncer runs `server_reset_query`, `DISCARD ALL`, too; this
/// does not count on it).
const RESET: &str = "RESET search_path; RESET lock_timeout; RESET client_min_messages";

/// Makes `conn`'s session a migrator's: `search_path` `postal` (sqlx's bookkeeping table is
/// `postal._sqlx_migrations`), `lock_timeout`, and `client_min_messages = warning` (the
/// notices of `CREATE … IF NOT EXISTS` on every start — `schema "postal" already exists,
/// skipping` — are not news; sqlx would log each); then checks that the first two took.
async fn postal_session(
    conn: &mut PgConnection,
    lock_timeout: Duration,
) -> Result<(), sqlx::Error> {
    use sqlx::{Executor as _, Row as _};
    let set = format!(
        "SET search_path = {POSTAL_SCHEMA}; SET lock_timeout = '{}ms'; SET client_min_messages = warning",
        lock_timeout.as_millis()
    );
    conn.execute(set.as_str()).await?;
    let path: String = conn.fetch_one("SHOW search_path").await?.try_get(0)?;
    if path != POSTAL_SCHEMA {
        return Err(sqlx::Error::Protocol(format!(
            "the migrator's search_path did not take (it is {path:?}): is a pooler in between rewriting sessions?"
        )));
    }
    Ok(())
}

/// A one-connection pool whose connection is a migrator's ([`postal_session`]).
async fn session_pool(
    options: &sqlx::postgres::PgConnectOptions,
    lock_timeout: Duration,
) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            Box::pin(async move { postal_session(conn, lock_timeout).await })
        })
        .connect_with(options.clone())
        .await
}

/// Resets the session of `pool`'s connection ([`RESET`]) and closes it.
async fn reset_and_close(pool: PgPool) {
    if let Ok(mut conn) = pool.acquire().await {
        if sqlx::Executor::execute(&mut *conn, RESET).await.is_err() {
            // Not reset: closed rather than handed back.
            conn.detach().close().await.ok();
        }
    }
    pool.close().await;
}

/// [`migrate`], waiting at most `lock_wait` for the migration lock (and for table locks).
pub async fn migrate_within(pool: &PgPool, lock_wait: Duration) -> Result<(), Error> {
    // A transaction pooler would run the statements of one migration run on different server
    // sessions (the search_path below, the migration lock): refused with one line, and so is
    // a pooler too busy for the probe to tell.
    crate::pooler::require_known_session(pool).await?;
    // No startup `options` (PgBouncer refuses them, or drops them when told to ignore them,
    // and sqlx's bookkeeping would then land in `public`): each connection sets its session
    // after connecting, checks it took, and resets it before it closes (see `session`).
    let options = pool.connect_options().as_ref().clone();
    // Serialise concurrent migrators from the very first statement (CREATE SCHEMA IF NOT
    // EXISTS races otherwise); the session lock goes away with its connection.
    let mut lock = PgConnection::connect_with(&options).await?;
    postal_session(&mut lock, MIGRATION_LOCK_TIMEOUT).await?;
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
            if sqlx::Executor::execute(&mut lock, RESET).await.is_ok() {
                lock.close().await.ok();
            }
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
        // One-connection pools whose search_path is `postal`: sqlx's bookkeeping table lands
        // in the `postal` schema. `wait` has no lock timeout (concurrent index builds).
        let pool = session_pool(&options, MIGRATION_LOCK_TIMEOUT).await?;
        let wait = session_pool(&options, Duration::ZERO).await?;
        // A migration that needs a lock held by a long transaction (an open claim, a
        // `pg_dump`) gives up after `MIGRATION_LOCK_TIMEOUT` and is tried again after a
        // growing pause, instead of queueing its exclusive lock in front of every enqueue and
        // claim meanwhile.
        let mut pause = Duration::from_secs(1);
        let run = loop {
            match apply(&mut lock, &pool, &wait).await {
                Err(e) if lock_timed_out(&e) && started.elapsed() < lock_wait => {
                    tracing::warn!(error = %e, "a migration waited {MIGRATION_LOCK_TIMEOUT:?} for a table lock (a long transaction holds it); trying again in {pause:?}");
                    tokio::time::sleep(pause.min(lock_wait.saturating_sub(started.elapsed()))).await;
                    pause = (pause * 2).min(MIGRATION_RETRY_PAUSE_MAX);
                }
                other => break other,
            }
        };
        reset_and_close(wait).await;
        reset_and_close(pool).await;
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
    if sqlx::Executor::execute(&mut lock, RESET).await.is_ok() {
        lock.close().await.ok();
    }
    result?;
    tracing::debug!("postal schema is up to date");
    Ok(())
}
