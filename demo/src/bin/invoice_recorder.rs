//! The second hop: records every `invoice.created` exactly once. Stops on SIGINT/SIGTERM.
//!
//! Environment: `DATABASE_URL`, `KAFKA_BOOTSTRAP_SERVERS`, `INVOICES_TOPIC` (default
//! `invoices`), and the consumer settings of `ConsumerConfig::with_vars` (`POSTAL_KAFKA`, …).

use postal_consumer::{idempotent, Consumer, ConsumerConfig, Event, HandlerError};
use postal_demo::service::{connect, env_required, init_tracing};
use postal_shared::stop_signal;
use serde::Deserialize;
use sqlx::{Postgres, Transaction};

/// The payload written by the billing service.
#[derive(Debug, Deserialize)]
pub struct InvoiceCreated {
    /// Order id.
    pub order_id: i64,
    /// Customer id.
    pub customer: String,
    /// The order's number among its customer's orders.
    pub seq: i32,
}

/// Records the invoice.
#[idempotent(consumer = "invoices")]
async fn on_invoice_created(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<InvoiceCreated>,
) -> Result<(), HandlerError> {
    let i = &event.payload;
    sqlx::query("INSERT INTO invoices (order_id, customer, seq, event_id) VALUES ($1, $2, $3, $4)")
        .bind(i.order_id)
        .bind(&i.customer)
        .bind(i.seq)
        .bind(event.id.as_uuid())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The service's own table.
const INVOICES_TABLE: &str = "CREATE TABLE IF NOT EXISTS invoices (
     id bigserial PRIMARY KEY, order_id bigint NOT NULL, customer text NOT NULL,
     seq integer NOT NULL, event_id uuid NOT NULL,
     recorded_at timestamptz NOT NULL DEFAULT clock_timestamp())";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing("info");
    let db = env_required("DATABASE_URL")?;
    let brokers = env_required("KAFKA_BOOTSTRAP_SERVERS")?;
    let topic = std::env::var("INVOICES_TOPIC").unwrap_or_else(|_| "invoices".into());
    let config = ConsumerConfig::new(brokers, "invoices").with_env()?;
    // Listening from here on: a stop while start-up still waits for PostgreSQL is clean too.
    let mut stop = stop_signal()?;
    let pool = tokio::select! {
        pool = connect(&db, INVOICES_TABLE) => pool?,
        () = &mut stop => return Ok(()),
    };
    let consumer = Consumer::builder(pool, config)
        .on(&topic, "invoice.created", on_invoice_created)
        .build()?;
    consumer.run(stop).await?;
    Ok(())
}
