//! Lease coordination: the heartbeat that renews this relay's key partition leases, keeps the
//! owned set and the lanes' split of it up to date and gives partitions away when relays join,
//! and what the rest of the relay reads from the leases as last renewed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::share::lanes_per_relay;
use super::Shared;
use crate::claim;
use crate::lease;
use crate::transport::Transport;

impl<T: Transport> Shared<T> {
    /// When a batch still in flight is given up unless a heartbeat renewed the leases
    /// meanwhile: a quarter of the lease before they run out, so that its work (a task
    /// handler) has stopped before another relay may take its keys over. A healthy relay
    /// renews every quarter of the lease and is never this close.
    pub(super) fn give_up_at(&self) -> tokio::time::Instant {
        self.lease_until() - self.config.lease / 4
    }

    /// Until when this relay's partition leases hold at least, as last renewed (a full lease
    /// from now before the first heartbeat, when nothing can be claimed yet).
    fn lease_until(&self) -> tokio::time::Instant {
        let until = *self.lease_until.lock().expect("lease lock");
        until.unwrap_or_else(|| tokio::time::Instant::now() + self.config.lease)
    }

    /// Whether the leases, as this relay last renewed them, have enough left for a claim
    /// ([`claim::lease_reserve`]; the claim checks the same with the database's clock). A
    /// relay whose heartbeats fail stops claiming here instead of claiming batches that it
    /// would give up at once.
    pub(super) fn may_claim(&self) -> bool {
        tokio::time::Instant::now() + claim::lease_reserve(self.config.lease) < self.lease_until()
    }

    /// Notes the leases that a heartbeat started at `beat` renewed.
    fn renewed(&self, beat: tokio::time::Instant, result: &Result<lease::Lease, sqlx::Error>) {
        if result.is_ok() {
            *self.lease_until.lock().expect("lease lock") = Some(beat + self.config.lease);
        }
    }

    /// Heartbeats every quarter of the lease, keeps `owned` up to date and gives partitions
    /// away (after draining in-flight batches) when relays join.
    ///
    /// Heartbeats start every `lease / 4`, counted from the start of the one before, and the
    /// waits for in-flight batches within a round end when the next round is due, so a healthy
    /// relay starts a heartbeat at least every `lease / 4` plus one heartbeat's duration. It
    /// thus keeps more than [`claim::lease_reserve`] (55 %) of the lease for its claims while a
    /// heartbeat takes less than a fifth of the lease (12 s by default), and
    /// gives up batches in flight (at a quarter left, [`Shared::give_up_at`]) only when its
    /// heartbeats fail or stall for half a lease.
    ///
    /// Returns once `stop` is cancelled, between heartbeats (never in the middle of one).
    pub(super) async fn coordinate(
        self: Arc<Self>,
        changed: tokio::sync::watch::Sender<u64>,
        stop: CancellationToken,
    ) {
        let every = self.config.lease / 4;
        let host = std::env::var("HOSTNAME").unwrap_or_default();
        let mut failures = 0u32;
        // From the first attempt of a heartbeat until one succeeds (the stall watchdog's
        // clock: failed attempts and their back-off count; claims need the leases).
        let mut beating: Option<super::stall::Waiting> = None;
        loop {
            if stop.is_cancelled() {
                return;
            }
            let round = tokio::time::Instant::now();
            let held = self.owned.read().expect("owned lock").clone();
            // In-flight slots held across a change of `owned` (see below).
            let mut drained = None;
            beating.get_or_insert_with(|| self.claim_clock.start("the lease heartbeat"));
            let mut result = lease::heartbeat(
                &self.pool,
                &self.config.group,
                self.id,
                &host,
                self.config.lease,
                &held,
                false,
            )
            .await;
            self.renewed(round, &result);
            if result.is_ok() {
                beating = None;
            }
            if let Ok(l) = &result {
                if l.wants_release {
                    // Record everything in flight before giving partitions away, so the next
                    // owner cannot overtake an event of ours.
                    if let Some(permits) = self.all_slots(round + every, &stop).await {
                        let beat = tokio::time::Instant::now();
                        let waiting = self.claim_clock.start("the lease heartbeat");
                        result = lease::heartbeat(
                            &self.pool,
                            &self.config.group,
                            self.id,
                            &host,
                            self.config.lease,
                            &l.held,
                            true,
                        )
                        .await;
                        drop(waiting);
                        self.renewed(beat, &result);
                        drained = Some(permits);
                    }
                }
            }
            match result {
                Ok(l) => {
                    if failures > 0 {
                        tracing::info!("partition leases renewed again");
                    }
                    failures = 0;
                    let current = self.owned.read().expect("owned lock").clone();
                    let active = lanes_per_relay(self.config.lanes, l.live);
                    if current != l.held || active != self.active_lanes.load(Ordering::Relaxed) {
                        // The lanes' split of the partitions changes with the owned set: change
                        // it only while nothing is claimed or in flight, so that a partition
                        // moving to another lane cannot have its events in two lanes at once.
                        // Lanes read their share only once they hold a slot.
                        if drained.is_none() {
                            drained = self.all_slots(round + every, &stop).await;
                        }
                        if drained.is_some() {
                            tracing::info!(relay = %self.id, partitions = l.held.len(), live_relays = l.live, lanes = active, "key partitions rebalanced");
                            *self.owned.write().expect("owned lock") = l.held.clone();
                            self.active_lanes.store(active, Ordering::Relaxed);
                            changed.send_modify(|n| *n = n.wrapping_add(1));
                        } else {
                            // Batches still in flight after a quarter of the lease: keep the
                            // old split (claims re-check the lease, so partitions that were
                            // lost are not claimed) and try again at the next heartbeat.
                            tracing::warn!(relay = %self.id, "key partitions changed but batches are still in flight; rebalancing lanes at the next heartbeat");
                        }
                    }
                    metrics::gauge!("postal_relay_partitions_owned", "group" => self.config.group.clone())
                        .set(self.owned.read().expect("owned lock").len() as f64);
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, "cannot renew partition leases (database unreachable?); retrying");
                    // Once the leases as last renewed have run out, this relay owns nothing
                    // (another relay may hold them now): the gauge says so.
                    if self.lease_until() <= tokio::time::Instant::now() {
                        metrics::gauge!("postal_relay_partitions_owned", "group" => self.config.group.clone())
                            .set(0.0);
                    }
                }
            }
            // Lanes claim again while this waits (also after a failed release heartbeat, which
            // gave nothing away).
            drop(drained);
            let next = if failures > 0 {
                let wait = self.config.backoff.delay(failures).min(every);
                tokio::time::Instant::now() + wait.max(Duration::from_millis(50))
            } else {
                round + every
            };
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                () = stop.cancelled() => return,
            }
        }
    }

    /// Every in-flight slot (nothing can be claimed or in flight while they are held), or
    /// `None` once `until` passed or `stop` came first.
    async fn all_slots(
        &self,
        until: tokio::time::Instant,
        stop: &CancellationToken,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let all = self.config.max_in_flight_batches as u32;
        tokio::select! {
            r = tokio::time::timeout_at(until, self.slots.clone().acquire_many_owned(all)) => r.ok().and_then(Result::ok),
            () = stop.cancelled() => None,
        }
    }
}
