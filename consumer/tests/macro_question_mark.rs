//! `?` works in a handler on the errors handlers meet most, each classified: a payload that does
//! not decode is permanent, I/O is retryable, anyhow and boxed errors by what they wrap.
//! (A plain test rather than a trybuild pass case: trybuild would then build every dependency
//! again, linked, in a project of its own; compiling this file is the check.)
use postal_consumer::{idempotent, BoxError, Event, HandlerError, Raw};
use sqlx::{Postgres, Transaction};

#[derive(Debug, serde::Deserialize)]
struct Invoice {
    cents: i64,
}

fn lookup(cents: i64) -> anyhow::Result<i64> {
    anyhow::ensure!(cents >= 0, "negative amount");
    Ok(cents)
}

fn boxed() -> Result<(), BoxError> {
    Ok(())
}

#[idempotent(consumer = "billing")]
async fn on_raw(tx: &mut Transaction<'_, Postgres>, event: Event<Raw>) -> Result<(), HandlerError> {
    let invoice: Invoice = serde_json::from_slice(&event.payload.bytes)?; // serde_json::Error
    let cents = lookup(invoice.cents)?; // anyhow::Error
    std::fs::metadata("/")?; // std::io::Error
    boxed()?; // Box<dyn Error + Send + Sync>
    sqlx::query("SELECT $1")
        .bind(cents)
        .execute(&mut **tx)
        .await?; // sqlx::Error
    Ok(())
}

#[test]
fn question_mark_classifies_the_errors_handlers_meet() {
    let _ = on_raw;
    let bad_json = serde_json::from_slice::<Invoice>(b"{").unwrap_err();
    assert!(matches!(
        HandlerError::from(bad_json),
        HandlerError::Permanent(_)
    ));
    let io = std::io::Error::other("disk");
    assert!(matches!(HandlerError::from(io), HandlerError::Retryable(_)));
}
