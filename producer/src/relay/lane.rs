//! A claim loop (lane): takes its slots, claims from its share of the owned key partitions and
//! checks the claim out ([`Shared::check_out`]) or hands it over ([`Shared::hand_over`]).

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::check_out::CheckOutPermits;
use super::hand_over::{Claimed, HandOver};
use super::share::lane_share;
use super::Shared;
use crate::claim;
use crate::transport::Transport;

/// What a lane holds before it claims, taken in this order.
struct Slots {
    /// The most events to claim.
    limit: usize,
    /// Checking out: a permit per event it may claim.
    events: Option<OwnedSemaphorePermit>,
    /// No backlog: the lane claims for all of the relay's partitions, holding every slot.
    light: bool,
    /// The lane's own slot.
    own: OwnedSemaphorePermit,
    /// The relay's slot (all of them when `light`).
    permit: OwnedSemaphorePermit,
}

impl<T: Transport> Shared<T> {
    /// One claim loop over its share ([`lane_share`]) of the owned key partitions.
    /// Returns its outstanding completions on shutdown.
    pub(super) async fn lane(
        self: Arc<Self>,
        lane: usize,
        lanes: usize,
        mut wake: tokio::sync::watch::Receiver<u64>,
        mut owned_changed: tokio::sync::watch::Receiver<u64>,
    ) -> tokio::task::JoinSet<()> {
        let mut completions = tokio::task::JoinSet::new();
        // This lane's own share of the in-flight batches. A lane's next claim walks past the
        // rows of its own batches still in flight (they stay in the index, locked, until their
        // commit); with several lanes each holding few batches, the relay keeps as many
        // batches in flight while each claim steps over fewer of them. With checked-out rows
        // (the task runner) a lane uses every slot: a long task holds back only its own key.
        let per_lane = if self.chained {
            self.config.max_in_flight_batches.max(1)
        } else {
            self.config.max_in_flight_batches.div_ceil(lanes).max(1)
        };
        let own_slots = Arc::new(Semaphore::new(per_lane));
        let mut db_failures: u32 = 0;
        // The claim this lane is trying to make, from its first attempt until one returns
        // (the stall watchdog's clock: failed attempts and their back-off count).
        let mut claiming: Option<super::stall::Waiting> = None;
        loop {
            if self.wait_out_pause().await.is_break() {
                break;
            }
            let Some(Slots {
                limit,
                events,
                light,
                own,
                permit,
            }) = self.take_slots(&own_slots).await
            else {
                break;
            };
            let partitions = self.partitions(lane, light);
            if partitions.is_empty() || !self.may_claim() {
                if partitions.is_empty() {
                    // Nothing of this lane's to claim (not a wait for the database; leases
                    // run out unrenewed are: the heartbeat's wait shows those).
                    claiming = None;
                }
                drop(permit);
                if self
                    .wait_for_partitions(&mut owned_changed)
                    .await
                    .is_break()
                {
                    break;
                }
                continue;
            }
            // The claim is not raced against shutdown: it is short and bounded, and its
            // transaction is then either completed or rolled back.
            // Held until the batch is handed over (see `record_gate`).
            let gate = self.record_gate.read().await;
            let claim_started = Instant::now();
            claiming.get_or_insert_with(|| self.claim_clock.start("a claim"));
            let claimed = self.claim(&partitions, limit).await;
            if claimed.is_ok() {
                claiming = None;
            }
            let mut claim = match claimed {
                Ok(Some(c)) => {
                    if db_failures > 0 {
                        tracing::info!("database reachable again; relay resumes");
                    }
                    db_failures = 0;
                    c
                }
                Ok(None) => {
                    db_failures = 0;
                    self.backlogged.store(false, Ordering::Relaxed);
                    drop(gate);
                    drop(permit);
                    if self
                        .wait_for_events(&mut wake, &mut owned_changed)
                        .await
                        .is_break()
                    {
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    drop(gate);
                    drop(permit);
                    let wait = self.config.backoff.delay(db_failures);
                    db_failures = db_failures.saturating_add(1);
                    tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "claim failed (database unreachable?); retrying");
                    if self.back_off(wait).await.is_break() {
                        break;
                    }
                    continue;
                }
            };
            if self.config.history.is_some() {
                claim.keep_history();
            }
            let batch = claim.take_events();
            let full = batch.len() == limit;
            self.backlogged.store(full, Ordering::Relaxed);
            if let Some(events_permit) = events {
                if self
                    .check_out(
                        claim,
                        batch,
                        claim_started,
                        gate,
                        CheckOutPermits {
                            slots: [permit, own],
                            events: events_permit,
                        },
                    )
                    .await
                {
                    db_failures = 0;
                } else {
                    // As after a failed claim: back off.
                    let wait = self.config.backoff.delay(db_failures);
                    db_failures = db_failures.saturating_add(1);
                    if self.back_off(wait).await.is_break() {
                        break;
                    }
                }
                continue;
            }
            let claimed = Claimed {
                own,
                permit,
                gate,
                claim_started,
                claim,
                batch,
                light,
            };
            match self.hand_over(&mut completions, claimed).await {
                HandOver::InFlight => {}
                HandOver::GivenBack => continue,
                HandOver::Abandoned => break,
            }
            if !full {
                // The backlog is drained for now: let acknowledgements get recorded.
                tokio::task::yield_now().await;
            }
        }
        completions
    }

    /// Backs off while the destination is unavailable.
    async fn wait_out_pause(&self) -> ControlFlow<()> {
        let pause = *self.paused_until.lock().expect("pause lock");
        if let Some(until) = pause {
            let now = Instant::now();
            if until > now {
                tokio::select! {
                    _ = self.stop.cancelled() => return ControlFlow::Break(()),
                    _ = tokio::time::sleep(until - now) => {}
                }
            }
        }
        ControlFlow::Continue(())
    }

    /// Takes what the lane holds while it claims and hands a batch over; `None` once the relay
    /// stops.
    async fn take_slots(&self, own_slots: &Arc<Semaphore>) -> Option<Slots> {
        // Without a backlog, a lane claims only when no batch is in flight, and then for
        // all of the relay's partitions: events that arrived meanwhile go out together in
        // one claim (one produce request per Kafka partition, one commit) instead of in
        // small claims of their own each. Holding every slot while it claims and hands the
        // batch to the transport, it cannot race another lane for the same key. At a
        // steady load this lowered the end-to-end latency in `postal-bench e2e`
        // (BENCHMARKS.md): the claims and requests saved are work the database and the
        // broker no longer queue. With a backlog (the last claim came back full) the lanes
        // claim their own shares with up to `max_in_flight_batches` batches in flight, and
        // so do they always when rows are checked out (the task runner: one long task must
        // not stop the claims of every other key).
        // Checking out: no more events than the transport takes at once (one permit each,
        // released as their outcomes are recorded).
        let mut limit = self.config.batch_size;
        let mut events_permit = None;
        if let Some(room) = &self.checkout {
            let mut p = tokio::select! {
                _ = self.stop.cancelled() => return None,
                p = room.clone().acquire_owned() => p.expect("semaphore never closed"),
            };
            let more = room.available_permits().min(limit.saturating_sub(1));
            if let Ok(extra) = room.clone().try_acquire_many_owned(more as u32) {
                p.merge(extra);
            }
            limit = p.num_permits();
            events_permit = Some(p);
        }
        let light = !self.chained && !self.backlogged.load(Ordering::Relaxed);
        let all = self.config.max_in_flight_batches as u32;
        let own = tokio::select! {
            _ = self.stop.cancelled() => return None,
            p = own_slots.clone().acquire_owned() => p.expect("semaphore never closed"),
        };
        let permit = tokio::select! {
            _ = self.stop.cancelled() => return None,
            p = self.slots.clone().acquire_many_owned(if light { all } else { 1 }) =>
                p.expect("semaphore never closed"),
        };
        // After a failure, the batches in flight settle first (see `key_chain`): claimed
        // behind them, this batch would hold their failed keys back in turn.
        if !self.chained {
            tokio::select! {
                _ = self.stop.cancelled() => return None,
                () = self.key_chain.settled() => {}
            }
        }
        Some(Slots {
            limit,
            events: events_permit,
            light,
            own,
            permit,
        })
    }

    /// The partitions lane `lane` claims from now. Read only while holding a slot: the split
    /// changes only while the coordinator holds all of them. Lanes beyond this relay's part
    /// of the group's budget idle.
    fn partitions(&self, lane: usize, light: bool) -> Vec<i16> {
        let owned = self.owned.read().expect("owned lock");
        let active = self.active_lanes.load(Ordering::Relaxed);
        if lane >= active {
            Vec::new()
        } else if light {
            owned.clone()
        } else {
            lane_share(&owned, active, lane)
        }
    }

    /// Claims a batch of at most `limit` events from `partitions`.
    async fn claim(
        &self,
        partitions: &[i16],
        limit: usize,
    ) -> Result<Option<claim::Claim>, sqlx::Error> {
        claim::claim_below(
            &self.pool,
            self.id,
            partitions,
            limit,
            self.config.lease,
            // Checked-out rows stay in the outbox while they are in flight.
            self.config.delete_on_publish && self.checkout.is_none(),
            &self.config.topics,
            self.below
                .as_ref()
                .map_or(i64::MAX, |b| b.load(Ordering::Relaxed)),
        )
        .await
    }

    /// Nothing to claim from (no partitions, or the leases too short): waits for the owned
    /// partitions to change, or the poll interval.
    async fn wait_for_partitions(
        &self,
        owned_changed: &mut tokio::sync::watch::Receiver<u64>,
    ) -> ControlFlow<()> {
        tokio::select! {
            _ = self.stop.cancelled() => return ControlFlow::Break(()),
            Ok(()) = owned_changed.changed() => {}
            _ = tokio::time::sleep(self.config.poll_interval) => {}
        }
        ControlFlow::Continue(())
    }

    /// Nothing was claimable: waits for a wake-up, a change of the owned partitions, or the
    /// poll interval.
    async fn wait_for_events(
        &self,
        wake: &mut tokio::sync::watch::Receiver<u64>,
        owned_changed: &mut tokio::sync::watch::Receiver<u64>,
    ) -> ControlFlow<()> {
        tokio::select! {
            _ = self.stop.cancelled() => return ControlFlow::Break(()),
            // Err only once the relay is stopping; `stop` ends the loop then.
            Ok(()) = wake.changed() => {}
            Ok(()) = owned_changed.changed() => {}
            _ = tokio::time::sleep(self.config.poll_interval) => {}
        }
        ControlFlow::Continue(())
    }

    /// After a failed claim or check-out: waits `wait` (at least 100 ms).
    async fn back_off(&self, wait: Duration) -> ControlFlow<()> {
        tokio::select! {
            _ = self.stop.cancelled() => return ControlFlow::Break(()),
            _ = tokio::time::sleep(wait.max(Duration::from_millis(100))) => {}
        }
        ControlFlow::Continue(())
    }
}
