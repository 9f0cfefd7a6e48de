//! `#[idempotent]` accepts the documented handler shapes (the rejected ones are in
//! `tests/ui/fail`, checked by `macro_ui.rs`).

use postal_consumer::{
    idempotent, Batch, BatchHandler, Event, EventId, FromRef, Handler, HandlerError,
    IntoBatchHandler, IntoHandler, Outcome, Raw, State,
};
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

/// The application's state.
#[derive(Clone)]
struct App {
    topics: Topics,
    greeting: String,
}

/// A part of it, taken by `FromRef`.
#[derive(Clone)]
struct Topics {
    invoices: String,
}

impl FromRef<App> for Topics {
    fn from_ref(app: &App) -> Self {
        app.topics.clone()
    }
}

// ... and optionally the state first: the whole state ...
#[idempotent(consumer = "billing")]
async fn on_greeting(
    State(app): State<App>,
    tx: &mut Transaction<'_, Postgres>,
    event: Event<OrderCreated>,
) -> Result<(), HandlerError> {
    let _ = (app.greeting, tx, event.payload.order_id);
    Ok(())
}

// ... or a part of it.
#[idempotent(consumer = "billing")]
async fn on_invoice(
    State(topics): State<Topics>,
    conn: &mut PgConnection,
    event: Event<Raw>,
) -> Result<(), HandlerError> {
    let _ = (topics.invoices, conn, event);
    Ok(())
}

/// A crate re-exporting Postal names it with `crate = "..."`.
mod reexport {
    pub use postal_consumer as postal;
}

#[idempotent(consumer = "billing", crate = "reexport::postal")]
async fn on_reexported(conn: &mut PgConnection, event: Event<Raw>) -> Result<(), HandlerError> {
    let _ = (conn, event);
    Ok(())
}

async fn standalone_with_state(
    pool: sqlx::PgPool,
    topics: Topics,
) -> Result<Outcome, HandlerError> {
    let mut tx = pool.begin().await?;
    let raw = Raw {
        content_type: None,
        bytes: Vec::new(),
    };
    let event = Event::new(EventId::new(), "invoice", raw);
    let outcome = on_invoice::call(State(topics), &mut tx, event).await?;
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
    assert_eq!(Handler::name(&on_reexported), "on_reexported");
    let _ = (standalone, standalone_with_state);
}

/// Guarantee: a handler taking `State<T>` is bound to the consumer's state when routed — the
/// whole state, or the part `FromRef` takes — and keeps its consumer and handler names.
#[test]
fn stateful_handlers_bind_to_the_state() {
    let app = App {
        topics: Topics {
            invoices: "invoices".into(),
        },
        greeting: "hello".into(),
    };
    let whole = on_greeting.into_handler(&app);
    let part = on_invoice.into_handler(&app);
    assert_eq!(Handler::consumer(&whole), "billing");
    assert_eq!(Handler::name(&part), "on_invoice");
    assert_eq!(on_invoice::CONSUMER, "billing");
    // A stateless handler is routed to whatever the state is.
    let plain = IntoHandler::<App>::into_handler(on_order, &app);
    assert_eq!(Handler::name(&plain), "on_order");
}

// Batch handlers: the events of a batch as `Batch<T>` ...
#[idempotent(consumer = "billing")]
async fn on_orders(
    tx: &mut Transaction<'_, Postgres>,
    events: Batch<OrderCreated>,
) -> Result<(), HandlerError> {
    let ids: Vec<i64> = events.iter().map(|e| e.payload.order_id).collect();
    sqlx::query("SELECT $1::bigint[]")
        .bind(&ids)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

// ... or as a slice, with the state first if wanted.
#[idempotent(consumer = "billing")]
async fn on_invoices(
    State(topics): State<Topics>,
    conn: &mut PgConnection,
    events: &[Event<Raw>],
) -> Result<(), HandlerError> {
    let _ = (topics.invoices, conn, events.len());
    Ok(())
}

async fn standalone_batch(pool: sqlx::PgPool, topics: Topics) -> Result<(), HandlerError> {
    let mut tx = pool.begin().await?;
    let order = |id| {
        Event::new(
            EventId::new(),
            "order.created",
            OrderCreated { order_id: id },
        )
    };
    let outcomes: Vec<Outcome> = on_orders::call(&mut tx, vec![order(1), order(2)]).await?;
    let raw = Raw {
        content_type: None,
        bytes: Vec::new(),
    };
    let invoice = Event::new(EventId::new(), "invoice", raw);
    let more: Vec<Outcome> = on_invoices::call(State(topics), &mut tx, vec![invoice]).await?;
    tx.commit().await?;
    let _ = (outcomes, more);
    Ok(())
}

/// Guarantee: the batch forms compile (`Batch<T>` or `&[Event<T>]`, with or without state),
/// implement `BatchHandler` (bound to the state when routed) and expose `call`.
#[test]
fn batch_signatures() {
    assert_eq!(on_orders::CONSUMER, "billing");
    assert_eq!(BatchHandler::name(&on_orders), "on_orders");
    let app = App {
        topics: Topics {
            invoices: "invoices".into(),
        },
        greeting: "hello".into(),
    };
    let bound = on_invoices.into_batch_handler(&app);
    assert_eq!(BatchHandler::consumer(&bound), "billing");
    assert_eq!(BatchHandler::name(&bound), "on_invoices");
    let plain = IntoBatchHandler::<App>::into_batch_handler(on_orders, &app);
    assert_eq!(BatchHandler::name(&plain), "on_orders");
    let _ = standalone_batch;
}
