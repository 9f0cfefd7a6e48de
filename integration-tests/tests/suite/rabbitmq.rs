//! The relay publishing to a real RabbitMQ (a private node from Debian's `rabbitmq-server`, or
//! `AMQP_URL`): confirms, crash between confirm and mark, broker restart, unroutable and
//! oversized events, and one relay serving Kafka and RabbitMQ topics at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use postal_integration_tests::rabbit::{self, PrivateRabbit, Rabbit};
use postal_integration_tests::{kafka, services, unique, wait};
use postal_producer::{
    enqueue, ContentType, NewEvent, RabbitConfig, RabbitTransport, RelayConfig, Router, Transport,
};
use sqlx::PgPool;

use crate::common::{
    fast_config, kafka_transport, outbox_count, Counting, FailureCounts, RunningRelay,
};
use crate::relay::seed;

fn transport(url: &str) -> RabbitTransport {
    let mut cfg = RabbitConfig::new(url);
    // Within half the tests' 3 s lease.
    cfg.confirm_timeout = Duration::from_secs(1);
    RabbitTransport::new(cfg).expect("rabbit transport")
}

fn id_counts(messages: &[rabbit::Message]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for msg in messages {
        *m.entry(msg.message_id.clone().unwrap_or_default())
            .or_insert(0) += 1;
    }
    m
}

async fn parked(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT event_key, coalesce(last_error, '') FROM postal.outbox WHERE status = 'failed' ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Guarantee: every committed event arrives once, confirmed, as a persistent message whose
/// AMQP message id is the event id, with the CloudEvents headers, routed by event type, and per
/// key in outbox order.
#[tokio::test]
async fn events_arrive_with_confirms_headers_and_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mq = Rabbit::get().await;
    let topic = unique("rmq");
    let queue = rabbit::bind_queue(&mq.url(), &topic, "#").await;
    let ids = seed(&db.pool, &topic, 2000, 20).await;
    let relay = RunningRelay::start(&db.pool, transport(&mq.url()), fast_config());
    wait::until(Duration::from_secs(60), "outbox drained", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    let stats = relay.stop().await;
    assert_eq!(stats.published, 2000);
    let messages = rabbit::read_all(&mq.url(), &queue, 2000, Duration::from_secs(30)).await;
    let counts = id_counts(&messages);
    assert_eq!(
        counts.keys().cloned().collect::<BTreeSet<_>>(),
        ids,
        "nothing lost"
    );
    assert!(counts.values().all(|&c| c == 1), "each published once");
    let mut last_seq: BTreeMap<String, i64> = BTreeMap::new();
    for m in &messages {
        assert_eq!(m.delivery_mode, Some(2), "persistent");
        assert_eq!(m.routing_key, "e", "routing key = event type");
        assert_eq!(m.kind.as_deref(), Some("e"));
        assert_eq!(m.content_type.as_deref(), Some("application/json"));
        assert_eq!(m.header("ce_id"), m.message_id.as_deref());
        assert_eq!(m.header("ce_specversion"), Some("1.0"));
        assert_eq!(m.header("ce_type"), Some("e"));
        assert!(m.header("ce_time").is_some() && m.header("ce_source").is_some());
        let key = m.header("ce_subject").expect("subject = key").to_owned();
        let seq: i64 = m.header("ce_postalseq").unwrap().parse().unwrap();
        let prev = last_seq.insert(key.clone(), seq);
        assert!(
            prev.is_none_or(|p| p < seq),
            "key {key}: {prev:?} then {seq}"
        );
        serde_json::from_slice::<serde_json::Value>(&m.body).expect("JSON body");
    }
}

/// Guarantee: an event no queue is bound for (returned as unroutable) and an event over the
/// size limit are parked with their reasons; the unroutable one only after its attempts, each
/// holding back only its own key while other keys flow.
#[tokio::test]
async fn unroutable_and_oversized_events_are_parked_with_reason() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mq = Rabbit::get().await;
    let routed = unique("rmq-routed");
    let queue = rabbit::bind_queue(&mq.url(), &routed, "order.*").await;
    let mut conn = db.pool.acquire().await.unwrap();
    enqueue(
        &mut conn,
        NewEvent::json(routed.as_str(), "lost-key", "invoice.created", &1).unwrap(),
    )
    .await
    .unwrap();
    enqueue(
        &mut conn,
        NewEvent::bytes(
            routed.as_str(),
            "big-key",
            "order.created",
            ContentType::new("application/octet-stream").unwrap(),
            vec![1u8; 300_000],
        )
        .unwrap(),
    )
    .await
    .unwrap();
    let mut ok = BTreeSet::new();
    for i in 0..50 {
        let id = enqueue(
            &mut conn,
            NewEvent::json(routed.as_str(), format!("k{}", i % 5), "order.created", &i).unwrap(),
        )
        .await
        .unwrap();
        ok.insert(id.to_string());
    }
    let mut cfg = RabbitConfig::new(mq.url());
    cfg.confirm_timeout = Duration::from_secs(1);
    cfg.max_message_bytes = 100_000;
    let counts = FailureCounts::default();
    let transport = Counting {
        inner: RabbitTransport::new(cfg).unwrap(),
        counts: counts.clone(),
    };
    let relay = RunningRelay::start(
        &db.pool,
        transport,
        RelayConfig {
            max_attempts: 3,
            ..fast_config()
        },
    );
    wait::until(Duration::from_secs(60), "both parked", || async {
        parked(&db.pool).await.len() == 2
    })
    .await;
    wait::until(Duration::from_secs(30), "the rest published", || async {
        outbox_count(&db.pool).await == 2
    })
    .await;
    relay.stop().await;
    let p = parked(&db.pool).await;
    assert_eq!(p[0].0, "lost-key");
    assert!(p[0].1.contains("unroutable"), "{}", p[0].1);
    assert_eq!(p[1].0, "big-key");
    assert!(p[1].1.contains("exceeds"), "{}", p[1].1);
    assert!(
        counts.other.load(Ordering::Relaxed) >= 4,
        "the unroutable event used up its 3 attempts, the oversized one failed once"
    );
    let messages = rabbit::read_all(&mq.url(), &queue, 50, Duration::from_secs(30)).await;
    let seen: BTreeSet<String> = messages
        .iter()
        .filter_map(|m| m.message_id.clone())
        .collect();
    assert_eq!(seen, ok, "other keys flowed");
}

/// Guarantee: a message RabbitMQ nacks (here: its queue is full and rejects publishes) is a
/// failed attempt with the reason recorded; after `max_attempts` it is parked, holding back the
/// later events of its key only, while another key's event on an open exchange flows.
#[tokio::test]
async fn nacked_event_is_retried_then_parked_with_reason() {
    use lapin::types::{AMQPValue, FieldTable};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mq = Rabbit::get().await;
    let full = unique("rmq-full");
    let open = unique("rmq-open");
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    rabbit::bind_queue_with(&mq.url(), &full, "#", args).await;
    let open_queue = rabbit::bind_queue(&mq.url(), &open, "#").await;
    let mut conn = db.pool.acquire().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            enqueue(
                &mut conn,
                NewEvent::json(full.as_str(), "k", "e", &i).unwrap(),
            )
            .await
            .unwrap(),
        );
    }
    let other = enqueue(
        &mut conn,
        NewEvent::json(open.as_str(), "other", "e", &0).unwrap(),
    )
    .await
    .unwrap();
    let relay = RunningRelay::start(
        &db.pool,
        transport(&mq.url()),
        RelayConfig {
            max_attempts: 2,
            ..fast_config()
        },
    );
    wait::until(
        Duration::from_secs(60),
        "the nacked event parked",
        || async { parked(&db.pool).await.len() == 1 },
    )
    .await;
    relay.stop().await;
    let p = parked(&db.pool).await;
    assert!(p[0].1.contains("nacked"), "{}", p[0].1);
    let (first_status, third_status): (Option<String>, Option<String>) = (
        sqlx::query_scalar("SELECT status FROM postal.outbox WHERE event_id = $1")
            .bind(ids[0].as_uuid())
            .fetch_optional(&db.pool)
            .await
            .unwrap(),
        sqlx::query_scalar("SELECT status FROM postal.outbox WHERE event_id = $1")
            .bind(ids[2].as_uuid())
            .fetch_optional(&db.pool)
            .await
            .unwrap(),
    );
    assert_eq!(
        first_status, None,
        "the first event was confirmed into the queue"
    );
    assert_eq!(
        third_status.as_deref(),
        Some("pending"),
        "the key's later event waits"
    );
    let messages = rabbit::read_all(&mq.url(), &open_queue, 1, Duration::from_secs(30)).await;
    assert_eq!(
        messages[0].message_id,
        Some(other.to_string()),
        "the other key flowed"
    );
}

/// Guarantee: a relay that dies after RabbitMQ confirmed but before marking loses nothing: its
/// claim ends with it, and the events are published again under the same message ids.
#[tokio::test]
async fn relay_killed_between_confirm_and_mark_republishes_same_message_id() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mq = Rabbit::get().await;
    let topic = unique("rmq-crash");
    let queue = rabbit::bind_queue(&mq.url(), &topic, "#").await;
    let ids = seed(&db.pool, &topic, 300, 30).await;
    let mut claimed = crate::common::claim_as_doomed_relay(&db.pool).await;
    let batch = claimed.take_events();
    assert_eq!(batch.len(), 300);
    let t = transport(&mq.url());
    let acks = t.send(&batch).await.await;
    assert!(acks.iter().all(Result::is_ok), "all confirmed: {acks:?}");
    drop(t);
    // Dies before recording: the claim's transaction ends without a commit.
    drop(claimed);
    let relay = RunningRelay::start(&db.pool, transport(&mq.url()), fast_config());
    wait::until(Duration::from_secs(30), "outbox drained", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    let messages = rabbit::read_all(&mq.url(), &queue, 600, Duration::from_secs(30)).await;
    let counts = id_counts(&messages);
    assert_eq!(
        counts.keys().cloned().collect::<BTreeSet<_>>(),
        ids,
        "nothing lost"
    );
    assert!(
        counts.values().all(|&c| c == 2),
        "each republished once, under the same message id"
    );
}

/// Guarantee: RabbitMQ stopped for longer than every retry budget and restarted: nothing is
/// parked, nothing lost; the backlog drains by itself once it is back.
#[tokio::test]
async fn rabbitmq_stopped_and_restarted_loses_nothing_parks_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mut mq = PrivateRabbit::start().await;
    let topic = unique("rmq-outage");
    let queue = rabbit::bind_queue(&mq.url(), &topic, "#").await;
    let mut ids = seed(&db.pool, &topic, 100, 10).await;
    let counts = FailureCounts::default();
    let transport = Counting {
        inner: transport(&mq.url()),
        counts: counts.clone(),
    };
    let relay = RunningRelay::start(
        &db.pool,
        transport,
        RelayConfig {
            max_attempts: 2,
            ..fast_config()
        },
    );
    wait::until(
        Duration::from_secs(30),
        "first events published",
        || async { outbox_count(&db.pool).await == 0 },
    )
    .await;
    mq.stop();
    ids.extend(seed(&db.pool, &topic, 500, 10).await);
    wait::until(
        Duration::from_secs(60),
        "failed rounds during the outage",
        || async { counts.unavailable.load(Ordering::Relaxed) >= 500 * 3 },
    )
    .await;
    assert!(parked(&db.pool).await.is_empty(), "an outage parks nothing");
    mq.restart().await;
    wait::until(
        Duration::from_secs(90),
        "backlog drained after RabbitMQ returned",
        || async { outbox_count(&db.pool).await == 0 },
    )
    .await;
    relay.stop().await;
    let messages = rabbit::read_all(&mq.url(), &queue, 600, Duration::from_secs(30)).await;
    let seen: BTreeSet<String> = messages
        .iter()
        .filter_map(|m| m.message_id.clone())
        .collect();
    assert_eq!(
        seen, ids,
        "everything arrived (the first 100 survived the restart on disk)"
    );
    assert_eq!(
        counts.other.load(Ordering::Relaxed),
        0,
        "no failure was counted against an event"
    );
}

/// Guarantee: with a destination per topic, one relay publishes Kafka topics to Kafka and
/// RabbitMQ topics to RabbitMQ, each event to its own destination only; a topic without a
/// destination is parked with a clear reason.
#[tokio::test]
async fn one_relay_serves_kafka_and_rabbitmq_topics() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mq = Rabbit::get().await;
    let to_kafka = unique("mixed-k");
    let to_rabbit = unique("mixed-r");
    let nowhere = unique("mixed-none");
    let queue = rabbit::bind_queue(&mq.url(), &to_rabbit, "#").await;
    let kafka_ids = seed(&db.pool, &to_kafka, 300, 10).await;
    let rabbit_ids = seed(&db.pool, &to_rabbit, 300, 10).await;
    seed(&db.pool, &nowhere, 1, 1).await;
    let router = Router::new()
        .destination("kafka", kafka_transport(&svc.bootstrap))
        .destination("rabbitmq", transport(&mq.url()))
        .route(format!("{to_kafka}*"), "kafka")
        .unwrap()
        .route(to_rabbit.as_str(), "rabbitmq")
        .unwrap();
    let relay = RunningRelay::start(&db.pool, router, fast_config());
    wait::until(
        Duration::from_secs(60),
        "routed events published",
        || async { outbox_count(&db.pool).await == 1 && parked(&db.pool).await.len() == 1 },
    )
    .await;
    relay.stop().await;
    let p = parked(&db.pool).await;
    assert!(p[0].1.contains("no destination"), "{}", p[0].1);
    let records = kafka::read_all(&svc.bootstrap, &to_kafka, 300, Duration::from_secs(30)).await;
    assert_eq!(kafka::event_ids(&records), kafka_ids);
    let messages = rabbit::read_all(&mq.url(), &queue, 300, Duration::from_secs(30)).await;
    let seen: BTreeSet<String> = messages
        .iter()
        .filter_map(|m| m.message_id.clone())
        .collect();
    assert_eq!(seen, rabbit_ids);
}
