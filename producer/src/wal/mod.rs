//! The WAL source of the relay (`postal relay --read-from wal`, [`crate::RelaySource::Wal`]):
//! outbox inserts read from a logical replication slot (pgoutput) instead of claimed by
//! polling, published through the same transport in commit order. docs/wal-relay.md has the
//! design; `stream` reads the slot, `pgoutput` decodes it, `rows` locks, publishes and
//! marks a batch's rows, and `confirm` is the rule for the slot's confirmed position.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::config::RelayConfig;
use crate::relay::RelayStats;
use crate::transport::{FailureKind, Transport};
use crate::Error;

mod confirm;
mod lease;
mod pgoutput;
mod rows;
pub mod slot;
mod stream;

/// Where the WAL relay reads: a logical replication slot (plugin `pgoutput`) and a
/// publication of the inserts into `postal.outbox` ([`slot::create`] makes both).
#[derive(Clone, PartialEq, Eq)]
pub struct WalSource {
    /// The replication connection: `postgres://user:password@host:port/database?sslmode=…`
    /// (the user needs the `REPLICATION` attribute). Only `sslmode` is read from the query.
    pub url: String,
    /// The slot's name.
    pub slot: String,
    /// The publication's name.
    pub publication: String,
    /// How often the relay reports its confirmed position to the server, at most (a raised
    /// position is sent within this), and at least while idle (default 1 s).
    pub status_interval: Duration,
}

impl std::fmt::Debug for WalSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URL: it may hold a password.
        f.debug_struct("WalSource")
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("status_interval", &self.status_interval)
            .finish()
    }
}

impl WalSource {
    /// A source reading `slot` (publication `publication`) over the connection `url`.
    pub fn new(
        url: impl Into<String>,
        slot: impl Into<String>,
        publication: impl Into<String>,
    ) -> Self {
        WalSource {
            url: url.into(),
            slot: slot.into(),
            publication: publication.into(),
            status_interval: Duration::from_secs(1),
        }
    }
}

/// How often the relay records its slot's state as metrics.
const METRICS_INTERVAL: Duration = Duration::from_secs(5);

/// Runs the WAL relay until `shutdown` resolves. A batch under way when it does gets
/// `shutdown_timeout` to finish; one that does not is given up unconfirmed (its rows are read
/// from the slot again by the next run, and those already marked are skipped).
///
/// It streams only while it holds the slot's lease (`lease`, `config.lease`): it stands by
/// while another relay holds it, and stops streaming (and marks nothing more) once it lost it.
pub(crate) async fn run<T: Transport>(
    pool: PgPool,
    transport: Arc<T>,
    config: RelayConfig,
    source: WalSource,
    holder: uuid::Uuid,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<RelayStats, Error> {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut stats = RelayStats::default();
    let mut failures = 0u32;
    let mut held: Option<lease::Held> = None;
    // The slot's state as metrics, every 5 s, holder or standby alike (alerts take the
    // maximum per slot).
    let metrics = tokio::spawn({
        let (pool, slot) = (pool.clone(), source.slot.clone());
        async move {
            loop {
                if let Err(e) = slot::record_metrics(&pool, &slot).await {
                    tracing::debug!(error = %e, "WAL relay: could not read the slot's state for metrics");
                }
                tokio::time::sleep(METRICS_INTERVAL).await;
            }
        }
    });
    tracing::info!(slot = %source.slot, publication = %source.publication, %holder, "WAL relay started");
    'session: loop {
        let lease = match &held {
            Some(h) if !h.is_lost() => h,
            _ => {
                held = None;
                match lease::acquire(&pool, &source.slot, holder, config.lease, &mut shutdown).await
                {
                    Some(h) => held.insert(h),
                    None => break 'session,
                }
            }
        };
        let stream = tokio::select! {
            () = &mut shutdown => break 'session,
            s = stream::Stream::start(&source, (config.lease / 2).max(Duration::from_secs(5))) => s,
        };
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "WAL relay: could not start streaming; retrying");
                // The previous holder's walsender may still be ending.
                lease.end_walsender(&pool).await;
                if pause(&config, failures, &mut shutdown).await {
                    break 'session;
                }
                continue;
            }
        };
        let mut confirm = confirm::Confirm::default();
        loop {
            let read = tokio::select! {
                biased;
                () = &mut shutdown => {
                    stream.stop().await;
                    break 'session;
                }
                () = lease.lost() => {
                    tracing::warn!(slot = %source.slot, "WAL relay: lost the slot's lease; stopped streaming, standing by");
                    stream.stop().await;
                    continue 'session;
                }
                r = stream.next(config.batch_size) => r,
            };
            match read {
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, "WAL relay: the replication session ended; restarting from the slot's confirmed position");
                    stream.stop().await;
                    if pause(&config, failures, &mut shutdown).await {
                        break 'session;
                    }
                    continue 'session;
                }
                Ok(stream::Read::KeepAlive(lsn)) => {
                    if let Some(lsn) = confirm.keepalive(lsn) {
                        stream.confirm(lsn);
                    }
                }
                Ok(stream::Read::Batch(batch)) => {
                    failures = 0;
                    confirm.received(batch.end_lsn);
                    let publish = publish(&pool, &*transport, &config, &batch, lease, &mut stats);
                    let mut publish = std::pin::pin!(publish);
                    let done = tokio::select! {
                        () = &mut shutdown => {
                            let r = tokio::time::timeout(config.shutdown_timeout, &mut publish).await;
                            if r == Ok(Ok(())) {
                                stream.confirm(confirm.finished());
                            }
                            stream.stop().await;
                            break 'session;
                        }
                        r = &mut publish => r,
                        // A holder cut off from the database waits there forever: the batch
                        // is given up (not marked, not confirmed; the next holder reads it).
                        () = lease.lost() => Err(LeaseLost),
                    };
                    match done {
                        Ok(()) => stream.confirm(confirm.finished()),
                        Err(LeaseLost) => {
                            tracing::warn!(slot = %source.slot, "WAL relay: lost the slot's lease with a batch in hand; nothing more of it is marked or confirmed, standing by");
                            lease.set_lost();
                            stream.stop().await;
                            continue 'session;
                        }
                    }
                }
            }
        }
    }
    metrics.abort();
    transport.flush(Duration::from_secs(1)).await;
    if let Some(h) = held {
        h.release(&pool).await;
    }
    tracing::info!(published = stats.published, "WAL relay stopped");
    Ok(stats)
}

/// Backs off after the `failures`th failure in a row; `true` when shutdown came meanwhile.
async fn pause(
    config: &RelayConfig,
    failures: u32,
    shutdown: &mut std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
) -> bool {
    let wait = config.backoff.delay(failures).min(Duration::from_secs(10));
    tokio::select! {
        () = shutdown.as_mut() => true,
        () = tokio::time::sleep(wait) => false,
    }
}

/// Publishes the rows of `batch` (whole transactions from the slot, in commit order) until each
/// is acknowledged and marked, or found no longer to publish. Failed events are retried with
/// backoff, each with its key's later events in the batch after it (the transport holds those
/// back), before anything later is read from the slot. Ends early with [`LeaseLost`] once the
/// slot's lease is no longer this relay's: nothing more is sent, and marks are refused.
async fn publish<T: Transport>(
    pool: &PgPool,
    transport: &T,
    config: &RelayConfig,
    batch: &stream::Batch,
    lease: &lease::Held,
    stats: &mut RelayStats,
) -> Result<(), LeaseLost> {
    // The commits are in the WAL, but their rows may not be visible yet (`rows::visible`): a
    // row not seen would be taken as published by someone else and skipped, and lost.
    let mut failures = 0u32;
    while let Err(e) = rows::visible(pool, &batch.xids).await {
        failures += 1;
        tracing::warn!(error = %e, "WAL relay: could not check that the batch's transactions are visible; retrying");
        tokio::time::sleep(config.backoff.delay(failures).min(Duration::from_secs(10))).await;
    }
    let mut todo: Vec<i64> = batch.seqs.clone();
    let mut failures = 0u32;
    while !todo.is_empty() {
        let chunk_len = todo.len().min(config.batch_size);
        let chunk: Vec<i64> = todo[..chunk_len].to_vec();
        if !lease.may_send() {
            return Err(LeaseLost);
        }
        let locked = match rows::lock(pool, &chunk, config.lease / 2).await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "WAL relay: could not lock the batch's rows; retrying");
                tokio::time::sleep(config.backoff.delay(failures).min(Duration::from_secs(10)))
                    .await;
                continue;
            }
        };
        if locked.left > 0 {
            tracing::warn!(rows = locked.left, "WAL relay: rows held back (scheduled, retried, parked or behind such a row of their key) are left pending for a polling relay");
        }
        let events = locked.events.clone();
        // The lease is checked again after the lock, which may have waited: a batch goes to
        // the transport only with more than half the lease left.
        if !lease.may_send() {
            return Err(LeaseLost);
        }
        let outcomes = if events.is_empty() {
            Vec::new()
        } else {
            transport.send(&events).await.await
        };
        let mut published = Vec::with_capacity(events.len());
        let mut failed = Vec::new();
        let mut parked = Vec::new();
        let mut worst = None;
        for (e, outcome) in events.iter().zip(&outcomes) {
            match outcome {
                Ok(()) => published.push(e.seq),
                // Refused for good (too large, invalid): parked, as polling parks it; its
                // key's later rows are then left behind it (`rows::lock`). Retrying it would
                // stop the relay on this batch forever, every key with it.
                Err(err) if err.kind == FailureKind::Permanent => {
                    parked.push(crate::complete::Failure {
                        seq: e.seq,
                        counts: true,
                        park: true,
                        hold: true,
                        retry_in: Duration::ZERO,
                        reason: Some(err.reason.clone()),
                    });
                }
                Err(err) => {
                    if worst.is_none() && err.kind != FailureKind::HeldBack {
                        worst = Some(err.clone());
                    }
                    failed.push(e.seq);
                }
            }
        }
        match locked
            .mark(&published, &parked, config.delete_on_publish, lease)
            .await
        {
            Ok(false) => {
                transport.recorded(&events, false);
                tracing::warn!(
                    rows = published.len(),
                    "WAL relay: marks refused: the slot's lease moved to another relay"
                );
                return Err(LeaseLost);
            }
            Ok(true) => {
                transport.recorded(&events, true);
                stats.published += published.len() as u64;
                stats.parked += parked.len() as u64;
                for p in &parked {
                    tracing::warn!(seq = p.seq, reason = ?p.reason, "WAL relay: an event refused for good is parked; its key's later events are left pending behind it");
                }
                // Done with the chunk, except its failed rows: they go first again.
                failed.extend_from_slice(&todo[chunk_len..]);
                todo = failed;
                if let Some(err) = worst {
                    failures += 1;
                    tracing::warn!(reason = %err, "WAL relay: a publish failed; retrying it (and its key's later events) before reading further");
                    tokio::time::sleep(config.backoff.delay(failures).min(Duration::from_secs(10)))
                        .await;
                } else {
                    failures = 0;
                }
            }
            Err(e) => {
                transport.recorded(&events, false);
                failures += 1;
                tracing::warn!(error = %e, "WAL relay: could not mark published rows; publishing the batch again (duplicates carry the same ce_id)");
                tokio::time::sleep(config.backoff.delay(failures).min(Duration::from_secs(10)))
                    .await;
            }
        }
    }
    Ok(())
}

/// The slot's lease is no longer this relay's.
#[derive(Debug, PartialEq, Eq)]
struct LeaseLost;
