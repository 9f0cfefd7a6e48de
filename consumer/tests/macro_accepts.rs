//! `#[idempotent]` accepts the documented handler shapes (the rejected ones are in
//! `tests/ui/fail`, checked by `macro_ui.rs`).

use postal_consumer::{idempotent, Event, EventId, Handler, HandlerError, Outcome, Raw};
use serde::Deserialize;
use sqlx::{PgConnection, Postgres, Transaction};

/// A payload.
#[derive(Deserialize)]
pub struct OrderCreated {
    /// Order id.
    pub order_id: i64,
}

/// Handlers take the transaction ...
#[idempotent(consumer = "billing")]
pub async fn on_order(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<OrderCreated>,
) -> Result<(), HandlerError> {
    sqlx::query("SELECT $1")
        .bind(event.payload.order_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

// ... or the connection, and may take raw payloads.
#[idempotent(consumer = "billing")]
async fn on_blob(conn: &mut PgConnection, event: Event<Raw>) -> Result<(), HandlerError> {
    let _ = (conn, event.payload.bytes.len());
    Ok(())
}

async fn standalone(pool: sqlx::PgPool) -> Result<Outcome, HandlerError> {
    let mut tx = pool.begin().await?;
    let event = Event::new(
        EventId::new(),
        "order.created",
        OrderCreated { order_id: 7 },
    );
    let outcome = on_order::call(&mut tx, event).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// Guarantee: the documented handler shapes compile (transaction or connection, typed or raw
/// payload, public or private) and expose the consumer name, handler name and `call`.
#[test]
fn accepted_signatures() {
    assert_eq!(on_order::CONSUMER, "billing");
    assert_eq!(Handler::consumer(&on_blob), "billing");
    assert_eq!(Handler::name(&on_order), "on_order");
    let _ = standalone;
}
