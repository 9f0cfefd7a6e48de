//! Postal's producer half: write events into a transactional outbox in the same PostgreSQL
//! transaction as your business rows, and run a relay that publishes them to Kafka.
//!
//! ```no_run
//! use postal_producer::{enqueue, KafkaConfig, KafkaTransport, NewEvent, Relay, RelayConfig};
//! use serde::Serialize;
//!
//! #[derive(Serialize)]
//! struct OrderCreated { order_id: i64, total_cents: i64 }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/shop").await?;
//! postal_shared::migrate(&pool).await?;
//!
//! // Business row and event commit together, or not at all.
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id, customer) VALUES (7, 'c-42')").execute(&mut *tx).await?;
//! let event = NewEvent::json("orders", "c-42", "order.created", &OrderCreated { order_id: 7, total_cents: 2999 })?;
//! let event_id = enqueue(&mut tx, event).await?;
//! tx.commit().await?;
//!
//! // The relay (normally `postal relay`) publishes committed events and removes them.
//! let transport = KafkaTransport::new(KafkaConfig::new("127.0.0.1:9092"))?;
//! let relay = Relay::new(pool.clone(), transport, RelayConfig::default())?;
//! relay.run(postal_shared::stop_signal()?).await?; // until SIGINT or SIGTERM
//! # let _ = event_id; Ok(()) }
//! ```

mod activity;
mod allow;
#[doc(hidden)]
pub mod backlog;
mod checkout;
mod claim;
mod complete;
mod config;
mod enqueue;
mod env;
mod error;
mod event;
mod fence;
mod kafka;
mod key_chain;
mod lease;
mod outcome;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
mod relay;
pub mod retention;
mod route;
mod skipped;
mod tasks;
#[cfg(feature = "test-util")]
pub mod testing;
mod trace;
mod transport;
pub mod wal;

pub use allow::TopicAllowList;
pub use config::{RelayConfig, RelaySource, TopicFilter};
pub use enqueue::{enqueue, enqueue_batch, enqueue_once, KEY_LOCK_CLASS, NOTIFY_CHANNEL};
pub use error::Error;
pub use event::{NewEvent, MAX_PAYLOAD_BYTES, MAX_USER_HEADERS};
pub use kafka::{classify, KafkaConfig, KafkaTransport};
/// A `key=value` pair as given on a command line or in the environment (`--kafka`,
/// `--rabbitmq-routing-key`); errors never quote the value.
pub use postal_shared::secret::parse_property;
pub use postal_shared::Backoff;
pub use postal_shared::{ContentType, EventId, EventKey, EventType, SchemaVersion, Topic};
pub use postal_shared::{FromRef, State};
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::{RabbitConfig, RabbitTransport};
pub use relay::{Relay, RelayHealth, RelayStats, STALL_AFTER};
pub use route::{DynTransport, Router};
/// The `sqlx` Postal is built with (0.8). Its types are part of Postal's API (handlers and
/// `enqueue` take its `Transaction`, the relay and consumer its `PgPool`), so code that shares a
/// transaction with Postal uses this one: `sqlx::{Postgres, Transaction}` through this path
/// works whatever major version of `sqlx` the rest of your crate depends on.
pub use sqlx;
pub use tasks::{Task, TaskConfig, TaskError, TaskHandler, TaskTransport};
pub use transport::{FailureKind, OutboundEvent, PublishError, Transport};
pub use wal::WalSource;

#[cfg(test)]
mod source_rules {
    /// Guarantee: no transaction of the producer is begun with a bare `pool.begin()`, which
    /// sqlx leaves half-open on the pooled connection when the future is dropped after its
    /// `BEGIN` was sent (`postal_shared::cancel_safe`); the WAL relay's chunks began that way
    /// until helper-68 found it.
    #[test]
    fn transactions_begin_cancel_safe() {
        fn walk(dir: &std::path::Path, found: &mut Vec<String>) {
            // Spelled in two halves so that this test does not find itself.
            let needle = [".begin", "().await"].concat();
            for entry in std::fs::read_dir(dir).expect("src") {
                let path = entry.expect("entry").path();
                if path.is_dir() {
                    walk(&path, found);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).expect("source");
                    for (i, line) in text.lines().enumerate() {
                        let code = line.split("//").next().unwrap_or("");
                        if code.contains(&needle) {
                            found.push(format!("{}:{}", path.display(), i + 1));
                        }
                    }
                }
            }
        }
        let mut found = Vec::new();
        walk(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            &mut found,
        );
        assert!(
            found.is_empty(),
            "use postal_shared::cancel_safe::begin: {found:?}"
        );
    }
}
