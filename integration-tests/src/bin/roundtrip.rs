//! Round trip through the local stack: write orders and their events in one transaction each,
//! relay them to Kafka, read them back, and check every event arrived exactly as written.
//!
//! Environment: `DATABASE_URL`, `KAFKA_BOOTSTRAP_SERVERS`, `ROUNDTRIP_EVENTS` (default 1000).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use postal_producer::{enqueue, KafkaConfig, KafkaTransport, NewEvent, Relay, RelayConfig};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("warn").init();
    let db = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").context("KAFKA_BOOTSTRAP_SERVERS is not set")?;
    let n: usize = std::env::var("ROUNDTRIP_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);

    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(postal_shared::secret::database_url_options(&db)?)
        .await
        .context("cannot reach PostgreSQL")?;
    postal_shared::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS roundtrip_orders (id uuid PRIMARY KEY, customer text NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let topic = format!("roundtrip-{}", uuid::Uuid::now_v7().simple());

    println!("writing {n} orders, each with its order.created event in the same transaction…");
    let mut expected = BTreeSet::new();
    for i in 0..n {
        let customer = format!("customer-{}", i % 50);
        let mut tx = pool.begin().await?;
        let order = uuid::Uuid::now_v7();
        sqlx::query("INSERT INTO roundtrip_orders VALUES ($1, $2)")
            .bind(order)
            .bind(&customer)
            .execute(&mut *tx)
            .await?;
        let event = NewEvent::json(
            topic.as_str(),
            customer.as_str(),
            "order.created",
            &serde_json::json!({"order_id": order, "customer": customer}),
        )?;
        expected.insert(enqueue(&mut tx, event).await?.to_string());
        tx.commit().await?;
    }

    println!("relaying to Kafka at {bootstrap} (topic {topic})…");
    let started = Instant::now();
    let relay = Relay::new(
        pool.clone(),
        KafkaTransport::new(KafkaConfig::new(&bootstrap))?,
        RelayConfig::default(),
    )?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(relay.run(async move {
        let _ = stop_rx.await;
    }));
    let seen = tokio::task::spawn_blocking({
        let bootstrap = bootstrap.clone();
        let topic = topic.clone();
        let want = expected.len();
        move || read_ids(&bootstrap, &topic, want)
    })
    .await??;
    let elapsed = started.elapsed();
    let _ = stop_tx.send(());
    let stats = relay_task.await??;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE topic = $1")
        .bind(&topic)
        .fetch_one(&pool)
        .await?;

    println!("events written:   {}", expected.len());
    println!("events published: {}", stats.published);
    println!("events read back: {}", seen.len());
    println!("left in outbox:   {left}");
    println!("relay + read-back time: {:.2?}", elapsed);
    if seen != expected || left != 0 {
        bail!("round trip FAILED: read-back set differs from what was written or the outbox is not empty");
    }
    println!("round trip OK: every committed event arrived exactly once");
    Ok(())
}

fn read_ids(bootstrap: &str, topic: &str, want: usize) -> anyhow::Result<BTreeSet<String>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set(
            "group.id",
            format!("roundtrip-reader-{}", uuid::Uuid::now_v7().simple()),
        )
        .set("enable.auto.commit", "false")
        .create()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    // Wait for the relay to create the topic, then read every partition from the start.
    let parts = loop {
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(5))?;
        if let Some(t) = md
            .topics()
            .iter()
            .find(|t| t.name() == topic && t.error().is_none())
        {
            if !t.partitions().is_empty() {
                break t.partitions().iter().map(|p| p.id()).collect::<Vec<_>>();
            }
        }
        if Instant::now() > deadline {
            bail!("topic {topic} never appeared");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut tpl = TopicPartitionList::new();
    for p in parts {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut ids = BTreeSet::new();
    let mut records = 0usize;
    while records < want && Instant::now() < deadline {
        if let Some(m) = consumer.poll(Duration::from_millis(200)) {
            let m = m?;
            records += 1;
            if let Some(h) = m.headers() {
                for hd in h.iter() {
                    if hd.key == "ce_id" {
                        ids.insert(
                            String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                        );
                    }
                }
            }
        }
    }
    if records != ids.len() {
        bail!(
            "{records} records carried only {} distinct ids: duplicates",
            ids.len()
        );
    }
    Ok(ids)
}
