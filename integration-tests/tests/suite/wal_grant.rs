//! `postal grant --wal-relay ROLE`: the least privileges of a WAL relay (docs/wal-relay.md):
//! a relay's, its slot lease, and the `REPLICATION` attribute.

use std::time::Duration;

use postal_integration_tests::{services, unique, wait};

use crate::pg_security::as_role;
use crate::procs::bin_dir;
use crate::wal_lease::wal_relay_proc;
use crate::wal_relay::{enqueue_each, Slot};

/// Guarantee: after `postal grant --wal-relay R` (run as a superuser owning the schema), role
/// R, created with no attribute, has `REPLICATION`, and `postal relay --read-from wal` running
/// as R takes the slot's lease and publishes every event. Before, `postal grant` knew no WAL
/// relay: a relay role lacked `REPLICATION` and the lease table (permission denied), and the
/// WAL relay published nothing.
#[tokio::test]
async fn a_role_granted_as_wal_relay_streams_and_publishes() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let role = format!("walrelay_{}", unique("r").replace('-', "_"));
    sqlx::query(&format!("CREATE ROLE {role} LOGIN"))
        .execute(&db.pool)
        .await
        .unwrap();
    let out = std::process::Command::new(bin_dir().join("postal"))
        .args(["grant", "--wal-relay", &role])
        .env("DATABASE_URL", &db.url)
        .output()
        .expect("postal runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "postal grant: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("REPLICATION"), "{stdout}");
    let replication: bool =
        sqlx::query_scalar("SELECT rolreplication FROM pg_roles WHERE rolname = $1")
            .bind(&role)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(replication, "the role has REPLICATION");

    let slot = Slot::create(&db).await;
    let topic = unique("wal-grant");
    enqueue_each(&db.pool, &topic, "k", 10).await;
    let mut relay = wal_relay_proc(&db, &slot, &svc.bootstrap, "wal-grant", "relay")
        .env(&[("DATABASE_URL", as_role(&db.url, &role))]);
    relay.start();
    wait::until(Duration::from_secs(60), "the outbox drained", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop();
    for drop in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        let _ = sqlx::query(&drop).execute(&db.pool).await;
    }
}
