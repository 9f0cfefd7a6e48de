//! Third adversarial review of the row-lock check (claim.rs `claimed!`, skipped.rs) and of the
//! Kafka topic readiness (kafka/served.rs, acks.rs), aimed at what `row_locks_by_hand::`,
//! `row_locks_relay::` and `fresh_topic::` do not model:
//!
//! - the own-claim recognition once a claim has *ended* having taken a row and given it back
//!   (released, or written back untried): the registry still lists the row among the ended
//!   claim's rows, so a multixact `xmax` equal to that claim's transaction id passes for its
//!   lock (`a_multixact_equal_to_an_ended_claims_xid_on_a_row_it_gave_back_…`, ignored: breaks);
//! - two relay groups whose topic filters overlap, both pipelined, under stranger row locks;
//! - partitions added to a Kafka topic while the relay publishes to it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postal_integration_tests::kafka::{read_all, Record};
use postal_integration_tests::{fresh_postgres_db, services, unique};
use postal_producer::testing::lease;
use postal_producer::{enqueue, NewEvent, TopicFilter};
use sqlx::PgPool;

use crate::common::held_up::connect;
use crate::common::{create_topic, fast_config, kafka_transport, RunningRelay};
use crate::row_locks_relay::{
    advance_multixacts, claim_in, exec, hold_pairs, payloads, probe_multixact, put, seq_of, LEASE,
};

// ---------------------------------------------------------------------------------------------
// A multixact equal to an ended claim's transaction id, on a row that claim took
// ---------------------------------------------------------------------------------------------

/// Attacks the own-claim recognition after abcb6aa's fix. The fix sends the statement only the
/// rows the relay's *running* claims took (`$9`); a passed row locked by an id in `$8` that is
/// not among them goes to `s`, and Rust judges it (`skipped::elsewhere`): for an *ended* claim
/// with that transaction id, the row counts as the relay's own in-flight row when the ended
/// claim took it (`Xact::not_in_flight` is false) — but an ended claim holds nothing. A claim
/// that took a row and gave it back (released: send deadline passed, lease give-up, a batch
/// given back untried; or written back untried, `HeldBack`) ends with that row in its `taken`
/// list, and the row is pending again, lockable by anyone. Two sessions that share a lock on it
/// give it a multixact `xmax`; when that id equals the ended claim's transaction id, the next
/// claim takes the key's later event while the earlier one is pending and locked.
///
/// Guarantee: per-key order of first publication (docs/guarantees.md; docs/relay.md "A row
/// lock holds its key").
///
/// Schedule: `first` of key k is enqueued; claim E takes it (its transaction id X, read as the
/// row's `xmax`) and releases it (rollback: `first` is pending again); the multixact counter
/// is advanced to X − 1; `second` of key k is enqueued; sessions A and B both take `FOR SHARE`
/// on `first` (multixact X, checked); claim L must take nothing of key k. It fails if L takes
/// `second`.
#[tokio::test]
async fn a_multixact_equal_to_an_ended_claims_xid_on_a_row_it_gave_back_still_holds_the_key() {
    let db = fresh_postgres_db().await;
    let relay = crate::common::held_up::relay_in(&db.pool, lease::DEFAULT_GROUP, LEASE).await;
    let topic = unique("mxgave");
    let mut a = connect(&db.url).await;
    let mut b = connect(&db.url).await;
    exec(&mut a, "CREATE TABLE mx (id int PRIMARY KEY)").await;
    exec(&mut a, "INSERT INTO mx SELECT generate_series(0, 2000)").await;
    put(&db.pool, &topic, "k", "first").await;
    let first = seq_of(&db.pool, "first").await;
    // Claim E takes `first`, then gives it back (its rows are pending again, unchanged).
    let e = claim_in(&db.pool, relay, &topic, 10).await;
    assert_eq!(payloads(&e), ["first"], "claim E");
    let x: i64 = sqlx::query_scalar("SELECT xmax::text::int8 FROM postal.outbox WHERE seq = $1")
        .bind(first)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    e.unwrap().release().await.unwrap();
    // Advance the multixact counter to X - 1.
    let (holders, pairs) = hold_pairs(&db.url).await;
    let started = Instant::now();
    loop {
        let m = probe_multixact(&mut a, &mut b).await;
        assert!(
            m < x,
            "the multixact counter ({m}) is past claim E's xid ({x})"
        );
        if m == x - 1 {
            break;
        }
        advance_multixacts(&mut b, pairs, x - 2 - m).await;
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "advancing multixacts"
        );
    }
    drop(holders);
    eprintln!("multixact counter advanced in {:?}", started.elapsed());
    put(&db.pool, &topic, "k", "second").await;
    exec(&mut a, "BEGIN").await;
    exec(&mut b, "BEGIN").await;
    let lock = format!("SELECT 1 FROM postal.outbox WHERE seq = {first} FOR SHARE");
    exec(&mut a, &lock).await;
    exec(&mut b, &lock).await;
    let xmax: i64 = sqlx::query_scalar("SELECT xmax::text::int8 FROM postal.outbox WHERE seq = $1")
        .bind(first)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        xmax, x,
        "first's multixact is claim E's xid (another multixact creator ran?)"
    );
    let l = claim_in(&db.pool, relay, &topic, 10).await;
    let took = payloads(&l);
    if let Some(l) = l {
        l.release().await.unwrap();
    }
    exec(&mut a, "ROLLBACK").await;
    exec(&mut b, "ROLLBACK").await;
    assert!(
        took.is_empty(),
        "claim L took {took:?} while `first` (multixact {xmax} = ended claim E's xid; E had taken and given back `first`) was pending and locked"
    );
}

// ---------------------------------------------------------------------------------------------
// Reading a topic back
// ---------------------------------------------------------------------------------------------

/// First copies (by `ce_id`) per key, in (partition, offset) order: (seq, partition).
fn first_copies(records: &[Record]) -> BTreeMap<String, Vec<(i64, i32)>> {
    let mut seen = HashSet::new();
    let mut by_key: BTreeMap<String, Vec<(i64, i32)>> = BTreeMap::new();
    for r in records {
        let id = r.header(postal_shared::headers::CE_ID).unwrap().to_owned();
        if !seen.insert(id) {
            continue;
        }
        let seq: i64 = r
            .header(postal_shared::headers::CE_POSTAL_SEQ)
            .unwrap()
            .parse()
            .unwrap();
        by_key
            .entry(r.key.clone().unwrap())
            .or_default()
            .push((seq, r.partition));
    }
    by_key
}

async fn pending(pool: &PgPool, topic: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE topic = $1")
        .bind(topic)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A stranger session that keeps row-locking random pending rows of `topic` (the four lock
/// modes, committed or rolled back) for 0–150 ms, until `done`. Returns how many it locked.
fn stranger(
    url: String,
    topic: String,
    seed: u64,
    done: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        use rand::{Rng as _, SeedableRng as _};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut c = connect(&url).await;
        exec(&mut c, "SET lock_timeout = '300ms'").await;
        let mut n = 0usize;
        while !done.load(Ordering::Relaxed) {
            let lock = ["FOR SHARE", "FOR KEY SHARE", "FOR UPDATE", ""][rng.random_range(0..4)];
            let sql = if lock.is_empty() {
                "UPDATE postal.outbox SET headers = headers WHERE seq = (
                     SELECT seq FROM postal.outbox WHERE topic = $1 AND status = 'pending'
                     ORDER BY seq LIMIT 1 OFFSET (random() * 6)::int)"
                    .to_string()
            } else {
                format!(
                    "SELECT 1 FROM postal.outbox WHERE seq = (
                         SELECT seq FROM postal.outbox
                         WHERE topic = $1 AND status = 'pending'
                         ORDER BY seq LIMIT 1 OFFSET (random() * 6)::int) {lock}"
                )
            };
            exec(&mut c, "BEGIN").await;
            if sqlx::query(&sql).bind(&topic).execute(&mut c).await.is_ok() {
                n += 1;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..150))).await;
            let end = if rng.random_bool(0.5) {
                "COMMIT"
            } else {
                "ROLLBACK"
            };
            exec(&mut c, end).await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..30))).await;
        }
        n
    })
}

// ---------------------------------------------------------------------------------------------
// Two relay groups with overlapping topic filters, pipelined, under stranger locks
// ---------------------------------------------------------------------------------------------

/// Attacks the lock check across relay groups: group `wide` (every topic) and group `narrow`
/// (only this topic) each run a pipelined Kafka relay (two lanes, batches of 4, eight in
/// flight) over the same outbox, so every row is a candidate for two relays whose claims are
/// strangers to each other (their registries are keyed by relay id), while three writers
/// enqueue on four hot keys and two stranger sessions row-lock random pending rows. Each group
/// owns all 256 key partitions (leases are per group), so neither fence orders the other: only
/// the row-lock check does.
///
/// Guarantee: per-key order of first publication (docs/relay.md "A row lock holds its key":
/// "a claim of a relay group whose topic filter overlaps this one's"), and nothing lost;
/// duplicates between the groups are allowed (consumers drop them by event id).
///
/// It fails if a key's first copies (read back in offset order on its partition) are not in
/// `seq` order, if an event never arrives, or if the outbox does not drain within 90 s.
#[tokio::test]
async fn two_relay_groups_with_overlapping_filters_under_stranger_locks_keep_key_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("locks3groups");
    create_topic(&svc.bootstrap, &topic, 4).await;
    let pipelined = || {
        fast_config()
            .batch_size(4)
            .max_in_flight_batches(8)
            .lanes(2)
    };
    let wide = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        pipelined().group("wide".to_string()),
    );
    let narrow = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        pipelined()
            .group("narrow".to_string())
            .topics(TopicFilter::Only(vec![topic.clone()])),
    );
    let done = Arc::new(AtomicBool::new(false));
    let lockers: Vec<_> = (0..2u64)
        .map(|s| stranger(db.url.clone(), topic.clone(), 31 + s, done.clone()))
        .collect();
    const WRITERS: usize = 3;
    const PER_WRITER: usize = 120;
    let keys = ["g0", "g1", "g2", "g3"];
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let pool = db.pool.clone();
        let topic = topic.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..PER_WRITER {
                let key = keys[(i * 5 + w) % keys.len()];
                let mut c = pool.acquire().await.unwrap();
                enqueue(
                    &mut c,
                    NewEvent::json(topic.as_str(), key, "e", &format!("{w}-{i}")).unwrap(),
                )
                .await
                .unwrap();
                if i % 8 == 0 {
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let total = WRITERS * PER_WRITER;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let left = pending(&db.pool, &topic).await;
        if left == 0 {
            break;
        }
        if left < 20 {
            done.store(true, Ordering::Relaxed);
        }
        assert!(
            Instant::now() < deadline,
            "{left} events still in the outbox after 90 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done.store(true, Ordering::Relaxed);
    for l in lockers {
        eprintln!("stranger locked {} rows", l.await.unwrap());
    }
    let records = read_all(&svc.bootstrap, &topic, total, Duration::from_secs(30)).await;
    wide.stop().await;
    narrow.stop().await;
    let by_key = first_copies(&records);
    let firsts: usize = by_key.values().map(Vec::len).sum();
    eprintln!(
        "{} records, {firsts} first copies ({} duplicates)",
        records.len(),
        records.len() - firsts
    );
    assert_eq!(firsts, total, "events lost");
    for (k, seqs) in &by_key {
        for w in seqs.windows(2) {
            assert!(
                w[0].0 < w[1].0,
                "key {k}: first copies out of order: {:?}",
                seqs.iter().map(|s| s.0).collect::<Vec<_>>()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Partitions added to a topic while the relay publishes to it
// ---------------------------------------------------------------------------------------------

pub(crate) async fn add_partitions(bootstrap: &str, topic: &str, total: usize) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let r = admin
        .create_partitions(
            &[NewPartitions::new(topic, total)],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap();
    for x in r {
        x.unwrap();
    }
}

/// Whether any partition of `topic` but 0 holds a record (its high watermark above 0).
async fn written_beyond_partition_0(bootstrap: &str, topic: &str) -> bool {
    let (bootstrap, topic) = (bootstrap.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer as _};
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", "review-locks3-watermarks")
            .create()
            .unwrap();
        (1..8).any(|p| {
            c.fetch_watermarks(&topic, p, Duration::from_secs(2))
                .is_ok_and(|(_, high)| high > 0)
        })
    })
    .await
    .unwrap()
}

/// A topic of one partition; a relay (its producer refreshing metadata every 500 ms, so that
/// it sees new partitions within the test, as it would within 5 min by librdkafka's default)
/// publishes 8 keys × 10 events; the topic grows to 8 partitions; the writer goes on enqueuing
/// rounds of one event per key while the relay publishes, until a record of the second phase
/// lands on a new partition (at most 60 s), then 3 rounds more. Returns the records, the
/// number of events, and how many rounds the second phase took.
async fn publish_across_a_partition_increase() -> (Vec<Record>, usize, usize) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("grown");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let mut transport_cfg = postal_producer::KafkaConfig::new(&svc.bootstrap);
    transport_cfg.topic_partitions = 1;
    transport_cfg
        .properties
        .insert("message.timeout.ms".into(), "1000".into());
    transport_cfg
        .properties
        .insert("topic.metadata.refresh.interval.ms".into(), "500".into());
    let transport = postal_producer::KafkaTransport::new(transport_cfg).unwrap();
    let relay = RunningRelay::start(&db.pool, transport, fast_config().batch_size(5));
    let keys: Vec<String> = (0..8).map(|k| format!("key{k}")).collect();
    let mut n = 0usize;
    let round = |pool: PgPool, topic: String, keys: Vec<String>, r: usize| async move {
        let mut c = pool.acquire().await.unwrap();
        for k in &keys {
            enqueue(
                &mut c,
                NewEvent::json(topic.as_str(), k.as_str(), "e", &format!("{k}-{r}")).unwrap(),
            )
            .await
            .unwrap();
        }
    };
    for r in 0..10 {
        round(db.pool.clone(), topic.clone(), keys.clone(), r).await;
        n += keys.len();
    }
    let drained = Instant::now() + Duration::from_secs(30);
    while pending(&db.pool, &topic).await > 0 {
        assert!(Instant::now() < drained, "phase 1 did not drain");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    add_partitions(&svc.bootstrap, &topic, 8).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut r = 10;
    let mut after = None;
    loop {
        round(db.pool.clone(), topic.clone(), keys.clone(), r).await;
        n += keys.len();
        r += 1;
        if after.is_none() && written_beyond_partition_0(&svc.bootstrap, &topic).await {
            after = Some(r);
        }
        if after.is_some_and(|a| r >= a + 3) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained = Instant::now() + Duration::from_secs(30);
    while pending(&db.pool, &topic).await > 0 {
        assert!(Instant::now() < drained, "phase 2 did not drain");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let records = read_all(&svc.bootstrap, &topic, n, Duration::from_secs(30)).await;
    relay.stop().await;
    (records, n, r - 10)
}

/// Attacks the topic readiness cache (`served.rs`: a topic is checked once, when the relay
/// first uses it) with partitions added to a topic the relay already publishes to: the new
/// partitions are freshly started on a Kafka 4.4 broker (KAFKA-15591 applies) and never
/// checked. Guarantee: nothing lost (docs/guarantees.md "Nothing is lost"); the relay's first
/// copies on each partition are in `seq` order per key.
///
/// Fails if an event never reaches the topic, or if on some partition a key's first copies are
/// out of `seq` order.
#[tokio::test]
async fn partitions_added_under_a_publishing_relay_lose_nothing() {
    let (records, n, rounds) = publish_across_a_partition_increase().await;
    eprintln!(
        "{} records of {n} events; second phase {rounds} rounds",
        records.len()
    );
    let by_key = first_copies(&records);
    let firsts: usize = by_key.values().map(Vec::len).sum();
    assert_eq!(firsts, n, "events lost");
    assert!(
        records.iter().any(|r| r.partition > 0),
        "the relay never wrote to a new partition: the attack did not happen"
    );
    for (k, copies) in &by_key {
        let mut on: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
        for &(seq, p) in copies {
            on.entry(p).or_default().push(seq);
        }
        for (p, seqs) in &on {
            assert!(
                seqs.windows(2).all(|w| w[0] < w[1]),
                "key {k} on partition {p}: first copies out of order: {seqs:?}"
            );
        }
    }
}

/// Attacks "Per-key order of application" (docs/guarantees.md: "events of a key share a
/// partition") with partitions added to a topic the relay publishes to. The relay's producer
/// partitions by murmur2(key) mod the partition count, so once it sees the new count a key's
/// later events go to another partition than its earlier ones, and a consumer (whose
/// partitions are read independently, possibly by different members) can apply a key's later
/// events before its earlier ones. The docs cover re-partitioning only as delete-and-recreate
/// (docs/operations.md); nothing says that adding partitions breaks per-key order, or how to
/// do it safely (drain the consumers first), and the relay does not notice or warn.
///
/// Schedule: as [`publish_across_a_partition_increase`]. Fails when some key's events are on
/// more than one partition.
#[tokio::test]
#[ignore = "known: partitions added to a topic move keys (murmur2 mod n), as for every Kafka producer; docs/guarantees.md says so; the relay does not notice the change"]
async fn partitions_added_under_a_publishing_relay_keep_each_key_on_one_partition() {
    let (records, n, _) = publish_across_a_partition_increase().await;
    let by_key = first_copies(&records);
    assert_eq!(
        by_key.values().map(Vec::len).sum::<usize>(),
        n,
        "events lost"
    );
    let split: BTreeMap<&String, BTreeSet<i32>> = by_key
        .iter()
        .map(|(k, c)| (k, c.iter().map(|&(_, p)| p).collect::<BTreeSet<i32>>()))
        .filter(|(_, ps)| ps.len() > 1)
        .collect();
    assert!(
        split.is_empty(),
        "keys whose events are on several partitions (a consumer may apply them out of order): {split:?}"
    );
}
