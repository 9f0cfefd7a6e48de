//! Consumer runtime: dedup, handler failures, fencing, and the standalone handler.

use std::time::Duration;

use postal_consumer::testing::offsets;
use postal_consumer::{Consumer, Event, EventId, Outcome, State};
use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    apply_consumer, consumer_config, create_topic, effects, effects_table, produce, start_apply,
    start_apply_with, RawRecord, RunningConsumer,
};
use crate::handlers::{self, apply, Job};

const WAIT: Duration = Duration::from_secs(60);

async fn processed_rows(pool: &sqlx::PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.processed_events WHERE event_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn effect_rows(pool: &sqlx::PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Guarantee: the same event delivered twice (two records, one event id) is applied once; the
/// second delivery finds its dedup row and the body does not run.
#[tokio::test]
async fn same_event_twice_is_applied_once() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("dup");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[
            RawRecord::event(a, "k", "job", json!({"n": 1})),
            RawRecord::event(a, "k", "job", json!({"n": 1})),
            RawRecord::event(b, "k", "job", json!({"n": 2})),
        ],
    )
    .await;
    let group = unique("g");
    let probe = handlers::Probe::default();
    let running = start_apply_with(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &group, handlers::CONSUMER),
        probe.clone(),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "three records processed", || {
        let s = stats.snapshot();
        async move { s.applied + s.duplicates == 3 }
    })
    .await;
    running.stop().await;
    let s = stats.snapshot();
    assert_eq!((s.applied, s.duplicates), (2, 1));
    assert_eq!(
        effects(&db.pool).await,
        (2, 2),
        "each event applied exactly once"
    );
    assert_eq!(probe.attempts(a), 1, "the duplicate did not run the body");
    assert_eq!(processed_rows(&db.pool, a).await, 1);
    // Processed offsets also reach Kafka (for lag tools); the database copy is what counts.
    let committed = tokio::task::spawn_blocking({
        let (bootstrap, topic, group) = (svc.bootstrap.clone(), topic.clone(), group.clone());
        move || {
            use rdkafka::consumer::{BaseConsumer, Consumer as _};
            let c: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set("group.id", &group)
                .create()
                .unwrap();
            let mut tpl = rdkafka::TopicPartitionList::new();
            tpl.add_partition(&topic, 0);
            c.committed_offsets(tpl, Duration::from_secs(10)).unwrap()
        }
    })
    .await
    .unwrap();
    assert_eq!(
        committed.elements()[0].offset(),
        rdkafka::Offset::Offset(3),
        "the Kafka group offset is committed too"
    );
}

/// Guarantee: a failing handler leaves none of its effects; retryable failures are retried
/// until they succeed (applied once), permanent failures and panics become dead letters whose
/// event keeps its dedup row (so no later copy applies it), and the records after them are
/// still processed.
#[tokio::test]
async fn handler_errors_leave_no_effect_and_dead_letters_keep_their_dedup_row() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("fail");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let [perm, flaky, boom, after] = [(); 4].map(|_| Uuid::now_v7());
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[
            RawRecord::event(perm, "k", "job", json!({"n": 1, "fail": "permanent"})),
            RawRecord::event(
                flaky,
                "k",
                "job",
                json!({"n": 2, "fail": "retry", "retries": 2}),
            ),
            RawRecord::event(boom, "k", "job", json!({"n": 3, "fail": "panic"})),
            RawRecord::event(after, "k", "job", json!({"n": 4})),
        ],
    )
    .await;
    let probe = handlers::Probe::default();
    let running = start_apply_with(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER),
        probe.clone(),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "all four records handled", || {
        let s = stats.snapshot();
        async move { s.applied + s.dead_letters == 4 }
    })
    .await;
    running.stop().await;
    let s = stats.snapshot();
    assert_eq!((s.applied, s.dead_letters, s.retries), (2, 2, 2));

    for id in [perm, boom] {
        assert_eq!(
            effect_rows(&db.pool, id).await,
            0,
            "no effect of a failed event"
        );
        assert_eq!(
            processed_rows(&db.pool, id).await,
            1,
            "a dead letter keeps its event's dedup row (no copy of it is ever applied)"
        );
    }
    assert_eq!(
        effect_rows(&db.pool, flaky).await,
        1,
        "retried, applied once"
    );
    assert_eq!(probe.attempts(flaky), 3);
    assert_eq!(
        effect_rows(&db.pool, after).await,
        1,
        "later records still processed"
    );
    let reasons: Vec<(Option<Uuid>, String, String)> = sqlx::query_as(
        "SELECT event_id, reason, error FROM postal.dead_letters ORDER BY kafka_offset",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(reasons.len(), 2);
    assert_eq!(
        (reasons[0].0, reasons[0].1.as_str()),
        (Some(perm), "permanent")
    );
    assert!(reasons[0].2.contains("business rule"), "{}", reasons[0].2);
    assert_eq!((reasons[1].0, reasons[1].1.as_str()), (Some(boom), "panic"));
    assert!(reasons[1].2.contains("handler bug"), "{}", reasons[1].2);
    let next: Option<i64> =
        sqlx::query_scalar("SELECT next_offset FROM postal.consumer_offsets WHERE topic = $1")
            .bind(&topic)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(next, Some(4), "the stored offset moved past every record");
}

/// Guarantee: a transaction of a consumer whose partition was taken over (the epoch moved on)
/// does not commit — its effects and dedup row roll back, and it stops processing.
#[tokio::test]
async fn a_fenced_transaction_does_not_commit() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("fence");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let (blocked, next) = (Uuid::now_v7(), Uuid::now_v7());
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[
            RawRecord::event(blocked, "k", "job", json!({"n": 1, "fail": "block"})),
            RawRecord::event(next, "k", "job", json!({"n": 2})),
        ],
    )
    .await;
    let group = unique("g");
    let probe = handlers::Probe::default();
    let running = start_apply_with(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &group, handlers::CONSUMER),
        probe.clone(),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "the blocking handler to start", || {
        let entered = probe.entered(blocked);
        async move { entered }
    })
    .await;
    // Another consumer takes the partition over while the transaction is open.
    offsets::claim(&db.pool, &group, &topic, 0, "intruder")
        .await
        .unwrap();
    probe.release(blocked);
    wait::until(WAIT, "the fenced transaction", || {
        let s = stats.snapshot();
        async move { s.fenced == 1 }
    })
    .await;
    running.stop().await;
    assert_eq!(effect_rows(&db.pool, blocked).await, 0, "rolled back");
    assert_eq!(processed_rows(&db.pool, blocked).await, 0, "rolled back");
    assert_eq!(
        effect_rows(&db.pool, next).await,
        0,
        "the fenced worker stopped"
    );
    assert_eq!(stats.snapshot().applied, 0);
}

/// Guarantee: the generated standalone handler works inside the caller's transaction — first
/// call applies, second reports a duplicate without running the body; a failing body rolls back
/// its dedup row and effects while the caller's own writes in the same transaction survive.
#[tokio::test]
async fn standalone_handler_in_callers_transaction() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    sqlx::query("CREATE TABLE audit (note text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let id = EventId::new();
    let job = || Job {
        n: 7,
        fail: None,
        retries: 0,
        next: None,
    };
    let probe = handlers::Probe::default();
    for expected in [Outcome::Applied, Outcome::Duplicate] {
        let mut tx = db.pool.begin().await.unwrap();
        let outcome = apply::call(State(probe.clone()), &mut tx, Event::new(id, "job", job()))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(outcome, expected);
    }
    assert_eq!(effect_rows(&db.pool, id.as_uuid()).await, 1);
    assert_eq!(probe.attempts(id.as_uuid()), 1);

    let failing = EventId::new();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO audit VALUES ('caller write')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let bad = Job {
        n: 8,
        fail: Some("permanent".into()),
        retries: 0,
        next: None,
    };
    let err = apply::call(
        State(probe.clone()),
        &mut tx,
        Event::new(failing, "job", bad),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("business rule"), "{err}");
    tx.commit()
        .await
        .expect("the caller's transaction stays usable");
    let audit: i64 = sqlx::query_scalar("SELECT count(*) FROM audit")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(audit, 1, "the caller's own write committed");
    assert_eq!(effect_rows(&db.pool, failing.as_uuid()).await, 0);
    assert_eq!(processed_rows(&db.pool, failing.as_uuid()).await, 0);
}

/// Guarantee: a shutdown that cannot finish the in-flight transaction within the shutdown
/// timeout abandons it — its effects and dedup row roll back — and the next consumer of the
/// group applies that event exactly once.
#[tokio::test]
async fn shutdown_abandons_an_unfinished_transaction_cleanly() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("shutdown");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let blocked = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[RawRecord::event(
            blocked,
            "k",
            "job",
            json!({"n": 1, "fail": "block"}),
        )],
    )
    .await;
    let group = unique("g");
    let probe = handlers::Probe::default();
    let build = || {
        let mut config = consumer_config(&svc.bootstrap, &group, handlers::CONSUMER);
        config.shutdown_timeout = Duration::from_millis(300);
        Consumer::builder(db.pool.clone(), config)
            .state(probe.clone())
            .on(&topic, "job", apply)
            .build()
            .unwrap()
    };
    let first = RunningConsumer::start(build());
    wait::until(WAIT, "the blocking handler to start", || {
        let entered = probe.entered(blocked);
        async move { entered }
    })
    .await;
    first.stop().await; // returns after the 300 ms shutdown timeout
    assert_eq!(
        effect_rows(&db.pool, blocked).await,
        0,
        "abandoned: rolled back"
    );
    assert_eq!(processed_rows(&db.pool, blocked).await, 0);

    probe.release(blocked);
    let second = RunningConsumer::start(build());
    let stats = second.stats.clone();
    wait::until(WAIT, "the event applied by the next consumer", || {
        let s = stats.snapshot();
        async move { s.applied == 1 }
    })
    .await;
    second.stop().await;
    assert_eq!(
        effect_rows(&db.pool, blocked).await,
        1,
        "applied exactly once"
    );
}

/// `n` `job` events of key `k`, numbered from `from`.
fn jobs(from: i64, n: i64) -> Vec<RawRecord> {
    (from..from + n)
        .map(|n| RawRecord::event(Uuid::now_v7(), "k", "job", json!({"n": n})))
        .collect()
}

/// Waits until the runtime has applied `n` events in all.
async fn applied(stats: &postal_consumer::Stats, n: u64, within: Duration, what: &str) {
    wait::until(within, what, || {
        let s = stats.snapshot();
        async move { s.applied == n }
    })
    .await;
}

/// Guarantee: an owned partition whose fetching stops behind the runtime's back (a lost fetch
/// position, as after a broker fault) does not stall: after `stall_check` without records
/// while the broker has more, the runtime resumes and seeks to the stored offset, and every
/// later record is applied exactly once.
#[tokio::test]
async fn a_partition_that_stops_fetching_is_recovered() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("stall");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce(&svc.bootstrap, &topic, None, &jobs(0, 20)).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config.stall_check = Duration::from_secs(1);
    let consumer = apply_consumer(&db.pool, &topic, config);
    let fault = consumer.fetch_fault();
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    applied(&stats, 20, WAIT, "the first 20 events applied").await;
    fault.stop_fetching(&topic, 0).expect("pause");
    produce(&svc.bootstrap, &topic, None, &jobs(20, 20)).await;
    applied(
        &stats,
        40,
        WAIT,
        "the next 20 events applied after the stall",
    )
    .await;
    assert!(stats.snapshot().stalls_recovered >= 1);
    // The injector's handle on the client would keep the stopping consumer waiting for it
    // (up to its shutdown timeout) before it leaves the group.
    drop(fault);
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (40, 40));
}

/// Guarantee: a partition revoked and assigned again in quick succession (several rebalances
/// in a row) keeps being consumed: the worker of the last assignment owns the partition in the
/// database, however the earlier workers' takeovers interleave with its own. (A restarted
/// consumer in the chain test once left a partition to a worker fenced by its cancelled
/// predecessor.)
#[tokio::test]
async fn quick_successive_reassignments_leave_the_partition_consumed() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("reassign");
    create_topic(&svc.bootstrap, &topic, 1).await;
    produce(&svc.bootstrap, &topic, None, &jobs(0, 10)).await;
    let config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    let consumer = apply_consumer(&db.pool, &topic, config);
    let fault = consumer.rebalance_fault();
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    applied(&stats, 10, WAIT, "the first 10 events applied").await;
    for round in 1..=8u64 {
        fault.reassign(&topic, 0, 3);
        produce(&svc.bootstrap, &topic, None, &jobs(round as i64 * 10, 10)).await;
        applied(
            &stats,
            (round + 1) * 10,
            Duration::from_secs(30),
            "the next 10 events applied after reassignments",
        )
        .await;
    }
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (90, 90));
}

/// Guarantee: with a tiny per-partition buffer the runtime pauses and resumes fetching over and
/// over without losing, repeating or stalling a record.
#[tokio::test]
async fn backpressure_pauses_and_resumes_without_loss() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("pause");
    create_topic(&svc.bootstrap, &topic, 2).await;
    let records: Vec<RawRecord> = (0..400)
        .map(|n| {
            RawRecord::event(
                Uuid::now_v7(),
                &format!("k{}", n % 9),
                "job",
                json!({"n": n}),
            )
        })
        .collect();
    produce(&svc.bootstrap, &topic, None, &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config.partition_buffer = 4;
    let running = start_apply(&db.pool, &topic, config);
    let stats = running.stats.clone();
    wait::until(WAIT, "400 events applied", || {
        let s = stats.snapshot();
        async move { s.applied == 400 }
    })
    .await;
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (400, 400));
}

/// Guarantee: through the real runtime (Kafka, throughput mode) a batch handler applies every
/// event once and each key's events in order: 600 events on 3 partitions with copies of
/// events right after them (duplicates inside a batch) and a permanently failing event in the
/// middle of the stream, which alone becomes a dead letter; a small partition buffer makes the
/// runtime pause and resume fetching throughout.
#[tokio::test]
async fn a_batch_handler_applies_every_event_once_and_in_order_per_key() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("batch");
    create_topic(&svc.bootstrap, &topic, 3).await;
    let ids: Vec<Uuid> = (0..600).map(|_| Uuid::now_v7()).collect();
    let bad = 301;
    let mut records = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        let payload = if n == bad {
            json!({"n": n, "fail": "permanent"})
        } else {
            json!({"n": n})
        };
        let record = || RawRecord::event(*id, &format!("k{}", n % 7), "job", payload.clone());
        if n % 10 == 3 {
            records.push(record());
        }
        records.push(record());
    }
    produce(&svc.bootstrap, &topic, None, &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), handlers::CONSUMER);
    config.max_batch = 50;
    config.partition_buffer = 60;
    let consumer = Consumer::builder(db.pool.clone(), config)
        .state(handlers::Probe::default())
        .on_batch(&topic, "job", handlers::apply_batch)
        .build()
        .expect("consumer");
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    wait::until(WAIT, "599 events applied and one dead letter", || {
        let s = stats.snapshot();
        async move { s.applied == 599 && s.dead_letters == 1 }
    })
    .await;
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (599, 599), "each event once");
    // Per key, in the order produced.
    let order: Vec<(i64,)> = sqlx::query_as("SELECT n FROM effects ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut last = std::collections::HashMap::new();
    for (n,) in order {
        if let Some(prev) = last.insert(n % 7, n) {
            assert!(prev < n, "key k{}: {n} applied after {prev}", n % 7);
        }
    }
    let dead: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM postal.dead_letters")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(dead, vec![ids[bad]]);
}
