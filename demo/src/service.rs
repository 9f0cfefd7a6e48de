//! Start-up pieces the services share (this package's binaries, and the integration suite's
//! `report_worker`, which the chaos, netsplit, cluster, monitoring and task suites run as real
//! processes): logging, typed environment values, and a database connection that waits for
//! PostgreSQL instead of failing (a long-running service started while the database restarts
//! should come up when it is back).

use std::future::Future;
use std::time::Duration;

use anyhow::Context;
use sqlx::{Connection, PgConnection, PgPool};

/// Logs through `tracing` as every Postal binary does (`postal_shared::init_logging`: filtered
/// by `POSTAL_LOG`, else `RUST_LOG`, else `default`; `POSTAL_LOG_FORMAT=json` for JSON lines).
/// An invalid `POSTAL_LOG_FORMAT` stops the service with its one-line error.
pub fn init_tracing(default: &str) {
    if let Err(e) = postal_shared::init_logging(default) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

/// A required environment variable, with a one-line error naming it.
pub fn env_required(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| format!("{name} is not set"))
}

/// An optional environment variable parsed as `T`, `default` when unset.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name}={v:?} is not valid")),
        Err(_) => Ok(default),
    }
}

/// How long [`connect`] waits for one connection before it counts the server as unreachable.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to PostgreSQL, applies Postal's migrations, then runs `setup` (the service's own
/// `CREATE TABLE IF NOT EXISTS …`; several statements allowed). While the server is unreachable
/// or restarting — also when it goes away halfway through — it waits and starts over, with a
/// log line every attempt (up to 5 s apart). A malformed URL, a refused login, a missing
/// database or a failing statement is an error at once. Instances starting together run
/// `setup` one at a time (two concurrent `CREATE TABLE IF NOT EXISTS` of one table can fail).
pub async fn connect(url: &str, setup: &str) -> anyhow::Result<PgPool> {
    let opts = postal_shared::secret::database_url_options(url)?;
    // One implicit transaction: the lock is held until `setup` is through.
    let setup =
        format!("SELECT pg_advisory_xact_lock(hashtext('postal_fixtures.setup'));\n{setup}");
    wait_out(
        "starting up",
        || start(&opts, &setup),
        // Another instance migrating for longer than the lock wait: wait on too.
        |e| e.is_unavailable() || matches!(e, postal_shared::Error::LockBusy { .. }),
    )
    .await
}

/// One attempt of [`connect`].
async fn start(
    opts: &sqlx::postgres::PgConnectOptions,
    setup: &str,
) -> Result<PgPool, postal_shared::Error> {
    // One connection first (at most 5 s): it fails at once while the server is down, where
    // the pool would retry quietly for its whole acquire timeout (30 s) before the first log
    // line.
    match tokio::time::timeout(PROBE_TIMEOUT, PgConnection::connect_with(opts)).await {
        Ok(Ok(c)) => {
            let _ = c.close().await;
        }
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => return Err(sqlx::Error::PoolTimedOut.into()),
    }
    let pool = PgPool::connect_with(opts.clone()).await?;
    postal_shared::migrate(&pool).await?;
    sqlx::raw_sql(setup).execute(&pool).await?;
    Ok(pool)
}

/// Runs `step` until it succeeds, waiting (with a log line, up to 5 s apart) while PostgreSQL is
/// unreachable; any other error is returned at once.
pub async fn retry_while_unreachable<T, F, Fut>(what: &str, step: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    wait_out(what, step, postal_shared::database_unavailable).await
}

/// Runs `step` until it succeeds, waiting while `outage` says its error means PostgreSQL is
/// unreachable (200 ms, doubling up to 5 s, a log line each time); any other error is
/// returned at once.
async fn wait_out<T, E, F, Fut>(
    what: &str,
    mut step: F,
    outage: impl Fn(&E) -> bool,
) -> anyhow::Result<T>
where
    E: std::error::Error + Send + Sync + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let backoff = postal_shared::Backoff {
        base: Duration::from_millis(200),
        max: Duration::from_secs(5),
    };
    let mut attempt = 0u32;
    loop {
        match step().await {
            Ok(v) => return Ok(v),
            Err(e) if outage(&e) => {
                let wait = backoff.ceiling(attempt);
                tracing::warn!(error = %e, "{what}: PostgreSQL unreachable; retrying in {wait:?}");
                tokio::time::sleep(wait).await;
                attempt = attempt.saturating_add(1);
            }
            Err(e) => return Err(anyhow::Error::new(e).context(what.to_owned())),
        }
    }
}
