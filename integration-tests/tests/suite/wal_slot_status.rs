//! The WAL relay's slot as operators see it (docs/wal-relay.md "Operations"): `postal status`
//! (text and `--json`) and the relay's `postal_wal_slot_*` metrics: present or missing,
//! active, lag, retained WAL, the lease.

use std::time::Duration;

use postal_integration_tests::{services, unique, wait};

use crate::procs::{bin_dir, http_get};
use crate::wal_lease::wal_relay_proc;
use crate::wal_relay::{enqueue_each, Slot};

/// `postal status --json`'s entry for `slot`, and the text output.
fn status(url: &str, slot: &str) -> (Option<serde_json::Value>, String) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin_dir().join("postal"))
            .args(args)
            .env("DATABASE_URL", url)
            .env("POSTAL_LOG", "warn")
            .output()
            .expect("run the postal CLI");
        assert!(
            out.status.success(),
            "postal {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let json: serde_json::Value = serde_json::from_str(&run(&["status", "--json"])).unwrap();
    let entry = json["wal_slots"]
        .as_array()
        .expect("wal_slots")
        .iter()
        .find(|s| s["slot"] == slot)
        .cloned();
    (entry, run(&["status"]))
}

/// The value of `name{slot="<slot>"}` on a relay's `/metrics`.
fn metric(port: u16, name: &str, slot: &str) -> Option<f64> {
    let text = http_get(port, "/metrics")?;
    let prefix = format!("{name}{{slot=\"{slot}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// Guarantee: `postal status` shows a WAL relay's slot with its lag in bytes while events wait
/// in it (inactive, no lease), then active with its holder's lease and no lag once a relay
/// drained it; the relay exports the same as `postal_wal_slot_present`/`_active`/`_lag_bytes`;
/// a slot that is gone (dropped, or lost in a failover) shows as MISSING in `postal status`
/// and as `postal_wal_slot_present` 0 on a relay that has a lease row for it (what
/// `PostalWalSlotMissing` fires on); the dashboard's overview lists the slot, active, with its
/// holder. Before, none of them showed anything about the slot.
#[tokio::test]
async fn status_and_metrics_show_the_slot_lag_lease_and_a_missing_slot() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let name = slot.source.slot.clone();
    let topic = unique("wal-status");
    let (_, before_last) = enqueue_each(&db.pool, &topic, "k", 20).await;

    let (entry, text) = status(&db.url, &name);
    let entry = entry.expect("the slot in postal status --json");
    assert_eq!(entry["present"], true);
    assert_eq!(entry["active"], false);
    assert!(entry["lag_bytes"].as_i64().unwrap() > 0, "{entry}");
    assert!(entry["holder"].is_null(), "{entry}");
    assert!(text.contains(&name) && text.contains("INACTIVE"), "{text}");

    let mut relay =
        wal_relay_proc(&db, &slot, &svc.bootstrap, "wal-status", "relay").with_metrics();
    relay.start();
    let port = relay.metrics_port().unwrap();
    wait::until(Duration::from_secs(60), "drained and confirmed", || async {
        crate::common::outbox_count(&db.pool).await == 0
            && slot.confirmed(&db.pool).await >= before_last
    })
    .await;
    wait::until(Duration::from_secs(30), "the slot's metrics", || async {
        metric(port, "postal_wal_slot_present", &name) == Some(1.0)
            && metric(port, "postal_wal_slot_active", &name) == Some(1.0)
            && metric(port, "postal_wal_slot_lag_bytes", &name).is_some()
    })
    .await;
    let (entry, text) = status(&db.url, &name);
    let entry = entry.unwrap();
    assert_eq!(entry["active"], true, "{entry}");
    assert!(!entry["holder"].is_null(), "{entry}");
    assert!(entry["lease_left_s"].as_f64().unwrap() > 0.0, "{entry}");
    assert!(entry["retained_bytes"].as_i64().is_some(), "{entry}");
    assert!(text.contains("active"), "{text}");
    // The dashboard's overview shows the slot and its holder.
    let addr =
        crate::common::dashboard::start(postal_admin::web::Dashboard::new(db.pool.clone())).await;
    let page = postal_integration_tests::http::request(addr, "GET", "/", &[], "").await;
    let section = &page.body[page.body.find("id=\"wal-slots\"").expect("the slots table")..];
    assert!(
        section.contains(&name) && section.contains("active"),
        "{section}"
    );
    assert!(
        section.contains(entry["holder"].as_str().unwrap()),
        "the holder shown"
    );
    relay.stop();

    // The slot is lost (as after a failover: the publication, in the catalog, survives it);
    // its lease row stays.
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&name)
        .execute(&db.pool)
        .await
        .unwrap();
    let (entry, text) = status(&db.url, &name);
    assert_eq!(entry.expect("the leased slot")["present"], false);
    assert!(text.contains("MISSING"), "{text}");
    let mut relay =
        wal_relay_proc(&db, &slot, &svc.bootstrap, "wal-status", "relay-2").with_metrics();
    relay.start();
    let port = relay.metrics_port().unwrap();
    wait::until(
        Duration::from_secs(30),
        "postal_wal_slot_present 0",
        || async { metric(port, "postal_wal_slot_present", &name) == Some(0.0) },
    )
    .await;
    relay.stop();
}
