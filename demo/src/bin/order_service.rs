//! The order service: creates orders, each with its `order.created` event written through the
//! outbox in the same transaction. The customer id is the event key, and every customer gets
//! many orders (numbered per customer), so per-key order is exercised downstream.
//!
//! Orders are idempotent by `(customer, seq)`: when the database goes away mid-commit the
//! service cannot know whether the order landed, so it retries the same order and a unique
//! conflict means "already there". Numbering resumes from the database after a restart.
//!
//! Environment: `DATABASE_URL`; `ORDERS_TOPIC` (default `orders`); `ORDERS` (how many new
//! orders, default 1000; 0 = until stopped); `ORDER_RATE` (orders per second, default 200);
//! `CUSTOMERS` (default 50).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use postal_demo::service::{connect, env_or, env_required, init_tracing, retry_while_unreachable};
use postal_producer::{enqueue, NewEvent};
use sqlx::PgPool;

/// Creates one order and its event in one transaction. `Ok(false)`: it already existed.
async fn create_order(
    pool: &PgPool,
    topic: &str,
    customer: &str,
    seq: i32,
) -> Result<bool, postal_producer::Error> {
    let mut tx = pool.begin().await?;
    let order_id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO orders (customer, seq) VALUES ($1, $2)
         ON CONFLICT (customer, seq) DO NOTHING RETURNING id",
    )
    .bind(customer)
    .bind(seq)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(order_id) = order_id else {
        return Ok(false);
    };
    let event = NewEvent::json(
        topic,
        customer,
        "order.created",
        &serde_json::json!({"order_id": order_id, "customer": customer, "seq": seq}),
    )?;
    enqueue(&mut tx, event).await?;
    tx.commit().await?;
    Ok(true)
}

/// Whether an error means "the database is (briefly) unreachable": retry the same order.
fn unavailable(e: &postal_producer::Error) -> bool {
    matches!(e, postal_producer::Error::Database(db) if postal_shared::database_unavailable(db))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing("warn");
    let db = env_required("DATABASE_URL")?;
    let topic = std::env::var("ORDERS_TOPIC").unwrap_or_else(|_| "orders".into());
    let total: u64 = env_or("ORDERS", 1000)?;
    let rate: f64 = env_or("ORDER_RATE", 200.0)?;
    let customers: u64 = env_or("CUSTOMERS", 50)?;
    anyhow::ensure!(
        rate > 0.0 && customers > 0,
        "ORDER_RATE and CUSTOMERS must be positive"
    );
    let pool = connect(
        &db,
        "CREATE TABLE IF NOT EXISTS orders (
             id bigserial PRIMARY KEY, customer text NOT NULL, seq integer NOT NULL,
             created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
             UNIQUE (customer, seq))",
    )
    .await?;
    let mut seqs: HashMap<String, i32> = retry_while_unreachable("reading order numbers", || {
        sqlx::query_as("SELECT customer, max(seq) FROM orders GROUP BY customer").fetch_all(&pool)
    })
    .await?
    .into_iter()
    .collect();

    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut n = 0u64;
    while total == 0 || n < total {
        tick.tick().await;
        let customer = format!("customer-{}", n % customers);
        let seq = *seqs
            .entry(customer.clone())
            .and_modify(|s| *s += 1)
            .or_insert(1);
        let mut wait = Duration::from_millis(100);
        loop {
            match create_order(&pool, &topic, &customer, seq).await {
                Ok(_) => break,
                Err(e) if unavailable(&e) => {
                    tracing::warn!(error = %e, %customer, seq, "database unavailable; retrying the order in {wait:?}");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
        n += 1;
    }
    println!(
        "order service: {n} orders in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
