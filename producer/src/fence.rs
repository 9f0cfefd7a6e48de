//! The fence between a claim and the next owner of its key partitions.
//!
//! A lease alone cannot fence a claim: the claim is an open transaction holding its rows
//! `FOR UPDATE SKIP LOCKED` (deleted, uncommitted, in delete-on-claim mode), and PostgreSQL ends
//! it by `idle_in_transaction_session_timeout` only while it is idle. A backend that is
//! *active* — blocked writing a large result to a frozen (SIGSTOP) or partitioned client, or
//! waiting on a relation lock (a migration's `CREATE INDEX`) — lives on past the lease, and
//! the next owner's `SKIP LOCKED` claim would step over its rows and publish the key's later
//! events first. So the claim is tied to its partitions in the database, for the claim
//! transaction's whole life:
//!
//! 1. A claim first takes a transaction-scoped *shared* advisory lock on each key partition it
//!    wants (`pg_try_advisory_xact_lock_shared(hashtext('postal.relay:' || group), partition)`,
//!    [`LOCK_CLASS`]), and only then, in a later statement (a fresh READ COMMITTED snapshot,
//!    taken after the locks), checks the leases; it keeps the partitions both locked and leased
//!    ([`crate::claim::claim`]). Claims never wait for these locks (`try`), and shared locks do
//!    not conflict with each other: a relay's claims never hold each other up.
//! 2. Taking a partition over — the heartbeat's update of a partition whose owner is not this
//!    relay (free, or its lease expired) — first takes the *exclusive* lock on it in the
//!    heartbeat's transaction ([`crate::lease::heartbeat`]). A partition whose lock some claim
//!    holds is not taken this round. So no relay owns a partition while a claim of a previous
//!    owner on it is still open, whatever that claim's backend is doing; and a claim that locked
//!    a partition after a takeover committed sees the new owner and leaves it. Renewing a
//!    relay's own partitions takes no lock, so it never waits for its own claims.
//! 3. When such a holder's partition is free or its lease expired, the heartbeat terminates
//!    the holding backends ([`terminate_stale_holders`], outside its transaction):
//!    `pg_terminate_backend` ends a backend blocked writing to its client or waiting on a lock,
//!    which a statement timeout or a cancel would not. Their transactions roll back, the rows
//!    are back, and the next heartbeat takes the partition. This needs the right to signal
//!    those backends: every relay of a group connects as the same role, or as a member of
//!    `pg_signal_backend` (superuser backends only a superuser may end). Without it the
//!    partition stays with the old claim until its backend ends by itself (one WARN per
//!    attempt names the partition and the process): order still holds, only progress waits.
//! 4. Completion re-checks, in the claim's transaction, that the relay still owns the claim's
//!    partitions before it commits ([`crate::claim::Claim::complete`]); a claim that fails the
//!    check rolls back (its rows are published again: duplicates, never loss). With steps 1–2
//!    this cannot fail; it fences claims against a takeover that bypassed the lock (a relay of
//!    an older version during a rolling upgrade, an operator's manual `UPDATE`).
//! 5. The relay hands a claimed batch to its transport only before the claim's send deadline
//!    by its own monotonic clock ([`crate::claim::Claim::send_deadline_passed`]), so a process
//!    frozen between claim and hand-over does not publish once its leases may have moved.
//!
//! The claim also sets `tcp_user_timeout` on its session for its transaction (half the lease),
//! so that the kernel drops the connection of a backend whose client stopped acknowledging
//! data (Linux ≥ 5.11 also while the client's window stays closed, e.g. a frozen process),
//! even where step 3 lacks the right to terminate it.

use sqlx::PgPool;
use uuid::Uuid;

/// SQL for the first key of a relay group's partition locks; `$g` is the SQL expression
/// (a parameter or a column) holding the group. The second key is the partition (so `pg_locks`
/// shows the group's hash as `classid`, the partition as `objid`, and `objsubid = 2`).
macro_rules! fence_lock_class {
    ($g:literal) => {
        concat!("hashtext('postal.relay:' || ", $g, ")")
    };
}
pub(crate) use fence_lock_class;

/// How a relay group's partition lock is keyed: `(hashtext('postal.relay:' || group),
/// key_partition)`, the two-key form of PostgreSQL's advisory locks (the SQL inlines it; the
/// tests check a held lock against it).
#[cfg_attr(not(test), allow(dead_code))]
pub const LOCK_CLASS: &str = fence_lock_class!("group");

/// Backends other than this session's that hold the lock of a partition in `partitions` (of
/// `group`) while that partition is free or its lease has expired, and not owned by `me`: the
/// claims of a relay that lost or gave up the partition. As `(partition, pid)`.
pub async fn stale_holders(
    pool: &PgPool,
    group: &str,
    me: Uuid,
    partitions: &[i16],
) -> Result<Vec<(i16, i32)>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT rp.key_partition, l.pid
         FROM pg_locks l
         JOIN postal.relay_partitions rp
           ON rp.relay_group = $1 AND l.objid = rp.key_partition::int4::oid
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.classid = ",
        fence_lock_class!("$1"),
        "::oid
           AND l.pid <> pg_backend_pid()
           AND rp.key_partition = ANY($3)
           AND rp.owner IS DISTINCT FROM $2
           AND (rp.owner IS NULL OR rp.lease_until < now())
         ORDER BY rp.key_partition, l.pid"
    ))
    .bind(group)
    .bind(me)
    .bind(partitions)
    .fetch_all(pool)
    .await
}

/// Terminates the backends of claims that keep this relay from taking over `partitions`
/// (see [`stale_holders`]). Each termination re-checks, in its own statement, that the backend
/// still holds the lock of a partition that is free or expired, so a backend that meanwhile
/// belongs to a live owner again is left alone. A missing right to signal the backend is a
/// one-line WARN naming the partition and the process, and the next holder is tried.
/// Returns how many backends were terminated.
pub async fn terminate_stale_holders(
    pool: &PgPool,
    group: &str,
    me: Uuid,
    partitions: &[i16],
) -> Result<usize, sqlx::Error> {
    if partitions.is_empty() {
        return Ok(0);
    }
    let holders = stale_holders(pool, group, me, partitions).await?;
    let mut terminated = 0;
    let mut done: Vec<i32> = Vec::new();
    for (partition, pid) in holders {
        // A backend holding several partitions is terminated once.
        if done.contains(&pid) {
            continue;
        }
        done.push(pid);
        let ended: Result<Option<bool>, sqlx::Error> = sqlx::query_scalar(concat!(
            "SELECT pg_terminate_backend(l.pid)
             FROM pg_locks l
             JOIN postal.relay_partitions rp
               ON rp.relay_group = $1 AND l.objid = rp.key_partition::int4::oid
             WHERE l.pid = $4 AND rp.key_partition = $3
               AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND l.classid = ",
            fence_lock_class!("$1"),
            "::oid
               AND rp.owner IS DISTINCT FROM $2
               AND (rp.owner IS NULL OR rp.lease_until < now())
             LIMIT 1"
        ))
        .bind(group)
        .bind(me)
        .bind(partition)
        .bind(pid)
        .fetch_optional(pool)
        .await
        .map(Option::flatten);
        match ended {
            Ok(Some(true)) => {
                terminated += 1;
                tracing::warn!(relay = %me, group, partition, pid, "terminated the backend of a claim that outlived its partition lease (its rows are handed out again)");
            }
            // Gone meanwhile, or no longer a stale holder.
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(relay = %me, group, partition, pid, error = %e, "cannot terminate the backend of a claim that outlived its partition lease; the partition waits until it ends (relays of a group need the same role or pg_signal_backend)");
            }
        }
    }
    Ok(terminated)
}

#[cfg(test)]
mod tests {
    /// The claim, the takeover and the termination must key the lock the same way.
    #[test]
    fn every_statement_keys_the_lock_the_same_way() {
        assert_eq!(
            super::LOCK_CLASS,
            "hashtext('postal.relay:' || group)",
            "documented key"
        );
        assert_eq!(fence_lock_class!("$1"), "hashtext('postal.relay:' || $1)");
    }
}
