//! What the WAL relay checks of its source before it streams (at start, and each time it opens
//! the slot again): that the publication publishes the inserts into `postal.outbox`, all of
//! them, and that the slot is a `pgoutput` slot of this database.
//!
//! A relay streaming a publication without the outbox reads no outbox insert and confirms the
//! slot past them all; slot names are server-wide, and a relay on another database's slot
//! would end that database's walsender. Either is a configuration to fix: one line
//! ([`Error::Config`]) saying what to do, and the relay stops. A database that does not answer
//! is an [`Error::Database`], which the relay waits out.

use sqlx::PgPool;

use super::WalSource;
use crate::Error;

/// Checks the publication and the slot of `source` in the database of `pool`.
pub(crate) async fn source(pool: &PgPool, source: &WalSource) -> Result<(), Error> {
    slot_of_this_database(pool, &source.slot).await?;
    publication(pool, &source.publication).await
}

/// The publication exists, publishes inserts, and publishes every row of `postal.outbox`
/// (no row filter).
pub(crate) async fn publication(pool: &PgPool, publication: &str) -> Result<(), Error> {
    // `to_jsonb`: `rowfilter` exists from PostgreSQL 15 on only.
    let (database, found, inserts, outbox, filter): (String, bool, bool, bool, Option<String>) =
        sqlx::query_as(
            "SELECT current_database()::text, p.pubname IS NOT NULL, coalesce(p.pubinsert, false),
                    t.pubname IS NOT NULL, to_jsonb(t) ->> 'rowfilter'
             FROM (SELECT 1) AS one
             LEFT JOIN pg_publication p ON p.pubname = $1
             LEFT JOIN pg_publication_tables t ON t.pubname = p.pubname
                   AND t.schemaname = 'postal' AND t.tablename = 'outbox'",
        )
        .bind(publication)
        .fetch_one(pool)
        .await?;
    let fix = "name the publication of postal.outbox with --wal-publication, or create one with `postal migrate --wal-slot SLOT --wal-publication NAME`";
    if !found {
        return Err(Error::Config(format!(
            "WAL source: publication {publication} does not exist in database {database}: {fix}"
        )));
    }
    if !outbox {
        return Err(Error::Config(format!(
            "WAL source: publication {publication} of database {database} does not publish postal.outbox: its events would never be read and the slot would move past them; {fix}"
        )));
    }
    if !inserts {
        return Err(Error::Config(format!(
            "WAL source: publication {publication} of database {database} does not publish inserts (publish = 'insert' needed): {fix}"
        )));
    }
    if let Some(filter) = filter {
        return Err(Error::Config(format!(
            "WAL source: publication {publication} of database {database} publishes only the outbox rows WHERE {filter}: the others would never be published; {fix}"
        )));
    }
    Ok(())
}

/// The slot, if it exists, is a logical `pgoutput` slot of this database. One of another
/// database is refused: its name is taken on this server (slot names are server-wide).
pub(crate) async fn slot_of_this_database(pool: &PgPool, slot: &str) -> Result<(), Error> {
    let (database, present, of, plugin): (String, bool, Option<String>, Option<String>) =
        sqlx::query_as(
            "SELECT current_database()::text, s.slot_name IS NOT NULL, s.database::text,
                    s.plugin::text
             FROM (SELECT 1) AS one LEFT JOIN pg_replication_slots s ON s.slot_name = $1",
        )
        .bind(slot)
        .fetch_one(pool)
        .await?;
    let found = present.then_some((of, plugin));
    match found {
        None => Ok(()),
        Some((Some(other), _)) if other != database => Err(Error::Config(format!(
            "WAL source: slot {slot} belongs to database {other}, not {database} (slot names are server-wide): give database {database}'s relay a slot name of its own with --wal-slot (created by `postal migrate --wal-slot NAME`)"
        ))),
        Some((None, _)) => Err(Error::Config(format!(
            "WAL source: slot {slot} is a physical replication slot, not a logical one of database {database}: give the relay a slot name of its own with --wal-slot (created by `postal migrate --wal-slot NAME`)"
        ))),
        Some((Some(_), plugin)) if plugin.as_deref() != Some("pgoutput") => {
            Err(Error::Config(format!(
                "WAL source: slot {slot} of database {database} uses plugin {}, not pgoutput: give the relay a slot name of its own with --wal-slot (created by `postal migrate --wal-slot NAME`)",
                plugin.unwrap_or_default()
            )))
        }
        Some(_) => Ok(()),
    }
}
