use postal_consumer::{idempotent, Consumer, ConsumerConfig, Event, HandlerError, State};
use sqlx::{Postgres, Transaction};

#[derive(Clone)]
struct Topics {
    invoices: String,
}

#[derive(Clone)]
struct App {
    greeting: String,
}

#[idempotent(consumer = "billing")]
async fn on_order(
    State(topics): State<Topics>,
    tx: &mut Transaction<'_, Postgres>,
    event: Event<u32>,
) -> Result<(), HandlerError> {
    let _ = (topics.invoices, tx, event);
    Ok(())
}

#[idempotent(consumer = "billing")]
async fn state_not_first(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<u32>,
    State(app): State<App>,
) -> Result<(), HandlerError> {
    let _ = (tx, event, app.greeting);
    Ok(())
}

fn route(pool: sqlx::PgPool) {
    let app = App { greeting: "hello".into() };
    // The consumer's state is `App`, which does not provide `Topics`.
    let _ = Consumer::builder(pool.clone(), ConsumerConfig::new("b:9092", "g"))
        .state(app)
        .on("orders", "order.created", on_order);
    // No state given at all.
    let _ = Consumer::builder(pool, ConsumerConfig::new("b:9092", "g"))
        .on("orders", "order.created", on_order);
}

fn main() {
    let _ = route;
}
