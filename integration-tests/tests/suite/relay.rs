//! The relay against a real broker: claims, crashes, parking, outages, shutdown.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use postal_integration_tests::private::PrivateBroker;
use postal_integration_tests::{kafka, services, unique, wait};
use postal_producer::{
    enqueue, enqueue_batch, ContentType, KafkaConfig, KafkaTransport, NewEvent, Transport,
};
use sqlx::PgPool;

use crate::common::{
    fast_config, kafka_transport, outbox_count, Counting, FailureCounts, RunningRelay,
};

pub(crate) async fn seed(pool: &PgPool, topic: &str, n: usize, keys: usize) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut conn = pool.acquire().await.unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let events = chunk
            .iter()
            .map(|i| {
                NewEvent::json(
                    topic,
                    format!("k{}", i % keys),
                    "e",
                    &serde_json::json!({"i": i}),
                )
                .unwrap()
            })
            .collect();
        for id in enqueue_batch(&mut conn, events).await.unwrap() {
            ids.insert(id.to_string());
        }
    }
    ids
}

/// Outbox rows locked by a claim: exactly those a `SKIP LOCKED` read cannot see.
async fn claimed(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM postal.outbox)
              - (SELECT count(*) FROM (SELECT 1 FROM postal.outbox FOR UPDATE SKIP LOCKED) s)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The event ids in the outbox.
async fn outbox_ids(pool: &PgPool) -> BTreeSet<String> {
    sqlx::query_scalar::<_, uuid::Uuid>("SELECT event_id FROM postal.outbox")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|u| u.to_string())
        .collect()
}

fn id_counts(records: &[kafka::Record]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in records {
        *m.entry(r.header("ce_id").unwrap_or_default().to_owned())
            .or_insert(0) += 1;
    }
    m
}

/// Guarantee (seed 002's gap): publishing directly and then failing the transaction leaves an
/// event for an order that does not exist; through the outbox, the rolled-back event is
/// never published while committed ones are.
#[tokio::test]
async fn dual_write_gap_demonstrated_then_closed() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    sqlx::query("CREATE TABLE orders (id bigint PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let topic = unique("gap");

    // The naive way: publish, then the transaction fails.
    let transport = kafka_transport(&svc.bootstrap);
    let ghost = NewEvent::json(topic.as_str(), "1", "order.created", &1).unwrap();
    let ghost_id = ghost.id().to_string();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let out = postal_producer::OutboundEvent {
        seq: 0,
        id: ghost.id(),
        topic: topic.clone(),
        key: "1".into(),
        event_type: "order.created".into(),
        schema_version: 1,
        occurred_at: chrono::Utc::now(),
        content_type: "application/json".into(),
        payload: ghost.payload().to_vec(),
        headers: vec![],
        attempts: 0,
    };
    let acks = transport.send(std::slice::from_ref(&out)).await.await;
    assert!(acks[0].is_ok());
    tx.rollback().await.unwrap(); // the order never existed…
    let records = kafka::read_all(&svc.bootstrap, &topic, 1, Duration::from_secs(30)).await;
    assert!(
        records
            .iter()
            .any(|r| r.header("ce_id") == Some(ghost_id.as_str())),
        "…but its event is out: the gap"
    );

    // Through the outbox: the rolled-back event never leaves; the committed one does.
    let topic2 = unique("gap-closed");
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (2)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let lost = enqueue(
        &mut tx,
        NewEvent::json(topic2.as_str(), "2", "order.created", &2).unwrap(),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (3)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let kept = enqueue(
        &mut tx,
        NewEvent::json(topic2.as_str(), "3", "order.created", &3).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let records = kafka::read_all(&svc.bootstrap, &topic2, 1, Duration::from_secs(30)).await;
    let ids: BTreeSet<_> = records.iter().filter_map(|r| r.header("ce_id")).collect();
    assert!(ids.contains(kept.to_string().as_str()));
    assert!(!ids.contains(lost.to_string().as_str()));
    relay.stop().await;
}

/// Guarantee: several relays claiming concurrently never publish a row twice while its lease
/// holds — every event arrives exactly once.
#[tokio::test]
async fn concurrent_relays_never_double_publish() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("concurrent");
    let ids = seed(&db.pool, &topic, 3000, 300).await;
    let relays: Vec<_> = (0..3)
        .map(|_| {
            let cfg = fast_config().batch_size(50);
            RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), cfg)
        })
        .collect();
    wait::until(Duration::from_secs(60), "outbox drained", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    let mut total = 0;
    for r in relays {
        total += r.stop().await.published;
    }
    let records = kafka::read_all(&svc.bootstrap, &topic, 3000, Duration::from_secs(60)).await;
    let counts = id_counts(&records);
    assert_eq!(counts.keys().cloned().collect::<BTreeSet<_>>(), ids);
    assert!(counts.values().all(|&c| c == 1), "no event published twice");
    assert_eq!(total, 3000);
}

/// Guarantee: a relay that dies after the broker acknowledged but before marking loses nothing:
/// its claim ends with it, and the events are republished with the same event ids.
#[tokio::test]
async fn crash_between_publish_and_mark_republishes_same_ids() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("crash");
    let ids = seed(&db.pool, &topic, 200, 20).await;
    let mut claimed = crate::common::claim_as_doomed_relay(&db.pool).await;
    let batch = claimed.take_events();
    assert_eq!(batch.len(), 200);
    let transport = kafka_transport(&svc.bootstrap);
    let acks = transport.send(&batch).await.await;
    assert!(acks.iter().all(Result::is_ok));
    drop(transport);
    drop(claimed);
    // A healthy relay takes over once the lease runs out.
    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    wait::until(Duration::from_secs(30), "outbox drained", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    let records = kafka::read_all(&svc.bootstrap, &topic, 400, Duration::from_secs(30)).await;
    let counts = id_counts(&records);
    assert_eq!(
        counts.keys().cloned().collect::<BTreeSet<_>>(),
        ids,
        "nothing lost"
    );
    assert!(
        counts.values().all(|&c| c == 2),
        "each republished once, under the same id"
    );
}

/// Guarantee: an event too large for the broker is parked as failed with its reason; other
/// keys keep flowing; a later event of the same key waits behind it.
#[tokio::test]
async fn oversized_event_is_parked_and_holds_only_its_key() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("oversized");
    let mut conn = db.pool.acquire().await.unwrap();
    let big = enqueue(
        &mut conn,
        NewEvent::bytes(
            topic.as_str(),
            "big-key",
            "e",
            ContentType::new("application/octet-stream").unwrap(),
            vec![7u8; 2_000_000],
        )
        .unwrap(),
    )
    .await
    .unwrap();
    let behind = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "big-key", "e", &"after").unwrap(),
    )
    .await
    .unwrap();
    let others = seed(&db.pool, &topic, 50, 5).await;
    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let records = kafka::read_all(&svc.bootstrap, &topic, 50, Duration::from_secs(30)).await;
    let seen: BTreeSet<String> = kafka::event_ids(&records);
    assert_eq!(
        seen, others,
        "other keys flowed; the parked key's later event did not"
    );
    wait::until(Duration::from_secs(10), "big event parked", || async {
        let s: Option<String> =
            sqlx::query_scalar("SELECT status FROM postal.outbox WHERE event_id = $1")
                .bind(big.as_uuid())
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        s.as_deref() == Some("failed")
    })
    .await;
    relay.stop().await;
    let (err,): (Option<String>,) =
        sqlx::query_as("SELECT last_error FROM postal.outbox WHERE event_id = $1")
            .bind(big.as_uuid())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        err.unwrap_or_default().contains("exceeds"),
        "the reason is recorded"
    );
    let status: String = sqlx::query_scalar("SELECT status FROM postal.outbox WHERE event_id = $1")
        .bind(behind.as_uuid())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "pending", "the later event of the parked key waits");
}

/// Guarantee: with topic creation off (as on clusters where only operators create topics),
/// events for a missing topic are not poison: they wait, in key order, without using up
/// attempts, with a reason naming the topic and how to create it, while other topics flow;
/// once the topic exists they all go out, once each and in order.
#[tokio::test]
async fn missing_topic_waits_until_created_and_other_topics_flow() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (missing, present) = (unique("missing"), unique("present"));
    crate::common::create_topic(&svc.bootstrap, &present, 1).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let events = (0..20)
        .map(|i| NewEvent::json(missing.as_str(), "k", "e", &serde_json::json!({"i": i})).unwrap())
        .collect();
    let waiting = enqueue_batch(&mut conn, events).await.unwrap();
    let flowing = enqueue(
        &mut conn,
        // Another key: the waiting events hold theirs (on their own topic only).
        NewEvent::json(present.as_str(), "other", "e", &1).unwrap(),
    )
    .await
    .unwrap();
    let mut cfg = KafkaConfig::new(&svc.bootstrap);
    cfg.create_topics = false;
    cfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    let relay = RunningRelay::start(&db.pool, KafkaTransport::new(cfg).unwrap(), fast_config());
    // The other topic's event goes out although the missing topic's events came first.
    let read = kafka::read_all(&svc.bootstrap, &present, 1, Duration::from_secs(30)).await;
    assert_eq!(kafka::event_ids(&read), [flowing.to_string()].into());
    wait::until(
        Duration::from_secs(30),
        "the first event's reason recorded",
        || async {
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT last_error FROM postal.outbox WHERE event_id = $1",
            )
            .bind(waiting[0].as_uuid())
            .fetch_one(&db.pool)
            .await
            .unwrap()
            .is_some()
        },
    )
    .await;
    let (parked, attempts, err): (i64, i64, String) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status <> 'pending'), coalesce(sum(attempts), 0),
                max(last_error) FROM postal.outbox WHERE topic = $1",
    )
    .bind(&missing)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (parked, attempts),
        (0, 0),
        "waiting events are neither parked nor charged attempts"
    );
    assert!(
        err.contains(&format!("topic {missing:?} does not exist"))
            && err.contains("--create --topic")
            && err.contains("wait"),
        "{err}"
    );
    crate::common::create_topic(&svc.bootstrap, &missing, 1).await;
    // Waiting events are retried every minute.
    let read = kafka::read_all(&svc.bootstrap, &missing, 20, Duration::from_secs(120)).await;
    relay.stop().await;
    let order: Vec<String> = read
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    let want: Vec<String> = waiting.iter().map(ToString::to_string).collect();
    assert_eq!(order, want, "every waiting event once, in key order");
}

/// Guarantee: a broker outage longer than every retry budget parks nothing; when the broker
/// returns, the backlog drains by itself and every event arrives.
#[tokio::test]
async fn broker_outage_longer_than_retry_budget_parks_nothing() {
    broker_outage_longer_than_retry_budget(false).await;
}

/// Guarantee: the same with a WAL relay: the stream's failed chunks are written back without
/// charging an attempt, the sweep retries them through the outage, nothing is parked, and the
/// backlog drains by itself once the broker returns.
#[tokio::test]
async fn broker_outage_longer_than_retry_budget_parks_nothing_wal() {
    broker_outage_longer_than_retry_budget(true).await;
}

/// With a WAL relay (a slot created before any event) when `wal`, else a polling one.
async fn broker_outage_longer_than_retry_budget(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let mut broker = PrivateBroker::start().await;
    let topic = unique("outage");
    // Create the topic while the broker is up.
    let first = seed(&db.pool, &topic, 1, 1).await;
    let counts = FailureCounts::default();
    let mut kcfg = KafkaConfig::new(broker.bootstrap());
    kcfg.topic_partitions = 2;
    kcfg.properties
        .insert("message.timeout.ms".into(), "1500".into());
    kcfg.properties
        .insert("reconnect.backoff.max.ms".into(), "200".into());
    let transport = Counting {
        inner: KafkaTransport::new(kcfg).unwrap(),
        counts: counts.clone(),
    };
    let cfg = crate::wal_relay::config_for(&slot)
        .lease(Duration::from_secs(4))
        .max_attempts(2)
        .backoff(postal_producer::Backoff {
            base: Duration::from_millis(20),
            max: Duration::from_millis(100),
        });
    let relay = RunningRelay::start(&db.pool, transport, cfg);
    wait::until(Duration::from_secs(30), "first event published", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;

    broker.kill();
    let mut ids = seed(&db.pool, &topic, 300, 10).await;
    ids.extend(first);
    // Far more failed rounds than max_attempts (2) would allow if outages counted.
    wait::until(
        Duration::from_secs(60),
        "many failed rounds during the outage",
        || async { counts.unavailable.load(Ordering::Relaxed) >= 300 * 5 },
    )
    .await;
    let parked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE status = 'failed'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(parked, 0, "an outage parks nothing");

    broker.restart().await;
    wait::until(
        Duration::from_secs(90),
        "backlog drained after the broker returned",
        || async { outbox_count(&db.pool).await == 0 },
    )
    .await;
    relay.stop().await;
    let records = kafka::read_all(&broker.bootstrap(), &topic, 301, Duration::from_secs(30)).await;
    let seen: BTreeSet<String> = kafka::event_ids(&records);
    assert_eq!(seen, ids, "everything arrived");
    assert_eq!(
        counts.other.load(Ordering::Relaxed),
        0,
        "no failure was counted against an event"
    );
}

/// Guarantee: graceful shutdown mid-drain leaves no row claimed, and every event is either
/// published or still pending — nothing is lost.
#[tokio::test]
async fn graceful_shutdown_leaves_nothing_claimed() {
    graceful_shutdown(false).await;
}

/// Guarantee: the same with a WAL relay stopped mid-drain: no row left locked, every event
/// published or still pending, and none both.
#[tokio::test]
async fn graceful_shutdown_leaves_nothing_claimed_wal() {
    graceful_shutdown(true).await;
}

/// With a WAL relay (a slot created before any event) when `wal`, else a polling one.
async fn graceful_shutdown(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("shutdown");
    let ids = seed(&db.pool, &topic, 20_000, 100).await;
    let relay = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    wait::until(Duration::from_secs(60), "relay under way", || async {
        outbox_count(&db.pool).await < 20_000
    })
    .await;
    relay.stop().await;
    assert_eq!(
        claimed(&db.pool).await,
        0,
        "no claimed-but-unpublished rows"
    );
    let pending = outbox_ids(&db.pool).await;
    let published_n = 20_000 - pending.len();
    let records =
        kafka::read_all(&svc.bootstrap, &topic, published_n, Duration::from_secs(60)).await;
    let published: BTreeSet<String> = kafka::event_ids(&records);
    let union: BTreeSet<String> = published.union(&pending).cloned().collect();
    assert_eq!(union, ids, "every event is published or still pending");
    assert!(
        published.intersection(&pending).count() == 0,
        "deleted rows are exactly the published ones"
    );
}

/// Guarantee: a hand-over that never returns (a destination that never answers) does not keep
/// the relay from stopping: after the shutdown timeout the batch is abandoned, its claim rolls
/// back, and every event is still in the outbox, unclaimed.
#[tokio::test]
async fn a_hand_over_that_never_returns_does_not_block_shutdown() {
    hand_over_that_never_returns(false).await;
}

/// Guarantee: the same with a WAL relay: a chunk whose hand-over never returns does not keep
/// it from stopping; the chunk's rows are given back unmarked, every event still pending.
#[tokio::test]
async fn a_hand_over_that_never_returns_does_not_block_a_wal_relay_s_shutdown() {
    hand_over_that_never_returns(true).await;
}

/// With a WAL relay (a slot created before any event) when `wal`, else a polling one.
async fn hand_over_that_never_returns(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("stuck");
    let ids = seed(&db.pool, &topic, 10, 2).await;
    let entered = std::sync::Arc::new(tokio::sync::Notify::new());
    let config = crate::wal_relay::config_for(&slot).shutdown_timeout(Duration::from_secs(1));
    let relay = RunningRelay::start(
        &db.pool,
        NeverHandsOver {
            entered: entered.clone(),
        },
        config,
    );
    tokio::time::timeout(Duration::from_secs(30), entered.notified())
        .await
        .expect("the relay claimed and began handing the batch over");
    let stopped = tokio::time::timeout(Duration::from_secs(30), relay.stop()).await;
    let stats = stopped.expect("the relay stopped within its bounds");
    assert_eq!(stats.published, 0);
    // The claim's rollback is sent when its connection is next used or returned.
    wait::until(
        Duration::from_secs(10),
        "the given-up claim rolled back",
        || async { claimed(&db.pool).await == 0 },
    )
    .await;
    assert_eq!(
        outbox_ids(&db.pool).await,
        ids,
        "every event is still in the outbox"
    );
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE status = 'pending'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(pending, 10, "and pending");
}

/// A destination whose hand-over never returns.
struct NeverHandsOver {
    entered: std::sync::Arc<tokio::sync::Notify>,
}

impl Transport for NeverHandsOver {
    type Acks = std::future::Ready<Vec<Result<(), postal_producer::PublishError>>>;

    async fn send(&self, _batch: &[postal_producer::OutboundEvent]) -> Self::Acks {
        self.entered.notify_one();
        std::future::pending().await
    }
}

/// Guarantee: a bytes payload keeps its exact bytes and content type through Kafka.
#[tokio::test]
async fn bytes_payload_round_trips_with_content_type() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("bytes");
    let payload: Vec<u8> = (0..=255u8).collect();
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue(
        &mut conn,
        NewEvent::bytes(
            topic.as_str(),
            "k",
            "blob.stored",
            ContentType::new("application/x-protobuf").unwrap(),
            payload.clone(),
        )
        .unwrap()
        .with_schema_version(postal_producer::SchemaVersion::new(3).unwrap()),
    )
    .await
    .unwrap();
    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let records = kafka::read_all(&svc.bootstrap, &topic, 1, Duration::from_secs(30)).await;
    relay.stop().await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].payload, payload);
    assert_eq!(
        records[0].header("content-type"),
        Some("application/x-protobuf")
    );
    assert_eq!(records[0].header("ce_schemaversion"), Some("3"));
}

/// Guarantee: a scheduled event is not published before its time, and holds back later events
/// of its key until then.
#[tokio::test]
async fn scheduled_event_waits_and_holds_its_key() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("scheduled");
    let mut conn = db.pool.acquire().await.unwrap();
    let at = chrono::Utc::now() + chrono::Duration::seconds(2);
    let later = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "e", &1)
            .unwrap()
            .deliver_at(at),
    )
    .await
    .unwrap();
    let behind = enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k", "e", &2).unwrap(),
    )
    .await
    .unwrap();
    let relay = RunningRelay::kafka(&db.pool, &svc.bootstrap);
    let records = kafka::read_all(&svc.bootstrap, &topic, 2, Duration::from_secs(30)).await;
    relay.stop().await;
    let order: Vec<&str> = records.iter().filter_map(|r| r.header("ce_id")).collect();
    assert_eq!(
        order,
        vec![later.to_string().as_str(), behind.to_string().as_str()],
        "key order kept"
    );
    let time: chrono::DateTime<chrono::Utc> =
        chrono::DateTime::parse_from_rfc3339(records[0].header("ce_time").unwrap())
            .unwrap()
            .into();
    assert!(time <= at);
}

/// Guarantee: when PostgreSQL crashes and comes back, the running relay reconnects by itself and
/// publishes what is committed afterwards; nothing is lost.
#[tokio::test]
async fn relay_reconnects_after_database_restart() {
    relay_reconnects_after_database_restart_with(false).await;
}

/// Guarantee: the same with a WAL relay: after PostgreSQL crashed and came back, it streams
/// from its slot again by itself (the slot survives the crash) and publishes what was
/// committed before and after; nothing is lost.
#[tokio::test]
async fn a_wal_relay_reconnects_after_database_restart() {
    relay_reconnects_after_database_restart_with(true).await;
}

/// With a WAL relay (a slot created before any event) when `wal`, else a polling one.
async fn relay_reconnects_after_database_restart_with(wal: bool) {
    use postal_integration_tests::private::PrivatePostgres;

    let svc = services().await;
    let mut pg = PrivatePostgres::start().await;
    let db = postal_integration_tests::create_db(&pg.url()).await;
    postal_shared::migrate(&db.pool).await.unwrap();
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("dbrestart");
    let mut ids = seed(&db.pool, &topic, 10, 3).await;
    let relay = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    wait::until(
        Duration::from_secs(30),
        "first events published",
        || async { outbox_count(&db.pool).await == 0 },
    )
    .await;

    pg.crash();
    pg.restart().await;
    ids.extend(seed(&db.pool, &topic, 10, 3).await);
    wait::until(
        Duration::from_secs(60),
        "events after the restart published",
        || async {
            matches!(
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM postal.outbox")
                    .fetch_one(&db.pool)
                    .await,
                Ok(0)
            )
        },
    )
    .await;
    relay.stop().await;
    let records = kafka::read_all(&svc.bootstrap, &topic, 20, Duration::from_secs(30)).await;
    let seen: BTreeSet<String> = kafka::event_ids(&records);
    assert_eq!(seen, ids);
}

/// Guarantee: with published rows kept, every event is published once and its row stays,
/// marked `published` with its time, until retention removes it.
#[tokio::test]
async fn keep_published_mode_marks_rows() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("keep");
    let ids = seed(&db.pool, &topic, 300, 7).await;
    let cfg = fast_config().delete_on_publish(false);
    let relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), cfg);
    wait::until(Duration::from_secs(30), "all rows marked published", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM postal.outbox WHERE status = 'published' AND published_at IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
            == 300
    })
    .await;
    relay.stop().await;
    let records = kafka::read_all(&svc.bootstrap, &topic, 300, Duration::from_secs(30)).await;
    let counts = id_counts(&records);
    assert_eq!(counts.keys().cloned().collect::<BTreeSet<_>>(), ids);
    assert!(counts.values().all(|&c| c == 1));
}

/// Guarantee (history mode, seed 001's daily partitions): every published event leaves the
/// outbox and lands once in `postal.outbox_history` in the same transaction; retention drops
/// whole days older than the retention (and expired rows of the default partition), keeps the
/// younger days, and runs in one instance at a time.
#[tokio::test]
async fn history_mode_keeps_events_in_daily_partitions_and_drops_old_days() {
    history_mode(false).await;
}

/// Guarantee: the same with a WAL relay: each event the stream (or its sweep) publishes leaves
/// the outbox and lands once in today's history partition, in the transaction that marks it.
#[tokio::test]
async fn history_mode_keeps_events_in_daily_partitions_and_drops_old_days_wal() {
    history_mode(true).await;
}

/// With a WAL relay (a slot created before any event) when `wal`, else a polling one.
async fn history_mode(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("history");
    let ids = seed(&db.pool, &topic, 300, 7).await;
    let cfg = crate::wal_relay::config_for(&slot).history(Some(Duration::from_secs(3 * 86_400)));
    let relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), cfg);
    wait::until(Duration::from_secs(30), "outbox drained", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    let archived: Vec<(uuid::Uuid, String, bool)> = sqlx::query_as(
        "SELECT event_id, tableoid::regclass::text,
                published_at >= created_at AND published_at <= now()
         FROM postal.outbox_history",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let archived_ids: BTreeSet<String> = archived.iter().map(|(id, ..)| id.to_string()).collect();
    assert_eq!(archived.len(), 300, "each published event archived once");
    assert_eq!(archived_ids, ids);
    let today: String = sqlx::query_scalar(
        "SELECT 'postal.outbox_history_' || to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        archived.iter().all(|(_, part, ok)| *part == today && *ok),
        "rows are in today's partition with their publication time"
    );
    let records = kafka::read_all(&svc.bootstrap, &topic, 300, Duration::from_secs(30)).await;
    assert_eq!(kafka::event_ids(&records), ids);

    // Older days: 5 days ago and yesterday get partitions; 10 days ago has none (default).
    for days in [5, 1] {
        sqlx::query(
            "SELECT postal.history_partition_ensure((now() AT TIME ZONE 'UTC')::date - $1::int)",
        )
        .bind(days)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    for days in [10, 5, 1] {
        sqlx::query(
            "INSERT INTO postal.outbox_history (seq, event_id, topic, event_key, event_type,
                 schema_version, occurred_at, content_type, payload, headers, attempts,
                 created_at, published_at)
             VALUES (0, gen_random_uuid(), 't', 'k', 'e', 1, now(), 'application/json', '',
                     '{}', 0, now(), now() - $1 * interval '1 day')",
        )
        .bind(days as f64)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // Another instance maintaining right now: this one does nothing.
    let mut other = db.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(postal_producer::retention::HISTORY_LOCK)
        .execute(&mut *other)
        .await
        .unwrap();
    let busy =
        postal_producer::retention::maintain_history(&db.pool, Duration::from_secs(3 * 86_400))
            .await
            .unwrap();
    assert_eq!(busy, None, "one instance at a time");
    other.rollback().await.unwrap();

    let done =
        postal_producer::retention::maintain_history(&db.pool, Duration::from_secs(3 * 86_400))
            .await
            .unwrap()
            .expect("lock free");
    let five_days_ago: String = sqlx::query_scalar(
        "SELECT 'outbox_history_' || to_char((now() AT TIME ZONE 'UTC')::date - 5, 'YYYYMMDD')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        done.dropped,
        vec![five_days_ago],
        "only the expired day is dropped"
    );
    assert_eq!(
        done.default_rows_deleted, 1,
        "the expired default-partition row"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox_history")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 301, "today's 300 and yesterday's row stay");
}

/// Inserts a history row published `days_ago` days ago, as the relay's archive insert does.
async fn history_row(pool: &sqlx::PgPool, days_ago: f64) {
    sqlx::query(
        "INSERT INTO postal.outbox_history (seq, event_id, topic, event_key, event_type,
             schema_version, occurred_at, content_type, payload, headers, attempts,
             created_at, published_at)
         VALUES (0, gen_random_uuid(), 't', 'k', 'e', 1, now(), 'application/json', '',
                 '{}', 0, now(), now() - $1 * interval '1 day')",
    )
    .bind(days_ago)
    .execute(pool)
    .await
    .unwrap();
}

/// Guarantee (history maintenance cannot wedge): when the default partition already holds
/// rows of today and of an unexpired earlier day (archived before the first maintenance, or
/// after a failed one), maintenance gives those days and tomorrow partitions of their own and
/// moves the rows into them; expired rows are deleted. (Before, creating today's partition
/// failed with "updated partition constraint for default partition would be violated", and
/// tomorrow's was never created either, run after run.)
#[tokio::test]
async fn history_maintenance_moves_default_rows_into_partitions_of_their_days() {
    let db = services().await.fresh_db().await;
    for days in [0.0, 0.0, 1.0, 10.0] {
        history_row(&db.pool, days).await;
    }
    let retention = Duration::from_secs(3 * 86_400);
    let done = postal_producer::retention::maintain_history(&db.pool, retention)
        .await
        .unwrap()
        .expect("lock free");
    assert!(done.ok(), "every step succeeded: {:?}", done.failed);
    let day = |offset: i32| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT 'outbox_history_' || to_char((now() AT TIME ZONE 'UTC')::date + $1, 'YYYYMMDD')",
            )
            .bind(offset)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let (yesterday, today, tomorrow) = (day(-1).await, day(0).await, day(1).await);
    let mut created = done.created.clone();
    created.sort();
    assert_eq!(created, vec![yesterday.clone(), today.clone(), tomorrow]);
    assert_eq!(done.moved_rows, 3, "today's two rows and yesterday's");
    assert_eq!(done.default_rows_deleted, 1, "the expired row");
    let placed: Vec<(String, i64)> = sqlx::query_as(
        "SELECT tableoid::regclass::text, count(*) FROM postal.outbox_history GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        placed,
        vec![
            (format!("postal.{yesterday}"), 1),
            (format!("postal.{today}"), 2)
        ]
    );
    // And again: nothing left to do.
    let again = postal_producer::retention::maintain_history(&db.pool, retention)
        .await
        .unwrap()
        .expect("lock free");
    assert!(again.ok() && again.created.is_empty() && again.moved_rows == 0);
}

/// Guarantee (history maintenance beside live archive inserts): while tasks keep inserting
/// archive rows of today and of two earlier unexpired days into `postal.outbox_history` (as
/// the relay's archive insert does), some of them waiting in the default partition,
/// maintenance gives those days and tomorrow partitions of their own within a bounded number
/// of runs without a failed step; no insert fails; every inserted row is in the history
/// exactly once; and the default partition keeps no row of the days that got partitions.
#[tokio::test]
async fn history_maintenance_beside_live_archive_inserts_loses_and_fails_no_insert() {
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Mutex};
    let db = services().await.fresh_db().await;
    // Rows of three unexpired days wait in the default partition.
    for days in [0.0, 1.0, 2.0] {
        history_row(&db.pool, days).await;
    }
    let retention = Duration::from_secs(5 * 86_400);
    let stop = Arc::new(AtomicBool::new(false));
    let inserted: Arc<Mutex<Vec<uuid::Uuid>>> = Default::default();
    let failures: Arc<Mutex<Vec<String>>> = Default::default();
    let slowest: Arc<Mutex<Duration>> = Default::default();
    let inserters: Vec<_> = (0..4)
        .map(|task| {
            let (pool, stop) = (db.pool.clone(), stop.clone());
            let (inserted, failures) = (inserted.clone(), failures.clone());
            let slowest = slowest.clone();
            tokio::spawn(async move {
                let mut n = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let id = uuid::Uuid::now_v7();
                    let t = std::time::Instant::now();
                    let days_ago = f64::from((n + task) % 3);
                    n += 1;
                    let res = sqlx::query(
                        "INSERT INTO postal.outbox_history (seq, event_id, topic, event_key,
                             event_type, schema_version, occurred_at, content_type, payload,
                             headers, attempts, created_at, published_at)
                         VALUES (0, $1, 't', 'k', 'e', 1, now(), 'application/json', '', '{}',
                                 0, now(), now() - $2 * interval '1 day')",
                    )
                    .bind(id)
                    .bind(days_ago)
                    .execute(&pool)
                    .await;
                    {
                        let mut m = slowest.lock().unwrap();
                        *m = (*m).max(t.elapsed());
                    }
                    match res {
                        Ok(_) => inserted.lock().unwrap().push(id),
                        Err(e) => failures.lock().unwrap().push(e.to_string()),
                    }
                }
            })
        })
        .collect();
    let inserted_now = || inserted.lock().unwrap().len();
    wait::until(Duration::from_secs(30), "inserts under way", || {
        let n = inserted_now();
        async move { n >= 50 }
    })
    .await;
    let day = |offset: i32| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT 'outbox_history_' || to_char((now() AT TIME ZONE 'UTC')::date + $1, 'YYYYMMDD')",
            )
            .bind(offset)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let mut wanted = vec![day(-2).await, day(-1).await, day(0).await, day(1).await];
    wanted.sort();
    let mut created = Vec::new();
    let mut runs = Vec::new();
    for _ in 0..3 {
        let done = postal_producer::retention::maintain_history(&db.pool, retention)
            .await
            .unwrap()
            .expect("lock free");
        created.extend(done.created.iter().cloned());
        runs.push(done.failed.clone());
        if done.ok() {
            break;
        }
    }
    assert!(
        runs.last().is_some_and(|f| f.is_empty()),
        "maintenance failed steps in each of {} runs: {runs:?}",
        runs.len()
    );
    created.sort();
    assert_eq!(created, wanted, "each day got its partition once");
    // Inserts go on after the partitions exist.
    let after = inserted_now() + 50;
    wait::until(Duration::from_secs(30), "inserts after maintenance", || {
        let n = inserted_now();
        async move { n >= after }
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for t in inserters {
        t.await.unwrap();
    }
    eprintln!(
        "archive inserts beside history maintenance: {} inserted, slowest {:?}",
        inserted.lock().unwrap().len(),
        *slowest.lock().unwrap()
    );
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} archive inserts failed beside maintenance, first: {:?}",
        failures.len(),
        failures.first()
    );
    let ids = inserted.lock().unwrap().clone();
    let copies: Vec<i64> = sqlx::query_scalar(
        "SELECT count(h.event_id) FROM unnest($1::uuid[]) AS i(id)
         LEFT JOIN postal.outbox_history h ON h.event_id = i.id GROUP BY i.id",
    )
    .bind(&ids)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(copies.len(), ids.len());
    let lost = copies.iter().filter(|&&c| c == 0).count();
    let doubled = copies.iter().filter(|&&c| c > 1).count();
    assert_eq!(
        (lost, doubled),
        (0, 0),
        "of {} inserted rows: (missing, present more than once)",
        ids.len()
    );
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox_history")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(total as usize, ids.len() + 3, "no other row appeared");
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM postal.outbox_history_default
         WHERE published_at >= ((now() AT TIME ZONE 'UTC')::date - 2)::timestamp AT TIME ZONE 'UTC'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        left, 0,
        "rows of partitioned days left in the default partition"
    );
}

/// Guarantee (maintenance never queues behind a long reader): with a reader holding the
/// history open (as `pg_dump` does) and a row of today in the default partition, maintenance
/// gives up the step that needs the exclusive lock after its `lock_timeout` and reports it,
/// instead of waiting behind the reader (and making every archive insert queue behind it);
/// once the reader is gone, the next run does it. (Before, the step waited as long as the
/// reader ran.)
#[tokio::test]
async fn history_maintenance_gives_up_a_step_behind_a_long_reader_and_does_it_later() {
    let db = services().await.fresh_db().await;
    history_row(&db.pool, 0.0).await;
    let retention = Duration::from_secs(3 * 86_400);
    let mut reader = db.pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM postal.outbox_history")
        .execute(&mut *reader)
        .await
        .unwrap();
    // Archive inserts go on meanwhile (one every 20 ms); the slowest one is reported.
    let stop = Arc::new(AtomicBool::new(false));
    let inserter = tokio::spawn({
        let (pool, stop) = (db.pool.clone(), stop.clone());
        async move {
            let mut slowest = Duration::ZERO;
            while !stop.load(Ordering::SeqCst) {
                let started = std::time::Instant::now();
                history_row(&pool, 0.0).await;
                slowest = slowest.max(started.elapsed());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            slowest
        }
    });
    let blocked = tokio::time::timeout(
        Duration::from_secs(60),
        postal_producer::retention::maintain_history(&db.pool, retention),
    )
    .await
    .expect("maintenance returns while the reader still runs")
    .unwrap()
    .expect("lock free");
    stop.store(true, Ordering::SeqCst);
    let slowest = inserter.await.unwrap();
    eprintln!("archive inserts while maintenance waited behind a reader: slowest {slowest:?}");
    assert!(
        slowest < Duration::from_secs(5),
        "an archive insert waited {slowest:?} behind maintenance"
    );
    assert!(!blocked.ok(), "the step behind the reader is reported");
    assert!(
        blocked.failed.iter().any(|f| f.contains("lock timeout")),
        "{:?}",
        blocked.failed
    );
    // An archive insert of the relay is not held up meanwhile.
    history_row(&db.pool, 0.0).await;
    reader.rollback().await.unwrap();
    let done = postal_producer::retention::maintain_history(&db.pool, retention)
        .await
        .unwrap()
        .expect("lock free");
    assert!(done.ok(), "{:?}", done.failed);
    let in_default: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox_history_default")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(in_default, 0, "today's rows moved once the reader was gone");
}
