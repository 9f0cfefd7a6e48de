//! Every Kafka producer Postal makes puts a key on the partition Java's default partitioner
//! picks for it (`murmur2`, as the relay's): the consumer's dead-letter copies on
//! `<topic>.dlq`, and dead letters replayed by `postal dead-letters replay` and by the
//! dashboard. librdkafka's own default (CRC32) puts most keys elsewhere, so a replayed event
//! would land on another partition than its key's other events.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use postal_admin::web::Dashboard;
use postal_integration_tests::http::{csrf, request};
use postal_integration_tests::{kafka, services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::dashboard::{click_and_confirm, start};
use crate::common::{consumer_config, create_topic, produce, start_apply, RawRecord};
use crate::handlers;

const WAIT: Duration = Duration::from_secs(60);
const PARTITIONS: i32 = 8;
const KEYS: usize = 12;

/// Kafka's `Utils.murmur2` (kafka-clients), the hash of Java's default partitioner.
fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h = SEED ^ data.len() as u32;
    let words = data.chunks_exact(4);
    let tail = words.remainder();
    for w in words {
        let mut k = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if let Some(&b) = tail.first() {
        h ^= u32::from(b);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Java's default partitioner picks for `key`
/// (`BuiltInPartitioner.partitionForKey`: `toPositive(murmur2(key)) % partitions`).
fn java_partition(key: &[u8]) -> i32 {
    (murmur2(key) & 0x7fff_ffff) % PARTITIONS
}

/// The partition librdkafka's default partitioner (`consistent_random`: CRC-32 of the key)
/// picks for `key`.
fn crc32_partition(key: &[u8]) -> i32 {
    let mut c = !0u32;
    for &b in key {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0xedb8_8320
            } else {
                c >> 1
            };
        }
    }
    (!c % PARTITIONS as u32) as i32
}

/// Guarantee: the test's murmur2 is Kafka's `Utils.murmur2` (vectors of kafka-clients 4.4.0,
/// every tail length; the same as librdkafka's unit test of its Java-compatible murmur2), and
/// the keys the scenario uses are ones where librdkafka's default partitioner would pick
/// another partition than Java's for most of them (so the scenario tells the two apart).
#[test]
fn murmur2_is_kafkas_and_the_keys_tell_the_partitioners_apart() {
    for (key, hash) in [
        ("kafka", 0xd067cf64u32),
        ("giberish123456789", 0x8f552b0c),
        ("1234", 0x9fc97b14),
        ("234", 0xe7c009ca),
        ("34", 0x873930da),
        ("4", 0x5a4b5ca1),
        ("PreAmbleWillBeRemoved,ThePrePartThatIs", 0x78424f1c),
        ("", 0x106e08d9),
        ("customer-0", 0xf73f75fb),
    ] {
        assert_eq!(murmur2(key.as_bytes()) as u32, hash, "{key:?}");
    }
    assert_eq!(java_partition(b"customer-0"), 3);
    assert_eq!(crc32_partition(b"123456789"), (0xcbf4_3926u32 % 8) as i32);
    let apart = keys()
        .iter()
        .filter(|k| java_partition(k.as_bytes()) != crc32_partition(k.as_bytes()))
        .count();
    assert!(apart >= KEYS / 2, "only {apart} of {KEYS} keys differ");
}

fn keys() -> Vec<String> {
    (0..KEYS).map(|i| format!("customer-{i}")).collect()
}

/// Runs `postal dead-letters replay` for `ids` against `database_url` and `bootstrap`, with no
/// `--kafka` properties; panics with its output when it fails.
async fn cli_replay(database_url: &str, bootstrap: &str, ids: &[i64]) {
    let mut cmd = std::process::Command::new(crate::procs::bin_dir().join("postal"));
    cmd.args(["dead-letters", "replay", "--bootstrap-servers", bootstrap])
        .env("DATABASE_URL", database_url)
        .env_remove("POSTAL_KAFKA")
        .env_remove("POSTAL_KAFKA_FILE");
    for id in ids {
        cmd.args(["--id", &id.to_string()]);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .expect("postal runs (cargo build -p postal-cli)");
    assert!(
        out.status.success(),
        "postal dead-letters replay: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Guarantee (one constructor for every Kafka producer): on an 8-partition topic, for 12 keys,
/// the consumer's dead-letter copy on `<topic>.dlq` (8 partitions), a dead letter replayed by
/// `postal dead-letters replay` and one replayed from the dashboard each land on the
/// partition Java's default partitioner picks for the record's key
/// (`toPositive(murmur2(key)) % 8`), as the relay's records do — not on librdkafka's default
/// CRC-32 choice, which differs for most of these keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_copies_and_replays_land_on_javas_partition_for_their_key() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-partitions");
    create_topic(&svc.bootstrap, &topic, PARTITIONS).await;
    // No handler for this type: each record becomes a dead letter `unknown_type`.
    let records: Vec<RawRecord> = keys()
        .iter()
        .map(|k| RawRecord::event(Uuid::now_v7(), k, "job.unheard_of", json!({"n": 1})))
        .collect();
    produce(&svc.bootstrap, &topic, None, &records).await;
    let originals: BTreeSet<(i32, i64)> = kafka::read_all(&svc.bootstrap, &topic, KEYS, WAIT)
        .await
        .iter()
        .map(|r| (r.partition, r.offset))
        .collect();
    assert_eq!(originals.len(), KEYS);

    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config.dlq_partitions = PARTITIONS;
    let running = start_apply(&db.pool, &topic, config);
    wait::until(WAIT, "every dead letter published", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM postal.dead_letters WHERE published_at IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
            == KEYS as i64
    })
    .await;
    running.stop().await;
    let dlq = kafka::read_all(&svc.bootstrap, &format!("{topic}.dlq"), KEYS, WAIT).await;
    assert_eq!(dlq.len(), KEYS, "one dead-letter copy per record");

    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM postal.dead_letters ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let (by_cli, by_dashboard) = ids.split_at(KEYS / 2);
    cli_replay(&db.url, &svc.bootstrap, by_cli).await;
    let mut kafka_settings = rdkafka::ClientConfig::new();
    kafka_settings.set("bootstrap.servers", &svc.bootstrap);
    let addr = start(
        Dashboard::new(db.pool.clone())
            .actions(true)
            .kafka(kafka_settings),
    )
    .await;
    let page = request(addr, "GET", "/dead-letters", &[], "").await;
    let token = csrf(&page.body).expect("a CSRF token on the page");
    let ids_shown: Vec<String> = by_dashboard.iter().map(i64::to_string).collect();
    let mut fields = vec![("csrf", token.as_str())];
    fields.extend(ids_shown.iter().map(|id| ("id", id.as_str())));
    let (_, done) = click_and_confirm(addr, "/dead-letters/replay", &fields).await;
    assert!(
        done.body
            .contains(&format!("Replayed {} dead letter(s)", by_dashboard.len())),
        "{}",
        done.body
    );

    // Which path replayed each event.
    let replayed_by: BTreeMap<String, &str> = sqlx::query_as::<_, (i64, Uuid)>(
        "SELECT id, event_id FROM postal.dead_letters WHERE replayed_at IS NOT NULL",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, event)| {
        let path = if by_cli.contains(&id) {
            "postal dead-letters replay"
        } else {
            "the dashboard's replay"
        };
        (event.to_string(), path)
    })
    .collect();
    assert_eq!(replayed_by.len(), KEYS, "every dead letter replayed");
    let replays: Vec<kafka::Record> = kafka::read_all(&svc.bootstrap, &topic, 2 * KEYS, WAIT)
        .await
        .into_iter()
        .filter(|r| !originals.contains(&(r.partition, r.offset)))
        .collect();
    assert_eq!(replays.len(), KEYS, "one replayed record per dead letter");

    let mut misplaced = Vec::new();
    let copies = dlq.iter().map(|r| (r, "the consumer's dead-letter copy"));
    let replayed = replays.iter().map(|r| {
        let id = r.header("ce_id").expect("the original ce_id");
        (r, replayed_by[id])
    });
    for (r, by) in copies.chain(replayed) {
        let key = r.key.as_deref().expect("the original key");
        let java = java_partition(key.as_bytes());
        if r.partition != java {
            misplaced.push(format!(
                "{by}: key {key} on partition {}, Java's partitioner picks {java}",
                r.partition
            ));
        }
    }
    assert!(
        misplaced.is_empty(),
        "{} of {} records off their key's partition:\n{}",
        misplaced.len(),
        dlq.len() + replays.len(),
        misplaced.join("\n")
    );
}
