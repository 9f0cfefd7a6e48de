//! Review 46, hostile input: sizes, counts and encodings that the supported write paths
//! (`postal.enqueue`, the application role's `INSERT` on `postal.outbox`) let through, and what
//! the relay, the operator tools and the broker make of them.

use std::collections::BTreeSet;
use std::time::Duration;

use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue, NewEvent};
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{create_topic, kafka_transport, RunningRelay};

const WAIT: Duration = Duration::from_secs(45);

/// Enqueues `n` small events on `topic` over keys `ok0`..`ok4` (Rust `enqueue`); their ids.
async fn small_events(pool: &PgPool, topic: &str, n: usize) -> BTreeSet<Uuid> {
    let mut conn = pool.acquire().await.unwrap();
    let mut ids = BTreeSet::new();
    for i in 0..n {
        let e = NewEvent::json(topic, format!("ok{}", i % 5), "order.created", &i).unwrap();
        ids.insert(enqueue(&mut conn, e).await.unwrap().as_uuid());
    }
    ids
}

/// The outbox's rows as (event id, status, last error).
async fn rows(pool: &PgPool) -> Vec<(Uuid, String, Option<String>)> {
    sqlx::query_as("SELECT event_id, status, last_error FROM postal.outbox ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Waits until the outbox holds exactly `bad` and each of them is parked with a one-line
/// reason; returns the reasons. Panics (naming what is left) after [`WAIT`].
async fn only_parked_left(pool: &PgPool, bad: &BTreeSet<Uuid>, what: &str) -> Vec<String> {
    let res = tokio::time::timeout(WAIT, async {
        loop {
            let left = rows(pool).await;
            let ids: BTreeSet<Uuid> = left.iter().map(|r| r.0).collect();
            if &ids == bad && left.iter().all(|r| r.1 == "failed") {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    match res {
        Ok(left) => {
            let reasons: Vec<String> = left.into_iter().map(|r| r.2.unwrap_or_default()).collect();
            for r in &reasons {
                assert!(
                    !r.is_empty() && r.lines().count() == 1,
                    "{what}: reason {r:?}"
                );
            }
            reasons
        }
        Err(_) => panic!(
            "{what}: after {WAIT:?} the outbox still holds {:?}",
            rows(pool)
                .await
                .into_iter()
                .map(|(id, st, e)| (
                    id,
                    st,
                    e.map(|e| postal_shared::text::bounded(&e, 200).into_owned())
                ))
                .collect::<Vec<_>>()
        ),
    }
}

/// Input: `postal.enqueue(…, p_occurred_at => t)` for t = `infinity`, `-infinity` and
/// `290000-01-01` (all valid PostgreSQL `timestamptz`s, all outside chrono's range), one key
/// each, beside 20 ordinary events of five other keys on the same topic; a Kafka relay.
/// Guarantee: each such call either fails at the call with a one-line error, or its row is
/// parked with a one-line reason; the 20 others are published either way (nothing stalls the
/// relay).
#[tokio::test]
async fn occurred_at_out_of_chronos_range_is_refused_or_parked_and_others_flow() {
    occurred_at_out_of_chronos_range_is_refused_or_parked_and_others_flow_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the rows).
#[tokio::test]
async fn occurred_at_out_of_chronos_range_is_refused_or_parked_and_others_flow_wal() {
    occurred_at_out_of_chronos_range_is_refused_or_parked_and_others_flow_with(true).await;
}

async fn occurred_at_out_of_chronos_range_is_refused_or_parked_and_others_flow_with(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("hostile-time");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut bad = BTreeSet::new();
    for (i, t) in ["infinity", "-infinity", "290000-01-01 00:00:00+00"]
        .iter()
        .enumerate()
    {
        let r = sqlx::query_scalar::<_, Uuid>(
            "SELECT postal.enqueue($1, $2, 'order.created', '{}'::jsonb, p_occurred_at => $3::timestamptz)",
        )
        .bind(&topic)
        .bind(format!("bad{i}"))
        .bind(t)
        .fetch_one(&db.pool)
        .await;
        match r {
            Ok(id) => {
                bad.insert(id);
            }
            Err(e) => assert_eq!(e.to_string().lines().count(), 1, "{t}: {e}"),
        }
    }
    // The same times written around the function (the application role may INSERT): parked
    // by the relay with the reason, their stored times unchanged.
    for (i, (occ, created)) in [
        ("infinity", "now"),
        ("2020-01-01", "-infinity"),
        ("290000-01-01", "290000-01-01"),
    ]
    .iter()
    .enumerate()
    {
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, occurred_at, created_at)
             VALUES ($1, $2, $3, 'order.created', '{}'::bytea, $4::timestamptz, $5::timestamptz)",
        )
        .bind(id)
        .bind(&topic)
        .bind(format!("raw{i}"))
        .bind(occ)
        .bind(created)
        .execute(&db.pool)
        .await
        .unwrap();
        bad.insert(id);
    }
    small_events(&db.pool, &topic, 20).await;
    let relay = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    only_parked_left(&db.pool, &bad, "outside the times").await;
    let kept: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM postal.outbox WHERE status = 'failed'
           AND (occurred_at IN ('infinity', '290000-01-01') OR created_at IN ('-infinity', '290000-01-01'))",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(kept, 3, "the parked rows keep their stored times");
    relay.stop().await;
}

/// Input: an outbox row with 300 headers of a few bytes each (within the size limits; the
/// Rust `enqueue` takes at most `MAX_USER_HEADERS`, 128), written around `postal.enqueue`
/// (which refuses it since migration 31, as a row written before it was not), beside 20
/// ordinary events. Guarantee: the row is parked with a one-line reason before it is sent,
/// and the 20 others are published.
///
/// Broken: the SQL `postal.enqueue` counted no headers and the relay did not either: the
/// event was published, for every Postal consumer (`max_headers` 256 by default, Postal's own
/// headers included) to dead-letter.
#[tokio::test]
async fn an_sql_enqueued_event_with_more_headers_than_enqueue_takes_is_parked() {
    an_sql_enqueued_event_with_more_headers_than_enqueue_takes_is_parked_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the rows).
#[tokio::test]
async fn an_sql_enqueued_event_with_more_headers_than_enqueue_takes_is_parked_wal() {
    an_sql_enqueued_event_with_more_headers_than_enqueue_takes_is_parked_with(true).await;
}

async fn an_sql_enqueued_event_with_more_headers_than_enqueue_takes_is_parked_with(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("hostile-header-count");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let bad: Uuid = sqlx::query_scalar(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, headers)
         VALUES (postal.uuid_v7(), $1, 'bad', 'order.created', '{}'::bytea,
                 (SELECT jsonb_object_agg('x-' || i, 'v') FROM generate_series(1, 300) AS i))
         RETURNING event_id",
    )
    .bind(&topic)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    small_events(&db.pool, &topic, 20).await;
    let relay = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    let reasons = only_parked_left(&db.pool, &BTreeSet::from([bad]), "300 headers").await;
    relay.stop().await;
    assert!(reasons[0].contains("300 user headers"), "{reasons:?}");
}

/// Input: an outbox row inserted by the application role (`postal grant --app` gives it
/// `INSERT` on every column) with `attempts = 2147483647` (i32::MAX) on a topic the relay
/// refuses for good (`<topic>.dlq`, a dead-letter topic outside any allow list), beside 20
/// ordinary events of other keys. Guarantee: the row is parked with a one-line reason and the
/// 20 others are published (the count at its ceiling stalls nothing).
#[tokio::test]
async fn a_stored_row_at_the_attempts_ceiling_is_parked_and_others_flow() {
    a_stored_row_at_the_attempts_ceiling_is_parked_and_others_flow_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the rows).
#[tokio::test]
async fn a_stored_row_at_the_attempts_ceiling_is_parked_and_others_flow_wal() {
    a_stored_row_at_the_attempts_ceiling_is_parked_and_others_flow_with(true).await;
}

async fn a_stored_row_at_the_attempts_ceiling_is_parked_and_others_flow_with(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("hostile-attempts");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let bad = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, attempts)
         VALUES ($1, $2, 'bad', 'order.created', '{}'::bytea, 2147483647)",
    )
    .bind(bad)
    .bind(format!("{topic}.dlq"))
    .execute(&db.pool)
    .await
    .unwrap();
    small_events(&db.pool, &topic, 20).await;
    let relay = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    only_parked_left(&db.pool, &BTreeSet::from([bad]), "attempts at i32::MAX").await;
    relay.stop().await;
}

/// Input: outbox rows inserted by the application role around `postal.enqueue` with topics no
/// Kafka broker takes: with a space, with `/`, non-ASCII (`ordérs`), 250 characters, and
/// `..`; each on its own key, beside 20 ordinary events. Guarantee: each is parked with a
/// one-line reason (nothing is created, no retry loop), and the 20 others are published.
#[tokio::test]
async fn stored_rows_with_topics_kafka_refuses_are_parked_and_others_flow() {
    stored_rows_with_topics_kafka_refuses_are_parked_and_others_flow_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the rows).
#[tokio::test]
async fn stored_rows_with_topics_kafka_refuses_are_parked_and_others_flow_wal() {
    stored_rows_with_topics_kafka_refuses_are_parked_and_others_flow_with(true).await;
}

async fn stored_rows_with_topics_kafka_refuses_are_parked_and_others_flow_with(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("hostile-topics");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut bad = BTreeSet::new();
    for (i, t) in [
        format!("{topic} x"),
        format!("{topic}/x"),
        "ordérs".to_owned(),
        "t".repeat(250),
        "..".to_owned(),
    ]
    .iter()
    .enumerate()
    {
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload)
             VALUES ($1, $2, $3, 'order.created', '{}'::bytea)",
        )
        .bind(id)
        .bind(t)
        .bind(format!("bad{i}"))
        .execute(&db.pool)
        .await
        .unwrap();
        bad.insert(id);
    }
    small_events(&db.pool, &topic, 20).await;
    let relay = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    let reasons = only_parked_left(&db.pool, &bad, "invalid topics").await;
    relay.stop().await;
    for r in reasons {
        assert!(r.to_lowercase().contains("topic"), "{r}");
    }
}

/// Input: Kafka's topic-name collision: events to `<u>.col` are published (the relay creates
/// it), then events to `<u>_col` (a distinct valid name, which the broker refuses to create
/// because `.` and `_` collide in its metric names) beside ordinary events. Guarantee: the
/// colliding topic's events are parked with a one-line reason that says why (names the
/// collision, so an operator knows what to rename), nothing else stalls.
#[tokio::test]
async fn a_topic_colliding_with_an_existing_one_is_parked_with_its_reason() {
    a_topic_colliding_with_an_existing_one_is_parked_with_its_reason_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the rows).
#[tokio::test]
async fn a_topic_colliding_with_an_existing_one_is_parked_with_its_reason_wal() {
    a_topic_colliding_with_an_existing_one_is_parked_with_its_reason_with(true).await;
}

async fn a_topic_colliding_with_an_existing_one_is_parked_with_its_reason_with(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let base = unique("hostile").replace('-', "");
    let (dotted, underscored) = (format!("{base}.col"), format!("{base}_col"));
    let topic = unique("hostile-ok");
    create_topic(&svc.bootstrap, &topic, 1).await;
    small_events(&db.pool, &dotted, 3).await;
    let relay = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    wait::until(WAIT, "the dotted topic's events published", || async {
        rows(&db.pool).await.is_empty()
    })
    .await;
    let mut conn = db.pool.acquire().await.unwrap();
    let mut bad = BTreeSet::new();
    for i in 0..3 {
        let e = NewEvent::json(underscored.as_str(), format!("c{i}"), "order.created", &i).unwrap();
        bad.insert(enqueue(&mut conn, e).await.unwrap().as_uuid());
    }
    drop(conn);
    small_events(&db.pool, &topic, 20).await;
    let reasons = only_parked_left(&db.pool, &bad, "colliding topic").await;
    relay.stop().await;
    for r in reasons {
        assert!(
            r.contains("collide") || r.contains(&dotted),
            "the reason should say that {underscored} collides with {dotted}: {r}"
        );
    }
}

/// Input: `postal.enqueue_bytes` with content types that the Rust `enqueue` refuses
/// (`ContentType::new`: 1–255 bytes, no control characters): one with ESC and a line break
/// (`text/plain\x1b[2J\r\nX-Injected: 1`) and one of 100,000 bytes. Guarantee: both
/// enqueues apply the same rules, so each call fails with a one-line error and writes nothing.
#[tokio::test]
async fn sql_enqueue_refuses_content_types_that_rust_enqueue_refuses() {
    let db = services().await.fresh_db().await;
    for ct in [
        "text/plain\u{1b}[2J\r\nX-Injected: 1".to_owned(),
        format!("application/{}", "x".repeat(100_000)),
    ] {
        assert!(postal_shared::ContentType::new(ct.clone()).is_err());
        let r = sqlx::query_scalar::<_, Uuid>(
            "SELECT postal.enqueue_bytes('orders', 'k', 'order.created', $1, '\\x7b7d'::bytea)",
        )
        .bind(&ct)
        .fetch_one(&db.pool)
        .await;
        match r {
            Ok(id) => panic!(
                "postal.enqueue_bytes wrote {id} with a content type of {} bytes that Rust refuses",
                ct.len()
            ),
            Err(e) => assert_eq!(e.to_string().lines().count(), 1, "{e}"),
        }
    }
    assert_eq!(rows(&db.pool).await.len(), 0);
}

/// GETs `path` on the dashboard at `addr`; `None` when the connection ended without an answer
/// (a handler that panicked).
async fn page(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    let path = path.to_owned();
    let got = tokio::spawn(async move {
        postal_integration_tests::http::request(addr, "GET", &path, &[], "").await
    })
    .await
    .ok()?;
    (got.status != 0).then_some((got.status, got.body))
}

/// Input: a row scheduled for ever (`available_at = 'infinity'`, held: `postal.enqueue` refuses
/// `p_deliver_at => 'infinity'`, the application role can INSERT it; it holds its key) and a row the application role inserted already parked
/// with `occurred_at`, `created_at` and `available_at` = `infinity`; then every dashboard page
/// that lists or shows them (overview, parked list and detail, blocked keys, lookup by id).
/// Guarantee: each page answers (a page, or a one-line error page); none ends the connection
/// without an answer.
#[tokio::test]
async fn dashboard_pages_answer_over_timestamps_outside_chronos_range() {
    use postal_admin::web::Dashboard;
    let db = services().await.fresh_db().await;
    // `postal.enqueue` refuses `p_deliver_at => 'infinity'` now (migration 0023); the
    // application role can still INSERT such a row.
    let scheduled = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, held,
                                    available_at)
         VALUES ($1, 'orders', 'sched', 'order.created', '{}'::bytea, true, 'infinity')",
    )
    .bind(scheduled)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("SELECT postal.enqueue('orders', 'sched', 'order.created', '{}'::jsonb)")
        .execute(&db.pool)
        .await
        .unwrap();
    let parked = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status, held,
                                    last_error, occurred_at, created_at, available_at)
         VALUES ($1, 'orders', 'k', 'order.created', '{}'::bytea, 'failed', true, 'boom',
                 'infinity', 'infinity', 'infinity')",
    )
    .bind(parked)
    .execute(&db.pool)
    .await
    .unwrap();
    let addr = crate::common::dashboard::start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let mut dropped = Vec::new();
    for path in [
        "/".to_owned(),
        "/parked".to_owned(),
        format!("/parked/{parked}"),
        "/blocked".to_owned(),
        format!("/lookup?event_id={parked}"),
        format!("/lookup?event_id={scheduled}"),
        "/audit".to_owned(),
    ] {
        match page(addr, &path).await {
            Some((status, body)) => {
                if status >= 400 {
                    assert!(body.len() < 4096, "{path}: {status} {body}");
                }
            }
            None => dropped.push(path),
        }
    }
    assert!(dropped.is_empty(), "no answer from {dropped:?}");
}

/// Input: dashboard paths and queries with numbers and encodings out of range: dead-letter ids
/// `-1`, `0`, `9223372036854775807`, `99999999999999999999` and `1e3`; parked ids that are
/// not UUIDs (`%00`, 10,000 characters, `%FF%FE`); lookup and filter values with invalid
/// UTF-8 percent-escapes and 50,000 characters; a time filter of year 300000 (NUL in a filter:
/// [`a_nul_in_a_filter_gets_a_400_not_a_database_error`]).
/// Guarantee: every answer is a page or a one-line error page under 4 KiB (400/404, never a
/// 500 from the database, never a dropped connection), and it echoes no raw `<`.
#[tokio::test]
async fn out_of_range_ids_and_query_values_get_short_errors() {
    use postal_admin::web::Dashboard;
    let db = services().await.fresh_db().await;
    let addr = crate::common::dashboard::start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let long = "a".repeat(50_000);
    let paths = vec![
        "/dead-letters/-1".to_owned(),
        "/dead-letters/0".to_owned(),
        "/dead-letters/9223372036854775807".to_owned(),
        "/dead-letters/99999999999999999999".to_owned(),
        "/dead-letters/1e3".to_owned(),
        "/parked/%00".to_owned(),
        format!("/parked/{}", "f".repeat(10_000)),
        "/parked/%FF%FE".to_owned(),
        "/lookup?event_id=%00".to_owned(),
        "/lookup?event_id=%FF%FE%3Cscript%3E".to_owned(),
        format!("/lookup?key={long}"),
        "/parked?key=%FF%FE".to_owned(),
        format!("/parked?reason={long}"),
        "/parked?since=300000-01-01T00:00".to_owned(),
        "/parked?until=-262144-01-01T00:00".to_owned(),
        "/parked?since=%3Cscript%3Ealert(1)%3C/script%3E".to_owned(),
        "/dead-letters?error=%FF".to_owned(),
        format!("/dead-letters?error={long}"),
        "/blocked?key=%00".to_owned(),
        "/audit?limit=-1&page=-1&before=-9223372036854775808".to_owned(),
    ];
    let bad = short_answers(addr, &paths).await;
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// What is wrong with the dashboard's answers to `paths`: none, a 5xx, an error page over
/// 4 KiB, or an echoed `<script>`.
async fn short_answers(addr: std::net::SocketAddr, paths: &[String]) -> Vec<String> {
    let mut bad = Vec::new();
    for path in paths {
        match page(addr, path).await {
            None => bad.push(format!("{}: no answer", &path[..path.len().min(80)])),
            Some((status, body)) => {
                let short = &path[..path.len().min(80)];
                if status >= 500 {
                    bad.push(format!(
                        "{short}: {status} {}",
                        postal_shared::text::bounded(&body, 300)
                    ));
                } else if status >= 400 && body.len() > 4096 {
                    bad.push(format!("{short}: {status} with {} bytes", body.len()));
                }
                if body.contains("<script>") {
                    bad.push(format!("{short}: echoes <script>"));
                }
            }
        }
    }
    bad
}

/// Input: a NUL (`%00`) in the filter fields of the parked, dead-letter and lookup pages
/// (`/parked?topic=%00`, `/parked?key=%00`, `/dead-letters?consumer=%00`,
/// `/lookup?consumer=%00&event_id=…`). Guarantee: a 400 with a one-line error saying what is
/// wrong with the field (no stored key, topic or consumer can hold a NUL), not a 500 carrying
/// PostgreSQL's encoding error.
#[tokio::test]
async fn a_nul_in_a_filter_gets_a_400_not_a_database_error() {
    use postal_admin::web::Dashboard;
    let db = services().await.fresh_db().await;
    let addr = crate::common::dashboard::start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let paths: Vec<String> = [
        "/parked?topic=%00",
        "/parked?key=a%00b",
        "/dead-letters?consumer=%00",
        "/lookup?consumer=%00&event_id=00000000-0000-0000-0000-000000000001",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bad = short_answers(addr, &paths).await;
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Runs `postal <args>` on `url` under `peak_rss` (which reports that one process's peak
/// resident set), stdout to `out`: its exit code, its peak RSS in KiB, and its stderr.
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

/// Guarantee: `postal failed discard --all` discards parked events however large their sum
/// is, with the CLI's memory bounded: each event is moved whole, inside the database, from
/// the outbox to `postal.operator_audit_events` (one row each, under the discard's audit row)
/// by the statement that deletes it, in batches bounded by bytes (64 MiB) as well as count;
/// the audit row counts them; `postal audit show` still has them. Here three parked events of
/// 90 MiB each (283,115,520 payload bytes, more than a jsonb value can hold): all three
/// discarded, the CLI's peak RSS under 100 MiB (one event's size; 22 MiB measured), and
/// `postal audit show`, which prints them whole, holds a piece of one at a time (under one
/// event's size; 54 MiB measured, 480 MiB when it read each event whole).
///
/// Broken: every batch (up to 1,000 events by count) went through the CLI and was appended
/// to one jsonb `removed` field of the audit row: the discard failed with `total size of
/// jsonb array elements exceeds the maximum of 268435455 bytes`, discarded nothing, left an
/// audit row of matched 3 / affected 0, and the CLI held the events several times over (a
/// 1.5 GB peak for 272 MB of events).
#[tokio::test]
async fn discarding_parked_events_larger_than_a_jsonb_value_keeps_them_in_the_database() {
    const MIB: i64 = 1 << 20;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("big-discard");
    // Built by the server, parked as the relay parks them: no 90 MiB value in this process.
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    held, last_error)
         SELECT gen_random_uuid(), $1, 'k' || i, 'big', convert_to(repeat('x', $2), 'UTF8'),
                'failed', true, 'too large'
         FROM generate_series(1, 3) AS i",
    )
    .bind(&topic)
    .bind((90 * MIB) as i32)
    .execute(&db.pool)
    .await
    .unwrap();
    let dir = std::env::temp_dir().join(unique("big-discard"));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("discard.out");
    let (code, peak_kib, stderr) =
        postal_with_peak_rss(&db.url, &["failed", "discard", "--all"], &out);
    let printed = std::fs::read_to_string(&out).unwrap();
    assert_eq!(code, 0, "discard: {printed}{stderr}");
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(parked, 0, "all three discarded: {printed}");
    let (id, matched, affected): (i64, Option<i64>, i64) = sqlx::query_as(
        "SELECT id, matched, affected FROM postal.operator_audit WHERE action = 'discard'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((matched, affected), (Some(3), 3));
    let kept: Vec<i64> = sqlx::query_scalar(
        "SELECT octet_length(payload)::int8 FROM postal.operator_audit_events
         WHERE audit_id = $1 AND payload = convert_to(repeat('x', $2), 'UTF8')",
    )
    .bind(id)
    .bind((90 * MIB) as i32)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(kept.len(), 3, "each event kept whole");
    assert!(
        peak_kib < 100 * 1024,
        "the CLI's peak RSS was {peak_kib} KiB for 270 MiB of events"
    );
    // `audit show` reads them back one at a time: the entry and three events.
    let shown = dir.join("show.out");
    let (code, show_kib, stderr) =
        postal_with_peak_rss(&db.url, &["audit", "show", &id.to_string()], &shown);
    assert_eq!(code, 0, "{stderr}");
    let lines = std::io::BufRead::lines(std::io::BufReader::new(
        std::fs::File::open(&shown).unwrap(),
    ))
    .count();
    assert_eq!(lines, 4, "the entry and the three events");
    // A piece of one event in memory at a time (`audit show` streams each payload).
    assert!(
        show_kib < 90 * 1024,
        "audit show's peak RSS was {show_kib} KiB for three 90 MiB events"
    );
    eprintln!("discard peak RSS {peak_kib} KiB; audit show peak RSS {show_kib} KiB");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Guarantee: a discard's batches are bounded by bytes as well as count: with a bound of
/// 1 MiB, five parked events of 600 KiB go in five batches (`keep` sees one at a time: two
/// would exceed the bound), every event is kept whole under the audit row, and the row counts
/// five. An event larger than the bound still goes, alone in its batch.
///
/// Broken: batches were bounded by count only (1,000 events, whatever their size).
#[tokio::test]
async fn discard_batches_are_bounded_by_bytes() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("bounded-discard");
    let seqs: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    held, last_error)
         SELECT gen_random_uuid(), $1, 'k', 'big',
                convert_to(repeat('y', CASE WHEN i = 5 THEN 3 * 1048576 ELSE 600 * 1024 END), 'UTF8'),
                'failed', true, 'too large'
         FROM generate_series(1, 5) AS i RETURNING seq",
    )
    .bind(&topic)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut batches = Vec::new();
    let done = postal_admin::parked::discard_seqs_in(
        &db.pool,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "all": true }),
        &seqs,
        postal_admin::parked::DiscardBatch {
            rows: 1000,
            bytes: 1 << 20,
        },
        |batch| {
            batches.push(batch.iter().map(|d| d.payload_bytes).collect::<Vec<_>>());
            Ok(())
        },
    )
    .await
    .unwrap();
    assert_eq!(done, 5);
    assert_eq!(
        batches,
        [
            vec![614400],
            vec![614400],
            vec![614400],
            vec![614400],
            vec![3145728]
        ]
    );
    let (affected, kept): (i64, i64) = sqlx::query_as(
        "SELECT a.affected, (SELECT sum(octet_length(payload))::int8
                             FROM postal.operator_audit_events WHERE audit_id = a.id)
         FROM postal.operator_audit a",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((affected, kept), (5, 4 * 614400 + 3145728));
}
