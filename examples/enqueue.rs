//! Enqueue: a business row and its event written in ONE PostgreSQL transaction (the
//! transactional outbox). Either both commit or neither does: no event for an order that was
//! rolled back, no order whose event is lost.
//!
//! Run first: the local stack (`bash scripts/stack.sh up`, then
//! `eval "$(bash scripts/stack.sh env)"` for `DATABASE_URL`). Then:
//!
//! ```text
//! cargo run -p postal-examples --example enqueue -- 5
//! ```
//!
//! It creates 5 orders (the argument, else `ORDERS`, else 3) with one `order.created` event
//! each on `ORDERS_TOPIC` (default `orders`), prints the event ids and exits. The events wait
//! in the outbox (`postal status` shows them) until a relay publishes them: `postal relay`, or
//! `cargo run -p postal-examples --example relay`.

use anyhow::Context;
use postal::producer::{enqueue, NewEvent};
use postal::sqlx;
use serde::Serialize;

/// The event's payload: any `serde` type, stored as JSON.
#[derive(Serialize)]
struct OrderCreated {
    order_id: i64,
    customer: String,
    total_cents: i64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let orders: u32 = match std::env::args()
        .nth(1)
        .or_else(|| std::env::var("ORDERS").ok())
    {
        Some(n) => n.parse()?,
        None => 3,
    };
    let topic = std::env::var("ORDERS_TOPIC").unwrap_or_else(|_| "orders".into());
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    // Postal's schema (what `postal migrate` applies); a no-op when it is up to date.
    postal::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
             id bigserial PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;

    for n in 0..orders {
        let customer = format!("customer-{}", n % 3);
        let total_cents = 1000 + i64::from(n);
        // One transaction per order: the row and its event commit together.
        let mut tx = pool.begin().await?;
        let order_id: i64 = sqlx::query_scalar(
            "INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id",
        )
        .bind(&customer)
        .bind(total_cents)
        .fetch_one(&mut *tx)
        .await?;
        // The key (here the customer) orders events: one customer's events are published,
        // and consumed, in the order they were enqueued. It becomes the Kafka record's key.
        let event = NewEvent::json(
            topic.as_str(),
            customer.as_str(),
            "order.created",
            &OrderCreated {
                order_id,
                customer: customer.clone(),
                total_cents,
            },
        )?;
        // `enqueue` takes the transaction (never the pool): the event is only an outbox row
        // of this transaction until the commit.
        let event_id = enqueue(&mut tx, event).await?;
        tx.commit().await?;
        println!("order {order_id} for {customer}: event {event_id}");
    }
    println!("{orders} events in the outbox; run a relay to publish them (`postal relay`)");
    Ok(())
}
