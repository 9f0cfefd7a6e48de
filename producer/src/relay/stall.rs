//! The claim watchdog: a claim that has waited long for the database (a pool with no
//! connection free, a pooler with fewer server connections than this relay's pool, a lock held
//! for long) shows as a log line, the `postal_relay_claim_waiting_seconds` gauge and a
//! not-ready [`RelayHealth`] within [`STALL_AFTER`], instead of a relay idle without a sign.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Shared;
use crate::transport::Transport;

/// How long a claim may wait for the database before the relay says it is stalled. A claim is
/// short and bounded when the database answers.
pub const STALL_AFTER: Duration = Duration::from_secs(30);

/// How often the watchdog looks.
const TICK: Duration = Duration::from_secs(5);

/// Whether a running relay makes progress, for a readiness check (`/readyz`): a clone of
/// [`crate::Relay::health`], readable while the relay runs.
#[derive(Clone, Debug, Default)]
pub struct RelayHealth(Arc<Mutex<Option<String>>>);

impl RelayHealth {
    /// `None` while the relay makes progress; else one line saying what holds it up.
    pub fn problem(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set(&self, problem: Option<String>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = problem;
    }
}

/// The relay's waits for the database along its claim path, each from when it started: a
/// claim (from its first attempt until one returns: failed attempts and their back-off count,
/// as when the pool has no connection to give), the commit recording a published batch or
/// checking a claimed batch out (it holds the slot or permit the next claim needs), the
/// recording of checked-out events' outcomes, and the lease heartbeat (claims need its
/// leases). Behind a frozen pooler the lanes wait for slots held by commits that never return,
/// with no claim under way: the commits' waits are what shows.
#[derive(Clone, Debug, Default)]
pub(crate) struct ClaimClock(Arc<Mutex<Waits>>);

#[derive(Debug, Default)]
struct Waits {
    next: u64,
    open: std::collections::HashMap<u64, (Instant, &'static str)>,
}

/// One wait under way on the [`ClaimClock`]; it ends when dropped.
#[derive(Debug)]
pub(crate) struct Waiting {
    clock: ClaimClock,
    id: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.clock.lock().open.remove(&self.id);
    }
}

impl ClaimClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waits> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a wait for the database: `what` names it in the stall line ("a claim").
    pub(crate) fn start(&self, what: &'static str) -> Waiting {
        let mut waits = self.lock();
        let id = waits.next;
        waits.next += 1;
        waits.open.insert(id, (Instant::now(), what));
        Waiting {
            clock: self.clone(),
            id,
        }
    }

    /// The oldest wait under way: how long, and what.
    fn oldest(&self) -> Option<(Duration, &'static str)> {
        let waits = self.lock();
        waits
            .open
            .values()
            .min_by_key(|(started, _)| *started)
            .map(|(started, what)| (started.elapsed(), *what))
    }
}

impl<T: Transport> Shared<T> {
    /// Every [`TICK`]: the longest wait for the database under way on the claim path
    /// ([`ClaimClock`]); past [`STALL_AFTER`], one warning, the gauge and [`RelayHealth`] say
    /// so until the database answers again.
    pub(super) async fn watch_claims(self: Arc<Self>) {
        let mut tick = tokio::time::interval(TICK);
        let mut stalled = false;
        // What `postal.relay_instances.stalled` holds for this relay, once written.
        let recorded = Arc::new(Mutex::new(None::<String>));
        let mut recording: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            tick.tick().await;
            // For `postal status`: the problem (or its end) into the relay's row, in a task of
            // its own, bounded (the database may be what holds the claims), tried each tick
            // until it lands.
            let wanted = self.health.problem();
            let landed = recorded.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if wanted.as_deref().map(first_words) != landed.as_deref().map(first_words)
                && recording.as_ref().is_none_or(|r| r.is_finished())
            {
                let (pool, id, recorded) = (self.pool.clone(), self.id, recorded.clone());
                recording = Some(tokio::spawn(async move {
                    let write = sqlx::query(
                        "UPDATE postal.relay_instances SET stalled = $2 WHERE relay_id = $1",
                    )
                    .bind(id)
                    .bind(wanted.as_deref())
                    .execute(&pool);
                    if let Ok(Ok(_)) = tokio::time::timeout(TICK, write).await {
                        *recorded.lock().unwrap_or_else(|p| p.into_inner()) = wanted;
                    }
                }));
            }
            let (waiting, what) = self.claim_clock.oldest().unwrap_or_default();
            metrics::gauge!("postal_relay_claim_waiting_seconds").set(waiting.as_secs_f64());
            if waiting >= STALL_AFTER {
                let problem = format!(
                    "{what} has waited {}s for the database: no connection of the relay's pool gets an answer (a pooler with fewer server connections than the relay's pool of {}? raise PgBouncer's default_pool_size for this database, or connect the relay directly), the pooler or the database does not answer, or a long lock holds it",
                    waiting.as_secs(),
                    self.pool.options().get_max_connections()
                );
                if !stalled {
                    tracing::warn!(relay = %self.id, "relay stalled: {problem}");
                    stalled = true;
                }
                self.health.set(Some(problem));
            } else if stalled {
                tracing::info!(relay = %self.id, "claims answer again; relay resumes");
                stalled = false;
                self.health.set(None);
            }
        }
    }
}

/// A problem line without its growing figures (how long a claim waited): what is recorded
/// changes only when the problem does.
fn first_words(problem: &str) -> &str {
    problem.split(" has waited").next().unwrap_or(problem)
}
