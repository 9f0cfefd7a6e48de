//! Database roles as earlier releases granted them, for tests of what a relay does without
//! a newer privilege.

use postal_integration_tests::{unique, TestDb};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// A relay role as `postal grant --relay` of the release before migration 0018 made it
/// (nothing on `postal.relay_minutes`), and a pool of it.
pub async fn pre18_relay_pool(db: &TestDb, size: u32) -> (String, PgPool) {
    let role = unique("relay_pre18").replace('-', "_");
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA postal TO {role}"),
        format!("GRANT SELECT, UPDATE, DELETE ON postal.outbox TO {role}"),
        format!("GRANT SELECT, INSERT ON postal.outbox_history TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON postal.relay_instances, postal.relay_partitions TO {role}"),
        format!("GRANT SELECT ON postal.schema_contract, postal._sqlx_migrations TO {role}"),
    ] {
        sqlx::query(&sql).execute(&db.pool).await.unwrap();
    }
    let opts: PgConnectOptions = db.url.parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .connect_with(opts.username(&role))
        .await
        .unwrap();
    (role, pool)
}
