//! Ownership of key partitions across relay instances.
//!
//! Every relay heartbeats its row in `postal.relay_instances`. The live relays (heartbeat within
//! the lease) split the 256 key partitions deterministically into contiguous blocks: partition
//! `p` belongs to the `p * n / 256`-th live relay in id order ([`share`]). Contiguous blocks
//! let each claim skip the other relays' rows inside the index (see [`crate::claim`]). A relay
//! takes a partition only when it is free or its lease expired, holds it with a lease it renews
//! on every heartbeat, and gives it up when the split says so — after its in-flight batches are
//! recorded. The claim statement re-checks the
//! lease, so a relay that lost its lease claims nothing from that partition.
//!
//! No partition changes hands while a claim of its previous owner on it is still open, whatever
//! that claim's backend is doing: every claim holds a shared advisory lock on each of its
//! partitions for its whole transaction, and [`heartbeat`] takes a partition over only with
//! the exclusive lock; when the lock's holders belong to a lease that expired (or was given
//! up), it terminates their backends and takes the partition at the next heartbeat (see
//! [`crate::fence`]). A relay renewing its own partitions takes no lock, so its claims never
//! hold up its heartbeats. In normal operation the fence never has to act: a claim
//! transaction can outlive its relay by at most half a lease while idle (the claim sets
//! `idle_in_transaction_session_timeout` to half the lease), and a relay claims only while
//! its lease has more than that left ([`crate::claim::lease_reserve`]). A live relay keeps a
//! claim alive (a slow broker) only within its leases (each keep-alive shortens the
//! claim's idle limit to what they have left) and gives the batch up when a quarter of the
//! lease is left without a renewal.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

/// Number of key partitions (`key_partition` = `hashtext(key) & 255`): what relays lease.
pub const KEY_PARTITIONS: i16 = 256;

/// The key partitions of the `me`-th of `n` live relays: a contiguous block, the blocks of all
/// `n` covering every partition once.
pub fn share(n: usize, me: usize) -> Vec<i16> {
    let n = n.max(1);
    (0..KEY_PARTITIONS)
        .filter(|p| *p as usize * n / KEY_PARTITIONS as usize == me)
        .collect()
}

/// The group of relays that do not name one.
pub const DEFAULT_GROUP: &str = "default";

/// Heartbeats in relay group `group`, then computes this relay's share of the partitions among
/// the group's live members and returns the partitions it now holds.
///
/// `release_ok` says whether partitions may be given up now (the caller has drained its
/// in-flight batches); if not, partitions to give away are kept and renewed until next time.
///
/// A partition that is free or expired but still locked by some claim is not taken: after its
/// transaction commits, the heartbeat terminates those claims' backends
/// (`fence::terminate_stale_holders`), and a later heartbeat takes the partition.
pub async fn heartbeat(
    pool: &PgPool,
    group: &str,
    relay: Uuid,
    host: &str,
    lease: Duration,
    held: &[i16],
    release_ok: bool,
) -> Result<Lease, sqlx::Error> {
    let lease_ms = lease.as_millis() as i64;
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    if held.is_empty() && group != DEFAULT_GROUP {
        // A group's partition rows are created by its first relay.
        sqlx::query(
            "INSERT INTO postal.relay_partitions (relay_group, key_partition)
             SELECT $1, generate_series(0, $2 - 1) ON CONFLICT DO NOTHING",
        )
        .bind(group)
        .bind(i32::from(KEY_PARTITIONS))
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query(
        "INSERT INTO postal.relay_instances (relay_id, host, relay_group, release)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (relay_id) DO UPDATE SET heartbeat_at = now()",
    )
    .bind(relay)
    .bind(host)
    .bind(group)
    .bind(env!("CARGO_PKG_VERSION"))
    .execute(&mut *tx)
    .await?;
    let live: Vec<Uuid> = sqlx::query_scalar(
        "SELECT relay_id FROM postal.relay_instances
         WHERE relay_group = $2 AND heartbeat_at > now() - $1 * interval '1 millisecond'
         ORDER BY relay_id",
    )
    .bind(lease_ms)
    .bind(group)
    .fetch_all(&mut *tx)
    .await?;
    let me = live.iter().position(|r| *r == relay).unwrap_or(0);
    let n = live.len().max(1);
    let target = share(n, me);
    let give_up: Vec<i16> = if release_ok {
        held.iter()
            .copied()
            .filter(|p| !target.contains(p))
            .collect()
    } else {
        Vec::new()
    };
    if !give_up.is_empty() {
        sqlx::query(
            "UPDATE postal.relay_partitions SET owner = NULL, lease_until = NULL
             WHERE owner = $1 AND key_partition = ANY($2)",
        )
        .bind(relay)
        .bind(&give_up)
        .execute(&mut *tx)
        .await?;
    }
    // Renew what we keep, take what is ours by the split and free (or expired).
    let wanted: Vec<i16> = target
        .iter()
        .copied()
        .chain(held.iter().copied().filter(|p| !give_up.contains(p)))
        .collect();
    // The fence ([`crate::fence`]): a partition is taken over only with the exclusive lock
    // that every claim on it holds shared, so never while a claim of its previous owner is
    // still open. `try`: a partition still claimed is not taken this round. Renewing our own
    // partitions takes no lock, so it never waits for our own claims.
    let takeover: Vec<(i16, bool)> = sqlx::query_as(concat!(
        "SELECT key_partition, pg_try_advisory_xact_lock(",
        crate::fence::fence_lock_class!("relay_group"),
        ", key_partition)
         FROM postal.relay_partitions
         WHERE relay_group = $2 AND key_partition = ANY($3)
           AND owner IS DISTINCT FROM $1 AND (owner IS NULL OR lease_until < now())
         ORDER BY key_partition"
    ))
    .bind(relay)
    .bind(group)
    .bind(&wanted)
    .fetch_all(&mut *tx)
    .await?;
    let locked: Vec<i16> = takeover.iter().filter(|t| t.1).map(|t| t.0).collect();
    let blocked: Vec<i16> = takeover.iter().filter(|t| !t.1).map(|t| t.0).collect();
    // A statement of its own: its snapshot is taken after the locks, so a partition that its
    // owner renewed meanwhile is not taken.
    let mut now_held: Vec<i16> = sqlx::query_scalar(
        "UPDATE postal.relay_partitions
         SET owner = $1, lease_until = now() + $2 * interval '1 millisecond',
             acquired_at = CASE WHEN owner IS DISTINCT FROM $1 THEN now() ELSE acquired_at END
         WHERE relay_group = $4
           AND ((owner = $1 AND key_partition = ANY($3))
                OR (key_partition = ANY($5) AND (owner IS NULL OR lease_until < now())))
         RETURNING key_partition",
    )
    .bind(relay)
    .bind(lease_ms)
    .bind(&wanted)
    .bind(group)
    .bind(&locked)
    .fetch_all(&mut *tx)
    .await?;
    // Forget relays that have been silent for a long time.
    sqlx::query(
        "DELETE FROM postal.relay_instances WHERE heartbeat_at < now() - $1 * interval '1 millisecond'",
    )
    .bind(lease_ms * 20)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    if !blocked.is_empty() {
        // Outside the heartbeat's transaction: a missing right to signal must not undo the
        // heartbeat, and the terminated claims' rows are back before the next round takes the
        // partitions. A failure here only delays the takeover.
        match crate::fence::terminate_stale_holders(pool, group, relay, &blocked).await {
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, partitions = ?blocked, "cannot look for the claims that keep key partitions from this relay; retrying at the next heartbeat")
            }
        }
    }
    now_held.sort_unstable();
    let pending_release = held.iter().any(|p| !target.contains(p)) && !release_ok;
    Ok(Lease {
        held: now_held,
        live: live.len(),
        wants_release: pending_release,
    })
}

/// Gives up every partition this relay holds (graceful shutdown) and removes its heartbeat.
pub async fn leave(pool: &PgPool, relay: Uuid) -> Result<(), sqlx::Error> {
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    sqlx::query(
        "UPDATE postal.relay_partitions SET owner = NULL, lease_until = NULL WHERE owner = $1",
    )
    .bind(relay)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM postal.relay_instances WHERE relay_id = $1")
        .bind(relay)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// Result of a heartbeat.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lease {
    /// Partitions held now, sorted.
    pub held: Vec<i16>,
    /// Live relays seen.
    pub live: usize,
    /// Some held partitions belong to another relay by the split and wait to be given up.
    pub wants_release: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_contiguous_balanced_and_cover_every_partition_once() {
        for n in 1..=9 {
            let mut all = Vec::new();
            for me in 0..n {
                let s = share(n, me);
                assert!(
                    s.windows(2).all(|w| w[1] == w[0] + 1),
                    "n={n} me={me}: {s:?}"
                );
                let size = s.len();
                assert!(
                    size == 256 / n || size == 256 / n + 1,
                    "n={n} me={me}: {size} partitions"
                );
                all.extend(s);
            }
            assert_eq!(all, (0..KEY_PARTITIONS).collect::<Vec<_>>(), "n={n}");
        }
    }
}
