use postal_consumer::{idempotent, Event, HandlerError};
use sqlx::{Postgres, Transaction};

#[idempotent(consumer = "billing", retries = 3)]
async fn unknown_argument(tx: &mut Transaction<'_, Postgres>, event: Event<u32>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

#[idempotent(consumer = billing)]
async fn not_a_string(tx: &mut Transaction<'_, Postgres>, event: Event<u32>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

#[idempotent(consumer = "")]
async fn empty_name(tx: &mut Transaction<'_, Postgres>, event: Event<u32>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

fn main() {}
