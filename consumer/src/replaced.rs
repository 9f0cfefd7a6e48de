//! Partitions whose log was replaced under the group's stored offset: a topic deleted and
//! re-created, the group moved to another Kafka cluster, a log truncated by an unclean leader
//! election. Their offsets start again below the stored one.
//!
//! # The rule: a redelivery, or a new log?
//!
//! A record below the stored next offset `n` is either a redelivery of a record the group has
//! processed (the fetch started at Kafka's group offset, which trails the stored one, or at a
//! position from before a seek: normal right after a rebalance) or a record of a new log
//! whose offsets began again at 0. Record by record the two look alike; the partition's high
//! watermark tells them apart. In a partition's normal life the stored offset is never above
//! the high watermark:
//!
//! - the group stores `offset + 1` only of records it read, and it reads only below the high
//!   watermark (`read_committed` stops at the last stable offset, which is not above it);
//! - `postal consumer reset` stores only offsets within the watermarks;
//! - the high watermark never goes down in the same log.
//!
//! So while `n <= high`, records below `n` are ones the group already processed: they are
//! dropped without a transaction (`postal_consumer_skipped_total{reason="below_stored_offset"}`).
//! When `n > high` ([`impossible`]) the log is not the one the offset was stored for: records
//! below `n` are new, and so may be every record of the topic's other partitions. The consumer
//! then stops the topic: a row in `postal.consumer_stops` (shared by the group's processes),
//! one ERROR line, `postal_consumer_partitions_stopped`; it applies nothing of the topic and
//! skips nothing until `postal consumer reset` moves the topic's offsets (the way on, usually
//! `--to earliest`: the dedup rows protect events applied before, within their retention).
//! The condition must hold on two reads of the watermarks a moment apart: a leader that has
//! just taken over may answer briefly with a high watermark behind the log's.
//!
//! What the rule cannot see: a re-created topic that already holds `n` or more records on
//! every partition when the group comes back. The group then resumes at `n` of the new log
//! and never reads its first `n` records. Kafka's topic ids would show it; the Rust client
//! does not expose them, so after re-creating a topic on purpose, reset its groups
//! (`postal consumer reset --to earliest`, docs/operations.md).

use sqlx::PgPool;

/// Whether the stored next offset `stored` cannot belong to a partition whose high watermark
/// is `high`: its log was replaced under the group (a topic deleted and re-created, another
/// Kafka cluster). A consumer stops such a topic; `postal consumer reset` is the way on.
pub fn impossible(stored: i64, high: i64) -> bool {
    stored > high
}

/// What was seen on the partition that stopped a topic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::FromRow)]
pub(crate) struct Stop {
    pub partition: i32,
    pub stored_offset: i64,
    pub low_watermark: i64,
    pub high_watermark: i64,
}

/// Records that `group` stopped `topic` because of what `stop` shows (the first record of a
/// partition stays).
pub(crate) async fn record(
    pool: &PgPool,
    group: &str,
    topic: &str,
    stop: Stop,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO postal.consumer_stops
            (group_id, topic, partition, stored_offset, low_watermark, high_watermark)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (group_id, topic, partition) DO NOTHING",
    )
    .bind(group)
    .bind(topic)
    .bind(stop.partition)
    .bind(stop.stored_offset)
    .bind(stop.low_watermark)
    .bind(stop.high_watermark)
    .execute(pool)
    .await?;
    Ok(())
}

/// The first stop of `topic` recorded for `group`, if the topic is stopped.
pub(crate) async fn of_topic(
    pool: &PgPool,
    group: &str,
    topic: &str,
) -> Result<Option<Stop>, sqlx::Error> {
    sqlx::query_as(
        "SELECT partition, stored_offset, low_watermark, high_watermark
         FROM postal.consumer_stops WHERE group_id = $1 AND topic = $2
         ORDER BY stopped_at, partition LIMIT 1",
    )
    .bind(group)
    .bind(topic)
    .fetch_optional(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::impossible;

    /// Guarantee: a stored offset at the high watermark (everything read) or below it is a
    /// normal position; only one above it marks a replaced log.
    #[test]
    fn only_a_stored_offset_above_the_high_watermark_is_impossible() {
        assert!(!impossible(150, 150));
        assert!(!impossible(0, 0));
        assert!(!impossible(10, 500));
        assert!(impossible(150, 0));
        assert!(impossible(150, 149));
    }
}
