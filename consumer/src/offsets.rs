//! Offsets stored beside the effects, and the epoch that fences a partition's previous owner.
//!
//! A consumer assigned a partition calls [`claim`]: it bumps the partition's epoch and reads
//! the stored next offset (waiting, through the row lock, for a previous owner's transaction
//! that is committing right now). Every processing transaction then calls [`advance`] before
//! committing; it matches only while the epoch is still the one read at assignment, so a
//! transaction of an owner that has lost the partition cannot commit.

use sqlx::{PgConnection, PgPool};

/// What a consumer learns when it takes a partition over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ownership {
    /// The fencing epoch of this ownership.
    pub epoch: i64,
    /// The next offset to process, if the group ever committed one for this partition.
    pub next_offset: Option<i64>,
}

/// Takes `(group, topic, partition)` over for `owner`, fencing any previous owner.
pub async fn claim(
    pool: &PgPool,
    group: &str,
    topic: &str,
    partition: i32,
    owner: &str,
) -> Result<Ownership, sqlx::Error> {
    let (next_offset, epoch): (Option<i64>, i64) = sqlx::query_as(
        "INSERT INTO postal.consumer_offsets (group_id, topic, partition, owner)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (group_id, topic, partition) DO UPDATE
            SET epoch = postal.consumer_offsets.epoch + 1, owner = EXCLUDED.owner,
                updated_at = now()
         RETURNING next_offset, epoch",
    )
    .bind(group)
    .bind(topic)
    .bind(partition)
    .bind(owner)
    .fetch_one(pool)
    .await?;
    Ok(Ownership { epoch, next_offset })
}

/// Sets the next offset in the caller's transaction. Returns `false` when the epoch moved on
/// (another consumer owns the partition now): the caller must roll back.
pub async fn advance(
    conn: &mut PgConnection,
    group: &str,
    topic: &str,
    partition: i32,
    epoch: i64,
    next_offset: i64,
) -> Result<bool, sqlx::Error> {
    let n = sqlx::query(
        "UPDATE postal.consumer_offsets SET next_offset = $5, updated_at = now()
         WHERE group_id = $1 AND topic = $2 AND partition = $3 AND epoch = $4",
    )
    .bind(group)
    .bind(topic)
    .bind(partition)
    .bind(epoch)
    .bind(next_offset)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// The stored next offsets of a group on a topic, by partition.
#[cfg_attr(not(feature = "test-util"), allow(dead_code))] // the tests' (`testing`)
pub async fn stored(
    pool: &PgPool,
    group: &str,
    topic: &str,
) -> Result<Vec<(i32, Option<i64>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT partition, next_offset FROM postal.consumer_offsets
         WHERE group_id = $1 AND topic = $2 ORDER BY partition",
    )
    .bind(group)
    .bind(topic)
    .fetch_all(pool)
    .await
}
