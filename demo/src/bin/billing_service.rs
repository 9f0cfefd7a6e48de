//! The billing service: consumes `order.created` with the `#[idempotent]` handler, writes one
//! ledger row per order and, in the same transaction, emits `invoice.created` through its own
//! outbox (consume-transform-produce). Stops on SIGINT/SIGTERM.
//!
//! Environment: `DATABASE_URL`, `KAFKA_BOOTSTRAP_SERVERS`, `ORDERS_TOPIC` (default `orders`),
//! `INVOICES_TOPIC` (default `invoices`), and the consumer settings of
//! `ConsumerConfig::with_vars` (`POSTAL_KAFKA`, `POSTAL_MAX_BATCH`, `POSTAL_METRICS_ADDR`, …).
//!
//! A customer listed in `blocked_customers` has its orders refused (a permanent failure): by
//! default each becomes a dead letter; with `POSTAL_FINAL_FAILURE=hold-key` the customer's
//! orders wait, in order, until the customer is unblocked and the key released
//! (`postal held release --group billing --topic orders --key <customer>`).

use postal_consumer::{idempotent, Consumer, ConsumerConfig, Event, EventId, HandlerError, State};
use postal_demo::service::{connect, env_required, init_tracing};
use postal_producer::{enqueue_once, Error, NewEvent};
use postal_shared::stop_signal;
use serde::Deserialize;
use sqlx::{Postgres, Transaction};

/// The payload written by the order service.
#[derive(Debug, Deserialize)]
pub struct OrderCreated {
    /// Order id.
    pub order_id: i64,
    /// Customer id (also the event key).
    pub customer: String,
    /// The order's number among its customer's orders.
    pub seq: i32,
}

/// What the handler needs besides its transaction: the consumer's state.
#[derive(Clone)]
struct Billing {
    /// Where invoice events go.
    invoices_topic: String,
}

/// Books the order in the ledger and emits the invoice event, exactly once per event id.
#[idempotent(consumer = "billing")]
async fn on_order_created(
    State(billing): State<Billing>,
    tx: &mut Transaction<'_, Postgres>,
    event: Event<OrderCreated>,
) -> Result<(), HandlerError> {
    let order = &event.payload;
    let blocked: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM blocked_customers WHERE customer = $1)")
            .bind(&order.customer)
            .fetch_one(&mut **tx)
            .await?;
    if blocked {
        return Err(HandlerError::permanent(format!(
            "customer {} is blocked",
            order.customer
        )));
    }
    sqlx::query("INSERT INTO ledger (order_id, customer, seq, event_id) VALUES ($1, $2, $3, $4)")
        .bind(order.order_id)
        .bind(&order.customer)
        .bind(order.seq)
        .bind(event.id.as_uuid())
        .execute(&mut **tx)
        .await?;
    let invoice = NewEvent::json(
        billing.invoices_topic.as_str(),
        order.customer.as_str(),
        "invoice.created",
        &serde_json::json!({"order_id": order.order_id, "customer": order.customer, "seq": order.seq}),
    )
    .map_err(HandlerError::permanent)?
    // Derived from the order event's id: if this order event is ever applied again (a replay
    // past the dedup retention), the same invoice event is emitted, and the next hop
    // recognises it instead of recording a second invoice.
    .with_id(EventId::derived(event.id, "invoice.created"));
    enqueue_once(tx, invoice).await.map_err(|e| match e {
        // Classified like the handler's own sqlx calls: a lost connection is an outage
        // (waited out, not counted as a failed attempt).
        Error::Database(db) => HandlerError::from(db),
        other => HandlerError::permanent(other),
    })?;
    Ok(())
}

/// The service's own tables.
const LEDGER_TABLE: &str = "CREATE TABLE IF NOT EXISTS ledger (
     id bigserial PRIMARY KEY, order_id bigint NOT NULL, customer text NOT NULL,
     seq integer NOT NULL, event_id uuid NOT NULL,
     applied_at timestamptz NOT NULL DEFAULT clock_timestamp());
     CREATE TABLE IF NOT EXISTS blocked_customers (customer text PRIMARY KEY)";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing("info");
    let db = env_required("DATABASE_URL")?;
    let brokers = env_required("KAFKA_BOOTSTRAP_SERVERS")?;
    let orders = std::env::var("ORDERS_TOPIC").unwrap_or_else(|_| "orders".into());
    let billing = Billing {
        invoices_topic: std::env::var("INVOICES_TOPIC").unwrap_or_else(|_| "invoices".into()),
    };
    let config = ConsumerConfig::new(brokers, "billing").with_env()?;
    // Listening from here on: a stop while start-up still waits for PostgreSQL is clean too.
    let mut stop = stop_signal()?;
    let pool = tokio::select! {
        pool = connect(&db, LEDGER_TABLE) => pool?,
        () = &mut stop => return Ok(()),
    };
    let consumer = Consumer::builder(pool, config)
        .state(billing)
        .on(&orders, "order.created", on_order_created)
        .build()?;
    consumer.run(stop).await?;
    Ok(())
}
