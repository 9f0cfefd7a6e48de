//! The order service: creates orders, each with its `order.created` event written through the
//! outbox in the same transaction. The customer id is the event key, and every customer gets
//! many orders (numbered per customer), so per-key order is exercised downstream.
//!
//! Environment: `DATABASE_URL`; `ORDERS_TOPIC` (default `orders`); `ORDERS` (how many, default
//! 1000; 0 = until stopped); `ORDER_RATE` (orders per second, default 200); `CUSTOMERS`
//! (default 50).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use postal_producer::{enqueue, NewEvent};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name}={v:?} is not valid")),
        Err(_) => Ok(default),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let db = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let topic = std::env::var("ORDERS_TOPIC").unwrap_or_else(|_| "orders".into());
    let total: u64 = env_or("ORDERS", 1000)?;
    let rate: f64 = env_or("ORDER_RATE", 200.0)?;
    let customers: u64 = env_or("CUSTOMERS", 50)?;
    anyhow::ensure!(
        rate > 0.0 && customers > 0,
        "ORDER_RATE and CUSTOMERS must be positive"
    );
    let pool = sqlx::PgPool::connect(&db)
        .await
        .context("cannot reach PostgreSQL")?;
    postal_shared::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
             id bigserial PRIMARY KEY, customer text NOT NULL, seq integer NOT NULL,
             created_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(&pool)
    .await?;

    let mut seqs: HashMap<u64, i32> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut n = 0u64;
    while total == 0 || n < total {
        tick.tick().await;
        let c = n % customers;
        let seq = seqs.entry(c).or_insert(0);
        *seq += 1;
        let customer = format!("customer-{c}");
        let mut tx = pool.begin().await?;
        let order_id: i64 =
            sqlx::query_scalar("INSERT INTO orders (customer, seq) VALUES ($1, $2) RETURNING id")
                .bind(&customer)
                .bind(*seq)
                .fetch_one(&mut *tx)
                .await?;
        let event = NewEvent::json(
            topic.as_str(),
            customer.as_str(),
            "order.created",
            &serde_json::json!({"order_id": order_id, "customer": customer, "seq": *seq}),
        )?;
        enqueue(&mut tx, event).await?;
        tx.commit().await?;
        n += 1;
    }
    println!(
        "order service: {n} orders in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
