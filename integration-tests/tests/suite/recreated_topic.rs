//! A topic deleted and re-created under a consumer group (issue 51, finding 1): its offsets
//! start again below the group's stored ones. The consumer stops the topic instead of dropping
//! the new records as "below the stored offset", `postal status` shows it, other topics keep
//! flowing, and `postal consumer reset --to earliest` is the way on, with the dedup rows
//! keeping events applied before from being applied again. Also: a reset of a group that has
//! no stored offsets (a typo) is refused.

use std::time::Duration;

use postal_integration_tests::wait::until;
use postal_integration_tests::{services, unique};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects_table, produce, RawRecord, RunningConsumer,
};
use crate::missing_topic::topic_exists;

/// Runs the `postal` CLI; (success, stdout, stderr).
pub(crate) fn postal(url: &str, bootstrap: &str, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(crate::procs::bin_dir().join("postal"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("run the postal CLI");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!(
        "postal {args:?}: success={}\nstdout: {stdout}stderr: {stderr}",
        out.status.success()
    );
    (out.status.success(), stdout, stderr)
}

/// `postal status --json`'s rows of `group` on `topic`.
pub(crate) fn status_rows(
    url: &str,
    bootstrap: &str,
    group: &str,
    topic: &str,
) -> Vec<serde_json::Value> {
    let (ok, stdout, _) = postal(url, bootstrap, &["status", "--json"]);
    assert!(ok, "postal status");
    let status: serde_json::Value = serde_json::from_str(&stdout).expect("status JSON");
    status["consumers"]
        .as_array()
        .expect("consumers")
        .iter()
        .filter(|c| c["group_id"] == group && c["topic"] == topic)
        .cloned()
        .collect()
}

pub(crate) fn job(id: Uuid, n: i64) -> RawRecord {
    RawRecord::event(id, &format!("k{n}"), "job", json!({ "n": n }))
}

/// Effects rows whose `n` lies in `range`.
pub(crate) async fn applied_in(pool: &PgPool, range: std::ops::Range<i64>) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE n >= $1 AND n < $2")
        .bind(range.start)
        .bind(range.end)
        .fetch_one(pool)
        .await
        .unwrap()
}

pub(crate) async fn delete_topic(bootstrap: &str, topic: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    for r in admin
        .delete_topics(&[topic], &AdminOptions::new())
        .await
        .expect("delete topic")
    {
        r.expect("topic deleted");
    }
    let (b, t) = (bootstrap.to_owned(), topic.to_owned());
    until(Duration::from_secs(60), "the topic to be gone", || {
        let (b, t) = (b.clone(), t.clone());
        async move {
            tokio::task::spawn_blocking(move || !topic_exists(&b, &t))
                .await
                .unwrap()
        }
    })
    .await;
}

/// Creates `topic` again once the broker has finished deleting it.
pub(crate) async fn recreate_topic(bootstrap: &str, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let res = admin
            .create_topics(
                [&NewTopic::new(
                    topic,
                    partitions,
                    TopicReplication::Fixed(1),
                )],
                &AdminOptions::new(),
            )
            .await
            .expect("create topic");
        match res.into_iter().next().expect("one result") {
            Ok(_) => return,
            // Still being deleted.
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("re-creating {topic}: {e:?}; again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("cannot re-create {topic}: {e:?}"),
        }
    }
}

fn consumer(pool: &PgPool, bootstrap: &str, group: &str, topics: [&str; 2]) -> RunningConsumer {
    let mut config = consumer_config(bootstrap, group, crate::handlers::CONSUMER);
    config.stall_check = Duration::from_secs(1);
    RunningConsumer::start(
        postal_consumer::Consumer::builder(pool.clone(), config)
            .state(crate::handlers::Probe::default())
            .on(topics[0], "job", crate::handlers::apply)
            .on(topics[1], "job", crate::handlers::apply)
            .build()
            .expect("valid consumer"),
    )
}

/// Topic `orders` (two partitions) is consumed up to offsets 20 and 2, then deleted and
/// re-created; its new log gets 3 records on partition 0 (one a republished copy of an event
/// applied before) and 5 on partition 1. Topic `other` is consumed by the same consumer
/// throughout.
///
/// Guarantee: no record of the re-created topic is lost. The consumer skips none of them as
/// "below the stored offset": it stops the topic (partition 0, whose stored offset 20 is above
/// the new log's end, applies nothing), `postal status` shows it stopped (not lag 0), and
/// `other` keeps flowing. `postal consumer reset --to earliest`, run as the error says, says
/// what it does (the new log from its start, dedup protection) rather than "replayed"; after
/// it every new event is applied exactly once and the republished one not again.
/// (On main: partition 0's 3 new records were dropped as below the stored offset — the skip
/// counter showed them — and the reset claimed to "move back 20 offsets: replayed".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_topic_stops_instead_of_skipping_and_resumes_after_a_reset() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (orders, other, group) = (unique("recreated"), unique("other"), unique("g"));
    create_topic(&svc.bootstrap, &orders, 2).await;
    create_topic(&svc.bootstrap, &other, 1).await;
    // n: 0..20 orders[0], 100..102 orders[1], 200..203 other (old log); new log: 300..303
    // orders[0] (300 republishes the event of n=0), 400..405 orders[1]; 500..502 other.
    let old_ids: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    let old: Vec<RawRecord> = (0..20).map(|n| job(old_ids[n as usize], n)).collect();
    produce(&svc.bootstrap, &orders, Some(0), &old).await;
    let old1: Vec<RawRecord> = (100..102).map(|n| job(Uuid::now_v7(), n)).collect();
    produce(&svc.bootstrap, &orders, Some(1), &old1).await;
    let others: Vec<RawRecord> = (200..203).map(|n| job(Uuid::now_v7(), n)).collect();
    produce(&svc.bootstrap, &other, Some(0), &others).await;

    let running = consumer(&db.pool, &svc.bootstrap, &group, [&orders, &other]);
    until(
        Duration::from_secs(60),
        "the 25 old events applied",
        || async { crate::common::effects(&db.pool).await.0 == 25 },
    )
    .await;
    running.stop().await;

    delete_topic(&svc.bootstrap, &orders).await;
    recreate_topic(&svc.bootstrap, &orders, 2).await;
    let mut new0 = vec![RawRecord::event(
        old_ids[0],
        "k0",
        "job",
        json!({ "n": 300 }),
    )];
    new0.extend((301..303).map(|n| job(Uuid::now_v7(), n)));
    produce(&svc.bootstrap, &orders, Some(0), &new0).await;
    let new1: Vec<RawRecord> = (400..405).map(|n| job(Uuid::now_v7(), n)).collect();
    produce(&svc.bootstrap, &orders, Some(1), &new1).await;

    let running = consumer(&db.pool, &svc.bootstrap, &group, [&orders, &other]);
    let more: Vec<RawRecord> = (500..502).map(|n| job(Uuid::now_v7(), n)).collect();
    produce(&svc.bootstrap, &other, Some(0), &more).await;
    until(
        Duration::from_secs(60),
        "the other topic's new events applied",
        || async { applied_in(&db.pool, 500..502).await == 2 },
    )
    .await;
    // Either the stop shows, or (the failure) the new records were dropped.
    let stats = running.stats.clone();
    let (url, bootstrap) = (db.url.clone(), svc.bootstrap.clone());
    let stopped = |url: String, bootstrap: String, group: String, topic: String| async move {
        tokio::task::spawn_blocking(move || {
            let rows = status_rows(&url, &bootstrap, &group, &topic);
            rows.iter().any(|r| r["stopped"] == true)
        })
        .await
        .unwrap()
    };
    until(
        Duration::from_secs(60),
        "orders stopped, or records skipped",
        || {
            let skipped = stats.snapshot().replays_skipped > 0;
            let f = stopped(
                url.clone(),
                bootstrap.clone(),
                group.clone(),
                orders.clone(),
            );
            async move { skipped || f.await }
        },
    )
    .await;
    assert_eq!(
        running.stats.snapshot().replays_skipped,
        0,
        "records of the re-created topic were dropped as below the stored offset"
    );
    let rows = {
        let (u, b, g, t) = (
            url.clone(),
            bootstrap.clone(),
            group.clone(),
            orders.clone(),
        );
        tokio::task::spawn_blocking(move || status_rows(&u, &b, &g, &t))
            .await
            .unwrap()
    };
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(r["stopped"], true, "every partition shown stopped: {r}");
        assert!(r["lag"].is_null(), "no lag figure (was a clamped 0): {r}");
    }
    assert_eq!(
        applied_in(&db.pool, 300..303).await,
        0,
        "nothing of the stopped partition applied"
    );
    running.stop().await;

    let (ok, stdout, stderr) = postal(
        &db.url,
        &svc.bootstrap,
        &[
            "consumer",
            "reset",
            "--group",
            &group,
            "--topic",
            &orders,
            "--to",
            "earliest",
            "--execute",
        ],
    );
    assert!(ok, "reset: {stderr}");
    assert!(
        !stdout.contains("replayed"),
        "the new log's records were never applied, so nothing is replayed: {stdout}"
    );
    assert!(
        stdout.contains("postal.processed_events"),
        "says that dedup rows protect events applied before: {stdout}"
    );
    assert!(
        stdout.contains(&format!("{group} {orders}[0] -> next offset 0")),
        "{stdout}"
    );

    let running = consumer(&db.pool, &svc.bootstrap, &group, [&orders, &other]);
    until(
        Duration::from_secs(60),
        "the new log's events applied",
        || async {
            applied_in(&db.pool, 301..303).await == 2 && applied_in(&db.pool, 400..405).await == 5
        },
    )
    .await;
    let (u, b, g, t) = (
        url.clone(),
        bootstrap.clone(),
        group.clone(),
        orders.clone(),
    );
    until(
        Duration::from_secs(60),
        "the reset partitions' offsets at the new log's end",
        || {
            let (u, b, g, t) = (u.clone(), b.clone(), g.clone(), t.clone());
            async move {
                tokio::task::spawn_blocking(move || {
                    let rows = status_rows(&u, &b, &g, &t);
                    rows.len() == 2 && rows.iter().all(|r| r["stopped"] != true && r["lag"] == 0)
                })
                .await
                .unwrap()
            }
        },
    )
    .await;
    running.stop().await;
    // 20 + 2 + 3 + 2 old and other, 2 + 5 new; the republished copy of n=0 (n=300) not again.
    assert_eq!(
        applied_in(&db.pool, 300..301).await,
        0,
        "the republished event applied again"
    );
    let (rows, distinct) = crate::common::effects(&db.pool).await;
    assert_eq!(
        (rows, distinct),
        (34, 34),
        "each event applied exactly once"
    );
}

/// Guarantee: `postal consumer reset` refuses a group that has no stored offsets (a typo of a
/// group's name) with one line saying what to do, and stores nothing (`postal status` does not
/// list it); `--new-group` gives a new group its first offsets. (On main: the typo exited 0 and
/// created the group's offsets.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_of_a_group_without_stored_offsets_is_refused() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("typo");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let ids: Vec<RawRecord> = (0..3).map(|n| job(Uuid::now_v7(), n)).collect();
    produce(&svc.bootstrap, &topic, Some(0), &ids).await;
    let group = unique("biling");
    let args = [
        "consumer",
        "reset",
        "--group",
        &group,
        "--topic",
        &topic,
        "--to",
        "earliest",
        "--execute",
    ];
    let (ok, _, stderr) = postal(&db.url, &svc.bootstrap, &args);
    assert!(!ok, "refused");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(
        lines[0].contains("has no stored offsets") && lines[0].contains("--new-group"),
        "says what to do: {stderr}"
    );
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.consumer_offsets WHERE group_id = $1")
            .bind(&group)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(stored, 0, "nothing stored");
    let (url, bootstrap, g, t) = (
        db.url.clone(),
        svc.bootstrap.clone(),
        group.clone(),
        topic.clone(),
    );
    let listed = tokio::task::spawn_blocking(move || status_rows(&url, &bootstrap, &g, &t))
        .await
        .unwrap();
    assert!(
        listed.is_empty(),
        "postal status lists no such group: {listed:?}"
    );

    let mut new = args.to_vec();
    new.push("--new-group");
    let (ok, stdout, _) = postal(&db.url, &svc.bootstrap, &new);
    assert!(
        ok && stdout.contains(&format!("{group} {topic}[0] -> next offset 0")),
        "{stdout}"
    );
}

/// The series of `name` on a `/metrics` page: (labels, value) each.
fn scraped(page: &str, name: &str) -> Vec<(Vec<(String, String)>, f64)> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (set, value) = match rest.strip_prefix('{') {
                Some(r) => r.rsplit_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            let labels = set
                .split(',')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').expect("label=value");
                    (k.to_owned(), v.trim_matches('"').to_owned())
                })
                .collect();
            Some((labels, value.trim().parse().ok()?))
        })
        .collect()
}

/// Guarantee (alert `PostalConsumerTopicStopped`, on a real consumer process): a
/// `billing_service` process (serving `/metrics`) whose topic is deleted and re-created under
/// it stops the topic, and its `/metrics` then exposes what the alert rule of
/// `deploy/prometheus-alerts.yml` reads: the metric the rule's expression names, above 0,
/// with every label the rule groups by (`consumer` = the service's consumer name, `topic` = the
/// re-created topic), and no stop on its other partitions' topics. Where promtool is
/// available (`POSTAL_PROMTOOL`, or on `PATH`), the rule file itself is evaluated over the
/// scraped series (as Prometheus would scrape them, plus an `instance` label): the alert
/// fires with those labels after its `for`, and not before. (Before, only an in-process
/// consumer's `StatsSnapshot::partitions_stopped` was checked, and the rule's metric name and
/// labels only against the source text.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_process_that_stops_a_recreated_topic_exposes_what_its_alert_reads() {
    use crate::procs::{bin_dir, http_get, Proc};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let orders = unique("orders-stopped");
    let group = unique("billing-stopped");
    create_topic(&svc.bootstrap, &orders, 2).await;
    let dir = bin_dir();
    let logs = dir.join(format!("topic-stopped-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let mut billing = Proc::new(&dir, &logs, "billing", "billing_service", &[])
        .env(&[
            ("DATABASE_URL", db.url.clone()),
            ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
            ("ORDERS_TOPIC", orders.clone()),
            ("INVOICES_TOPIC", unique("invoices-stopped")),
            ("POSTAL_CONSUMER_GROUP", group.clone()),
            ("RUST_LOG", "info,rdkafka=warn".into()),
        ])
        .with_metrics();
    billing.start();
    let port = billing.metrics_port().unwrap();
    let order = |n: i64| {
        RawRecord::event(
            Uuid::now_v7(),
            &format!("c{n}"),
            "order.created",
            json!({"order_id": n, "customer": format!("c{n}"), "seq": 1}),
        )
    };
    // The old log: 10 orders on each partition, applied.
    for p in 0..2 {
        let old: Vec<RawRecord> = (0..10).map(|n| order(p * 100 + n)).collect();
        produce(&svc.bootstrap, &orders, Some(p as i32), &old).await;
    }
    let booked = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while booked().await < 20 {
        billing.assert_alive();
        assert!(std::time::Instant::now() < deadline, "the old log applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metric = "postal_consumer_partitions_stopped";
    // Re-created under the running process, with a shorter new log.
    delete_topic(&svc.bootstrap, &orders).await;
    recreate_topic(&svc.bootstrap, &orders, 2).await;
    let new: Vec<RawRecord> = (1000..1003).map(order).collect();
    produce(&svc.bootstrap, &orders, Some(0), &new).await;
    let stopped_series = || {
        scraped(&http_get(port, "/metrics").unwrap_or_default(), metric)
            .into_iter()
            .filter(|(labels, v)| {
                *v > 0.0 && labels.iter().any(|(k, t)| k == "topic" && *t == orders)
            })
            .collect::<Vec<_>>()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while stopped_series().is_empty()
        || !billing.logged("stored offset above the partition's high watermark")
    {
        billing.assert_alive();
        assert!(
            std::time::Instant::now() < deadline,
            "the topic stopped: {metric} above 0 for it and the ERROR line"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let page = http_get(port, "/metrics").unwrap();
    let series = scraped(&page, metric);
    billing.stop();
    assert_eq!(booked().await, 20, "nothing of the new log applied");

    // The rule, as shipped.
    let rules_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/prometheus-alerts.yml")
        .canonicalize()
        .unwrap();
    let rules: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&rules_path).unwrap()).unwrap();
    let rule = rules["groups"][0]["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|r| r["alert"].as_str() == Some("PostalConsumerTopicStopped"))
        .expect("the rule")
        .clone();
    let expr = rule["expr"].as_str().unwrap();
    let named: Vec<&str> = expr
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("postal_"))
        .collect();
    assert_eq!(
        named,
        [metric],
        "the rule reads the metric the process exposes: {expr}"
    );
    let by: Vec<&str> = expr
        .split_once("by (")
        .and_then(|(_, r)| r.split_once(')'))
        .map(|(l, _)| l.split(',').map(str::trim).collect())
        .expect("the rule groups by labels");
    let stopped: Vec<_> = series.iter().filter(|(_, v)| *v > 0.0).collect();
    assert_eq!(stopped.len(), 1, "one stopped series: {series:?}");
    let (labels, value) = stopped[0];
    let label = |k: &str| labels.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    for l in &by {
        assert!(
            label(l).is_some(),
            "the series has the rule's label {l}: {labels:?}"
        );
    }
    assert_eq!(label("consumer"), Some("billing"), "{labels:?}");
    assert_eq!(label("topic"), Some(orders.as_str()), "{labels:?}");
    assert!(*value >= 1.0, "{value}");

    // promtool, where available: the rule file over the scraped series.
    let promtool = std::env::var_os("POSTAL_PROMTOOL")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::split_paths(&std::env::var_os("PATH")?)
                .map(|d| d.join("promtool"))
                .find(|p| p.is_file())
        });
    match promtool {
        None => eprintln!(
            "recreated_topic::a_consumer_process_that_stops…: promtool not found (POSTAL_PROMTOOL or PATH): the rule was checked by its text only"
        ),
        Some(promtool) => {
            let selector = |labels: &[(String, String)]| {
                let mut all: Vec<String> =
                    labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
                all.push("instance=\"billing-1\"".into());
                format!("{metric}{{{}}}", all.join(","))
            };
            let input: Vec<serde_yaml::Value> = series
                .iter()
                .map(|(labels, v)| {
                    serde_yaml::to_value(serde_json::json!({
                        "series": selector(labels),
                        "values": format!("{v}x10"),
                    }))
                    .unwrap()
                })
                .collect();
            let render = |text: &str| {
                text.replace("{{ $labels.consumer }}", "billing")
                    .replace("{{ $labels.topic }}", &orders)
            };
            let annotations: serde_yaml::Mapping = rule["annotations"]
                .as_mapping()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), render(v.as_str().unwrap()).into()))
                .collect();
            let mut expected = rule["labels"].as_mapping().cloned().unwrap_or_default();
            expected.insert("consumer".into(), "billing".into());
            expected.insert("topic".into(), orders.clone().into());
            let test = serde_json::json!({
                "rule_files": [rules_path.display().to_string()],
                "evaluation_interval": "1m",
                "tests": [{
                    "interval": "1m",
                    "input_series": input,
                    "alert_rule_test": [
                        {"eval_time": "0m", "alertname": "PostalConsumerTopicStopped", "exp_alerts": []},
                        {"eval_time": "2m", "alertname": "PostalConsumerTopicStopped", "exp_alerts": [{
                            "exp_labels": expected,
                            "exp_annotations": annotations,
                        }]},
                    ],
                }],
            });
            let file = logs.join("scraped.test.yml");
            std::fs::write(&file, serde_yaml::to_string(&test).unwrap()).unwrap();
            let out = std::process::Command::new(promtool)
                .args(["test", "rules"])
                .arg(&file)
                .output()
                .expect("promtool runs");
            assert!(
                out.status.success(),
                "promtool test rules over the scraped series:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    std::fs::remove_dir_all(&logs).ok();
}
