use postal_consumer::{idempotent, Event, HandlerError};
use sqlx::{Postgres, Transaction};

#[idempotent(consumer = "billing")]
async fn no_return(tx: &mut Transaction<'_, Postgres>, event: Event<u32>) {
    let _ = (tx, event);
}

#[idempotent(consumer = "billing")]
async fn string_error(tx: &mut Transaction<'_, Postgres>, event: Event<u32>) -> Result<(), String> {
    let _ = (tx, event);
    Ok(())
}

fn main() {}
