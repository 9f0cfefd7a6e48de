//! Operator commands against real PostgreSQL and a real broker (`DATABASE_URL` and
//! `KAFKA_BOOTSTRAP_SERVERS`, as `scripts/test.sh` sets them; skipped otherwise).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use postal_consumer::{idempotent, Consumer, ConsumerConfig, Event, HandlerError, Stats};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::{PgPool, Postgres, Transaction};

fn postal(url: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_postal"));
    c.env("DATABASE_URL", url).env("POSTAL_LOG", "warn");
    c
}

fn ok(mut c: Command) -> String {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `c`, which must fail; returns its stderr.
fn fails(mut c: Command) -> String {
    let out = c.output().unwrap();
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr).unwrap()
}

struct Env {
    url: String,
    pool: PgPool,
    bootstrap: String,
    /// The test's database, dropped when the test passed.
    _db: postal_integration_tests::TestDb,
}

async fn env() -> Option<Env> {
    let (Ok(server), Ok(bootstrap)) = (
        std::env::var("DATABASE_URL"),
        std::env::var("KAFKA_BOOTSTRAP_SERVERS"),
    ) else {
        eprintln!(
            "DATABASE_URL / KAFKA_BOOTSTRAP_SERVERS not set: skipping (scripts/test.sh sets them)"
        );
        return None;
    };
    let db = postal_integration_tests::create_db(&server).await;
    let (url, pool) = (db.url.clone(), db.pool.clone());
    postal_shared::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (event_id uuid NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    Some(Env {
        url,
        pool,
        bootstrap,
        _db: db,
    })
}

fn unique(p: &str) -> String {
    format!("{p}-{}", uuid::Uuid::now_v7().simple())
}

async fn until<F: Fn() -> Fut, Fut: std::future::Future<Output = bool>>(what: &str, f: F) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn create_topic(bootstrap: &str, topic: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    admin
        .create_topics(
            [&NewTopic::new(topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
}

/// Writes events with `ce_id` / `ce_type`.
async fn produce(bootstrap: &str, topic: &str, bodies: &[&str]) -> Vec<uuid::Uuid> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let mut ids = Vec::new();
    for body in bodies {
        let id = uuid::Uuid::now_v7();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "ce_id",
                value: Some(&id.to_string()),
            })
            .insert(Header {
                key: "ce_type",
                value: Some("job"),
            });
        producer
            .send(
                FutureRecord::to(topic)
                    .key("k")
                    .payload(*body)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        ids.push(id);
    }
    ids
}

fn read_ids(bootstrap: &str, topic: &str) -> Vec<String> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("reader"))
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    c.assign(&tpl).unwrap();
    let mut ids = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
            if let Some(h) = m.headers() {
                for h in h.iter().filter(|h| h.key == "ce_id") {
                    ids.push(String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned());
                }
            }
        }
    }
    ids
}

/// Waits until the outbox is empty, then kills the relay process `r`.
async fn stop_when_drained(e: &Env, mut r: Child) {
    until("the outbox to drain", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox")
            .fetch_one(&e.pool)
            .await
            .unwrap()
            == 0
    })
    .await;
    r.kill().unwrap();
    r.wait().unwrap();
}

/// Runs a relay until the outbox is empty, then returns the event ids on `topic`.
async fn drain_and_read(e: &Env, topic: &str) -> Vec<String> {
    stop_when_drained(e, relay(e, &[])).await;
    let (b, t) = (e.bootstrap.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || read_ids(&b, &t))
        .await
        .unwrap()
}

/// Relay flags that park any record of more than 1,000 bytes as too large.
const TOO_SMALL: &[&str] = &["--kafka", "message.max.bytes=1000"];

fn relay(e: &Env, extra: &[&str]) -> Child {
    postal(&e.url)
        .args([
            "relay",
            "--bootstrap-servers",
            &e.bootstrap,
            "--lease",
            "3s",
            "--poll-interval",
            "100ms",
            "--kafka",
            "message.timeout.ms=1000",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Guarantee: `postal relay --route` sends each topic to its configured destination: the
/// RabbitMQ topic's events arrive there (message id = event id, routing key mapped by
/// `--rabbitmq-routing-key`), the other topic's go to Kafka through the fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_routes_topics_to_rabbitmq_and_kafka() {
    use postal_integration_tests::rabbit;
    let Some(e) = env().await else { return };
    let Ok(amqp) = std::env::var("AMQP_URL") else {
        eprintln!("AMQP_URL not set: skipping (scripts/test.sh sets it)");
        return;
    };
    let to_rabbit = unique("cli-rmq");
    let to_kafka = unique("cli-kafka");
    let queue = rabbit::bind_queue(&amqp, &to_rabbit, "orders.created.v1").await;
    let mut rabbit_ids = Vec::new();
    for i in 0..20 {
        let id: uuid::Uuid = sqlx::query_scalar(
            "SELECT postal.enqueue($1, $2, 'order.created', jsonb_build_object('i', $3::int))",
        )
        .bind(&to_rabbit)
        .bind(format!("k{}", i % 3))
        .bind(i)
        .fetch_one(&e.pool)
        .await
        .unwrap();
        rabbit_ids.push(id.to_string());
    }
    let kafka_id: uuid::Uuid =
        sqlx::query_scalar("SELECT postal.enqueue($1, 'k', 'job', '{}'::jsonb)")
            .bind(&to_kafka)
            .fetch_one(&e.pool)
            .await
            .unwrap();
    let route = format!("{to_rabbit}=rabbitmq");
    let r = relay(
        &e,
        &[
            "--route",
            &route,
            "--rabbitmq-url",
            &amqp,
            "--rabbitmq-routing-key",
            "order.created=orders.created.v1",
            "--rabbitmq-confirm-timeout",
            "1s",
            "--topic-partitions",
            "1",
        ],
    );
    stop_when_drained(&e, r).await;
    let messages = rabbit::read_all(&amqp, &queue, 20, Duration::from_secs(30)).await;
    let got: Vec<String> = messages
        .iter()
        .filter_map(|m| m.message_id.clone())
        .collect();
    let mut want = rabbit_ids.clone();
    want.sort();
    let mut got_sorted = got.clone();
    got_sorted.sort();
    assert_eq!(got_sorted, want, "each RabbitMQ event once");
    assert!(messages
        .iter()
        .all(|m| m.routing_key == "orders.created.v1"));
    let (b, t) = (e.bootstrap.clone(), to_kafka.clone());
    let ids = tokio::task::spawn_blocking(move || read_ids(&b, &t))
        .await
        .unwrap();
    assert_eq!(ids, [kafka_id.to_string()], "the other topic went to Kafka");
}

/// Guarantee: a parked event is visible in `postal failed list/show`, `postal failed requeue`
/// makes it pending again with its event id unchanged, and the relay then publishes it exactly
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeued_parked_event_is_published_once() {
    let Some(e) = env().await else { return };
    let topic = unique("parked");
    let id: uuid::Uuid = sqlx::query_scalar(
        "SELECT postal.enqueue($1, 'k', 'job', jsonb_build_object('pad', repeat('x', 2000)))",
    )
    .bind(&topic)
    .fetch_one(&e.pool)
    .await
    .unwrap();
    create_topic(&e.bootstrap, &topic).await;
    // A relay whose producer takes records of at most 1,000 bytes parks the 2 kB event.
    let mut r = relay(&e, TOO_SMALL);
    until("the event to be parked", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox WHERE status = 'failed'")
            .fetch_one(&e.pool)
            .await
            .unwrap()
            == 1
    })
    .await;
    r.kill().unwrap();
    r.wait().unwrap();

    let mut list = postal(&e.url);
    list.args(["failed", "list", "--json"]);
    let listed: serde_json::Value = serde_json::from_str(&ok(list)).unwrap();
    assert_eq!(listed[0]["event_id"], id.to_string());
    assert!(listed[0]["last_error"]
        .as_str()
        .unwrap()
        .contains("exceeds the producer's message.max.bytes"));
    // Filtered as in the dashboard: by key, type and error text (case-insensitive).
    let mut list = postal(&e.url);
    list.args(["failed", "list", "--json", "--topic", &topic])
        .args(["--key", "k", "--type", "job", "--reason", "MAX.BYTES"]);
    let listed: serde_json::Value = serde_json::from_str(&ok(list)).unwrap();
    assert_eq!(listed[0]["event_id"], id.to_string());
    let mut list = postal(&e.url);
    list.args(["failed", "list", "--topic", &topic, "--key", "other"]);
    assert!(ok(list).contains("(no parked events)"));
    let mut show = postal(&e.url);
    show.args(["failed", "show", &id.to_string()]);
    let shown = ok(show);
    assert!(shown.contains("status:       failed"));
    assert!(
        shown.contains(&"x".repeat(2000)),
        "the payload whole: {shown}"
    );

    let mut requeue = postal(&e.url);
    requeue.args(["failed", "requeue", "--id", &id.to_string()]);
    assert!(ok(requeue).contains("requeued 1 event(s)"));
    let ids = drain_and_read(&e, &topic).await;
    assert_eq!(
        ids,
        [id.to_string()],
        "published once, with its original id"
    );
}

/// Guarantee: `postal failed discard` deletes a parked event only after printing it whole
/// (id, payload, error), and releases its key: the later event of the same key, which waited
/// behind it, is then published, and the discarded one never is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discarded_parked_event_releases_its_key() {
    let Some(e) = env().await else { return };
    let topic = unique("discard");
    let mut ids = Vec::new();
    for n in 1..=2 {
        // The first is 2 kB, too large for the first relay below; the second is small.
        let id: uuid::Uuid = sqlx::query_scalar(
            "SELECT postal.enqueue($1, 'k', 'job',
                    jsonb_build_object('n', $2, 'pad', repeat('x', CASE WHEN $2 = 1 THEN 2000 ELSE 0 END)))",
        )
        .bind(&topic)
        .bind(n)
        .fetch_one(&e.pool)
        .await
        .unwrap();
        ids.push(id);
    }
    create_topic(&e.bootstrap, &topic).await;
    let mut r = relay(&e, TOO_SMALL);
    until("the first event to be parked", || async {
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT status FROM postal.outbox WHERE event_id = $1",
        )
        .bind(ids[0])
        .fetch_one(&e.pool)
        .await
        .unwrap()
        .as_deref()
            == Some("failed")
    })
    .await;
    r.kill().unwrap();
    r.wait().unwrap();

    let mut none = postal(&e.url);
    none.args(["failed", "discard"]);
    let refused = none.output().unwrap();
    assert!(!refused.status.success(), "discard needs a selection");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("say what to discard"));
    let mut discard = postal(&e.url);
    discard.args(["failed", "discard", "--id", &ids[0].to_string()]);
    let printed = ok(discard);
    let lines: Vec<serde_json::Value> = printed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{printed}");
    assert_eq!(lines[0]["event_id"], ids[0].to_string());
    assert_eq!(lines[0]["event_key"], "k");
    // The line names the event; the event itself is kept whole in the audit trail.
    let mut show = postal(&e.url);
    show.args(["audit", "show", &lines[0]["audit_id"].to_string()]);
    let shown = ok(show);
    let kept: serde_json::Value = serde_json::from_str(shown.lines().nth(1).unwrap()).unwrap();
    assert_eq!(kept["event_id"], ids[0].to_string());
    let payload: serde_json::Value =
        serde_json::from_str(kept["payload"].as_str().unwrap()).unwrap();
    assert_eq!(payload["n"], 1);
    assert!(kept["last_error"]
        .as_str()
        .unwrap()
        .contains("exceeds the producer's message.max.bytes"));

    let published = drain_and_read(&e, &topic).await;
    assert_eq!(
        published,
        [ids[1].to_string()],
        "the later event of the key, and not the discarded one"
    );
}

#[idempotent(consumer = "cli-test")]
async fn record(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<serde_json::Value>,
) -> Result<(), HandlerError> {
    let enabled: bool =
        sqlx::query_scalar("SELECT count(*) = 0 FROM pg_tables WHERE tablename = 'broken'")
            .fetch_one(&mut **tx)
            .await?;
    if !enabled {
        return Err(HandlerError::permanent("the ledger is broken"));
    }
    sqlx::query("INSERT INTO effects VALUES ($1)")
        .bind(event.id.as_uuid())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn start_consumer(
    e: &Env,
    group: &str,
    topic: &str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<Stats>,
) {
    let mut config = ConsumerConfig::new(e.bootstrap.clone(), group);
    config.kafka_commit_interval = Duration::from_millis(200);
    config
        .kafka
        .insert("session.timeout.ms".into(), "6000".into());
    config
        .kafka
        .insert("max.poll.interval.ms".into(), "10000".into());
    let consumer = Consumer::builder(e.pool.clone(), config)
        .on(topic, "job", record)
        .build()
        .unwrap();
    let stats = consumer.stats();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        consumer
            .run(async move {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    (tx, task, stats)
}

/// Whether the broker lists `group` with at least one member.
async fn group_has_members(bootstrap: String, group: String) -> bool {
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()
            .unwrap();
        c.fetch_group_list(Some(&group), Duration::from_secs(5))
            .map(|l| {
                l.groups()
                    .iter()
                    .any(|x| x.name() == group && !x.members().is_empty())
            })
            .unwrap_or(false)
    })
    .await
    .unwrap()
}

async fn effects(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Guarantee: `postal consumer reset --to earliest` refuses while the group has live members
/// (one line, saying what to wait for when they are consumers that stopped without leaving),
/// only prints its plan without `--execute`, moves the stored offsets once it is stopped, and the replay that follows applies nothing
/// twice (every replayed event is recognised as a duplicate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_reset_then_replay_applies_nothing_twice() {
    let Some(e) = env().await else { return };
    let (topic, group) = (unique("reset"), unique("g"));
    create_topic(&e.bootstrap, &topic).await;
    produce(&e.bootstrap, &topic, &["{}"; 20]).await;
    let (stop, task, stats) = start_consumer(&e, &group, &topic);
    until("20 events applied", || async {
        stats.snapshot().applied == 20
    })
    .await;

    let reset = || {
        let mut c = postal(&e.url);
        c.args([
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
        .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
        c
    };
    // The broker reports the running consumer as a member (group state can lag under load).
    until("the group to show its member", || {
        group_has_members(e.bootstrap.clone(), group.clone())
    })
    .await;
    let refused = reset().output().unwrap();
    assert!(!refused.status.success());
    let why = String::from_utf8_lossy(&refused.stderr);
    // What to wait for when the member is a consumer that stopped without leaving.
    assert!(
        why.contains("live member")
            && why.contains("nothing changed")
            && why.contains("session.timeout.ms, 45 s unless they set it")
            && why.lines().count() == 1,
        "{why}"
    );
    stop.send(()).unwrap();
    task.await.unwrap();

    // Without --execute: the plan, and nothing changed.
    let mut dry = postal(&e.url);
    dry.args([
        "consumer", "reset", "--group", &group, "--topic", &topic, "--to", "earliest",
    ])
    .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
    let plan = ok(dry);
    assert!(
        plan.contains(&format!(
            "plan: {group} {topic}[0]: next offset 20 -> 0 (moves back 20 offsets"
        )) && plan.contains("dry run: nothing changed; add --execute"),
        "{plan}"
    );
    assert_eq!(stored_offset(&e.pool, &group, &topic).await, Some(20));
    assert!(ok(reset()).contains("-> next offset 0"));
    let (stop, task, stats) = start_consumer(&e, &group, &topic);
    until("the replay of 20 events", || async {
        stats.snapshot().duplicates == 20
    })
    .await;
    stop.send(()).unwrap();
    task.await.unwrap();
    assert_eq!(stats.snapshot().applied, 0);
    assert_eq!(effects(&e.pool).await, (20, 20), "nothing applied twice");
}

/// Guarantee: a dead letter shows up in `postal dead-letters list/show`, and `postal
/// dead-letters replay` sends it back to its topic, where the (fixed) handler applies it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_replay_applies_once() {
    let Some(e) = env().await else { return };
    let (ids, stop, task, stats) = one_dead_letter(&e).await;

    let mut list = postal(&e.url);
    list.args(["dead-letters", "list", "--json"]);
    let listed: serde_json::Value = serde_json::from_str(&ok(list)).unwrap();
    assert_eq!(listed[0]["event_id"], ids[0].to_string());
    assert_eq!(listed[0]["reason"], "permanent");
    let dl_id = listed[0]["id"].as_i64().unwrap().to_string();
    let mut show = postal(&e.url);
    show.args(["dead-letters", "show", &dl_id]);
    assert!(ok(show).contains("the ledger is broken"));

    sqlx::query("DROP TABLE broken")
        .execute(&e.pool)
        .await
        .unwrap();
    let mut replay = postal(&e.url);
    replay
        .args(["dead-letters", "replay", "--all"])
        .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
    assert!(ok(replay).contains("replayed 1 dead letter(s)"));
    until("the replayed event applied", || async {
        stats.snapshot().applied == 1
    })
    .await;
    stop.send(()).unwrap();
    task.await.unwrap();
    assert_eq!(effects(&e.pool).await, (1, 1));
    let mut again = postal(&e.url);
    again.args(["dead-letters", "list", "--json"]);
    let remaining: serde_json::Value = serde_json::from_str(&ok(again)).unwrap();
    assert_eq!(remaining.as_array().unwrap().len(), 0, "marked replayed");
}

/// Guarantee: `postal dead-letters replay` removes only the dedup row its dead letter wrote.
/// When a copy of the dead-lettered event was applied since (a replay retried after a failed
/// send, two replays at once, or a dead letter recorded before dead letters kept their row),
/// that copy's row stays and the replayed record is a duplicate: the event is applied once.
/// Before, replay deleted whatever row the event had and applied it a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_replay_never_applies_an_event_twice() {
    let Some(e) = env().await else { return };
    let (ids, stop, task, stats) = one_dead_letter(&e).await;
    // Meanwhile a copy of the event was applied: its effect and its own dedup row (written
    // in a later transaction than the dead letter).
    sqlx::query("DROP TABLE broken")
        .execute(&e.pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO effects VALUES ($1)")
        .bind(ids[0])
        .execute(&e.pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE postal.processed_events SET processed_at = processed_at + interval '1 second'
         WHERE event_id = $1",
    )
    .bind(ids[0])
    .execute(&e.pool)
    .await
    .unwrap();
    let mut replay = postal(&e.url);
    replay
        .args(["dead-letters", "replay", "--all"])
        .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
    assert!(ok(replay).contains("replayed 1 dead letter(s)"));
    until("the replayed record recognised as a duplicate", || async {
        stats.snapshot().duplicates == 1
    })
    .await;
    stop.send(()).unwrap();
    task.await.unwrap();
    assert_eq!(stats.snapshot().applied, 0);
    assert_eq!(effects(&e.pool).await, (1, 1), "applied once");
    // A second replay finds nothing left to replay.
    let mut again = postal(&e.url);
    again
        .args(["dead-letters", "replay", "--all"])
        .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
    assert!(ok(again).contains("replayed 0 dead letter(s)"));
}

/// One event on a fresh topic, dead-lettered by a consumer whose ledger is broken (the
/// `broken` table exists); the consumer keeps running.
async fn one_dead_letter(
    e: &Env,
) -> (
    Vec<uuid::Uuid>,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<Stats>,
) {
    let (topic, group) = (unique("dl"), unique("g"));
    create_topic(&e.bootstrap, &topic).await;
    sqlx::query("CREATE TABLE broken ()")
        .execute(&e.pool)
        .await
        .unwrap();
    let ids = produce(&e.bootstrap, &topic, &["{}"]).await;
    let (stop, task, stats) = start_consumer(e, &group, &topic);
    until("the dead letter", || async {
        stats.snapshot().dead_letters == 1
    })
    .await;
    (ids, stop, task, stats)
}

fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some((out.get(9..12)?.parse().ok()?, out))
}

/// Guarantee: `postal relay --metrics-addr` serves Prometheus metrics (backlog gauge included),
/// liveness and readiness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_serves_metrics_and_health() {
    let Some(e) = env().await else { return };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    // An event scheduled an hour ahead is not backlog (the "relay stuck" alert must not fire
    // on it) and is counted as scheduled.
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload,
                                    available_at, held)
         VALUES (gen_random_uuid(), 't', 'k', 'reminder', '\\x7b7d',
                 now() + interval '1 hour', true)",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let mut r = relay(&e, &["--metrics-addr", &addr]);
    until("the gauges on /metrics", || async {
        http_get(&addr, "/metrics").is_some_and(|(s, body)| {
            s == 200
                && body.lines().any(|l| l == "postal_relay_backlog 0")
                && body.lines().any(|l| l == "postal_relay_scheduled 1")
        })
    })
    .await;
    assert_eq!(http_get(&addr, "/healthz").map(|r| r.0), Some(200));
    assert_eq!(http_get(&addr, "/readyz").map(|r| r.0), Some(200));
    r.kill().unwrap();
    r.wait().unwrap();
}

/// Guarantee: `postal cleanup` deletes kept published outbox rows, dedup rows and published
/// dead letters older than the given retention, and nothing newer (and never pending rows or
/// dead letters not yet published to their topic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_deletes_only_expired_rows() {
    let Some(e) = env().await else { return };
    for (age, status) in [(3, "published"), (0, "published"), (3, "pending")] {
        sqlx::query(
            "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                        created_at, published_at)
             SELECT gen_random_uuid(), 't', 'k', 'e', '\\x7b7d', $2,
                    now() - $1 * interval '1 day',
                    CASE WHEN $2 = 'published' THEN now() - $1 * interval '1 day' END
             FROM generate_series(1, 30)",
        )
        .bind(age)
        .bind(status)
        .execute(&e.pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
             SELECT 'billing', gen_random_uuid(), now() - $1 * interval '1 day'
             FROM generate_series(1, 10)",
        )
        .bind(age)
        .execute(&e.pool)
        .await
        .unwrap();
    }
    // Dead letters: old and published (deleted), old and not published yet, new and published.
    for (age, published) in [(3, true), (3, false), (0, true)] {
        sqlx::query(
            "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                                              kafka_offset, reason, error, dlq_topic,
                                              created_at, published_at)
             SELECT 'billing', 'g', 't', 0, n, 'permanent', 'bad', 't.dlq',
                    now() - $1 * interval '1 day',
                    CASE WHEN $2 THEN now() - $1 * interval '1 day' END
             FROM generate_series(1, 5) AS n",
        )
        .bind(age)
        .bind(published)
        .execute(&e.pool)
        .await
        .unwrap();
    }
    let mut c = postal(&e.url);
    c.args([
        "cleanup",
        "--published-retention",
        "1day",
        "--dedup-retention",
        "1day",
        "--dead-letter-retention",
        "1day",
        "--batch",
        "7",
    ]);
    let out = ok(c);
    assert!(out.contains("deleted 30 published row(s)"), "{out}");
    assert!(out.contains("dedup billing: deleted 20 row(s)"), "{out}");
    assert!(
        out.contains("dead letters: deleted 5 published row(s)"),
        "{out}"
    );
    let dead: Vec<(bool, i64)> = sqlx::query_as(
        "SELECT published_at IS NOT NULL, count(*) FROM postal.dead_letters GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&e.pool)
    .await
    .unwrap();
    assert_eq!(
        dead,
        [(false, 5), (true, 5)],
        "the old unpublished and the new published ones stay"
    );
    let left: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM postal.outbox GROUP BY 1 ORDER BY 1")
            .fetch_all(&e.pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        [("pending".to_owned(), 30), ("published".to_owned(), 30)]
    );
    let dedup: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(dedup, 10);
}

/// Writes one event per timestamp (milliseconds since the epoch) as the record's timestamp.
async fn produce_at(bootstrap: &str, topic: &str, timestamps: &[i64]) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    for ts in timestamps {
        let id = uuid::Uuid::now_v7().to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "ce_id",
                value: Some(&id),
            })
            .insert(Header {
                key: "ce_type",
                value: Some("job"),
            });
        producer
            .send(
                FutureRecord::to(topic)
                    .key("k")
                    .payload("{}")
                    .headers(headers)
                    .timestamp(*ts),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
}

/// The group's stored next offset of partition 0 of `topic`.
async fn stored_offset(pool: &PgPool, group: &str, topic: &str) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets
         WHERE group_id = $1 AND topic = $2 AND partition = 0",
    )
    .bind(group)
    .bind(topic)
    .fetch_optional(pool)
    .await
    .unwrap()
    .flatten()
}

/// Guarantee: once `postal cleanup --dedup-retention 7d` deleted dedup rows, `postal consumer
/// reset` refuses (exit non-zero, one line saying why and what to do, stored offset unchanged)
/// a target whose records are older than the deleted rows, since their replay would apply
/// twice; a target inside the horizon is accepted, and `--force-past-retention` overrides.
/// `postal status` shows the horizon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_reset_refuses_targets_past_the_dedup_horizon() {
    let Some(e) = env().await else { return };
    let (topic, group) = (unique("horizon"), unique("g"));
    create_topic(&e.bootstrap, &topic).await;
    let now = chrono::Utc::now().timestamp_millis();
    let day = 24 * 3600 * 1000;
    // Offsets 0..3: produced 9 days ago; 3..5: now.
    produce_at(
        &e.bootstrap,
        &topic,
        &[now - 9 * day, now - 9 * day, now - 9 * day, now, now],
    )
    .await;
    // Dedup rows: processed 8 days ago (expired under 7d) and an hour ago (kept).
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
         VALUES ('cli-test', gen_random_uuid(), now() - interval '8 days'),
                ('cli-test', gen_random_uuid(), now() - interval '1 hour')",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let mut cleanup = postal(&e.url);
    cleanup.args(["cleanup", "--dedup-retention", "7d"]);
    assert!(ok(cleanup).contains("dedup cli-test: deleted 1 row(s)"));
    let mut status = postal(&e.url);
    status.args(["status", "--json"]);
    let status: serde_json::Value = serde_json::from_str(&ok(status)).unwrap();
    assert_eq!(status["dedup_horizons"][0]["consumer_name"], "cli-test");

    let reset = |to: &str, extra: &[&str]| {
        let mut c = postal(&e.url);
        c.args([
            "consumer",
            "reset",
            "--execute",
            "--group",
            &group,
            "--topic",
            &topic,
            "--to",
            to,
        ])
        .args(extra)
        .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
        c
    };
    assert!(
        ok(reset("3", &["--new-group"])).contains("-> next offset 3"),
        "inside"
    );
    assert_eq!(stored_offset(&e.pool, &group, &topic).await, Some(3));

    let refused = reset("earliest", &[]).output().unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(
        lines[0].starts_with(&format!("error: {topic}[0] offset 0 may hold records processed before consumer \"cli-test\"'s dedup retention horizon")),
        "{stderr}"
    );
    assert!(
        lines[0].contains("reset to offset 3 or later, or pass --force-past-retention"),
        "{stderr}"
    );
    assert_eq!(
        stored_offset(&e.pool, &group, &topic).await,
        Some(3),
        "unchanged"
    );

    // Naming only a consumer whose rows were never deleted: nothing to protect. (A name that
    // never deduplicated here is refused: reset_horizon::a_wrong_consumer_name_…)
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id) VALUES ('other', gen_random_uuid())",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    assert!(ok(reset("1", &["--consumer", "other"])).contains("-> next offset 1"));
    // The move back left a mark of the position it left (3).
    let left: Vec<i64> = sqlx::query_scalar(
        "SELECT next_offset FROM postal.offset_marks WHERE group_id = $1 AND topic = $2",
    )
    .bind(&group)
    .bind(&topic)
    .fetch_all(&e.pool)
    .await
    .unwrap();
    assert_eq!(left, vec![3], "the reset marked the position it left");
    assert!(ok(reset("earliest", &["--force-past-retention"])).contains("-> next offset 0"));
    assert_eq!(stored_offset(&e.pool, &group, &topic).await, Some(0));
}

/// Guarantee: `postal consumer reset` refuses a target below the highest position the group's
/// offset marks (`postal.offset_marks`, database clock) show it had reached by the first mark
/// after the dedup horizon, even when every record's timestamp is newer than the horizon (a
/// producer clock far ahead) and when the group had moved back meanwhile, and names the offset
/// to reset to; a target at or above it is accepted. (Failed before the marks: only
/// timestamps were checked and `--to 2` was accepted, so the replay would apply records whose
/// dedup rows were deleted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_reset_refuses_targets_below_the_groups_offset_marks() {
    let Some(e) = env().await else { return };
    let (topic, group) = (unique("marks"), unique("g"));
    create_topic(&e.bootstrap, &topic).await;
    let now = chrono::Utc::now().timestamp_millis();
    produce_at(&e.bootstrap, &topic, &[now; 8]).await;
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
         VALUES ('cli-test', gen_random_uuid(), now() - interval '8 days')",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let mut cleanup = postal(&e.url);
    cleanup.args(["cleanup", "--dedup-retention", "7d"]);
    assert!(ok(cleanup).contains("dedup cli-test: deleted 1 row(s)"));
    // The group had reached 5 an hour before the horizon; a move back to 1 (a reset whose own
    // mark was lost, or an older Postal's) was marked twenty minutes after it; it stood at 8
    // later and now. Records 1..5 were processed before the horizon although the first mark
    // after it says 1 (a review found the first version trusting that mark: `--to 3`
    // accepted).
    sqlx::query(
        "INSERT INTO postal.offset_marks (group_id, topic, partition, next_offset, marked_at)
         VALUES ($1, $2, 0, 5, now() - interval '8 days' - interval '1 hour'),
                ($1, $2, 0, 1, now() - interval '8 days' + interval '20 minutes'),
                ($1, $2, 0, 8, now() - interval '8 days' + interval '40 minutes'),
                ($1, $2, 0, 8, now() - interval '1 minute');
         ",
    )
    .bind(&group)
    .bind(&topic)
    .execute(&e.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO postal.consumer_offsets (group_id, topic, partition, next_offset)
         VALUES ($1, $2, 0, 8)",
    )
    .bind(&group)
    .bind(&topic)
    .execute(&e.pool)
    .await
    .unwrap();
    let reset = |to: &str| {
        let mut c = postal(&e.url);
        c.args([
            "consumer",
            "reset",
            "--execute",
            "--group",
            &group,
            "--topic",
            &topic,
            "--to",
            to,
        ])
        .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
        c
    };
    for to in ["2", "3"] {
        let refused = reset(to).output().unwrap();
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "--to {to}: {stderr}");
        assert!(stderr.contains("reset to offset 5 or later"), "{stderr}");
    }
    assert_eq!(stored_offset(&e.pool, &group, &topic).await, Some(8));
    assert!(ok(reset("5")).contains("-> next offset 5"));
}

/// Guarantee: a running consumer records where its group stands in `postal.offset_marks`
/// (what `postal consumer reset` reads), at most every 10 minutes per partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_consumer_marks_its_offsets() {
    let Some(e) = env().await else { return };
    let (topic, group) = (unique("marking"), unique("g"));
    create_topic(&e.bootstrap, &topic).await;
    produce(&e.bootstrap, &topic, &["{}"; 3]).await;
    let mut config = ConsumerConfig::new(e.bootstrap.clone(), group.clone());
    config.cleanup_interval = Duration::from_millis(200);
    let consumer = Consumer::builder(e.pool.clone(), config)
        .on(&topic, "job", record)
        .build()
        .unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async move {
        let _ = rx.await;
    }));
    let pool = e.pool.clone();
    until("a mark of the group's offset", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM postal.offset_marks WHERE group_id = $1 AND next_offset > 0",
        )
        .bind(&group)
        .fetch_one(&pool)
        .await
        .unwrap()
            == 1
    })
    .await;
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

/// Guarantee: a running consumer exports the age of its oldest dedup row as
/// `postal_consumer_dedup_oldest_seconds{consumer}`, updated after its retention deletes
/// expired rows (and the deletion is recorded as its dedup horizon).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_reports_the_age_of_its_oldest_dedup_row() {
    let Some(e) = env().await else { return };
    let topic = unique("oldest");
    create_topic(&e.bootstrap, &topic).await;
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
         VALUES ('cli-test', gen_random_uuid(), now() - interval '10 days'),
                ('cli-test', gen_random_uuid(), now() - interval '2 hours')",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let addr = format!("127.0.0.1:{}", postal_integration_tests::free_port());
    let mut config = ConsumerConfig::new(e.bootstrap.clone(), unique("g"));
    config.dedup_retention = Some(Duration::from_secs(24 * 3600));
    config.cleanup_interval = Duration::from_millis(200);
    config.ops_addr = Some(addr.parse().unwrap());
    let consumer = Consumer::builder(e.pool.clone(), config)
        .on(&topic, "job", record)
        .build()
        .unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async move {
        let _ = rx.await;
    }));
    let age = |body: &str| {
        body.lines()
            .find_map(|l| {
                l.strip_prefix("postal_consumer_dedup_oldest_seconds{consumer=\"cli-test\"} ")
            })
            .and_then(|v| v.parse::<f64>().ok())
    };
    until(
        "the gauge to show the 2-hour-old row as the oldest",
        || async {
            http_get(&addr, "/metrics")
                .and_then(|(_, body)| age(&body))
                .is_some_and(|a| (7200.0..7300.0).contains(&a))
        },
    )
    .await;
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    let horizon_age_days: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - horizon)::float8 / 86400 FROM postal.dedup_horizon
         WHERE consumer_name = 'cli-test'",
    )
    .fetch_one(&e.pool)
    .await
    .unwrap();
    assert!(
        (9.9..10.1).contains(&horizon_age_days),
        "{horizon_age_days}"
    );
    let declared: Option<i64> = sqlx::query_scalar(
        "SELECT dedup_retention_ms FROM postal.consumer_settings WHERE consumer_name = 'cli-test'",
    )
    .fetch_one(&e.pool)
    .await
    .unwrap();
    assert_eq!(
        declared,
        Some(24 * 3600 * 1000),
        "the consumer declares its retention"
    );
}

/// Guarantee: `postal cleanup --dedup-retention` never deletes dedup rows a consumer declares
/// it keeps — a shorter retention than the consumer's own, or any for a consumer that keeps
/// its rows for good — unless told to with `--ignore-declared`; and it refuses a retention
/// below an hour. (Before, `--dedup-retention 60s` was accepted and applied to every consumer,
/// whatever retention each was configured with.)
#[tokio::test]
async fn cleanup_respects_the_retention_consumers_declare() {
    let Some(e) = env().await else { return };
    let (long, forever) = (unique("declares-long"), unique("declares-forever"));
    for c in [&long, &forever] {
        sqlx::query(
            "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
             VALUES ($1, gen_random_uuid(), now() - interval '3 days'),
                    ($1, gen_random_uuid(), now() - interval '10 days')",
        )
        .bind(c.as_str())
        .execute(&e.pool)
        .await
        .unwrap();
    }
    postal_consumer::retention::declare_retention(
        &e.pool,
        &long,
        Some(Duration::from_secs(7 * 86_400)),
    )
    .await
    .unwrap();
    postal_consumer::retention::declare_retention(&e.pool, &forever, None)
        .await
        .unwrap();
    let left = |c: String| {
        let pool = e.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM postal.processed_events WHERE consumer_name = $1",
            )
            .bind(c)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let mut short = postal(&e.url);
    short.args(["cleanup", "--dedup-retention", "60s", "--consumer", &long]);
    let err = fails(short);
    assert!(err.contains("at least 1h"), "{err}");
    let mut c = postal(&e.url);
    c.args([
        "cleanup",
        "--dedup-retention",
        "1day",
        "--consumer",
        &long,
        "--consumer",
        &forever,
    ]);
    let out = ok(c);
    assert!(out.contains("declares a retention of 7days"), "{out}");
    assert!(out.contains("keeps its dedup rows for good"), "{out}");
    assert_eq!(left(long.clone()).await, 1, "the 10-day-old row only");
    assert_eq!(left(forever.clone()).await, 2, "nothing");
    let mut c = postal(&e.url);
    c.args([
        "cleanup",
        "--dedup-retention",
        "1day",
        "--consumer",
        &long,
        "--consumer",
        &forever,
        "--ignore-declared",
    ]);
    ok(c);
    assert_eq!(left(long).await, 0);
    assert_eq!(left(forever).await, 0);
}

/// Guarantee: when the group's Kafka offsets cannot be moved (here: `--force` while a member
/// is live, so the broker refuses a commit from outside the group), `postal consumer reset`
/// fails with one line saying what to do and leaves the stored offsets unchanged: a restarted
/// consumer can never fetch from a Kafka offset later than the stored one and skip the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_reset_whose_kafka_commit_fails_changes_nothing() {
    let Some(e) = env().await else { return };
    let (topic, group) = (unique("resetfail"), unique("g"));
    create_topic(&e.bootstrap, &topic).await;
    produce(&e.bootstrap, &topic, &["{}"; 5]).await;
    let (stop, task, stats) = start_consumer(&e, &group, &topic);
    until("5 events applied", || async {
        stats.snapshot().applied == 5
    })
    .await;
    until("the group to show its member", || {
        group_has_members(e.bootstrap.clone(), group.clone())
    })
    .await;
    let mut reset = postal(&e.url);
    reset
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
            "--force",
        ])
        .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
    let out = reset.output().unwrap();
    stop.send(()).unwrap();
    task.await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(
        lines[0].starts_with(&format!(
            "error: nothing changed: cannot commit group \"{group}\"'s offsets to Kafka"
        )),
        "{stderr}"
    );
    assert!(lines[0].ends_with("then re-run"), "{stderr}");
    assert_eq!(stored_offset(&e.pool, &group, &topic).await, Some(5));
}

/// Guarantee: bytes an attacker wrote into the outbox or a topic never reach the operator's
/// terminal raw. A parked event and a dead letter whose key, headers, payload and error carry
/// an escape sequence (setting the window title), a line break that fakes an output line and
/// a bidirectional override are printed by `failed list/show` and `dead-letters list/show`
/// with those characters escaped; `--raw` prints them as stored; `--json` stays valid JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_output_escapes_control_characters() {
    let Some(e) = env().await else { return };
    let hostile = "k\u{1b}]0;pwned\u{7}\nstatus:       published\u{202e}";
    let id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    held, last_error)
         VALUES ($1, 'hostile', $2, 'job', convert_to($2, 'UTF8'), 'failed', true, $2)",
    )
    .bind(id)
    .bind(hostile)
    .execute(&e.pool)
    .await
    .unwrap();
    let dead: i64 = sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                                          kafka_offset, reason, error, dlq_topic, record_key,
                                          payload, header_names, header_values)
         VALUES ('billing', 'g', 'hostile', 0, 7, 'undecodable', $1, 'hostile.dlq',
                 convert_to($1, 'UTF8'), convert_to($1, 'UTF8'), ARRAY[$1],
                 ARRAY[convert_to($1, 'UTF8')])
         RETURNING id",
    )
    .bind(hostile)
    .fetch_one(&e.pool)
    .await
    .unwrap();
    let run = |args: &[&str]| {
        let mut c = postal(&e.url);
        c.args(args);
        ok(c)
    };
    // A row written around `postal.enqueue` may name any topic: `postal status` lists it.
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload)
         VALUES ($1, $2, 'k', 'job', '{}')",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(hostile)
    .execute(&e.pool)
    .await
    .unwrap();
    let status = run(&["status"]);
    assert!(
        !status.contains('\u{1b}') && !status.contains('\u{7}') && !status.contains('\u{202e}'),
        "status printed a control character raw: {status:?}"
    );
    let (id, dead) = (id.to_string(), dead.to_string());
    for args in [
        vec!["failed", "list"],
        vec!["failed", "show", &id],
        vec!["dead-letters", "list"],
        vec!["dead-letters", "show", &dead],
    ] {
        let out = run(&args);
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{7}') && !out.contains('\u{202e}'),
            "{args:?} printed a control character raw: {out:?}"
        );
        assert!(out.contains("\\u{1b}]0;pwned\\u{7}\\n"), "{args:?}: {out}");
        assert!(
            !out.lines()
                .any(|l| l.starts_with("status:       published")),
            "{args:?} let the payload fake an output line: {out}"
        );
        let mut raw = args.clone();
        raw.push("--raw");
        assert!(
            run(&raw).contains('\u{1b}'),
            "{raw:?} prints the bytes as stored"
        );
    }
    for args in [
        ["failed", "list", "--json"],
        ["dead-letters", "list", "--json"],
    ] {
        let out = run(&args);
        let parsed: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
        assert!(parsed.to_string().contains("pwned"), "{args:?}");
        assert!(!out.contains('\u{1b}'), "{args:?}: JSON escapes it");
    }
}

/// Guarantee: `postal failed discard --all` acts only on the events parked when it started —
/// one parked while it runs (here by a trigger, as a relay would park it between two batches)
/// stays — and `--dry-run` lists what would be acted on and changes nothing. (Before, the
/// command re-read "every parked event" batch after batch, and deleted events parked after it
/// started.)
#[tokio::test]
async fn discard_by_filter_acts_only_on_what_matched_at_the_start() {
    let Some(e) = env().await else { return };
    let topic = unique("discard-bound");
    sqlx::query(
        "SELECT postal.enqueue($1, CASE WHEN n = 0 THEN 'late' ELSE 'k' || n END, 'job',
                               jsonb_build_object('n', n))
         FROM generate_series(0, 1500) AS n",
    )
    .bind(&topic)
    .execute(&e.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE postal.outbox SET status = 'failed', last_error = 'poison'
         WHERE event_key <> 'late'",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE FUNCTION postal.park_late() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             UPDATE postal.outbox SET status = 'failed', last_error = 'parked meanwhile'
              WHERE event_key = 'late' AND status = 'pending';
             RETURN NULL;
         END $$",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER park_late AFTER DELETE ON postal.outbox
         FOR EACH STATEMENT EXECUTE FUNCTION postal.park_late()",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let count = |status: &'static str| {
        let pool = e.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox WHERE status = $1")
                .bind(status)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let mut dry = postal(&e.url);
    dry.args(["failed", "discard", "--all", "--dry-run"]);
    let out = dry.output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1500);
    assert!(String::from_utf8_lossy(&out.stderr).contains("would discard 1500 parked event(s)"));
    assert_eq!(count("failed").await, 1500, "a dry run changes nothing");
    let mut discard = postal(&e.url);
    discard.args(["failed", "discard", "--all"]);
    let out = discard.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1500);
    let late: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT status, last_error FROM postal.outbox WHERE event_key = 'late'")
            .fetch_all(&e.pool)
            .await
            .unwrap();
    assert_eq!(
        late,
        [("failed".to_owned(), Some("parked meanwhile".to_owned()))],
        "the event parked while the command ran is still there"
    );
}

/// Guarantee: `postal consumer reset --to <offset>` refuses an offset outside a partition's
/// offsets (here past its end) with one line naming the range, and changes nothing. (Before,
/// it stored the offset: the consumer then fell back to its `auto.offset.reset` and skipped
/// every record below the stored offset — a silent loss.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_reset_refuses_an_offset_outside_the_partition() {
    let Some(e) = env().await else { return };
    let (topic, group) = (unique("reset-range"), unique("g"));
    create_topic(&e.bootstrap, &topic).await;
    produce(&e.bootstrap, &topic, &["{}"; 5]).await;
    let mut c = postal(&e.url);
    c.args([
        "consumer",
        "reset",
        "--execute",
        "--group",
        &group,
        "--topic",
        &topic,
        "--to",
        "999999",
        "--new-group",
    ])
    .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
    let err = fails(c);
    assert!(
        err.contains("is outside partition 0's offsets (0 to 5)"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.consumer_offsets WHERE group_id = $1")
            .bind(&group)
            .fetch_one(&e.pool)
            .await
            .unwrap();
    assert_eq!(stored, 0, "nothing stored");
    let mut c = postal(&e.url);
    c.args([
        "consumer",
        "reset",
        "--execute",
        "--group",
        &group,
        "--topic",
        &topic,
        "--to",
        "5",
        "--new-group",
    ])
    .env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
    assert!(ok(c).contains("-> next offset 5"));
}

/// Guarantee: one escaping rule for everything the CLI prints for people, its JSON included:
/// for each class of dangerous character — C0 (ESC), DEL, C1 (U+009B, a one-character CSI)
/// and bidirectional controls (U+202E, U+2067, U+061C) — written into a parked event, a dead
/// letter and a topic name, no output of `failed list/show`, `dead-letters list/show`, `status`
/// (text and `--json`) or `failed discard`'s line passes it raw, and every JSON output stays
/// valid and parses back to the stored text. (Before, the JSON outputs escaped only
/// U+0000–U+001F.)
#[tokio::test]
async fn every_output_escapes_every_class_of_control_character() {
    let Some(e) = env().await else { return };
    let classes = [
        ("C0", '\u{1b}'),
        ("DEL", '\u{7f}'),
        ("C1", '\u{9b}'),
        ("bidi override", '\u{202e}'),
        ("bidi isolate", '\u{2067}'),
        ("Arabic letter mark", '\u{61c}'),
    ];
    for (class, c) in classes {
        let hostile = format!("key{c}[2Jfed");
        let topic = unique("hostile");
        let id = uuid::Uuid::now_v7();
        sqlx::query(
            "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                        held, last_error)
             VALUES ($1, $2, $3, 'job', convert_to($3, 'UTF8'), 'failed', true, $3)",
        )
        .bind(id)
        .bind(format!("{topic}{c}"))
        .bind(&hostile)
        .execute(&e.pool)
        .await
        .unwrap();
        let dead: i64 = sqlx::query_scalar(
            "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                                              kafka_offset, reason, error, dlq_topic, record_key,
                                              payload, header_names, header_values)
             VALUES ($1, 'g', $1, 0, 7, 'undecodable', $1, 'hostile.dlq',
                     convert_to($1, 'UTF8'), convert_to($1, 'UTF8'), ARRAY[$1],
                     ARRAY[convert_to($1, 'UTF8')])
             RETURNING id",
        )
        .bind(&hostile)
        .fetch_one(&e.pool)
        .await
        .unwrap();
        let run = |args: &[&str]| {
            let mut cmd = postal(&e.url);
            cmd.args(args);
            ok(cmd)
        };
        let (id, dead) = (id.to_string(), dead.to_string());
        let text = [
            vec!["failed", "list"],
            vec!["failed", "show", &id],
            vec!["dead-letters", "list"],
            vec!["dead-letters", "show", &dead],
            vec!["status"],
        ];
        for args in text {
            let out = run(&args);
            assert!(
                !out.contains(c),
                "{class}: {args:?} printed {c:?} raw: {out:?}"
            );
            assert!(
                out.contains(&format!("\\u{{{:x}}}", c as u32)),
                "{class}: {args:?} shows it escaped: {out:?}"
            );
        }
        let json = [
            vec!["failed", "list", "--json"],
            vec!["dead-letters", "list", "--json"],
            vec!["status", "--json"],
            vec!["failed", "discard", "--id", &id],
        ];
        for args in json {
            let out = run(&args);
            assert!(
                !out.contains(c),
                "{class}: {args:?} printed {c:?} raw: {out:?}"
            );
            let first: serde_json::Value = if args[1] == "discard" {
                serde_json::from_str(out.lines().next().unwrap()).expect("a JSON line")
            } else {
                serde_json::from_str(&out).expect("valid JSON")
            };
            assert!(
                holds_text(&first, &hostile),
                "{class}: {args:?} parses back to the stored text: {out}"
            );
        }
    }
}

/// Whether a string in `v` (at any depth) contains `s`.
fn holds_text(v: &serde_json::Value, s: &str) -> bool {
    match v {
        serde_json::Value::String(t) => t.contains(s),
        serde_json::Value::Array(a) => a.iter().any(|v| holds_text(v, s)),
        serde_json::Value::Object(o) => o.values().any(|v| holds_text(v, s)),
        _ => false,
    }
}

/// Guarantee: a command whose standard output was closed (`postal status | head -1`, the
/// reader gone) ends quietly — no panic, nothing on stderr, the exit status a shell reports for
/// a process SIGPIPE ended (141) — and `failed discard` deletes nothing it could not print.
/// (Before, `println!` panicked: "failed printing to stdout: Broken pipe".)
#[tokio::test]
async fn a_closed_stdout_ends_every_command_quietly() {
    let Some(e) = env().await else { return };
    let id: uuid::Uuid = sqlx::query_scalar(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                    held, last_error)
         VALUES (gen_random_uuid(), 'closed', 'k', 'job', '\\x7b7d', 'failed', true, 'x')
         RETURNING event_id",
    )
    .fetch_one(&e.pool)
    .await
    .unwrap();
    let id = id.to_string();
    for args in [
        vec!["status"],
        vec!["status", "--json"],
        vec!["failed", "list"],
        vec!["failed", "list", "--json"],
        vec!["failed", "show", &id],
        vec!["dead-letters", "list"],
        vec!["failed", "discard", "--id", &id],
    ] {
        // A pipe whose reading end is closed before the command starts: its first write fails.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = postal(&e.url)
            .args(&args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "{args:?}: {stderr}"
        );
    }
    let status: String = sqlx::query_scalar("SELECT status FROM postal.outbox WHERE event_id = $1")
        .bind(uuid::Uuid::parse_str(&id).unwrap())
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(
        status, "failed",
        "a discard that could not print deletes nothing"
    );
}

/// Guarantee: every action from the CLI is in the audit trail, through the dashboard's code
/// path: `failed requeue`, `failed discard` and `dead-letters replay` each leave a row naming
/// the OS user, `via` `cli`, the database role (`current_user`), the action, the ids given,
/// how many matched and were affected; the discarded events are kept whole, one row each in
/// `postal.operator_audit_events` referencing the discard's row — payloads included (a 3 kB
/// text payload, a binary one, UTF-8 with a NUL) — the lines the discard printed name them
/// (event id, payload size, audit id), and `postal audit show` prints them back whole;
/// `postal audit list` (text and `--json`) lists the rows. (Before, CLI actions left no row:
/// the printed line was the only copy.)
#[tokio::test]
async fn cli_actions_are_audited_with_the_discarded_events_whole() {
    let Some(e) = env().await else { return };
    let topic = unique("audited");
    let mut ids = Vec::new();
    for payload in [
        format!("{{\"pad\":\"{}\"}}", "x".repeat(3000)).into_bytes(),
        vec![0xff, 0x00, 0x9b, 0x1b],
        // UTF-8, but with a NUL that a jsonb string cannot hold.
        b"a\0b".to_vec(),
        b"{}".to_vec(),
    ] {
        let id: uuid::Uuid = sqlx::query_scalar(
            "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, status,
                                        held, last_error)
             VALUES (gen_random_uuid(), $1, 'k', 'job', $2, 'failed', true, 'timeout')
             RETURNING event_id",
        )
        .bind(&topic)
        .bind(payload)
        .fetch_one(&e.pool)
        .await
        .unwrap();
        ids.push(id.to_string());
    }
    let run = |args: &[&str]| {
        let mut c = postal(&e.url);
        c.args(args).env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
        ok(c)
    };
    let printed = run(&[
        "failed", "discard", "--id", &ids[0], "--id", &ids[1], "--id", &ids[2],
    ]);
    run(&["failed", "requeue", "--id", &ids[3]]);
    let dead_topic = unique("audited-dl");
    create_topic(&e.bootstrap, &dead_topic).await;
    let dead: i64 = sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                                          kafka_offset, reason, error, dlq_topic, payload,
                                          header_names, header_values)
         VALUES ('billing', 'g', $1, 0, 7, 'permanent', 'boom', 'x.dlq', '\\x7b7d', '{}', '{}')
         RETURNING id",
    )
    .bind(&dead_topic)
    .fetch_one(&e.pool)
    .await
    .unwrap();
    run(&["dead-letters", "replay", "--id", &dead.to_string()]);

    let role: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    let os_user = nix::unistd::User::from_uid(nix::unistd::getuid())
        .unwrap()
        .unwrap()
        .name;
    type Row = (
        i64,
        String,
        Option<String>,
        Option<String>,
        String,
        serde_json::Value,
        Option<i64>,
        i64,
        Option<serde_json::Value>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, actor, via, db_role, action, target, matched, affected, removed
         FROM postal.operator_audit ORDER BY id",
    )
    .fetch_all(&e.pool)
    .await
    .unwrap();
    let actions: Vec<(&str, i64, i64)> = rows
        .iter()
        .map(|r| (r.4.as_str(), r.6.unwrap(), r.7))
        .collect();
    assert_eq!(
        actions,
        [("discard", 3, 3), ("requeue", 1, 1), ("replay", 1, 1)]
    );
    for r in &rows {
        assert_eq!(
            (r.1.as_str(), r.2.as_deref(), r.3.as_deref()),
            (os_user.as_str(), Some("cli"), Some(role.as_str())),
            "{r:?}"
        );
    }
    assert_eq!(
        rows[0].5,
        serde_json::json!({ "ids": [ids[0], ids[1], ids[2]] })
    );
    assert_eq!(rows[2].5, serde_json::json!({ "ids": [dead] }));
    let lines: Vec<serde_json::Value> = printed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(rows.iter().all(|r| r.8.is_none()), "nothing in `removed`");
    let kept: Vec<(uuid::Uuid, Vec<u8>)> = sqlx::query_as(
        "SELECT event_id, payload FROM postal.operator_audit_events WHERE audit_id = $1
         ORDER BY seq",
    )
    .bind(rows[0].0)
    .fetch_all(&e.pool)
    .await
    .unwrap();
    assert_eq!(kept.len(), 3, "the discarded events are kept, one row each");
    for (i, (id, payload)) in kept.iter().enumerate() {
        assert_eq!(id.to_string(), ids[i]);
        assert_eq!(lines[i]["event_id"], ids[i].as_str());
        assert_eq!(lines[i]["audit_id"], rows[0].0);
        assert_eq!(lines[i]["payload_bytes"], payload.len());
    }
    assert_eq!(kept[0].1.len(), 3010);
    assert_eq!(kept[1].1, [0xff, 0x00, 0x9b, 0x1b]);
    assert_eq!(kept[2].1, b"a\0b");

    let shown = run(&["audit", "show", &rows[0].0.to_string()]);
    let shown: Vec<serde_json::Value> = shown
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(shown[0]["action"], "discard");
    assert_eq!(shown.len(), 4, "the entry, then the three events");
    assert_eq!(shown[1]["event_id"], ids[0].as_str());
    assert_eq!(shown[1]["payload"].as_str().unwrap().len(), 3010);
    assert_eq!(shown[2]["payload_base64"], "/wCbGw==");
    assert_eq!(shown[3]["payload_base64"], "YQBi");
    assert_eq!(shown[3]["last_error"], "timeout");
    let listed: serde_json::Value =
        serde_json::from_str(&run(&["audit", "list", "--json"])).unwrap();
    let listed: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["replay", "requeue", "discard"], "newest first");
    let text = run(&["audit", "list"]);
    assert_eq!(text.lines().count(), 4, "{text}");
    assert!(text.contains(&os_user) && text.contains(" cli "), "{text}");
}

/// A parked outbox event of `topic` whose payload is `pad` repeated `n` times (enqueued, then
/// marked parked as the relay would).
async fn parked_event(e: &Env, topic: &str, n: i32) -> uuid::Uuid {
    let id: uuid::Uuid = sqlx::query_scalar(
        "SELECT postal.enqueue($1, 'k', 'job', jsonb_build_object('pad', repeat('x', $2)))",
    )
    .bind(topic)
    .bind(n)
    .fetch_one(&e.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE postal.outbox SET status = 'failed', last_error = 'parked by the test' WHERE event_id = $1")
        .bind(id)
        .execute(&e.pool)
        .await
        .unwrap();
    id
}

/// Guarantee: every subcommand that takes ids takes them the same way — positionally and as
/// `--id` — and both forms address the same event, dead letter or audit entry: `failed show`,
/// `failed requeue`, `failed discard`, `dead-letters show`, `dead-letters replay`, `audit
/// show`. (Failed before: `dead-letters replay 1` and `failed requeue <id>` stopped with
/// "unexpected argument", `failed show --id` and `dead-letters show --id` too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_are_taken_the_same_way_by_every_subcommand() {
    let Some(e) = env().await else { return };
    let id = parked_event(&e, &unique("ids"), 10).await.to_string();
    let run = |args: &[&str]| {
        let mut c = postal(&e.url);
        c.args(args).env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
        ok(c)
    };
    let shown = run(&["failed", "show", &id]);
    assert!(shown.contains(&id), "{shown}");
    assert_eq!(run(&["failed", "show", "--id", &id]), shown);
    for verb in ["requeue", "discard"] {
        for form in [vec![id.as_str()], vec!["--id", id.as_str()]] {
            let mut args = vec!["failed", verb, "--dry-run"];
            args.extend(&form);
            let mut c = postal(&e.url);
            c.args(&args);
            let out = c.output().unwrap();
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                String::from_utf8_lossy(&out.stdout).contains(&id),
                "{args:?}"
            );
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("would ")
                    && String::from_utf8_lossy(&out.stderr).contains(" 1 parked event(s)"),
                "{args:?}"
            );
        }
    }

    let (_ids, stop, task, _stats) = one_dead_letter(&e).await;
    let listed: serde_json::Value =
        serde_json::from_str(&run(&["dead-letters", "list", "--json"])).unwrap();
    let dl = listed[0]["id"].as_i64().unwrap().to_string();
    let shown = run(&["dead-letters", "show", &dl]);
    assert!(shown.contains("the ledger is broken"), "{shown}");
    assert_eq!(run(&["dead-letters", "show", "--id", &dl]), shown);
    assert!(run(&["dead-letters", "replay", &dl]).contains("replayed 1 dead letter(s)"));
    stop.send(()).unwrap();
    task.await.unwrap();

    let audit: serde_json::Value =
        serde_json::from_str(&run(&["audit", "list", "--json"])).unwrap();
    let entry = audit[0]["id"].as_i64().unwrap().to_string();
    let shown = run(&["audit", "show", &entry]);
    assert!(shown.contains("replay"), "{shown}");
    assert_eq!(run(&["audit", "show", "--id", &entry]), shown);

    // Both forms at once is one line saying so, not a guess.
    let mut both = postal(&e.url);
    both.args(["failed", "show", &id, "--id", &id]);
    let err = fails(both);
    assert!(err.contains("cannot be used with"), "{err}");
}

/// Guarantee: `postal failed list` with nothing parked says where consumer failures are —
/// `postal dead-letters list`, with their count — when consumers have open dead letters, and
/// only then. (Failed before: "(no parked events)" and nothing else, right after a consumer
/// dead-lettered an event.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_list_points_at_dead_letters_when_consumers_have_some() {
    let Some(e) = env().await else { return };
    let mut list = postal(&e.url);
    list.args(["failed", "list"]);
    let out = ok(list);
    assert!(out.contains("(no parked events)\n"), "{out}");
    assert!(
        !out.contains("dead-letters"),
        "no hint without dead letters: {out}"
    );
    let (_ids, stop, task, _stats) = one_dead_letter(&e).await;
    stop.send(()).unwrap();
    task.await.unwrap();
    let mut list = postal(&e.url);
    list.args(["failed", "list"]);
    let out = ok(list);
    assert!(
        out.contains("consumers have 1 open dead letter(s): postal dead-letters list"),
        "{out}"
    );
}

/// Guarantee: `postal failed show` prints a large payload's first 64 KiB and says how many
/// bytes it cut and how to see them; `--full` prints it whole. (Failed before: a 1.5 MB
/// payload was printed whole, 1.5 MB on the terminal.)
#[tokio::test]
async fn failed_show_cuts_a_large_payload_unless_full() {
    let Some(e) = env().await else { return };
    let id = parked_event(&e, &unique("large"), 1_500_000)
        .await
        .to_string();
    let total: i32 = sqlx::query_scalar(
        "SELECT octet_length(payload) FROM postal.outbox WHERE event_id = $1::uuid",
    )
    .bind(&id)
    .fetch_one(&e.pool)
    .await
    .unwrap();
    let mut show = postal(&e.url);
    show.args(["failed", "show", &id]);
    let out = ok(show);
    assert!(out.len() < 70_000, "{} bytes printed", out.len());
    let cut = total as usize - 64 * 1024;
    assert!(
        out.contains(&format!(
            "[{cut} of its {total} bytes not shown; --full prints the whole payload]"
        )),
        "{}",
        &out[out.len().saturating_sub(200)..]
    );
    let mut full = postal(&e.url);
    full.args(["failed", "show", &id, "--full"]);
    let out = ok(full);
    assert!(out.contains(&"x".repeat(1_500_000)), "whole");
    assert!(!out.contains("not shown"));
}

/// A dead letter of consumer `consumer` (group `group`), open; its id.
async fn dead_letter_of(e: &Env, consumer: &str, group: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                                          kafka_offset, reason, error, dlq_topic, payload,
                                          header_names, header_values)
         VALUES ($1, $2, 'orders', 0, 7, 'permanent', 'boom', 'orders.dlq', '\\x7b7d', '{}', '{}')
         RETURNING id",
    )
    .bind(consumer)
    .bind(group)
    .fetch_one(&e.pool)
    .await
    .unwrap()
}

async fn audit_rows(e: &Env) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.operator_audit")
        .fetch_one(&e.pool)
        .await
        .unwrap()
}

/// Asserts `err` is one error line (clap's "For more information" hint aside).
fn one_error_line(err: &str) -> &str {
    let line = err.lines().next().unwrap_or_default();
    assert!(line.starts_with("error: "), "{err}");
    assert!(
        err.lines()
            .skip(1)
            .all(|l| l.trim().is_empty() || l.contains("For more information")),
        "{err}"
    );
    line
}

/// Guarantee: every subcommand that takes `--group` refuses, in one line and changing
/// nothing, a consumer group the database knows nothing of (no stored offsets, held keys,
/// pauses or dead letters), naming the known groups; `--new-group` (the flag `consumer reset`
/// has) pauses a group before its first start. Every subcommand that takes `--consumer`
/// refuses an unknown consumer the same way, naming the known ones, and `dead-letters replay`
/// then writes no audit row. (Failed before: `pause consumer --group ledger-srvice` said it
/// paused the group; `dead-letters list --consumer ledgr` printed "(no dead letters)" and
/// `replay --consumer ledgr` "replayed 0" with an audit entry, all with exit 0.)
#[tokio::test]
async fn unknown_groups_and_consumers_are_refused_naming_the_known_ones() {
    let Some(e) = env().await else { return };
    sqlx::query(
        "INSERT INTO postal.consumer_offsets (group_id, topic, partition, next_offset)
         VALUES ('ledger-service', 'orders', 0, 5)",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    dead_letter_of(&e, "ledger", "ledger-service").await;
    let run = |args: &[&str]| {
        let mut c = postal(&e.url);
        c.args(args).env("KAFKA_BOOTSTRAP_SERVERS", &e.bootstrap);
        c
    };

    for args in [
        &["pause", "consumer", "--group", "ledger-srvice"][..],
        &["resume", "consumer", "--group", "ledger-srvice"],
        &[
            "consumer",
            "reset",
            "--group",
            "ledger-srvice",
            "--topic",
            "orders",
            "--to",
            "earliest",
        ],
    ] {
        let err = fails(run(args));
        let line = one_error_line(&err);
        assert!(
            line.contains("group ledger-srvice has no stored offsets")
                && line.contains("known groups: ledger-service")
                && line.contains("pass --new-group"),
            "{args:?}: {err}"
        );
    }
    for args in [
        &["held", "list", "--group", "ledger-srvice"][..],
        &[
            "held",
            "release",
            "--group",
            "ledger-srvice",
            "--topic",
            "orders",
            "--key",
            "k",
        ],
    ] {
        let err = fails(run(args));
        let line = one_error_line(&err);
        assert!(
            line.contains("known groups: ledger-service") && !line.contains("--new-group"),
            "{args:?}: {err}"
        );
    }
    let pauses = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.pauses")
            .fetch_one(&e.pool)
            .await
            .unwrap()
    };
    assert_eq!(pauses().await, 0, "a refused pause changes nothing");
    assert!(ok(run(&["pause", "consumer", "--group", "ledger-service"])).contains("paused"));
    ok(run(&["resume", "consumer", "--group", "ledger-service"]));
    // A group that has not run yet: paused before its first start, then known by its pause.
    ok(run(&[
        "pause",
        "consumer",
        "--group",
        "billing-service",
        "--new-group",
    ]));
    assert!(ok(run(&["resume", "consumer", "--group", "billing-service"])).contains("resumed"));

    let audited = audit_rows(&e).await;
    for args in [
        &["dead-letters", "list", "--consumer", "ledgr"][..],
        &["dead-letters", "replay", "--consumer", "ledgr"],
        &[
            "cleanup",
            "--dedup-retention",
            "1day",
            "--consumer",
            "ledgr",
        ],
        &[
            "consumer",
            "reset",
            "--group",
            "ledger-service",
            "--topic",
            "orders",
            "--to",
            "earliest",
            "--consumer",
            "ledgr",
        ],
    ] {
        let err = fails(run(args));
        let line = one_error_line(&err);
        assert!(
            line.contains("unknown consumer ledgr ")
                && line.contains("consumers known to this database: ledger"),
            "{args:?}: {err}"
        );
    }
    assert_eq!(
        audit_rows(&e).await,
        audited,
        "a refused replay is not audited"
    );
    let listed = ok(run(&["dead-letters", "list", "--consumer", "ledger"]));
    assert!(listed.contains("ledger"), "{listed}");
}

/// Guarantee: `postal dead-letters resolve <ID>` (or `--id`) marks an open dead letter
/// resolved through the function the dashboard calls, audited as `resolve`; `--dry-run` shows
/// it and changes nothing; a resolved one is left out of `list` and, with
/// `--include-replayed`, shown with its state, as in `show`. (Failed before: no such
/// subcommand, and the text output had no state.)
#[tokio::test]
async fn dead_letters_resolve_is_audited_and_shown_with_its_state() {
    let Some(e) = env().await else { return };
    let (first, second) = (
        dead_letter_of(&e, "ledger", "g").await,
        dead_letter_of(&e, "ledger", "g").await,
    );
    let run = |args: &[&str]| {
        let mut c = postal(&e.url);
        c.args(args);
        c
    };
    let resolved = |id: i64| {
        let pool = e.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT resolved_at IS NOT NULL FROM postal.dead_letters WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let help = ok(run(&["dead-letters", "--help"]));
    assert!(help.contains("resolve"), "{help}");

    let out = run(&["dead-letters", "resolve", "--dry-run", &first.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("boom"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("would resolve 1 dead letter(s)"));
    assert!(!resolved(first).await, "a dry run changes nothing");
    assert_eq!(audit_rows(&e).await, 0);

    let said = ok(run(&[
        "dead-letters",
        "resolve",
        "--id",
        &first.to_string(),
    ]));
    assert!(said.contains("resolved 1 dead letter(s)"), "{said}");
    assert!(resolved(first).await && !resolved(second).await);
    let audit: serde_json::Value =
        serde_json::from_str(&ok(run(&["audit", "list", "--json"]))).unwrap();
    assert_eq!(audit[0]["action"], "resolve", "{audit}");
    let again = ok(run(&["dead-letters", "resolve", &first.to_string()]));
    assert!(
        again.contains("resolved 0") && again.contains("1 of the given ids are not open"),
        "{again}"
    );

    let open = ok(run(&["dead-letters", "list"]));
    let line = |text: &str, id: i64| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(&id.to_string()))
            .map(str::to_owned)
    };
    assert!(line(&open, first).is_none(), "{open}");
    assert!(line(&open, second).unwrap().contains(" open "), "{open}");
    let all = ok(run(&["dead-letters", "list", "--include-replayed"]));
    assert!(line(&all, first).unwrap().contains(" resolved "), "{all}");
    let shown = ok(run(&["dead-letters", "show", &first.to_string()]));
    assert!(shown.contains("state:        resolved"), "{shown}");
    let shown = ok(run(&["dead-letters", "show", &second.to_string()]));
    assert!(shown.contains("state:        open"), "{shown}");
}

/// Guarantee: a wrong id is one line saying what kind of id is expected and where to find it,
/// for every subcommand that takes ids, never the parser's words. (Failed before: "invalid
/// digit found in string", "invalid length: found 1", "invalid group count".)
#[test]
fn wrong_ids_are_one_line_naming_the_kind_of_id() {
    let event = "01a22a4f-5483-7000-8000-000000000001";
    let cases: [(&[&str], &str); 7] = [
        (&["dead-letters", "show", event], "list --event"),
        (
            &["dead-letters", "replay", "--id", "x1"],
            "dead-letter ids are numbers",
        ),
        (
            &["dead-letters", "resolve", "01a22a4f-5483"],
            "part of an event id",
        ),
        (
            &["failed", "discard", "1"],
            "parked events are named by their event id, a UUID from `postal failed list`",
        ),
        (
            &["failed", "show", "01a22a4f-5483"],
            "parked events are named",
        ),
        (
            &["failed", "requeue", "--id", "x"],
            "parked events are named",
        ),
        (
            &["audit", "show", "x"],
            "the first column of `postal audit list`",
        ),
    ];
    for (args, expected) in cases {
        let mut c = postal("postgres://unused@127.0.0.1:1/none");
        c.args(args);
        let err = fails(c);
        let line = one_error_line(&err);
        assert!(line.contains(expected), "{args:?}: {err}");
        assert!(
            !line.contains("invalid digit")
                && !line.contains("invalid length")
                && !line.contains("invalid group"),
            "{args:?}: {err}"
        );
    }
}
