//! The upgrade contract: which binaries may run on which schema, checked when a long-running
//! process starts.
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
pub async fn check_schema(pool: &PgPool) -> Result<(), Error> {
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
