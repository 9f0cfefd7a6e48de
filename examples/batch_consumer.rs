//! A batch handler: the handler gets the new events of a partition batch at once and writes
//! their effects with ONE statement, instead of one statement per event. Same guarantee as a
//! per-event handler: the dedup rows, the effects and the offset commit in one transaction,
//! each event is applied once, in partition order.
//!
//! Use it when the effect of many events can be written together (a multi-row insert, a bulk
//! upsert, one call to a bulk API): per event, the database then does a fraction of the work.
//! A failing event is found by running halves of the batch again under savepoints, so the
//! body must not keep state of its own across calls.
//!
//! Run first: the local stack and its environment (`bash scripts/stack.sh up`, then
//! `eval "$(bash scripts/stack.sh env)"`), the `enqueue` and `relay` examples (the topic must
//! exist). Then, until Ctrl-C or SIGTERM:
//!
//! ```text
//! cargo run -p postal-examples --example batch_consumer
//! ```
//!
//! It reads `order.created` from `ORDERS_TOPIC` (default `orders`) and records each order in
//! `order_ledger`; `POSTAL_MAX_BATCH` overrides the batch size set here.

use anyhow::Context;
use postal::consumer::{idempotent, Batch, Consumer, ConsumerConfig, HandlerError};
use postal::sqlx;
use postal::sqlx::{Postgres, Transaction};
use serde::Deserialize;

#[derive(Deserialize)]
struct OrderCreated {
    customer: String,
    total_cents: i64,
}

/// Called once per transaction with the batch's new events (a redelivered or republished
/// event is not among them), in partition order. `&[Event<OrderCreated>]` works too.
#[idempotent(consumer = "order-ledger")]
async fn record_orders(
    tx: &mut Transaction<'_, Postgres>,
    events: Batch<OrderCreated>,
) -> Result<(), HandlerError> {
    let ids: Vec<_> = events.iter().map(|e| e.id.as_uuid()).collect();
    let customers: Vec<&str> = events.iter().map(|e| e.payload.customer.as_str()).collect();
    let cents: Vec<i64> = events.iter().map(|e| e.payload.total_cents).collect();
    // A business rule that rejects one event: only that event becomes a dead letter.
    if let Some(bad) = events.iter().find(|e| e.payload.total_cents < 0) {
        return Err(HandlerError::permanent(format!(
            "order event {} has a negative total",
            bad.id
        )));
    }
    sqlx::query(
        "INSERT INTO order_ledger (event_id, customer, total_cents)
         SELECT * FROM unnest($1::uuid[], $2::text[], $3::bigint[])",
    )
    .bind(&ids)
    .bind(&customers)
    .bind(&cents)
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
        "CREATE TABLE IF NOT EXISTS order_ledger (
             event_id uuid PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let mut config = ConsumerConfig::new(brokers, "order-ledger");
    // Batches of up to 500 records of a partition per transaction; with `max_batch` 1 the
    // handler is called with one event at a time.
    config.max_batch = 500;
    config.kafka.insert("fetch.wait.max.ms".into(), "10".into());
    let config = config.with_env()?;

    let consumer = Consumer::builder(pool, config)
        .on_batch(&topic, "order.created", record_orders) // `on_batch`, not `on`
        .build()?;
    consumer.run_until_signal().await?; // SIGINT/SIGTERM: graceful stop, exit 0
    Ok(())
}
