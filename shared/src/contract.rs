//! The upgrade contract: which binaries may run on which schema, checked when a long-running
//! process starts and again while it runs ([`watch_schema`]).
//!
//! A binary knows the migrations it embeds. It runs on a schema that has all of them applied
//! (newer, additive migrations it does not know are fine: services sharing a database upgrade
//! one at a time), and refuses, with one line saying what to do, a schema that is missing, one
//! that lacks migrations it needs, or one whose `postal.schema_contract` says binaries as old as
//! it must not run on it any more.

use sqlx::PgPool;

use crate::Error;

/// The newest migration this binary embeds.
pub fn known_version() -> i64 {
    crate::migrator()
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap_or(0)
}

/// [`Error::SchemaMissing`], naming the database (or the query's error if that fails too).
async fn missing(pool: &PgPool) -> Error {
    match sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pool)
        .await
    {
        Ok(database) => Error::SchemaMissing { database },
        Err(e) => e.into(),
    }
}

/// Checks that this binary may run on the database's Postal schema (see the module docs).
/// An unreachable database is an `Err` whose [`Error::is_unavailable`] is true: wait and
/// check again.
///
/// First of all it refuses a connection through a transaction pooler
/// ([`crate::pooler::require_session`]): every process that checks the schema needs a session.
pub async fn check_schema(pool: &PgPool) -> Result<(), Error> {
    crate::pooler::require_session(pool).await?;
    let known = known_version();
    let applied: Option<i64> =
        match sqlx::query_scalar("SELECT max(version) FROM postal._sqlx_migrations WHERE success")
            .fetch_one(pool)
            .await
        {
            Ok(v) => v,
            Err(sqlx::Error::Database(d))
                if matches!(d.code().as_deref(), Some("42P01" | "3F000")) =>
            {
                return Err(missing(pool).await)
            }
            Err(e) => return Err(e.into()),
        };
    let Some(applied) = applied else {
        return Err(missing(pool).await);
    };
    if applied < known {
        return Err(Error::SchemaBehind { applied, known });
    }
    let oldest: Option<i64> =
        match sqlx::query_scalar("SELECT oldest_compatible FROM postal.schema_contract")
            .fetch_optional(pool)
            .await
        {
            Ok(v) => v,
            Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42P01") => None,
            Err(e) => return Err(e.into()),
        };
    match oldest {
        Some(oldest) if oldest > known => Err(Error::SchemaTooNew {
            applied,
            oldest,
            known,
        }),
        _ => Ok(()),
    }
}

/// How often a running relay or consumer checks the upgrade contract again ([`watch_schema`]).
pub const SCHEMA_RECHECK: std::time::Duration = std::time::Duration::from_secs(30);

/// Whether `e` says this binary must not run on the database's schema (missing, behind, for
/// newer binaries only, or reached through a transaction pooler), as opposed to a database
/// that did not answer this time.
pub fn breaks_contract(e: &Error) -> bool {
    matches!(
        e,
        Error::SchemaMissing { .. }
            | Error::SchemaBehind { .. }
            | Error::SchemaTooNew { .. }
            | Error::TransactionPooling
    )
}

/// [`check_schema`] every `every` while a relay or consumer runs: returns the first error that
/// [`breaks_contract`] — a migration applied meanwhile that this binary must not run on (its
/// one line says what to do); the process stops with it. A check that fails otherwise (the
/// database unreachable for a while) is logged at debug level and made again.
pub async fn watch_schema(pool: &PgPool, every: std::time::Duration) -> Error {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tick.tick().await;
        match check_schema(pool).await {
            Ok(()) => {}
            Err(e) if breaks_contract(&e) => return e,
            Err(e) => tracing::debug!(error = %e, "schema re-check failed; checking again later"),
        }
    }
}

/// Why the database cannot be reached, in a few words: a pool only says it timed out, so one
/// connection of its own (bounded by `probe`) names the cause (connection refused, no route,
/// the server shutting down, …).
pub async fn unreachable_cause(pool: &PgPool, e: &Error, probe: std::time::Duration) -> String {
    use sqlx::Connection as _;
    if !matches!(e.database_error(), Some(sqlx::Error::PoolTimedOut)) {
        return match e.database_error().and_then(connect_hint) {
            Some(hint) => format!("{e} ({hint})"),
            None => e.to_string(),
        };
    }
    let options = pool.connect_options().as_ref().clone();
    match tokio::time::timeout(probe, sqlx::PgConnection::connect_with(&options)).await {
        Err(_) => format!("no answer within {}s", probe.as_secs()),
        Ok(Err(cause)) => match connect_hint(&cause) {
            Some(hint) => format!("{cause} ({hint})"),
            None => cause.to_string(),
        },
        // It answers now: the pool was busy or the server just came back.
        Ok(Ok(c)) => {
            c.close().await.ok();
            e.to_string()
        }
    }
}

/// [`check_schema`], waiting while the database is unreachable (one warning per attempt naming
/// the cause, attempts up to 10 s apart) until it answers or `shutdown` resolves. `Ok(false)`:
/// shut down while waiting. A schema this binary must not run on is an `Err` at once.
pub async fn wait_for_schema(
    pool: &PgPool,
    mut shutdown: impl std::future::Future<Output = ()> + Unpin,
) -> Result<bool, Error> {
    let backoff = crate::Backoff {
        base: std::time::Duration::from_millis(200),
        max: std::time::Duration::from_secs(10),
    };
    let mut failures = 0u32;
    loop {
        match check_schema(pool).await {
            Ok(()) => return Ok(true),
            Err(e) if e.is_unavailable() => {
                let wait = backoff.delay(failures);
                failures = failures.saturating_add(1);
                let cause = unreachable_cause(pool, &e, std::time::Duration::from_secs(5)).await;
                tracing::warn!(
                    retry_in_ms = wait.as_millis() as u64,
                    "cannot connect to the database, retrying: {cause}"
                );
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = &mut shutdown => return Ok(false),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// What to do about a connection error that waiting does not fix: a TLS certificate that could
/// not be verified, one for another host, a server that requires TLS. `None` for others.
pub fn connect_hint(e: &sqlx::Error) -> Option<&'static str> {
    let text = e.to_string();
    if text.contains("hostname mismatch") || text.contains("IP address mismatch") {
        return Some(
            "the server's TLS certificate is for another host name: connect with a name it names",
        );
    }
    if text.contains("certificate verify failed") {
        return Some("the server's TLS certificate could not be verified: set sslrootcert in DATABASE_URL to the CA that signed it");
    }
    if text.contains("no encryption") {
        return Some("the server requires TLS: add sslmode=verify-full and sslrootcert=<CA file> to DATABASE_URL");
    }
    None
}
