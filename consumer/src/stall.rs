//! The partition watchdog: records that wait in an owned partition while no transaction of it
//! completes (a pool with no connection free, a pooler that holds the connections, a lock, a
//! handler that keeps failing, a claim that does not land) show as a log line, the
//! `postal_consumer_stalled_seconds` gauge and a not-ready `/readyz` within [`STALL_AFTER`],
//! instead of a consumer idle without a sign.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::context::Tp;
use crate::stats::Stats;

/// How long records may wait in a partition with no transaction of it completing before the
/// consumer says it is stalled. A transaction is short and bounded when the database answers.
pub const STALL_AFTER: Duration = Duration::from_secs(30);

/// How often the watchdog looks.
const TICK: Duration = Duration::from_secs(5);

/// Since when records have waited in one partition without a transaction of it completing
/// (`None`: nothing waits).
#[derive(Debug, Default)]
pub(crate) struct Waiting(Mutex<Option<Instant>>);

impl Waiting {
    /// A record arrived: the clock starts unless it runs.
    pub(crate) fn arrived(&self) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(Instant::now);
    }

    /// A transaction completed: the partition advanced; records still waiting wait from now.
    pub(crate) fn advanced(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// The worker is about to wait for records: if none is queued (`queued()` false, read
    /// under the clock's lock, after which an arrival restarts it), nothing waits.
    pub(crate) fn idle_unless(&self, queued: impl FnOnce() -> bool) {
        let mut since = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !queued() {
            *since = None;
        }
    }

    fn waited(&self) -> Duration {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map_or(Duration::ZERO, |s| s.elapsed())
    }
}

/// Whether a running consumer makes progress, for its `/readyz`.
#[derive(Debug, Default)]
pub(crate) struct ConsumerHealth(Mutex<Option<String>>);

impl ConsumerHealth {
    /// `None` while every owned partition makes progress; else one line saying which does not.
    pub(crate) fn problem(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The waiting clocks of the partitions owned here, and what the watchdog last reported.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    pub(crate) partitions: Mutex<HashMap<Tp, std::sync::Arc<Waiting>>>,
    pub(crate) health: ConsumerHealth,
}

impl Watch {
    /// Every [`TICK`] until cancelled: each owned partition's wait as the gauge
    /// `postal_consumer_stalled_seconds{consumer, topic, partition}` (0 while it advances or
    /// nothing waits); a partition waiting [`STALL_AFTER`] or more (and not in a stopped
    /// topic, which has its own gauge, nor in a paused one) is one warning and makes the consumer not ready, until
    /// it advances again.
    pub(crate) async fn run(
        &self,
        consumer: String,
        pool_size: u32,
        stats: &Stats,
        pauses: &crate::pause::Pauses,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut tick = tokio::time::interval(TICK);
        let mut shown: HashSet<Tp> = HashSet::new();
        let mut stalled: HashSet<Tp> = HashSet::new();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let now: Vec<(Tp, Duration)> = self
                .partitions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(|(tp, w)| (tp.clone(), w.waited()))
                .collect();
            // Always set, also with no partition: what `PostalConsumerAbsent` looks for.
            metrics::gauge!("postal_consumer_partitions_owned", "consumer" => consumer.clone())
                .set(now.len() as f64);
            let mut problems = Vec::new();
            let mut seen = HashSet::new();
            for ((topic, partition), waited) in now {
                let tp = (topic.clone(), partition);
                seen.insert(tp.clone());
                // A stopped topic has a gauge of its own; a paused one waits on purpose.
                let waited = if stats.topic_stopped(&topic) || pauses.covers(&topic) {
                    Duration::ZERO
                } else {
                    waited
                };
                metrics::gauge!("postal_consumer_stalled_seconds", "consumer" => consumer.clone(), "topic" => topic.clone(), "partition" => partition.to_string())
                    .set(waited.as_secs_f64());
                if waited >= STALL_AFTER {
                    let problem = format!(
                        "partition {topic}/{partition}: records have waited {}s with no transaction completing: no connection of the consumer's pool of {pool_size} gets an answer (a pooler with fewer server connections than the pool? raise PgBouncer's default_pool_size for this database, or connect directly), a long lock, or a handler that keeps failing",
                        waited.as_secs()
                    );
                    if stalled.insert(tp.clone()) {
                        tracing::warn!(consumer = %consumer, "consumer stalled: {problem}");
                    }
                    problems.push(problem);
                } else if stalled.remove(&tp) {
                    tracing::info!(consumer = %consumer, topic = %topic, partition, "partition advances again; consumer resumes");
                }
            }
            // Partitions no longer owned here: their gauge falls to 0.
            for (topic, partition) in shown.difference(&seen) {
                metrics::gauge!("postal_consumer_stalled_seconds", "consumer" => consumer.clone(), "topic" => topic.clone(), "partition" => partition.to_string())
                    .set(0.0);
                stalled.remove(&(topic.clone(), *partition));
            }
            shown = seen;
            *self.health.0.lock().unwrap_or_else(|p| p.into_inner()) =
                (!problems.is_empty()).then(|| problems.join("; "));
        }
    }
}
