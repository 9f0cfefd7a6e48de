use postal_consumer::{idempotent, Batch, Consumer, ConsumerConfig, Event, HandlerError};
use sqlx::{Postgres, Transaction};

// A batch is read, not changed: `&mut [Event<T>]` is refused at the `mut`.
#[idempotent(consumer = "billing")]
async fn mutable(tx: &mut Transaction<'_, Postgres>, events: &mut [Event<u32>]) -> Result<(), HandlerError> {
    let _ = (tx, events);
    Ok(())
}

// A slice of something else is not a batch.
#[idempotent(consumer = "billing")]
async fn not_events(tx: &mut Transaction<'_, Postgres>, events: &[u32]) -> Result<(), HandlerError> {
    let _ = (tx, events);
    Ok(())
}

#[idempotent(consumer = "billing")]
async fn batch(tx: &mut Transaction<'_, Postgres>, events: Batch<u32>) -> Result<(), HandlerError> {
    let _ = (tx, events);
    Ok(())
}

#[idempotent(consumer = "billing")]
async fn single(tx: &mut Transaction<'_, Postgres>, event: Event<u32>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

fn routes(pool: sqlx::PgPool) {
    // A batch handler is routed with `on_batch`, a single-event one with `on`.
    let _ = Consumer::builder(pool.clone(), ConsumerConfig::new("b", "g")).on("t", "e", batch);
    let _ = Consumer::builder(pool, ConsumerConfig::new("b", "g")).on_batch("t", "e", single);
}

fn main() {}
