//! Start-up pieces the example services share: logging, typed environment values, and a
//! database connection that waits for PostgreSQL instead of failing (a long-running service
//! started while the database restarts should come up when it is back).

use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;

/// Logs through `tracing`, filtered by `RUST_LOG` (else `default`).
pub fn init_tracing(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default.into()),
        )
        .init();
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

/// Connects to PostgreSQL, waiting (with a log line every attempt, up to 5 s apart) while the
/// server is unreachable, then applies Postal's migrations. A malformed URL fails at once.
pub async fn connect(url: &str) -> anyhow::Result<PgPool> {
    let opts: sqlx::postgres::PgConnectOptions = url.parse().context("DATABASE_URL")?;
    let mut wait = Duration::from_millis(200);
    loop {
        match PgPool::connect_with(opts.clone()).await {
            Ok(pool) => match postal_shared::migrate(&pool).await {
                Ok(()) => return Ok(pool),
                // The server went away between connecting and migrating: wait like above.
                Err(postal_shared::Error::Database(e)) => {
                    tracing::warn!(error = %e, "PostgreSQL unreachable; retrying in {wait:?}")
                }
                Err(e) => return Err(e.into()),
            },
            Err(sqlx::Error::Configuration(e)) => anyhow::bail!("DATABASE_URL: {e}"),
            Err(e) => tracing::warn!(error = %e, "PostgreSQL unreachable; retrying in {wait:?}"),
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}
