//! The embedded migrator. Postal's migrations live in the workspace's `migrations/` directory and
//! are compiled into this crate.

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
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("search_path", POSTAL_SCHEMA)]);
    // Serialise concurrent migrators from the very first statement (CREATE SCHEMA IF NOT
    // EXISTS races otherwise); the session lock goes away with its connection.
    let mut lock = PgConnection::connect_with(&options).await?;
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(MIGRATE_LOCK)
        .execute(&mut lock)
        .await?;
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
        let run = MIGRATOR.run(&pool).await;
        pool.close().await;
        run?;
        Ok::<(), Error>(())
    }
    .await;
    lock.close().await.ok();
    result?;
    tracing::debug!("postal schema is up to date");
    Ok(())
}
