//! The sweep: the rows the slot's stream does not publish, published by polling.
//!
//! The stream publishes the rows it delivers that are due at once. It leaves pending the rows
//! it does not hold (committed before the slot existed, or while an operator had dropped it),
//! rows scheduled for later or waiting for a retry, rows requeued by an operator, and the
//! rows of a key behind any of those. While the WAL relay holds the slot's lease it runs a
//! polling relay beside the stream, in the same relay group, which claims such rows once they
//! are due, with polling's rules (attempts, backoff, parking, held keys, the partition leases
//! and their fence).
//!
//! The sweep claims only rows below a bound on `seq` ([`crate::claim::claim_below`]), so that
//! it does not race the stream for the rows the stream is about to publish. Each tick the
//! bound moves up to the highest `seq` in the table at the tick before, and only while the
//! stream is caught up (its last read was not full, or it read a keepalive): rows
//! committed before then were delivered by the stream already, so those still pending are the
//! stream's leftovers. A bound on `seq` keeps every key's order (a key's earlier rows have
//! lower sequence numbers). The bound only decides which rows the sweep looks at: where the
//! sweep and the stream meet on a row (a long transaction's row, older than the bound when
//! it commits), the rules that keep a key's order between any two publishers hold — a claim
//! leaves a key's later rows behind a row another session has locked (`crate::skipped`),
//! the stream carries a key's rows behind a row locked elsewhere and leaves them behind an
//! older pending row it was not given (`super::rows`), and whoever marks a row first
//! publishes it (the other finds it no longer pending).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::{RelayConfig, RelaySource};
use crate::relay::{Relay, RelayStats};
use crate::transport::Transport;

/// A running sweep. Its tasks live in sets that abort them when dropped: a WAL relay dropped
/// in-process (killed) leaves no sweep running on its behalf.
pub(super) struct Sweep {
    stop: CancellationToken,
    relay: tokio::task::JoinSet<RelayStats>,
    bound: tokio::task::JoinSet<()>,
}

/// What the stream tells the sweep: whether it is caught up, and the bound it keeps.
#[derive(Clone, Default)]
pub(super) struct Progress {
    /// The stream's last read was not full, or it read a keepalive.
    pub caught_up: Arc<AtomicBool>,
    /// The sweep claims rows below this `seq` only.
    pub below: Arc<AtomicI64>,
}

impl Progress {
    /// The stream read `rows` inserts, at most `max` in one read.
    pub(super) fn read(&self, rows: usize, max: usize) {
        self.caught_up.store(rows < max, Ordering::Relaxed);
    }

    /// The stream read a keepalive: everything committed before it was received.
    pub(super) fn idle(&self) {
        self.caught_up.store(true, Ordering::Relaxed);
    }
}

/// How often the sweep's bound moves, and how often its claim loop looks when it found
/// nothing: the poll interval, at least 200 ms.
fn tick(config: &RelayConfig) -> Duration {
    config.poll_interval.max(Duration::from_millis(200))
}

/// Starts the sweep: a polling relay (one lane, no `LISTEN`, no housekeeping: the WAL relay
/// does that) of `config`'s group, and the task that moves its bound.
pub(super) fn start<T: Transport>(
    pool: &PgPool,
    transport: Arc<T>,
    config: &RelayConfig,
    progress: &Progress,
) -> Sweep {
    let mut polling = config.clone();
    polling.source = RelaySource::Poll;
    polling.listen = false;
    polling.lanes = 1;
    polling.poll_interval = tick(config);
    let stop = CancellationToken::new();
    let relay = Relay::sweep(pool.clone(), transport, polling, progress.below.clone());
    tracing::info!(relay = %relay.id(), "WAL relay: sweep started (publishes what the slot's stream leaves pending: rows from before the slot, scheduled rows, retries, requeued rows)");
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn({
        let stop = stop.clone();
        async move {
            match relay.run(stop.cancelled_owned()).await {
                Ok(stats) => stats,
                Err(e) => {
                    tracing::warn!(error = %e, "WAL relay: the sweep stopped");
                    RelayStats::default()
                }
            }
        }
    });
    let mut bound = tokio::task::JoinSet::new();
    bound.spawn(move_bound(pool.clone(), tick(config), progress.clone()));
    Sweep {
        stop,
        relay: tasks,
        bound,
    }
}

impl Sweep {
    /// Stops the sweep (gracefully: its batches in flight are waited for within the relay's
    /// shutdown timeout) and returns what it published.
    pub(super) async fn stop(mut self, config: &RelayConfig) -> RelayStats {
        self.bound.abort_all();
        self.stop.cancel();
        let within = config.shutdown_timeout * 2 + Duration::from_secs(10);
        match tokio::time::timeout(within, self.relay.join_next()).await {
            Ok(Some(Ok(stats))) => stats,
            Ok(_) => RelayStats::default(),
            Err(_) => {
                tracing::warn!(
                    "WAL relay: the sweep did not stop in time; aborted (its claims roll back)"
                );
                self.relay.abort_all();
                while self.relay.join_next().await.is_some() {}
                RelayStats::default()
            }
        }
    }
}

/// Every `tick`: when the stream is caught up, the bound moves up to past the highest `seq`
/// read at the tick before; then reads it again.
async fn move_bound(pool: PgPool, tick: Duration, progress: Progress) {
    let mut before: Option<i64> = None;
    loop {
        tokio::time::sleep(tick).await;
        if progress.caught_up.load(Ordering::Relaxed) {
            if let Some(seq) = before {
                let was = progress
                    .below
                    .fetch_max(seq.saturating_add(1), Ordering::Relaxed);
                if was <= seq {
                    tracing::trace!(below = seq + 1, "WAL relay: the sweep's bound moved");
                }
            }
        }
        match sqlx::query_scalar::<_, Option<i64>>("SELECT max(seq) FROM postal.outbox")
            .fetch_one(&pool)
            .await
        {
            Ok(seq) => before = seq.or(before),
            Err(e) => {
                tracing::debug!(error = %e, "WAL relay: could not read the outbox's highest seq for the sweep");
            }
        }
    }
}
