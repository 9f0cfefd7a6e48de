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

/// What [`advance`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advance {
    /// The offset moved: the caller may commit.
    Advanced,
    /// The epoch moved on (another consumer owns the partition now): the caller must roll back.
    Fenced,
    /// The group, or this topic of it, is paused (`postal.pauses`): the caller must roll back.
    Paused,
}

/// Sets the next offset in the caller's transaction, unless the epoch moved on or the group
/// (or the topic) is paused.
///
/// The pause is read here, in the statement every processing transaction runs last before it
/// commits, with a snapshot taken after the transaction's `BEGIN` took the shared pause locks
/// ([`crate::partition`]'s `begin_for`, [`postal_shared::pause`]): a pause that committed
/// before then is seen, and one that commits later waited for this transaction to end.
pub async fn advance(
    conn: &mut PgConnection,
    group: &str,
    topic: &str,
    partition: i32,
    epoch: i64,
    next_offset: i64,
) -> Result<Advance, sqlx::Error> {
    set_next(conn, group, topic, partition, epoch, Some(next_offset)).await
}

/// As [`advance`], leaving the stored offset where it is: for the transactions that apply a
/// released held record (its offset is behind the stored one already), fenced and paused as
/// every other processing transaction.
pub(crate) async fn confirm(
    conn: &mut PgConnection,
    group: &str,
    topic: &str,
    partition: i32,
    epoch: i64,
) -> Result<Advance, sqlx::Error> {
    set_next(conn, group, topic, partition, epoch, None).await
}

async fn set_next(
    conn: &mut PgConnection,
    group: &str,
    topic: &str,
    partition: i32,
    epoch: i64,
    next_offset: Option<i64>,
) -> Result<Advance, sqlx::Error> {
    let (advanced, paused): (bool, bool) = sqlx::query_as(
        "WITH p AS (SELECT EXISTS (SELECT 1 FROM postal.pauses
                                   WHERE side = 'consumer' AND group_name = $1
                                     AND (topic IS NULL OR topic = $2)) AS paused),
              u AS (UPDATE postal.consumer_offsets
                    SET next_offset = coalesce($5, next_offset), updated_at = now()
                    WHERE group_id = $1 AND topic = $2 AND partition = $3 AND epoch = $4
                      AND NOT (SELECT paused FROM p)
                    RETURNING 1)
         SELECT EXISTS (SELECT 1 FROM u), (SELECT paused FROM p)",
    )
    .bind(group)
    .bind(topic)
    .bind(partition)
    .bind(epoch)
    .bind(next_offset)
    .fetch_one(conn)
    .await?;
    Ok(match (advanced, paused) {
        (true, _) => Advance::Advanced,
        (false, true) => Advance::Paused,
        (false, false) => Advance::Fenced,
    })
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
