//! Relay: embedding Postal's relay in your own service instead of running `postal relay`.
//! It publishes the committed outbox events to Kafka in per-key order and removes them,
//! configured from the same environment variables as `postal relay`, and stops gracefully on
//! SIGINT (Ctrl-C) or SIGTERM (`kill`, Kubernetes), exiting 0.
//!
//! Run first: the local stack and its environment (`bash scripts/stack.sh up`, then
//! `eval "$(bash scripts/stack.sh env)"`), and something that enqueues
//! (`cargo run -p postal-examples --example enqueue`). Then:
//!
//! ```text
//! cargo run -p postal-examples --example relay
//! ```
//!
//! Every `POSTAL_*` relay variable of README's configuration table applies (`POSTAL_LANES=2`,
//! `POSTAL_LEASE=30s`, `POSTAL_KAFKA=linger.ms=5`, …); a bad value stops it with one line
//! naming the variable.

use anyhow::Context;
use postal::producer::{KafkaConfig, KafkaTransport, Relay, RelayConfig};
use postal::sqlx::postgres::PgPoolOptions;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // `POSTAL_LOG` (else `RUST_LOG`) filters, `POSTAL_LOG_FORMAT=json` for log shippers.
    postal::init_logging("info")?;
    // Listen for SIGINT/SIGTERM from the start, so a stop during start-up is clean too.
    let stop = postal::stop_signal()?;

    // Defaults first, then the environment on top: the code states what this service wants,
    // the deployment tunes it without a rebuild.
    let config = RelayConfig::default().with_env()?;
    let brokers =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").context("KAFKA_BOOTSTRAP_SERVERS is not set")?;
    let kafka = KafkaTransport::new(KafkaConfig::new(brokers).with_env()?)?;

    // The relay holds a connection per claiming lane and per batch in flight, plus three
    // (lease heartbeat, LISTEN, housekeeping): size its pool for that, or claims wait.
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let pool = PgPoolOptions::new()
        .max_connections(config.connections_wanted())
        .connect(&url)
        .await?;
    postal::migrate(&pool).await?; // what `postal migrate` does; a no-op when current

    let relay = Relay::new(pool, kafka, config)?;
    // Runs until `stop` resolves, then stops claiming, waits (bounded by
    // `POSTAL_SHUTDOWN_TIMEOUT`) for the broker's acknowledgements in flight and records them.
    let stats = relay.run(stop).await?;
    tracing::info!(
        published = stats.published,
        parked = stats.parked,
        "relay stopped"
    );
    Ok(())
}
