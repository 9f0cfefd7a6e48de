//! Postal's consumer half: dedup of delivered events by `(consumer_name, event_id)` in the
//! consumer's own PostgreSQL transaction.
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool, event_id: postal_shared::EventId) -> Result<(), postal_consumer::Error> {
//! let mut tx = pool.begin().await?;
//! if postal_consumer::dedup::record(&mut tx, "billing", event_id).await? {
//!     // First delivery: apply the effects in `tx`.
//! }
//! tx.commit().await?;
//! # Ok(()) }
//! ```

pub mod dedup;
mod error;

pub use error::Error;
