//! Postal: effectively-once event delivery between services over PostgreSQL and Kafka, as one
//! dependency. It re-exports the two halves, as `tokio` and `tracing` re-export theirs:
//!
//! - `producer` (feature `producer`): write an event in the same transaction as your rows
//!   (`producer::enqueue`); the relay publishes it and marks it only once the broker has it.
//! - `consumer` (feature `consumer`): handlers whose effects, dedup row and consumed offset
//!   commit in one transaction (`#[idempotent]`), so each event's effects happen once.
//! - `admin` (feature `admin`, not on by default): the operator actions and the dashboard to
//!   mount in your axum service.
//!
//! The vocabulary both share ([`EventId`], [`Topic`], [`migrate`], …) is at the top level, and
//! so is the [`sqlx`] Postal is built with.
//!
//! The package is `postal-outbox` (the name `postal` on crates.io is another project's); its
//! library is `postal`.
//!
//! ```no_run
//! use postal::consumer::{idempotent, ConsumerConfig, Event, HandlerError, State};
//! use postal::producer::{enqueue, NewEvent};
//! use postal::sqlx::{self, PgPool, Postgres, Transaction};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct OrderPlaced { order_id: i64 }
//!
//! #[derive(Clone)]
//! struct App { pool: PgPool }
//!
//! // `#[idempotent]` finds Postal through this crate as well as through `postal-consumer`.
//! #[idempotent(consumer = "billing")]
//! async fn bill(State(_app): State<App>, tx: &mut Transaction<'_, Postgres>,
//!               event: Event<OrderPlaced>) -> Result<(), HandlerError> {
//!     sqlx::query("INSERT INTO ledger (order_id) VALUES ($1)")
//!         .bind(event.payload.order_id).execute(&mut **tx).await?;
//!     Ok(())
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = PgPool::connect("postgres://localhost/shop").await?;
//! postal::migrate(&pool).await?;
//!
//! let mut tx = pool.begin().await?;
//! let event = NewEvent::json("orders", "customer-7", "order.placed", &OrderPlaced { order_id: 7 })?;
//! enqueue(&mut tx, event).await?;
//! tx.commit().await?;
//!
//! let consumer = postal::consumer::Consumer::builder(
//!         pool.clone(), ConsumerConfig::new("localhost:9092", "billing"))
//!     .state(App { pool: pool.clone() })
//!     .on("orders", "order.placed", bill)
//!     .build()?;
//! consumer.run_until_signal().await?;
//! # Ok(()) }
//! ```

pub use postal_shared::{
    migrate, stop_signal, Backoff, ContentType, Error, EventId, EventKey, EventType, FromRef,
    SchemaVersion, State, StopSignal, Topic,
};

#[cfg(feature = "logging")]
pub use postal_shared::init_logging;

/// The `sqlx` Postal is built with (0.8). Its types are part of Postal's API (handlers and
/// `enqueue` take its `Transaction`, the relay and consumer its `PgPool`): write
/// `use postal::sqlx::{PgPool, Postgres, Transaction};` and a crate needs no `sqlx` dependency
/// of its own, or may depend on another major version of it for the rest of its code (a
/// transaction of that other version cannot be handed to Postal). `sqlx::query!` and the other
/// checked macros need `sqlx` as a direct dependency of the same major version.
pub use postal_shared::sqlx;

/// The producer half (feature `producer`): see [`postal_producer`].
#[cfg(feature = "producer")]
pub use postal_producer as producer;

/// The consumer half (feature `consumer`): see [`postal_consumer`].
#[cfg(feature = "consumer")]
pub use postal_consumer as consumer;

/// Operator tools and the dashboard (feature `admin`): see [`postal_admin`].
#[cfg(feature = "admin")]
pub use postal_admin as admin;
