//! One WAL relay per slot: the slot's lease (`postal.wal_slot_leases`, migration 0034).
//!
//! A relay streams from its slot only while it holds the slot's lease. It takes a free or
//! expired lease by raising the row's `token` (the fencing token), then ends whatever
//! walsender still streams from the slot (`pg_terminate_backend` on
//! `pg_replication_slots.active_pid`: the previous holder's, frozen or cut off), and renews
//! the lease every quarter of it while it runs. A standby polls the row and takes over once the
//! lease has expired: within the lease of the holder's last renewal.
//!
//! Three fences keep a holder that lost the lease (frozen by SIGSTOP, cut off from the
//! database, slow) from acting on it:
//! - its walsender is terminated by the new holder before that one streams;
//! - the marking transaction locks the lease row `FOR SHARE` and commits only while the token
//!   is still its own ([`check`]), so a takeover either waits for its commit or is seen by it
//!   and refuses it: nothing is marked, and so nothing confirmed, after the lease moved;
//! - a batch goes to the transport only while the lease, by the relay's own monotonic clock
//!   since its last renewal, has more than half of it left ([`Held::may_send`]).
//!
//! What a woken holder may still publish: records already handed to the transport before it
//! froze (in the producer's queue). They carry their `ce_id` and are published again by the
//! new holder (their rows were not marked), before or after; for a key, such a late copy can
//! land after the key's later events, as a duplicate that consumers drop by event id
//! (docs/wal-relay.md "One reader per slot").

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The slot's lease, held by this relay: renewed by a background task until dropped.
pub(crate) struct Held {
    pub(crate) slot: String,
    pub(crate) holder: Uuid,
    pub(crate) token: i64,
    lease: Duration,
    /// The end of the lease by this process's monotonic clock: the start of the last
    /// successful renewal (or of the take) plus the lease.
    until: Arc<Mutex<Instant>>,
    lost: CancellationToken,
    renew: tokio::task::JoinHandle<()>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.renew.abort();
    }
}

impl Held {
    /// A lease taken (`token`, valid by this process's clock until `until`) that no task
    /// renews: for a relay played by hand.
    #[cfg(feature = "test-util")]
    pub(super) fn unrenewed(
        slot: &str,
        holder: Uuid,
        token: i64,
        lease: Duration,
        until: Instant,
    ) -> Held {
        Held {
            slot: slot.to_owned(),
            holder,
            token,
            lease,
            until: Arc::new(Mutex::new(until)),
            lost: CancellationToken::new(),
            renew: tokio::spawn(async {}),
        }
    }

    /// Resolves once the lease is lost: another relay took it, or it ran out without a
    /// renewal.
    pub(crate) async fn lost(&self) {
        self.lost.cancelled().await
    }

    /// Whether the lease is known lost.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Records that the lease is lost (a mark was refused).
    pub(crate) fn set_lost(&self) {
        self.lost.cancel();
    }

    /// Whether a batch may still be handed to the transport: more than half the lease left.
    pub(crate) fn may_send(&self) -> bool {
        !self.lost.is_cancelled()
            && *self.until.lock().expect("lease clock") > Instant::now() + self.lease / 2
    }

    /// Ends the walsender still streaming from the slot (a previous holder's) and waits, up to
    /// half the lease, until the slot is free. A failure only delays streaming (logged).
    pub(crate) async fn end_walsender(&self, pool: &PgPool) {
        if let Err(e) = end_walsender(pool, &self.slot, self.lease / 2).await {
            tracing::warn!(error = %e, slot = %self.slot, "WAL relay: could not end the slot's previous walsender; streaming waits until it ends");
        }
    }

    /// Gives the lease up (a graceful stop): a standby takes the slot at once.
    pub(crate) async fn release(self, pool: &PgPool) {
        let r = sqlx::query(
            "UPDATE postal.wal_slot_leases SET holder = NULL, lease_until = NULL
             WHERE slot_name = $1 AND token = $2",
        )
        .bind(&self.slot)
        .bind(self.token)
        .execute(pool)
        .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, slot = %self.slot, "WAL relay: could not give up the slot's lease; it expires by itself");
        }
    }
}

/// Takes the slot's lease if it is free or expired. `None` when another relay holds it.
pub(super) async fn take(
    pool: &PgPool,
    slot: &str,
    holder: Uuid,
    host: &str,
    lease: Duration,
) -> Result<Option<(i64, Instant)>, sqlx::Error> {
    let started = Instant::now();
    sqlx::query(
        "INSERT INTO postal.wal_slot_leases (slot_name) VALUES ($1) ON CONFLICT DO NOTHING",
    )
    .bind(slot)
    .execute(pool)
    .await?;
    let token: Option<i64> = sqlx::query_scalar(
        "UPDATE postal.wal_slot_leases
         SET holder = $2, host = $3, token = token + 1,
             lease_until = now() + $4 * interval '1 millisecond', acquired_at = now()
         WHERE slot_name = $1 AND (holder IS NULL OR lease_until < now())
         RETURNING token",
    )
    .bind(slot)
    .bind(holder)
    .bind(host)
    .bind(lease.as_millis() as i64)
    .fetch_optional(pool)
    .await?;
    Ok(token.map(|t| (t, started + lease)))
}

/// Ends the walsender still streaming from `slot` (a previous holder's) and waits, up to
/// `within`, until the slot is free. Only a walsender: a slot is also active while an
/// operator's session creates it (`pg_create_logical_replication_slot`), and that session is
/// waited for, not ended.
async fn end_walsender(pool: &PgPool, slot: &str, within: Duration) -> Result<(), sqlx::Error> {
    let ended: Vec<(i32, bool)> = sqlx::query_as(
        "SELECT s.active_pid, pg_terminate_backend(s.active_pid) FROM pg_replication_slots s
         JOIN pg_stat_activity a ON a.pid = s.active_pid AND a.backend_type = 'walsender'
         WHERE s.slot_name = $1 AND s.database = current_database()",
    )
    .bind(slot)
    .fetch_all(pool)
    .await?;
    for (pid, done) in &ended {
        tracing::info!(
            pid,
            terminated = done,
            slot,
            "WAL relay: ended the previous holder's walsender"
        );
    }
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let active: Option<bool> = sqlx::query_scalar(
            "SELECT active FROM pg_replication_slots
                 WHERE slot_name = $1 AND database = current_database()",
        )
        .bind(slot)
        .fetch_optional(pool)
        .await?;
        if active != Some(true) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Waits until this relay holds the slot's lease (standing by while another relay holds it),
/// then ends the previous holder's walsender. `None` if `shutdown` came first.
pub(crate) async fn acquire(
    pool: &PgPool,
    slot: &str,
    holder: Uuid,
    lease: Duration,
    shutdown: &mut std::pin::Pin<&mut (impl std::future::Future<Output = ()> + Send)>,
) -> Option<Held> {
    let host = std::env::var("HOSTNAME").unwrap_or_default();
    let poll = (lease / 8).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut standing_by = false;
    loop {
        match take(pool, slot, holder, &host, lease).await {
            Ok(Some((token, until))) => {
                tracing::info!(slot, token, %holder, "WAL relay: holding the slot's lease");
                // Renewed from now on, also while the previous walsender is being ended.
                let until = Arc::new(Mutex::new(until));
                let lost = CancellationToken::new();
                let renew = tokio::spawn(renew(
                    pool.clone(),
                    slot.to_owned(),
                    holder,
                    token,
                    lease,
                    until.clone(),
                    lost.clone(),
                ));
                let held = Held {
                    slot: slot.to_owned(),
                    holder,
                    token,
                    lease,
                    until,
                    lost,
                    renew,
                };
                held.end_walsender(pool).await;
                return Some(held);
            }
            Ok(None) => {
                if !standing_by {
                    standing_by = true;
                    tracing::info!(
                        slot,
                        "WAL relay: standing by: another relay holds the slot's lease"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, slot, "WAL relay: could not read the slot's lease; retrying")
            }
        }
        tokio::select! {
            () = shutdown.as_mut() => return None,
            () = tokio::time::sleep(poll) => {}
        }
    }
}

/// Renews the lease every quarter of it; cancels `lost` when the token moved on or the lease
/// ran out (by the monotonic clock) without a renewal.
async fn renew(
    pool: PgPool,
    slot: String,
    holder: Uuid,
    token: i64,
    lease: Duration,
    until: Arc<Mutex<Instant>>,
    lost: CancellationToken,
) {
    loop {
        let expires = *until.lock().expect("lease clock");
        let next = (Instant::now() + lease / 4).min(expires);
        tokio::time::sleep_until(next).await;
        let started = Instant::now();
        if started >= *until.lock().expect("lease clock") {
            tracing::warn!(
                slot,
                token,
                "WAL relay: the slot's lease ran out without a renewal"
            );
            lost.cancel();
            return;
        }
        let r = sqlx::query(
            "UPDATE postal.wal_slot_leases
             SET lease_until = now() + $4 * interval '1 millisecond'
             WHERE slot_name = $1 AND holder = $2 AND token = $3",
        )
        .bind(&slot)
        .bind(holder)
        .bind(token)
        .bind(lease.as_millis() as i64)
        .execute(&pool);
        let expires = *until.lock().expect("lease clock");
        match tokio::time::timeout_at(expires, r).await {
            Ok(Ok(done)) if done.rows_affected() == 1 => {
                *until.lock().expect("lease clock") = started + lease;
            }
            Ok(Ok(_)) => {
                tracing::warn!(
                    slot,
                    token,
                    "WAL relay: the slot's lease was taken by another relay"
                );
                lost.cancel();
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, slot, "WAL relay: could not renew the slot's lease; retrying")
            }
            Err(_) => {}
        }
    }
}

/// In the marking transaction, before it commits: locks the lease row (`FOR SHARE`, so a
/// takeover waits for this commit) and checks that the token is still `held`'s. `false`:
/// another relay took the slot; the transaction must not commit.
pub(crate) async fn check(
    tx: &mut Transaction<'static, Postgres>,
    slot: &str,
    holder: Uuid,
    token: i64,
) -> Result<bool, sqlx::Error> {
    let ours: Option<i64> = sqlx::query_scalar(
        "SELECT token FROM postal.wal_slot_leases
         WHERE slot_name = $1 AND holder = $2 AND token = $3 FOR SHARE",
    )
    .bind(slot)
    .bind(holder)
    .bind(token)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(ours.is_some())
}
