//! Odd input moves on: a handler with an empty scope, a stored header that is not a string or is
//! longer than AMQP allows, and an unpublishable dead letter neither stall their partition or
//! relay nor hold back other events; a forced reset of a live group neither re-applies nor skips.
//! (The reproductions of an adversarial review, each of which failed before its fix.)

use std::time::Duration;

use postal_consumer::{BoxFuture, Consumer, Event, Handler, HandlerError};
use postal_integration_tests::{services, unique, wait};
use serde_json::json;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects_table, produce, RawRecord, RunningConsumer,
};

const WAIT: Duration = Duration::from_secs(60);

/// A hand-written handler (the `Handler` trait is public for exactly this) whose dedup scope is
/// chosen at start-up, e.g. read from a setting that may be left empty.
struct Scoped {
    scope: String,
    name: String,
}

impl Handler for Scoped {
    type Payload = serde_json::Value;
    fn consumer(&self) -> &str {
        &self.scope
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (event_id, n, consumer) VALUES ($1, 0, $2)")
                .bind(event.id.as_uuid())
                .bind(&self.scope)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    }
}

/// Guarantee: one runtime is one dedup scope — a handler of another scope is refused at
/// build ("one runtime is one consumer") — so an event's fate does not depend on whether it is
/// processed alone or in a batch.
///
/// Broken: a hand-written handler whose scope is empty, routed first, leaves
/// `ConsumerConfig::consumer` empty, so the next handler's scope ("billing") becomes the
/// runtime's without any check against the first, and `build` succeeds. The single-record path
/// then deduplicates the first handler's events as `""` (`route.consumer()`, refused by the
/// table's CHECK: retried, then dead-lettered as `retries_exhausted`), the batch path as
/// `"billing"` (`config.consumer`: applied). The same handler's events are dead-lettered when
/// they arrive alone and applied when they arrive together (observed: the lone event
/// dead-lettered, the 20 of the burst applied).
#[tokio::test]
async fn empty_scope_handler_first_gives_two_scopes() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("scope2");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    // The configuration leaves the scope to the handlers (ConsumerConfig::new's default).
    let mut config = consumer_config(&svc.bootstrap, &group, "");
    config.max_batch = 100;
    config.max_attempts = 2;
    let built = Consumer::builder(db.pool.clone(), config)
        .on(
            &topic,
            "job",
            Scoped {
                scope: String::new(),
                name: "jobs".into(),
            },
        )
        .on(
            &topic,
            "other",
            Scoped {
                scope: "billing".into(),
                name: "other".into(),
            },
        )
        .build();
    let consumer = match built {
        // The guarantee holds if the runtime refuses the two scopes.
        Err(_) => return,
        Ok(c) => c,
    };
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    let e = Uuid::now_v7();
    // First copy alone: the single-record path.
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[RawRecord::event(e, "k", "job", json!({"n": 1}))],
    )
    .await;
    wait::until(WAIT, "first copy finished", || {
        let s = stats.snapshot();
        async move { s.applied + s.dead_letters == 1 }
    })
    .await;
    let alone = stats.snapshot();
    // The relay republishes it (a lost acknowledgement) amid other events: a batch.
    let mut burst: Vec<RawRecord> = (0..20)
        .map(|i| RawRecord::event(Uuid::now_v7(), "k", "job", json!({"n": i})))
        .collect();
    burst.insert(10, RawRecord::event(e, "k", "job", json!({"n": 1})));
    produce(&svc.bootstrap, &topic, None, &burst).await;
    wait::until(WAIT, "burst finished", || {
        let s = stats.snapshot();
        async move { s.applied + s.duplicates + s.dead_letters == 22 }
    })
    .await;
    let end = stats.snapshot();
    running.stop().await;
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
        .bind(e)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let dead: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters WHERE event_id = $1")
            .bind(e)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let scopes: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT consumer_name FROM postal.processed_events ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    panic!(
        "a runtime of two dedup scopes (\"\" and \"billing\") was built; event {e}: applied {applied} time(s), dead-lettered {dead} time(s); \
         alone: applied {} dead {}; at the end: applied {} dead {} duplicates {}; scopes in processed_events: {scopes:?}",
        alone.applied, alone.dead_letters, end.applied, end.dead_letters, end.duplicates
    );
}

/// Guarantee (as for a stored reserved or ill-named `ce_` header): an outbox row written around
/// `postal.enqueue` with headers Postal cannot publish is parked with a reason, and the other
/// events flow; nothing stalls silently.
///
/// Broken: a stored header whose value is a JSON number (`postal.enqueue` refuses it; the
/// table's CHECK allows any JSON object). The claim decodes every row's headers as strings,
/// so every claim that reaches the row fails ("claim failed (database unreachable?)"), for
/// good: the row is never parked and stays pending without a reason, and the events of every
/// key its claim lane covers — not only its own key — are never published.
#[tokio::test]
async fn a_stored_row_with_a_non_string_header_value_does_not_stall_the_relay() {
    a_stored_row_with_a_non_string_header_value_does_not_stall_the_relay_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the test's rows).
#[tokio::test]
async fn a_stored_row_with_a_non_string_header_value_does_not_stall_the_relay_wal() {
    a_stored_row_with_a_non_string_header_value_does_not_stall_the_relay_with(true).await;
}

async fn a_stored_row_with_a_non_string_header_value_does_not_stall_the_relay_with(wal: bool) {
    use postal_producer::NewEvent;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("hostile-num");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let odd = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, headers)
         VALUES ($1, $2, 'k1', 'audit.noop', '{}'::bytea, '{\"tenant\": 5}'::jsonb)",
    )
    .bind(odd)
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut fine = Vec::new();
    for i in 0..40 {
        let key = format!("other-{i}");
        fine.push(
            postal_producer::enqueue(
                &mut conn,
                NewEvent::json(topic.as_str(), key.as_str(), "job", &i).unwrap(),
            )
            .await
            .unwrap()
            .as_uuid(),
        );
    }
    drop(conn);
    let relay = crate::common::RunningRelay::start(
        &db.pool,
        crate::common::kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    let outcome = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let left: Vec<(Uuid, String, Option<String>)> = sqlx::query_as(
                "SELECT event_id, status, last_error FROM postal.outbox ORDER BY seq",
            )
            .fetch_all(&db.pool)
            .await
            .unwrap();
            let odd_parked = left.iter().any(|(id, s, _)| *id == odd && s == "failed");
            let stuck = left.iter().filter(|(id, _, _)| fine.contains(id)).count();
            if odd_parked && stuck == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let left: Vec<(Uuid, String, Option<String>)> =
        sqlx::query_as("SELECT event_id, status, last_error FROM postal.outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    relay.stop().await;
    let stuck = left.iter().filter(|(id, _, _)| fine.contains(id)).count();
    let odd_state = left.iter().find(|(id, _, _)| *id == odd);
    assert!(
        outcome.is_ok(),
        "after 30 s: the odd row {odd_state:?}; {stuck} of the 40 other keys' events still pending"
    );
}

/// Guarantee: one configuration vocabulary — a value of a shared variable that `postal relay`
/// refuses as unsafe is refused by the consumer too, rather than silently taken.
///
/// Broken: `POSTAL_BACKOFF_BASE=0s` (or a base above `POSTAL_BACKOFF_MAX`) is refused by
/// `RelayConfig::with_vars` ("backoff base must be positive and not above the backoff max") but
/// `ConsumerConfig::with_vars` takes it: with a zero base every retry waits 0 ms, so a
/// retryable failure (a lock timeout, a flaky dependency) uses up `max_attempts` within
/// milliseconds and the event is dead-lettered, and a database outage is retried in a tight
/// loop (`Unavailable` never uses up an attempt).
#[test]
fn a_backoff_the_relay_refuses_is_refused_by_the_consumer() {
    for vars in [
        &[("POSTAL_BACKOFF_BASE", "0s")][..],
        &[("POSTAL_BACKOFF_BASE", "10s"), ("POSTAL_BACKOFF_MAX", "1s")][..],
    ] {
        let var = |name: &str| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        };
        let relay = postal_producer::RelayConfig::default().with_vars(var);
        assert!(relay.is_err(), "the relay refuses {vars:?}");
        let consumer = postal_consumer::ConsumerConfig::new("127.0.0.1:9092", "g").with_vars(var);
        assert!(
            consumer.is_err(),
            "the consumer takes {vars:?}, which the relay refuses ({}): backoff {:?}",
            relay.unwrap_err(),
            consumer.unwrap().backoff
        );
    }
}

/// Guarantee: every dead letter reaches its dead-letter topic (or waits only for its own
/// cause): one dead letter that cannot be published does not hold back the others.
///
/// Broken: a topic name of 246 to 249 characters is valid (Kafka's and Postal's limit is 249),
/// its dead-letter topic (`<topic>.dlq`, 250 to 253) is not. Every publishing pass takes this
/// consumer's oldest 100 unpublished dead letters and first creates their topics; the invalid
/// name fails the whole pass, so no later dead letter of this consumer — of any topic — is
/// published while that one waits (it always does).
#[tokio::test]
async fn one_unpublishable_dead_letter_does_not_hold_back_the_others() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let short = unique("hol");
    let long = format!("{short}-{}", "x".repeat(249 - short.len() - 1));
    assert_eq!(long.len(), 249);
    create_topic(&svc.bootstrap, &short, 1).await;
    create_topic(&svc.bootstrap, &long, 1).await;
    let group = unique("g");
    let consumer = Consumer::builder(
        db.pool.clone(),
        consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER),
    )
    .state(crate::handlers::Probe::default())
    .on(&long, "job", crate::handlers::apply)
    .on(&short, "job", crate::handlers::apply)
    .build()
    .expect("valid consumer");
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    // An event of a type no handler takes: dead-lettered (the default for unknown types).
    produce(
        &svc.bootstrap,
        &long,
        None,
        &[RawRecord::event(
            Uuid::now_v7(),
            "k",
            "unknown",
            json!({"n": 1}),
        )],
    )
    .await;
    wait::until(WAIT, "the first dead letter recorded", || {
        let s = stats.snapshot();
        async move { s.dead_letters == 1 }
    })
    .await;
    let later = Uuid::now_v7();
    produce(
        &svc.bootstrap,
        &short,
        None,
        &[RawRecord::event(later, "k", "unknown", json!({"n": 2}))],
    )
    .await;
    wait::until(
        Duration::from_secs(30),
        "the other topic's dead letter published to its dead-letter topic",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM postal.dead_letters
                 WHERE event_id = $1 AND published_at IS NOT NULL)",
            )
            .bind(later)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        },
    )
    .await;
    running.stop().await;
}

/// Guarantee: a setting that would keep every dead letter from being published is refused at
/// start, as an empty dead-letter suffix is.
///
/// Broken: `validate` checks only that `dlq_suffix` is not empty; a suffix with a character a
/// Kafka topic name may not hold (a space, a `/`) is taken, and every dead-letter topic
/// (`<topic><suffix>`) then fails to be created, for every dead letter, for good.
#[test]
fn a_dead_letter_suffix_that_makes_no_valid_topic_is_refused() {
    for suffix in [" dlq", "/dlq", ".dlq!"] {
        let mut c = postal_consumer::ConsumerConfig::new("127.0.0.1:9092", "g");
        c.dlq_suffix = suffix.into();
        assert!(
            c.validate().is_err(),
            "dead-letter suffix {suffix:?} accepted: no dead-letter topic named with it can exist"
        );
    }
}

/// Guarantee: a row parked for a stored header Postal refuses (`ce_Tenant-Id`: a `ce_` name
/// with a character other than letters and digits, in mixed case) holds back the later events
/// of its key — they are not published ahead of it — while other keys flow.
#[tokio::test]
async fn a_row_parked_for_its_header_holds_back_its_key() {
    a_row_parked_for_its_header_holds_back_its_key_with(false).await;
}

/// Guarantee: the same with a WAL relay (its slot created before the test's rows).
#[tokio::test]
async fn a_row_parked_for_its_header_holds_back_its_key_wal() {
    a_row_parked_for_its_header_holds_back_its_key_with(true).await;
}

async fn a_row_parked_for_its_header_holds_back_its_key_with(wal: bool) {
    use postal_producer::NewEvent;
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = unique("hdr-order");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let bad = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, headers)
         VALUES ($1, $2, 'k1', 'job', '{}'::bytea, jsonb_build_object('CE_Tenant-Id', 'acme'))",
    )
    .bind(bad)
    .bind(&topic)
    .execute(&db.pool)
    .await
    .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let after = postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k1", "job", &1).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    let relay = crate::common::RunningRelay::start(
        &db.pool,
        crate::common::kafka_transport(&svc.bootstrap),
        crate::wal_relay::config_for(&slot),
    );
    wait::until(WAIT, "the row parked", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM postal.outbox WHERE event_id = $1 AND status = 'failed')",
        )
        .bind(bad)
        .fetch_one(&db.pool)
        .await
        .unwrap()
    })
    .await;
    // Another key's event, enqueued after the park, published: the relay has moved on.
    let mut conn = db.pool.acquire().await.unwrap();
    let other = postal_producer::enqueue(
        &mut conn,
        NewEvent::json(topic.as_str(), "k2", "job", &2).unwrap(),
    )
    .await
    .unwrap();
    drop(conn);
    wait::until(WAIT, "the other key's event published", || async {
        !sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM postal.outbox WHERE event_id = $1)",
        )
        .bind(other.as_uuid())
        .fetch_one(&db.pool)
        .await
        .unwrap()
    })
    .await;
    relay.stop().await;
    let records = postal_integration_tests::kafka::read_all(
        &svc.bootstrap,
        &topic,
        1,
        Duration::from_secs(30),
    )
    .await;
    let ids: Vec<String> = records
        .iter()
        .filter_map(|r| r.header("ce_id").map(str::to_owned))
        .collect();
    assert_eq!(
        ids,
        vec![other.to_string()],
        "only the other key's event published"
    );
    let status: String = sqlx::query_scalar("SELECT status FROM postal.outbox WHERE event_id = $1")
        .bind(after.as_uuid())
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "pending", "the parked row's key is held");
}

/// Guarantee: an event with a user header the destination cannot carry is refused at enqueue
/// or parked with a reason; the other keys' events flow.
///
/// Broken: an AMQP header name is a short string (at most 255 bytes); `with_header` and
/// `enqueue` take a 300-byte name (letters only, no `ce_` prefix), and the RabbitMQ transport
/// converts each name with `ShortString::from`, which panics ("ShortString exceeds maximum
/// length") inside the relay's publish. Nothing is parked and nothing logged by Postal: the
/// event and the other events of its claim (4 of the 20 other keys here) stay pending.
#[tokio::test]
async fn a_header_name_longer_than_amqp_allows_is_refused_or_parked() {
    use postal_integration_tests::rabbit::{self, Rabbit};
    use postal_producer::{NewEvent, RabbitConfig, RabbitTransport};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let mq = Rabbit::get().await;
    let topic = unique("rmq-long-header");
    let _queue = rabbit::bind_queue(&mq.url(), &topic, "#").await;
    let long = "h".repeat(300);
    let event = NewEvent::json(topic.as_str(), "k0", "job", &0)
        .unwrap()
        .with_header(long.as_str(), "v");
    let Ok(event) = event else {
        return;
    };
    let mut conn = db.pool.acquire().await.unwrap();
    let odd = postal_producer::enqueue(&mut conn, event).await.unwrap();
    let mut others = Vec::new();
    for i in 1..=20 {
        let key = format!("k{i}");
        others.push(
            postal_producer::enqueue(
                &mut conn,
                NewEvent::json(topic.as_str(), key.as_str(), "job", &i).unwrap(),
            )
            .await
            .unwrap()
            .as_uuid(),
        );
    }
    drop(conn);
    let mut cfg = RabbitConfig::new(mq.url());
    cfg.confirm_timeout = Duration::from_secs(1);
    let relay = crate::common::RunningRelay::start(
        &db.pool,
        RabbitTransport::new(cfg).expect("rabbit transport"),
        crate::common::fast_config(),
    );
    let outcome = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let left: Vec<(Uuid, String)> =
                sqlx::query_as("SELECT event_id, status FROM postal.outbox")
                    .fetch_all(&db.pool)
                    .await
                    .unwrap();
            let others_left = left.iter().filter(|(id, _)| others.contains(id)).count();
            let odd_done = left
                .iter()
                .find(|(id, _)| *id == odd.as_uuid())
                .is_none_or(|(_, s)| s == "failed");
            if others_left == 0 && odd_done {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let left: Vec<(Uuid, String, Option<String>)> =
        sqlx::query_as("SELECT event_id, status, last_error FROM postal.outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    relay.kill().await;
    assert!(
        outcome.is_ok(),
        "after 30 s, still in the outbox: {:?}",
        left.iter()
            .map(|(id, s, e)| (
                id == &odd.as_uuid(),
                s.clone(),
                e.clone().map(|e| e.chars().take(200).collect::<String>())
            ))
            .collect::<Vec<_>>()
    );
}

/// Guarantee: a consumer runtime either refuses its configuration at build or, running, applies
/// or dead-letters every record (no partition held silently).
///
/// Probe: the only handler is a hand-written one whose dedup scope is empty (the configuration
/// leaves the scope to the handlers). `validate` refuses a blank scope but not an empty one;
/// `postal.processed_events` and `postal.dead_letters` both refuse `consumer_name = ''`.
#[tokio::test]
async fn a_runtime_whose_only_handler_has_an_empty_scope_is_refused_or_moves_on() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("scope0");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    let mut config = consumer_config(&svc.bootstrap, &group, "");
    config.max_attempts = 2;
    let built = Consumer::builder(db.pool.clone(), config)
        .on(
            &topic,
            "job",
            Scoped {
                scope: String::new(),
                name: "jobs".into(),
            },
        )
        .build();
    let consumer = match built {
        Err(_) => return,
        Ok(c) => c,
    };
    let running = RunningConsumer::start(consumer);
    let stats = running.stats.clone();
    produce(
        &svc.bootstrap,
        &topic,
        None,
        &[RawRecord::event(
            Uuid::now_v7(),
            "k",
            "job",
            json!({"n": 1}),
        )],
    )
    .await;
    wait::until(
        Duration::from_secs(30),
        "the record applied or dead-lettered",
        || {
            let s = stats.snapshot();
            async move { s.applied + s.dead_letters == 1 }
        },
    )
    .await;
    running.kill().await;
}

/// Guarantee: `postal consumer reset --force --execute` against a live group (its consumer
/// running and applying) neither re-applies nor skips: moved back to the earliest offset while
/// records keep arriving, every event is applied exactly once and every later one is applied.
/// (Observed: Kafka refuses the group-offset commit for a group with live members, so the
/// reset changes nothing and says so; the consumer goes on.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_reset_of_a_live_group_neither_reapplies_nor_skips() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("live-reset");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let group = unique("g");
    let batch = |from: i64, to: i64| -> Vec<RawRecord> {
        (from..to)
            .map(|n| RawRecord::event(Uuid::now_v7(), "k", "job", json!({"n": n})))
            .collect()
    };
    produce(&svc.bootstrap, &topic, None, &batch(0, 50)).await;
    let running = crate::common::start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &group, crate::handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    wait::until(WAIT, "the first 50 applied", || {
        let s = stats.snapshot();
        async move { s.applied == 50 }
    })
    .await;
    // Records keep arriving while the reset runs.
    let producing = tokio::spawn({
        let (b, t) = (svc.bootstrap.clone(), topic.clone());
        async move {
            for i in 0..10 {
                produce(&b, &t, None, &batch(50 + i * 10, 60 + i * 10)).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let out = std::process::Command::new(crate::procs::bin_dir().join("postal"))
        .args([
            "consumer",
            "reset",
            "--execute",
            "--force",
            "--group",
            &group,
            "--topic",
            &topic,
            "--to",
            "earliest",
        ])
        .env("DATABASE_URL", &db.url)
        .env("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap)
        .env("POSTAL_LOG", "warn")
        .output()
        .expect("run the postal CLI");
    // Kafka refuses a commit for a group with live members (UnknownMemberId): the reset then
    // says "nothing changed" — also a safe outcome. Either way the events are applied once.
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() || said.contains("nothing changed"),
        "reset: {said}"
    );
    producing.await.unwrap();
    wait::until(WAIT, "all 150 applied, the replayed ones dropped", || {
        let pool = db.pool.clone();
        async move { crate::common::effects(&pool).await.1 == 150 }
    })
    .await;
    // Whatever the replay still delivers is a duplicate.
    let s = stats.snapshot();
    running.stop().await;
    assert_eq!(
        crate::common::effects(&db.pool).await,
        (150, 150),
        "each event applied once (applied {}, duplicates {}, fenced {})",
        s.applied,
        s.duplicates,
        s.fenced
    );
}

/// Guarantee: `postal.enqueue` / `postal.enqueue_bytes` (the SQL producers' enqueue) refuse
/// what the Rust `enqueue` refuses, so that an event a producer was told is enqueued is not
/// parked later (holding back its key) or left unpublishable.
///
/// Broken before migration 31: the SQL functions checked only the reserved names and string
/// values. They took a
/// `ce_<name>` header whose name is not letters and digits (`ce_tenant-id`, refused by
/// `with_header` since c261a00; the relay parks the row, and the key's later events wait), and
/// a content type longer than 255 bytes (`ContentType::new` refuses it; an AMQP short string,
/// so the RabbitMQ transport panics on it as on a long header name).
#[tokio::test]
async fn the_sql_enqueue_refuses_what_the_rust_enqueue_refuses() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let rust_header = postal_producer::NewEvent::json("t", "k", "e", &1)
        .unwrap()
        .with_header("ce_tenant-id", "acme");
    assert!(
        rust_header.is_err(),
        "control: the Rust enqueue refuses the header"
    );
    let long_type = format!("application/{}", "x".repeat(300));
    assert!(
        postal_shared::ContentType::new(long_type.as_str()).is_err(),
        "control: the Rust content type refuses it"
    );
    let header = sqlx::query(
        "SELECT postal.enqueue('t', 'k', 'e', '{}'::jsonb, '{\"ce_tenant-id\": \"acme\"}'::jsonb)",
    )
    .execute(&db.pool)
    .await;
    let content_type =
        sqlx::query("SELECT postal.enqueue_bytes('t', 'k', 'e', $1, '\\x00'::bytea)")
            .bind(&long_type)
            .execute(&db.pool)
            .await;
    assert!(
        header.is_err() && content_type.is_err(),
        "the SQL enqueue took: ce_tenant-id header: {}; 300-byte content type: {}",
        header.is_ok(),
        content_type.is_ok()
    );
}
