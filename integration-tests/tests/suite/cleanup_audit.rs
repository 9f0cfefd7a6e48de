//! `postal cleanup`'s audit row counts every row it deleted, also when the run fails or is
//! killed midway, and when two runs delete at once.

use postal_integration_tests::services;

/// 25 published outbox rows, published 3 hours ago and before (oldest first by seq), and a
/// transaction holding the newest one locked: a `postal cleanup --published-retention 1h
/// --batch 10` deletes two batches of 10, then its third batch waits on that row.
async fn published_rows_with_the_newest_locked(
    pool: &sqlx::PgPool,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    for i in 0..25 {
        sqlx::query("SELECT postal.enqueue('t', $1, 'e', '{}'::jsonb)")
            .bind(format!("k{i}"))
            .execute(pool)
            .await
            .unwrap();
    }
    sqlx::query(
        "UPDATE postal.outbox SET status = 'published',
                published_at = now() - interval '3 hours' + seq * interval '1 second'",
    )
    .execute(pool)
    .await
    .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(
        "SELECT 1 FROM postal.outbox WHERE seq = (SELECT max(seq) FROM postal.outbox) FOR UPDATE",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    holder
}

/// How many outbox rows are gone, and the `cleanup` audit rows' `affected`.
async fn deleted_and_recorded(pool: &sqlx::PgPool) -> (i64, Vec<i64>) {
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(pool)
        .await
        .unwrap();
    let recorded: Vec<i64> = sqlx::query_scalar(
        "SELECT affected FROM postal.operator_audit WHERE action = 'cleanup' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    (25 - left, recorded)
}

/// `postal cleanup --published-retention 1h --batch <batch>` on `url`.
fn cleanup_command(url: &str, batch: &str) -> std::process::Command {
    let mut c = std::process::Command::new(crate::procs::bin_dir().join("postal"));
    c.args(["cleanup", "--published-retention", "1h", "--batch", batch])
        .env("DATABASE_URL", url)
        .env("POSTAL_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    c
}

/// Guarantee: a `postal cleanup` that fails after some of its batches committed (here its
/// third batch's lock wait ends in `lock_timeout`) leaves its audit row saying how many rows
/// it did delete (20), not 0: each batch counts itself in the audit row in its own
/// transaction; and the row keeps the error the run ended with (migration 38).
///
/// Broken: the count was written once, after the last batch; a cleanup that failed midway
/// deleted 20 rows and its audit row said `affected` 0. Before migration 38 the row kept no
/// error: a failed run looked like one still running.
#[tokio::test]
async fn a_cleanup_that_fails_midway_records_the_rows_it_deleted() {
    let db = services().await.fresh_db().await;
    let holder = published_rows_with_the_newest_locked(&db.pool).await;
    let out = cleanup_command(&db.url, "10").output().unwrap();
    holder.rollback().await.unwrap();
    assert!(
        !out.status.success(),
        "the cleanup should fail on the locked row: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (deleted, recorded) = deleted_and_recorded(&db.pool).await;
    assert_eq!(
        deleted, 20,
        "two batches of 10 deleted before the locked row"
    );
    assert_eq!(recorded, vec![20], "the audit row counts what was deleted");
    let (ended, error) = outcome(&db.pool).await;
    assert!(ended, "the audit row says the run ended");
    let error = error.expect("the audit row keeps the error the run ended with");
    assert!(
        error.contains("lock timeout"),
        "the error's line, as the command printed it: {error}"
    );
}

/// Whether the one `cleanup` audit row says it ended, and the error it keeps.
async fn outcome(pool: &sqlx::PgPool) -> (bool, Option<String>) {
    sqlx::query_as(
        "SELECT ended_at IS NOT NULL, error FROM postal.operator_audit WHERE action = 'cleanup'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Guarantee: a `postal cleanup` killed (SIGKILL) while a batch waits leaves its audit row
/// with the rows its committed batches deleted (20).
///
/// Broken: its audit row said `affected` 0 while 20 rows were gone.
#[tokio::test]
async fn a_cleanup_killed_midway_records_the_rows_it_deleted() {
    let db = services().await.fresh_db().await;
    let holder = published_rows_with_the_newest_locked(&db.pool).await;
    let mut child =
        postal_integration_tests::KillOnDrop(cleanup_command(&db.url, "10").spawn().unwrap());
    // Waits until the third batch waits on the locked row (the first two committed).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE 'DELETE FROM postal.outbox%'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cleanup never waited on the locked row"
        );
        assert!(child.0.try_wait().unwrap().is_none(), "the cleanup ended");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    holder.rollback().await.unwrap();
    let (deleted, recorded) = deleted_and_recorded(&db.pool).await;
    assert_eq!(
        deleted, 20,
        "two batches of 10 deleted before the locked row"
    );
    assert_eq!(recorded, vec![20], "the audit row counts what was deleted");
    assert_eq!(
        outcome(&db.pool).await,
        (false, None),
        "a killed run never ended: its row says so (no end, no error)"
    );
}

/// Guarantee: two `postal cleanup` runs at once on the same table (each batch takes the
/// cleanup lock anew, so their batches may interleave) leave two audit rows whose counts add
/// up to the rows deleted: 2,000 published rows, both runs with `--batch 50`, all deleted,
/// counted once. (Passes on main too; seen split [2000, 0] and [100, 1900]: a run that finds
/// the lock taken at a later batch ends there.)
#[tokio::test]
async fn two_cleanups_at_once_count_each_deleted_row_once() {
    let db = services().await.fresh_db().await;
    sqlx::query(
        "SELECT postal.enqueue('t', 'k' || i, 'e', '{}'::jsonb) FROM generate_series(1, 2000) AS i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE postal.outbox SET status = 'published', published_at = now() - interval '3 hours'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let run =
        || postal_integration_tests::KillOnDrop(cleanup_command(&db.url, "50").spawn().unwrap());
    let (mut a, mut b) = (run(), run());
    for child in [&mut a, &mut b] {
        let out = child.0.wait().unwrap();
        assert!(out.success(), "a cleanup failed");
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let recorded: Vec<i64> = sqlx::query_scalar(
        "SELECT affected FROM postal.operator_audit WHERE action = 'cleanup' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!("two cleanups at once: affected {recorded:?}");
    assert_eq!(left, 0, "all deleted");
    assert_eq!(recorded.len(), 2, "one row per run: {recorded:?}");
    assert_eq!(recorded.iter().sum::<i64>(), 2000, "{recorded:?}");
}
