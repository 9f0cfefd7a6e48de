//! `postal cleanup` and `postal grant` are operator actions like a discard or a reset: one
//! deletes rows, the other changes privileges. Each is recorded in the audit trail with who
//! (OS user, via `cli`, database role), what, on what, and how many.

use postal_integration_tests::services;

/// An audit row: action, via, database role, target, matched, affected.
type AuditRow = (
    String,
    Option<String>,
    Option<String>,
    serde_json::Value,
    Option<i64>,
    i64,
);

async fn audit_rows(pool: &sqlx::PgPool) -> Vec<AuditRow> {
    sqlx::query_as(
        "SELECT action, via, db_role, target, matched, affected FROM postal.operator_audit
         ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Runs `postal <args>` on `url`; panics unless it succeeds.
fn postal(url: &str, args: &[&str]) {
    let out = std::process::Command::new(crate::procs::bin_dir().join("postal"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("run the postal CLI");
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Guarantee (docs/security.md: every action that changes something is in
/// `postal.operator_audit`): `postal cleanup --dedup-retention 1h --consumer c
/// --ignore-declared` leaves a `cleanup` row via `cli` with the database role, the table,
/// consumer and retention, and the 3 rows it deleted.
///
/// Broken: the cleanup deleted the dedup rows (after which a late copy of those events is
/// applied again) and wrote no row.
#[tokio::test]
async fn a_cleanup_is_in_the_audit_trail_with_what_it_deleted() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
         SELECT 'c', gen_random_uuid(), now() - interval '2 hours' FROM generate_series(1, 3)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    postal(
        &db.url,
        &[
            "cleanup",
            "--dedup-retention",
            "1h",
            "--consumer",
            "c",
            "--ignore-declared",
        ],
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the cleanup deleted the rows");
    let rows = audit_rows(&db.pool).await;
    assert_eq!(rows.len(), 1, "one audit row: {rows:?}");
    let (action, via, role, target, matched, affected) = &rows[0];
    assert_eq!(action, "cleanup");
    assert_eq!(via.as_deref(), Some("cli"));
    assert!(role.is_some(), "the database role is recorded");
    assert_eq!(target["table"], "processed_events");
    assert_eq!(target["consumer"], "c");
    assert_eq!(target["dedup_retention"], "1h");
    assert_eq!((*matched, *affected), (None, 3));
}

/// Guarantee: `postal grant --consumer <role>` leaves a `grant` row via `cli` with the
/// database role, the roles granted to, and how many statements it ran, committed with the
/// privileges.
///
/// Broken: the privileges changed and no row said who granted them.
#[tokio::test]
async fn a_grant_is_in_the_audit_trail() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let role = postal_integration_tests::unique("grantee");
    sqlx::query(&format!("CREATE ROLE \"{role}\""))
        .execute(&db.pool)
        .await
        .unwrap();
    postal(&db.url, &["grant", "--consumer", &role]);
    let can: bool =
        sqlx::query_scalar("SELECT has_table_privilege($1, 'postal.dead_letters', 'INSERT')")
            .bind(&role)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(can, "granted");
    let rows = audit_rows(&db.pool).await;
    for drop in [
        format!("DROP OWNED BY \"{role}\""),
        format!("DROP ROLE \"{role}\""),
    ] {
        sqlx::query(&drop).execute(&db.pool).await.unwrap();
    }
    assert_eq!(rows.len(), 1, "one audit row: {rows:?}");
    let (action, via, db_role, target, matched, affected) = &rows[0];
    assert_eq!(action, "grant");
    assert_eq!(via.as_deref(), Some("cli"));
    assert!(db_role.is_some(), "the database role is recorded");
    assert_eq!(target["consumer"], serde_json::json!([role]));
    assert!(
        matched.is_some_and(|m| m > 0) && Some(*affected) == *matched,
        "{rows:?}"
    );
}
