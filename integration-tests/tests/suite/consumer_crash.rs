//! A consumer killed (SIGKILL) after its database commits and before any Kafka offset commit
//! resumes from the offsets stored beside its effects.

use std::process::{Command, Stdio};
use std::time::Duration;

use postal_consumer::Consumer;
use postal_integration_tests::{services, unique, wait};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;
use uuid::Uuid;

use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, start_apply, RawRecord,
};
use crate::handlers::{self, apply};

const WAIT: Duration = Duration::from_secs(90);

fn events(from: i64, to: i64) -> Vec<RawRecord> {
    (from..to)
        .map(|n| {
            RawRecord::event(
                Uuid::now_v7(),
                &format!("k{}", n % 7),
                "job",
                json!({"n": n}),
            )
        })
        .collect()
}

/// Guarantee: a consumer process killed with SIGKILL mid-stream, after committing effects to
/// the database but before committing any offset to Kafka, applies nothing twice after a
/// restart —
/// the new member seeks to the stored offsets, so not even a duplicate delivery reaches the
/// dedup table — and then processes the rest and new events.
#[tokio::test]
async fn killed_after_db_commit_replays_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    let topic = unique("crash");
    let group = unique("g");
    create_topic(&svc.bootstrap, &topic, 2).await;
    produce(&svc.bootstrap, &topic, None, &events(0, 200)).await;

    // The child is this test binary running `child_consumer_process`.
    let child_log = std::env::temp_dir().join(format!("{topic}.child.log"));
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "consumer_crash::child_consumer_process",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("POSTAL_CHILD_DB", &db.url)
        .env("POSTAL_CHILD_BOOTSTRAP", &svc.bootstrap)
        .env("POSTAL_CHILD_TOPIC", &topic)
        .env("POSTAL_CHILD_GROUP", &group)
        .env("POSTAL_TEST_LOG", "postal_consumer=info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&child_log).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while effects(&db.pool).await.1 < 100 {
        if std::time::Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            panic!(
                "the child consumer did not apply 100 events; its log:\n{}",
                std::fs::read_to_string(&child_log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap(); // SIGKILL, mid-stream
    child.wait().unwrap();
    let (rows, before) = effects(&db.pool).await;
    assert_eq!(rows, before, "nothing doubled before the kill");
    assert!(before >= 100);

    // Kafka never saw an offset commit: only the database knows how far the group got.
    let committed = tokio::task::spawn_blocking({
        let (bootstrap, topic, group) = (svc.bootstrap.clone(), topic.clone(), group.clone());
        move || {
            let c: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set("group.id", &group)
                .create()
                .unwrap();
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&topic, 0);
            tpl.add_partition(&topic, 1);
            c.committed_offsets(tpl, Duration::from_secs(10)).unwrap()
        }
    })
    .await
    .unwrap();
    for e in committed.elements() {
        assert!(
            !matches!(e.offset(), Offset::Offset(_)),
            "partition {} has a Kafka commit: {:?}",
            e.partition(),
            e.offset()
        );
    }

    produce(&svc.bootstrap, &topic, None, &events(200, 250)).await;
    let running = start_apply(
        &db.pool,
        &topic,
        consumer_config(&svc.bootstrap, &group, handlers::CONSUMER),
    );
    let stats = running.stats.clone();
    // Counted in the database, not as `250 - before`: a transaction whose COMMIT the killed
    // child had sent may land after `before` was read (the server finishes it), and its
    // records are then not the new consumer's to apply (seen once in a CI rehearsal: the wait
    // for `250 - before` ran out).
    wait::until(WAIT, "the rest and the 50 new events", || {
        let pool = db.pool.clone();
        async move { effects(&pool).await.1 == 250 }
    })
    .await;
    running.stop().await;
    assert_eq!(effects(&db.pool).await, (250, 250), "nothing applied twice");
    assert_eq!(
        stats.snapshot().duplicates,
        0,
        "no already-processed record reached a handler transaction"
    );
}

/// Not a scenario on its own: the consumer process that `killed_after_db_commit_replays_nothing`
/// starts and kills. It never commits offsets to Kafka.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of killed_after_db_commit_replays_nothing"]
async fn child_consumer_process() {
    let Ok(url) = std::env::var("POSTAL_CHILD_DB") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap();
    postal_integration_tests::wait::ready_postgres(&url, Duration::from_secs(60))
        .await
        .unwrap();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("POSTAL_TEST_LOG"))
        .with_writer(std::io::stderr)
        .try_init();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let mut config = consumer_config(
        &var("POSTAL_CHILD_BOOTSTRAP"),
        &var("POSTAL_CHILD_GROUP"),
        handlers::CONSUMER,
    );
    config.kafka_commit_interval = Duration::from_secs(3600);
    let consumer = Consumer::builder(pool, config)
        .state(handlers::Probe::default())
        .on(&var("POSTAL_CHILD_TOPIC"), "job", apply)
        .build()
        .unwrap();
    consumer.run(std::future::pending()).await.unwrap();
}
