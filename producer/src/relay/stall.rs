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

    fn set(&self, problem: Option<String>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = problem;
    }
}

/// When each lane's claim under way started.
#[derive(Debug, Default)]
pub(super) struct ClaimClock(Mutex<std::collections::HashMap<usize, Instant>>);

impl ClaimClock {
    pub(super) fn started(&self, lane: usize) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(lane, Instant::now());
    }

    pub(super) fn ended(&self, lane: usize) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&lane);
    }

    fn oldest(&self) -> Option<Duration> {
        let claims = self.0.lock().unwrap_or_else(|p| p.into_inner());
        claims.values().min().map(Instant::elapsed)
    }
}

impl<T: Transport> Shared<T> {
    /// Every [`TICK`]: the longest wait of a claim under way; past [`STALL_AFTER`], one
    /// warning, the gauge and [`RelayHealth`] say so until claims answer again.
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
            let waiting = self.claim_clock.oldest().unwrap_or_default();
            metrics::gauge!("postal_relay_claim_waiting_seconds").set(waiting.as_secs_f64());
            if waiting >= STALL_AFTER {
                let problem = format!(
                    "a claim has waited {}s for the database: no connection of the relay's pool gets an answer (a pooler with fewer server connections than the relay's pool of {}? raise PgBouncer's default_pool_size for this database, or connect the relay directly) or a long lock holds it",
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
