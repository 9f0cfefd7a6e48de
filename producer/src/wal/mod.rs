//! The WAL source of the relay (`postal relay --read-from wal`, [`crate::RelaySource::Wal`]):
//! outbox inserts read from a logical replication slot (pgoutput) instead of claimed by
//! polling, published through the same transport in commit order. docs/wal-relay.md has the
//! design; `check` checks the publication and slot before streaming, `stream` reads the
//! slot, `pgoutput` decodes it, `rows` locks and marks a batch's rows, `publish` hands them to
//! the transport (carrying failed and busy rows to the next batch), `confirm` is the rule
//! for the slot's confirmed position, and `sweep` publishes, by polling, the rows the stream
//! leaves pending (from before the slot, scheduled, retried, requeued).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::config::RelayConfig;
use crate::relay::{RelayHealth, RelayStats};
use crate::transport::Transport;
use crate::Error;

mod aside;
#[cfg(feature = "test-util")]
pub(crate) mod by_hand;
mod check;
mod confirm;
mod lease;
mod older;
mod pgoutput;
mod publish;
mod rows;
pub mod slot;
mod stream;
mod sweep;

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

/// How many starts of streaming in a row may fail, over at least a lease, before the holder
/// gives the slot's lease up for a standby ([`give_up_after`]).
const FAILED_STARTS_TO_GIVE_UP: u32 = 3;

/// How often rows another session holds locked are tried again.
const BUSY_RETRY: Duration = Duration::from_secs(1);

/// How many chunks (of `batch_size` rows) a batch read from the slot holds at most: the next
/// chunk's rows are taken while a chunk's acknowledgements are awaited.
const READ_CHUNKS: usize = 4;

/// How many rows may be carried (busy, behind a chunk aside, not due yet, with their keys'
/// later rows); the later ones past it are left pending for the sweep.
fn carry_max(config: &RelayConfig) -> usize {
    config.batch_size.max(1) * 4
}

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
    health: RelayHealth,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<RelayStats, Error> {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut stats = RelayStats::default();
    let mut failures = 0u32;
    // Failed starts of streaming in a row, and since when.
    let mut failed_starts: Option<(u32, tokio::time::Instant)> = None;
    let mut held: Option<lease::Held> = None;
    // A connection URL the replication session cannot use (an unknown `sslmode`, a CA file
    // that cannot be read): one line, and no stream at all.
    stream::replication_config(&source)?;
    // A wrong publication or another database's slot: one line, and no stream at all.
    if !checked(&pool, &source, &config, &mut shutdown).await? {
        return Ok(stats);
    }
    // The slot's state as metrics, every 5 s, holder or standby alike (alerts take the
    // maximum per slot).
    // In a set, which aborts its tasks when dropped: a relay dropped in-process (killed)
    // leaves nothing running on its behalf.
    let mut background = tokio::task::JoinSet::new();
    // Relays of an earlier release live on this outbox (`older`): the stream stops.
    let older_live = Arc::new(std::sync::atomic::AtomicBool::new(false));
    background.spawn({
        let (pool, slot, lease, older_live) = (
            pool.clone(),
            source.slot.clone(),
            config.lease,
            older_live.clone(),
        );
        async move {
            loop {
                if let Err(e) = slot::record_metrics(&pool, &slot).await {
                    tracing::debug!(error = %e, "WAL relay: could not read the slot's state for metrics");
                }
                if let Ok(relays) = older::live(&pool, lease).await {
                    older_live.store(!relays.is_empty(), std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(METRICS_INTERVAL).await;
            }
        }
    });
    // The outbox's gauges (backlog, parked, oldest pending) and its upkeep, as polling relays
    // record them: the alerts on them hold for WAL deployments too.
    background.spawn(crate::relay::housekeeping::housekeeping(
        pool.clone(),
        config.clone(),
    ));
    let mut ended: Result<(), Error> = Ok(());
    tracing::info!(slot = %source.slot, publication = %source.publication, %holder, "WAL relay started");
    // Set once streaming failed to start too often: the lease is given up (below).
    let mut give_up: Option<String> = None;
    let mut busy = publish::BusyWatch::new(&health);
    // The sweep runs while this relay holds the slot's lease (`sweep`).
    let progress = sweep::Progress::default();
    // Failed publishes are judged as polling judges them (attempts, backoff, parking, a pause
    // while the destination is unavailable).
    let judge = crate::outcome::Judge {
        config: config.clone(),
        counters: std::sync::Arc::new(crate::outcome::Counters::default()),
        unavailable_streak: std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0)),
        paused_until: std::sync::Arc::new(std::sync::Mutex::new(None)),
    };
    let mut sweeping: Option<sweep::Sweep> = None;
    'session: loop {
        if let Some(why) = give_up.take() {
            if let Some(s) = sweeping.take() {
                add(&mut stats, s.stop(&config).await);
            }
            // A holder that cannot stream (its replication session refused: a pooler, no
            // REPLICATION attribute, max_wal_senders used up) must not keep the slot from a
            // standby that can.
            let wait = give_up_after(&config);
            tracing::warn!(slot = %source.slot, retry_in_s = wait.as_secs(),
                "WAL relay: cannot stream from the slot ({why}); gave up the slot's lease so that a standby can take it (the replication connection needs a role with REPLICATION, connected directly, not through a pooler)");
            if let Some(h) = held.take() {
                h.release(&pool).await;
            }
            tokio::select! {
                () = &mut shutdown => break 'session,
                () = tokio::time::sleep(wait) => {}
            }
        }
        let lease = match &held {
            Some(h) if !h.is_lost() => h,
            _ => {
                held = None;
                if let Some(s) = sweeping.take() {
                    add(&mut stats, s.stop(&config).await);
                }
                match lease::acquire(&pool, &source.slot, holder, config.lease, &mut shutdown).await
                {
                    Some(h) => held.insert(h),
                    None => break 'session,
                }
            }
        };
        if sweeping.is_none() {
            sweeping = Some(sweep::start(&pool, transport.clone(), &config, &progress));
        }
        // The slot and publication again as they are opened (dropped, re-created, altered
        // meanwhile?).
        match checked(&pool, &source, &config, &mut shutdown).await {
            Ok(true) => {}
            Ok(false) => break 'session,
            Err(e) => {
                ended = Err(e);
                break 'session;
            }
        }
        // Not beside a relay of an earlier release (`older`).
        if !older_gone(&pool, &config, &progress, &mut shutdown).await {
            break 'session;
        }
        older_live.store(false, std::sync::atomic::Ordering::Relaxed);
        let stream = tokio::select! {
            () = &mut shutdown => break 'session,
            s = stream::Stream::start(&source, (config.lease / 2).max(Duration::from_secs(5))) => s,
        };
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                failures += 1;
                if let Some(why) = failed_start(&mut failed_starts, &config, &e) {
                    give_up = Some(why);
                    continue;
                }
                tracing::warn!(error = %e, "WAL relay: could not start streaming; retrying");
                // The previous holder's walsender may still be ending.
                lease.end_walsender(&pool).await;
                if pause(&config, failures, &mut shutdown).await {
                    break 'session;
                }
                continue;
            }
        };
        let mut streamed = false;
        let mut confirm = confirm::Confirm::default();
        // Rows that failed or that another session holds locked (and their keys' later rows),
        // carried from batch to batch until they are done; nothing is confirmed meanwhile. A
        // new session reads them from the slot again.
        let mut carried: Vec<i64> = Vec::new();
        let mut retry_at = tokio::time::Instant::now();
        // Chunks whose acknowledgements are slow, set aside while other keys go on
        // (`aside`); given up (their transactions rolled back, their rows read again) when the
        // session ends.
        let mut aside = aside::Aside::new(transport.clone());
        busy.saw(&[]);
        loop {
            // Set when a chunk aside got its outcomes: the carried rows behind it are due.
            let mut settled = false;
            let read = tokio::select! {
                biased;
                () = &mut shutdown => {
                    let deadline = tokio::time::Instant::now() + config.shutdown_timeout;
                    if publish::settle_aside(
                        &*transport,
                        &config,
                        &judge,
                        lease,
                        &mut stats,
                        &mut aside,
                        deadline,
                    )
                    .await
                        && carried.is_empty()
                    {
                        stream.confirm(confirm.finished());
                    }
                    stream.stop_reported().await;
                    break 'session;
                }
                () = lease.lost() => {
                    tracing::warn!(slot = %source.slot, "WAL relay: lost the slot's lease; stopped streaming, standing by");
                    stream.stop().await;
                    continue 'session;
                }
                // The rows carried are bounded (`carry_max`): reading goes on.
                r = stream.next(config.batch_size * READ_CHUNKS) => r,
                // Carried rows are tried again when due, with or without new commits.
                () = tokio::time::sleep_until(retry_at), if !carried.is_empty() => {
                    Ok(stream::Read::Batch(stream::Batch::default()))
                }
                // A chunk aside got its outcomes: recorded, and the rows behind it sent.
                () = aside.ready(), if !aside.is_empty() => {
                    settled = true;
                    Ok(stream::Read::Batch(stream::Batch::default()))
                }
            };
            if read.is_ok() && !streamed {
                streamed = true;
                failed_starts = None;
            }
            // A relay of an earlier release started meanwhile: the stream stops (what it has in
            // hand is given up, and read again once that relay stopped).
            if older_live.load(std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!("WAL relay: a relay of an earlier release started on this outbox; stopped streaming until it stops");
                stream.stop().await;
                continue 'session;
            }
            match read {
                Err(e) => {
                    failures += 1;
                    stream.stop().await;
                    // A session that ended before it gave anything did not start.
                    if !streamed {
                        if let Some(why) = failed_start(&mut failed_starts, &config, &e) {
                            give_up = Some(why);
                            continue 'session;
                        }
                        lease.end_walsender(&pool).await;
                    }
                    tracing::warn!(error = %e, "WAL relay: the replication session ended; restarting from the slot's confirmed position");
                    if pause(&config, failures, &mut shutdown).await {
                        break 'session;
                    }
                    continue 'session;
                }
                Ok(stream::Read::KeepAlive(lsn)) => {
                    if let Some(lsn) = confirm.keepalive(lsn) {
                        stream.confirm(lsn);
                    }
                    // Everything committed before it was read, whether or not it is all
                    // confirmed yet (a chunk aside, rows carried): what is pending from before
                    // is the sweep's to look at (a row written back after a failed publish is
                    // updated, not inserted again, so the stream does not give it again).
                    progress.idle();
                }
                Ok(stream::Read::Batch(batch)) => {
                    failures = 0;
                    // Only a read from the slot says whether the stream is caught up, not the
                    // retry timer's empty batch.
                    if batch.end_lsn > 0 {
                        progress.read(batch.seqs.len(), config.batch_size * READ_CHUNKS);
                        confirm.received(batch.end_lsn);
                    }
                    let was_carrying = !carried.is_empty();
                    let due = !was_carrying || settled || tokio::time::Instant::now() >= retry_at;
                    // `None`: shutdown came; `Some(true)` with it when the batch was done
                    // within the shutdown timeout, leaving nothing to carry.
                    let mut stopping: Option<(bool, tokio::time::Instant)> = None;
                    let done = {
                        let publish = publish::publish(
                            &pool,
                            &*transport,
                            &config,
                            std::mem::take(&mut carried),
                            due,
                            &batch,
                            lease,
                            &mut busy,
                            &judge,
                            &mut stats,
                            &mut aside,
                        );
                        let mut publish = std::pin::pin!(publish);
                        tokio::select! {
                            () = &mut shutdown => {
                                let deadline = tokio::time::Instant::now() + config.shutdown_timeout;
                                let r = tokio::time::timeout_at(deadline, &mut publish).await;
                                let left_none = matches!(&r, Ok(Ok(left)) if left.rows.is_empty());
                                stopping = Some((left_none, deadline));
                                Ok(publish::Carry::default())
                            }
                            r = &mut publish => r,
                            // A holder cut off from the database waits there forever: the batch
                            // is given up (not marked, not confirmed; the next holder reads it).
                            () = lease.lost() => Err(LeaseLost),
                        }
                    };
                    if let Some((left_none, deadline)) = stopping {
                        // The chunks aside get what is left of the shutdown timeout.
                        if left_none
                            && publish::settle_aside(
                                &*transport,
                                &config,
                                &judge,
                                lease,
                                &mut stats,
                                &mut aside,
                                deadline,
                            )
                            .await
                        {
                            stream.confirm(confirm.finished());
                        }
                        stream.stop_reported().await;
                        break 'session;
                    }
                    match done {
                        Ok(left) if left.rows.is_empty() && aside.is_empty() => {
                            stream.confirm(confirm.finished());
                        }
                        // Not confirmed past the carried rows.
                        Ok(left) => {
                            carried = left.rows;
                            // Past the bound, the later rows are left pending for the sweep,
                            // and reading goes on (a hot key behind a slow chunk or a row
                            // locked elsewhere does not stop the other keys; helper-70). Each
                            // is later than the rows kept of its key, and a key's later rows
                            // read from the stream wait for it (`rows::lock`: an earlier
                            // pending row the stream did not give).
                            if carried.len() > carry_max(&config) {
                                let over = carried.split_off(carry_max(&config));
                                tracing::info!(rows = over.len(), first = over[0], "WAL relay: more rows wait behind busy rows or slow chunks than the relay carries; the later ones are left pending for the sweep, which publishes them in order");
                            }
                            if due {
                                retry_at = tokio::time::Instant::now() + BUSY_RETRY;
                            }
                        }
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
    if let Some(s) = sweeping.take() {
        add(&mut stats, s.stop(&config).await);
    }
    background.abort_all();
    health.set(None);
    transport.flush(Duration::from_secs(1)).await;
    if let Some(h) = held {
        h.release(&pool).await;
    }
    // A configuration to fix: the caller says it (one line).
    ended?;
    tracing::info!(published = stats.published, "WAL relay stopped");
    Ok(stats)
}

/// Adds the sweep's totals to the relay's.
fn add(stats: &mut RelayStats, sweep: RelayStats) {
    stats.published += sweep.published;
    stats.parked += sweep.parked;
    stats.retried += sweep.retried;
    stats.held_back += sweep.held_back;
}

/// Counts a failed start of streaming (`e`); what to say when it is time to give the lease up:
/// [`FAILED_STARTS_TO_GIVE_UP`] failed starts in a row, over at least a lease.
fn failed_start(
    failed_starts: &mut Option<(u32, tokio::time::Instant)>,
    config: &RelayConfig,
    e: &Error,
) -> Option<String> {
    let (n, since) = failed_starts.get_or_insert((0, tokio::time::Instant::now()));
    *n += 1;
    if *n < FAILED_STARTS_TO_GIVE_UP || since.elapsed() < config.lease {
        return None;
    }
    let why = format!(
        "{n} failed starts in a row over {}s, the last: {e}",
        since.elapsed().as_secs()
    );
    *failed_starts = None;
    Some(why)
}

/// How long a holder that gave the slot's lease up waits before it tries to take it again: a
/// lease, plus a second, so that a standby (which polls at most every second) takes it first.
fn give_up_after(config: &RelayConfig) -> Duration {
    config.lease + Duration::from_secs(1)
}

/// Checks the source's publication and slot ([`check::source`]), waiting out a database that
/// does not answer (one line per attempt). `Ok(false)`: `shutdown` came first; an error: a
/// configuration to fix.
async fn checked(
    pool: &PgPool,
    source: &WalSource,
    config: &RelayConfig,
    shutdown: &mut std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
) -> Result<bool, Error> {
    let mut failures = 0u32;
    loop {
        match check::source(pool, source).await {
            Ok(()) => return Ok(true),
            Err(e @ Error::Config(_)) => return Err(e),
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, slot = %source.slot, publication = %source.publication, "WAL relay: could not check the slot and publication (the database does not answer?); retrying");
                if pause(config, failures, shutdown).await {
                    return Ok(false);
                }
            }
        }
    }
}

/// Waits while a relay of an earlier release is live on the outbox ([`older`]), with one line
/// when the wait starts and one when it ends. `false` when `shutdown` came first.
async fn older_gone(
    pool: &PgPool,
    config: &RelayConfig,
    progress: &sweep::Progress,
    shutdown: &mut std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
) -> bool {
    // While the stream waits, the sweep claims without a bound (the stream publishes nothing,
    // and the other relay only its own partitions); its bound is put back after.
    let mut bound: Option<i64> = None;
    let ended = |bound: Option<i64>| {
        if let Some(b) = bound {
            progress
                .below
                .store(b, std::sync::atomic::Ordering::Relaxed);
        }
    };
    loop {
        match older::live(pool, config.lease).await {
            Ok(relays) if relays.is_empty() => {
                if bound.is_some() {
                    tracing::info!(
                        "WAL relay: no relay of an earlier release runs any more; streaming"
                    );
                }
                ended(bound);
                return true;
            }
            Ok(relays) => {
                if bound.is_none() {
                    tracing::warn!("{}", older::waiting_line(&relays));
                    bound = Some(
                        progress
                            .below
                            .swap(i64::MAX, std::sync::atomic::Ordering::Relaxed),
                    );
                }
            }
            // Checked again at the next start; the stream's own errors say the rest.
            Err(e) => {
                tracing::debug!(error = %e, "WAL relay: could not look for relays of an earlier release");
                ended(bound);
                return true;
            }
        }
        tokio::select! {
            () = shutdown.as_mut() => {
                ended(bound);
                return false;
            }
            () = tokio::time::sleep((config.lease / 4).clamp(Duration::from_millis(200), Duration::from_secs(5))) => {}
        }
    }
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

/// The slot's lease is no longer this relay's.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LeaseLost;
