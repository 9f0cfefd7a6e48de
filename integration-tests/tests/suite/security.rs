//! Kafka with authentication, TLS and ACLs: the `--secure` node of `scripts/stack.sh` (a
//! SASL_SSL listener with SCRAM-SHA-512, its certificate from a local CA, the standard
//! authorizer, no access without an ACL). The relay takes its security settings from a
//! `--kafka-file`, the consumer from `ConsumerConfig::kafka`: both are passed to librdkafka.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue, NewEvent};

use crate::common::{consumer_config, effects, effects_table, start_apply};
use crate::procs::{bin_dir, http_get, Proc};

/// The secure node as `scripts/stack.sh kafka-up --secure` prints it.
struct Secure {
    bootstrap: String,
    ca: String,
    relay_password: String,
    consumer_password: String,
    admin_password: String,
}

fn secure() -> Option<Secure> {
    let var = |n: &str| std::env::var(n).ok();
    match (
        var("KAFKA_SASL_SSL_BOOTSTRAP"),
        var("KAFKA_SASL_SSL_CA"),
        var("KAFKA_SASL_SSL_RELAY_PASSWORD"),
        var("KAFKA_SASL_SSL_CONSUMER_PASSWORD"),
        var("KAFKA_SASL_SSL_ADMIN_PASSWORD"),
    ) {
        (
            Some(bootstrap),
            Some(ca),
            Some(relay_password),
            Some(consumer_password),
            Some(admin_password),
        ) => Some(Secure {
            bootstrap,
            ca,
            relay_password,
            consumer_password,
            admin_password,
        }),
        _ if std::env::var("POSTAL_REQUIRE_SECURE").as_deref() == Ok("1") => {
            panic!("KAFKA_SASL_SSL_* are not set: start the node with scripts/stack.sh kafka-up --secure")
        }
        _ => {
            eprintln!("security test NOT RUN: KAFKA_SASL_SSL_* are not set (scripts/test.sh starts the --secure node)");
            None
        }
    }
}

/// librdkafka properties for `user` over SASL_SSL, verifying the broker against `ca`.
fn client_properties(user: &str, password: &str, ca: &str) -> Vec<(String, String)> {
    [
        ("security.protocol", "SASL_SSL"),
        ("sasl.mechanisms", "SCRAM-SHA-512"),
        ("sasl.username", user),
        ("sasl.password", password),
        ("ssl.ca.location", ca),
        ("ssl.endpoint.identification.algorithm", "https"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// Kafka's AclCommand as the secure node's admin, in one JVM for the whole test binary
/// (`scripts/stack.sh acl-repl --secure`, started on first use; a JVM per change cost about 9 s
/// and 5 CPU-seconds each on two busy cores). One change at a time.
struct AclRepl {
    child: std::process::Child,
    input: std::process::ChildStdin,
    output: std::io::BufReader<std::process::ChildStdout>,
}

static ACL_REPL: std::sync::Mutex<Option<AclRepl>> = std::sync::Mutex::new(None);

fn acl_repl() -> AclRepl {
    use std::process::{Command, Stdio};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut child = Command::new("bash")
        .arg(root.join("scripts/stack.sh"))
        .args(["acl-repl", "--secure"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("scripts/stack.sh acl-repl --secure");
    let input = child.stdin.take().unwrap();
    let output = std::io::BufReader::new(child.stdout.take().unwrap());
    AclRepl {
        child,
        input,
        output,
    }
}

/// Runs Kafka's AclCommand with `args` as the secure node's admin; panics with its output if it
/// fails.
fn acl(args: &[&str]) {
    use std::io::{BufRead, Write};
    const DONE: &str = "\u{1}postal-acl-done ";
    let mut repl = ACL_REPL.lock().unwrap_or_else(|e| e.into_inner());
    // A second try only if the JVM is gone (its output ended before the command's answer).
    for _ in 0..2 {
        let r = repl.get_or_insert_with(acl_repl);
        let mut text = String::new();
        let mut code = None;
        if writeln!(r.input, "{}", args.join("\t")).is_ok() && r.input.flush().is_ok() {
            let mut line = String::new();
            while r.output.read_line(&mut line).unwrap_or(0) > 0 {
                if let Some(c) = line.trim_end().strip_prefix(DONE) {
                    code = Some(c.to_owned());
                    break;
                }
                text.push_str(&line);
                line.clear();
            }
        }
        match code.as_deref() {
            Some("0") => return,
            Some(c) => panic!("acl {args:?}: exit {c}: {text}"),
            None => {
                let mut gone = repl.take().unwrap();
                let _ = gone.child.kill();
                let _ = gone.child.wait();
            }
        }
    }
    panic!("acl {args:?}: scripts/stack.sh acl-repl --secure ended twice before answering");
}

async fn create_topic(s: &Secure, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let mut cfg = rdkafka::ClientConfig::new();
    cfg.set("bootstrap.servers", &s.bootstrap);
    for (k, v) in client_properties("admin", &s.admin_password, &s.ca) {
        cfg.set(k, v);
    }
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = cfg.create().unwrap();
    let res = admin
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create topic");
    for r in res {
        r.expect("topic created");
    }
}

/// A `postal relay` process whose Kafka properties (with the password) come from a file.
fn relay(
    dir: &Path,
    logs: &Path,
    name: &str,
    url: &str,
    s: &Secure,
    properties: &[(String, String)],
) -> (Proc, PathBuf) {
    relay_with(dir, logs, name, url, s, properties, &[])
}

/// [`relay`] with further `postal relay` arguments (`--read-from wal …`).
fn relay_with(
    dir: &Path,
    logs: &Path,
    name: &str,
    url: &str,
    s: &Secure,
    properties: &[(String, String)],
    args: &[&str],
) -> (Proc, PathBuf) {
    let file = logs.join(format!("{name}.properties"));
    let text: String = properties
        .iter()
        .map(|(k, v)| format!("{k}={v}\n"))
        .collect();
    std::fs::write(&file, text).unwrap();
    let proc = Proc::new(dir, logs, name, "postal", &[&["relay"], args].concat())
        .env(&[
            ("DATABASE_URL", url.to_owned()),
            ("KAFKA_BOOTSTRAP_SERVERS", s.bootstrap.clone()),
            ("POSTAL_KAFKA_FILE", file.display().to_string()),
            ("POSTAL_LOG", "info,rdkafka=warn".into()),
        ])
        .with_metrics();
    let log = logs.join(format!("{name}.log"));
    (proc, log)
}

/// `n` job events on `topic`, keys `<topic>-k0` … `<topic>-k7`: a key's order holds across
/// topics, so keys of their own keep one topic's waiting events from holding another's back.
async fn enqueue_jobs(pool: &sqlx::PgPool, topic: &str, n: i64) {
    let mut tx = pool.begin().await.unwrap();
    for i in 0..n {
        let event = NewEvent::json(
            topic,
            format!("{topic}-k{}", i % 8).as_str(),
            "job",
            &serde_json::json!({"n": i}),
        )
        .unwrap();
        enqueue(&mut tx, event).await.unwrap();
    }
    tx.commit().await.unwrap();
}

async fn outbox_left(pool: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'failed')
         FROM postal.outbox",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Guarantee (issue: Kafka security): with certificate verification on, a relay and a consumer
/// whose principals hold only the ACLs they need (relay: WRITE and DESCRIBE on its topic;
/// consumer: READ and DESCRIBE on it and READ on its group) deliver every event once; and the
/// password is in none of the relay's log, its `/metrics`, or `postal status --json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_work_over_sasl_ssl_with_least_privilege() {
    sasl_ssl_with_least_privilege(false).await;
}

/// Guarantee (issue: Kafka security): the same with a WAL relay (`postal relay --read-from
/// wal` on a slot of the test's own, over the same `DATABASE_URL`): with certificate
/// verification on and the relay's principal holding only WRITE and DESCRIBE on its topic (no
/// more than polling needs), every event is read from the slot, delivered and applied once;
/// and the password is in none of the relay's log, its `/metrics`, or `postal status --json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_work_over_sasl_ssl_with_least_privilege_wal() {
    sasl_ssl_with_least_privilege(true).await;
}

async fn sasl_ssl_with_least_privilege(wal: bool) {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    // Created before the events, so that the stream holds them all.
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let created_at = match &slot {
        Some(slot) => slot.confirmed(&db.pool).await,
        None => 0,
    };
    let (topic, group) = (unique("secure"), unique("g"));
    create_topic(&s, &topic, 3).await;
    acl(&[
        "--add",
        "--allow-principal",
        "User:relay",
        "--operation",
        "Write",
        "--operation",
        "Describe",
        "--topic",
        &topic,
    ]);
    acl(&[
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Read",
        "--operation",
        "Describe",
        "--topic",
        &topic,
    ]);
    acl(&[
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Read",
        "--group",
        &group,
    ]);

    let dir = bin_dir();
    let logs = dir.join(format!("security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let wal_args = slot
        .as_ref()
        .map(|slot| {
            vec![
                "--read-from",
                "wal",
                "--wal-slot",
                slot.source.slot.as_str(),
                "--wal-publication",
                slot.source.publication.as_str(),
            ]
        })
        .unwrap_or_default();
    let (mut relay, log) = relay_with(
        &dir,
        &logs,
        "relay",
        &db.url,
        &s,
        &client_properties("relay", &s.relay_password, &s.ca),
        &wal_args,
    );
    relay.start();
    let mut config = consumer_config(&s.bootstrap, &group, crate::handlers::CONSUMER);
    config
        .kafka
        .extend(client_properties("consumer", &s.consumer_password, &s.ca));
    let consumer = start_apply(&db.pool, &topic, config);
    enqueue_jobs(&db.pool, &topic, 200).await;
    // Until every event is applied, or 90 s (then the assertion below says what is left).
    let deadline = Instant::now() + Duration::from_secs(90);
    wait::until(
        Duration::from_secs(100),
        "every event applied over SASL_SSL",
        || {
            relay.assert_alive();
            let pool = db.pool.clone();
            async move { effects(&pool).await.1 >= 200 || Instant::now() > deadline }
        },
    )
    .await;
    assert!(
        effects(&db.pool).await.1 >= 200,
        "not every event applied over SASL_SSL: {:?}, outbox {:?}",
        effects(&db.pool).await,
        outbox_left(&db.pool).await
    );
    if let Some(slot) = &slot {
        // The relay read the events from the slot: it confirms its position past them.
        wait::until(
            Duration::from_secs(30),
            "the WAL relay confirming its slot past the events",
            || async { slot.confirmed(&db.pool).await > created_at },
        )
        .await;
    }
    let metrics = relay
        .metrics_port()
        .and_then(|p| http_get(p, "/metrics"))
        .unwrap_or_default();
    assert!(
        metrics.contains("postal_relay_published_total"),
        "{metrics}"
    );
    consumer.stop().await;
    relay.stop();
    assert_eq!(
        effects(&db.pool).await,
        (200, 200),
        "each event applied once"
    );
    let status = std::process::Command::new(dir.join("postal"))
        .args(["status", "--json"])
        .env("DATABASE_URL", &db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &s.bootstrap)
        .output()
        .unwrap();
    let logged = std::fs::read_to_string(&log).unwrap();
    for (what, text) in [
        ("the relay's log", logged.as_str()),
        ("/metrics", metrics.as_str()),
        (
            "postal status --json",
            &String::from_utf8_lossy(&status.stdout),
        ),
        (
            "postal status (stderr)",
            &String::from_utf8_lossy(&status.stderr),
        ),
    ] {
        assert!(
            !text.contains(&s.relay_password),
            "the relay's password appears in {what}"
        );
    }
}

/// Guarantee (issue: Kafka security): a relay with a wrong password, or one that does not
/// trust the broker's CA, says plainly what failed (an authentication failure; a certificate
/// that could not be verified), keeps running and retrying, and parks or loses nothing: its
/// events stay pending, and a relay with the right settings then publishes every one. The
/// wrong password never appears in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_or_an_untrusted_broker_is_said_plainly_and_loses_nothing() {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("secure");
    create_topic(&s, &topic, 1).await;
    acl(&[
        "--add",
        "--allow-principal",
        "User:relay",
        "--operation",
        "Write",
        "--operation",
        "Describe",
        "--topic",
        &topic,
    ]);
    enqueue_jobs(&db.pool, &topic, 20).await;
    let dir = bin_dir();
    let logs = dir.join(format!("security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();

    let wrong = format!("{}-wrong", s.relay_password);
    // A CA that did not sign the broker's certificate: the system's bundle.
    let system_ca = "/etc/ssl/certs/ca-certificates.crt";
    for (name, properties, said) in [
        (
            "wrong-password",
            client_properties("relay", &wrong, &s.ca),
            "Authentication failed",
        ),
        (
            "untrusted-ca",
            client_properties("relay", &s.relay_password, system_ca),
            "certificate verify failed",
        ),
    ] {
        let (mut relay, log) = relay(&dir, &logs, name, &db.url, &s, &properties);
        relay.start();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains(said) {
                assert!(
                    !text.contains(&wrong),
                    "{name}: the password appears in the log"
                );
                break;
            }
            relay.assert_alive();
            assert!(
                Instant::now() < deadline,
                "{name}: the log never said {said:?}:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Still running after saying so, and nothing parked.
        relay.assert_alive();
        assert_eq!(
            outbox_left(&db.pool).await,
            (20, 0),
            "{name}: events stay pending"
        );
        relay.stop();
    }

    let (mut relay, _) = relay(
        &dir,
        &logs,
        "right",
        &db.url,
        &s,
        &client_properties("relay", &s.relay_password, &s.ca),
    );
    relay.start();
    let deadline = Instant::now() + Duration::from_secs(60);
    while outbox_left(&db.pool).await != (0, 0) {
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "the right settings never published: {:?}",
            outbox_left(&db.pool).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    relay.stop();
}

/// Guarantee (issue: Kafka security): a relay whose principal lacks WRITE on one topic keeps
/// that topic's events waiting — not parked, attempts not used up — with the reason in its log
/// and in `postal status` (the missing ACL and what to grant), while another topic's events
/// flow; once the ACL is granted they are published, each key's events in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_without_write_acl_waits_and_others_flow() {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (open, closed) = (unique("secure-open"), unique("secure-closed"));
    create_topic(&s, &open, 1).await;
    create_topic(&s, &closed, 1).await;
    acl(&[
        "--add",
        "--allow-principal",
        "User:relay",
        "--operation",
        "Write",
        "--operation",
        "Describe",
        "--topic",
        &open,
    ]);
    let dir = bin_dir();
    let logs = dir.join(format!("security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let (mut relay, log) = relay(
        &dir,
        &logs,
        "relay",
        &db.url,
        &s,
        &client_properties("relay", &s.relay_password, &s.ca),
    );
    relay.start();
    enqueue_jobs(&db.pool, &closed, 30).await;
    enqueue_jobs(&db.pool, &open, 30).await;
    let left = |topic: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (i64, i64, i64)>(
                "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'failed'),
                        coalesce(max(attempts), 0)::int8
                 FROM postal.outbox WHERE topic = $1",
            )
            .bind(topic)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while left(open.clone()).await.0 > 0 {
        relay.assert_alive();
        assert!(Instant::now() < deadline, "the open topic did not flow");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let said = format!("the relay is not authorised for topic \"{closed}\"");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains(&said)
    {
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "the log never named the missing ACL"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        left(closed.clone()).await,
        (30, 0, 0),
        "waiting, not parked, no attempt used"
    );
    let status = std::process::Command::new(dir.join("postal"))
        .arg("status")
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&status.stdout);
    assert!(
        shown.contains(&format!("waiting: {said}"))
            && shown.contains("grant its Kafka principal WRITE"),
        "{shown}"
    );

    acl(&[
        "--add",
        "--allow-principal",
        "User:relay",
        "--operation",
        "Write",
        "--operation",
        "Describe",
        "--topic",
        &closed,
    ]);
    let deadline = Instant::now() + Duration::from_secs(90);
    while left(closed.clone()).await.0 > 0 {
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "granting the ACL did not let the events through: {:?}",
            left(closed.clone()).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    relay.stop();
    // Each key's events first reached the topic in enqueue order.
    let records = postal_integration_tests::kafka::read_all_with(
        &s.bootstrap,
        &closed,
        30,
        Duration::from_secs(60),
        &client_properties("admin", &s.admin_password, &s.ca),
    )
    .await;
    let mut next: std::collections::BTreeMap<String, i64> = Default::default();
    let mut seen = std::collections::BTreeSet::new();
    for r in &records {
        let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        let n = v["n"].as_i64().unwrap();
        if !seen.insert(n) {
            continue;
        }
        let key = format!("{closed}-k{}", n % 8);
        let due = next.entry(key.clone()).or_insert(n % 8);
        assert_eq!(n, *due, "key {key}: {n} first seen where {due} was due");
        *due += 8;
    }
    assert_eq!(seen.len(), 30, "every event on the topic");
}

/// What a consumer's principal lacks at first.
#[derive(Clone, Copy, Debug)]
enum Lacks {
    /// READ on its group.
    Group,
    /// READ and DESCRIBE on its topic.
    Topic,
}

/// Guarantee (issue: Kafka security): a consumer whose principal may not read its group says
/// so plainly (the group authorisation failure, in its log) and applies nothing; once READ on
/// the group is granted it applies every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_without_read_on_its_group_applies_nothing_until_granted() {
    consumer_lacking(Lacks::Group).await;
}

/// Guarantee (issue: Kafka security): a consumer whose principal may not read its topic
/// applies nothing and dead-letters nothing; once READ and DESCRIBE on the topic
/// are granted it applies every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_without_read_on_its_topic_applies_nothing_until_granted() {
    consumer_lacking(Lacks::Topic).await;
}

async fn consumer_lacking(lacks: Lacks) {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (topic, group) = (unique("secure-read"), unique("g"));
    create_topic(&s, &topic, 1).await;
    acl(&[
        "--add",
        "--allow-principal",
        "User:relay",
        "--operation",
        "Write",
        "--operation",
        "Describe",
        "--topic",
        &topic,
    ]);
    let topic_acl = [
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Read",
        "--operation",
        "Describe",
        "--topic",
        &topic,
    ];
    let group_acl = [
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Read",
        "--group",
        &group,
    ];
    let (first, later): (&[&str], &[&str]) = match lacks {
        Lacks::Group => (&topic_acl, &group_acl),
        Lacks::Topic => (&group_acl, &topic_acl),
    };
    acl(first);
    let dir = bin_dir();
    let logs = dir.join(format!("security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let (mut relay, _) = relay(
        &dir,
        &logs,
        "relay",
        &db.url,
        &s,
        &client_properties("relay", &s.relay_password, &s.ca),
    );
    relay.start();
    enqueue_jobs(&db.pool, &topic, 20).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while outbox_left(&db.pool).await != (0, 0) {
        relay.assert_alive();
        assert!(Instant::now() < deadline, "not published");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    relay.stop();
    let mut config = consumer_config(&s.bootstrap, &group, crate::handlers::CONSUMER);
    config
        .kafka
        .extend(client_properties("consumer", &s.consumer_password, &s.ca));
    let consumer = start_apply(&db.pool, &topic, config);
    // Long enough for the group join or the fetch to be refused and retried a few times.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        effects(&db.pool).await,
        (0, 0),
        "{lacks:?}: nothing applied without the ACL"
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dead, 0, "{lacks:?}: nothing dead-lettered");
    acl(later);
    let deadline = Instant::now() + Duration::from_secs(90);
    while effects(&db.pool).await.1 < 20 {
        assert!(
            Instant::now() < deadline,
            "{lacks:?}: granting the ACL did not start the consumer: {:?}",
            effects(&db.pool).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    consumer.stop().await;
    assert_eq!(effects(&db.pool).await, (20, 20));
}
// ---------------------------------------------------------------------------------------
// Adversarial review (branch review-acl): ACL revoked while the relay publishes.
// ---------------------------------------------------------------------------------------

fn acl_topic(op: &str, topic: &str, ops: &[&str]) {
    let mut args: Vec<&str> = vec![op, "--force", "--allow-principal", "User:relay"];
    for o in ops {
        args.push("--operation");
        args.push(o);
    }
    args.push("--topic");
    args.push(topic);
    acl(&args);
}

async fn counts(pool: &sqlx::PgPool, topic: &str) -> (i64, i64, i64) {
    sqlx::query_as::<_, (i64, i64, i64)>(
        "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'failed'),
                coalesce(max(attempts), 0)::int8
         FROM postal.outbox WHERE topic = $1",
    )
    .bind(topic)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Enqueues one event per tick on each topic; key = `{prefix}k{i%8}`; n = global counter.
fn spawn_enqueuer(
    pool: sqlx::PgPool,
    topics: Vec<(String, String)>, // (topic, key prefix)
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let mut i = 0i64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let mut tx = pool.begin().await.unwrap();
            for (t, p) in &topics {
                let event = NewEvent::json(
                    t.as_str(),
                    format!("{p}k{}", i % 8).as_str(),
                    "job",
                    &serde_json::json!({"n": i}),
                )
                .unwrap();
                enqueue(&mut tx, event).await.unwrap();
            }
            tx.commit().await.unwrap();
            i += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        i
    })
}

/// Checks per-key first-occurrence order and completeness of topic `t` (n in 0..total).
async fn check_topic(s: &Secure, t: &str, total: i64) -> Result<(), String> {
    let records = postal_integration_tests::kafka::read_all_with(
        &s.bootstrap,
        t,
        total as usize,
        Duration::from_secs(60),
        &client_properties("admin", &s.admin_password, &s.ca),
    )
    .await;
    let mut next: std::collections::BTreeMap<i64, i64> = Default::default();
    let mut seen = std::collections::BTreeSet::new();
    let mut errs = vec![];
    for r in &records {
        let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        let n = v["n"].as_i64().unwrap();
        if !seen.insert(n) {
            continue;
        }
        let due = next.entry(n % 8).or_insert(n % 8);
        if n != *due {
            errs.push(format!(
                "key k{}: {n} first seen where {due} was due",
                n % 8
            ));
        }
        *due = n + 8;
    }
    let missing: Vec<i64> = (0..total).filter(|n| !seen.contains(n)).collect();
    eprintln!(
        "topic {t}: {} records, {} distinct, {} dups, missing {:?}",
        records.len(),
        seen.len(),
        records.len() - seen.len(),
        &missing[..missing.len().min(20)]
    );
    if !missing.is_empty() {
        errs.push(format!("{} missing", missing.len()));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; "))
    }
}

/// Revoke `revoke` on T while records flow on T and U, wait, grant back. Shared keys if
/// `shared`.
async fn revoke_mid_publish(revoke: &[&str], shared: bool) {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (t, u) = (unique("rev-t"), unique("rev-u"));
    create_topic(&s, &t, 3).await;
    create_topic(&s, &u, 3).await;
    acl_topic("--add", &t, &["Write", "Describe"]);
    acl_topic("--add", &u, &["Write", "Describe"]);
    let dir = bin_dir();
    let logs = dir.join(format!("security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let (mut relay, log) = relay(
        &dir,
        &logs,
        "relay",
        &db.url,
        &s,
        &client_properties("relay", &s.relay_password, &s.ca),
    );
    relay.start();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (pt, pu) = if shared {
        ("s-".to_string(), "s-".to_string())
    } else {
        ("t-".to_string(), "u-".to_string())
    };
    let enq = spawn_enqueuer(
        db.pool.clone(),
        vec![(t.clone(), pt), (u.clone(), pu)],
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    eprintln!(
        "before revoke: T {:?} U {:?}",
        counts(&db.pool, &t).await,
        counts(&db.pool, &u).await
    );
    acl_topic("--remove", &t, revoke);
    eprintln!("revoked {revoke:?} on T");
    let mut u_max_pending = 0;
    for i in 0..25 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        relay.assert_alive();
        let (ct, cu) = (counts(&db.pool, &t).await, counts(&db.pool, &u).await);
        if i > 5 {
            u_max_pending = u_max_pending.max(cu.0);
        }
        eprintln!("t+{i}s: T {ct:?} U {cu:?}");
    }
    let (ct_rev, cu_rev) = (counts(&db.pool, &t).await, counts(&db.pool, &u).await);
    let status = std::process::Command::new(dir.join("postal"))
        .arg("status")
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    eprintln!(
        "STATUS while revoked:\n{}",
        String::from_utf8_lossy(&status.stdout)
    );
    acl_topic("--add", &t, revoke);
    eprintln!("granted back");
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let total = enq.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(150);
    loop {
        let (ct, cu) = (counts(&db.pool, &t).await, counts(&db.pool, &u).await);
        if ct.0 == 0 && cu.0 == 0 {
            break;
        }
        if Instant::now() > deadline {
            eprintln!("NOT DRAINED: T {ct:?} U {cu:?}");
            break;
        }
        relay.assert_alive();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    relay.stop();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    for l in text
        .lines()
        .filter(|l| {
            l.contains("WARN")
                || l.contains("ERROR")
                || l.contains("recreated")
                || l.contains("atal")
        })
        .take(40)
    {
        eprintln!("LOG: {l}");
    }
    let (ct, cu) = (counts(&db.pool, &t).await, counts(&db.pool, &u).await);
    eprintln!("final: T {ct:?} U {cu:?} total per topic {total}");
    let rt = check_topic(&s, &t, total).await;
    let ru = check_topic(&s, &u, total).await;
    acl_topic("--remove", &t, &["Write", "Describe"]);
    acl_topic("--remove", &u, &["Write", "Describe"]);
    let mut problems = vec![];
    if ct_rev.1 > 0 || ct.1 > 0 || cu.1 > 0 {
        problems.push(format!("parked: T {ct:?} U {cu:?}"));
    }
    if ct_rev.2 > 0 {
        problems.push(format!("attempts used on T while revoked: {ct_rev:?}"));
    }
    if u_max_pending > 200 {
        problems.push(format!(
            "U stalled while T revoked: max pending {u_max_pending} ({cu_rev:?})"
        ));
    }
    if ct.0 > 0 || cu.0 > 0 {
        problems.push("not drained".into());
    }
    if text.contains("order is broken") {
        problems.push("relay logged: the key's order is broken at the destination (a later event of a key published on U before its earlier event on T)".into());
    }
    if !text.contains("the relay is not authorised for topic") {
        problems.push("no log line named the missing ACL".into());
    }
    if let Err(e) = rt {
        problems.push(format!("T: {e}"));
    }
    if let Err(e) = ru {
        problems.push(format!("U: {e}"));
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Guarantee (from a review): WRITE revoked on a topic mid-publish (DESCRIBE kept, so its
/// metadata still looks fine) loses, parks and reorders nothing, uses no attempt, another topic
/// keeps flowing, and one log line names the missing ACL (before: the raw broker error only).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revoking_write_mid_publish_waits_and_says_why() {
    revoke_mid_publish(&["Write"], false).await;
}

/// Guarantee (from a review): WRITE and DESCRIBE revoked mid-publish: the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revoking_write_and_describe_mid_publish_waits_and_says_why() {
    revoke_mid_publish(&["Write", "Describe"], false).await;
}

/// Guarantee: keys shared by two topics, WRITE revoked on one mid-publish. A key's scope for
/// order is its topic and key: the refused topic's events wait (no attempt used, nothing
/// parked) and go out in order after the grant, the other topic's events of the same keys keep
/// flowing in order, and the relay never logs "order is broken" (before the scope was one: a
/// batch sent a key's events to both topics at once, and the refused one went out after the
/// key's later event on the other topic).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revoking_write_with_keys_shared_across_topics() {
    revoke_mid_publish(&["Write"], true).await;
}

/// Guarantee: as above, WRITE and DESCRIBE revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revoking_write_and_describe_with_keys_shared_across_topics() {
    revoke_mid_publish(&["Write", "Describe"], true).await;
}

/// Guarantee (from a review): a relay principal that may write no topic at all (DESCRIBE
/// only): the idempotent producer's InitProducerId is refused (CLUSTER_AUTHORIZATION_FAILED, a
/// fatal producer error). Its events wait: no attempt used, nothing parked (before: each
/// producer replacement used an attempt, and the events were parked within about 90 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_principal_that_may_write_nothing_parks_nothing() {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let t = unique("clu-t");
    create_topic(&s, &t, 1).await;
    acl(&[
        "--add",
        "--force",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Describe",
        "--topic",
        &t,
    ]);
    let dir = bin_dir();
    let logs = dir.join(format!("security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let (mut relay, log) = relay(
        &dir,
        &logs,
        "relay",
        &db.url,
        &s,
        &client_properties("consumer", &s.consumer_password, &s.ca),
    );
    relay.start();
    enqueue_jobs(&db.pool, &t, 5).await;
    for i in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        relay.assert_alive();
        if i % 5 == 0 {
            eprintln!("t+{i}s: {:?}", counts(&db.pool, &t).await);
        }
    }
    let c = counts(&db.pool, &t).await;
    let status = std::process::Command::new(dir.join("postal"))
        .arg("status")
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    eprintln!("STATUS:\n{}", String::from_utf8_lossy(&status.stdout));
    relay.stop();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    for l in text.lines().filter(|l| !l.contains(" INFO ")).take(30) {
        eprintln!("LOG: {}", &l[..l.len().min(300)]);
    }
    acl(&[
        "--remove",
        "--force",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Describe",
        "--topic",
        &t,
    ]);
    assert_eq!((c.1, c.2), (0, 0), "parked / attempts used: {c:?}");
}

/// Guarantee (issue: Kafka security): a consumer whose principal may write no topic (READ on
/// its topic and group only) keeps its dead letters in `postal.dead_letters` — the record is
/// still moved past, nothing is lost — and once WRITE on the dead-letter topic is granted it
/// publishes them without a restart. (Before, its idempotent dead-letter producer failed for
/// good at the first attempt — "Cluster authorization failed" — and stayed so until the
/// process restarted; and a principal without CREATE could not publish even to a topic an
/// operator had created.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_wait_for_write_on_their_topic_and_then_go_out() {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (topic, group) = (unique("secure-dlq"), unique("g"));
    let dlq = format!("{topic}.dlq");
    create_topic(&s, &topic, 1).await;
    create_topic(&s, &dlq, 1).await;
    acl(&[
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Read",
        "--operation",
        "Describe",
        "--topic",
        &topic,
    ]);
    acl(&[
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Read",
        "--group",
        &group,
    ]);
    // One good event and one the handler cannot decode (no `n`), written with the admin.
    let mut props = client_properties("admin", &s.admin_password, &s.ca);
    props.push(("bootstrap.servers".into(), s.bootstrap.clone()));
    let mut cfg = rdkafka::ClientConfig::new();
    for (k, v) in &props {
        cfg.set(k, v);
    }
    let producer: rdkafka::producer::FutureProducer = cfg.create().unwrap();
    for (id, body) in [
        (uuid::Uuid::now_v7(), r#"{"n": 1}"#),
        (uuid::Uuid::now_v7(), r#"{"not": "a job"}"#),
    ] {
        use rdkafka::message::{Header, OwnedHeaders};
        let id = id.to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "ce_id",
                value: Some(id.as_str()),
            })
            .insert(Header {
                key: "ce_type",
                value: Some("job"),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json"),
            });
        producer
            .send(
                rdkafka::producer::FutureRecord::to(&topic)
                    .key("k")
                    .payload(body)
                    .headers(headers),
                Duration::from_secs(30),
            )
            .await
            .expect("produced");
    }
    let mut config = consumer_config(&s.bootstrap, &group, crate::handlers::CONSUMER);
    config
        .kafka
        .extend(client_properties("consumer", &s.consumer_password, &s.ca));
    let consumer = start_apply(&db.pool, &topic, config);
    let unpublished = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM postal.dead_letters WHERE published_at IS NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while effects(&db.pool).await.1 < 1 || unpublished().await < 1 {
        assert!(
            Instant::now() < deadline,
            "the good event applied and the bad one dead-lettered: {:?}, {} unpublished",
            effects(&db.pool).await,
            unpublished().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Long enough for publishing to be refused and retried.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(unpublished().await, 1, "kept while it cannot be written");
    acl(&[
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Write",
        "--operation",
        "Describe",
        "--topic",
        &dlq,
    ]);
    let deadline = Instant::now() + Duration::from_secs(90);
    while unpublished().await > 0 {
        assert!(
            Instant::now() < deadline,
            "WRITE on {dlq} granted but the dead letter was not published"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    consumer.stop().await;
    let admin = client_properties("admin", &s.admin_password, &s.ca);
    let seen = postal_integration_tests::kafka::read_all_with(
        &s.bootstrap,
        &dlq,
        1,
        Duration::from_secs(30),
        &admin,
    )
    .await;
    assert_eq!(seen.len(), 1, "the dead letter on {dlq}");
    assert_eq!(effects(&db.pool).await, (1, 1));
}

/// Kills the process when dropped (also when the test fails).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Guarantee (issue: Kafka security): with certificate verification on (as README configures
/// it), a relay refuses a broker whose certificate our CA signed but for another host name
/// (here a TLS server presenting a certificate for `wrong.example` on the broker's address):
/// it says the certificate could not be verified, keeps running and retrying, and parks
/// nothing. (The same server is accepted when hostname verification is switched off, which
/// shows the refusal is the host name's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_host_name_is_refused() {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("secure-host");
    enqueue_jobs(&db.pool, &topic, 5).await;
    let dir = bin_dir();
    let logs = dir.join(format!("security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    // A certificate for wrong.example, signed by the secure node's CA.
    let tls = Path::new(&s.ca).parent().unwrap().to_owned();
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let path = |name: &str| logs.join(name).display().to_string();
    std::fs::write(logs.join("san.ext"), "subjectAltName=DNS:wrong.example\n").unwrap();
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=wrong.example",
        "-keyout",
        &path("wrong.key"),
        "-out",
        &path("wrong.csr"),
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        &path("wrong.csr"),
        "-CA",
        &s.ca,
        "-CAkey",
        &tls.join("ca.key").display().to_string(),
        "-CAcreateserial",
        "-CAserial",
        &path("ca.srl"),
        "-days",
        "1",
        "-extfile",
        &path("san.ext"),
        "-out",
        &path("wrong.crt"),
    ]);
    let port = postal_integration_tests::free_port();
    let _server = Killed(
        std::process::Command::new("openssl")
            .args([
                "s_server",
                "-quiet",
                "-accept",
                &format!("127.0.0.1:{port}"),
                "-cert",
                &path("wrong.crt"),
                "-key",
                &path("wrong.key"),
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("openssl s_server"),
    );
    // Listening before the relay starts: a first connection refused would read as "said
    // something about its broker" below.
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "openssl s_server never listened on {port}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elsewhere = Secure {
        bootstrap: format!("127.0.0.1:{port}"),
        ca: s.ca.clone(),
        relay_password: s.relay_password.clone(),
        consumer_password: s.consumer_password.clone(),
        admin_password: s.admin_password.clone(),
    };
    let said = "certificate verify failed";
    let verified = client_properties("relay", &s.relay_password, &s.ca);
    let mut unverified = verified.clone();
    for (k, v) in unverified.iter_mut() {
        if k == "ssl.endpoint.identification.algorithm" {
            *v = "none".into();
        }
    }
    for (name, properties, refused) in [
        ("hostname-verified", verified, true),
        ("hostname-not-verified", unverified, false),
    ] {
        let (mut relay, log) = relay(&dir, &logs, name, &db.url, &elsewhere, &properties);
        relay.start();
        // What the relay says about its broker connection: a TLS refusal, or (with the host
        // name not checked) that the server does not speak Kafka.
        let deadline = Instant::now() + Duration::from_secs(60);
        let text = loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains(said) || text.contains("127.0.0.1") && text.contains("WARN") {
                break text;
            }
            relay.assert_alive();
            assert!(
                Instant::now() < deadline,
                "{name}: the log never said anything about the broker:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(
            text.contains(said),
            refused,
            "{name}: refused for its certificate: {refused}\n{text}"
        );
        relay.assert_alive();
        assert_eq!(
            outbox_left(&db.pool).await,
            (5, 0),
            "{name}: events stay pending"
        );
        relay.stop();
    }
}

/// Guarantee (issue: Kafka security): one-shot commands reach a SASL_SSL cluster with the same
/// properties as the relay (`POSTAL_KAFKA_FILE`): `postal consumer reset` prints its plan
/// over verified TLS with the consumer's principal; with a wrong password it exits non-zero
/// with one line and changes nothing. (Before, the CLI's Kafka clients took no properties and
/// could not reach a secured cluster at all.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_commands_reach_a_secured_cluster_or_fail_in_one_line() {
    let Some(s) = secure() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (topic, group) = (unique("secure-reset"), unique("g"));
    create_topic(&s, &topic, 2).await;
    acl(&[
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Read",
        "--operation",
        "Describe",
        "--topic",
        &topic,
    ]);
    acl(&[
        "--add",
        "--allow-principal",
        "User:consumer",
        "--operation",
        "Read",
        "--operation",
        "Describe",
        "--group",
        &group,
    ]);
    let dir = bin_dir();
    let logs = dir.join(format!("security-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();
    let reset = |name: &str, password: &str| {
        let file = logs.join(format!("{name}.properties"));
        let text: String = client_properties("consumer", password, &s.ca)
            .iter()
            .map(|(k, v)| format!("{k}={v}\n"))
            .collect();
        std::fs::write(&file, text).unwrap();
        std::process::Command::new(dir.join("postal"))
            .args([
                "consumer",
                "reset",
                "--group",
                &group,
                "--topic",
                &topic,
                "--to",
                "earliest",
                "--new-group",
                "--bootstrap-servers",
                &s.bootstrap,
            ])
            .env("DATABASE_URL", &db.url)
            .env("POSTAL_KAFKA_FILE", &file)
            .output()
            .expect("postal runs")
    };
    let out = reset("right", &s.consumer_password);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "reset plan over SASL_SSL: {stdout}{stderr}"
    );
    assert!(
        stdout.contains(&topic),
        "the plan names the topic: {stdout}"
    );
    let wrong = format!("{}-wrong", s.consumer_password);
    let out = reset("wrong", &wrong);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a wrong password succeeded");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(!stderr.contains(&wrong), "the password is shown: {stderr}");
    assert!(
        stderr.contains("Authentication failed"),
        "names the cause: {stderr}"
    );
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.consumer_offsets")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, 0, "nothing changed");
}
