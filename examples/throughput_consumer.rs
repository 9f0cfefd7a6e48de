//! Throughput mode: a consumer that applies up to `max_batch` records of a partition in ONE
//! transaction (one multi-row dedup insert, one offset update, one commit) instead of one
//! transaction per record. Same guarantee, far fewer commits; a failing record is isolated
//! under a savepoint and the partition's order holds.
//!
//! The handler keeps running totals per customer: an effect that must not happen twice (a
//! redelivered event would count an order twice), which Postal's dedup row prevents.
//!
//! Run first: the local stack and its environment (`bash scripts/stack.sh up`, then
//! `eval "$(bash scripts/stack.sh env)"`), the `enqueue` and `relay` examples (the topic must
//! exist). Then, until Ctrl-C or SIGTERM:
//!
//! ```text
//! cargo run -p postal-examples --example throughput_consumer
//! ```
//!
//! It reads `order.created` from `ORDERS_TOPIC` (default `orders`); `POSTAL_MAX_BATCH`
//! overrides the batch size set here.

use anyhow::Context;
use postal::consumer::{idempotent, Consumer, ConsumerConfig, Event, HandlerError};
use postal::sqlx;
use postal::sqlx::{Postgres, Transaction};
use serde::Deserialize;

#[derive(Deserialize)]
struct OrderCreated {
    customer: String,
    total_cents: i64,
}

/// The body is written as for one record at a time: in throughput mode Postal runs the bodies
/// of a batch one after another in the same transaction.
#[idempotent(consumer = "sales-totals")]
async fn add_to_totals(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<OrderCreated>,
) -> Result<(), HandlerError> {
    sqlx::query(
        "INSERT INTO customer_totals (customer, orders, cents) VALUES ($1, 1, $2)
         ON CONFLICT (customer) DO UPDATE
         SET orders = customer_totals.orders + 1, cents = customer_totals.cents + $2",
    )
    .bind(&event.payload.customer)
    .bind(event.payload.total_cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    postal::init_logging("info")?;
    let topic = std::env::var("ORDERS_TOPIC").unwrap_or_else(|_| "orders".into());
    let brokers =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").context("KAFKA_BOOTSTRAP_SERVERS is not set")?;
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    postal::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS customer_totals (
             customer text PRIMARY KEY, orders bigint NOT NULL, cents bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let mut config = ConsumerConfig::new(brokers, "sales-totals");
    // Throughput mode: up to 500 records of a partition per transaction (1 = one each, the
    // default). Larger batches mean fewer commits; a retried batch re-runs more bodies.
    config.max_batch = 500;
    // Let the broker answer a fetch as soon as records are there (librdkafka waits up to
    // 500 ms by default for more to arrive, which adds to every event's latency).
    config.kafka.insert("fetch.wait.max.ms".into(), "10".into());
    // The environment last, so a deployment can still tune both.
    let config = config.with_env()?;

    let consumer = Consumer::builder(pool, config)
        .on(&topic, "order.created", add_to_totals)
        .build()?;
    consumer.run_until_signal().await?; // SIGINT/SIGTERM: graceful stop, exit 0
    Ok(())
}
