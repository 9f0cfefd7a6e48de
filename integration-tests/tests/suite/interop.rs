//! Postal records read and written by the official Java clients: kafka-clients and the
//! CloudEvents SDK's Kafka protocol binding (`io.cloudevents:cloudevents-kafka`), run from the
//! jar that `scripts/interop-jar.sh` builds from `interop/jvm` (`POSTAL_INTEROP_JAR`).
//! `scripts/test.sh` builds it and requires these tests to run (`POSTAL_INTEROP_REQUIRE=1`);
//! elsewhere a missing jar skips them with a line saying how to build it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use postal_consumer::{idempotent, Event, HandlerError};
use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue_batch, NewEvent, SchemaVersion};
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::common::{consumer_config, create_topic, RunningConsumer};
use crate::procs::{bin_dir, log_tail, Proc};

const WAIT: Duration = Duration::from_secs(90);

/// The interop jar, or `None` (with a line saying why) when it was not built;
/// `POSTAL_INTEROP_REQUIRE=1` (set by `scripts/test.sh`) makes that a failure.
fn interop_jar() -> Option<PathBuf> {
    match std::env::var_os("POSTAL_INTEROP_JAR") {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(
                p.is_file(),
                "POSTAL_INTEROP_JAR={} is not a file: build it with `eval \"$(bash scripts/interop-jar.sh)\"`",
                p.display()
            );
            Some(p)
        }
        None if std::env::var("POSTAL_INTEROP_REQUIRE").as_deref() == Ok("1") => panic!(
            "POSTAL_INTEROP_JAR is not set: build the jar with `eval \"$(bash scripts/interop-jar.sh)\"` (needs a JDK 17+ and Maven)"
        ),
        None => {
            eprintln!("interop test NOT RUN: POSTAL_INTEROP_JAR is not set (build the jar with `eval \"$(bash scripts/interop-jar.sh)\"`; scripts/test.sh does)");
            None
        }
    }
}

/// A folder for the test's process logs, beside the binaries.
fn log_dir(db_name: &str) -> PathBuf {
    let logs = bin_dir().join(format!("interop-{db_name}"));
    std::fs::create_dir_all(&logs).expect("log dir");
    logs
}

/// Runs `java -cp <jar> dev.postal.interop.<class> <args>` until it exits (at most `within`;
/// then it is killed and the test fails), its stdout and stderr kept in `logs`. Returns its
/// exit code, its stdout's lines and its stderr.
async fn run_java(
    jar: &Path,
    logs: &Path,
    name: &str,
    class: &str,
    args: &[&str],
    within: Duration,
) -> (i32, Vec<String>, String) {
    let out = logs.join(format!("{name}.out"));
    let err = logs.join(format!("{name}.err"));
    let mut child = Command::new("java")
        .arg("-cp")
        .arg(jar)
        .arg(format!("dev.postal.interop.{class}"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("start java (a JDK 17 or newer on PATH)");
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for java") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{name} ({class}) still running after {within:?}; stderr:\n{}",
                log_tail(&err)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let stdout = std::fs::read_to_string(&out).expect("java's stdout");
    (
        status.code().unwrap_or(-1),
        stdout.lines().map(str::to_owned).collect(),
        std::fs::read_to_string(&err).expect("java's stderr"),
    )
}

/// The end of a Java program's stderr, for a failure message.
fn tail(stderr: &str) -> &str {
    let from = stderr.len().saturating_sub(4000);
    let from = (from..stderr.len())
        .find(|&i| stderr.is_char_boundary(i))
        .unwrap_or(0);
    &stderr[from..]
}

/// A `postal relay` process (not started) writing `source` as the CloudEvents source.
fn relay(logs: &Path, name: &str, database_url: &str, bootstrap: &str, source: &str) -> Proc {
    Proc::new(
        &bin_dir(),
        logs,
        name,
        "postal",
        &["relay", "--source", source],
    )
    .env(&[
        ("DATABASE_URL", database_url.to_owned()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.to_owned()),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ])
}

/// Parses the JSON lines a Java program printed.
fn json_lines(lines: &[String]) -> Vec<Value> {
    lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect()
}

/// What the test enqueued for one event.
struct Enqueued {
    key: String,
    round: u32,
    payload: Value,
    version: i32,
    occurred_at: DateTime<Utc>,
    seq: i64,
}

const KEYS: u32 = 200;
const ROUNDS: u32 = 3;
const PARTITIONS: i32 = 12;
/// The relay's `--source` (a CloudEvents `source` must be a URI-reference).
const SOURCE: &str = "/shop/orders";

/// Guarantee: records that `postal relay` published decode with the CloudEvents SDK's Kafka
/// binding in a Java consumer (kafka-clients), binary content mode: each event's `id`,
/// `type`, `source` (the relay's `--source`), `specversion` 1.0, `subject` (the key), `time`
/// (occurred-at), `datacontenttype` and `data` (the JSON payload, byte for byte as parsed) are
/// what was enqueued, and its extensions are exactly `schemaversion` (the schema version) and
/// `postalseq` (the outbox sequence number), as text. Each of the 200 keys' records is on the
/// partition kafka-clients' own producer picks for that key (`BuiltInPartitioner`, murmur2;
/// all 12 partitions used), and per key, in offset order, the events come in enqueue order
/// with increasing `postalseq`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_cloudevents_consumer_decodes_relay_records_on_javas_partitions() {
    let Some(jar) = interop_jar() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("interop-out");
    create_topic(&svc.bootstrap, &topic, PARTITIONS).await;

    // 200 keys, 3 events each; each round one transaction, so a key's events interleave with
    // every other key's in the outbox.
    let base = Utc.with_ymd_and_hms(2026, 3, 14, 15, 9, 26).unwrap();
    let mut enqueued: HashMap<String, Enqueued> = HashMap::new();
    for round in 0..ROUNDS {
        let mut batch = Vec::new();
        for i in 0..KEYS {
            let key = format!("customer-{i}");
            let payload = json!({"customer": key, "round": round, "note": "Grüße ✓"});
            let version = 1 + (i % 2) as i32;
            // Microsecond precision, as PostgreSQL keeps it.
            let occurred_at =
                base + chrono::Duration::microseconds(i64::from(round * KEYS + i) * 1_001);
            let event = NewEvent::json(topic.as_str(), key.as_str(), "order.placed", &payload)
                .unwrap()
                .with_schema_version(SchemaVersion::new(version).unwrap())
                .with_occurred_at(occurred_at)
                .with_header("x-tenant", "acme")
                .unwrap();
            enqueued.insert(
                event.id().to_string(),
                Enqueued {
                    key,
                    round,
                    payload,
                    version,
                    occurred_at,
                    seq: 0,
                },
            );
            batch.push(event);
        }
        let mut tx = db.pool.begin().await.unwrap();
        enqueue_batch(&mut tx, batch).await.unwrap();
        tx.commit().await.unwrap();
    }
    let seqs: Vec<(Uuid, i64)> = sqlx::query_as("SELECT event_id, seq FROM postal.outbox")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(seqs.len(), enqueued.len());
    for (id, seq) in seqs {
        enqueued.get_mut(&id.to_string()).expect("enqueued id").seq = seq;
    }

    let logs = log_dir(&db.name);
    let mut relay = relay(&logs, "relay", &db.url, &svc.bootstrap, SOURCE);
    relay.start();

    let total = enqueued.len().to_string();
    let (code, lines, stderr) = run_java(
        &jar,
        &logs,
        "java-consumer",
        "ConsumeCloudEvents",
        &[&svc.bootstrap, &topic, &total, "120"],
        Duration::from_secs(180),
    )
    .await;
    relay.assert_alive();
    assert_eq!(
        code,
        0,
        "the Java consumer failed; stderr:\n{}",
        tail(&stderr)
    );
    let mut records = json_lines(&lines);
    let summary = records.pop().expect("a summary line");
    assert_eq!(
        summary["summary"]["records"],
        json!(enqueued.len()),
        "{summary}"
    );

    let mut ids = BTreeSet::new();
    let mut by_key: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    let mut partitions_used = BTreeSet::new();
    let mut mismatched = Vec::new();
    for r in &records {
        let id = r["id"].as_str().expect("id");
        assert!(ids.insert(id.to_owned()), "event {id} read twice");
        let e = enqueued
            .get(id)
            .unwrap_or_else(|| panic!("unknown event {r}"));
        assert_eq!(r["type"], "order.placed", "{r}");
        assert_eq!(r["source"], SOURCE, "{r}");
        assert_eq!(r["specversion"], "1.0", "{r}");
        assert_eq!(r["subject"], e.key.as_str(), "{r}");
        assert_eq!(r["key"], e.key.as_str(), "{r}");
        assert_eq!(r["datacontenttype"], "application/json", "{r}");
        assert_eq!(r["data"], e.payload, "{r}");
        assert_eq!(
            r["extensions"],
            json!({"schemaversion": e.version.to_string(), "postalseq": e.seq.to_string()}),
            "{r}"
        );
        let time = DateTime::parse_from_rfc3339(r["time"].as_str().expect("time")).unwrap();
        assert_eq!(time, e.occurred_at, "{r}");
        partitions_used.insert(r["partition"].as_i64().unwrap());
        if r["partition"] != r["java_partition"] {
            mismatched.push(format!(
                "{} on {} (Java: {})",
                e.key, r["partition"], r["java_partition"]
            ));
        }
        by_key.entry(e.key.clone()).or_default().push(r);
    }
    assert_eq!(ids.len(), enqueued.len(), "every event read once");
    assert!(
        mismatched.is_empty(),
        "{} of {} records are not on the partition Java's partitioner picks, e.g. {:?}",
        mismatched.len(),
        records.len(),
        &mismatched[..mismatched.len().min(5)]
    );
    assert_eq!(summary["summary"]["partition_mismatches"], 0, "{summary}");
    assert_eq!(
        partitions_used.len(),
        PARTITIONS as usize,
        "the keys spread over every partition"
    );
    assert_eq!(by_key.len(), KEYS as usize);
    for (key, mut rs) in by_key {
        rs.sort_by_key(|r| r["offset"].as_i64());
        let rounds: Vec<u32> = rs
            .iter()
            .map(|r| enqueued[r["id"].as_str().unwrap()].round)
            .collect();
        assert_eq!(rounds, [0, 1, 2], "{key}: events in enqueue order");
        let seqs: Vec<i64> = rs
            .iter()
            .map(|r| {
                r["extensions"]["postalseq"]
                    .as_str()
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{key}: postalseq increases with the offset: {seqs:?}"
        );
    }
    relay.stop();
}

/// The payload the Java producer sends.
#[derive(Debug, Deserialize)]
struct Placed {
    n: i64,
}

/// The consumer name (dedup scope) of [`record_java_event`].
const JAVA_CONSUMER: &str = "java-interop";

/// Records one applied Java event, with what Postal read from its envelope.
#[idempotent(consumer = "java-interop")]
async fn record_java_event(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<Placed>,
) -> Result<(), HandlerError> {
    let position = event.position.as_ref().expect("a consumed event");
    sqlx::query(
        "INSERT INTO java_effects (event_id, event_key, n, schema_version, occurred_at, subject,
                                   source, kafka_partition, kafka_offset)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(event.id.as_uuid())
    .bind(&event.key)
    .bind(event.payload.n)
    .bind(event.schema_version)
    .bind(event.occurred_at)
    .bind(event.headers.get("ce_subject"))
    .bind(event.headers.get("ce_source"))
    .bind(position.partition)
    .bind(position.offset)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn java_effects_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE java_effects (id bigserial PRIMARY KEY, event_id uuid NOT NULL,
             event_key text, n bigint NOT NULL, schema_version integer NOT NULL,
             occurred_at timestamptz, subject text, source text,
             kafka_partition integer NOT NULL, kafka_offset bigint NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// A random (version 4) UUID, the kind `java.util.UUID.randomUUID()` makes.
fn random_uuid() -> Uuid {
    uuid::Builder::from_random_bytes(rand::random()).into_uuid()
}

/// Writes the Java producer's input (one JSON object a line) and runs it; returns what it
/// reported per event (id, key, mode, partition, offset).
async fn java_produce(
    jar: &Path,
    logs: &Path,
    bootstrap: &str,
    topic: &str,
    events: &[Value],
) -> Vec<Value> {
    let input = logs.join("java-producer.jsonl");
    let text: String = events.iter().map(|e| format!("{e}\n")).collect();
    std::fs::write(&input, text).expect("producer input");
    let (code, lines, stderr) = run_java(
        jar,
        logs,
        "java-producer",
        "ProduceCloudEvents",
        &[bootstrap, topic, input.to_str().expect("UTF-8 path")],
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(
        code,
        0,
        "the Java producer failed; stderr:\n{}",
        tail(&stderr)
    );
    let sent = json_lines(&lines);
    assert_eq!(sent.len(), events.len(), "one line per event sent");
    sent
}

/// Guarantee: CloudEvents that a Java service produces with kafka-clients and the CloudEvents
/// SDK's `CloudEventSerializer` (binary content mode, random UUID ids, the producer's default
/// partitioner) are applied by a Postal consumer exactly once each and, per key, in the order
/// sent: 8 keys with 5 events each, interleaved, plus one event sent a second time (same
/// `ce_id`, after its key's later events), which dedup drops (no second effect, key order
/// intact, counted as a duplicate, no dead letter). The handler sees the Java event's id,
/// key, `time`, `subject`, `source`, payload and `schemaversion` extension (default 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_cloudevents_apply_exactly_once_in_key_order() {
    let Some(jar) = interop_jar() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    java_effects_table(&db.pool).await;
    let topic = unique("interop-in");
    create_topic(&svc.bootstrap, &topic, 4).await;
    let logs = log_dir(&db.name);

    const JAVA_KEYS: usize = 8;
    const PER_KEY: i64 = 5;
    let base = Utc.with_ymd_and_hms(2026, 5, 1, 8, 0, 0).unwrap();
    let mut events = Vec::new();
    let mut ids: HashMap<(usize, i64), Uuid> = HashMap::new();
    for n in 1..=PER_KEY {
        for k in 0..JAVA_KEYS {
            let id = random_uuid();
            ids.insert((k, n), id);
            let time = base + chrono::Duration::milliseconds(n * 1000 + k as i64);
            let mut e = json!({
                "id": id.to_string(), "type": "order.placed", "key": format!("acct-{k}"),
                "time": time.to_rfc3339(), "data": {"n": n, "account": format!("acct-{k}")},
            });
            if k == 7 {
                // One Java service that tags its schema version, as Postal's producers do.
                e["extensions"] = json!({"schemaversion": 2});
            }
            events.push(e);
        }
    }
    // The duplicate: key 0's third event again, after key 0's fifth.
    let duplicate = ids[&(0, 3)];
    let again = events
        .iter()
        .find(|e| e["id"] == duplicate.to_string())
        .unwrap()
        .clone();
    events.push(again);
    let sent = java_produce(&jar, &logs, &svc.bootstrap, &topic, &events).await;
    let java_partition: HashMap<String, i64> = sent
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_owned(),
                s["partition"].as_i64().unwrap(),
            )
        })
        .collect();
    let used: BTreeSet<i64> = java_partition.values().copied().collect();
    assert!(used.len() > 1, "the keys spread over partitions: {used:?}");

    let consumer = postal_consumer::Consumer::builder(
        db.pool.clone(),
        consumer_config(&svc.bootstrap, &unique("g"), JAVA_CONSUMER),
    )
    .on(&topic, "order.placed", record_java_event)
    .build()
    .expect("valid consumer");
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    let records = events.len() as u64;
    wait::until(WAIT, "every Java record handled", || {
        let s = stats.snapshot();
        async move { s.applied + s.duplicates + s.dead_letters >= records }
    })
    .await;
    running.stop().await;
    let s = stats.snapshot();
    assert_eq!(
        (s.applied, s.duplicates, s.dead_letters),
        (JAVA_KEYS as u64 * PER_KEY as u64, 1, 0),
        "(applied, duplicates, dead letters)"
    );

    #[allow(clippy::type_complexity)]
    let rows: Vec<(
        Uuid,
        Option<String>,
        i64,
        i32,
        Option<DateTime<Utc>>,
        Option<String>,
        Option<String>,
        i32,
    )> = sqlx::query_as(
        "SELECT event_id, event_key, n, schema_version, occurred_at, subject, source,
                kafka_partition
         FROM java_effects ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        rows.len(),
        JAVA_KEYS * PER_KEY as usize,
        "one effect per event"
    );
    let distinct: BTreeSet<Uuid> = rows.iter().map(|r| r.0).collect();
    assert_eq!(distinct.len(), rows.len(), "no event applied twice");
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (id, key, n, version, occurred_at, subject, source, partition) in &rows {
        let key = key.clone().expect("the record key");
        let k: usize = key.strip_prefix("acct-").unwrap().parse().unwrap();
        assert_eq!(*id, ids[&(k, *n)], "{key} #{n}: the Java event's id");
        assert_eq!(subject.as_deref(), Some(key.as_str()), "ce_subject");
        assert_eq!(source.as_deref(), Some("/java-interop"), "ce_source");
        assert_eq!(
            *version,
            if k == 7 { 2 } else { 1 },
            "{key}: schema version"
        );
        let time = base + chrono::Duration::milliseconds(n * 1000 + k as i64);
        assert_eq!(*occurred_at, Some(time), "{key} #{n}: ce_time");
        assert_eq!(
            i64::from(*partition),
            java_partition[&id.to_string()],
            "read where the Java producer wrote it"
        );
        per_key.entry(key).or_default().push(*n);
    }
    assert_eq!(per_key.len(), JAVA_KEYS);
    for (key, ns) in per_key {
        assert_eq!(
            ns,
            (1..=PER_KEY).collect::<Vec<_>>(),
            "{key}: applied in order"
        );
    }
    let processed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.processed_events WHERE consumer_name = $1")
            .bind(JAVA_CONSUMER)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(processed, rows.len() as i64, "one dedup row per event");
}

/// Guarantee (what Postal's consumer does today with CloudEvents it cannot identify): a
/// structured-mode CloudEvent from the Java SDK (`application/cloudevents+json`: the whole
/// event, id included, in the record value, no `ce_id` header) and a binary-mode event whose
/// `id` is not a UUID (CloudEvents allows any string; Postal's dedup needs a UUID) are never
/// applied, nor decoded as something else: each becomes a `missing_event_id` dead letter
/// holding the original record (for the structured one, the JSON envelope with its id and
/// data, and its content type), and the key's next event is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_structured_mode_and_non_uuid_ids_become_dead_letters() {
    let Some(jar) = interop_jar() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    java_effects_table(&db.pool).await;
    let topic = unique("interop-structured");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let logs = log_dir(&db.name);

    let (first, structured, last) = (random_uuid(), random_uuid(), random_uuid());
    let event = |id: String, n: i64, mode: &str| {
        json!({"id": id, "type": "order.placed", "key": "acct-s", "mode": mode,
               "data": {"n": n}})
    };
    let events = [
        event(first.to_string(), 1, "binary"),
        event(structured.to_string(), 2, "structured"),
        event("order-42".into(), 3, "binary"),
        event(last.to_string(), 4, "binary"),
    ];
    java_produce(&jar, &logs, &svc.bootstrap, &topic, &events).await;

    let consumer = postal_consumer::Consumer::builder(
        db.pool.clone(),
        consumer_config(&svc.bootstrap, &unique("g"), JAVA_CONSUMER),
    )
    .on(&topic, "order.placed", record_java_event)
    .build()
    .expect("valid consumer");
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    wait::until(WAIT, "the four Java records handled", || {
        let s = stats.snapshot();
        async move { s.applied + s.duplicates + s.dead_letters >= 4 }
    })
    .await;
    running.stop().await;

    let applied: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT event_id, n FROM java_effects ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        applied,
        [(first, 1), (last, 4)],
        "only the binary events with UUID ids applied"
    );
    #[allow(clippy::type_complexity)]
    let dead: Vec<(
        i64,
        String,
        String,
        Option<Uuid>,
        Option<Vec<u8>>,
        Vec<String>,
        Vec<Vec<u8>>,
    )> = sqlx::query_as(
        "SELECT kafka_offset, reason, error, event_id, payload, header_names, header_values
             FROM postal.dead_letters ORDER BY kafka_offset",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let reasons: Vec<(i64, &str)> = dead.iter().map(|d| (d.0, d.1.as_str())).collect();
    assert_eq!(
        reasons,
        [(1, "missing_event_id"), (2, "missing_event_id")],
        "errors: {:?}",
        dead.iter().map(|d| &d.2).collect::<Vec<_>>()
    );
    let header = |d: &(_, _, _, _, _, Vec<String>, Vec<Vec<u8>>), name: &str| {
        d.5.iter()
            .position(|h| h == name)
            .map(|i| String::from_utf8_lossy(&d.6[i]).into_owned())
    };

    let s = &dead[0];
    assert!(s.2.contains("no ce_id header"), "{}", s.2);
    assert_eq!(s.3, None, "no event id could be read");
    assert_eq!(
        header(s, "content-type").as_deref(),
        Some("application/cloudevents+json"),
        "structured mode's content type kept"
    );
    let envelope: Value =
        serde_json::from_slice(s.4.as_deref().expect("the record value")).expect("JSON envelope");
    assert_eq!(envelope["specversion"], "1.0", "{envelope}");
    assert_eq!(envelope["id"], structured.to_string(), "{envelope}");
    assert_eq!(envelope["data"], json!({"n": 2}), "{envelope}");

    let x = &dead[1];
    assert!(x.2.contains("is not a non-nil UUID"), "{}", x.2);
    assert_eq!(header(x, "ce_id").as_deref(), Some("order-42"));
}

/// Guarantee: what the Java CloudEvents SDK would refuse never reaches the topic. A relay
/// `--source` that is not a URI-reference (`billing service`: the SDK would refuse every record)
/// stops `postal relay` at start with a one-line error; a user header named `ce_<name>` whose
/// `<name>` is not letters and digits (`ce_tenant-id`: the SDK refuses that record) is refused
/// by `enqueue`, and a row written around it carrying one is parked with the reason — while a
/// user header `ce_Tenant` reaches Java as the extension `tenant` and the Java consumer reads
/// every record. (Before, Postal published both, and the Java consumer stopped on them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_java_sdk_refuses_postal_refuses_first() {
    let Some(jar) = interop_jar() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let logs = log_dir(&db.name);
    let topic = unique("interop-headers");
    create_topic(&svc.bootstrap, &topic, 1).await;

    let out = std::process::Command::new(bin_dir().join("postal"))
        .args(["relay", "--source", "billing service"])
        .env("DATABASE_URL", &db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap)
        .output()
        .expect("postal runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a relay with a non-URI source starts"
    );
    assert!(
        stderr.contains("source \"billing service\" is not a URI-reference"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");

    let refused = NewEvent::json(topic.as_str(), "k", "order.placed", &json!({"n": 3}))
        .unwrap()
        .with_header("ce_tenant-id", "acme")
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("CloudEvents extension attribute"),
        "{refused}"
    );

    let good = NewEvent::json(topic.as_str(), "k", "order.placed", &json!({"n": 2}))
        .unwrap()
        .with_header("ce_Tenant", "acme")
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let ids = enqueue_batch(&mut conn, vec![good]).await.unwrap();
    drop(conn);
    let around = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, headers)
         VALUES ($1, $2, 'k2', 'order.placed', '{\"n\": 4}'::bytea, jsonb_build_object('ce_tenant-id', 'acme'))",
    )
    .bind(around)
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let mut relay = relay(&logs, "relay", &db.url, &svc.bootstrap, SOURCE);
    relay.start();
    let (code, lines, stderr) = run_java(
        &jar,
        &logs,
        "java-consumer-headers",
        "ConsumeCloudEvents",
        &[&svc.bootstrap, &topic, "1", "60"],
        Duration::from_secs(120),
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let reason = loop {
        let parked: Option<String> = sqlx::query_scalar(
            "SELECT last_error FROM postal.outbox WHERE event_id = $1 AND status = 'failed'",
        )
        .bind(around)
        .fetch_optional(&db.pool)
        .await
        .unwrap();
        if let Some(reason) = parked {
            break reason;
        }
        relay.assert_alive();
        assert!(
            std::time::Instant::now() < deadline,
            "the row was not parked"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    relay.stop();
    assert_eq!(code, 0, "stdout {lines:?}, stderr:\n{}", tail(&stderr));
    let read: Vec<Value> = json_lines(&lines)
        .into_iter()
        .filter(|v| v.get("summary").is_none())
        .collect();
    assert_eq!(read.len(), 1, "{read:?}");
    assert_eq!(read[0]["id"], ids[0].to_string());
    assert_eq!(read[0]["extensions"]["tenant"], "acme", "{}", read[0]);
    assert!(
        reason.contains("\"ce_tenant-id\" is a CloudEvents extension attribute"),
        "{reason}"
    );
}

/// Guarantee (issue: JVM interop): for 10,000 random keys, the relay puts every key on the
/// partition the Java client's default partitioner picks (`BuiltInPartitioner.partitionForKey`),
/// for topics of 3, 7, 12 and 32 partitions; and an event's trace context reaches a Java
/// CloudEvents consumer as the distributed-tracing extension `traceparent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_partitions_match_for_random_keys_and_see_the_trace_context() {
    use rand::Rng;
    let Some(jar) = interop_jar() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let logs = log_dir(&db.name);
    const KEYS: usize = 10_000;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut rng = rand::rng();
    let keys: Vec<String> = (0..KEYS)
        .map(|_| {
            let len = rng.random_range(1..40);
            let mut key: String = (0..len)
                .map(|_| rng.random_range(b' '..=b'~') as char)
                .collect();
            if rng.random_bool(0.1) {
                key.push('ü');
            }
            key
        })
        .collect();
    let mut topics = Vec::new();
    for partitions in [3, 7, 12, 32] {
        let topic = unique(&format!("interop-p{partitions}"));
        create_topic(&svc.bootstrap, &topic, partitions).await;
        for chunk in keys.chunks(2_000) {
            let batch: Vec<NewEvent> = chunk
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    let e = NewEvent::json(topic.as_str(), k.as_str(), "k.seen", &json!({"i": i}))
                        .unwrap();
                    if i == 0 {
                        e.with_header("traceparent", traceparent).unwrap()
                    } else {
                        e
                    }
                })
                .collect();
            let mut tx = db.pool.begin().await.unwrap();
            enqueue_batch(&mut tx, batch).await.unwrap();
            tx.commit().await.unwrap();
        }
        topics.push((partitions, topic));
    }
    let mut relay = relay(&logs, "relay-keys", &db.url, &svc.bootstrap, SOURCE);
    relay.start();
    for (partitions, topic) in &topics {
        let (code, lines, stderr) = run_java(
            &jar,
            &logs,
            &format!("java-keys-{partitions}"),
            "ConsumeCloudEvents",
            &[&svc.bootstrap, topic, &KEYS.to_string(), "120"],
            Duration::from_secs(240),
        )
        .await;
        relay.assert_alive();
        assert_eq!(code, 0, "{partitions} partitions: {}", tail(&stderr));
        let all = json_lines(&lines);
        let summary = all
            .iter()
            .find_map(|v| v.get("summary"))
            .expect("a summary line");
        assert_eq!(summary["records"], KEYS as u64, "{partitions}: {summary}");
        assert_eq!(
            summary["partition_mismatches"], 0,
            "{partitions} partitions: keys Java would put elsewhere: {summary}"
        );
        let used: BTreeSet<i64> = all
            .iter()
            .filter_map(|v| v.get("partition").and_then(Value::as_i64))
            .collect();
        assert_eq!(used.len(), *partitions as usize, "every partition used");
        let traced: Vec<&Value> = all
            .iter()
            .filter(|v| v["extensions"].get("traceparent").is_some())
            .collect();
        assert_eq!(traced.len(), 5, "one traced event per batch: {traced:?}");
        assert!(traced
            .iter()
            .all(|v| v["extensions"]["traceparent"] == traceparent));
    }
    relay.stop();
}

/// Guarantee (as `what_the_java_sdk_refuses_postal_refuses_first`): what the Java CloudEvents
/// SDK refuses never reaches the topic — `enqueue` refuses it, or the Java consumer reads every
/// record.
///
/// Broken: the `ce_<name>` check looks only at the name's characters, and the reserved list
/// holds only the attributes Postal writes. `ce_dataschema` is a CloudEvents context attribute
/// too (a URI): a user header `ce_dataschema: orders v2` passes `with_header` and `enqueue`, is
/// published, and the SDK's `CloudEventDeserializer` refuses the record (a Java consumer that
/// stops on it holds its partition) — the failure c261a00 set out to prevent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ce_context_attribute_header_postal_does_not_set_is_refused_or_read() {
    let Some(jar) = interop_jar() else { return };
    let svc = services().await;
    let db = svc.fresh_db().await;
    let logs = log_dir(&db.name);
    let topic = unique("interop-attr");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let event = NewEvent::json(topic.as_str(), "k", "order.placed", &json!({"n": 1}))
        .unwrap()
        .with_header("ce_dataschema", "orders v2");
    let Ok(event) = event else {
        // Refused at enqueue: the guarantee holds.
        return;
    };
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue_batch(&mut conn, vec![event]).await.unwrap();
    drop(conn);
    let mut relay = relay(&logs, "relay", &db.url, &svc.bootstrap, SOURCE);
    relay.start();
    let (code, lines, stderr) = run_java(
        &jar,
        &logs,
        "java-consumer-attr",
        "ConsumeCloudEvents",
        &[&svc.bootstrap, &topic, "1", "60"],
        Duration::from_secs(120),
    )
    .await;
    relay.stop();
    assert_eq!(
        code,
        0,
        "Postal published a record the Java CloudEvents SDK refuses; stdout {lines:?}, stderr:\n{}",
        tail(&stderr)
    );
}
