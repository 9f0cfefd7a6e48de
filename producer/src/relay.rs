//! The relay loop: claim → hand to the transport → await acknowledgements → record outcomes.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore};
use uuid::Uuid;

use crate::claim::{self, all_partitions};
use crate::complete::{self, Failure};
use crate::config::RelayConfig;
use crate::enqueue::NOTIFY_CHANNEL;
use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};
use crate::Error;

/// Totals of one relay run, returned when it stops.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Events acknowledged by the destination and recorded.
    pub published: u64,
    /// Events parked as failed.
    pub parked: u64,
    /// Failed publishes rescheduled for a retry.
    pub retried: u64,
}

#[derive(Default)]
struct Counters {
    published: std::sync::atomic::AtomicU64,
    parked: std::sync::atomic::AtomicU64,
    retried: std::sync::atomic::AtomicU64,
}

/// A relay instance. Several may run against one database; each claims with its own id.
pub struct Relay<T: Transport> {
    pool: PgPool,
    transport: Arc<T>,
    config: RelayConfig,
    id: Uuid,
}

impl<T: Transport> Relay<T> {
    /// A relay publishing through `transport`. Fails if the configuration is invalid.
    pub fn new(pool: PgPool, transport: T, config: RelayConfig) -> Result<Self, Error> {
        config.validate()?;
        Ok(Relay {
            pool,
            transport: Arc::new(transport),
            config,
            id: Uuid::now_v7(),
        })
    }

    /// This instance's id (recorded as `claimed_by` on the rows it holds).
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// Runs until `shutdown` resolves, then stops claiming, waits (bounded) for in-flight
    /// acknowledgements, records them and releases whatever it still holds.
    ///
    /// Database or broker outages never end the loop: it logs one line per failed attempt
    /// and retries with backoff.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<RelayStats, Error> {
        let shutdown_notify = Arc::new(Notify::new());
        let wake = Arc::new(Notify::new());
        let counters = Arc::new(Counters::default());
        let unavailable_streak = Arc::new(AtomicU32::new(0));
        let paused_until = Arc::new(std::sync::Mutex::new(None::<Instant>));
        let slots = Arc::new(Semaphore::new(self.config.max_in_flight_batches));
        let partitions = all_partitions();

        let listener = self.config.listen.then(|| {
            tokio::spawn(listen(
                self.pool.clone(),
                wake.clone(),
                self.config.poll_interval,
            ))
        });

        tracing::info!(relay = %self.id, batch = self.config.batch_size, "relay started");
        tokio::pin!(shutdown);
        let mut db_failures: u32 = 0;
        loop {
            // Back off while the destination is unavailable.
            let pause = *paused_until.lock().expect("pause lock");
            if let Some(until) = pause {
                let now = Instant::now();
                if until > now {
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(until - now) => {}
                    }
                }
            }
            let permit = tokio::select! {
                _ = &mut shutdown => break,
                p = slots.clone().acquire_owned() => p.expect("semaphore never closed"),
            };
            // The claim is not raced against shutdown: a claim cancelled mid-statement could
            // still commit on the server after we released our rows. It is short and bounded.
            let batch = claim::claim(
                &self.pool,
                self.id,
                &partitions,
                self.config.batch_size,
                self.config.lease,
            )
            .await;
            let batch = match batch {
                Ok(b) => {
                    if db_failures > 0 {
                        tracing::info!("database reachable again; relay resumes");
                    }
                    db_failures = 0;
                    b
                }
                Err(e) => {
                    drop(permit);
                    let wait = self.config.backoff.delay(db_failures);
                    db_failures = db_failures.saturating_add(1);
                    tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "claim failed (database unreachable?); retrying");
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(wait.max(Duration::from_millis(100))) => {}
                    }
                    continue;
                }
            };
            if batch.is_empty() {
                drop(permit);
                tokio::select! {
                    _ = &mut shutdown => break,
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(self.config.poll_interval) => {}
                }
                continue;
            }
            let full = batch.len() == self.config.batch_size;
            let started = Instant::now();
            let acks = self.transport.send(&batch).await;
            let ctx = CompleteCtx {
                pool: self.pool.clone(),
                config: self.config.clone(),
                counters: counters.clone(),
                unavailable_streak: unavailable_streak.clone(),
                paused_until: paused_until.clone(),
                shutdown: shutdown_notify.clone(),
            };
            tokio::spawn(async move {
                let outcomes = acks.await;
                metrics::histogram!("postal_relay_batch_seconds")
                    .record(started.elapsed().as_secs_f64());
                ctx.record(batch, outcomes).await;
                drop(permit);
            });
            if !full {
                // A partial batch means the backlog is drained for now; a notification or the
                // next poll brings the loop back. Yield so acknowledgements get recorded.
                tokio::task::yield_now().await;
            }
        }

        tracing::info!(relay = %self.id, "relay stopping: waiting for in-flight acknowledgements");
        shutdown_notify.notify_waiters();
        if let Some(l) = listener {
            l.abort();
        }
        let all = self.config.max_in_flight_batches as u32;
        let drained =
            tokio::time::timeout(self.config.shutdown_timeout, slots.acquire_many(all)).await;
        if drained.is_err() {
            tracing::warn!("shutdown timeout reached with acknowledgements outstanding");
        }
        self.transport.flush(Duration::from_secs(1)).await;
        match claim::release_all(&self.pool, self.id).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(rows = n, "released rows still held by this relay"),
            Err(e) => {
                tracing::warn!(error = %e, "could not release held rows; they return after the lease")
            }
        }
        let stats = RelayStats {
            published: counters.published.load(Ordering::Relaxed),
            parked: counters.parked.load(Ordering::Relaxed),
            retried: counters.retried.load(Ordering::Relaxed),
        };
        tracing::info!(relay = %self.id, published = stats.published, parked = stats.parked, "relay stopped");
        Ok(stats)
    }
}

struct CompleteCtx {
    pool: PgPool,
    config: RelayConfig,
    counters: Arc<Counters>,
    unavailable_streak: Arc<AtomicU32>,
    paused_until: Arc<std::sync::Mutex<Option<Instant>>>,
    shutdown: Arc<Notify>,
}

impl CompleteCtx {
    async fn record(&self, batch: Vec<OutboundEvent>, outcomes: Vec<Result<(), PublishError>>) {
        let mut published = Vec::with_capacity(batch.len());
        let mut failures = Vec::new();
        let mut any_unavailable = false;
        let streak = self.unavailable_streak.load(Ordering::Relaxed);
        for (event, outcome) in batch.iter().zip(outcomes) {
            match outcome {
                Ok(()) => published.push(event.seq),
                Err(err) if err.kind == FailureKind::HeldBack => failures.push(Failure {
                    seq: event.seq,
                    counts: false,
                    park: false,
                    hold: false,
                    retry_in: Duration::ZERO,
                    reason: None,
                }),
                Err(err) => {
                    let counts = err.kind != FailureKind::Unavailable;
                    let attempts = event.attempts + i32::from(counts);
                    let park =
                        err.kind == FailureKind::Permanent || attempts >= self.config.max_attempts;
                    let retry_in = match err.kind {
                        FailureKind::Unavailable => {
                            any_unavailable = true;
                            self.config.backoff.delay(streak)
                        }
                        _ => self.config.backoff.delay(attempts.max(0) as u32),
                    };
                    if park {
                        tracing::warn!(event_id = %event.id, topic = %event.topic, key = %event.key, attempts, reason = %err.reason, "event parked as failed");
                    } else {
                        tracing::debug!(event_id = %event.id, reason = %err.reason, "publish failed; will retry");
                    }
                    failures.push(Failure {
                        seq: event.seq,
                        counts,
                        park,
                        hold: true,
                        retry_in,
                        reason: Some(err.reason),
                    });
                }
            }
        }
        if any_unavailable {
            let n = self.unavailable_streak.fetch_add(1, Ordering::Relaxed);
            let wait = self.config.backoff.delay(n).max(Duration::from_millis(200));
            tracing::warn!(retry_in_ms = wait.as_millis() as u64, reason = %failures.iter().find(|f| !f.counts).and_then(|f| f.reason.as_deref()).unwrap_or(""), "destination unavailable; pausing the relay");
            *self.paused_until.lock().expect("pause lock") = Some(Instant::now() + wait);
        } else if !published.is_empty() {
            self.unavailable_streak.store(0, Ordering::Relaxed);
        }

        // Record the outcome; retry while the database is unreachable. If we give up (shutdown)
        // the rows stay leased and are republished after the lease: duplicates, never loss.
        let mut attempt = 0u32;
        loop {
            match complete::complete(
                &self.pool,
                &published,
                &failures,
                self.config.delete_on_publish,
            )
            .await
            {
                Ok(()) => break,
                Err(e) => {
                    let wait = self
                        .config
                        .backoff
                        .delay(attempt)
                        .max(Duration::from_millis(100));
                    attempt += 1;
                    tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "recording published batch failed; retrying");
                    if attempt > 3 {
                        // During shutdown, stop retrying after a few attempts.
                        let stop = tokio::select! {
                            _ = self.shutdown.notified() => true,
                            _ = tokio::time::sleep(wait) => false,
                        };
                        if stop {
                            return;
                        }
                    } else {
                        tokio::time::sleep(wait).await;
                    }
                }
            }
        }
        let parked = failures.iter().filter(|f| f.park).count() as u64;
        let retried = failures.len() as u64 - parked;
        self.counters
            .published
            .fetch_add(published.len() as u64, Ordering::Relaxed);
        self.counters.parked.fetch_add(parked, Ordering::Relaxed);
        self.counters.retried.fetch_add(retried, Ordering::Relaxed);
        metrics::counter!("postal_relay_published_total").increment(published.len() as u64);
        metrics::counter!("postal_relay_failed_total").increment(parked);
        metrics::counter!("postal_relay_retried_total").increment(retried);
    }
}

/// Forwards `postal_outbox` notifications to `wake`, reconnecting with backoff when the
/// listening connection drops. Notifications are only a hint: the relay also polls.
async fn listen(pool: PgPool, wake: Arc<Notify>, poll: Duration) {
    let mut failures = 0u32;
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                let wait = (poll * failures.min(30)).min(Duration::from_secs(30));
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "cannot LISTEN for outbox notifications; polling meanwhile");
                tokio::time::sleep(wait).await;
                continue;
            }
        };
        if let Err(e) = listener.listen(NOTIFY_CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; polling meanwhile");
            tokio::time::sleep(poll).await;
            continue;
        }
        failures = 0;
        // After (re)connecting, notifications may have been missed: wake once to re-check.
        wake.notify_one();
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => wake.notify_one(),
                Ok(None) => {
                    tracing::warn!("notification connection lost; reconnecting");
                    wake.notify_one();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "notification connection failed; reconnecting");
                    break;
                }
            }
        }
    }
}
