//! Postal's consumer half: Kafka handlers whose database effects happen exactly once per event.
//!
//! Each handler runs in a PostgreSQL transaction that also writes the
//! `postal.processed_events (consumer_name, event_id)` dedup row and the partition's next
//! offset: all commit together or none does. A redelivered event finds its dedup row and is
//! skipped; a restarted consumer seeks to the offset stored beside the effects, so a crash
//! between the database commit and the Kafka commit replays nothing.
//!
//! ```no_run
//! use postal_consumer::{idempotent, Consumer, ConsumerConfig, Event, HandlerError};
//! use serde::Deserialize;
//! use sqlx::{Postgres, Transaction};
//!
//! #[derive(Deserialize)]
//! struct OrderCreated { order_id: i64, total_cents: i64 }
//!
//! /// Books an invoice for each new order, exactly once.
//! #[idempotent(consumer = "billing")]
//! async fn on_order(
//!     tx: &mut Transaction<'_, Postgres>,
//!     event: Event<OrderCreated>,
//! ) -> Result<(), HandlerError> {
//!     sqlx::query("INSERT INTO invoices (event_id, order_id, cents) VALUES ($1, $2, $3)")
//!         .bind(event.id.as_uuid())
//!         .bind(event.payload.order_id)
//!         .bind(event.payload.total_cents)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/billing").await?;
//! postal_shared::migrate(&pool).await?;
//! let consumer = Consumer::builder(pool, ConsumerConfig::new("127.0.0.1:9092", "billing"))
//!     .on("orders", "order.created", on_order)
//!     .build()?;
//! consumer.run_until_signal().await?; // SIGINT / SIGTERM: graceful shutdown
//! # Ok(()) }
//! ```
//!
//! The same handler works inside a transaction you own (no broker involved):
//!
//! ```no_run
//! # use postal_consumer::{idempotent, Event, HandlerError, Outcome};
//! # use sqlx::{Postgres, Transaction};
//! # #[idempotent(consumer = "billing")]
//! # async fn on_order(tx: &mut Transaction<'_, Postgres>, event: Event<serde_json::Value>) -> Result<(), HandlerError> { Ok(()) }
//! # async fn run(pool: sqlx::PgPool, event: Event<serde_json::Value>) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = pool.begin().await?;
//! match on_order::call(&mut tx, event).await? {
//!     Outcome::Applied => {}   // first delivery: effects written in `tx`
//!     Outcome::Duplicate => {} // seen before: the body did not run
//!     _ => {}
//! }
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # Throughput mode
//! [`ConsumerConfig::max_batch`] above 1 processes up to that many records of a partition in
//! one transaction (one multi-row dedup insert, one offset update); a failing record is isolated
//! under a savepoint and the partition's order holds. A [`BatchHandler`] (`#[idempotent]` on an
//! `async fn` taking [`Batch<T>`](Batch)) gets the batch's new events in one call.
//!
//! # Testing handlers
//! `testing::deliver` and `testing::assert_applied_once` (feature `test-util`, for
//! `[dev-dependencies]`) run a handler against a real database without a broker.
//!
//! # Failures
//! A handler returns [`HandlerError::Retryable`] (retried with backoff, then dead-lettered),
//! [`HandlerError::Permanent`] (dead-lettered at once) or [`HandlerError::Unavailable`]
//! (retried for as long as it takes). Undecodable payloads, records without a `ce_id`,
//! event types without a handler ([`UnknownTypes`]) and handler panics are dead-lettered too.
//! A dead letter is written to `postal.dead_letters` in the same transaction that moves the
//! partition past the record — none can be lost — and then published to `<topic>.dlq` with the
//! original key, value and headers plus `postal_dlq_*` headers naming the error. The partition
//! moves on: later events of the same key are processed, so that key is reordered downstream
//! of the dead letter; re-driving it later applies it after them.

mod batch;
mod batch_handler;
mod client;
mod config;
mod context;
mod dead_letter;
mod dedup;
mod dlq_copy;
mod error;
mod event;
mod handler;
mod idle_end;
mod offsets;
mod packed_headers;
mod partition;
mod pause;
mod reason;
mod record;
mod replaced;
pub mod retention;
mod route;
mod runtime;
mod stall;
mod stats;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
mod trace;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
use __private as private;
// Also in the crate's own tests: its regression and random-input tests run in every test run.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;

pub use batch_handler::{Batch, BatchHandler, IntoBatchHandler};
pub use config::{ConsumerConfig, FinalFailure, UnknownTypes};
pub use dead_letter::Reason as DeadLetterReason;
pub use error::Error;
pub use event::{Event, Headers, Payload, Position, Raw};
pub use futures::future::BoxFuture;
pub use handler::{
    BoxError, FromRef, Handler, HandlerError, IntoHandler, IntoHandlerError, Outcome, State,
};
pub use postal_shared::{Backoff, EventId};
pub use private::{apply, apply_batch};
pub use replaced::impossible as log_replaced;
pub use runtime::{shutdown_signal, Consumer, ConsumerBuilder};
/// The `sqlx` Postal is built with (0.8). Its types are part of Postal's API (handlers and
/// `enqueue` take its `Transaction`, the relay and consumer its `PgPool`), so code that shares a
/// transaction with Postal uses this one: `sqlx::{Postgres, Transaction}` through this path
/// works whatever major version of `sqlx` the rest of your crate depends on.
pub use sqlx;
pub use stall::STALL_AFTER;
pub use stats::{Stats, StatsSnapshot};

/// Turns a plain `async fn([state,] tx, event) -> Result<(), HandlerError>` into an idempotent
/// handler.
///
/// ```ignore
/// #[idempotent(consumer = "billing")]
/// async fn on_order(tx: &mut Transaction<'_, Postgres>, event: Event<OrderCreated>)
///     -> Result<(), HandlerError> { Ok(()) }
/// ```
///
/// The function becomes a unit struct of the same name that
/// - can be routed (`.on(topic, type, on_order)`): the runtime opens the transaction, records
///   the dedup row, runs the body, stores the next offset and commits — all or nothing;
/// - has `on_order::call(&mut tx, event)`, for use inside a transaction you own: records the
///   dedup row with `ON CONFLICT DO NOTHING` under a savepoint, returns
///   [`Outcome::Duplicate`] without running the body if it existed, otherwise runs the body
///   and returns [`Outcome::Applied`]; any error rolls back the dedup row and the effects
///   together; you commit;
/// - has `on_order::CONSUMER`, the dedup scope.
///
/// The parameters are, in this order: optionally [`State<T>`](State) (the consumer's state, or
/// a part of it by [`FromRef`]; `call` then takes it first too); `&mut Transaction<'_, Postgres>`
/// (or `&mut PgConnection`); `Event<T>` where `T` is any `serde` type (decoded from JSON) or
/// [`Raw`]. Other signatures fail to compile with an error at the offending part.
///
/// With [`Batch<T>`](Batch) or `&[Event<T>]` as the last parameter it makes a batch handler
/// instead ([`BatchHandler`], routed with
/// [`on_batch`](ConsumerBuilder::on_batch)): the body gets the new events of a partition batch
/// at once, and `call(&mut tx, events)` takes a `Vec` of events and returns one [`Outcome`]
/// per event.
pub use postal_macros::idempotent;
