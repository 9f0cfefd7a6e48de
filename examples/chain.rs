//! A chain, consume → produce: a handler that applies an event AND enqueues a follow-up event
//! into its own service's outbox, in the one transaction Postal opened for it. The effect, the
//! follow-up, the dedup row and the offset commit together, so the chain is effectively-once
//! across both hops: one shipment row and one `shipment.requested` event id per order, however
//! often Kafka redelivers the order.
//!
//! Run first: the local stack and its environment (`bash scripts/stack.sh up`, then
//! `eval "$(bash scripts/stack.sh env)"`), the `enqueue` example, and the `relay` example
//! (it publishes the orders, then the follow-ups this handler enqueues). Then, until Ctrl-C
//! or SIGTERM:
//!
//! ```text
//! cargo run -p postal-examples --example chain
//! ```
//!
//! Reads `order.created` from `ORDERS_TOPIC` (default `orders`), writes `shipment.requested`
//! to `SHIPMENTS_TOPIC` (default `shipments`).

use anyhow::Context;
use postal::consumer::{idempotent, Consumer, ConsumerConfig, Event, EventId, HandlerError, State};
use postal::producer::{enqueue_once, NewEvent};
use postal::sqlx;
use postal::sqlx::{Postgres, Transaction};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct Order {
    order_id: i64,
    customer: String,
}

/// The handler's state: where follow-ups go.
#[derive(Clone)]
struct Shipping {
    topic: String,
}

#[idempotent(consumer = "shipping")]
async fn request_shipment(
    State(shipping): State<Shipping>,
    tx: &mut Transaction<'_, Postgres>,
    event: Event<Order>,
) -> Result<(), HandlerError> {
    let order = &event.payload;
    sqlx::query("INSERT INTO shipments (order_id, order_event_id) VALUES ($1, $2)")
        .bind(order.order_id)
        .bind(event.id.as_uuid())
        .execute(&mut **tx)
        .await?;
    // `?` on Postal's producer errors classifies them as on sqlx's: an event that cannot be
    // written is permanent (a dead letter), a lost connection an outage.
    let follow_up = NewEvent::json(
        shipping.topic.as_str(),
        order.customer.as_str(), // same key: the customer's events stay in order downstream
        "shipment.requested",
        order,
    )?
    // An id derived from the input's: should this order ever be applied again (a replay
    // past the dedup retention), the SAME follow-up is emitted and the next hop drops it.
    .with_id(EventId::derived(event.id, "shipment.requested"));
    // `enqueue_once` writes nothing if the outbox still holds that id. The handler's
    // transaction is the outbox's transaction: it commits only with the effect above.
    enqueue_once(tx, follow_up).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    postal::init_logging("info")?;
    let orders = std::env::var("ORDERS_TOPIC").unwrap_or_else(|_| "orders".into());
    let shipping = Shipping {
        topic: std::env::var("SHIPMENTS_TOPIC").unwrap_or_else(|_| "shipments".into()),
    };
    let brokers =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").context("KAFKA_BOOTSTRAP_SERVERS is not set")?;
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    postal::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS shipments (id bigserial PRIMARY KEY,
             order_id bigint NOT NULL, order_event_id uuid NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let consumer = Consumer::builder(pool, ConsumerConfig::new(brokers, "shipping").with_env()?)
        .state(shipping)
        .on(&orders, "order.created", request_shipment)
        .build()?;
    consumer.run_until_signal().await?;
    Ok(())
}
