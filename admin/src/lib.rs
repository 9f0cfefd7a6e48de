//! Operator actions on Postal's tables, and the dashboard that serves them.
//!
//! One implementation of each action, shared by the `postal` CLI (`postal failed`,
//! `postal dead-letters`) and the dashboard (`postal dashboard`, or `web::Dashboard`, feature
//! `web`, mounted in your own axum service):
//!
//! - [`parked`]: search parked events, group them by error, requeue or discard them (by id, by
//!   filter, with a cap), and the keys they hold back ([`parked::blocked_keys`]);
//! - [`dead_letters`]: search, replay to their topic, or mark resolved;
//! - [`held`]: held keys of consumer groups (`FinalFailure::HoldKey`): what waits behind each,
//!   and releasing one (retry the head, or dead-letter it, then the rest);
//! - [`lookup`]: did consumer X process event Y?
//! - [`pauses`]: pause and resume a topic or relay group at the relay, a consumer group or one
//!   of its topics at the consumer;
//! - [`overview`]: backlog, relays, consumers, dead letters and the last hour per minute;
//! - [`audit`]: every operator action, from the dashboard or the CLI, recorded through the
//!   actions above (who, via, database role, what, on what, how many; a discard's events whole).
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool) -> Result<(), postal_admin::Error> {
//! use postal_admin::parked::{self, Selection};
//!
//! // Requeue every parked event of one topic, refusing if more than 1,000 match (recorded in
//! // the audit trail as done by alice).
//! let filter = parked::Filter::default().topic("orders");
//! let by = postal_admin::audit::Operator::cli("alice");
//! let requeued = parked::requeue(&pool, &by, &Selection::Filter(filter), Some(1000)).await?;
//! println!("requeued {requeued}");
//! # Ok(()) }
//! ```

pub mod audit;
pub mod dead_letters;
mod error;
pub mod held;
pub mod kept_events;
pub mod lookup;
pub mod overview;
pub mod parked;
pub mod pauses;
#[doc(hidden)]
pub mod plans;
#[cfg(feature = "web")]
pub mod web;

pub use error::Error;
