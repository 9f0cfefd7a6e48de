//! Creating and dropping the WAL relay's publication and slot (what `postal migrate` will do
//! only when asked; the tests create their own).
//!
//! Order matters: the publication first, then the slot. The slot's stream holds every outbox
//! insert committed after the slot's consistent point; rows committed before it are not in it
//! (drain them with a polling relay first, docs/wal-relay.md "Handing over").

use sqlx::PgPool;

use crate::Error;

fn checked(name: &str) -> Result<&str, Error> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(name)
    } else {
        Err(Error::Config(format!(
            "{name:?}: slot and publication names are 1 to 63 of a-z, 0-9 and _"
        )))
    }
}

/// Creates the publication of `postal.outbox` inserts (if missing) and the logical slot with
/// plugin `pgoutput` (if missing). Returns the slot's consistent point when it was created.
///
/// Slot names are server-wide: a slot of that name of another database (or not a `pgoutput`
/// one) is refused with [`Error::Config`], one line naming both databases.
pub async fn create(pool: &PgPool, slot: &str, publication: &str) -> Result<Option<String>, Error> {
    let (slot, publication) = (checked(slot)?, checked(publication)?);
    super::check::slot_of_this_database(pool, slot).await?;
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
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots
                        WHERE slot_name = $1 AND database = current_database())",
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

/// Drops the slot (if present in this database and inactive) and the publication (if
/// present).
pub async fn drop(pool: &PgPool, slot: &str, publication: &str) -> Result<(), Error> {
    let (slot, publication) = (checked(slot)?, checked(publication)?);
    sqlx::query(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(slot)
    .execute(pool)
    .await?;
    sqlx::query(&format!("DROP PUBLICATION IF EXISTS {publication}"))
        .execute(pool)
        .await?;
    Ok(())
}

/// The slot's confirmed position (`confirmed_flush_lsn`), if the slot exists in this
/// database.
pub async fn confirmed(pool: &PgPool, slot: &str) -> Result<Option<String>, sqlx::Error> {
    Ok(sqlx::query_scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?
    .flatten())
}

/// A WAL relay's slot as `postal status`, the relay's metrics and the alerts see it: the
/// logical `pgoutput` slots of this database, and the slots named in
/// `postal.wal_slot_leases` (a slot with a lease row but no slot is missing: dropped, or lost
/// in a failover).
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct SlotState {
    /// The slot's name.
    pub slot: String,
    /// The slot exists on this server.
    pub present: bool,
    /// A walsender streams from it now.
    pub active: bool,
    /// WAL written past the slot's confirmed position (`pg_current_wal_lsn() -
    /// confirmed_flush_lsn`): what the relay has yet to confirm.
    pub lag_bytes: Option<i64>,
    /// The slot's confirmed position, as a number of bytes.
    pub confirmed_lsn: Option<i64>,
    /// PostgreSQL's measure of the slot's lag in time (`pg_stat_replication.flush_lag` of
    /// its walsender): none when inactive, or caught up for a while.
    pub lag_s: Option<f64>,
    /// WAL the slot keeps on the server (`pg_current_wal_lsn() - restart_lsn`).
    pub retained_bytes: Option<i64>,
    /// `pg_replication_slots.wal_status`: `reserved`, `extended`, `unreserved` (past
    /// `max_slot_wal_keep_size`: invalidated at the next checkpoint unless it catches up) or
    /// `lost`.
    pub wal_status: Option<String>,
    /// WAL that can still be written before the slot is invalidated
    /// (`safe_wal_size`; none when `max_slot_wal_keep_size` is -1, unlimited).
    pub safe_wal_bytes: Option<i64>,
    /// The relay holding the slot's lease, its host, and the lease's time left (negative:
    /// expired).
    pub holder: Option<uuid::Uuid>,
    /// The holder's host (`HOSTNAME`).
    pub holder_host: Option<String>,
    /// Seconds left on the lease (negative: expired).
    pub lease_left_s: Option<f64>,
}

/// The WAL relays' slots of this database ([`SlotState`]).
pub async fn states(pool: &PgPool) -> Result<Vec<SlotState>, sqlx::Error> {
    sqlx::query_as(
        "WITH s AS (
             SELECT s.slot_name::text AS slot_name, s.active, s.active_pid,
                    s.confirmed_flush_lsn, s.restart_lsn, s.wal_status, s.safe_wal_size
             FROM pg_replication_slots s
             WHERE s.database = current_database() AND s.plugin = 'pgoutput'
         )
         SELECT coalesce(s.slot_name, l.slot_name) AS slot,
                s.slot_name IS NOT NULL AS present,
                coalesce(s.active, false) AS active,
                (pg_current_wal_lsn() - s.confirmed_flush_lsn)::int8 AS lag_bytes,
                (s.confirmed_flush_lsn - '0/0')::int8 AS confirmed_lsn,
                (SELECT extract(epoch FROM r.flush_lag)::float8 FROM pg_stat_replication r
                 WHERE r.pid = s.active_pid) AS lag_s,
                (pg_current_wal_lsn() - s.restart_lsn)::int8 AS retained_bytes,
                s.wal_status,
                s.safe_wal_size::int8 AS safe_wal_bytes,
                l.holder,
                l.host AS holder_host,
                extract(epoch FROM l.lease_until - now())::float8 AS lease_left_s
         FROM s FULL JOIN postal.wal_slot_leases l ON l.slot_name = s.slot_name
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
}

/// Records the state of `slot` as the relay's metrics (`postal_wal_slot_*{slot}`,
/// docs/operations.md); a slot that is gone reports `postal_wal_slot_present` 0.
pub(crate) async fn record_metrics(pool: &PgPool, slot: &str) -> Result<(), sqlx::Error> {
    let states = states(pool).await?;
    let state = states.into_iter().find(|s| s.slot == slot);
    let label = slot.to_owned();
    let present = state.as_ref().is_some_and(|s| s.present);
    metrics::gauge!("postal_wal_slot_present", "slot" => label.clone()).set(if present {
        1.0
    } else {
        0.0
    });
    let Some(s) = state.filter(|s| s.present) else {
        return Ok(());
    };
    metrics::gauge!("postal_wal_slot_active", "slot" => label.clone()).set(if s.active {
        1.0
    } else {
        0.0
    });
    if let Some(v) = s.lag_bytes {
        metrics::gauge!("postal_wal_slot_lag_bytes", "slot" => label.clone()).set(v as f64);
    }
    if let Some(v) = s.confirmed_lsn {
        metrics::gauge!("postal_wal_slot_confirmed_lsn", "slot" => label.clone()).set(v as f64);
    }
    metrics::gauge!("postal_wal_slot_lag_seconds", "slot" => label.clone())
        .set(s.lag_s.unwrap_or(0.0));
    if let Some(v) = s.retained_bytes {
        metrics::gauge!("postal_wal_slot_retained_bytes", "slot" => label.clone()).set(v as f64);
    }
    if let Some(v) = s.safe_wal_bytes {
        metrics::gauge!("postal_wal_slot_safe_wal_bytes", "slot" => label.clone()).set(v as f64);
    }
    let unreserved = matches!(s.wal_status.as_deref(), Some("unreserved" | "lost"));
    metrics::gauge!("postal_wal_slot_unreserved", "slot" => label).set(if unreserved {
        1.0
    } else {
        0.0
    });
    Ok(())
}
