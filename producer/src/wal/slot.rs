//! Creating and dropping the WAL relay's publication and slot (what `postal migrate` will do
//! only when asked; the tests create their own).
//!
//! Order matters: the publication first, then the slot. The slot's stream holds every outbox
//! insert committed after the slot's consistent point; rows committed before it are not in it
//! (drain them with a polling relay first, docs/wal-relay.md "Handing over").

use sqlx::PgPool;

fn checked(name: &str) -> Result<&str, sqlx::Error> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(name)
    } else {
        Err(sqlx::Error::Protocol(format!(
            "{name:?}: slot and publication names are 1 to 63 of a-z, 0-9 and _"
        )))
    }
}

/// Creates the publication of `postal.outbox` inserts (if missing) and the logical slot with
/// plugin `pgoutput` (if missing). Returns the slot's consistent point when it was created.
pub async fn create(
    pool: &PgPool,
    slot: &str,
    publication: &str,
) -> Result<Option<String>, sqlx::Error> {
    let (slot, publication) = (checked(slot)?, checked(publication)?);
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(publication)
            .fetch_one(pool)
            .await?;
    if !exists {
        sqlx::query(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE postal.outbox WITH (publish = 'insert')"
        ))
        .execute(pool)
        .await?;
    }
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(slot)
    .fetch_one(pool)
    .await?;
    if exists {
        return Ok(None);
    }
    let lsn: String = sqlx::query_scalar(
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
    )
    .bind(slot)
    .fetch_one(pool)
    .await?;
    Ok(Some(lsn))
}

/// Drops the slot (if present and inactive) and the publication (if present).
pub async fn drop(pool: &PgPool, slot: &str, publication: &str) -> Result<(), sqlx::Error> {
    let (slot, publication) = (checked(slot)?, checked(publication)?);
    sqlx::query(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .execute(pool)
    .await?;
    sqlx::query(&format!("DROP PUBLICATION IF EXISTS {publication}"))
        .execute(pool)
        .await?;
    Ok(())
}

/// The slot's confirmed position (`confirmed_flush_lsn`), if the slot exists.
pub async fn confirmed(pool: &PgPool, slot: &str) -> Result<Option<String>, sqlx::Error> {
    Ok(sqlx::query_scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?
    .flatten())
}
