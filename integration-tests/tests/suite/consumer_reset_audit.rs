//! `postal consumer reset --execute` is an operator action like a requeue or a replay: it
//! moves a group's stored offsets (events replayed or skipped, never applied) and is recorded
//! in the audit trail with who, the group, topic, target and each partition's move.

use postal_integration_tests::{services, unique};

use crate::common::{create_topic, produce, RawRecord};

/// An audit row: action, via, database role, target, matched, affected.
type AuditRow = (
    String,
    Option<String>,
    Option<String>,
    serde_json::Value,
    Option<i64>,
    i64,
);

/// Guarantee (docs/security.md: every action that changes something is written to
/// `postal.operator_audit`): after `postal consumer reset --execute`, the trail has a `reset`
/// row via `cli` with the database role, the group, topic and `--to` given, and each
/// partition's stored offset before and after.
///
/// Broken: the reset moved the stored offsets (here 3 -> 0: three events applied again; a
/// move forward skips events for good) and wrote no row: `postal audit list` and the
/// dashboard's Audit page did not show it.
#[tokio::test]
async fn a_consumer_reset_is_in_the_audit_trail() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("reset-audit");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let records: Vec<RawRecord> = (0..3)
        .map(|i| RawRecord {
            key: Some(format!("k{i}")),
            payload: b"{}".to_vec(),
            headers: Vec::new(),
        })
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    // The group has applied all three.
    sqlx::query(
        "INSERT INTO postal.consumer_offsets (group_id, topic, partition, next_offset, owner)
         VALUES ($1, $2, 0, 3, 'test')",
    )
    .bind(&group)
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let out = std::process::Command::new(crate::procs::bin_dir().join("postal"))
        .args([
            "consumer",
            "reset",
            "--execute",
            "--group",
            &group,
            "--topic",
            &topic,
            "--to",
            "earliest",
        ])
        .env("DATABASE_URL", &db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("run the postal CLI");
    assert!(
        out.status.success(),
        "reset: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let next: i64 = sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets WHERE group_id = $1 AND topic = $2",
    )
    .bind(&group)
    .bind(&topic)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(next, 0, "the reset moved the stored offset");
    let rows: Vec<AuditRow> = sqlx::query_as(
        "SELECT action, via, db_role, target, matched, affected FROM postal.operator_audit",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 1, "one audit row: {rows:?}");
    let (action, via, role, target, matched, affected) = &rows[0];
    assert_eq!(action, "reset");
    assert_eq!(via.as_deref(), Some("cli"));
    assert!(role.is_some(), "the database role is recorded");
    assert_eq!(target["group"], group.as_str());
    assert_eq!(target["topic"], topic.as_str());
    assert_eq!(target["to"], "earliest");
    assert_eq!(
        target["partitions"],
        serde_json::json!([{"partition": 0, "from": 3, "to": 0}])
    );
    assert_eq!((*matched, *affected), (Some(1), 1));
}
