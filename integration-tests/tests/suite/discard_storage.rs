//! Discarded parked events are kept whole in the database, each once: discards racing each other and a requeue
//! over the same parked events, and `postal audit show` of discarded events too large to hold.

use std::collections::BTreeMap;

use postal_admin::audit::Operator;
use postal_admin::parked::{self, DiscardBatch};
use postal_integration_tests::{services, unique};
use sqlx::PgPool;
use uuid::Uuid;

/// Parks `n` events of topic `topic` (keys `k0`..`k9`) as the relay parks them; their seqs.
async fn park(pool: &PgPool, topic: &str, n: i32) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    held, last_error)
         SELECT gen_random_uuid(), $1, 'k' || (i % 10), 'e', convert_to('{\"i\": ' || i || '}', 'UTF8'),
                'failed', true, 'refused'
         FROM generate_series(1, $2) AS i ORDER BY i RETURNING seq",
    )
    .bind(topic)
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Guarantee: two discards and a requeue of the same 3,000 parked events, run at once (in
/// batches of 50), leave each event in exactly one place — pending in the outbox (requeued),
/// or kept once in `postal.operator_audit_events` (discarded) — never both, never twice,
/// never lost; and each action's audit row counts exactly what it changed.
///
/// Would be broken by a discard that deletes rows another action holds, keeps an event twice,
/// or counts a batch it did not commit. Passes on main.
#[tokio::test]
async fn discards_and_a_requeue_racing_leave_each_event_in_one_place_counted_once() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("discard-race");
    let seqs = park(&db.pool, &topic, 3000).await;
    let ids: BTreeMap<i64, Uuid> = sqlx::query_as("SELECT seq, event_id FROM postal.outbox")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let batch = DiscardBatch {
        rows: 50,
        bytes: 64 << 20,
    };
    let target = serde_json::json!({ "topic": topic });
    let discard =
        |who: &'static str| {
            let (pool, seqs, target) = (db.pool.clone(), seqs.clone(), target.clone());
            async move {
                parked::discard_seqs_in(&pool, &Operator::cli(who), &target, &seqs, batch, |_| {
                    Ok(())
                })
                .await
                .unwrap()
            }
        };
    let requeue = {
        let (pool, seqs, target) = (db.pool.clone(), seqs.clone(), target.clone());
        async move {
            parked::requeue_seqs(&pool, &Operator::cli("r"), &target, &seqs, |_| {})
                .await
                .unwrap()
        }
    };
    let (d1, d2, r) = tokio::join!(discard("d1"), discard("d2"), requeue);

    let pending: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM postal.outbox WHERE status = 'pending' ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let still_parked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE status = 'failed'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let kept: Vec<(i64, Uuid, String)> = sqlx::query_as(
        "SELECT e.seq, e.event_id, a.actor FROM postal.operator_audit_events e
         JOIN postal.operator_audit a ON a.id = e.audit_id ORDER BY e.seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let affected: BTreeMap<String, i64> =
        sqlx::query_as("SELECT actor, affected FROM postal.operator_audit")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    eprintln!(
        "discard d1 {d1}, discard d2 {d2}, requeue {r}; pending {}, kept {}, parked {still_parked}",
        pending.len(),
        kept.len()
    );
    assert_eq!(still_parked, 0, "every event was acted on by one of them");
    let mut places: BTreeMap<i64, usize> = BTreeMap::new();
    for s in pending.iter().chain(kept.iter().map(|(s, _, _)| s)) {
        *places.entry(*s).or_default() += 1;
    }
    assert_eq!(
        places.keys().copied().collect::<Vec<_>>(),
        seqs,
        "every event is somewhere"
    );
    assert!(
        places.values().all(|&n| n == 1),
        "an event in two places: {:?}",
        places
            .iter()
            .filter(|(_, &n)| n > 1)
            .take(5)
            .collect::<Vec<_>>()
    );
    for (seq, id, _) in &kept {
        assert_eq!(ids.get(seq), Some(id), "kept as itself");
    }
    let kept_by = |who: &str| kept.iter().filter(|(_, _, a)| a == who).count() as u64;
    assert_eq!(
        (d1, d2, r),
        (kept_by("d1"), kept_by("d2"), pending.len() as u64)
    );
    assert_eq!(
        affected,
        BTreeMap::from([
            ("d1".to_owned(), d1 as i64),
            ("d2".to_owned(), d2 as i64),
            ("r".to_owned(), r as i64)
        ]),
        "each audit row counts what its action changed"
    );
}

/// Runs `postal <args>` on `url` under `peak_rss`, stdout to `out`: exit code, peak RSS in
/// KiB, stderr.
fn postal_with_peak_rss(url: &str, args: &[&str], out: &std::path::Path) -> (i32, i64, String) {
    let file = std::fs::File::create(out).unwrap();
    let run = std::process::Command::new(crate::procs::bin_dir().join("peak_rss"))
        .arg(crate::procs::bin_dir().join("postal"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("POSTAL_LOG", "warn")
        .stdout(file)
        .output()
        .expect("run the postal CLI");
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    let peak = stderr
        .lines()
        .find_map(|l| l.strip_prefix("peak_rss_kib="))
        .unwrap_or_else(|| panic!("no peak reported: {stderr}"))
        .parse()
        .unwrap();
    (run.status.code().unwrap_or(-1), peak, stderr)
}

/// Guarantee: `postal audit show` of a discard prints each kept event whole, as one JSON line,
/// with memory bounded by a piece of it rather than by its size: a 150 MiB text payload of
/// multi-byte characters (a right-to-left override among them, escaped for the terminal) and a
/// 12 MiB binary one (NUL and 0xff: printed in base64) come back exactly, under 96 MiB of
/// peak RSS (about 60 MiB measured, whatever the event's size; the CLI alone is about 24 MiB).
///
/// Broken: each event was read whole and printed from one string: the payload, its JSON, and
/// the JSON escaped for the terminal, several copies of the event at once (480 MiB measured
/// for three 90 MiB events).
#[tokio::test]
async fn audit_show_prints_large_discarded_events_whole_in_bounded_memory() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("show-big");
    // 9 bytes a unit: pieces of 3 MiB cut characters in two.
    let unit = "a\u{20ac}\u{202e}\u{fc}";
    let units = 150 * (1 << 20) / unit.len() as i32;
    let bin_pairs = 6 * (1 << 20);
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    held, last_error)
         VALUES (gen_random_uuid(), $1, 'text', 'big', convert_to(repeat($2, $3), 'UTF8'),
                 'failed', true, 'too large'),
                (gen_random_uuid(), $1, 'binary', 'big', decode(repeat('00ff', $4), 'hex'),
                 'failed', true, 'too large')",
    )
    .bind(&topic)
    .bind(unit)
    .bind(units)
    .bind(bin_pairs)
    .execute(&db.pool)
    .await
    .unwrap();
    let dir = std::env::temp_dir().join(unique("show-big"));
    std::fs::create_dir_all(&dir).unwrap();
    let (code, _, stderr) = postal_with_peak_rss(
        &db.url,
        &["failed", "discard", "--all"],
        &dir.join("discard.out"),
    );
    assert_eq!(code, 0, "discard: {stderr}");
    let id: i64 = sqlx::query_scalar("SELECT id FROM postal.operator_audit")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let shown = dir.join("show.out");
    let (code, peak_kib, stderr) =
        postal_with_peak_rss(&db.url, &["audit", "show", &id.to_string()], &shown);
    assert_eq!(code, 0, "audit show: {stderr}");
    let text = std::fs::read_to_string(&shown).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "the entry and the two events");
    assert!(
        !lines[1].contains('\u{202e}'),
        "the override is escaped for the terminal"
    );
    let first: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
    let second: serde_json::Value = serde_json::from_str(lines[2]).unwrap();
    assert_eq!(first["event_key"], "text");
    let payload = first["payload"].as_str().expect("text payload");
    assert_eq!(payload.len(), unit.len() * units as usize);
    assert!(
        payload == unit.repeat(units as usize),
        "the text payload whole"
    );
    assert_eq!(second["event_key"], "binary");
    let expected: String = sqlx::query_scalar(
        "SELECT translate(encode(payload, 'base64'), chr(10), '') FROM postal.operator_audit_events
         WHERE event_key = 'binary'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(second.get("payload").is_none());
    assert!(
        second["payload_base64"].as_str() == Some(expected.as_str()),
        "the binary payload whole, in base64"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    eprintln!("audit show peak RSS {peak_kib} KiB");
    assert!(
        peak_kib < 96 * 1024,
        "audit show's peak RSS was {peak_kib} KiB for a 150 MiB and a 12 MiB event"
    );
}

/// Guarantee: `postal failed discard --all` killed (SIGKILL) between its batches leaves every
/// event in exactly one place — still parked, or kept once in `postal.operator_audit_events` —
/// and its audit row counts exactly the events kept: each batch deletes, keeps and counts in
/// one transaction. Here 50,000 parked events (batches of 1,000), killed once the first batch
/// is kept.
///
/// Would be broken by a batch whose deletion and copy (or count) commit apart. Passes on main.
#[tokio::test]
async fn a_discard_killed_midway_leaves_each_event_parked_or_kept_once_and_counted() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("discard-kill");
    let mut seqs: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    held, last_error)
         SELECT gen_random_uuid(), $1, 'k' || (i % 100), 'e', convert_to(repeat('p', 1000), 'UTF8'),
                'failed', true, 'refused'
         FROM generate_series(1, 50000) AS i RETURNING seq",
    )
    .bind(&topic)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    seqs.sort_unstable();
    let app = unique("killed-discard");
    let sep = if db.url.contains('?') { '&' } else { '?' };
    let url = format!("{}{sep}application_name={app}", db.url);
    let mut child = postal_integration_tests::KillOnDrop(
        std::process::Command::new(crate::procs::bin_dir().join("postal"))
            .args(["failed", "discard", "--all"])
            .env("DATABASE_URL", &url)
            .env("POSTAL_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("postal failed discard"),
    );
    postal_integration_tests::wait::until(
        std::time::Duration::from_secs(60),
        "the first batch kept",
        || {
            let pool = db.pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.operator_audit_events")
                    .fetch_one(&pool)
                    .await
                    .unwrap_or(0)
                    > 0
            }
        },
    )
    .await;
    child.0.kill().expect("SIGKILL the discard");
    child.0.wait().expect("reaped");
    // Its server session ends after it: a COMMIT it sent is applied or not by then.
    postal_integration_tests::wait::until(
        std::time::Duration::from_secs(60),
        "the killed discard's session gone",
        || {
            let (pool, app) = (db.pool.clone(), app.clone());
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind(app)
                .fetch_one(&pool)
                .await
                .unwrap_or(1)
                    == 0
            }
        },
    )
    .await;
    let parked: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM postal.outbox WHERE status = 'failed' ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let kept: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM postal.operator_audit_events ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let affected: i64 = sqlx::query_scalar("SELECT affected FROM postal.operator_audit")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    eprintln!(
        "killed discard: {} kept, {} still parked, affected {affected}",
        kept.len(),
        parked.len()
    );
    assert!(
        !parked.is_empty(),
        "the discard finished before the kill: the test proves nothing (make it larger)"
    );
    let mut all: Vec<i64> = parked.iter().chain(&kept).copied().collect();
    all.sort_unstable();
    assert_eq!(all, seqs, "each event parked or kept, once");
    assert_eq!(
        affected,
        kept.len() as i64,
        "the audit row counts what was kept"
    );
}
