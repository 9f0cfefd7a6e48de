//! An idle outbox database's WAL relay slot keeps advancing (docs/wal-relay.md
//! "Heartbeats"): the relay confirms the server's keepalive positions when nothing of its own
//! is outstanding, so WAL written elsewhere on the server is not kept for the slot.

use std::time::Duration;

use postal_integration_tests::{services, wait};
use sqlx::PgPool;

use crate::wal_relay::Slot;

/// `(lag_bytes, retained_bytes)` of `slot`: WAL past its confirmed position, and WAL it keeps
/// (past its restart position).
async fn slot_bytes(pool: &PgPool, slot: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::int8,
                (pg_current_wal_lsn() - restart_lsn)::int8
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
    .unwrap()
}

const WRITTEN: i64 = 48 << 20;

/// Guarantee: with the outbox's database idle (no outbox insert, nothing written in it) while
/// another database on the server writes 48 MiB of WAL, the running WAL relay's slot does not
/// keep that WAL: its confirmed position follows the server's (less than 4 MiB behind) and
/// its retained WAL comes back under 24 MiB. Without confirming keepalive positions the slot
/// stayed where it was created, 48 MiB or more behind, keeping all of it.
#[tokio::test]
async fn an_idle_outbox_slot_keeps_advancing_while_other_databases_write() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let other = svc.empty_db().await;
    let slot = Slot::create(&db).await;
    let name = slot.source.slot.clone();
    let relay = crate::common::RunningRelay::start(
        &db.pool,
        crate::common::kafka_transport(&svc.bootstrap),
        slot.config(),
    );
    let start: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE filler (x text)")
        .execute(&other.pool)
        .await
        .unwrap();
    loop {
        sqlx::query(
            "INSERT INTO filler SELECT repeat(md5(g::text), 32) FROM generate_series(1, 4000) g",
        )
        .execute(&other.pool)
        .await
        .unwrap();
        let written: i64 = sqlx::query_scalar("SELECT (pg_current_wal_lsn() - $1::pg_lsn)::int8")
            .bind(&start)
            .fetch_one(&other.pool)
            .await
            .unwrap();
        if written >= WRITTEN {
            break;
        }
    }
    wait::until(
        Duration::from_secs(90),
        "the slot to follow the server",
        || async {
            let (lag, retained) = slot_bytes(&db.pool, &name).await;
            lag < 4 << 20 && retained < 24 << 20
        },
    )
    .await;
    let last = slot_bytes(&db.pool, &name).await;
    eprintln!(
        "after {WRITTEN} bytes written elsewhere: lag {} B, retained {} B",
        last.0, last.1
    );
    relay.stop().await;
}
