//! Pausing and resuming (`postal pause`, `postal resume`; docs/operations.md, "Pausing"): a
//! pause takes effect within one batch — the batches in flight when it commits finish, nothing
//! later of what it pauses is published or applied — outlasts restarts and rebalances, and
//! loses nothing: once resumed, everything is delivered once, in each key's order.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use postal_admin::audit::Operator;
use postal_admin::pauses::{self, Scope};
use postal_integration_tests::{kafka, services, unique, wait};
use postal_producer::testing::{claim, lease};
use postal_producer::{enqueue, enqueue_batch, NewEvent, TopicFilter};
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects_table, fast_config, kafka_transport, produce, RawRecord,
    RunningConsumer, RunningRelay,
};

const WAIT: Duration = Duration::from_secs(60);

/// Pauses `scope` as `postal pause` does: the row and its audit row in one transaction, then
/// (relay) the wait for the claims in flight.
async fn pause(pool: &PgPool, scope: &Scope) {
    let mut tx = pool.begin().await.unwrap();
    let new = pauses::pause(&mut tx, &Operator::cli("test"), scope, Some("test"), WAIT)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(new, "{} was paused already", scope.describe());
    if scope.side() == pauses::Side::Relay {
        pauses::wait_for_relay_claims(pool, scope, WAIT)
            .await
            .unwrap();
    }
}

async fn resume(pool: &PgPool, scope: &Scope) {
    let mut tx = pool.begin().await.unwrap();
    assert!(pauses::resume(&mut tx, &Operator::cli("test"), scope)
        .await
        .unwrap());
    tx.commit().await.unwrap();
}

/// The sum of `topic`'s high watermarks: every record the broker acknowledged on it.
async fn records_in(bootstrap: &str, topic: &str) -> i64 {
    let (bootstrap, topic) = (bootstrap.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let parts = kafka::partitions(&bootstrap, &topic, WAIT);
        let client: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("log_level", "0")
            .create()
            .unwrap();
        // A topic the relay just created may answer "not leader" for a moment: asked again.
        let deadline = std::time::Instant::now() + WAIT;
        parts
            .iter()
            .map(|p| loop {
                match client.fetch_watermarks(&topic, *p, Duration::from_secs(10)) {
                    Ok((_, high)) => break high,
                    Err(e) if std::time::Instant::now() < deadline => {
                        eprintln!("watermarks of {topic}/{p}: {e}; asking again");
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    Err(e) => panic!("watermarks of {topic}/{p}: {e}"),
                }
            })
            .sum()
    })
    .await
    .unwrap()
}

/// Whether some session of this test's database waits for an advisory lock (a pause waiting
/// for work in flight).
async fn a_pause_waits(pool: &PgPool) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks
                        WHERE locktype = 'advisory' AND NOT granted
                          AND database = (SELECT oid FROM pg_database
                                          WHERE datname = current_database()))",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Enqueues `per_round` events on each of `topics` per round (keys `k0`…`k9`, `n` counting up
/// per topic) until `stop`; returns how many per topic.
fn writer(
    pool: PgPool,
    topics: Vec<String>,
    per_round: i64,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<HashMap<String, i64>> {
    tokio::spawn(async move {
        let mut written: HashMap<String, i64> = HashMap::new();
        while !stop.load(Ordering::Relaxed) {
            let mut conn = pool.acquire().await.unwrap();
            let mut events = Vec::new();
            for t in &topics {
                let n0 = *written.get(t).unwrap_or(&0);
                for n in n0..n0 + per_round {
                    events.push(
                        NewEvent::json(
                            t.as_str(),
                            format!("k{}", n % 10),
                            "job",
                            &serde_json::json!({ "n": n }),
                        )
                        .unwrap(),
                    );
                }
                written.insert(t.clone(), n0 + per_round);
            }
            enqueue_batch(&mut conn, events).await.unwrap();
            drop(conn);
            // Pacing, not synchronization: a steady stream while the test acts.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        written
    })
}

/// Per key, the `n`s of `records` in log order (a key lives on one partition).
fn by_key(records: &[kafka::Record]) -> BTreeMap<String, Vec<i64>> {
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in records {
        let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        out.entry(r.key.clone().unwrap_or_default())
            .or_default()
            .push(v["n"].as_i64().unwrap());
    }
    out
}

/// Guarantee (relay, real Kafka): once `postal pause relay --topic A` returns, nothing more of
/// A reaches Kafka — the batches claimed before the pause were acknowledged before it returned
/// — while writers keep enqueueing to A and B and B keeps flowing; the pause outlasts a relay
/// restart; A's backlog stays in the outbox; after the resume every event of A is in Kafka,
/// each key's events first published in order.
#[tokio::test]
async fn a_relay_pause_takes_effect_within_one_batch_outlasts_a_restart_and_loses_nothing() {
    relay_pause(false).await;
}

/// Guarantee: the same with a WAL relay (`--read-from wal`): its stream leaves a paused
/// topic's rows pending, `postal pause` returns only once the chunks the stream took before it
/// ended, and after the resume the sweep publishes the paused backlog in each key's order.
/// Before, the stream published paused topics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_relay_pause_takes_effect_within_one_batch_outlasts_a_restart_and_loses_nothing() {
    relay_pause(true).await;
}

async fn relay_pause(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (a, b) = (unique("pause-a"), unique("pause-b"));
    let slot = if wal {
        Some(crate::wal_relay::Slot::create(&db).await)
    } else {
        None
    };
    // Small batches, several in flight: "within one batch" has something to mean.
    let config = || {
        slot.as_ref()
            .map_or_else(fast_config, |s| s.config())
            .batch_size(20)
            .lanes(2)
            .max_in_flight_batches(4)
    };
    let mut relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), config());
    let stop = Arc::new(AtomicBool::new(false));
    let writing = writer(
        db.pool.clone(),
        vec![a.clone(), b.clone()],
        10,
        stop.clone(),
    );
    wait::until(WAIT, "A flows", || async {
        records_in(&svc.bootstrap, &a).await >= 200
    })
    .await;

    let scope = Scope::relay(None, Some(&a)).unwrap();
    pause(&db.pool, &scope).await;
    let a_at_pause = records_in(&svc.bootstrap, &a).await;
    let b_at_pause = records_in(&svc.bootstrap, &b).await;
    // B flows on: many batches of B after the pause, while A gets enqueued too.
    wait::until(WAIT, "B flows on after the pause", || async {
        records_in(&svc.bootstrap, &b).await >= b_at_pause + 300
    })
    .await;
    assert_eq!(
        records_in(&svc.bootstrap, &a).await,
        a_at_pause,
        "records of the paused topic reached Kafka after the pause returned"
    );

    // A restart: the new relay honours the pause too.
    relay.stop().await;
    relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), config());
    let b_now = records_in(&svc.bootstrap, &b).await;
    wait::until(WAIT, "B flows after the restart", || async {
        records_in(&svc.bootstrap, &b).await >= b_now + 300
    })
    .await;
    assert_eq!(
        records_in(&svc.bootstrap, &a).await,
        a_at_pause,
        "a restarted relay published the paused topic"
    );
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE topic = $1")
        .bind(&a)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        waiting > 0,
        "the paused topic's backlog stays in the outbox"
    );

    stop.store(true, Ordering::Relaxed);
    let written = writing.await.unwrap();
    resume(&db.pool, &scope).await;
    wait::until(WAIT, "the outbox drains after the resume", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    for topic in [&a, &b] {
        let total = written[topic];
        let records = kafka::read_all(&svc.bootstrap, topic, total as usize, WAIT).await;
        assert_eq!(
            kafka::event_ids(&records).len() as i64,
            total,
            "{topic}: every event published"
        );
        // A batch the relay gave up in flight (a lease lapsing on a starved machine) is
        // published again: copies are Postal's at-least-once to Kafka (consumers drop them);
        // order is judged by each event's first appearance.
        if records.len() as i64 > total {
            eprintln!(
                "{topic}: {} copies of events published again",
                records.len() as i64 - total
            );
        }
        for (key, ns) in by_key(&records) {
            let mut seen = std::collections::HashSet::new();
            let first: Vec<i64> = ns.into_iter().filter(|n| seen.insert(*n)).collect();
            assert!(
                first.windows(2).all(|w| w[0] < w[1]),
                "{topic} key {key}: first published out of order: {first:?}"
            );
        }
    }
}

/// Guarantee (the claim): a claim takes nothing that a pause in force covers — a paused topic
/// of its relay group or of every relay group, or its whole group — and is unaffected by a
/// pause of another relay group; a resumed topic is claimed again.
#[tokio::test]
async fn a_claim_takes_nothing_a_pause_covers() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let pool = &db.pool;
    let (a, b) = (unique("claim-a"), unique("claim-b"));
    for t in [&a, &b] {
        let mut conn = pool.acquire().await.unwrap();
        enqueue(
            &mut conn,
            NewEvent::json(t.as_str(), "k", "job", &serde_json::json!({"n": 1})).unwrap(),
        )
        .await
        .unwrap();
    }
    let relay = Uuid::now_v7();
    let lease_for = Duration::from_secs(30);
    let held = lease::heartbeat(pool, lease::DEFAULT_GROUP, relay, "", lease_for, &[], true)
        .await
        .unwrap();
    assert_eq!(held.held.len(), 256);
    let topics_claimed = |filter: TopicFilter| async move {
        match claim::claim(
            pool,
            relay,
            &claim::all_partitions(),
            100,
            lease_for,
            true,
            &filter,
        )
        .await
        .unwrap()
        {
            None => Vec::new(),
            Some(c) => {
                let mut t: Vec<String> = c.events().iter().map(|e| e.topic.clone()).collect();
                c.release().await.unwrap();
                t.sort();
                t
            }
        }
    };
    let mut both = vec![a.clone(), b.clone()];
    both.sort();
    assert_eq!(topics_claimed(TopicFilter::All).await, both);

    let a_here = Scope::relay(Some(lease::DEFAULT_GROUP), Some(&a)).unwrap();
    pause(pool, &a_here).await;
    assert_eq!(topics_claimed(TopicFilter::All).await, vec![b.clone()]);
    assert_eq!(
        topics_claimed(TopicFilter::Only(vec![a.clone()])).await,
        Vec::<String>::new()
    );
    assert_eq!(
        topics_claimed(TopicFilter::Except(vec![b.clone()])).await,
        Vec::<String>::new()
    );
    resume(pool, &a_here).await;

    let a_elsewhere = Scope::relay(Some("reports"), Some(&a)).unwrap();
    pause(pool, &a_elsewhere).await;
    assert_eq!(topics_claimed(TopicFilter::All).await, both);
    resume(pool, &a_elsewhere).await;

    let a_everywhere = Scope::relay(None, Some(&a)).unwrap();
    pause(pool, &a_everywhere).await;
    assert_eq!(topics_claimed(TopicFilter::All).await, vec![b.clone()]);
    resume(pool, &a_everywhere).await;

    let group = Scope::relay(Some(lease::DEFAULT_GROUP), None).unwrap();
    pause(pool, &group).await;
    assert_eq!(topics_claimed(TopicFilter::All).await, Vec::<String>::new());
    resume(pool, &group).await;
    assert_eq!(topics_claimed(TopicFilter::All).await, both);
}

/// Guarantee (the relay's "within one batch"): `postal pause relay` returns only once the
/// batch claimed before it has ended — it waits while that claim is open — and a claim after
/// it takes nothing of the topic.
#[tokio::test]
async fn a_relay_pause_returns_only_after_the_batch_claimed_before_it_ended() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let pool = db.pool.clone();
    let a = unique("inflight");
    let mut conn = pool.acquire().await.unwrap();
    for n in 0..3 {
        enqueue(
            &mut conn,
            NewEvent::json(a.as_str(), "k", "job", &serde_json::json!({"n": n})).unwrap(),
        )
        .await
        .unwrap();
    }
    drop(conn);
    let relay = Uuid::now_v7();
    let lease_for = Duration::from_secs(30);
    lease::heartbeat(&pool, lease::DEFAULT_GROUP, relay, "", lease_for, &[], true)
        .await
        .unwrap();
    let in_flight = claim::claim(
        &pool,
        relay,
        &claim::all_partitions(),
        1,
        lease_for,
        true,
        &TopicFilter::All,
    )
    .await
    .unwrap()
    .expect("a batch in flight");
    let scope = Scope::relay(None, Some(&a)).unwrap();
    let pausing = tokio::spawn({
        let (pool, scope) = (pool.clone(), scope.clone());
        async move { pause(&pool, &scope).await }
    });
    wait::until(WAIT, "the pause waits for the claim", || async {
        a_pause_waits(&pool).await
    })
    .await;
    assert!(
        !pausing.is_finished(),
        "the pause returned with a batch in flight"
    );
    // The batch is acknowledged and recorded: the pause returns.
    let batch = in_flight.events().to_vec();
    let seqs: Vec<i64> = batch.iter().map(|e| e.seq).collect();
    in_flight.complete(&batch, &seqs, &[]).await.unwrap();
    tokio::time::timeout(WAIT, pausing).await.unwrap().unwrap();
    assert!(claim::claim(
        &pool,
        relay,
        &claim::all_partitions(),
        100,
        lease_for,
        true,
        &TopicFilter::All
    )
    .await
    .unwrap()
    .is_none());
}

/// Guarantee: a pause of every relay group, while it waits for one group's claim in flight,
/// does not stop the other groups: their claims' partition locks and a WAL relay's stream lock
/// (256) are free, so they go on publishing what the pause does not cover meanwhile.
#[tokio::test]
async fn a_pause_of_every_group_stops_no_group_while_it_waits_for_another() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let pool = db.pool.clone();
    let lease_for = Duration::from_secs(30);
    // "a-free" comes before "z-busy": the pause's wait reaches it first.
    for group in ["a-free", "z-busy"] {
        lease::heartbeat(&pool, group, Uuid::now_v7(), "", lease_for, &[], true)
            .await
            .unwrap();
    }
    // A claim of "z-busy" in flight: its partition's lock held shared.
    let mut busy = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock_shared(hashtext('postal.relay:z-busy'), 7)::text")
        .execute(&mut *busy)
        .await
        .unwrap();
    let scope = Scope::relay(None, None).unwrap();
    let pausing = tokio::spawn({
        let (pool, scope) = (pool.clone(), scope.clone());
        async move { pause(&pool, &scope).await }
    });
    wait::until(WAIT, "the pause waits for z-busy's claim", || async {
        a_pause_waits(&pool).await
    })
    .await;
    let mut probe = pool.begin().await.unwrap();
    let free: (bool, bool) = sqlx::query_as(
        "SELECT pg_try_advisory_xact_lock_shared(hashtext('postal.relay:a-free'), 3),
                pg_try_advisory_xact_lock_shared(hashtext('postal.relay:a-free'), 256)",
    )
    .fetch_one(&mut *probe)
    .await
    .unwrap();
    probe.rollback().await.unwrap();
    assert_eq!(
        free,
        (true, true),
        "a-free's partition and stream locks were held by a pause waiting for z-busy"
    );
    assert!(
        !pausing.is_finished(),
        "the pause returned with z-busy's claim in flight"
    );
    busy.rollback().await.unwrap();
    tokio::time::timeout(WAIT, pausing).await.unwrap().unwrap();
}

/// Records `n` (key `k{n % keys}`) on `topic`, key `k{i}` on partition `i % partitions`;
/// returns their event ids.
async fn produce_jobs(
    bootstrap: &str,
    topic: &str,
    ns: std::ops::Range<i64>,
    keys: i64,
    partitions: i64,
) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for p in 0..partitions {
        let records: Vec<RawRecord> = ns
            .clone()
            .filter(|n| (n % keys) % partitions == p)
            .map(|n| {
                let id = Uuid::now_v7();
                ids.push(id);
                RawRecord::event(
                    id,
                    &format!("k{}", n % keys),
                    "job",
                    serde_json::json!({ "n": n }),
                )
            })
            .collect();
        produce(bootstrap, topic, Some(p as i32), &records).await;
    }
    ids
}

/// `effects` rows of `ids`.
async fn applied(pool: &PgPool, ids: &[Uuid]) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = ANY($1)")
        .bind(ids)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn two_topic_consumer(
    pool: &PgPool,
    config: postal_consumer::ConsumerConfig,
    topics: [&str; 2],
    probe: crate::handlers::Probe,
) -> RunningConsumer {
    RunningConsumer::start(
        postal_consumer::Consumer::builder(pool.clone(), config)
            .state(probe)
            .on(topics[0], "job", crate::handlers::apply)
            .on(topics[1], "job", crate::handlers::apply)
            .build()
            .unwrap(),
    )
}

/// Guarantee (the consumer's "within one batch"): `postal pause consumer --group G` waits for
/// the transaction in flight (a handler still running) and returns once it committed; from
/// then on nothing is applied — not after a restart either — and the resume applies the rest
/// once each, in order.
#[tokio::test]
async fn a_consumer_pause_waits_for_the_transaction_in_flight_and_applies_nothing_after() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (topic, other) = (unique("cpause"), unique("cpause-other"));
    create_topic(&svc.bootstrap, &topic, 1).await;
    create_topic(&svc.bootstrap, &other, 1).await;
    let group = unique("cpause-group");
    let first = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[RawRecord::event(
            first,
            "k0",
            "job",
            serde_json::json!({"n": -1, "fail": "block"}),
        )],
    )
    .await;
    let rest = produce_jobs(&svc.bootstrap, &topic, 0..30, 1, 1).await;
    let probe = crate::handlers::Probe::default();
    let config = || consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER);
    let c = two_topic_consumer(&db.pool, config(), [&topic, &other], probe.clone());
    wait::until(WAIT, "the first handler runs", || async {
        probe.entered(first)
    })
    .await;

    let scope = Scope::consumer(&group, None).unwrap();
    let pausing = tokio::spawn({
        let (pool, scope) = (db.pool.clone(), scope.clone());
        async move { pause(&pool, &scope).await }
    });
    wait::until(WAIT, "the pause waits for the transaction", || async {
        a_pause_waits(&db.pool).await
    })
    .await;
    assert!(
        !pausing.is_finished(),
        "the pause returned with a transaction in flight"
    );
    probe.release(first);
    tokio::time::timeout(WAIT, pausing).await.unwrap().unwrap();
    assert_eq!(
        applied(&db.pool, &[first]).await,
        1,
        "the transaction in flight committed"
    );
    wait::until(WAIT, "the partition waits, paused", || async {
        c.stats.snapshot().partitions_paused == 1
    })
    .await;
    assert_eq!(
        applied(&db.pool, &rest).await,
        0,
        "applied after the pause returned"
    );

    // A restart: the new runtime honours the pause too.
    c.stop().await;
    let c = two_topic_consumer(&db.pool, config(), [&topic, &other], probe.clone());
    let more = produce_jobs(&svc.bootstrap, &other, 0..5, 1, 1).await;
    wait::until(WAIT, "the restarted consumer's partitions wait", || async {
        c.stats.snapshot().partitions_paused == 2
    })
    .await;
    assert_eq!(
        applied(&db.pool, &rest).await + applied(&db.pool, &more).await,
        0
    );

    resume(&db.pool, &scope).await;
    wait::until(WAIT, "everything applied after the resume", || async {
        applied(&db.pool, &rest).await == 30 && applied(&db.pool, &more).await == 5
    })
    .await;
    c.stop().await;
    let (rows, distinct) = crate::common::effects(&db.pool).await;
    assert_eq!((rows, distinct), (36, 36), "each event applied once");
    let ns: Vec<i64> =
        sqlx::query_scalar("SELECT n FROM effects WHERE event_id = ANY($1) ORDER BY id")
            .bind(&rest)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(ns, (0..30).collect::<Vec<_>>(), "applied in order");
}

/// Guarantee (consumer, one topic of a group): a topic pause stops that topic only — the
/// group's other topic keeps being applied — and holds across a rebalance (a second member
/// joins and takes partitions over: neither applies the paused topic); after the resume every
/// record is applied once, in each key's order.
#[tokio::test]
async fn a_consumer_topic_pause_holds_across_a_rebalance_and_loses_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let (topic, other) = (unique("tpause"), unique("tpause-other"));
    create_topic(&svc.bootstrap, &topic, 2).await;
    create_topic(&svc.bootstrap, &other, 2).await;
    let group = unique("tpause-group");
    let config = || consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER);
    let probe = crate::handlers::Probe::default();
    let c1 = two_topic_consumer(&db.pool, config(), [&topic, &other], probe.clone());
    let before = produce_jobs(&svc.bootstrap, &topic, 0..20, 4, 2).await;
    wait::until(WAIT, "the topic flows", || async {
        applied(&db.pool, &before).await == 20
    })
    .await;

    let scope = Scope::consumer(&group, Some(&topic)).unwrap();
    pause(&db.pool, &scope).await;
    let paused = produce_jobs(&svc.bootstrap, &topic, 20..60, 4, 2).await;
    let flowing = produce_jobs(&svc.bootstrap, &other, 0..20, 4, 2).await;
    wait::until(WAIT, "the other topic flows", || async {
        applied(&db.pool, &flowing).await == 20
    })
    .await;
    wait::until(WAIT, "the paused topic's partitions wait", || async {
        c1.stats.snapshot().partitions_paused == 2
    })
    .await;
    assert_eq!(applied(&db.pool, &paused).await, 0);

    // A second member: the partitions are shared out anew; both honour the pause.
    let c2 = two_topic_consumer(&db.pool, config(), [&topic, &other], probe.clone());
    let flowing2 = produce_jobs(&svc.bootstrap, &other, 20..60, 4, 2).await;
    wait::until(
        WAIT,
        "after the rebalance, each paused partition waits in one member",
        || async {
            let (s1, s2) = (c1.stats.snapshot(), c2.stats.snapshot());
            s1.partitions_paused + s2.partitions_paused == 2 && s2.partitions_paused >= 1
        },
    )
    .await;
    wait::until(
        WAIT,
        "the other topic flows after the rebalance",
        || async { applied(&db.pool, &flowing2).await == 40 },
    )
    .await;
    assert_eq!(applied(&db.pool, &paused).await, 0);

    resume(&db.pool, &scope).await;
    wait::until(
        WAIT,
        "the paused records applied after the resume",
        || async { applied(&db.pool, &paused).await == 40 },
    )
    .await;
    c2.stop().await;
    c1.stop().await;
    let (rows, distinct) = crate::common::effects(&db.pool).await;
    assert_eq!((rows, distinct), (120, 120), "each event applied once");
    let all: Vec<Uuid> = before.iter().chain(&paused).copied().collect();
    let ns: Vec<i64> =
        sqlx::query_scalar("SELECT n FROM effects WHERE event_id = ANY($1) ORDER BY id")
            .bind(&all)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let mut per_key: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for n in ns {
        per_key.entry(n % 4).or_default().push(n);
    }
    for (key, ns) in per_key {
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "key k{key} out of order: {ns:?}"
        );
    }
}

/// Runs the `postal` CLI; (success, stdout, stderr).
fn postal(url: &str, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(crate::procs::bin_dir().join("postal"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("run the postal CLI");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!("postal {args:?}: {}\n{stdout}{stderr}", out.status);
    (out.status.success(), stdout, stderr)
}

/// Guarantee (CLI): `postal pause`/`postal resume` write the pause and an audit row each
/// (who, via cli, the reason in the target); `postal pause list` and `postal status` show it
/// (the topic PAUSED, with its backlog); a resume that lifts nothing says so; a relay pause
/// needs `--topic` or `--all`.
#[tokio::test]
async fn the_cli_pauses_resumes_shows_and_audits() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let url = db.url.as_str();
    let topic = unique("cli-pause");
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "job", &serde_json::json!({"n": 1})).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let (ok, _, err) = postal(url, &["pause", "relay"]);
    assert!(!ok && err.contains("--topic"), "{err}");
    let (ok, out, _) = postal(
        url,
        &[
            "pause",
            "relay",
            "--topic",
            &topic,
            "--reason",
            "incident 7",
        ],
    );
    assert!(ok && out.contains("paused relay: topic"), "{out}");
    // A group that has not run yet is refused unless named new (a typo is refused).
    let (ok, _, err) = postal(url, &["pause", "consumer", "--group", "billing"]);
    assert!(!ok && err.contains("--new-group"), "{err}");
    let (ok, out, _) = postal(
        url,
        &["pause", "consumer", "--group", "billing", "--new-group"],
    );
    assert!(ok && out.contains("paused consumer group"), "{out}");

    let (ok, out, _) = postal(url, &["pause", "list", "--json"]);
    assert!(ok);
    let list: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(list.len(), 2, "{out}");
    assert!(list.iter().any(|p| p["side"] == "relay"
        && p["topic"] == topic.as_str()
        && p["group_name"].is_null()
        && p["reason"] == "incident 7"));
    let (ok, out, _) = postal(url, &["status", "--json"]);
    assert!(ok);
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let row = status["topics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["topic"] == topic.as_str())
        .expect("the topic's row");
    assert_eq!(row["paused"], serde_json::json!(["*"]));
    assert_eq!(row["pending"], 1, "its backlog still shows");
    let (ok, out, _) = postal(url, &["status"]);
    assert!(ok && out.contains("PAUSED in every relay group"), "{out}");

    let (ok, out, _) = postal(url, &["resume", "relay", "--topic", &topic]);
    assert!(ok && out.contains("resumed relay: topic"), "{out}");
    let (ok, out, _) = postal(url, &["resume", "relay", "--topic", &topic]);
    assert!(ok && out.contains("not paused"), "{out}");

    let (ok, out, _) = postal(url, &["audit", "list", "--json"]);
    assert!(ok);
    let entries: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let actions: Vec<(&str, i64)> = entries
        .iter()
        .rev()
        .map(|e| {
            (
                e["action"].as_str().unwrap(),
                e["affected"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        actions,
        [("pause", 1), ("pause", 1), ("resume", 1), ("resume", 0)],
        "{out}"
    );
    let first = entries.last().unwrap();
    assert_eq!(first["via"], "cli");
    assert_eq!(first["target"]["reason"], "incident 7");
    assert_eq!(first["target"]["topic"], topic.as_str());
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.pauses")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 1, "the consumer pause is still in force");
}

/// Guarantee (dashboard): pausing and resuming from the dashboard ask first (saying what, in
/// words) and change nothing until confirmed; confirmed, they pause and resume as the CLI does,
/// recorded in the audit trail with the dashboard user; the pauses page lists what is paused,
/// and a read-only dashboard refuses both.
#[tokio::test]
async fn the_dashboard_pauses_and_resumes_after_asking_and_audits() {
    use crate::common::dashboard::{click_and_confirm, post, start};
    use postal_admin::web::Dashboard;
    use postal_integration_tests::http::{csrf, form_fields, pairs, request};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let count = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.pauses")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let read_only = start(Dashboard::new(db.pool.clone())).await;
    let page = request(read_only, "GET", "/pauses", &[], "").await;
    assert!(page.body.contains("Nothing is paused."), "{}", page.body);
    let refused = post(
        read_only,
        "/pauses/pause",
        &[("side", "relay"), ("topic", "orders"), ("confirm", "yes")],
    )
    .await;
    assert_eq!(refused.status, 403, "{}", refused.body);

    let addr = start(Dashboard::new(db.pool.clone()).actions(true)).await;
    let page = request(addr, "GET", "/pauses", &[], "").await;
    let token = csrf(&page.body).expect("a CSRF token");
    let fields = [
        ("csrf", token.as_str()),
        ("side", "consumer"),
        ("group", "billing"),
        ("topic", "refunds"),
        ("reason", "INC-9"),
    ];
    let asked = post(addr, "/pauses/pause", &fields).await;
    assert!(
        asked.body.contains("Pause consumer group") && asked.body.contains("refunds"),
        "{}",
        asked.body
    );
    assert_eq!(
        count(db.pool.clone()).await,
        0,
        "nothing paused before the confirmation"
    );
    let done = post(
        addr,
        "/pauses/pause",
        &pairs(&form_fields(&asked.body, "confirm", 0)),
    )
    .await;
    assert!(done.body.contains("Paused consumer group"), "{}", done.body);
    assert_eq!(count(db.pool.clone()).await, 1);
    let page = request(addr, "GET", "/pauses", &[], "").await;
    assert!(
        page.body.contains("INC-9") && page.body.contains("refunds"),
        "{}",
        page.body
    );

    // The list's Resume button carries the scope.
    let resume_fields = form_fields(&page.body, "resume", 0);
    let (_, done) = click_and_confirm(addr, "/pauses/resume", &pairs(&resume_fields)).await;
    assert!(
        done.body.contains("Resumed consumer group"),
        "{}",
        done.body
    );
    assert_eq!(count(db.pool.clone()).await, 0);

    let (actions, via, actor, reason): (Vec<String>, Vec<String>, Vec<String>, Option<String>) =
        sqlx::query_as(
            "SELECT array_agg(action ORDER BY id), array_agg(via ORDER BY id),
                    array_agg(actor ORDER BY id), min(target->>'reason')
             FROM postal.operator_audit",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(actions, ["pause", "resume"]);
    assert_eq!(via, ["dashboard", "dashboard"]);
    assert_eq!(actor, ["local", "local"]);
    assert_eq!(reason.as_deref(), Some("INC-9"));
}
