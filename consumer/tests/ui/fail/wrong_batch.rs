use postal_consumer::{idempotent, Event, HandlerError};
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

fn main() {}
