//! `postal migrate --wal-slot NAME`: the WAL relay's publication and slot, created only when
//! asked (docs/wal-relay.md, "Slot and publication").

use postal_integration_tests::services;

use crate::procs::bin_dir;
use crate::wal_relay::Slot;

fn migrate(url: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(bin_dir().join("postal"))
        .arg("migrate")
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .expect("postal runs");
    assert!(
        out.status.success(),
        "postal migrate {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn slots_and_publications(db: &postal_integration_tests::TestDb) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_replication_slots WHERE database = current_database()),
                (SELECT count(*) FROM pg_publication)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Guarantee: `postal migrate` alone creates no slot and no publication (a slot keeps WAL
/// until it is read); `postal migrate --wal-slot S --wal-publication P` creates both (a
/// `pgoutput` slot, a publication of `postal.outbox` inserts) and says so; run again, it
/// says the slot exists and creates nothing. Before, `postal migrate` had no such option:
/// the slot had to be made by hand.
#[tokio::test]
async fn migrate_creates_the_wal_slot_only_when_asked() {
    let svc = services().await;
    let db = svc.empty_db().await;
    migrate(&db.url, &[]);
    assert_eq!(slots_and_publications(&db).await, (0, 0));
    let id = uuid::Uuid::now_v7().simple().to_string();
    let (slot, publication) = (format!("postal_t_slot_{id}"), format!("postal_t_pub_{id}"));
    let _cleanup = Slot::adopt(&db, &slot, &publication);
    let said = migrate(
        &db.url,
        &["--wal-slot", &slot, "--wal-publication", &publication],
    );
    assert!(said.contains("created publication"), "{said}");
    let (plugin, pubinsert, pubupdate): (String, bool, bool) = sqlx::query_as(
        "SELECT s.plugin::text, p.pubinsert, p.pubupdate FROM pg_replication_slots s, pg_publication p
         WHERE s.slot_name = $1 AND p.pubname = $2",
    )
    .bind(&slot)
    .bind(&publication)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (plugin.as_str(), pubinsert, pubupdate),
        ("pgoutput", true, false)
    );
    let said = migrate(
        &db.url,
        &["--wal-slot", &slot, "--wal-publication", &publication],
    );
    assert!(said.contains("exists"), "{said}");
    assert_eq!(slots_and_publications(&db).await, (1, 1));
}
