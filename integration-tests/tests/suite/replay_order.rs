//! Attacks on the order and counts of `postal dead-letters replay` (`postal_admin::dead_letters::
//! replay`): per chunk, a key's records go out one at a time in id order, keys at once; a key
//! whose record is refused for its size stops, and its rest goes out one at a time afterwards.

use std::time::Duration;

use postal_integration_tests::{kafka, services, unique};
use uuid::Uuid;

use crate::dead_letters::create_topic_with;

const WAIT: Duration = Duration::from_secs(60);

/// Records one dead letter of consumer `billing` from `topic` with record key `key` (None: no
/// key), an event id (also its `ce_id` header), its dedup row and `value` random bytes; returns
/// (dead letter id, event id).
async fn dead_letter(
    pool: &sqlx::PgPool,
    topic: &str,
    key: Option<&str>,
    value: usize,
) -> (i64, Uuid) {
    use rand::RngCore;
    let mut payload = vec![0u8; value];
    rand::rng().fill_bytes(&mut payload);
    let event = Uuid::now_v7();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
             kafka_offset, event_id, record_key, payload, header_names, header_values,
             reason, error, attempts, dlq_topic)
         VALUES ('billing', 'billing', $1, 0, 0, $2, $3, $4, ARRAY['ce_id', 'ce_type'],
                 ARRAY[convert_to($2::text, 'UTF8'), convert_to('job', 'UTF8')],
                 'permanent', 'declined', 1, $1 || '.dlq')
         RETURNING id",
    )
    .bind(topic)
    .bind(event)
    .bind(key.map(|k| k.as_bytes().to_vec()))
    .bind(payload)
    .fetch_one(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO postal.processed_events (consumer_name, event_id, processed_at)
         SELECT consumer_name, event_id, created_at FROM postal.dead_letters WHERE id = $1",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
    (id, event)
}

fn replay_producer(bootstrap: &str) -> rdkafka::producer::FutureProducer {
    postal_shared::kafka_producer::replay_config(bootstrap, &std::collections::BTreeMap::new())
        .expect("producer settings")
        .create()
        .expect("producer")
}

async fn replay(
    pool: &sqlx::PgPool,
    producer: &rdkafka::producer::FutureProducer,
    ids: &[i64],
) -> Result<u64, postal_admin::Error> {
    postal_admin::dead_letters::replay(
        pool,
        producer,
        &postal_admin::audit::Operator::cli("test"),
        &serde_json::json!({ "ids": ids }),
        ids,
        |_| {},
    )
    .await
}

/// The `ce_id`s on `topic`, per partition in offset order (read until `min` arrived).
async fn on_topic(bootstrap: &str, topic: &str, min: usize, wait: Duration) -> Vec<String> {
    kafka::read_all(bootstrap, topic, min, wait)
        .await
        .iter()
        .map(|r| r.header("ce_id").unwrap_or("-").to_owned())
        .collect()
}

/// Guarantee (the brief: a key's dead letters reach the topic in id order; a key whose record
/// is refused for its size sends nothing more until that record went out): four dead letters
/// of one key, sizes [100, 700,000, 100, 100] bytes, to a topic whose `max.message.bytes` is
/// 600,000 (the second can never be written). The replay fails on the second; the third and
/// fourth must not be written ahead of it: they stay open with their dedup rows, so that a
/// later replay (after the operator raised the topic's limit) sends 2, 3, 4 in order.
///
/// Broken (fails on r46b-s6 at 242185a): the replay returns the error for dead letter 2, yet
/// dead letters 3 and 4 were written to the topic (topic holds positions [0, 2, 3]) and marked
/// replayed (audit affected 3 of matched 4). In the pass "one record at a time" after the
/// first (`admin/src/dead_letters.rs` `replay`, `for rest in alone`), a record refused again
/// alone does not stop the rest of its key: once the topic's limit is raised and the replay is
/// run again, dead letter 2 lands after 3 and 4 — the key's order is lost. The same holds in
/// the first pass for any other failure in the middle of a key (the loop pushes the error and
/// goes on to the key's next record). The error also says "3 replayed before it" though only
/// one was before it (the count includes the two sent after it). 3 runs of 3.
#[tokio::test]
async fn a_key_whose_record_is_refused_alone_sends_none_of_its_later_ones() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-order-refused");
    create_topic_with(&svc.bootstrap, &topic, &[("max.message.bytes", "600000")]).await;
    let mut letters = Vec::new();
    for size in [100, 700_000, 100, 100] {
        letters.push(dead_letter(&db.pool, &topic, Some("k"), size).await);
    }
    let ids: Vec<i64> = letters.iter().map(|(id, _)| *id).collect();
    let producer = replay_producer(&svc.bootstrap);
    let res = replay(&db.pool, &producer, &ids).await;
    eprintln!("replay: {res:?}");
    assert!(res.is_err(), "dead letter 2 can never be written");
    let sent = on_topic(&svc.bootstrap, &topic, 1, Duration::from_secs(10)).await;
    let expected: Vec<String> = letters.iter().map(|(_, e)| e.to_string()).collect();
    let positions: Vec<Option<usize>> = sent
        .iter()
        .map(|e| expected.iter().position(|x| x == e))
        .collect();
    let open: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM postal.dead_letters WHERE replayed_at IS NULL ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let audit: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT matched, affected FROM postal.operator_audit WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!("on topic (positions): {positions:?}; open: {open:?}; audit: {audit:?}");
    assert_eq!(
        positions,
        vec![Some(0)],
        "only the first, before the refused one"
    );
    assert_eq!(
        open,
        ids[1..].to_vec(),
        "the refused one and the rest of its key stay open"
    );
    assert_eq!(audit, vec![(Some(4), 1)]);
}

/// Guarantee: a mix of keys on one partition (so that records of different keys share record
/// batches), records with no key, the same key on two topics, and sizes near the topic's
/// `max.message.bytes` (250,000: records of 100,000 and 240,000 bytes, interleaved) are each
/// replayed exactly once, each key's records (per topic) in id order, and the audit counts
/// match. Holds on r46b-s6 at 242185a.
#[tokio::test]
async fn mixed_keys_sizes_and_no_keys_on_one_partition_each_once_in_key_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let t1 = unique("replay-order-mix-a");
    let t2 = unique("replay-order-mix-b");
    for t in [&t1, &t2] {
        create_topic_with(&svc.bootstrap, t, &[("max.message.bytes", "250000")]).await;
    }
    // (topic, key, event), in id order.
    let mut letters: Vec<(String, Option<&str>, Uuid)> = Vec::new();
    let mut ids = Vec::new();
    let keys = [Some("a"), Some("b"), None, Some("c"), Some("a"), None];
    for i in 0..36 {
        let topic = if i % 5 == 4 { &t2 } else { &t1 };
        let key = keys[i % keys.len()];
        let size = if i % 3 == 1 { 240_000 } else { 100_000 };
        let (id, e) = dead_letter(&db.pool, topic, key, size).await;
        ids.push(id);
        letters.push((topic.clone(), key, e));
    }
    let producer = replay_producer(&svc.bootstrap);
    let n = replay(&db.pool, &producer, &ids).await.expect("replayed");
    assert_eq!(n, ids.len() as u64);
    let mut all = Vec::new();
    for t in [&t1, &t2] {
        let want = letters.iter().filter(|l| &l.0 == t).count();
        let sent = on_topic(&svc.bootstrap, t, want, WAIT).await;
        assert_eq!(sent.len(), want, "each once on {t}");
        for key in [Some("a"), Some("b"), Some("c")] {
            let expected: Vec<String> = letters
                .iter()
                .filter(|l| &l.0 == t && l.1 == key)
                .map(|l| l.2.to_string())
                .collect();
            let got: Vec<String> = sent
                .iter()
                .filter(|e| expected.contains(e))
                .cloned()
                .collect();
            assert_eq!(got, expected, "key {key:?} on {t} in id order");
        }
        all.extend(sent);
    }
    let mut sorted = all.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), ids.len(), "no doubles");
    let audit: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT matched, affected FROM postal.operator_audit WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(audit, vec![(Some(ids.len() as i64), ids.len() as i64)]);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters WHERE replayed_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(left, 0);
}

/// Guarantee: on a compacted topic (the broker refuses a record with no key: INVALID_RECORD),
/// keyed dead letters interleaved with keyless ones are all replayed, in id order per key, and
/// the keyless ones are counted failed and left open with their dedup rows; the audit counts
/// the keyed ones only.
#[tokio::test]
async fn keyless_dead_letters_refused_by_a_compacted_topic_stay_open_and_keyed_ones_go() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-order-compacted");
    create_topic_with(&svc.bootstrap, &topic, &[("cleanup.policy", "compact")]).await;
    let keys = [Some("a"), None, Some("a"), None, Some("b"), Some("a")];
    let mut letters = Vec::new();
    for key in keys {
        let (id, e) = dead_letter(&db.pool, &topic, key, 100).await;
        letters.push((id, key, e));
    }
    let ids: Vec<i64> = letters.iter().map(|l| l.0).collect();
    let producer = replay_producer(&svc.bootstrap);
    let res = replay(&db.pool, &producer, &ids).await;
    eprintln!("replay: {res:?}");
    assert!(res.is_err(), "the keyless ones are refused");
    let sent = on_topic(&svc.bootstrap, &topic, 4, WAIT).await;
    let keyed: Vec<String> = letters
        .iter()
        .filter(|l| l.1 == Some("a"))
        .map(|l| l.2.to_string())
        .collect();
    let got: Vec<String> = sent.iter().filter(|e| keyed.contains(e)).cloned().collect();
    assert_eq!(got, keyed, "key a in id order");
    assert_eq!(sent.len(), 4, "the four keyed ones, once each");
    let open: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM postal.dead_letters WHERE replayed_at IS NULL ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let keyless: Vec<i64> = letters
        .iter()
        .filter(|l| l.1.is_none())
        .map(|l| l.0)
        .collect();
    assert_eq!(open, keyless);
    let dedup: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dedup, 2, "the keyless ones keep their dedup rows");
    let audit: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT matched, affected FROM postal.operator_audit WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(audit, vec![(Some(6), 4)]);
}

/// Guarantee: as [`mixed_keys_sizes_and_no_keys_on_one_partition_each_once_in_key_order`],
/// heavier: 160 dead letters of 10 keys on one partition, sizes 60,000 to 240,000 bytes on a
/// topic of `max.message.bytes` 250,000, several chunks: each once, each key in id order.
/// Holds on r46b-s6 at 242185a (3 runs, about 0.5 s per replay); with a temporary print, 2 to
/// 10 keys per chunk went to the one-at-a-time pass, so that pass is exercised.
#[tokio::test]
async fn many_keys_near_the_limit_on_one_partition_each_once_in_key_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-order-many");
    create_topic_with(&svc.bootstrap, &topic, &[("max.message.bytes", "250000")]).await;
    let keys: Vec<String> = (0..10).map(|k| format!("k{k}")).collect();
    let mut letters = Vec::new();
    let mut ids = Vec::new();
    for i in 0..160usize {
        let key = &keys[(i * 7 + i / 10) % keys.len()];
        let size = [60_000, 240_000, 120_000, 200_000][i % 4];
        let (id, e) = dead_letter(&db.pool, &topic, Some(key), size).await;
        ids.push(id);
        letters.push((key.clone(), e));
    }
    let producer = replay_producer(&svc.bootstrap);
    let t = std::time::Instant::now();
    let n = replay(&db.pool, &producer, &ids).await.expect("replayed");
    eprintln!("replayed {n} in {:?}", t.elapsed());
    assert_eq!(n, ids.len() as u64);
    let sent = on_topic(&svc.bootstrap, &topic, ids.len(), WAIT).await;
    assert_eq!(sent.len(), ids.len(), "each once");
    for key in &keys {
        let expected: Vec<String> = letters
            .iter()
            .filter(|l| &l.0 == key)
            .map(|l| l.1.to_string())
            .collect();
        let got: Vec<String> = sent
            .iter()
            .filter(|e| expected.contains(e))
            .cloned()
            .collect();
        assert_eq!(got, expected, "key {key} in id order");
    }
    let audit: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT matched, affected FROM postal.operator_audit WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(audit, vec![(Some(160), 160)]);
}

/// Sets `max.message.bytes` of `topic` to `bytes`.
async fn set_max_message_bytes(bootstrap: &str, topic: &str, bytes: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let alter = AlterConfig::new(ResourceSpecifier::Topic(topic)).set("max.message.bytes", bytes);
    for r in admin
        .alter_configs([&alter], &AdminOptions::new())
        .await
        .expect("alter")
    {
        r.expect("altered");
    }
}

/// Guarantee (the brief: a key's dead letters reach the topic in id order): the operator's
/// course after a replay refused for a record's size — raise the topic's `max.message.bytes`,
/// run the replay again — ends with the key's four dead letters on the topic once each, in id
/// order. Sizes [100, 700,000, 100, 100], topic limit 600,000, then 1,000,000.
///
/// Broken (fails on r46b-s6 at 242185a, 3 runs of 3): the topic holds the key's dead letters in
/// the order [0, 2, 3, 1] (dead-letter positions). The first replay sent 3 and 4 after 2 was
/// refused alone (see [`a_key_whose_record_is_refused_alone_sends_none_of_its_later_ones`]);
/// the second replay sent 2 alone, after them. The consumer applies the key's events out of
/// order.
#[tokio::test]
async fn raising_the_limit_and_replaying_again_leaves_the_key_in_id_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-order-again");
    create_topic_with(&svc.bootstrap, &topic, &[("max.message.bytes", "600000")]).await;
    let mut letters = Vec::new();
    for size in [100, 700_000, 100, 100] {
        letters.push(dead_letter(&db.pool, &topic, Some("k"), size).await);
    }
    let ids: Vec<i64> = letters.iter().map(|(id, _)| *id).collect();
    let producer = replay_producer(&svc.bootstrap);
    let first = replay(&db.pool, &producer, &ids).await;
    assert!(first.is_err(), "dead letter 2 is refused");
    set_max_message_bytes(&svc.bootstrap, &topic, "1000000").await;
    // The broker applies a topic's new settings shortly after: until then the replay fails again.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match replay(&db.pool, &producer, &ids).await {
            Ok(_) => break,
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "still refused: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    let sent = on_topic(&svc.bootstrap, &topic, 4, WAIT).await;
    let expected: Vec<String> = letters.iter().map(|(_, e)| e.to_string()).collect();
    let positions: Vec<Option<usize>> = sent
        .iter()
        .map(|e| expected.iter().position(|x| x == e))
        .collect();
    eprintln!("on topic (positions): {positions:?}");
    assert_eq!(sent, expected, "each once, in id order");
}

/// Guarantee (issue 46: every operator action leaves a trail): a replay that fails keeps, in
/// its audit row, the one-line error it ended with and what it did before (`affected`), and
/// `postal audit list` shows it as `failed` with that error on the action's line; a replay
/// that completes says `done`, with no error.
///
/// Scenario: key `k` with dead letters of 100 and 700,000 bytes to a topic that takes 600,000
/// (the second can never be written), then a replay of one small dead letter of key `j`.
///
/// Broken before migration 38: the failed replay's row held `matched` 2, `affected` 1 and no
/// error; it looked like a replay still running.
#[tokio::test]
async fn a_failed_replay_keeps_its_error_in_the_audit_trail() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("replay-audit-error");
    create_topic_with(&svc.bootstrap, &topic, &[("max.message.bytes", "600000")]).await;
    let (small, _) = dead_letter(&db.pool, &topic, Some("k"), 100).await;
    let (large, _) = dead_letter(&db.pool, &topic, Some("k"), 700_000).await;
    let (other, _) = dead_letter(&db.pool, &topic, Some("j"), 100).await;
    let producer = replay_producer(&svc.bootstrap);
    let err = replay(&db.pool, &producer, &[small, large])
        .await
        .expect_err("dead letter 2 can never be written");
    assert_eq!(replay(&db.pool, &producer, &[other]).await.unwrap(), 1);
    let rows: Vec<(i64, bool, Option<String>)> = sqlx::query_as(
        "SELECT affected, ended_at IS NOT NULL, error FROM postal.operator_audit
         WHERE action = 'replay' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!("replay error: {err}; audit rows: {rows:?}");
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(
        (rows[0].0, rows[0].1),
        (1, true),
        "the first ended after 1 sent"
    );
    let kept = rows[0]
        .2
        .as_deref()
        .expect("the failed replay keeps its error");
    assert_eq!(kept, err.to_string(), "the error as the operator saw it");
    assert!(
        kept.contains(&format!("dead letter {large}")) && kept.contains("1 of 2 replayed"),
        "it names the dead letter and what was replayed: {kept}"
    );
    assert_eq!(rows[1], (1, true, None), "the second completed");
    let out = std::process::Command::new(crate::procs::bin_dir().join("postal"))
        .args(["audit", "list"])
        .env("DATABASE_URL", &db.url)
        .env("POSTAL_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains(" replay ")).collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(
        lines[0].contains(" done ") && !lines[0].contains("error:"),
        "newest first, the completed one: {}",
        lines[0]
    );
    assert!(
        lines[1].contains(" failed ")
            && lines[1].contains(&format!("error: replaying dead letter {large}")),
        "the failed one, with its error on its line: {}",
        lines[1]
    );
}
