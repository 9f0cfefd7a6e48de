//! Attacks on the changes of 00977cf and 7f20aa7 (held keys by hash, "a group that held
//! nothing takes a whole transaction's holds", replaced logs' held records dead-lettered at
//! `postal consumer reset`, gap-less Kafka producers replaced after a record refused for good):
//! what no test in `held_attack`, `held_keys_edges`, `held_random`, `size_fence_attack` or
//! `recreated_topic` models. Each test names the promise it checks; a break is named `break_…`
//! and ignored as known, with what was measured.
//!
//! Fixtures are `held_attack`'s: a `ledger` handler whose row ids give the order in which
//! entries were applied, and a `broken` table of the event ids it rejects for good.
//!
//! Besides the breaks here: on 7f20aa7 four `dead_letters::` tests
//! (`dead_letters_that_fit_their_topic_alone_are_*` three, `dead_letters_a_raised_limit_takes_*`)
//! and six `replay_attack::` tests fail (timeouts, or a replay ended by "Fatal"), and pass with
//! `enable.gapless.guarantee=false`: see
//! [`one_dead_letter_too_large_for_its_dlq_topic_does_not_stop_that_topic_s_dead_letters`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use postal_consumer::testing::Delivered;
use postal_consumer::FinalFailure;
use postal_integration_tests::kafka::read_all;
use postal_integration_tests::{fresh_postgres_db, services, unique};
use postal_producer::{enqueue_batch, NewEvent};
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, fast_config, kafka_transport, Counting, FailureCounts,
    RunningRelay,
};
use crate::held_attack::{
    applied, broken, build, config, group_bytes, harness_record, held, produce_recs, rec, start,
    tables, until_applied, until_held, within, CONSUMER,
};

/// The bootstrap servers (the protocol harness needs a consumer config, not a broker).
fn bootstrap() -> String {
    std::env::var("KAFKA_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// The stored next offset of `group` on partition 0.
async fn stored_offset(pool: &PgPool, group: &str) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets WHERE group_id = $1 AND partition = 0",
    )
    .bind(group)
    .fetch_optional(pool)
    .await
    .unwrap()
    .flatten()
}

/// What `postal consumer reset` (cli/src/consumer.rs, `store`) writes for partition 0 of
/// `topic`, moved to `offset`, in one transaction: for a replaced log (`replaced`) the offset
/// marks and stops deleted and the old log's held records dead-lettered
/// (`postal_admin::held::dead_letter_replaced_log`); the stored offset and the epoch bumped.
/// Returns how many held records became dead letters.
async fn reset(pool: &PgPool, group: &str, topic: &str, offset: i64, replaced: bool) -> u64 {
    let mut tx = pool.begin().await.unwrap();
    let mut moved = 0;
    if replaced {
        for table in ["postal.offset_marks", "postal.consumer_stops"] {
            sqlx::query(&format!(
                "DELETE FROM {table} WHERE group_id = $1 AND topic = $2"
            ))
            .bind(group)
            .bind(topic)
            .execute(&mut *tx)
            .await
            .unwrap();
        }
        moved = postal_admin::held::dead_letter_replaced_log(&mut tx, group, topic)
            .await
            .unwrap();
    }
    sqlx::query(
        "INSERT INTO postal.consumer_offsets (group_id, topic, partition, next_offset, owner)
         VALUES ($1, $2, 0, $3, 'postal consumer reset')
         ON CONFLICT (group_id, topic, partition) DO UPDATE
            SET next_offset = EXCLUDED.next_offset, epoch = postal.consumer_offsets.epoch + 1,
                owner = EXCLUDED.owner, updated_at = now()",
    )
    .bind(group)
    .bind(topic)
    .bind(offset)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    moved
}

/// Promise (docs/guarantees.md, "What the rule cannot see": "after re-creating a topic on
/// purpose, reset its groups (`postal consumer reset --to earliest`)"; held keys: "nothing is
/// dropped", other keys flow): following that procedure with a key held from the old log,
/// the new log's records are applied (or held, or dead-lettered), none is lost and the
/// partition does not stop for good.
///
/// Scenario (real consumer, real CLI): old log a0 (rejected: key a held), a1, b0; the
/// consumer stops at stored offset 3. The topic is deleted and re-created, and its new log
/// gets 4 records (a10, a11, c0, b1) before the group comes back: the stored offset (3) is
/// not above the new high watermark (4), so neither the consumer nor `postal consumer reset`
/// can tell the log was replaced (`replaced.rs` documents this blind spot and prescribes the
/// reset). The operator runs `postal consumer reset --to earliest --execute`, as documented.
/// The reset is not "recreated" (no stop, no vanished partition, stored ≤ high), so it does
/// not dead-letter the old log's held records: key a stays held with a0, a1 at offsets 0, 1.
/// The new log's a10 at offset 0 belongs to held key a; `hold_in` finds a0's row at offset 0
/// and refuses it as "another event" — for ever: every record behind it on the partition
/// (c0, b1) waits. The error text tells the operator to run `postal consumer reset --to
/// earliest`, which was just run and cannot see the replacement either.
///
/// Measured (2 runs of 2; the first 30 s after the reset; the second 20 s after the reset and
/// 20 s after a second reset run as the error says): c applied [], b applied [0] (b1 not), stored offset 0, key a held with 2
/// records (the old log's), none of the new log's 4 records applied, held or dead-lettered;
/// the consumer logged "cannot hold the record; retrying … offset 0 … already holds another
/// event" 295 times in 30 s (383 in the second run's 40 s) (WARN only: no stop, so `postal status` does not show the topic
/// stopped). Suggested fix: when `hold_in` meets another event's row
/// at a record's offset, record a `postal.consumer_stops` row for the topic (the log *was*
/// replaced: the same proof `impossible` gives), so that `postal status` shows it stopped and
/// the next `postal consumer reset` treats the log as replaced and dead-letters the old held
/// records; or let the reset dead-letter held records whose offsets the new log reuses with
/// other event ids (it can read those offsets from Kafka).
/// Broke at 7f20aa7 as measured above; fixed after it (CHANGELOG, Unreleased).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_topic_the_reset_cannot_see_is_stopped_and_a_reset_frees_it() {
    use crate::recreated_topic::{delete_topic, postal, recreate_topic};
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let (topic, group) = (unique("ha2-unseen"), unique("g"));
    create_topic(&svc.bootstrap, &topic, 1).await;
    let running = start(&db.pool, &topic, config(svc, &group));
    produce_recs(
        svc,
        &db.pool,
        &topic,
        0,
        &[broken("a", 0), rec("a", 1), rec("b", 0)],
    )
    .await;
    until_held(&db.pool, b"a", 2).await;
    until_applied(&db.pool, "b", &[0]).await;
    running.stop().await;
    assert_eq!(stored_offset(&db.pool, &group).await, Some(3));

    delete_topic(&svc.bootstrap, &topic).await;
    recreate_topic(&svc.bootstrap, &topic, 1).await;
    let new = produce_recs(
        svc,
        &db.pool,
        &topic,
        0,
        &[rec("a", 10), rec("a", 11), rec("c", 0), rec("b", 1)],
    )
    .await;
    let (url, boot, g, t) = (
        db.url.clone(),
        svc.bootstrap.clone(),
        group.clone(),
        topic.clone(),
    );
    let (ok, stdout, stderr) = tokio::task::spawn_blocking(move || {
        postal(
            &url,
            &boot,
            &[
                "consumer",
                "reset",
                "--group",
                &g,
                "--topic",
                &t,
                "--to",
                "earliest",
                "--execute",
            ],
        )
    })
    .await
    .unwrap();
    assert!(ok, "reset: {stderr}");

    let running = start(&db.pool, &topic, config(svc, &group));
    let flowed = |wait: Duration| {
        let pool = db.pool.clone();
        async move {
            within(wait, || async {
                applied(&pool, "c").await == [0] && applied(&pool, "b").await == [0, 1]
            })
            .await
        }
    };
    let mut ok_after = None;
    if flowed(Duration::from_secs(20)).await {
        ok_after = Some(1);
    }
    let _ = tokio::time::timeout(Duration::from_secs(30), running.stop()).await;
    // The partition's error says: "`postal consumer reset --to earliest` for the new log
    // dead-letters the old log's held records". Run it again, as told.
    let mut second = String::new();
    if ok_after.is_none() {
        let (url, boot, g, t) = (
            db.url.clone(),
            svc.bootstrap.clone(),
            group.clone(),
            topic.clone(),
        );
        let (ok, stdout, stderr) = tokio::task::spawn_blocking(move || {
            postal(
                &url,
                &boot,
                &[
                    "consumer",
                    "reset",
                    "--group",
                    &g,
                    "--topic",
                    &t,
                    "--to",
                    "earliest",
                    "--execute",
                ],
            )
        })
        .await
        .unwrap();
        assert!(ok, "second reset: {stderr}");
        second = stdout;
        let running = start(&db.pool, &topic, config(svc, &group));
        if flowed(Duration::from_secs(20)).await {
            ok_after = Some(2);
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), running.stop()).await;
    }
    let applied_ids: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM ledger")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let held_ids: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM postal.held_records")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let dead_ids: Vec<Option<Uuid>> =
        sqlx::query_scalar("SELECT event_id FROM postal.dead_letters")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let nowhere: Vec<usize> = (0..new.len())
        .filter(|&i| {
            let id = new[i];
            !applied_ids.contains(&id) && !held_ids.contains(&id) && !dead_ids.contains(&Some(id))
        })
        .collect();
    assert!(
        ok_after.is_some() && nowhere.is_empty(),
        "after the documented reset, and a second one as the partition's error says, the new log did not flow (20 s after each): c applied {:?}, b applied {:?}, a applied {:?}; stored offset {:?}; key a held with {} records; the new log's records (a10, a11, c0, b1) neither applied, held nor dead-lettered: {nowhere:?}; first reset said: {stdout}; second: {second}",
        applied(&db.pool, "c").await,
        applied(&db.pool, "b").await,
        applied(&db.pool, "a").await,
        stored_offset(&db.pool, &group).await,
        held(&db.pool, b"a").await,
    );
}

/// Promise (docs/guarantees.md: a dead letter's copy goes to its topic's dead-letter topic,
/// `ConsumerConfig::dlq_suffix`: "records of `orders` go to `orders.dlq`" by default, to
/// `orders<suffix>` otherwise): the dead letters a replaced log's reset makes of the held
/// records (reason `log_replaced`) go to the same dead-letter topic as the consumer's own.
///
/// Scenario (protocol harness): a consumer with `dlq_suffix = "-dead"` and `HoldKey` holds key
/// a (a0 rejected, a1); it never dead-lettered anything on the topic before (with `HoldKey`
/// a failure holds instead). The topic's log is replaced and reset (the statements `postal
/// consumer reset` runs, [`reset`]). Then, on the new log, a record without a key that the
/// handler rejects is dead-lettered by the consumer itself.
///
/// `dead_letter_replaced_log` picks the dead-letter topic of the consumer's latest dead letter
/// on the topic, or else `topic || '.dlq'` — the default suffix, not the consumer's (the
/// database does not know it). Measured (2 runs of 2): the two `log_replaced` dead letters have
/// `dlq_topic` `<topic>.dlq`, the consumer's own `<topic>-dead`. The consumer's dead-letter
/// publisher sends each copy to its row's `dlq_topic` and creates that topic if missing (as
/// [`a_replaced_log_s_held_events_reach_the_dlq_and_replay_once_in_order`] shows with the
/// default suffix), so these copies would land on a topic the operator's `-dead` readers never
/// look at (not run end to end here). Suggested fix: store the dead-letter topic (or
/// the suffix) with the held key when the consumer holds it (`held_keys.dlq_topic`), or have
/// the consumer fill in the dead-letter topic of rows it did not write (e.g. a NULL
/// `dlq_topic` filled in by the publisher from its config).
/// Broke at 7f20aa7 as measured above; fixed after it (CHANGELOG, Unreleased).
#[tokio::test]
async fn a_replaced_log_s_dead_letters_go_to_the_consumer_s_dlq_topic() {
    let db = fresh_postgres_db().await;
    tables(&db.pool).await;
    let topic = unique("ha2-suffix");
    let group = unique("g");
    let mut c = consumer_config(&bootstrap(), &group, CONSUMER);
    c.final_failure = FinalFailure::HoldKey;
    c.max_attempts = 1;
    c.max_batch = 1;
    c.dlq_suffix = "-dead".into();
    let consumer = build(&db.pool, &topic, c);
    let p = consumer.protocol();
    let (a0, a1, n0) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    for id in [a0, n0] {
        sqlx::query("INSERT INTO broken VALUES ($1)")
            .bind(id)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let own = p.claim(&topic, 0).await.expect("claim");
    for r in [
        harness_record(&topic, 0, a0, "a", 0),
        harness_record(&topic, 1, a1, "a", 1),
    ] {
        assert_eq!(p.deliver(&own, vec![r]).await, Delivered::Done);
    }
    assert_eq!(held(&db.pool, b"a").await, 2);
    assert_eq!(reset(&db.pool, &group, &topic, 0, true).await, 2);
    let own = p.claim(&topic, 0).await.expect("claim after the reset");
    let mut keyless = harness_record(&topic, 0, n0, "x", 0);
    keyless.key = None;
    assert_eq!(p.deliver(&own, vec![keyless]).await, Delivered::Done);
    let rows: Vec<(Option<Uuid>, String, String)> =
        sqlx::query_as("SELECT event_id, reason, dlq_topic FROM postal.dead_letters ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(
        rows[2],
        (Some(n0), "permanent".to_owned(), format!("{topic}-dead")),
        "the consumer's own dead letter"
    );
    let wrong: Vec<&(Option<Uuid>, String, String)> = rows
        .iter()
        .filter(|r| r.2 != format!("{topic}-dead"))
        .collect();
    assert!(
        wrong.is_empty(),
        "dead letters whose copy goes elsewhere than the consumer's dead-letter topic {topic}-dead: {wrong:?}"
    );
}

/// Promise (docs/guarantees.md, held keys: "Storage is bounded per group
/// (`held_bytes_limit`) … A hold that would pass it rolls back"; since 00977cf only "a group
/// that held nothing before the transaction takes all of a transaction's holds"): a group
/// that already holds records never goes past the bound.
///
/// Scenario (protocol harness, throughput mode): `held_bytes_limit` 2000, records of 1,540
/// bytes. a0 is rejected: key a held, the group holds one record (1,540 bytes). The stored offset
/// is moved back to 0 (a replay below a held key: `postal consumer reset`, documented as
/// "each is held once (counted once against the bound)"), and a batch [a0 (the same record
/// again), a1, a2, a3, a4] is delivered. a0 is already held (a copy: `hold_in` inserts nothing
/// and counts nothing), but `hold_or_bound` adds its weight to the transaction's `already`
/// all the same; so `b.bytes = already` (1,540 = 1,540) reads as "the group held nothing
/// before this transaction", and a1..a4 are all admitted past the bound.
///
/// Measured (2 runs of 2): the batch committed (`Done`), group bytes 7,700 (5 records) for a
/// bound of 2,000 (every further record of a batch that starts with copies is admitted, up to `max_batch`).
/// Suggested fix: `hold_in` tells a new row from a copy (`Held::Stored` vs `Held::Copy`), and
/// `hold_or_bound` adds to `c.held_bytes` only the bytes a new row added.
/// Broke at 7f20aa7 as measured above; fixed after it (CHANGELOG, Unreleased).
#[tokio::test]
async fn a_replayed_copy_of_a_held_record_does_not_let_a_batch_past_the_byte_bound() {
    let db = fresh_postgres_db().await;
    tables(&db.pool).await;
    let topic = unique("ha2-copybound");
    let group = unique("g");
    let mut c = consumer_config(&bootstrap(), &group, CONSUMER);
    c.final_failure = FinalFailure::HoldKey;
    c.max_attempts = 1;
    c.max_batch = 10;
    c.held_bytes_limit = 2000;
    let consumer = build(&db.pool, &topic, c);
    let p = consumer.protocol();
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    sqlx::query("INSERT INTO broken VALUES ($1)")
        .bind(ids[0])
        .execute(&db.pool)
        .await
        .unwrap();
    let own = p.claim(&topic, 0).await.expect("claim");
    assert_eq!(
        p.deliver(&own, vec![harness_record(&topic, 0, ids[0], "a", 0)])
            .await,
        Delivered::Done
    );
    let one = group_bytes(&db.pool, &group).await;
    assert!(one > 1000 && one <= 2000, "one record held: {one} bytes");
    reset(&db.pool, &group, &topic, 0, false).await;
    let own = p.claim(&topic, 0).await.expect("claim after the reset");
    let batch: Vec<_> = (0..5)
        .map(|i| harness_record(&topic, i as i64, ids[i], "a", i as i64))
        .collect();
    let d = p.deliver(&own, batch).await;
    let bytes = group_bytes(&db.pool, &group).await;
    let rows = held(&db.pool, b"a").await;
    assert!(
        bytes <= 2000,
        "the group held {one} bytes before the batch, and holds {bytes} bytes ({rows} records) after it, for a bound of 2000 (delivery: {d:?})"
    );
    assert_eq!(
        d,
        Delivered::OverBound,
        "the second record does not fit with the first"
    );
}

/// Random alphanumeric text of `n` characters (lz4 finds next to nothing to compress in it).
fn noise(seed: u64, n: usize) -> String {
    use rand::{distr::Alphanumeric, Rng, SeedableRng};
    rand::rngs::StdRng::seed_from_u64(seed)
        .sample_iter(&Alphanumeric)
        .take(n)
        .map(char::from)
        .collect()
}

/// What one run of [`a_topic_s_oversized_records_do_not_hold_up_other_topics`] saw.
#[derive(Debug)]
#[allow(dead_code)] // Shown whole (Debug) in the test's output and assertion messages.
struct Run {
    /// The longest a `small` event was seen waiting in the outbox (sampled every 50 ms).
    worst_wait: Duration,
    /// From the relay's start until every `large` event was parked.
    parked_in: Duration,
    /// Outcomes `Unavailable` (the relay pauses for each batch with one).
    unavailable: u64,
    held_back: u64,
    small_enqueued: i64,
}

/// One run: `big` events of 20,000 random characters on topic `large` (`max.message.bytes`
/// 4,000: each refused for good by the broker), distinct keys, enqueued first; meanwhile a
/// writer enqueues 10 events on topic `small` every 100 ms (keys k0..k19) until every `large`
/// event is parked, and for at least 3 s. Checks every `small` event on its topic once per
/// key in order, no `large` one; returns what was measured.
async fn oversized_beside_small(big: usize) -> Run {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (small, large) = (unique("ha2-small"), unique("ha2-large"));
    crate::dead_letters::create_topic_with(&svc.bootstrap, &small, &[]).await;
    crate::dead_letters::create_topic_with(
        &svc.bootstrap,
        &large,
        &[("max.message.bytes", "4000")],
    )
    .await;
    if big > 0 {
        let keys: Vec<String> = (0..big).map(|i| format!("big{i}")).collect();
        let mut tx = db.pool.begin().await.unwrap();
        enqueue_batch(
            &mut tx,
            keys.iter()
                .enumerate()
                .map(|(i, k)| {
                    NewEvent::json(large.as_str(), k.as_str(), "big", &noise(i as u64, 20_000))
                        .unwrap()
                })
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let counts = FailureCounts::default();
    let transport = Counting {
        inner: kafka_transport(&svc.bootstrap),
        counts: counts.clone(),
    };
    // The production default backoff (500 ms doubling): what the relay's pauses grow by.
    let config = fast_config().backoff(postal_producer::Backoff {
        base: Duration::from_millis(500),
        max: Duration::from_secs(300),
    });
    let started = Instant::now();
    let relay = RunningRelay::start(&db.pool, transport, config);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (pool, small, stop) = (db.pool.clone(), small.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n: i64 = 0;
            while !stop.load(Ordering::SeqCst) {
                let keys: Vec<String> = (n..n + 10).map(|i| format!("k{}", i % 20)).collect();
                let events: Vec<NewEvent> = keys
                    .iter()
                    .zip(n..)
                    .map(|(k, i)| NewEvent::json(small.as_str(), k.as_str(), "small", &i).unwrap())
                    .collect();
                let mut tx = pool.begin().await.unwrap();
                enqueue_batch(&mut tx, events).await.unwrap();
                tx.commit().await.unwrap();
                n += 10;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            n
        })
    };
    let mut worst_wait = Duration::ZERO;
    let mut parked_in = None;
    let deadline = started + Duration::from_secs(90);
    loop {
        let (wait_ms, big_left): (Option<f64>, i64) = sqlx::query_as(
            "SELECT (SELECT extract(epoch FROM clock_timestamp() - min(created_at)) * 1000
                     FROM postal.outbox WHERE topic = $1 AND status = 'pending')::float8,
                    (SELECT count(*) FROM postal.outbox WHERE topic = $2 AND status <> 'failed')",
        )
        .bind(&small)
        .bind(&large)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if let Some(ms) = wait_ms {
            worst_wait = worst_wait.max(Duration::from_millis(ms as u64));
        }
        if big_left == 0 && parked_in.is_none() {
            parked_in = Some(started.elapsed());
        }
        if parked_in.is_some() && started.elapsed() >= Duration::from_secs(3) {
            stop.store(true, Ordering::SeqCst);
        }
        if (stop.load(Ordering::SeqCst) && wait_ms.is_none()) || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let small_enqueued = writer.await.unwrap();
    // The last events the writer enqueued.
    assert!(
        within(Duration::from_secs(60), || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM postal.outbox WHERE topic = $1 AND status = 'pending'",
            )
            .bind(&small)
            .fetch_one(&db.pool)
            .await
            .unwrap()
                == 0
        })
        .await,
        "small events left pending"
    );
    let stats = relay.stop().await;
    let on_small = read_all(
        &svc.bootstrap,
        &small,
        small_enqueued as usize,
        Duration::from_secs(20),
    )
    .await;
    // Per key, the first copy of each event in the order written: 0, 20, 40, … for k0.
    let mut last: std::collections::HashMap<String, i64> = Default::default();
    let mut seen = std::collections::HashSet::new();
    for r in &on_small {
        let id = r.header("ce_id").unwrap_or_default().to_owned();
        if !seen.insert(id) {
            continue;
        }
        let n: i64 = serde_json::from_slice(&r.payload).unwrap();
        let key = r.key.clone().unwrap_or_default();
        let prev = last.insert(key.clone(), n);
        assert!(
            prev.is_none_or(|p| p < n),
            "key {key}: {n} after {prev:?} on topic small"
        );
    }
    assert_eq!(
        seen.len() as i64,
        small_enqueued,
        "every small event on its topic"
    );
    let on_large = read_all(&svc.bootstrap, &large, 0, Duration::from_secs(2)).await;
    assert!(on_large.is_empty(), "nothing over the limit written");
    Run {
        worst_wait,
        parked_in: parked_in.unwrap_or(Duration::MAX),
        unavailable: counts.unavailable.load(Ordering::Relaxed),
        held_back: stats.held_back,
        small_enqueued,
    }
}

/// Compares a control run (no oversized event) with a run of `big` oversized events (see
/// [`oversized_beside_small`]); fails if they were not all parked within 30 s, or (with
/// `wait`) if a `small` event waited 3 s longer than in the control run.
async fn oversized_against_control(big: usize, wait: bool) {
    let control = oversized_beside_small(0).await;
    let attacked = oversized_beside_small(big).await;
    eprintln!("control: {control:?}\nattacked: {attacked:?}");
    assert!(
        attacked.parked_in < Duration::from_secs(30),
        "the {big} oversized events were not all parked within 30 s: {attacked:?} (control: {control:?})"
    );
    assert!(
        !wait || attacked.worst_wait < control.worst_wait + Duration::from_secs(3),
        "a small event waited {:?} beside the oversized ones ({:?} without them): {attacked:?}",
        attacked.worst_wait,
        control.worst_wait
    );
}

/// Promise (docs/relay.md, failures: "A permanent failure (record too large for the broker,
/// invalid topic) parks the event at once"; other topics' events are not its business): since
/// 7f20aa7 every record the broker refuses for good stops the whole gap-less producer, which
/// is replaced; a few such records must still be parked promptly and not hold up other
/// topics for long.
///
/// Scenario: a control run (no oversized event) and a run with 40 oversized events on topic
/// `large` (`max.message.bytes` 4,000, known to the relay from the start; 20,000 random
/// characters each, distinct keys) while topic `small` gets 100 events a second; the
/// production default backoff. Compared: the longest any `small` event waited in the outbox,
/// and when the 40 were all parked. Checked: the 40 parked within 30 s; in both runs every
/// `small` event on its topic, each key in order, nothing written to `large`. Held (2 runs of
/// 2), but the waits grow already: small events waited at most 1.08 s and 2.84 s (61 ms and
/// 112 ms without the oversized ones), the 40 parked in 2.6 s and 3.9 s; so the wait is only
/// reported here, and checked in [`many_oversized_records_on_one_topic_do_not_stall_every_topic`]
/// (400).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_few_oversized_records_on_one_topic_do_not_hold_up_other_topics() {
    oversized_against_control(40, false).await;
}

/// Promise: as [`a_few_oversized_records_on_one_topic_do_not_hold_up_other_topics`] ("parks
/// the event at once"; other topics flow), with 400 oversized events (a producer bug, a
/// payload that grew, a topic limit lowered).
///
/// Mechanism: an event over its topic's known limit goes out "alone in its key"; the broker
/// refuses it (`MESSAGE_TOO_LARGE`), and with `enable.gapless.guarantee` librdkafka stops the
/// whole producer (fatal) and purges its queue — every topic's queued records come back held
/// back. The refusal itself does not replace the producer (`needs_reset` does not list
/// `MessageSizeTooLarge`): the next batch's first `send` meets the fatal producer, replaces it
/// and reports `Unavailable`, which pauses the whole relay (200 ms up to 10 s, growing with
/// the streak). So each round parks a few oversized events and costs every topic a pause
/// and a purge.
///
/// Measured (2 runs of 2): small events waited up to 13.8 s both times (145 ms and 50 ms
/// without the oversized ones); the 400 were parked only after 32.9 s and 29.5 s; 83 and 86
/// `Unavailable` outcomes ("destination unavailable; pausing the relay … Fatal"), about 86,300
/// records held back. With `enable.gapless.guarantee=false` (a local experiment, not
/// committed; 1 run of 1) the 400 were parked in 0.4 s, small events waited at most 349 ms,
/// no pause. It grows with the number
/// of oversized events. Suggested fix: send a record over its topic's known limit through a
/// second producer without the gap-less guarantee (its key's later records are fenced
/// anyway: "alone"), or park it without sending when even its compressed size cannot fit;
/// and on a gap-less fatal stop caused by another record's refusal, replace the producer at
/// once from the refused record's report and report the purged records as held back, not as
/// an outage (no relay pause).
/// Broke at 7f20aa7 as measured above; fixed after it (CHANGELOG, Unreleased).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_oversized_records_on_one_topic_do_not_stall_every_topic() {
    oversized_against_control(400, true).await;
}

/// Promise (00977cf, `dead_letter_replaced_log`: "kept as dead letters, nothing is lost
/// (`postal dead-letters replay` applies them after the new log's)"; docs/guarantees.md: a
/// dead letter's copy goes to the `.dlq` topic): after a topic with a held key is re-created
/// and reset as documented, the old log's held events are dead letters whose copies reach the
/// `.dlq` topic in key order, and replaying them applies each exactly once, in key order, after
/// the new log's events of the key.
///
/// Scenario (real consumer, CLI, Kafka): old log a0 (rejected), a1, a2, b0, b1: key a held
/// with 3 records. The topic is deleted and re-created with 2 records (a10, b10): the consumer
/// stops the topic (stored 5 above the new end 2). a0 is fixed; `postal consumer reset --to
/// earliest --execute` (the plan names the 3 held records), the consumer applies the new log
/// and publishes the 3 dead letters; `postal dead-letters replay --consumer …` replays them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_log_s_held_events_reach_the_dlq_and_replay_once_in_order() {
    use crate::recreated_topic::{delete_topic, postal, recreate_topic};
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let (topic, group) = (unique("ha2-replay"), unique("g"));
    create_topic(&svc.bootstrap, &topic, 1).await;
    let running = start(&db.pool, &topic, config(svc, &group));
    let old = produce_recs(
        svc,
        &db.pool,
        &topic,
        0,
        &[
            broken("a", 0),
            rec("a", 1),
            rec("a", 2),
            rec("b", 0),
            rec("b", 1),
        ],
    )
    .await;
    until_held(&db.pool, b"a", 3).await;
    until_applied(&db.pool, "b", &[0, 1]).await;
    running.stop().await;
    delete_topic(&svc.bootstrap, &topic).await;
    recreate_topic(&svc.bootstrap, &topic, 1).await;
    produce_recs(svc, &db.pool, &topic, 0, &[rec("a", 10), rec("b", 10)]).await;
    let running = start(&db.pool, &topic, config(svc, &group));
    postal_integration_tests::wait::until(
        Duration::from_secs(60),
        "the consumer to stop the re-created topic",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM postal.consumer_stops WHERE group_id = $1)",
            )
            .bind(&group)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        },
    )
    .await;
    running.stop().await;
    sqlx::query("DELETE FROM broken WHERE event_id = $1")
        .bind(old[0])
        .execute(&db.pool)
        .await
        .unwrap();
    let cli = |args: Vec<String>| {
        let (url, boot) = (db.url.clone(), svc.bootstrap.clone());
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            postal(&url, &boot, &args)
        })
    };
    let (ok, stdout, stderr) = cli([
        "consumer",
        "reset",
        "--group",
        &group,
        "--topic",
        &topic,
        "--to",
        "earliest",
        "--execute",
    ]
    .map(String::from)
    .to_vec())
    .await
    .unwrap();
    assert!(ok, "reset: {stderr}");
    assert!(
        stdout.contains("3 held records of 1 held keys"),
        "the plan names the held records: {stdout}"
    );
    let running = start(&db.pool, &topic, config(svc, &group));
    until_applied(&db.pool, "a", &[10]).await;
    until_applied(&db.pool, "b", &[0, 1, 10]).await;
    let dlq = format!("{topic}.dlq");
    let copies = read_all(&svc.bootstrap, &dlq, 3, Duration::from_secs(30)).await;
    let copied: Vec<String> = copies
        .iter()
        .map(|r| r.header("ce_id").unwrap_or("?").to_owned())
        .collect();
    let want: Vec<String> = old[..3].iter().map(Uuid::to_string).collect();
    assert_eq!(
        copied, want,
        "the old log's held a0, a1, a2 on {dlq}, in key order"
    );
    let (ok, _, stderr) = cli(["dead-letters", "replay", "--consumer", CONSUMER]
        .map(String::from)
        .to_vec())
    .await
    .unwrap();
    assert!(ok, "replay: {stderr}");
    until_applied(&db.pool, "a", &[10, 0, 1, 2]).await;
    let twice: i64 = sqlx::query_scalar("SELECT count(*) - count(DISTINCT event_id) FROM ledger")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    running.stop().await;
    assert_eq!(twice, 0, "nothing applied twice");
    assert_eq!(applied(&db.pool, "a").await, [10, 0, 1, 2]);
    assert_eq!(applied(&db.pool, "b").await, [0, 1, 10]);
    assert_eq!(
        group_bytes(&db.pool, &group).await,
        0,
        "nothing counted as held"
    );
}

/// One run of [`break_a_topic_with_a_tiny_limit_slows_every_topic`]: with `tiny`, the relay
/// first publishes one event to a topic whose `max.message.bytes` is 1,000 (so the transport
/// lowers its producer's `batch.size` for every topic, `ProducerSlot::fit_batches`); then
/// 20,000 events of about 1 kB (50 keys) are enqueued on another topic (4 partitions, default
/// limit). Returns how long they took to leave the outbox; checks them all on their topic,
/// each key in order.
async fn bulk_after(tiny: bool) -> Duration {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (bulk, small) = (unique("ha2-bulk"), unique("ha2-tiny"));
    create_topic(&svc.bootstrap, &bulk, 4).await;
    crate::dead_letters::create_topic_with(
        &svc.bootstrap,
        &small,
        &[("max.message.bytes", "1000")],
    )
    .await;
    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let first = if tiny { small.as_str() } else { bulk.as_str() };
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(
        &mut tx,
        vec![NewEvent::json(first, "first", "first", &0).unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let pending = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox WHERE status = 'pending'")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert!(
        within(Duration::from_secs(30), || async {
            pending(db.pool.clone()).await == 0
        })
        .await,
        "the first event published"
    );
    let pad = noise(3, 1000);
    let keys: Vec<String> = (0..50).map(|k| format!("k{k}")).collect();
    let events: Vec<NewEvent> = (0..20_000i64)
        .map(|n| {
            NewEvent::json(
                bulk.as_str(),
                keys[(n % 50) as usize].as_str(),
                "bulk",
                &serde_json::json!({ "n": n, "pad": pad }),
            )
            .unwrap()
        })
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    let started = Instant::now();
    assert!(
        within(Duration::from_secs(300), || async {
            pending(db.pool.clone()).await == 0
        })
        .await,
        "20,000 events not published in 300 s"
    );
    let took = started.elapsed();
    relay.stop().await;
    let records = read_all(&svc.bootstrap, &bulk, 20_000, Duration::from_secs(60)).await;
    let mut last: std::collections::HashMap<String, i64> = Default::default();
    let mut seen = std::collections::HashSet::new();
    for r in &records {
        if r.header("ce_type") != Some("bulk")
            || !seen.insert(r.header("ce_id").unwrap_or_default().to_owned())
        {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        let n = v["n"].as_i64().unwrap();
        let key = r.key.clone().unwrap_or_default();
        let prev = last.insert(key.clone(), n);
        assert!(prev.is_none_or(|p| p < n), "key {key}: {n} after {prev:?}");
    }
    assert_eq!(seen.len(), 20_000, "every bulk event on its topic once");
    took
}

/// Promise (7f20aa7, `ProducerSlot::fit_batches`: `batch.size` is lowered for every topic once
/// a topic with a lower `max.message.bytes` is met, so that records that fit alone are never
/// refused together): the other topics' events are all published, each key in order, and
/// their throughput is not cut by more than half (a topic with a small limit is the set-up's
/// business, not every topic's).
///
/// Scenario: two runs of [`bulk_after`]: a control, and one where the relay first met a topic
/// whose limit is 1,000 bytes (its producer's batches then hold at most 862 bytes, so each
/// ~1 kB record of every other topic goes in a produce batch of its own). Fails if the 20,000
/// events take more than twice the control's time plus 1 s, or if any is lost or out of its
/// key's order.
///
/// Measured with 5,000 events (2 runs): 1.39 s against 236 ms, 4.0 s against 612 ms (about 6
/// times slower on every topic, for the producer's life: `batch.size` is never raised again);
/// with 20,000 events, this test (2 runs of 2): 8.0 s against 1.88 s, 9.2 s against 0.77 s
/// (4 to 12 times slower). Order and completeness held in all four runs. Suggested fix: keep
/// `batch.size` per topic out of the producer (a second producer for topics whose limit is
/// below the producer's batch size), or lower it only to the topic's limit when records of
/// that topic are in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known: after one topic of max.message.bytes 1,000, 20,000 events of 1 kB on another topic took 8.0 s and 9.2 s against 1.9 s and 0.8 s (2 runs of 2)"]
async fn break_a_topic_with_a_tiny_limit_slows_every_topic() {
    let control = bulk_after(false).await;
    let lowered = bulk_after(true).await;
    eprintln!("20,000 events of 1 kB: {control:?} (control), {lowered:?} after a topic of max.message.bytes 1,000");
    assert!(
        lowered < control * 2 + Duration::from_secs(1),
        "20,000 events of 1 kB took {lowered:?} after the relay met a topic whose max.message.bytes is 1,000 ({control:?} without)"
    );
}

/// Promise (docs/consumer.md, `dead_letter::Publisher`: a copy too large for its `.dlq` topic
/// is cut — value, then headers, then key — until the broker takes it; refused even so, it is
/// marked unpublishable and passed over, "so that it never holds back the later ones"): one
/// dead letter too large for its `.dlq` topic is published cut, and its topic's later dead
/// letters and another topic's are published.
///
/// Scenario: dead letters of the running consumer's name, as the consumer writes them: one of
/// topic A with a 10 kB incompressible value, whose `A.dlq` takes at most 2,000 bytes, then 10
/// small ones of topic B (`B.dlq`, default limit) and 5 small ones of A. A consumer of a third
/// topic runs (its dead-letter publisher publishes every dead letter of its consumer name);
/// 60 s for all 16 to be published (the large one cut) or marked.
///
/// Mechanism (since 00977cf the dead-letter producer is gap-less, `postal_shared::
/// kafka_producer`): the large copy is refused for its size, which stops the whole producer
/// (fatal); its next, cut, try fails "Fatal" (not a size refusal), so the loop that cuts it
/// further ends as a passing failure: the topic cools, the producer is replaced at the end of
/// the pass, and the next pass starts again from the first cut — refused, fatal, and so on.
/// The large dead letter is never cut far enough nor marked, and A's later ones wait behind
/// it (the pass skips a topic that failed). The existing `dead_letters::
/// dead_letters_that_fit_their_topic_alone_are_*`, `dead_letters_a_raised_limit_takes_*` and
/// six `replay_attack::` tests fail on this commit the same way (the admin replay's producer is
/// gap-less too: a refused record ends the replay with "Fatal" for every key after it).
///
/// Measured (2 runs of 2): after 60 s topic A: 0 of 6 published, 0 marked; topic B: 10 of 10
/// published; 13 lines "the dead-letter producer failed for good; replaced" and 13 "publishing
/// dead letters to their .dlq topic failed … Fatal". With the default changed back to
/// `enable.gapless.guarantee=false` in `postal_shared::kafka_producer` (a local experiment, not
/// committed), this test and the six `replay_attack::` tests passed (1 run of 1: 7 of 7 in
/// 10 s), as did the four `dead_letters::` ones (4 of 4 in 24 s). Suggested fix: the dead-letter publisher
/// and the replay send a key's records one at a time and wait for each outcome, so gap-less
/// adds nothing there: build their producers with `enable.gapless.guarantee=false` (allowed
/// only for such callers), or check `fatal_error()` after every refusal and replace the
/// producer before the next send.
/// Broke at 7f20aa7 as measured above; fixed after it (CHANGELOG, Unreleased).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dead_letter_too_large_for_its_dlq_topic_does_not_stop_that_topic_s_dead_letters() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    tables(&db.pool).await;
    let (a, b, other, group) = (
        unique("ha2-dlq-a"),
        unique("ha2-dlq-b"),
        unique("ha2-dlq-other"),
        unique("g"),
    );
    crate::dead_letters::create_topic_with(
        &svc.bootstrap,
        &format!("{a}.dlq"),
        &[("max.message.bytes", "2000")],
    )
    .await;
    crate::dead_letters::create_topic_with(&svc.bootstrap, &format!("{b}.dlq"), &[]).await;
    create_topic(&svc.bootstrap, &other, 1).await;
    let insert = |topic: String, key: String, value: Vec<u8>| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO postal.dead_letters (consumer_name, group_id, topic, partition,
                     kafka_offset, event_id, event_type, record_key, payload, reason, error,
                     attempts, dlq_topic)
                 VALUES ($1, 'g', $2, 0, 0, gen_random_uuid(), 'entry', $3, $4, 'permanent',
                         'rejected', 1, $2 || '.dlq')",
            )
            .bind(CONSUMER)
            .bind(&topic)
            .bind(key.into_bytes())
            .bind(value)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    insert(a.clone(), "big".into(), noise(11, 10_000).into_bytes()).await;
    for i in 0..10 {
        insert(b.clone(), format!("b{i}"), b"{\"n\":1}".to_vec()).await;
    }
    for i in 0..5 {
        insert(a.clone(), format!("a{i}"), b"{\"n\":1}".to_vec()).await;
    }
    let running = start(&db.pool, &other, config(svc, &group));
    let counts = |pool: PgPool, a: String, b: String| async move {
        sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT count(*) FILTER (WHERE published_at IS NOT NULL AND topic = $1),
                    count(*) FILTER (WHERE published_at IS NOT NULL AND topic = $2),
                    count(*) FILTER (WHERE dlq_unpublishable IS NOT NULL)
             FROM postal.dead_letters",
        )
        .bind(a)
        .bind(b)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let done = within(Duration::from_secs(60), || {
        let f = counts(db.pool.clone(), a.clone(), b.clone());
        async move {
            let (pa, pb, marked) = f.await;
            pb == 10 && pa + marked == 6
        }
    })
    .await;
    let (pa, pb, marked) = counts(db.pool.clone(), a.clone(), b.clone()).await;
    let _ = tokio::time::timeout(Duration::from_secs(30), running.stop()).await;
    let on_b = read_all(
        &svc.bootstrap,
        &format!("{b}.dlq"),
        pb as usize,
        Duration::from_secs(20),
    )
    .await;
    assert!(
        done,
        "after 60 s: of topic A's 6 dead letters {pa} published and {marked} marked unpublishable (the large one should be published cut or marked, the 5 small ones published); of topic B's 10, {pb} published ({} copies on B.dlq)",
        on_b.len()
    );
}
