use postal_consumer::{idempotent, Event, HandlerError};
use sqlx::{Postgres, Transaction};

#[idempotent]
async fn on_order(tx: &mut Transaction<'_, Postgres>, event: Event<u32>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    Ok(())
}

fn main() {}
