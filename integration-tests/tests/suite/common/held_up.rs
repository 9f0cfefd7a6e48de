//! Claims held up right after their `BEGIN`, as production holds them up: another session
//! holds a lock on `postal.relay_partitions` (a migration, `VACUUM FULL`, `pg_repack`), and
//! the test waits until PostgreSQL reports the claim's backend waiting for it. Used by the
//! deterministic schedules of `concurrent_writers` and `claim_schedules`.

use std::time::Duration;

use postal_integration_tests::wait;
use postal_producer::testing::lease;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// A relay of `group` that holds every key partition of it for `lease_for`.
pub async fn relay_in(pool: &PgPool, group: &str, lease_for: Duration) -> Uuid {
    let relay = Uuid::now_v7();
    let held = lease::heartbeat(pool, group, relay, "", lease_for, &[], true)
        .await
        .unwrap();
    assert_eq!(held.held.len(), 256, "a lone relay holds every partition");
    relay
}

/// A connection of its own (not from the pool: the test holds its transactions open).
pub async fn connect(url: &str) -> PgConnection {
    PgConnection::connect(url).await.unwrap()
}

/// Holds `postal.relay_partitions` locked on a connection of its own until released: every
/// claim waits right after its `BEGIN`.
pub struct PartitionsLock(PgConnection);

impl PartitionsLock {
    pub async fn take(url: &str) -> Self {
        let mut c = connect(url).await;
        sqlx::query("BEGIN").execute(&mut c).await.unwrap();
        sqlx::query("LOCK TABLE postal.relay_partitions IN ACCESS EXCLUSIVE MODE")
            .execute(&mut c)
            .await
            .unwrap();
        PartitionsLock(c)
    }

    pub async fn release(mut self) {
        sqlx::query("ROLLBACK").execute(&mut self.0).await.unwrap();
    }
}

/// Waits until a backend other than the lock holder waits for a lock while running a statement
/// on `postal.relay_partitions`: the claim has begun its transaction and is held up.
pub async fn claim_waits_for_the_lock(pool: &PgPool) {
    wait::until(
        Duration::from_secs(20),
        "the claim waits for the partitions lock",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                                WHERE datname = current_database() AND wait_event_type = 'Lock'
                                  AND query LIKE '%relay_partitions%'
                                  AND query NOT LIKE 'LOCK TABLE%')",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
}
