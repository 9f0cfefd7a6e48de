use postal_consumer::{idempotent, Event, HandlerError};
use sqlx::{Postgres, Transaction};

#[idempotent(consumer = "billing")]
async fn on_order(tx: &mut String, event: Event<u32>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

fn main() {}
