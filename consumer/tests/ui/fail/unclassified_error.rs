use postal_consumer::{idempotent, Event, HandlerError};
use sqlx::{Postgres, Transaction};

/// An error type of the application's own: Postal cannot know whether it is permanent.
#[derive(Debug)]
struct QuotaExceeded;

impl std::fmt::Display for QuotaExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("quota exceeded")
    }
}

impl std::error::Error for QuotaExceeded {}

fn charge() -> Result<(), QuotaExceeded> {
    Err(QuotaExceeded)
}

#[idempotent(consumer = "billing")]
async fn on_order(tx: &mut Transaction<'_, Postgres>, event: Event<u32>) -> Result<(), HandlerError> {
    let _ = (tx, event);
    charge()?;
    Ok(())
}

fn main() {}
