//! Waiting for conditions with deadlines (never a bare sleep as synchronisation).

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

/// Polls `check` every 20 ms until it returns `true`; panics naming `what` after `timeout`.
pub async fn until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until PostgreSQL at `url` accepts a connection.
pub async fn ready_postgres(url: &str, timeout: Duration) -> Result<(), String> {
    let opts: PgConnectOptions = url
        .parse()
        .map_err(|e| format!("invalid DATABASE_URL: {e}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match opts.connect().await {
            Ok(c) => {
                let _ = c.close().await;
                return Ok(());
            }
            Err(e) if Instant::now() > deadline => {
                return Err(format!(
                    "PostgreSQL at {}:{} unreachable after {timeout:?}: {e}",
                    opts.get_host(),
                    opts.get_port()
                ))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
