//! A consumer service: books one invoice per `order.created` event on `orders`, exactly once,
//! with the `#[idempotent]` handler and Postal's consumer runtime. Stops on SIGINT/SIGTERM.
//!
//! Environment: `DATABASE_URL`, `KAFKA_BOOTSTRAP_SERVERS`, `BILLING_TOPIC` (default `orders`),
//! `POSTAL_METRICS_ADDR` (serve `/metrics`, `/healthz`, `/readyz` there).

use anyhow::Context;
use postal_consumer::{idempotent, Consumer, ConsumerConfig, Event, HandlerError};
use serde::Deserialize;
use sqlx::{Postgres, Transaction};

/// The payload written by the `roundtrip` example.
#[derive(Debug, Deserialize)]
pub struct OrderCreated {
    /// Order id.
    pub order: i64,
}

/// Books the invoice of an order. Runs at most once per event id, whatever Kafka redelivers.
#[idempotent(consumer = "billing")]
async fn on_order_created(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<OrderCreated>,
) -> Result<(), HandlerError> {
    if event.payload.order < 0 {
        return Err(HandlerError::permanent("negative order id"));
    }
    sqlx::query("INSERT INTO invoices (order_id, event_id) VALUES ($1, $2)")
        .bind(event.payload.order)
        .bind(event.id.as_uuid())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let db = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let brokers =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").context("KAFKA_BOOTSTRAP_SERVERS is not set")?;
    let topic = std::env::var("BILLING_TOPIC").unwrap_or_else(|_| "orders".into());
    let pool = sqlx::PgPool::connect(&db)
        .await
        .context("cannot reach PostgreSQL")?;
    postal_shared::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS invoices (order_id bigint NOT NULL, event_id uuid NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let mut config = ConsumerConfig::new(brokers, "billing", "billing");
    // Prometheus metrics and health endpoints, when asked for.
    if let Ok(addr) = std::env::var("POSTAL_METRICS_ADDR") {
        config.ops_addr = Some(addr.parse().context("POSTAL_METRICS_ADDR")?);
    }
    let consumer = Consumer::builder(pool, config)
        .on(&topic, "order.created", on_order_created)
        .build()?;
    consumer.run_until_signal().await?;
    Ok(())
}
