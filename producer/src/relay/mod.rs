//! The relay loop: claim → hand to the transport → await acknowledgements → record outcomes.
//!
//! [`Relay::run`] starts the lease coordinator ([`coordinate`]), housekeeping
//! ([`housekeeping`]), the `LISTEN` wake-ups ([`listen`]) and the claim loops ([`lane`]) over
//! one [`Shared`] state, and stops them in order.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::checkout;
use crate::config::RelayConfig;
use crate::key_chain::KeyChain;
use crate::lease;
use crate::outcome;
use crate::transport::Transport;
use crate::Error;

mod check_out;
mod coordinate;
mod hand_over;
mod held;
pub(crate) mod housekeeping;
mod in_flight;
mod lane;
mod listen;
mod notice;
mod share;
mod stall;

pub(crate) use stall::ClaimClock;
pub use stall::{RelayHealth, STALL_AFTER};

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
    health: RelayHealth,
    /// Set for a WAL relay's sweep (`crate::wal::sweep`): claims take only rows below this
    /// `seq`, and the sweep neither listens nor does the housekeeping (its WAL relay does).
    below: Option<Arc<AtomicI64>>,
}

impl<T: Transport> Relay<T> {
    /// A relay publishing through `transport`. Fails if the configuration is invalid.
    ///
    /// Give it a pool of at least `max_in_flight_batches + lanes + 4` connections (docs/relay.md,
    /// "In-process task handlers"): each batch in flight holds one, each claiming lane one,
    /// and the heartbeat, housekeeping, `LISTEN` and the activity report one each.
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
        // The WAL relay's stream hands rows to the transport inside the transaction that took
        // them, which PostgreSQL ends after half the lease idle: a task that runs longer would
        // be run again. Tasks are checked out, and only polling checks out.
        if matches!(config.source, crate::config::RelaySource::Wal(_))
            && transport.checks_out().is_some()
        {
            return Err(Error::Config(
                "the WAL relay (--read-from wal) does not run in-process tasks: give a transport that checks rows out (TaskTransport, or a route to one) to a polling relay".into(),
            ));
        }
        let wanted = Self::connections_wanted(&config);
        let max = pool.options().get_max_connections();
        if max < wanted {
            tracing::warn!(
                pool_max_connections = max,
                wanted,
                "the relay's pool is smaller than this configuration can use at once (lanes + in-flight batches + 4): claims will wait for connections; raise the pool's max_connections to {wanted}"
            );
        }
        Ok(Relay {
            pool,
            transport: Arc::new(transport),
            config,
            id: Uuid::now_v7(),
            health: RelayHealth::default(),
            below: None,
        })
    }

    /// A WAL relay's sweep: a polling relay over `pool` and `transport` that claims only rows
    /// below `below` (`crate::wal::sweep`).
    pub(crate) fn sweep(
        pool: PgPool,
        transport: Arc<T>,
        config: RelayConfig,
        below: Arc<AtomicI64>,
    ) -> Self {
        Relay {
            pool,
            transport,
            config,
            id: Uuid::now_v7(),
            health: RelayHealth::default(),
            below: Some(below),
        }
    }

    /// The connections `config` can use at once ([`RelayConfig::connections_wanted`]).
    pub fn connections_wanted(config: &RelayConfig) -> u32 {
        config.connections_wanted()
    }

    /// Whether this relay, once running, makes progress: for a readiness check (`/readyz`).
    /// A claim that waits [`STALL_AFTER`] or more for the database makes it a problem.
    pub fn health(&self) -> RelayHealth {
        self.health.clone()
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
    /// most about twice `shutdown_timeout` plus a one-second flush and the last activity report
    /// (at most 5 s).
    ///
    /// The owned key partitions are split across `lanes` claim loops, in contiguous blocks:
    /// each lane claims its partitions in sequence order, so per-key order
    /// holds while lanes claim in parallel. When the owned set changes, the split changes only
    /// while no batch is in flight.
    /// Database or broker outages never end the loop: it logs one line per failed attempt and
    /// retries with backoff. A schema this binary must not run on (checked at start and every
    /// [`postal_shared::SCHEMA_RECHECK`]) ends it with that error, after a graceful stop.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<RelayStats, Error> {
        let mut shutdown = std::pin::pin!(shutdown);
        // The upgrade contract: a schema this relay must not run on (missing, behind, or for
        // newer binaries only) stops it with one line; an unreachable database is waited for.
        if !postal_shared::wait_for_schema(&self.pool, &mut shutdown).await? {
            return Ok(RelayStats::default());
        }
        if let crate::config::RelaySource::Wal(source) = &self.config.source {
            let source = source.clone();
            return crate::wal::run(
                self.pool,
                self.transport,
                self.config,
                source,
                self.id,
                self.health,
                shutdown,
            )
            .await;
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
            claim_clock: stall::ClaimClock::default(),
            health: self.health.clone(),
            below: self.below.clone(),
        });
        // Background tasks live in JoinSets, which abort them when dropped: if this future is
        // dropped (the relay is killed), nothing keeps heartbeating on its behalf.
        let mut background = tokio::task::JoinSet::new();
        if self.config.listen && self.below.is_none() {
            background.spawn(listen::listen(
                self.pool.clone(),
                wake_tx.clone(),
                self.config.poll_interval,
            ));
        }

        tracing::info!(relay = %self.id, group = %self.config.group, topics = ?self.config.topics, batch = self.config.batch_size, lanes = self.config.lanes, "relay started");
        let lanes = self.config.lanes.max(1);
        let (owned_tx, owned_rx) = tokio::sync::watch::channel(0u64);
        // A set of its own: at a stop it finishes the heartbeat under way before the relay
        // gives its partitions up (aborted mid-heartbeat, a commit already sent could land
        // after `lease::leave` and keep every partition leased to a stopped relay for a whole
        // lease: seen in CI, a relay stopped 50 ms after its start left all 256 to the next
        // for 60 s). Aborted with the relay if this future is dropped.
        let coordinator_stop = CancellationToken::new();
        let mut coordination = tokio::task::JoinSet::new();
        coordination.spawn(
            shared
                .clone()
                .coordinate(owned_tx, coordinator_stop.clone()),
        );
        if self.below.is_none() {
            background.spawn(housekeeping::housekeeping(
                self.pool.clone(),
                self.config.clone(),
            ));
        }
        background.spawn(shared.clone().watch_claims());
        // Not in `background`: it writes the last activity as the relay stops (below).
        let report_stop = CancellationToken::new();
        // A set of its own, which aborts it if this future is dropped (the relay killed
        // in-process).
        let mut report = tokio::task::JoinSet::new();
        report.spawn(crate::activity::report(
            shared.counters.activity.clone(),
            self.pool.clone(),
            self.id,
            report_stop.clone(),
        ));
        let mut lane_tasks = tokio::task::JoinSet::new();
        for lane in 0..lanes {
            lane_tasks.spawn(
                shared
                    .clone()
                    .lane(lane, lanes, wake_rx.clone(), owned_rx.clone()),
            );
        }
        // The upgrade contract again while running: a migration this binary must not run on
        // stops it (gracefully, like a shutdown) with that one line as its error.
        let broken = tokio::select! {
            () = &mut shutdown => None,
            e = postal_shared::watch_schema(&self.pool, postal_shared::SCHEMA_RECHECK) => Some(e),
        };
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
        coordinator_stop.cancel();
        if tokio::time::timeout(Duration::from_secs(5), coordination.join_next())
            .await
            .is_err()
        {
            tracing::warn!("the lease heartbeat did not finish within 5 s of the stop; cut off (its partitions may stay leased until the lease runs out)");
            coordination.abort_all();
            while coordination.join_next().await.is_some() {}
        }
        background.abort_all();
        while background.join_next().await.is_some() {}
        // Whatever is still unacknowledged is abandoned: dropping a claim rolls its
        // transaction back, so the rows are claimable again at once.
        for mut set in completions {
            set.abort_all();
            while set.join_next().await.is_some() {}
        }
        // The activity of the last seconds, for the dashboard's charts: the report task
        // finishes a write under way (cut off at its commit, it could hold the rows' locks on
        // the server past the last write) and writes once more. A write stuck for 3 s is cut
        // off and the last one made apart, for at most 2 s more: a stop does not wait on an
        // unreachable database for the charts.
        report_stop.cancel();
        if tokio::time::timeout(Duration::from_secs(3), report.join_next())
            .await
            .is_err()
        {
            report.abort_all();
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                shared.counters.activity.flush(&self.pool, self.id),
            )
            .await;
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
        match broken {
            Some(e) => Err(e.into()),
            None => Ok(stats),
        }
    }
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

/// What the relay's tasks share: the coordinator, housekeeping, the claim loops and their
/// batches in flight.
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
    /// `n` live relays runs `lanes / n` of them, rounded up ([`share::lanes_per_relay`]).
    /// Changes only together with `owned`, while the coordinator holds every in-flight slot.
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
    /// When each lane's claim under way started ([`stall`]).
    claim_clock: stall::ClaimClock,
    /// What the claim watchdog found ([`Relay::health`]).
    health: RelayHealth,
    /// Claims take only rows below this `seq` (a WAL relay's sweep, [`Relay::sweep`]).
    below: Option<Arc<AtomicI64>>,
}

impl<T: Transport> Shared<T> {
    /// The relay's judge of outcomes: its configuration, totals and pause.
    fn judge(&self) -> outcome::Judge {
        outcome::Judge {
            config: self.config.clone(),
            counters: self.counters.clone(),
            unavailable_streak: self.unavailable_streak.clone(),
            paused_until: self.paused_until.clone(),
        }
    }
}
