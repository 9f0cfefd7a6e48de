use postal_consumer::{idempotent, Event, HandlerError};
use sqlx::{Postgres, Transaction};

#[idempotent(consumer = "billing")]
async fn shared_ref(tx: &Transaction<'_, Postgres>, event: Event<u32>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

#[idempotent(consumer = "billing")]
async fn not_an_event(tx: &mut Transaction<'_, Postgres>, event: u32) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

#[idempotent(consumer = "billing")]
async fn one_parameter(event: Event<u32>) -> Result<(), HandlerError> {
    let _ = event;
    Ok(())
}

#[idempotent(consumer = "billing")]
async fn generic<T>(tx: &mut Transaction<'_, Postgres>, event: Event<T>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

fn main() {}
