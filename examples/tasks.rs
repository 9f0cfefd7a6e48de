//! In-process tasks: the outbox without a broker. A service enqueues work (send a receipt)
//! in its own transaction, and its embedded relay runs a task handler for it instead of
//! publishing: retried with backoff when it fails, parked after `POSTAL_MAX_ATTEMPTS`, one at a
//! time per key in enqueue order, and run again if the process dies mid-run (at least once: the
//! handler makes its effect idempotent with `task.id`). The handler takes state (`State<T>`).
//!
//! Run first: PostgreSQL and `DATABASE_URL` (`bash scripts/stack.sh up`, then
//! `eval "$(bash scripts/stack.sh env)"`); no Kafka needed. Then, until Ctrl-C or SIGTERM:
//!
//! ```text
//! cargo run -p postal-examples --example tasks -- 5
//! ```
//!
//! It enqueues 5 tasks (the argument, else 3) and runs them; `postal status` shows them.

use anyhow::Context;
use postal::producer::{
    enqueue, NewEvent, Relay, RelayConfig, State, Task, TaskConfig, TaskError, TaskTransport,
    TopicFilter,
};
use postal::sqlx;
use postal::sqlx::{postgres::PgPoolOptions, PgPool};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct SendReceipt {
    order_id: i64,
    email: String,
}

/// The task handler's state.
#[derive(Clone)]
struct Mailer {
    pool: PgPool,
    sender: String,
}

async fn send_receipt(State(mailer): State<Mailer>, task: Task) -> Result<(), TaskError> {
    let receipt: SendReceipt = task.json()?; // a payload that does not decode: parked at once
                                             // A real mailer would call its provider here with `task.id` as the idempotency key. This
                                             // one records the mail, keyed by `task.id`, so a re-run after a crash sends nothing twice.
    sqlx::query(
        "INSERT INTO sent_receipts (task_id, order_id, sent_to, sent_from) VALUES ($1, $2, $3, $4)
         ON CONFLICT (task_id) DO NOTHING",
    )
    .bind(task.id.as_uuid())
    .bind(receipt.order_id)
    .bind(&receipt.email)
    .bind(&mailer.sender)
    .execute(&mailer.pool)
    .await
    .map_err(TaskError::retryable)?; // retried with backoff, parked after max attempts
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    postal::init_logging("info")?;
    let stop = postal::stop_signal()?;
    let receipts: i64 = std::env::args().nth(1).map_or(Ok(3), |n| n.parse())?;
    // Task runners claim only their own topic, in a relay group of their own, so that a
    // `postal relay --exclude-topics receipts` can publish the rest of the outbox.
    let config = RelayConfig::default()
        .group("receipts".into())
        .topics(TopicFilter::Only(vec!["receipts".into()]))
        .with_env()?;
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let pool = PgPoolOptions::new()
        // What the relay needs at once, plus a few for the handlers' own statements.
        .max_connections(config.connections_wanted() + 4)
        .connect(&url)
        .await?;
    postal::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS sent_receipts (task_id uuid PRIMARY KEY,
             order_id bigint NOT NULL, sent_to text NOT NULL, sent_from text NOT NULL)",
    )
    .execute(&pool)
    .await?;

    // A task is enqueued like any event: in your transaction, with your business rows.
    let mut tx = pool.begin().await?;
    for order_id in 1..=receipts {
        let email = format!("customer-{order_id}@example.com");
        let task = SendReceipt { order_id, email };
        let key = task.email.as_str(); // one customer's tasks run one at a time, in order
        enqueue(
            &mut tx,
            NewEvent::json("receipts", key, "receipt.requested", &task)?,
        )
        .await?;
    }
    tx.commit().await?;

    let mailer = Mailer {
        pool: pool.clone(),
        sender: "shop@example.com".into(),
    };
    let tasks = TaskTransport::new(TaskConfig::default())
        .state(mailer) // before `.on(…)`, as for a consumer
        .on("receipt.requested", send_receipt);
    // Runs tasks until SIGINT/SIGTERM; a stop waits up to `POSTAL_SHUTDOWN_TIMEOUT` for
    // running handlers, then gives their tasks back (they run again at the next start).
    let stats = Relay::new(pool, tasks, config)?.run(stop).await?;
    let (done, parked) = (stats.published, stats.parked);
    println!("stopped: {done} tasks done, {parked} parked");
    Ok(())
}
