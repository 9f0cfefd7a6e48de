//! The relay loop: claim → hand to the transport → await acknowledgements → record outcomes.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::checkout;
use crate::claim;
use crate::config::RelayConfig;
use crate::enqueue::NOTIFY_CHANNEL;
use crate::key_chain::{self, KeyChain};
use crate::lease;
use crate::outcome;
use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};
use crate::Error;

/// Why a batch in flight was given up (logged).
#[derive(Debug)]
enum GiveUp {
    /// By the relay's clock: no heartbeat renewed the leases in time.
    NotRenewed,
    /// The claim's keep-alive did not return before the give-up point.
    KeepAliveLate,
    /// The database answered the keep-alive: the claim's leases are lost or nearly over.
    LeaseShort,
    /// The keep-alive failed: the claim's transaction is gone or aborted.
    KeepAliveFailed(sqlx::Error),
}

impl std::fmt::Display for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GiveUp::NotRenewed => f.write_str(
                "no heartbeat renewed the partition leases in time (heartbeats failing?)",
            ),
            GiveUp::KeepAliveLate => {
                f.write_str("the claim's keep-alive did not return before the give-up point")
            }
            GiveUp::LeaseShort => f.write_str(
                "the database reports the claim's partition leases lost or about to run out",
            ),
            GiveUp::KeepAliveFailed(e) => write!(f, "could not keep the claim alive: {e}"),
        }
    }
}

/// Totals of one relay run, returned when it stops.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Events acknowledged by the destination and recorded.
    pub published: u64,
    /// Events parked as failed.
    pub parked: u64,
    /// Failed publishes rescheduled for a retry.
    pub retried: u64,
    /// Events released unsent, without using an attempt, because an earlier event of their key
    /// failed (or was itself held back) in the same or an earlier batch: claimed again later.
    pub held_back: u64,
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
    ///
    /// Give it a pool of at least `max_in_flight_batches + lanes + 3` connections (docs/relay.md,
    /// "In-process task handlers"): each batch in flight holds one, each claiming lane one,
    /// and the heartbeat, housekeeping and `LISTEN` one each.
    pub fn new(pool: PgPool, transport: T, config: RelayConfig) -> Result<Self, Error> {
        config.validate()?;
        if let Some(delivery) = transport.delivery_timeout() {
            if config.lease / 2 <= delivery {
                return Err(Error::Config(format!(
                    "lease {:?} is too short: half of it must exceed the transport's delivery timeout of {:?}",
                    config.lease, delivery
                )));
            }
        }
        let wanted = Self::connections_wanted(&config);
        let max = pool.options().get_max_connections();
        if max < wanted {
            tracing::warn!(
                pool_max_connections = max,
                wanted,
                "the relay's pool is smaller than this configuration can use at once (lanes + in-flight batches + 3): claims will wait for connections; raise the pool's max_connections to {wanted}"
            );
        }
        Ok(Relay {
            pool,
            transport: Arc::new(transport),
            config,
            id: Uuid::now_v7(),
        })
    }

    /// The connections this configuration can use at once: a claim per lane and per batch in
    /// flight, plus the lease heartbeat, the `LISTEN` session and housekeeping. `postal relay`
    /// sizes its pool so.
    pub fn connections_wanted(config: &RelayConfig) -> u32 {
        (config.max_in_flight_batches + config.lanes + 3) as u32
    }

    /// This instance's id (in its log lines).
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// Runs until `shutdown` resolves, then stops claiming, waits (bounded) for in-flight
    /// acknowledgements and records them; whatever is still unacknowledged after
    /// `shutdown_timeout` is given back (its claim rolls back). A batch still being handed to
    /// the destination when shutdown begins gets `shutdown_timeout` of its own first; a
    /// hand-over that takes longer is given up (its claim rolls back too). So a stop takes at
    /// most about twice `shutdown_timeout` plus a one-second flush.
    ///
    /// The owned key partitions are split across `lanes` claim loops, in contiguous blocks:
    /// each lane claims its partitions in sequence order, so per-key order
    /// holds while lanes claim in parallel. When the owned set changes, the split changes only
    /// while no batch is in flight.
    /// Database or broker outages never end the loop: it logs one line per failed attempt and
    /// retries with backoff.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<RelayStats, Error> {
        let mut shutdown = std::pin::pin!(shutdown);
        // The upgrade contract: a schema this relay must not run on (missing, behind, or for
        // newer binaries only) stops it with one line; an unreachable database is waited for.
        if !postal_shared::wait_for_schema(&self.pool, &mut shutdown).await? {
            return Ok(RelayStats::default());
        }
        let (wake_tx, wake_rx) = tokio::sync::watch::channel(0u64);
        let shared = Arc::new(Shared {
            pool: self.pool.clone(),
            transport: self.transport.clone(),
            config: self.config.clone(),
            counters: Arc::new(outcome::Counters::default()),
            unavailable_streak: Arc::new(AtomicU32::new(0)),
            paused_until: Arc::new(std::sync::Mutex::new(None::<Instant>)),
            slots: Arc::new(Semaphore::new(self.config.max_in_flight_batches)),
            backlogged: AtomicBool::new(true),
            active_lanes: AtomicUsize::new(self.config.lanes.max(1)),
            stop: CancellationToken::new(),
            abandon: CancellationToken::new(),
            release: CancellationToken::new(),
            drives: std::sync::Mutex::new(tokio::task::JoinSet::new()),
            owned: std::sync::RwLock::new(Vec::new()),
            lease_until: std::sync::Mutex::new(None),
            id: self.id,
            record_gate: tokio::sync::RwLock::new(()),
            key_chain: KeyChain::default(),
            // Checked-out rows hold back their keys in the database: no chain needed.
            chained: self.transport.checks_out().is_some(),
            checkout: self
                .transport
                .checks_out()
                .map(|n| Arc::new(Semaphore::new(n.max(1)))),
            wake: wake_tx.clone(),
        });
        // Background tasks live in JoinSets, which abort them when dropped: if this future is
        // dropped (the relay is killed), nothing keeps heartbeating on its behalf.
        let mut background = tokio::task::JoinSet::new();
        if self.config.listen {
            background.spawn(listen(
                self.pool.clone(),
                wake_tx.clone(),
                self.config.poll_interval,
            ));
        }

        tracing::info!(relay = %self.id, group = %self.config.group, topics = ?self.config.topics, batch = self.config.batch_size, lanes = self.config.lanes, "relay started");
        let lanes = self.config.lanes.max(1);
        let (owned_tx, owned_rx) = tokio::sync::watch::channel(0u64);
        let coordinator = background.spawn(shared.clone().coordinate(owned_tx));
        background.spawn(shared.clone().housekeeping());
        let mut lane_tasks = tokio::task::JoinSet::new();
        for lane in 0..lanes {
            lane_tasks.spawn(
                shared
                    .clone()
                    .lane(lane, lanes, wake_rx.clone(), owned_rx.clone()),
            );
        }
        shutdown.await;
        tracing::info!(relay = %self.id, "relay stopping: waiting for in-flight acknowledgements");
        shared.stop.cancel();
        drop(wake_tx);
        let mut completions = Vec::new();
        // A claim loop finishes the hand-over it is in before it sees `stop`. A hand-over that
        // does not return (a task handler that never ends, a destination that never answers)
        // must not keep the relay from stopping: after `shutdown_timeout` the loops give up
        // their hand-overs (those claims roll back) and return; their batches already handed
        // over stay in flight and are waited for below.
        let limit = self.config.shutdown_timeout;
        if tokio::time::timeout(limit, join_lanes(&mut lane_tasks, &mut completions))
            .await
            .is_err()
        {
            shared.abandon.cancel();
            // Given-up hand-overs return at once; only a loop stuck elsewhere (in a claim) is
            // aborted, after another timeout.
            if tokio::time::timeout(limit, join_lanes(&mut lane_tasks, &mut completions))
                .await
                .is_err()
            {
                tracing::warn!(
                    "a claim loop did not return after giving up its hand-over; aborting it"
                );
                lane_tasks.abort_all();
                join_lanes(&mut lane_tasks, &mut completions).await;
            }
        }
        let all = self.config.max_in_flight_batches as u32;
        // Checked-out events hold no slot but a permit of their own: wait for those too.
        let checked_out = self.transport.checks_out().map_or(0, |n| n.max(1) as u32);
        let drained = tokio::time::timeout(self.config.shutdown_timeout, async {
            let slots = shared.slots.acquire_many(all).await;
            let events = match &shared.checkout {
                Some(room) => Some(room.acquire_many(checked_out).await),
                None => None,
            };
            (slots, events)
        })
        .await;
        if drained.is_err() {
            tracing::warn!("shutdown timeout reached with acknowledgements outstanding");
        }
        // Checked-out events still running are given back (their handlers aborted) without
        // counting an attempt: a stop is not the task's failure.
        shared.release.cancel();
        let release_within =
            tokio::time::Instant::now() + checkout::STOP_GRACE + Duration::from_secs(2);
        let mut drives = std::mem::take(&mut *shared.drives.lock().expect("drives lock"));
        while let Ok(Some(_)) = tokio::time::timeout_at(release_within, drives.join_next()).await {}
        drives.abort_all();
        while drives.join_next().await.is_some() {}
        self.transport.flush(Duration::from_secs(1)).await;
        drop(coordinator);
        background.abort_all();
        while background.join_next().await.is_some() {}
        // Whatever is still unacknowledged is abandoned: dropping a claim rolls its
        // transaction back, so the rows are claimable again at once.
        for mut set in completions {
            set.abort_all();
            while set.join_next().await.is_some() {}
        }
        match lease::leave(&self.pool, self.id).await {
            Ok(()) => tracing::debug!("gave up all key partitions"),
            Err(e) => {
                tracing::warn!(error = %e, "could not give up key partitions; they move after the lease")
            }
        }
        let c = &shared.counters;
        let stats = RelayStats {
            published: c.published.load(Ordering::Relaxed),
            parked: c.parked.load(Ordering::Relaxed),
            retried: c.retried.load(Ordering::Relaxed),
            held_back: c.held_back.load(Ordering::Relaxed),
        };
        tracing::info!(relay = %self.id, published = stats.published, parked = stats.parked, "relay stopped");
        Ok(stats)
    }
}

struct Shared<T: Transport> {
    pool: PgPool,
    transport: Arc<T>,
    config: RelayConfig,
    counters: Arc<outcome::Counters>,
    unavailable_streak: Arc<AtomicU32>,
    paused_until: Arc<std::sync::Mutex<Option<Instant>>>,
    slots: Arc<Semaphore>,
    /// Whether the last claim came back full: there is a backlog, and the lanes keep up to
    /// `max_in_flight_batches` batches in flight. Otherwise a lane claims only once no batch is
    /// in flight (see the lane loop).
    backlogged: AtomicBool,
    /// How many of the lanes claim: `lanes` is the budget of the whole relay group, and each of
    /// `n` live relays runs `lanes / n` of them, rounded up ([`lanes_per_relay`]). Changes only
    /// together with `owned`, while the coordinator holds every in-flight slot.
    active_lanes: AtomicUsize,
    stop: CancellationToken,
    /// Cancelled when shutdown stops waiting for hand-overs: a lane still handing a batch
    /// over gives it up (its claim rolls back) and returns its batches in flight.
    abandon: CancellationToken,
    /// Cancelled when shutdown stops waiting for checked-out events: their work is aborted
    /// and they are given back as it ends ([`checkout::Driver::release`]).
    release: CancellationToken,
    /// The tasks driving checked-out events ([`checkout::drive`]).
    drives: std::sync::Mutex<tokio::task::JoinSet<()>>,
    /// Key partitions this relay holds a lease on.
    owned: std::sync::RwLock<Vec<i16>>,
    /// Until when those leases hold at least: the start of the last successful heartbeat
    /// plus the lease (the database set them from a later clock reading).
    lease_until: std::sync::Mutex<Option<tokio::time::Instant>>,
    id: Uuid,
    /// For a transport that chains keys across batches: a lane holds it (shared) from the
    /// start of its claim until the batch is handed over, and telling the transport that a
    /// batch was recorded takes it exclusively. A claim whose snapshot predates an earlier
    /// batch's commit (so it did not see a failed event of a key as held, and took the key's
    /// later events) then hands them over before the transport hears of that commit, and the
    /// transport chains them behind the failure.
    record_gate: tokio::sync::RwLock<()>,
    /// Whether the transport [`Transport::checks_out`] (asked once): its rows hold their keys
    /// in the database while in flight, so batches need no key chain and lanes use every slot.
    chained: bool,
    /// With a transport that [`Transport::checks_out`]: claims check their rows out
    /// ([`checkout`]), and this bounds the events in flight (a permit each).
    checkout: Option<Arc<Semaphore>>,
    /// Wakes the claim loops (a checked-out event's outcome was recorded: its key's next
    /// event may be claimable).
    wake: tokio::sync::watch::Sender<u64>,
    /// For every other transport: the relay's own chain of keys across its batches in flight
    /// ([`crate::key_chain`]), behind the same record gate.
    key_chain: KeyChain,
}

/// Tells the transport about a batch exactly once: [`RecordedNotice::recorded`] after the
/// relay recorded it, or "not recorded" when the task recording it is dropped first (aborted
/// at shutdown), so that nothing the transport chains behind the batch waits for good.
struct RecordedNotice<T: Transport> {
    shared: Arc<Shared<T>>,
    /// The claimed batch, as recorded.
    batch: Vec<OutboundEvent>,
    /// What of it was handed to the transport (all of it, unless the key chain held some back).
    sent: Vec<OutboundEvent>,
    /// The batch's place in the relay's key chain (transports that do not chain keys).
    chain: Option<key_chain::Entry>,
    told: bool,
}

impl<T: Transport> RecordedNotice<T> {
    async fn recorded(mut self, committed: bool) {
        // A batch with failures leaves the chain (and the transport hears of its commit) only
        // between claims: a claim in progress took its snapshot before this commit.
        let failed = self
            .chain
            .as_ref()
            .is_some_and(key_chain::Entry::failed_any);
        let _gate = if self.shared.chained || failed {
            Some(self.shared.record_gate.write().await)
        } else {
            None
        };
        if let Some(entry) = &self.chain {
            self.shared.key_chain.remove(entry);
        }
        self.shared.transport.recorded(&self.sent, committed);
        self.told = true;
    }

    /// The batch's outcome, for the batches of the key chain that wait for it.
    fn resolve(&mut self, outcomes: &[Result<(), PublishError>]) {
        if let Some(entry) = &mut self.chain {
            entry.resolve(outcomes);
        }
    }

    /// The batch was given up: for the key chain, all of it failed.
    fn resolve_failed(&mut self) {
        if let Some(entry) = &mut self.chain {
            entry.resolve_failed();
        }
    }
}

impl<T: Transport> Drop for RecordedNotice<T> {
    fn drop(&mut self) {
        if !self.told {
            if let Some(entry) = &self.chain {
                self.shared.key_chain.remove(entry);
            }
            self.shared.transport.recorded(&self.sent, false);
        }
    }
}

impl<T: Transport> Shared<T> {
    /// When a batch still in flight is given up unless a heartbeat renewed the leases
    /// meanwhile: a quarter of the lease before they run out, so that its work (a task
    /// handler) has stopped before another relay may take its keys over. A healthy relay
    /// renews every quarter of the lease and is never this close.
    fn give_up_at(&self) -> tokio::time::Instant {
        self.lease_until() - self.config.lease / 4
    }

    /// Until when this relay's partition leases hold at least, as last renewed (a full lease
    /// from now before the first heartbeat, when nothing can be claimed yet).
    fn lease_until(&self) -> tokio::time::Instant {
        let until = *self.lease_until.lock().expect("lease lock");
        until.unwrap_or_else(|| tokio::time::Instant::now() + self.config.lease)
    }

    /// Whether the leases, as this relay last renewed them, have enough left for a claim
    /// ([`claim::lease_reserve`]; the claim checks the same with the database's clock). A
    /// relay whose heartbeats fail stops claiming here instead of claiming batches that it
    /// would give up at once.
    fn may_claim(&self) -> bool {
        tokio::time::Instant::now() + claim::lease_reserve(self.config.lease) < self.lease_until()
    }

    /// Notes the leases that a heartbeat started at `beat` renewed.
    fn renewed(&self, beat: tokio::time::Instant, result: &Result<lease::Lease, sqlx::Error>) {
        if result.is_ok() {
            *self.lease_until.lock().expect("lease lock") = Some(beat + self.config.lease);
        }
    }

    /// Heartbeats every quarter of the lease, keeps `owned` up to date and gives partitions
    /// away (after draining in-flight batches) when relays join.
    ///
    /// Heartbeats start every `lease / 4`, counted from the start of the one before, and the
    /// waits for in-flight batches within a round end when the next round is due, so a healthy
    /// relay starts a heartbeat at least every `lease / 4` plus one heartbeat's duration. It
    /// thus keeps more than [`claim::lease_reserve`] (55 %) of the lease for its claims while a
    /// heartbeat takes less than a fifth of the lease (12 s by default), and
    /// gives up batches in flight (at a quarter left, [`Shared::give_up_at`]) only when its
    /// heartbeats fail or stall for half a lease.
    async fn coordinate(self: Arc<Self>, changed: tokio::sync::watch::Sender<u64>) {
        let every = self.config.lease / 4;
        let host = std::env::var("HOSTNAME").unwrap_or_default();
        let mut failures = 0u32;
        loop {
            let round = tokio::time::Instant::now();
            let held = self.owned.read().expect("owned lock").clone();
            // In-flight slots held across a change of `owned` (see below).
            let mut drained = None;
            let mut result = lease::heartbeat(
                &self.pool,
                &self.config.group,
                self.id,
                &host,
                self.config.lease,
                &held,
                false,
            )
            .await;
            self.renewed(round, &result);
            if let Ok(l) = &result {
                if l.wants_release {
                    // Record everything in flight before giving partitions away, so the next
                    // owner cannot overtake an event of ours.
                    let all = self.config.max_in_flight_batches as u32;
                    if let Ok(Ok(permits)) = tokio::time::timeout_at(
                        round + every,
                        self.slots.clone().acquire_many_owned(all),
                    )
                    .await
                    {
                        let beat = tokio::time::Instant::now();
                        result = lease::heartbeat(
                            &self.pool,
                            &self.config.group,
                            self.id,
                            &host,
                            self.config.lease,
                            &l.held,
                            true,
                        )
                        .await;
                        self.renewed(beat, &result);
                        drained = Some(permits);
                    }
                }
            }
            match result {
                Ok(l) => {
                    if failures > 0 {
                        tracing::info!("partition leases renewed again");
                    }
                    failures = 0;
                    let current = self.owned.read().expect("owned lock").clone();
                    let active = lanes_per_relay(self.config.lanes, l.live);
                    if current != l.held || active != self.active_lanes.load(Ordering::Relaxed) {
                        // The lanes' split of the partitions changes with the owned set: change
                        // it only while nothing is claimed or in flight, so that a partition
                        // moving to another lane cannot have its events in two lanes at once.
                        // Lanes read their share only once they hold a slot.
                        if drained.is_none() {
                            let all = self.config.max_in_flight_batches as u32;
                            drained = tokio::time::timeout_at(
                                round + every,
                                self.slots.clone().acquire_many_owned(all),
                            )
                            .await
                            .ok()
                            .and_then(Result::ok);
                        }
                        if drained.is_some() {
                            tracing::info!(relay = %self.id, partitions = l.held.len(), live_relays = l.live, lanes = active, "key partitions rebalanced");
                            *self.owned.write().expect("owned lock") = l.held.clone();
                            self.active_lanes.store(active, Ordering::Relaxed);
                            changed.send_modify(|n| *n = n.wrapping_add(1));
                        } else {
                            // Batches still in flight after a quarter of the lease: keep the
                            // old split (claims re-check the lease, so partitions that were
                            // lost are not claimed) and try again at the next heartbeat.
                            tracing::warn!(relay = %self.id, "key partitions changed but batches are still in flight; rebalancing lanes at the next heartbeat");
                        }
                    }
                    metrics::gauge!("postal_relay_partitions_owned", "group" => self.config.group.clone())
                        .set(self.owned.read().expect("owned lock").len() as f64);
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, "cannot renew partition leases (database unreachable?); retrying");
                    // Once the leases as last renewed have run out, this relay owns nothing
                    // (another relay may hold them now): the gauge says so.
                    if self.lease_until() <= tokio::time::Instant::now() {
                        metrics::gauge!("postal_relay_partitions_owned", "group" => self.config.group.clone())
                            .set(0.0);
                    }
                }
            }
            // Lanes claim again while this waits (also after a failed release heartbeat, which
            // gave nothing away).
            drop(drained);
            if failures > 0 {
                let wait = self.config.backoff.delay(failures).min(every);
                tokio::time::sleep(wait.max(Duration::from_millis(50))).await;
            } else {
                tokio::time::sleep_until(round + every).await;
            }
        }
    }

    /// Every 15 s: the backlog, oldest-pending and oldest-transaction gauges, and retention
    /// cleanup (when configured).
    async fn housekeeping(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(15).min(self.config.lease));
        let summary = crate::backlog::summary_sql(false);
        loop {
            tick.tick().await;
            // Each check in a transaction of its own whose statements end after
            // `CHECK_TIMEOUT`: a check stuck behind a lock fails (and says so) instead of
            // leaving every gauge at its last value without a sign.
            let checks = async {
                let mut tx = self.pool.begin().await?;
                sqlx::query("SELECT set_config('statement_timeout', $1, true)")
                    .bind(format!("{}ms", CHECK_TIMEOUT.as_millis()))
                    .execute(&mut *tx)
                    .await?;
                Ok::<_, sqlx::Error>(tx)
            };
            let backlog = async {
                let mut tx = checks.await?;
                let row = sqlx::query_as::<_, (i64, i64, i64, Option<f64>)>(&summary)
                    .fetch_one(&mut *tx)
                    .await?;
                // The oldest transaction of this database that holds back the visibility
                // horizon (and the keys it wrote), and how far a replication slot holds it.
                let (oldest_tx, slot_age) = sqlx::query_as::<_, (Option<f64>, Option<f64>)>(
                    "SELECT (SELECT extract(epoch FROM now() - min(xact_start))::float8
                             FROM pg_stat_activity
                             WHERE datname = current_database()
                               AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)),
                            (SELECT max(age(xmin))::float8 FROM pg_replication_slots
                             WHERE xmin IS NOT NULL
                               AND (database IS NULL OR database = current_database()))",
                )
                .fetch_one(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok::<_, sqlx::Error>((row, oldest_tx, slot_age))
            };
            match backlog.await {
                Ok(((pending, scheduled, failed, oldest), oldest_tx, slot_age)) => {
                    metrics::gauge!("postal_relay_backlog").set(pending as f64);
                    metrics::gauge!("postal_relay_oldest_pending_seconds")
                        .set(oldest.unwrap_or(0.0));
                    metrics::gauge!("postal_relay_parked").set(failed as f64);
                    metrics::gauge!("postal_relay_scheduled").set(scheduled as f64);
                    metrics::gauge!("postal_relay_oldest_transaction_seconds")
                        .set(oldest_tx.unwrap_or(0.0));
                    metrics::gauge!("postal_relay_replication_slot_xmin_age")
                        .set(slot_age.unwrap_or(0.0));
                }
                Err(e) => check_failed("backlog", &e),
            }
            if let Some(retention) = self.config.history {
                match crate::retention::maintain_history(&self.pool, retention).await {
                    Ok(Some(m)) => {
                        if !m.created.is_empty() || m.moved_rows > 0 {
                            tracing::info!(created = ?m.created, moved_rows = m.moved_rows, "history partitions created");
                        }
                        if !m.dropped.is_empty() || m.default_rows_deleted > 0 {
                            tracing::info!(dropped = ?m.dropped, default_rows_deleted = m.default_rows_deleted, "history retention dropped old partitions");
                        }
                        for step in &m.failed {
                            tracing::warn!(step = %postal_shared::text::bounded(step, postal_shared::text::MAX_ERROR_BYTES), "history maintenance step failed; will retry");
                        }
                        metrics::counter!("postal_relay_check_failures_total", "check" => "history")
                            .increment(m.failed.len() as u64);
                        metrics::gauge!("postal_relay_history_maintenance_ok").set(if m.ok() {
                            1.0
                        } else {
                            0.0
                        });
                    }
                    // Another instance maintains the history now.
                    Ok(None) => {}
                    Err(e) => {
                        metrics::gauge!("postal_relay_history_maintenance_ok").set(0.0);
                        check_failed("history", &e);
                    }
                }
            }
            if let (false, Some(retention)) = (self.config.delete_on_publish, self.config.retention)
            {
                match crate::retention::cleanup_published(&self.pool, retention, 1000, |_| {}).await
                {
                    Ok(Some(n)) if n > 0 => {
                        tracing::info!(rows = n, "retention cleanup deleted published rows")
                    }
                    Ok(_) => {}
                    Err(e) => check_failed("retention", &e),
                }
            }
        }
    }

    /// One claim loop over its share ([`lane_share`]) of the owned key partitions.
    /// Returns its outstanding completions on shutdown.
    /// Checks out the first row of each key in a claimed batch ([`checkout`]), commits the
    /// claim and hands each checked-out event to the transport on its own; a task of the
    /// lane's batches in flight then renews their run leases and records each outcome when it
    /// is known.
    async fn check_out(
        self: &Arc<Self>,
        claim: claim::Claim,
        batch: Vec<OutboundEvent>,
        claim_started: Instant,
        gate: tokio::sync::RwLockReadGuard<'_, ()>,
        permits: CheckOutPermits,
    ) -> bool {
        let CheckOutPermits {
            slots,
            events: mut events_permit,
        } = permits;
        use futures::FutureExt as _;
        let lease = self.config.lease;
        // The run leases end `lease` after the claim's start by the database's clock, which
        // read it after this process's clock read `claim_started`.
        let renewed_at = tokio::time::Instant::from_std(claim_started);
        let heads = checkout::heads(&batch);
        let seqs: Vec<i64> = heads.iter().map(|&i| batch[i].seq).collect();
        // Not raced against a timeout: it commits or rolls back before the lane claims again.
        let marked = match claim
            .check_out(&seqs, lease, self.config.max_attempts)
            .await
        {
            Ok(marked) => marked,
            Err(e) => {
                tracing::warn!(error = %e, events = batch.len(), "could not check out claimed events; they are claimed again");
                return false;
            }
        };
        drop(gate);
        let mut runs = checkout::Runs::new();
        let mut attempts = HashMap::new();
        let mut parked = 0u64;
        for (seq, run, failed, was_parked) in marked {
            attempts.insert(seq, failed);
            if was_parked {
                parked += 1;
                if let Some(e) = batch.iter().find(|e| e.seq == seq) {
                    tracing::warn!(event_id = %e.id, topic = %postal_shared::text::field(&e.topic), key = %postal_shared::text::field(&e.key), "event parked as failed: its attempts were used up by runs that ended without an outcome (the relay died or lost its run lease)");
                }
            } else {
                runs.insert(seq, run);
            }
        }
        if parked > 0 {
            self.counters.parked.fetch_add(parked, Ordering::Relaxed);
            metrics::counter!("postal_relay_failed_total").increment(parked);
        }
        if tokio::time::Instant::now() >= renewed_at + lease - lease / 4 {
            // Never handed over: given back without counting anything (else, when the
            // database does not answer, they run again when their run leases end).
            let back: Vec<(i64, i32)> = runs.iter().map(|(s, r)| (*s, *r)).collect();
            let released = checkout::release(&self.pool, &back, true).await;
            tracing::warn!(events = runs.len(), released = ?released.as_ref().ok(), "checked-out events reached their hand-over deadline (the relay stalled?); not handing them over but giving them back");
            return true;
        }
        // The events with their attempts as checked out (for the verdict on their outcome);
        // the transport gets them with the runs before this one as their attempts, so that a
        // task sees its run number.
        let events: Vec<OutboundEvent> = heads
            .into_iter()
            .filter(|&i| runs.contains_key(&batch[i].seq))
            .map(|i| {
                let mut e = batch[i].clone();
                e.attempts = attempts[&e.seq];
                e
            })
            .collect();
        let mut in_flight: Vec<checkout::InFlight> = Vec::with_capacity(events.len());
        for e in &events {
            let mut handed = e.clone();
            handed.attempts = runs[&e.seq] - 1;
            let acks = self.transport.send(std::slice::from_ref(&handed)).await;
            in_flight.push(
                async move {
                    acks.await.into_iter().next().unwrap_or_else(|| {
                        Err(PublishError::new(
                            FailureKind::Unavailable,
                            "the destination returned no outcome",
                        ))
                    })
                }
                .boxed(),
            );
        }
        // The claim slots are free again: the checked-out rows hold their keys in the
        // database, so claims (and changes of the lanes' split) need not wait for them.
        drop(slots);
        // One permit per event in flight.
        if let Some(unused) = events_permit.num_permits().checked_sub(events.len()) {
            drop(events_permit.split(unused));
        }
        let shared = self.clone();
        // In the relay's set, not the lane's: a lane aborted at shutdown (stuck in a claim)
        // must not take running tasks with it before they are given back.
        let mut drives = self.drives.lock().expect("drives lock");
        while drives.try_join_next().is_some() {}
        drives.spawn(async move {
            let judge = outcome::Judge {
                config: shared.config.clone(),
                counters: shared.counters.clone(),
                unavailable_streak: shared.unavailable_streak.clone(),
                paused_until: shared.paused_until.clone(),
            };
            let events_permit = std::sync::Mutex::new(events_permit);
            let notify = |e: &OutboundEvent, ok: bool| {
                drop(events_permit.lock().expect("permit lock").split(1));
                shared.transport.recorded(std::slice::from_ref(e), ok);
                if ok {
                    shared.wake.send_modify(|n| *n = n.wrapping_add(1));
                }
            };
            let driver = checkout::Driver {
                pool: &shared.pool,
                lease,
                keeping: checkout::Keeping {
                    delete: shared.config.delete_on_publish,
                    history: shared.config.history.is_some(),
                },
                judge: &judge,
                recorded: &notify,
                release: &shared.release,
                abort_running: &|| shared.transport.abort_running(),
            };
            checkout::drive(driver, events, runs, in_flight, renewed_at).await;
        });
        true
    }

    async fn lane(
        self: Arc<Self>,
        lane: usize,
        lanes: usize,
        mut wake: tokio::sync::watch::Receiver<u64>,
        mut owned_changed: tokio::sync::watch::Receiver<u64>,
    ) -> tokio::task::JoinSet<()> {
        let mut completions = tokio::task::JoinSet::new();
        // This lane's own share of the in-flight batches. A lane's next claim walks past the
        // rows of its own batches still in flight (they stay in the index, locked, until their
        // commit); with several lanes each holding few batches, the relay keeps as many
        // batches in flight while each claim steps over fewer of them. With checked-out rows
        // (the task runner) a lane uses every slot: a long task holds back only its own key.
        let chained = self.chained;
        let per_lane = if chained {
            self.config.max_in_flight_batches.max(1)
        } else {
            self.config.max_in_flight_batches.div_ceil(lanes).max(1)
        };
        let own_slots = Arc::new(Semaphore::new(per_lane));
        let mut db_failures: u32 = 0;
        let stop = self.stop.clone();
        loop {
            // Back off while the destination is unavailable.
            let pause = *self.paused_until.lock().expect("pause lock");
            if let Some(until) = pause {
                let now = Instant::now();
                if until > now {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(until - now) => {}
                    }
                }
            }
            // Without a backlog, a lane claims only when no batch is in flight, and then for
            // all of the relay's partitions: events that arrived meanwhile go out together in
            // one claim (one produce request per Kafka partition, one commit) instead of in
            // small claims of their own each. Holding every slot while it claims and hands the
            // batch to the transport, it cannot race another lane for the same key. At a
            // steady load this lowered the end-to-end latency in `postal-bench e2e`
            // (BENCHMARKS.md): the claims and requests saved are work the database and the
            // broker no longer queue. With a backlog (the last claim came back full) the lanes
            // claim their own shares with up to `max_in_flight_batches` batches in flight, and
            // so do they always when rows are checked out (the task runner: one long task must
            // not stop the claims of every other key).
            // Checking out: no more events than the transport takes at once (one permit each,
            // released as their outcomes are recorded).
            let mut limit = self.config.batch_size;
            let mut events_permit = None;
            if let Some(room) = &self.checkout {
                let mut p = tokio::select! {
                    _ = stop.cancelled() => break,
                    p = room.clone().acquire_owned() => p.expect("semaphore never closed"),
                };
                let more = room.available_permits().min(limit.saturating_sub(1));
                if let Ok(extra) = room.clone().try_acquire_many_owned(more as u32) {
                    p.merge(extra);
                }
                limit = p.num_permits();
                events_permit = Some(p);
            }
            let light = !chained && !self.backlogged.load(Ordering::Relaxed);
            let all = self.config.max_in_flight_batches as u32;
            let own = tokio::select! {
                _ = stop.cancelled() => break,
                p = own_slots.clone().acquire_owned() => p.expect("semaphore never closed"),
            };
            let mut permit = tokio::select! {
                _ = stop.cancelled() => break,
                p = self.slots.clone().acquire_many_owned(if light { all } else { 1 }) =>
                    p.expect("semaphore never closed"),
            };
            // After a failure, the batches in flight settle first (see `key_chain`): claimed
            // behind them, this batch would hold their failed keys back in turn.
            if !chained {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    () = self.key_chain.settled() => {}
                }
            }
            // Read only while holding a slot: the split changes only while the coordinator
            // holds all of them. Lanes beyond this relay's part of the group's budget idle.
            let partitions = {
                let owned = self.owned.read().expect("owned lock");
                let active = self.active_lanes.load(Ordering::Relaxed);
                if lane >= active {
                    Vec::new()
                } else if light {
                    owned.clone()
                } else {
                    lane_share(&owned, active, lane)
                }
            };
            if partitions.is_empty() || !self.may_claim() {
                drop(permit);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    Ok(()) = owned_changed.changed() => {}
                    _ = tokio::time::sleep(self.config.poll_interval) => {}
                }
                continue;
            }
            // The claim is not raced against shutdown: it is short and bounded, and its
            // transaction is then either completed or rolled back.
            // Held until the batch is handed over (see `record_gate`).
            let gate = self.record_gate.read().await;
            let claim_started = Instant::now();
            let claimed = claim::claim(
                &self.pool,
                self.id,
                &partitions,
                limit,
                self.config.lease,
                // Checked-out rows stay in the outbox while they are in flight.
                self.config.delete_on_publish && self.checkout.is_none(),
                &self.config.topics,
            )
            .await;
            let mut claim = match claimed {
                Ok(Some(c)) => {
                    if db_failures > 0 {
                        tracing::info!("database reachable again; relay resumes");
                    }
                    db_failures = 0;
                    c
                }
                Ok(None) => {
                    db_failures = 0;
                    self.backlogged.store(false, Ordering::Relaxed);
                    drop(gate);
                    drop(permit);
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        // Err only once the relay is stopping; `stop` ends the loop then.
                        Ok(()) = wake.changed() => {}
                        Ok(()) = owned_changed.changed() => {}
                        _ = tokio::time::sleep(self.config.poll_interval) => {}
                    }
                    continue;
                }
                Err(e) => {
                    drop(gate);
                    drop(permit);
                    let wait = self.config.backoff.delay(db_failures);
                    db_failures = db_failures.saturating_add(1);
                    tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "claim failed (database unreachable?); retrying");
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(wait.max(Duration::from_millis(100))) => {}
                    }
                    continue;
                }
            };
            if self.config.history.is_some() {
                claim.keep_history();
            }
            let batch = claim.take_events();
            let full = batch.len() == limit;
            self.backlogged.store(full, Ordering::Relaxed);
            if let Some(events_permit) = events_permit.take() {
                if self
                    .check_out(
                        claim,
                        batch,
                        claim_started,
                        gate,
                        CheckOutPermits {
                            slots: [permit, own],
                            events: events_permit,
                        },
                    )
                    .await
                {
                    db_failures = 0;
                } else {
                    // As after a failed claim: back off.
                    let wait = self.config.backoff.delay(db_failures);
                    db_failures = db_failures.saturating_add(1);
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(wait.max(Duration::from_millis(100))) => {}
                    }
                }
                continue;
            }
            let started = Instant::now();
            let claim_time = started - claim_started;
            // How long the oldest event of the batch had existed when the claim started
            // (from its `occurred_at`, normally the enqueueing transaction's start).
            let waited_ms = if tracing::enabled!(tracing::Level::TRACE) {
                let oldest = batch.iter().map(|e| e.occurred_at).min();
                oldest.map_or(0.0, |t| {
                    (chrono::Utc::now() - t).num_microseconds().unwrap_or(0) as f64 / 1e3
                        - claim_started.elapsed().as_secs_f64() * 1e3
                })
            } else {
                0.0
            };
            // Transports that do not chain keys themselves: this batch waits for the outcome
            // of earlier batches in flight with a key of its own, and holds back the events
            // of keys that failed there (see `key_chain`).
            let mut chain = (!chained).then(|| self.key_chain.register(&batch));
            let mut held: Vec<bool> = Vec::new();
            if let Some(entry) = chain.as_ref().filter(|e| e.has_deps()) {
                held = tokio::select! {
                    h = entry.wait() => h,
                    _ = self.abandon.cancelled() => {
                        tracing::warn!(events = batch.len(), "shutdown timeout reached while a batch waited for an earlier one of its keys; giving it up (its claim rolls back)");
                        drop(claim);
                        if let Some(entry) = chain.take() {
                            self.key_chain.remove(&entry);
                        }
                        break;
                    }
                };
            }
            if claim.send_deadline_passed() {
                // The fence's last step (see `claim::Claim::send_deadline_passed`): this relay
                // stalled (a frozen process, a starved runtime, a claim that waited on a
                // lock) until its leases as read at claim time may have run out.
                tracing::warn!(events = batch.len(), claim_ms = claim_time.as_secs_f64() * 1e3, "a claimed batch reached its send deadline before it was handed over (the relay stalled?); giving it back unsent");
                let _ = tokio::time::timeout(self.config.lease / 4, claim.release()).await;
                if let Some(entry) = chain.take() {
                    self.key_chain.remove(&entry);
                }
                drop(gate);
                drop(permit);
                drop(own);
                continue;
            }
            // The events to hand over: all, unless the chain holds some back.
            let sent: Vec<OutboundEvent> = if held.iter().any(|h| *h) {
                batch
                    .iter()
                    .zip(&held)
                    .filter(|(_, h)| !**h)
                    .map(|(e, _)| e.clone())
                    .collect()
            } else {
                batch.clone()
            };
            let handed = tokio::select! {
                acks = self.transport.send(&sent), if !sent.is_empty() => Some(acks),
                _ = std::future::ready(()), if sent.is_empty() => None,
                _ = self.abandon.cancelled() => {
                    tracing::warn!(events = batch.len(), "shutdown timeout reached while a batch was still being handed to the destination; giving it up (its claim rolls back, its events are published again later)");
                    drop(claim);
                    if let Some(entry) = chain.take() {
                        self.key_chain.remove(&entry);
                    }
                    // What the transport may have started of it ends without a record.
                    self.transport.recorded(&sent, false);
                    break;
                }
            };
            let acks = merge_held(handed, held);
            drop(gate);
            let send_time = started.elapsed();
            if light {
                // Handed over in order: other lanes may claim again (keep one slot).
                drop(permit.split(all as usize - 1));
            }
            let ctx = outcome::Judge {
                config: self.config.clone(),
                counters: self.counters.clone(),
                unavailable_streak: self.unavailable_streak.clone(),
                paused_until: self.paused_until.clone(),
            };
            while completions.try_join_next().is_some() {}
            let keep_alive_every = self.config.lease / 4;
            let mut notice = RecordedNotice {
                shared: self.clone(),
                batch,
                sent,
                chain,
                told: false,
            };
            completions.spawn(async move {
                // While the transport works on the batch (a slow broker, a long task handler),
                // the claim is kept alive for as long as the relay's partition leases hold.
                let mut acks = Box::pin(acks);
                let mut tick = tokio::time::interval_at(
                    tokio::time::Instant::now() + keep_alive_every,
                    keep_alive_every,
                );
                let outcomes = loop {
                    let give_up_at = notice.shared.give_up_at();
                    tokio::select! {
                        biased;
                        outcomes = &mut acks => break Ok(outcomes),
                        // Heartbeats renew the leases long before this, unless they fail.
                        _ = tokio::time::sleep_until(give_up_at) => {
                            if notice.shared.give_up_at() <= tokio::time::Instant::now() {
                                break Err(GiveUp::NotRenewed);
                            }
                        }
                        _ = tick.tick() => {
                            match tokio::time::timeout_at(give_up_at, claim.keep_alive()).await {
                                Ok(Ok(true)) => {}
                                Ok(Ok(false)) => break Err(GiveUp::LeaseShort),
                                // The claim's transaction is gone (or aborted): its rows are
                                // free for any claim already.
                                Ok(Err(e)) => break Err(GiveUp::KeepAliveFailed(e)),
                                // Its transaction's state is unknown now: give the batch up.
                                Err(_) => break Err(GiveUp::KeepAliveLate),
                            }
                        }
                    }
                };
                let outcomes = match outcomes {
                    Ok(outcomes) => outcomes,
                    Err(reason) => {
                        // The fence: the work on this batch stops (a task handler is aborted
                        // at its next await, Kafka acknowledgements are no longer awaited)
                        // before another relay may take its keys over, and its claim rolls
                        // back (or PostgreSQL ends it: its idle limit never reaches past the
                        // leases), so its events are handed out again in order.
                        drop(acks);
                        notice.resolve_failed();
                        metrics::counter!("postal_relay_batches_given_up_total").increment(1);
                        tracing::warn!(
                            events = notice.batch.len(),
                            %reason,
                            "giving up a batch still in flight (its events are handed out again)"
                        );
                        // Its slot is freed only once the rollback is through, so that this
                        // relay does not give its partitions away before. If the database
                        // does not answer, the wait ends after a quarter of the lease, about
                        // when the leases end; PostgreSQL ends the claim by its idle limit,
                        // which the keep-alives kept within the leases.
                        let _ = tokio::time::timeout(ctx.config.lease / 4, claim.release()).await;
                        notice.recorded(false).await;
                        drop(permit);
                        drop(own);
                        return;
                    }
                };
                notice.resolve(&outcomes);
                let acked = started.elapsed();
                metrics::histogram!("postal_relay_batch_seconds").record(acked.as_secs_f64());
                let n = notice.batch.len();
                let committed = ctx.record(claim, &notice.batch, outcomes).await;
                notice.recorded(committed).await;
                tracing::trace!(
                    events = n,
                    waited_ms,
                    claim_ms = claim_time.as_secs_f64() * 1e3,
                    send_ms = send_time.as_secs_f64() * 1e3,
                    ack_ms = acked.as_secs_f64() * 1e3,
                    total_ms = started.elapsed().as_secs_f64() * 1e3,
                    "batch recorded"
                );
                drop(permit);
                drop(own);
            });
            if !full {
                // The backlog is drained for now: let acknowledgements get recorded.
                tokio::task::yield_now().await;
            }
        }
        completions
    }
}

/// How long a housekeeping check's statement may run (`statement_timeout`).
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// A housekeeping check or job that failed: counted by kind (`postal_relay_check_failures_total`,
/// alert `PostalRelayChecksFailing`) and logged; it runs again at the next round, and the
/// gauges it sets keep their last value meanwhile.
fn check_failed(check: &'static str, e: &sqlx::Error) {
    metrics::counter!("postal_relay_check_failures_total", "check" => check).increment(1);
    tracing::warn!(check, error = %e, "relay housekeeping failed; will retry");
}

/// The outcomes of a claimed batch of which the key chain held some events back (`held`, per
/// event; empty when none was): the handed-over events' outcomes from the transport, in
/// order, and `HeldBack` for the others (released for a later claim without an attempt).
fn merge_held<A>(
    handed: Option<A>,
    held: Vec<bool>,
) -> futures::future::BoxFuture<'static, Vec<Result<(), PublishError>>>
where
    A: std::future::Future<Output = Vec<Result<(), PublishError>>> + Send + 'static,
{
    use futures::FutureExt as _;
    async move {
        let mut sent = match handed {
            Some(acks) => acks.await,
            None => Vec::new(),
        }
        .into_iter();
        if held.is_empty() {
            return sent.collect();
        }
        held.into_iter()
            .map(|h| {
                if h {
                    Err(PublishError::new(
                        FailureKind::HeldBack,
                        "an earlier event of this key failed in another batch",
                    ))
                } else {
                    sent.next().unwrap_or_else(|| {
                        Err(PublishError::new(
                            FailureKind::Unavailable,
                            "the destination returned no outcome",
                        ))
                    })
                }
            })
            .collect()
    }
    .boxed()
}

/// What a lane holds while it checks out a claim.
struct CheckOutPermits {
    /// The lane's claim slots (the relay's and its own), freed once the events are handed
    /// over.
    slots: [tokio::sync::OwnedSemaphorePermit; 2],
    /// A permit per claimed event, each freed when its outcome is recorded.
    events: tokio::sync::OwnedSemaphorePermit,
}

/// Waits for the claim loops to return, collecting their sets of batches in flight.
async fn join_lanes(
    lanes: &mut tokio::task::JoinSet<tokio::task::JoinSet<()>>,
    completions: &mut Vec<tokio::task::JoinSet<()>>,
) {
    while let Some(r) = lanes.join_next().await {
        if let Ok(set) = r {
            completions.push(set);
        }
    }
}

/// How many claim loops each of `live` relays runs: the group's budget of `lanes`, split evenly
/// and rounded up, at least one. The database then sees about the same number of concurrent
/// claims whether one relay runs or four; adding relays adds standbys and spreads the relays'
/// own work, without multiplying the claims that compete in PostgreSQL.
fn lanes_per_relay(lanes: usize, live: usize) -> usize {
    lanes.max(1).div_ceil(live.max(1))
}

/// The owned key partitions (sorted) of claim loop `lane` out of `lanes`: a contiguous run of
/// the owned list, so that with contiguous ownership ([`lease::share`]) each claim's
/// partitions form one narrow range that the index can check.
fn lane_share(owned: &[i16], lanes: usize, lane: usize) -> Vec<i16> {
    let lanes = lanes.max(1);
    let n = owned.len();
    owned[lane * n / lanes..(lane + 1) * n / lanes].to_vec()
}

impl outcome::Judge {
    /// Records the batch's outcomes on its claim; `false` when that failed (the claim rolled
    /// back).
    async fn record(
        &self,
        claim: claim::Claim,
        batch: &[OutboundEvent],
        outcomes: Vec<Result<(), PublishError>>,
    ) -> bool {
        let outcome::Verdict {
            published,
            failures,
        } = self.verdict(batch, outcomes);
        // Record the outcome on the claim's transaction. If that fails (database gone), the
        // transaction rolls back and the rows are republished later: duplicates, never loss.
        match claim.complete(batch, &published, &failures).await {
            Ok(()) => {}
            Err(e @ Error::LeaseLost { .. }) => {
                tracing::warn!(error = %e, events = batch.len(), "a published batch was not recorded: its key partitions moved to another relay meanwhile; its events will be published again");
                return false;
            }
            Err(e) => {
                metrics::counter!("postal_relay_record_failures_total").increment(1);
                tracing::warn!(error = %e, events = batch.len(), "could not record a published batch; its events will be published again");
                return false;
            }
        }
        self.count(published.len(), &failures);
        true
    }
}

/// Forwards `postal_outbox` notifications to `wake`, reconnecting with backoff when the
/// listening connection drops. Notifications are only a hint: the relay also polls.
async fn listen(pool: PgPool, wake: tokio::sync::watch::Sender<u64>, poll: Duration) {
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
        wake.send_modify(|n| *n = n.wrapping_add(1));
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => wake.send_modify(|n| *n = n.wrapping_add(1)),
                Ok(None) => {
                    tracing::warn!("notification connection lost; reconnecting");
                    wake.send_modify(|n| *n = n.wrapping_add(1));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "notification connection failed; reconnecting");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lane_budget_is_split_among_live_relays() {
        // One relay runs them all; more relays share them, rounded up, never fewer than one
        // each, so the group never runs fewer lanes than configured.
        assert_eq!(lanes_per_relay(4, 1), 4);
        assert_eq!(lanes_per_relay(4, 2), 2);
        assert_eq!(lanes_per_relay(4, 3), 2);
        assert_eq!(lanes_per_relay(4, 4), 1);
        assert_eq!(lanes_per_relay(4, 9), 1);
        assert_eq!(lanes_per_relay(1, 0), 1);
        for live in 1..=10 {
            assert!(lanes_per_relay(4, live) * live >= 4);
        }
    }

    #[test]
    fn lanes_split_the_owned_partitions_into_contiguous_runs() {
        let owned: Vec<i16> = (64..128).collect();
        let a = lane_share(&owned, 2, 0);
        let b = lane_share(&owned, 2, 1);
        assert_eq!(a, (64..96).collect::<Vec<_>>());
        assert_eq!(b, (96..128).collect::<Vec<_>>());
        // Uneven splits still cover everything once; more lanes than partitions leave some
        // lanes without any.
        let owned: Vec<i16> = vec![3, 4, 5, 9, 10];
        let parts: Vec<Vec<i16>> = (0..3).map(|l| lane_share(&owned, 3, l)).collect();
        assert_eq!(parts.concat(), owned);
        let parts: Vec<Vec<i16>> = (0..8).map(|l| lane_share(&owned, 8, l)).collect();
        assert_eq!(parts.concat(), owned);
        assert!(parts.iter().any(Vec::is_empty));
        assert!(lane_share(&[], 2, 1).is_empty());
    }
}
