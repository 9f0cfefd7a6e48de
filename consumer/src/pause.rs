//! Pauses of the consumer group (`postal pause consumer`, `postal.pauses`).
//!
//! What makes a pause exact is in the database: every processing transaction holds the pause
//! locks of its group and topic shared from its `BEGIN` on and reads the pause where it
//! advances the stored offset ([`crate::offsets::advance`], [`postal_shared::pause`]); a
//! transaction that finds one rolls back whole. This module is the runtime's view of the
//! pauses, read every [`POLL`]: workers stop before starting a transaction of a paused topic,
//! pause its partitions at the broker (fetching stops) and wait here until it is resumed; then
//! they take the partition over again from the stored offset. The view also sets the gauge
//! `postal_consumer_paused{group, consumer, topic}` and keeps paused partitions out of the
//! stall watchdog ([`crate::stall`]).

use std::collections::HashSet;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How often the runtime reads the group's pauses.
pub(crate) const POLL: Duration = Duration::from_secs(1);

/// The group's pauses as last read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Paused {
    /// The whole group.
    all: bool,
    /// These topics of it.
    topics: HashSet<String>,
}

impl Paused {
    pub(crate) fn covers(&self, topic: &str) -> bool {
        self.all || self.topics.contains(topic)
    }
}

/// The runtime's view of its group's pauses.
#[derive(Debug)]
pub(crate) struct Pauses(watch::Sender<Paused>);

impl Default for Pauses {
    fn default() -> Self {
        Pauses(watch::channel(Paused::default()).0)
    }
}

impl Pauses {
    /// Whether `topic` was paused at the last read.
    pub(crate) fn covers(&self, topic: &str) -> bool {
        self.0.borrow().covers(topic)
    }

    /// A receiver of every read (each read notifies, changed or not).
    pub(crate) fn subscribe(&self) -> watch::Receiver<Paused> {
        self.0.subscribe()
    }

    /// Reads the pauses of `group` every [`POLL`] until `stop`; logs each change and sets the
    /// gauge for each of the subscribed `topics`. A failed read keeps the last view (the
    /// transactions still honour the pause).
    pub(crate) async fn run(
        &self,
        pool: &PgPool,
        group: &str,
        consumer: &str,
        topics: &[String],
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut first = true;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let rows: Result<Vec<Option<String>>, sqlx::Error> = sqlx::query_scalar(
                "SELECT topic FROM postal.pauses WHERE side = 'consumer' AND group_name = $1",
            )
            .bind(group)
            .fetch_all(pool)
            .await;
            let Ok(rows) = rows else {
                continue;
            };
            let now = Paused {
                all: rows.iter().any(Option::is_none),
                topics: rows.into_iter().flatten().collect(),
            };
            let before = self.0.send_replace(now.clone());
            if before != now || first {
                for topic in topics {
                    let (was, is) = (before.covers(topic), now.covers(topic));
                    if was != is {
                        if is {
                            tracing::info!(group, consumer, topic, "topic paused (postal pause consumer): nothing of it is applied until it is resumed");
                        } else {
                            tracing::info!(
                                group,
                                consumer,
                                topic,
                                "topic resumed: applying from the stored offsets"
                            );
                        }
                    }
                    metrics::gauge!("postal_consumer_paused", "group" => group.to_owned(), "consumer" => consumer.to_owned(), "topic" => topic.clone())
                        .set(if is { 1.0 } else { 0.0 });
                }
            }
            first = false;
        }
    }
}
