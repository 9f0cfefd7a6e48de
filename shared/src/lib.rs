//! Shared vocabulary of Postal: typed event ids, the event envelope's validated parts, the Kafka
//! header names Postal writes and reads, the configuration of every Kafka producer Postal makes
//! ([`kafka_producer`]), and the embedded schema migrator.
//!
//! ```no_run
//! # async fn run() -> Result<(), postal_shared::Error> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/app").await?;
//! // Creates the `postal` schema and applies Postal's migrations; a second call is a no-op.
//! postal_shared::migrate(&pool).await?;
//!
//! let id = postal_shared::EventId::new(); // UUIDv7: time-ordered
//! let topic = postal_shared::Topic::new("orders")?;
//! assert_eq!(topic.as_str(), "orders");
//! # let _ = id;
//! # Ok(()) }
//! ```

mod availability;
mod backoff;
pub mod cancel_safe;
pub mod cleanup;
mod contract;
mod detached_drop;
pub mod env;
mod envelope;
mod error;
pub mod headers;
mod ids;
pub mod kafka_producer;
mod log_throttle;
#[cfg(feature = "logging")]
mod logging;
mod migrate;
pub mod pause;
pub mod pooler;
pub mod secret;
mod setters;
mod signal;
mod state;
pub mod text;

pub use availability::database_unavailable;
pub use backoff::Backoff;
pub use contract::{
    breaks_contract, check_schema, connect_hint, known_version, unreachable_cause, wait_for_schema,
    watch_schema, SCHEMA_RECHECK,
};
pub use detached_drop::DetachedDrop;
pub use envelope::{
    ContentType, EventKey, EventType, SchemaVersion, Topic, MAX_KEY_LEN, MAX_NAME_LEN,
};
pub use error::Error;
pub use ids::EventId;
pub use log_throttle::LogThrottle;
#[cfg(feature = "logging")]
pub use logging::{init_logging, LogFormat};
pub use migrate::{migrate, migrate_within, migrator, MIGRATE_LOCK_WAIT, POSTAL_SCHEMA};
pub use signal::{stop_signal, StopSignal};
/// The `sqlx` Postal is built with (0.8). Its types are part of Postal's API (handlers and
/// `enqueue` take its `Transaction`, the relay and consumer its `PgPool`), so code that shares a
/// transaction with Postal uses this one: `sqlx::{Postgres, Transaction}` through this path
/// works whatever major version of `sqlx` the rest of your crate depends on.
pub use sqlx;
pub use state::{FromRef, State};
