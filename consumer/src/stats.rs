//! Counters of what the runtime did, readable in-process and exported through `metrics`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Live counters of one consumer runtime.
#[derive(Debug, Default)]
pub struct Stats {
    applied: AtomicU64,
    duplicates: AtomicU64,
    dead_letters: AtomicU64,
    skipped: AtomicU64,
    replays_skipped: AtomicU64,
    retries: AtomicU64,
    fenced: AtomicU64,
    stalls_recovered: AtomicU64,
    records_expired: AtomicU64,
    buffered_bytes: AtomicU64,
    buffered_bytes_peak: AtomicU64,
    partitions_stopped: AtomicU64,
    partitions_paused: AtomicU64,
    partitions_held_full: AtomicU64,
    /// Partitions stopped here, per topic (the gauge's value).
    stopped_by_topic: Mutex<HashMap<String, u64>>,
}

/// A snapshot of [`Stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Events whose handler ran and committed.
    pub applied: u64,
    /// Deliveries whose dedup row already existed (the body did not run).
    pub duplicates: u64,
    /// Records recorded as dead letters.
    pub dead_letters: u64,
    /// Records of unknown types skipped by configuration.
    pub skipped: u64,
    /// Records below the stored offset (already processed), skipped without a transaction.
    pub replays_skipped: u64,
    /// Handler retries after retryable failures.
    pub retries: u64,
    /// Transactions rolled back because another consumer took the partition over.
    pub fenced: u64,
    /// Times an owned partition delivered nothing for `stall_check` although the broker had
    /// more, and the consumer sought to the stored offset again.
    pub stalls_recovered: u64,
    /// Records removed from the broker (retention, delete-records) before this consumer's
    /// group processed them: never applied nor dead-lettered.
    pub records_expired: u64,
    /// Bytes of records fetched and not yet processed, over all partitions (see
    /// `ConsumerConfig::partition_buffer_bytes`).
    pub buffered_bytes: u64,
    /// The most `buffered_bytes` has been.
    pub buffered_bytes_peak: u64,
    /// Partitions owned here that apply nothing because their topic is stopped: its log was
    /// replaced under the stored offset (a topic deleted and re-created, another Kafka
    /// cluster; see `postal consumer reset`).
    pub partitions_stopped: u64,
    /// Partitions owned here that wait, applying nothing, because their group or topic is
    /// paused (`postal pause consumer`); they go on from their stored offsets once resumed.
    pub partitions_paused: u64,
    /// Partitions owned here that wait, applying nothing, because their group's held keys
    /// reached `held_bytes_limit` (`postal_consumer_held_full`); they go on once held keys are
    /// released.
    pub partitions_held_full: u64,
}

macro_rules! bump {
    ($name:ident, $metric:literal, $($label:tt)*) => {
        pub(crate) fn $name(&self, consumer: &str, topic: &str, n: u64) {
            if n == 0 {
                return;
            }
            self.$name.fetch_add(n, Ordering::Relaxed);
            metrics::counter!($metric, "consumer" => consumer.to_owned(), "topic" => topic.to_owned(), $($label)*).increment(n);
        }
    };
}

impl Stats {
    bump!(applied, "postal_consumer_events_total", "outcome" => "applied");
    bump!(duplicates, "postal_consumer_events_total", "outcome" => "duplicate");
    bump!(dead_letters, "postal_consumer_events_total", "outcome" => "dead_letter");
    bump!(skipped, "postal_consumer_skipped_total", "reason" => "unknown_type");
    bump!(replays_skipped, "postal_consumer_skipped_total", "reason" => "below_stored_offset");
    bump!(retries, "postal_consumer_retries_total",);
    bump!(fenced, "postal_consumer_fenced_total",);
    bump!(stalls_recovered, "postal_consumer_stalls_recovered_total",);
    bump!(records_expired, "postal_consumer_records_expired_total",);

    /// The current values.
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            applied: l(&self.applied),
            duplicates: l(&self.duplicates),
            dead_letters: l(&self.dead_letters),
            skipped: l(&self.skipped),
            replays_skipped: l(&self.replays_skipped),
            retries: l(&self.retries),
            fenced: l(&self.fenced),
            stalls_recovered: l(&self.stalls_recovered),
            records_expired: l(&self.records_expired),
            buffered_bytes: l(&self.buffered_bytes),
            buffered_bytes_peak: l(&self.buffered_bytes_peak),
            partitions_stopped: l(&self.partitions_stopped),
            partitions_paused: l(&self.partitions_paused),
            partitions_held_full: l(&self.partitions_held_full),
        }
    }

    /// A partition started (`true`) or stopped waiting at the held-bytes bound.
    pub(crate) fn held_full(&self, start: bool) {
        if start {
            self.partitions_held_full.fetch_add(1, Ordering::Relaxed);
        } else {
            self.partitions_held_full.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A partition started (`true`) or stopped waiting while its topic is paused.
    pub(crate) fn held(&self, start: bool) {
        if start {
            self.partitions_paused.fetch_add(1, Ordering::Relaxed);
        } else {
            self.partitions_paused.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A partition of `topic` stopped (`1`) or left its stop (`-1`): the gauge
    /// `postal_consumer_partitions_stopped{consumer, topic}`.
    pub(crate) fn stopped(&self, consumer: &str, topic: &str, delta: i64) {
        let now = {
            let mut by_topic = self.stopped_by_topic.lock().expect("stopped partitions");
            let n = by_topic.entry(topic.to_owned()).or_default();
            *n = n.saturating_add_signed(delta);
            *n
        };
        if delta >= 0 {
            self.partitions_stopped
                .fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
        } else {
            self.partitions_stopped
                .fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
        }
        metrics::gauge!("postal_consumer_partitions_stopped", "consumer" => consumer.to_owned(), "topic" => topic.to_owned())
            .set(now as f64);
    }

    /// Whether partitions of `topic` owned here are stopped (`stopped`).
    pub(crate) fn topic_stopped(&self, topic: &str) -> bool {
        self.stopped_by_topic
            .lock()
            .expect("stopped partitions")
            .get(topic)
            .is_some_and(|n| *n > 0)
    }

    /// Records of `bytes` entered (positive) or left (negative) a partition buffer. Entries
    /// are counted before the records reach their worker, so the count never goes below zero.
    pub(crate) fn buffered(&self, bytes: i64) {
        let now = if bytes >= 0 {
            self.buffered_bytes
                .fetch_add(bytes as u64, Ordering::Relaxed)
                .saturating_add(bytes as u64)
        } else {
            self.buffered_bytes
                .fetch_sub(bytes.unsigned_abs(), Ordering::Relaxed)
                .saturating_sub(bytes.unsigned_abs())
        };
        self.buffered_bytes_peak.fetch_max(now, Ordering::Relaxed);
        metrics::gauge!("postal_consumer_buffered_bytes").set(now as f64);
    }
}
