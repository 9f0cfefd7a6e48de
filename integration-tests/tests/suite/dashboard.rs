//! The operator dashboard over HTTP: hostile values render inert, actions are refused across
//! origins, without the CSRF token, when read-only or over the cap, and otherwise ask for
//! confirmation and are audited; releasing a blocked key runs its head first, then the rest
//! in order; every page reads the large tables through indexes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use postal_admin::web::{serve, Dashboard};
use postal_integration_tests::http::{csrf, form, form_fields, pairs, request};
use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue_batch, NewEvent, Task, TaskConfig, TaskError, TaskTransport};

use crate::common::dashboard::{click_and_confirm, park, post, start, status};
use crate::common::{fast_config, RunningRelay};

/// Guarantee: an event whose key, type, headers, payload and error hold markup is shown as
/// text on every page (escaped), never as markup; every answer carries a strict
/// Content-Security-Policy (scripts only from the dashboard itself), and no page shows the
/// database password.
#[tokio::test]
async fn hostile_values_render_inert_under_a_strict_policy() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-hostile");
    let evil = "<script>alert(1)</script><img src=x onerror=alert(2)>";
    let e = NewEvent::json(
        topic.as_str(),
        evil,
        "evil.<b>type</b>",
        &serde_json::json!({ "html": evil }),
    )
    .unwrap()
    .with_header("x-note", evil)
    .unwrap();
    let id = park(&db.pool, vec![e], &format!("broker said {evil}")).await[0];
    let addr = start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let password = db
        .url
        .split(':')
        .nth(2)
        .and_then(|s| s.split('@').next())
        .unwrap_or("");
    for path in [
        "/".to_owned(),
        "/parked".to_owned(),
        format!(
            "/parked?key={}",
            postal_integration_tests::http::form(&[("k", evil)]).trim_start_matches("k=")
        ),
        format!("/parked/{id}"),
        "/blocked".to_owned(),
    ] {
        let a = request(addr, "GET", &path, &[], "").await;
        assert_eq!(a.status, 200, "{path}: {}", a.body);
        assert!(
            !a.body.contains("<script>alert"),
            "{path} renders a script tag"
        );
        assert!(!a.body.contains("<img src=x"), "{path} renders an img tag");
        if path != "/" {
            assert!(
                a.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
                "{path} shows the key as text"
            );
        }
        let csp = a.header("content-security-policy").expect("a CSP header");
        assert!(
            csp.contains("script-src 'self'") && csp.contains("default-src 'none'"),
            "{csp}"
        );
        assert_eq!(a.header("x-content-type-options"), Some("nosniff"));
        if password.len() > 3 {
            assert!(
                !a.body.contains(password),
                "{path} shows the database password"
            );
        }
    }
}

/// Guarantee: a POST from another origin, or without the page's CSRF token, changes nothing;
/// a proper one first answers with a confirmation showing the count, acts only when the
/// confirmed count still matches, and leaves an audit row (who, what, how many) — for a
/// discard with the discarded event itself.
#[tokio::test]
async fn actions_are_same_origin_confirmed_and_audited() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-actions");
    let ids = park(
        &db.pool,
        (0..3)
            .map(|i| NewEvent::json(topic.as_str(), format!("k{i}"), "order.placed", &i).unwrap())
            .collect(),
        "timeout",
    )
    .await;
    let addr = start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let page = request(addr, "GET", "/parked", &[], "").await;
    let token = csrf(&page.body).expect("the page's forms carry a CSRF token");
    let one = ids[0].to_string();

    let cross = request(
        addr,
        "POST",
        "/parked/requeue",
        &[("Origin", "http://attacker.example")],
        &form(&[
            ("csrf", &token),
            ("id", &one),
            ("confirm", "yes"),
            ("expected", "1"),
        ]),
    )
    .await;
    assert_eq!(cross.status, 403, "{}", cross.body);
    let no_origin = request(
        addr,
        "POST",
        "/parked/requeue",
        &[],
        &form(&[
            ("csrf", &token),
            ("id", &one),
            ("confirm", "yes"),
            ("expected", "1"),
        ]),
    )
    .await;
    assert_eq!(no_origin.status, 403, "{}", no_origin.body);
    let no_token = post(
        addr,
        "/parked/requeue",
        &[("id", &one), ("confirm", "yes"), ("expected", "1")],
    )
    .await;
    assert_eq!(no_token.status, 403, "{}", no_token.body);
    assert_eq!(status(&db.pool, ids[0]).await.as_deref(), Some("failed"));

    // Asks first, with the count; acts on exactly what it showed.
    let (_, done) =
        click_and_confirm(addr, "/parked/requeue", &[("csrf", &token), ("id", &one)]).await;
    assert!(done.body.contains("Requeued 1 event(s)"), "{}", done.body);
    assert_eq!(status(&db.pool, ids[0]).await.as_deref(), Some("pending"));
    let two = ids[1].to_string();
    let (_, done) =
        click_and_confirm(addr, "/parked/discard", &[("csrf", &token), ("id", &two)]).await;
    assert!(
        done.body.contains("Discarded 1 parked event(s)"),
        "{}",
        done.body
    );
    assert_eq!(status(&db.pool, ids[1]).await, None);

    // A filter's confirmation carries the events it showed: one parked after it is left alone.
    let ask = post(
        addr,
        "/parked/discard",
        &[("csrf", &token), ("topic", &topic)],
    )
    .await;
    assert!(
        ask.body.contains("id=\"confirm-count\"><b>1</b>"),
        "{}",
        ask.body
    );
    let late = park(
        &db.pool,
        vec![NewEvent::json(topic.as_str(), "k9", "order.placed", &9).unwrap()],
        "timeout",
    )
    .await[0];
    let confirmed = form_fields(&ask.body, "confirm", 0);
    let done = post(addr, "/parked/discard", &pairs(&confirmed)).await;
    assert!(
        done.body.contains("Discarded 1 parked event(s)"),
        "{}",
        done.body
    );
    assert_eq!(status(&db.pool, ids[2]).await, None);
    assert_eq!(
        status(&db.pool, late).await.as_deref(),
        Some("failed"),
        "an event parked after the confirmation was shown is not discarded by it"
    );

    let audit: Vec<(String, String, i64, Option<serde_json::Value>)> = sqlx::query_as(
        "SELECT actor, action, affected,
                (SELECT jsonb_agg(jsonb_build_object('event_id', event_id,
                                                     'payload', convert_from(payload, 'UTF8')))
                 FROM postal.operator_audit_events WHERE audit_id = a.id)
         FROM postal.operator_audit a ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(audit.len(), 3, "{audit:?}");
    assert_eq!((audit[0].1.as_str(), audit[0].2), ("requeue", 1));
    assert_eq!((audit[1].1.as_str(), audit[1].2), ("discard", 1));
    assert_eq!(audit[0].0, "local");
    let removed = audit[1].3.as_ref().expect("the discarded event is kept");
    assert_eq!(removed[0]["event_id"], serde_json::json!(two));
    assert_eq!(removed[0]["payload"], serde_json::json!("1"));
    let page = request(addr, "GET", "/audit", &[], "").await;
    assert!(
        page.body.contains("discard") && page.body.contains("requeue"),
        "{}",
        page.body
    );
}

/// Guarantee: the CLI's actions go through the dashboard's audited path: after `postal failed
/// requeue` and `postal failed discard` (the real binary), the Audit page lists both with who
/// ran them (the OS user, via `cli`, the database role) and how many they matched and
/// affected, beside a dashboard action (via `dashboard`). (Before, CLI actions left no row and
/// the page said "No actions yet".)
#[tokio::test]
async fn cli_actions_appear_on_the_audit_page() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-cli-audit");
    let ids = park(
        &db.pool,
        (0..3)
            .map(|i| NewEvent::json(topic.as_str(), format!("k{i}"), "order.placed", &i).unwrap())
            .collect(),
        "timeout",
    )
    .await;
    for (verb, id) in [("requeue", ids[0]), ("discard", ids[1])] {
        let out = std::process::Command::new(crate::procs::bin_dir().join("postal"))
            .args(["failed", verb, "--id", &id.to_string()])
            .env("DATABASE_URL", &db.url)
            .env("POSTAL_LOG", "warn")
            .output()
            .expect("postal runs");
        assert!(
            out.status.success(),
            "{verb}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let addr = start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let page = request(addr, "GET", "/parked", &[], "").await;
    let token = csrf(&page.body).expect("the page's forms carry a CSRF token");
    let (_, done) = click_and_confirm(
        addr,
        "/parked/requeue",
        &[("csrf", &token), ("id", &ids[2].to_string())],
    )
    .await;
    assert!(done.body.contains("Requeued 1 event(s)"), "{}", done.body);

    let role: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let os_user = nix::unistd::User::from_uid(nix::unistd::getuid())
        .unwrap()
        .expect("the test's OS user")
        .name;
    let page = request(addr, "GET", "/audit", &[], "").await;
    assert!(!page.body.contains("No actions yet"), "{}", page.body);
    let rows: Vec<&str> = page.body.split("<tr>").skip(2).collect();
    assert_eq!(rows.len(), 3, "three actions: {}", page.body);
    // Newest first: the dashboard's requeue, then the CLI's discard and requeue.
    assert!(
        rows[0].contains(">local<") && rows[0].contains(">dashboard<"),
        "{}",
        rows[0]
    );
    for (row, action) in [(rows[1], "discard"), (rows[2], "requeue")] {
        for cell in [os_user.as_str(), "cli", role.as_str(), action] {
            assert!(
                row.contains(&format!(">{cell}<")),
                "{action}: no {cell:?} in {row}"
            );
        }
        assert!(
            row.contains(&format!(
                "{}",
                if action == "discard" { ids[1] } else { ids[0] }
            )),
            "{row}"
        );
    }
}

/// Guarantee: by default the dashboard is read-only (no action buttons; an action POST is
/// refused and changes nothing), and an action matching more events than the cap is refused
/// with the count and changes nothing.
#[tokio::test]
async fn read_only_by_default_and_actions_are_capped() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-cap");
    let ids = park(
        &db.pool,
        (0..3)
            .map(|i| NewEvent::json(topic.as_str(), "k", "t", &i).unwrap())
            .collect(),
        "timeout",
    )
    .await;
    let ro = start(Dashboard::new(db.pool.clone())).await;
    let page = request(ro, "GET", "/parked", &[], "").await;
    assert!(
        !page.body.contains("data-test=\"requeue"),
        "read-only page shows buttons"
    );
    let refused = post(
        ro,
        "/parked/requeue",
        &[("topic", &topic), ("confirm", "yes"), ("expected", "3")],
    )
    .await;
    assert_eq!(refused.status, 403, "{}", refused.body);

    let capped = start(Dashboard::new(db.pool.clone()).actions(true).action_cap(2)).await;
    let page = request(capped, "GET", "/parked", &[], "").await;
    let token = csrf(&page.body).unwrap();
    let over = post(
        capped,
        "/parked/discard",
        &[
            ("csrf", &token),
            ("topic", &topic),
            ("confirm", "yes"),
            ("expected", "3"),
        ],
    )
    .await;
    assert_eq!(over.status, 400, "{}", over.body);
    assert!(
        over.body.contains("3 events match, more than the cap of 2"),
        "{}",
        over.body
    );
    for id in ids {
        assert_eq!(status(&db.pool, id).await.as_deref(), Some("failed"));
    }
}

/// Guarantee: the standalone dashboard refuses, before binding, to listen on a non-loopback
/// address without a token, with one line that says what to do; with a token, a request
/// without it is sent to sign in (or refused), and one with it is served; an embedded router
/// needs a choice of authentication.
#[tokio::test]
async fn a_non_loopback_bind_needs_a_token() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let err = serve(
        "0.0.0.0:0".parse().unwrap(),
        Dashboard::new(db.pool.clone()),
    )
    .await
    .expect_err("refused");
    assert_eq!(
        err.to_string(),
        "refusing to serve the dashboard on 0.0.0.0:0 without a token: set --token (POSTAL_DASHBOARD_TOKEN), or listen on 127.0.0.1"
    );
    assert!(Dashboard::new(db.pool.clone()).router().is_err());

    let addr = start(Dashboard::new(db.pool.clone()).token("s3cret-token")).await;
    let anon = request(addr, "GET", "/parked", &[], "").await;
    assert_eq!(anon.status, 303, "{anon:?}");
    assert!(anon.header("location").unwrap().ends_with("/login"));
    let wrong = request(
        addr,
        "GET",
        "/parked",
        &[("Authorization", "Bearer nope")],
        "",
    )
    .await;
    assert_eq!(wrong.status, 303);
    let ok = request(
        addr,
        "GET",
        "/parked",
        &[("Authorization", "Bearer s3cret-token")],
        "",
    )
    .await;
    assert_eq!(ok.status, 200);
    let login = post(addr, "/login", &[("token", "s3cret-token")]).await;
    let cookie = login
        .header("set-cookie")
        .expect("signing in sets a cookie")
        .to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let c = cookie.split(';').next().unwrap();
    let ok = request(addr, "GET", "/", &[("Cookie", c)], "").await;
    assert_eq!(ok.status, 200);
}

/// Guarantee: "retry the head, then release the rest" on a key held by a parked event runs the
/// head first and then the events that waited behind it, each once and in enqueue order, while
/// other keys were never held back.
#[tokio::test]
async fn releasing_a_key_runs_its_head_then_the_rest_in_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-release");
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let ran: Arc<Mutex<Vec<(String, i32)>>> = Arc::default();
    let tasks = {
        let (broken, ran) = (broken.clone(), ran.clone());
        TaskTransport::new(TaskConfig::default()).on("step", move |task: Task| {
            let (broken, ran) = (broken.clone(), ran.clone());
            async move {
                let n: i32 = task.json()?;
                if task.key == "held" && n == 0 && broken.load(std::sync::atomic::Ordering::SeqCst)
                {
                    return Err(TaskError::permanent("the ledger refused step 0"));
                }
                ran.lock().unwrap().push((task.key.clone(), n));
                Ok(())
            }
        })
    };
    let mut events = Vec::new();
    for n in 0..6 {
        events.push(NewEvent::json(topic.as_str(), "held", "step", &n).unwrap());
        events.push(NewEvent::json(topic.as_str(), "free", "step", &n).unwrap());
    }
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue_batch(&mut conn, events).await.unwrap();
    drop(conn);
    let relay = RunningRelay::start(&db.pool, tasks, fast_config().max_attempts(1));
    let addr = start(Dashboard::new(db.pool.clone()).actions(true)).await;
    wait::until(
        Duration::from_secs(30),
        "the free key done and the held key blocked",
        || async {
            let page = request(addr, "GET", "/blocked", &[], "").await;
            ran.lock().unwrap().iter().filter(|r| r.0 == "free").count() == 6
                && page.body.contains("data-test=\"waiting\">5<")
        },
    )
    .await;
    assert!(
        ran.lock().unwrap().iter().all(|r| r.0 == "free"),
        "the held key's tail ran"
    );

    broken.store(false, std::sync::atomic::Ordering::SeqCst);
    let page = request(addr, "GET", "/blocked", &[], "").await;
    let token = csrf(&page.body).unwrap();
    let head: uuid::Uuid = sqlx::query_scalar(
        "SELECT event_id FROM postal.outbox WHERE status = 'failed' AND event_key = 'held'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let head = head.to_string();
    let ask = post(
        addr,
        "/blocked/release",
        &[("csrf", &token), ("head", &head)],
    )
    .await;
    assert!(
        ask.body.contains("<b>1</b> will be affected"),
        "{}",
        ask.body
    );
    let (_, done) = click_and_confirm(
        addr,
        "/blocked/release",
        &[("csrf", &token), ("head", &head)],
    )
    .await;
    assert!(
        done.body.contains("Requeued 1 parked event(s) of the key"),
        "{}",
        done.body
    );
    wait::until(Duration::from_secs(30), "the held key done", || async {
        ran.lock().unwrap().iter().filter(|r| r.0 == "held").count() >= 6
    })
    .await;
    relay.stop().await;
    let held: Vec<i32> = ran
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.0 == "held")
        .map(|r| r.1)
        .collect();
    assert_eq!(
        held,
        vec![0, 1, 2, 3, 4, 5],
        "head first, then the rest in order, once each"
    );
    let page = request(addr, "GET", "/blocked", &[], "").await;
    assert!(page.body.contains("No key is held back."), "{}", page.body);
}

/// Guarantee: every query a page runs (with each kind of filter) can read Postal's large
/// tables — outbox, its history, dead letters, dedup rows, audit — through an index: with
/// sequential scans priced out, no plan reads one of them from end to end. (The page
/// benchmark measures the plans and times on a million rows.)
#[tokio::test]
async fn every_page_query_reads_the_large_tables_through_indexes() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    sqlx::query(&format!(
        "ALTER DATABASE \"{}\" SET enable_seqscan = off",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let pool = db.pool_of(2).await;
    let plans = postal_admin::plans::explain(&pool, uuid::Uuid::now_v7(), "k", "t", "c")
        .await
        .unwrap();
    assert!(plans.len() >= 20, "{} plans", plans.len());
    let mut scans = Vec::new();
    for (what, plan) in &plans {
        let full = postal_admin::plans::full_scans(plan);
        if !full.is_empty() {
            scans.push(format!("{what}: {full:?}\n{plan}"));
        }
    }
    assert!(
        scans.is_empty(),
        "pages read large tables end to end:\n{}",
        scans.join("\n\n")
    );
    // The check itself sees a full scan when there is one.
    let (plan,): (String,) =
        sqlx::query_as("EXPLAIN SELECT * FROM postal.outbox WHERE payload = '\\x00'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        postal_admin::plans::full_scans(&plan),
        vec!["outbox".to_owned()],
        "{plan}"
    );
}

/// Guarantee (issue 48: confirmations list the events they will touch): a confirmation page
/// lists, beside the count, the first 20 events it acts on in order (parked: event id, topic,
/// key, type, why parked; dead letters: id, consumer, topic, event, reason, error) and says how
/// many more it acts on; what it lists is what it carries.
///
/// Broken before: the page showed only the count.
#[tokio::test]
async fn a_confirmation_lists_the_first_events_it_will_touch() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-confirm-list");
    let ids = park(
        &db.pool,
        (0..25)
            .map(|i| NewEvent::json(topic.as_str(), format!("k{i}"), "order.placed", &i).unwrap())
            .collect(),
        "broker said no",
    )
    .await;
    let addr = start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let token = csrf(&request(addr, "GET", "/parked", &[], "").await.body)
        .expect("the page's forms carry a CSRF token");
    let ask = post(
        addr,
        "/parked/discard",
        &[("csrf", token.as_str()), ("topic", topic.as_str())],
    )
    .await;
    let list = ask
        .body
        .split("id=\"confirm-list\"")
        .nth(1)
        .expect("a list on the confirmation")
        .split("</table>")
        .next()
        .unwrap();
    let shown: Vec<usize> = ids
        .iter()
        .filter_map(|id| list.find(&id.to_string()))
        .collect();
    assert_eq!(shown.len(), 20, "the first 20 are listed: {list}");
    assert!(shown.windows(2).all(|w| w[0] < w[1]), "in order");
    assert!(list.contains(&ids[19].to_string()) && !list.contains(&ids[20].to_string()));
    assert!(list.contains("broker said no") && list.contains("order.placed"));
    assert!(
        ask.body.contains("The first 20 of 25"),
        "it says more are acted on: {}",
        ask.body
    );
    assert!(ask.body.contains("id=\"confirm-count\"><b>25</b>"));

    sqlx::query(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
             kafka_offset, event_id, payload, header_names, header_values, reason, error,
             attempts, dlq_topic)
         VALUES ('billing', 'billing', $1, 0, 7, gen_random_uuid(), 'x', '{}', '{}',
                 'permanent', 'card declined', 1, $1 || '.dlq')",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let ask = post(
        addr,
        "/dead-letters/resolve",
        &[("csrf", token.as_str()), ("consumer", "billing")],
    )
    .await;
    assert!(
        ask.body.contains("id=\"confirm-list\"")
            && ask.body.contains("card declined")
            && ask.body.contains("permanent"),
        "{}",
        ask.body
    );
}

/// Guarantee (issue 48): the overview says when pending events wait behind a parked event of
/// their key (how many, of how many keys, per topic, with the way to the blocked keys) and when
/// consumers hold keys (per group: keys, records, bytes); consumers are listed one row per
/// group, its partitions on demand.
///
/// Broken before: the overview counted pending and parked events apart (nothing said that
/// pending ones were stuck behind a parked one), did not show held keys, and listed one row per
/// partition (12 rows for one group of 12 partitions).
#[tokio::test]
async fn the_overview_says_what_waits_behind_parked_and_held_keys() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-behind");
    park(
        &db.pool,
        vec![NewEvent::json(topic.as_str(), "stuck", "order.placed", &0).unwrap()],
        "broker said no",
    )
    .await;
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![
            NewEvent::json(topic.as_str(), "stuck", "order.placed", &1).unwrap(),
            NewEvent::json(topic.as_str(), "stuck", "order.placed", &2).unwrap(),
            NewEvent::json(topic.as_str(), "free", "order.placed", &3).unwrap(),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    sqlx::query(
        "INSERT INTO postal.consumer_offsets (group_id, topic, partition, next_offset)
         SELECT 'billing', $1, p, 10 FROM generate_series(0, 11) AS p",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO postal.held_keys (group_id, topic, partition, record_key, head_offset,
             consumer_name, reason, error)
         VALUES ('billing', $1, 3, 'acct-7', 4, 'billing', 'permanent', 'declined')",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO postal.held_records (group_id, topic, partition, kafka_offset, record_key,
             event_id, event_type, bytes)
         SELECT 'billing', $1, 3, o, 'acct-7', gen_random_uuid(), 'account.debited', 100
         FROM generate_series(4, 5) AS o",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let addr = start(Dashboard::new(db.pool.clone())).await;
    let page = request(addr, "GET", "/", &[], "").await;
    let body = &page.body;
    assert!(
        body.contains("<b>2</b> pending event(s) of 1 key(s) wait behind a parked event"),
        "{body}"
    );
    let backlog = body.split("id=\"backlog\"").nth(1).unwrap();
    assert!(backlog.contains("<b>2</b></a> (1 key(s))"), "{backlog}");
    assert!(
        body.contains("<b>1</b> key(s) held by consumers (2 record(s) stored"),
        "{body}"
    );
    let consumers = body
        .split("id=\"consumers\"")
        .nth(1)
        .unwrap()
        .split("</table></td></tr></tbody></table>")
        .next()
        .unwrap();
    assert_eq!(
        consumers.matches("<details>").count(),
        1,
        "one row for the group: {consumers}"
    );
    assert!(consumers.contains("<summary>12</summary>"), "{consumers}");
    assert!(consumers.contains("<b>1</b> (2 record(s)"), "{consumers}");
}

/// Guarantee (issue 48: held keys in the dashboard): the Held keys page lists each held key of
/// each group with what waits behind it (count, bytes, the first held events); releasing one
/// asks first, listing the key's first held events and their count, then marks the key for its
/// partition's owner (the head retried, or with "skip" dead-lettered) and records the action in
/// the audit trail as the dashboard's user; a second release of the same key is refused while
/// the first is under way.
#[tokio::test]
async fn held_keys_are_listed_and_released_with_a_confirmation() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("dash-held");
    sqlx::query(
        "INSERT INTO postal.held_keys (group_id, topic, partition, record_key, head_offset,
             consumer_name, reason, error)
         VALUES ('ledger', $1, 2, 'acct-9', 7, 'ledger', 'permanent', 'balance below zero')",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let events: Vec<uuid::Uuid> = sqlx::query_scalar(
        "INSERT INTO postal.held_records (group_id, topic, partition, kafka_offset, record_key,
             event_id, event_type, bytes)
         SELECT 'ledger', $1, 2, o, 'acct-9', gen_random_uuid(), 'account.debited', 100
         FROM generate_series(7, 9) AS o RETURNING event_id",
    )
    .bind(&topic)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let addr = start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let page = request(addr, "GET", "/held", &[], "").await;
    assert_eq!(page.status, 200, "{}", page.body);
    let listed = page.body.split("id=\"held-keys\"").nth(1).unwrap();
    assert!(
        listed.contains("acct-9")
            && listed.contains("balance below zero")
            && listed.contains("data-test=\"held-count\">3<")
            && listed.contains(&format!("7:{}:account.debited", events[0])),
        "{listed}"
    );
    let fields = form_fields(&page.body, "release-held", 0);
    assert!(!fields.is_empty(), "a release button: {}", page.body);
    let ask = post(addr, "/held/release", &pairs(&fields)).await;
    assert!(
        ask.body.contains("id=\"confirm-count\"><b>3</b>")
            && ask
                .body
                .contains(&format!("7:{}:account.debited", events[0])),
        "the confirmation lists the key's first held events and their count: {}",
        ask.body
    );
    let release: Option<String> =
        sqlx::query_scalar("SELECT release FROM postal.held_keys WHERE group_id = 'ledger'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(release, None, "asking changes nothing");
    let confirmed = form_fields(&ask.body, "confirm", 0);
    let done = post(addr, "/held/release", &pairs(&confirmed)).await;
    assert!(
        done.body.contains("Release asked for 3 held record(s)"),
        "{}",
        done.body
    );
    let (release, by): (Option<String>, Option<String>) = sqlx::query_as(
        "SELECT release, released_by FROM postal.held_keys WHERE group_id = 'ledger'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(release.as_deref(), Some("retry"));
    assert!(by.is_some());
    let audit: (String, Option<String>, i64, serde_json::Value) = sqlx::query_as(
        "SELECT action, via, affected, target FROM postal.operator_audit ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (audit.0.as_str(), audit.1.as_deref(), audit.2),
        ("release-held", Some("dashboard"), 3),
        "{audit:?}"
    );
    assert_eq!(audit.3["key"], "acct-9");
    let again = post(addr, "/held/release", &pairs(&confirmed)).await;
    assert!(
        again.body.contains("already under way"),
        "a second release is refused: {}",
        again.body
    );
}
