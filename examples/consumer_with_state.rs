//! A consumer with state: an `#[idempotent]` handler that takes the application's state
//! (`State<T>`, as in axum) and writes a row in the handler's transaction. Postal commits the
//! row together with a dedup row and the partition's offset, so each event's effect happens
//! exactly once however often Kafka delivers it.
//!
//! Run first: the local stack and its environment (`bash scripts/stack.sh up`, then
//! `eval "$(bash scripts/stack.sh env)"`), the `enqueue` and `relay` examples (the topic must
//! exist). Then, until Ctrl-C or SIGTERM:
//!
//! ```text
//! cargo run -p postal-examples --example consumer_with_state
//! ```
//!
//! It reads `order.created` from `ORDERS_TOPIC` (default `orders`) and books one invoice per
//! order; the consumer variables of README's configuration table apply (`POSTAL_CONSUMER_GROUP`,
//! `POSTAL_MAX_BATCH`, …).

use anyhow::Context;
use postal::consumer::{idempotent, Consumer, ConsumerConfig, Event, FromRef, HandlerError, State};
use postal::sqlx;
use postal::sqlx::{Postgres, Transaction};
use serde::Deserialize;

/// The part of `order.created` this consumer reads (serde ignores the other fields).
#[derive(Deserialize)]
struct OrderCreated {
    order_id: i64,
    total_cents: i64,
}

/// The application's state: everything its handlers need (clients, settings, …).
#[derive(Clone)]
struct App {
    billing: Billing,
    region: String, // used by the rest of the service; the billing handler never sees it
}

/// The part of the state the billing handler takes.
#[derive(Clone)]
struct Billing {
    currency: String,
}

/// How a `State<Billing>` is taken from an `App` (every `Clone` type is its own part as well).
impl FromRef<App> for Billing {
    fn from_ref(app: &App) -> Self {
        app.billing.clone()
    }
}

/// `consumer = "billing"` names the dedup scope: a copy of an event that this scope applied
/// is skipped, whichever Kafka group or process delivers it.
#[idempotent(consumer = "billing")]
async fn book_invoice(
    State(billing): State<Billing>,
    tx: &mut Transaction<'_, Postgres>,
    event: Event<OrderCreated>,
) -> Result<(), HandlerError> {
    // Written in the transaction Postal opened for this event: `?` on a sqlx error rolls back
    // the row together with the dedup row, and the event is retried (or dead-lettered).
    sqlx::query(
        "INSERT INTO invoices (event_id, order_id, cents, currency) VALUES ($1, $2, $3, $4)",
    )
    .bind(event.id.as_uuid())
    .bind(event.payload.order_id)
    .bind(event.payload.total_cents)
    .bind(&billing.currency)
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
        "CREATE TABLE IF NOT EXISTS invoices (id bigserial PRIMARY KEY, event_id uuid NOT NULL,
             order_id bigint NOT NULL, cents bigint NOT NULL, currency text NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let app = App {
        billing: Billing {
            currency: "EUR".into(),
        },
        region: "eu-west".into(),
    };
    tracing::info!(region = %app.region, "billing consumer starting");
    // "billing" here is the Kafka consumer group (where this consumer's offsets are kept).
    let config = ConsumerConfig::new(brokers, "billing").with_env()?;
    let consumer = Consumer::builder(pool, config)
        .state(app) // before `.on(…)`: a state lacking `Billing` is a compile error there
        .on(&topic, "order.created", book_invoice)
        .build()?;
    // SIGINT/SIGTERM: finish the transactions in flight, leave the group, return Ok.
    consumer.run_until_signal().await?;
    Ok(())
}
