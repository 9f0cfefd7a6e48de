//! A topic stopped because a partition's log was replaced under the stored offset (the rule:
//! [`crate::replaced`]): finding it out, and the parked worker that applies and skips nothing
//! until `postal consumer reset` moves the topic's offsets.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::Consumer;

use crate::replaced::{self, Stop};

use super::{tpl, Owned, Shared, Worker};

/// How long the second read of the watermarks waits after a first that showed a replaced log.
const CONFIRM_AFTER: Duration = Duration::from_millis(500);

/// Counts a parked partition in the gauge for as long as it lives.
struct Parked(Arc<Shared>, String);

impl Parked {
    fn new(worker: &Worker) -> Self {
        let s = &worker.shared;
        s.stats.stopped(&s.config.consumer, &worker.topic, 1);
        Parked(s.clone(), worker.topic.clone())
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        self.0.stats.stopped(&self.0.config.consumer, &self.1, -1);
    }
}

impl Worker {
    /// The partition's (low, high) watermarks, read again while the broker does not answer;
    /// `None` if cancelled meanwhile.
    async fn watermarks(&self) -> Option<(i64, i64)> {
        let mut failures = 0u32;
        loop {
            let consumer = self.shared.consumer.clone();
            let (topic, partition) = (self.topic.clone(), self.partition);
            let r = tokio::task::spawn_blocking(move || {
                consumer.fetch_watermarks(&topic, partition, Duration::from_secs(5))
            })
            .await;
            match r {
                Ok(Ok(w)) => return Some(w),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot read the partition's watermarks to tell a redelivery from a re-created topic; holding its records and retrying");
                }
                Err(_) => return None,
            }
            if !self.wait(failures).await {
                return None;
            }
            failures = failures.saturating_add(1);
        }
    }

    /// Whether the topic must stop before records below the stored offset `n` are dropped or
    /// an idle partition goes on waiting: the group stopped it already, or this partition's
    /// log was replaced under `n` (confirmed by a second read; then recorded, with one ERROR
    /// line). `None` if cancelled meanwhile.
    pub(super) async fn log_replaced(&self, n: i64) -> Option<bool> {
        if self.topic_stopped().await {
            return Some(true);
        }
        let (_, high) = self.watermarks().await?;
        if !replaced::impossible(n, high) {
            return Some(false);
        }
        tokio::select! {
            _ = tokio::time::sleep(CONFIRM_AFTER) => {}
            _ = self.cancel.cancelled() => return None,
        }
        let (low, high) = self.watermarks().await?;
        if !replaced::impossible(n, high) {
            return Some(false);
        }
        let stop = Stop {
            partition: self.partition,
            stored_offset: n,
            low_watermark: low,
            high_watermark: high,
        };
        let group = &self.shared.config.group;
        let reset = format!(
            "postal consumer reset --group {group} --topic {} --to earliest --execute",
            self.topic
        );
        tracing::error!(group = %group, topic = %self.topic, partition = self.partition, stored_offset = n, low_watermark = low, high_watermark = high,
            "stored offset above the partition's high watermark: the topic was deleted and re-created, or the group moved to another Kafka cluster; the topic is stopped (nothing applied, nothing skipped): stop the group's consumers, then run `{reset}`");
        if let Err(e) = replaced::record(&self.shared.pool, group, &self.topic, stop).await {
            // Stopped here all the same; the group's other processes find it out themselves.
            tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot record the topic's stop in postal.consumer_stops (does the consumer's role have `postal grant --consumer`?)");
        }
        Some(true)
    }

    /// How many partitions the topic has now (a fresh metadata request); `None` when the
    /// broker does not say (unreachable, the topic missing or still being created).
    async fn partition_count(&self) -> Option<i32> {
        let consumer = self.shared.consumer.clone();
        let topic = self.topic.clone();
        tokio::task::spawn_blocking(move || {
            let md = consumer
                .fetch_metadata(Some(&topic), Duration::from_secs(5))
                .ok()?;
            let t = md.topics().iter().find(|t| t.name() == topic)?;
            (t.error().is_none() && !t.partitions().is_empty())
                .then(|| i32::try_from(t.partitions().len()).ok())?
        })
        .await
        .ok()?
    }

    /// Whether the group stored an offset for a partition the topic no longer has: Kafka never
    /// takes a partition away, so the topic was deleted and re-created with fewer partitions
    /// (or the group moved to another cluster) and the stored offsets of the partitions it
    /// still has belong to the old log too, even where they lie within the new log's offsets
    /// (resuming there would never read the new log's first records). Checked when a partition
    /// is taken over, before anything of it is applied; confirmed by a second metadata read;
    /// then recorded like a stored offset above the high watermark (watermarks -1: no such
    /// partition), with one ERROR line. `None` if cancelled meanwhile.
    pub(super) async fn partitions_vanished(&self) -> Option<bool> {
        let group = &self.shared.config.group;
        let highest: Option<(i32, Option<i64>)> = match sqlx::query_as(
            "SELECT partition, next_offset FROM postal.consumer_offsets
             WHERE group_id = $1 AND topic = $2 ORDER BY partition DESC LIMIT 1",
        )
        .bind(group)
        .bind(&self.topic)
        .fetch_optional(&self.shared.pool)
        .await
        {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!(error = %e, topic = %self.topic, "cannot read the group's stored partitions");
                return Some(false);
            }
        };
        let Some((highest, stored)) = highest else {
            return Some(false);
        };
        if self.cancel.is_cancelled() {
            return None;
        }
        match self.partition_count().await {
            Some(count) if highest >= count => {}
            _ => return Some(false),
        }
        tokio::select! {
            _ = tokio::time::sleep(CONFIRM_AFTER) => {}
            _ = self.cancel.cancelled() => return None,
        }
        let count = match self.partition_count().await {
            Some(count) if highest >= count => count,
            _ => return Some(false),
        };
        let stop = Stop {
            partition: highest,
            stored_offset: stored.unwrap_or(0),
            low_watermark: -1,
            high_watermark: -1,
        };
        let reset = format!(
            "postal consumer reset --group {group} --topic {} --to earliest --execute",
            self.topic
        );
        tracing::error!(group = %group, topic = %self.topic, partition = highest, partitions = count, stored_offset = ?stored,
            "the group stored an offset for a partition the topic no longer has: the topic was deleted and re-created with fewer partitions, or the group moved to another Kafka cluster; the topic is stopped (nothing applied, nothing skipped): stop the group's consumers, then run `{reset}`");
        if let Err(e) = replaced::record(&self.shared.pool, group, &self.topic, stop).await {
            tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot record the topic's stop in postal.consumer_stops (does the consumer's role have `postal grant --consumer`?)");
        }
        Some(true)
    }

    /// Whether the group stopped this topic (`postal.consumer_stops`). A database error counts
    /// as "no": the next check finds out.
    pub(super) async fn topic_stopped(&self) -> bool {
        match replaced::of_topic(&self.shared.pool, &self.shared.config.group, &self.topic).await {
            Ok(stop) => stop.is_some(),
            Err(e) => {
                tracing::debug!(error = %e, topic = %self.topic, "cannot read postal.consumer_stops");
                false
            }
        }
    }

    /// The partition's topic is stopped: fetching pauses, whatever was fetched is dropped
    /// unprocessed (it is fetched again from the stored offset later), nothing is applied or
    /// stored. Every `stall_check` the epoch is read: `postal consumer reset` bumps it, and
    /// the partition is then taken over again (`Owned::Fenced`) from the offset it stored.
    pub(super) async fn parked(&mut self, epoch: i64) -> Owned {
        let _gauge = Parked::new(self);
        {
            let mut paused = self.paused.lock().expect("pause flag");
            match self
                .shared
                .consumer
                .pause(&tpl(&self.topic, self.partition))
            {
                Ok(()) => *paused = true,
                Err(e) => {
                    tracing::debug!(error = %e, topic = %self.topic, partition = self.partition, "pausing the stopped partition failed; its records are dropped as they come")
                }
            }
        }
        if let Ok(Some(stop)) =
            replaced::of_topic(&self.shared.pool, &self.shared.config.group, &self.topic).await
        {
            tracing::warn!(group = %self.shared.config.group, topic = %self.topic, partition = self.partition,
                stopped_by_partition = stop.partition, stored_offset = stop.stored_offset, high_watermark = stop.high_watermark,
                "partition idle: its topic is stopped (postal status shows why; postal consumer reset is the way on)");
        }
        loop {
            let tick = self.shared.config.stall_check;
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Owned::Ended,
                r = self.rx.recv() => match r {
                    Some(r) => {
                        self.queued.sub(1, r.weight);
                        self.shared.stats.buffered(-(r.weight as i64));
                    }
                    None => return Owned::Ended,
                },
                _ = tokio::time::sleep(tick) => {
                    if self.epoch_moved(epoch).await {
                        return Owned::Fenced(None);
                    }
                }
            }
        }
    }
}
