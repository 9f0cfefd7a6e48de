//! Helpers shared by the scenarios.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use postal_producer::{
    FailureKind, KafkaConfig, KafkaTransport, OutboundEvent, PublishError, Relay, RelayConfig,
    RelayStats, Transport,
};
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A relay running in a task, stopped through `stop()`.
pub struct RunningRelay {
    stop: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<RelayStats, postal_producer::Error>>,
}

impl RunningRelay {
    /// Starts a relay with the given transport and config.
    pub fn start<T: Transport>(pool: &PgPool, transport: T, config: RelayConfig) -> Self {
        let relay = Relay::new(pool.clone(), transport, config).expect("valid relay config");
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(relay.run(async move {
            let _ = rx.await;
        }));
        RunningRelay {
            stop: Some(tx),
            handle,
        }
    }

    /// Starts a Kafka relay with test-friendly settings.
    pub fn kafka(pool: &PgPool, bootstrap: &str) -> Self {
        Self::start(pool, kafka_transport(bootstrap), fast_config())
    }

    /// Kills the relay: its task is dropped with whatever it was doing (claims roll back when
    /// their connections go), no shutdown work, no lease given up.
    pub fn kill(self) {
        self.handle.abort();
    }

    /// Graceful shutdown; returns the relay's totals.
    pub async fn stop(mut self) -> RelayStats {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.handle.await.expect("relay task").expect("relay run")
    }
}

/// Kafka transport for tests.
pub fn kafka_transport(bootstrap: &str) -> KafkaTransport {
    let mut cfg = KafkaConfig::new(bootstrap);
    cfg.topic_partitions = 4;
    // Within half the tests' 3 s lease.
    cfg.properties
        .insert("message.timeout.ms".into(), "1000".into());
    KafkaTransport::new(cfg).expect("kafka transport")
}

/// Relay settings for tests: quick polling and backoff.
pub fn fast_config() -> RelayConfig {
    RelayConfig {
        batch_size: 500,
        poll_interval: Duration::from_millis(200),
        lease: Duration::from_secs(3),
        backoff: postal_producer::Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(500),
        },
        shutdown_timeout: Duration::from_secs(10),
        ..RelayConfig::default()
    }
}

/// Rows in the outbox.
pub async fn outbox_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Counts failures by kind as they pass through a wrapped transport.
#[derive(Clone, Default)]
pub struct FailureCounts {
    pub unavailable: Arc<AtomicU64>,
    pub other: Arc<AtomicU64>,
}

/// A transport decorator that counts failure outcomes.
pub struct Counting<T> {
    pub inner: T,
    pub counts: FailureCounts,
}

impl<T: Transport> Transport for Counting<T> {
    type Acks = futures::future::BoxFuture<'static, Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        let acks = self.inner.send(batch).await;
        let counts = self.counts.clone();
        Box::pin(async move {
            let out = acks.await;
            for r in &out {
                match r {
                    Err(e) if e.kind == FailureKind::Unavailable => {
                        counts.unavailable.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        counts.other.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(()) => {}
                }
            }
            out
        })
    }
}
