//! Checking out a claim (a transport that [`Transport::checks_out`], the task runner): each
//! key's first claimed row is checked out under a run lease and handed over on its own, and
//! its outcome is recorded as soon as it is known ([`crate::checkout`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::Shared;
use crate::checkout;
use crate::claim;
use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};

/// What a lane holds while it checks out a claim.
pub(super) struct CheckOutPermits {
    /// The lane's claim slots (the relay's and its own), freed once the events are handed
    /// over.
    pub(super) slots: [tokio::sync::OwnedSemaphorePermit; 2],
    /// A permit per claimed event, each freed when its outcome is recorded.
    pub(super) events: tokio::sync::OwnedSemaphorePermit,
}

impl<T: Transport> Shared<T> {
    /// Checks out the first row of each key in a claimed batch ([`checkout`]), commits the
    /// claim and hands each checked-out event to the transport on its own; a task of the
    /// lane's batches in flight then renews their run leases and records each outcome when it
    /// is known.
    pub(super) async fn check_out(
        self: &Arc<Self>,
        mut claim: claim::Claim,
        batch: Vec<OutboundEvent>,
        claim_started: Instant,
        gate: tokio::sync::RwLockReadGuard<'_, ()>,
        permits: CheckOutPermits,
    ) -> bool {
        let CheckOutPermits {
            slots,
            events: mut events_permit,
        } = permits;
        use futures::FutureExt as _;
        let lease = self.config.lease;
        // The run leases end `lease` after the claim's start by the database's clock, which
        // read it after this process's clock read `claim_started`.
        let renewed_at = tokio::time::Instant::from_std(claim_started);
        let heads = checkout::heads(&batch);
        let seqs: Vec<i64> = heads.iter().map(|&i| batch[i].seq).collect();
        // Not raced against a timeout: it commits or rolls back before the lane claims again.
        let enqueued = claim.take_enqueued();
        let waiting = self
            .claim_clock
            .start("the commit checking a claimed batch out");
        let checked_out = claim
            .check_out(&seqs, lease, self.config.max_attempts)
            .await;
        drop(waiting);
        let marked = match checked_out {
            Ok(marked) => marked,
            Err(e) => {
                tracing::warn!(error = %e, events = batch.len(), "could not check out claimed events; they are claimed again");
                return false;
            }
        };
        drop(gate);
        let mut runs = checkout::Runs::new();
        let mut attempts = HashMap::new();
        let mut parked = 0u64;
        let mut marked_parked = std::collections::HashSet::new();
        for (seq, run, failed, was_parked) in marked {
            attempts.insert(seq, failed);
            if was_parked {
                parked += 1;
                marked_parked.insert(seq);
                if let Some(e) = batch.iter().find(|e| e.seq == seq) {
                    tracing::warn!(event_id = %e.id, topic = %postal_shared::text::field(&e.topic), key = %postal_shared::text::field(&e.key), "event parked as failed: its attempts were used up by runs that ended without an outcome (the relay died or lost its run lease)");
                }
            } else {
                runs.insert(seq, run);
            }
        }
        if parked > 0 {
            self.counters.activity.record(
                batch
                    .iter()
                    .filter(|e| marked_parked.contains(&e.seq))
                    .map(|e| (e.topic.as_str(), crate::activity::Outcome::Parked)),
            );
            self.counters.parked.fetch_add(parked, Ordering::Relaxed);
            metrics::counter!("postal_relay_failed_total").increment(parked);
        }
        if tokio::time::Instant::now() >= renewed_at + lease - lease / 4 {
            // Never handed over: given back without counting anything (else, when the
            // database does not answer, they run again when their run leases end).
            let back: Vec<(i64, i32)> = runs.iter().map(|(s, r)| (*s, *r)).collect();
            let released = checkout::release(&self.pool, &back, true).await;
            tracing::warn!(events = runs.len(), released = ?released.as_ref().ok(), "checked-out events reached their hand-over deadline (the relay stalled?); not handing them over but giving them back");
            return true;
        }
        // The events with their attempts as checked out (for the verdict on their outcome);
        // the transport gets them with the runs before this one as their attempts, so that a
        // task sees its run number.
        let events: Vec<OutboundEvent> = heads
            .into_iter()
            .filter(|&i| runs.contains_key(&batch[i].seq))
            .map(|i| {
                let mut e = batch[i].clone();
                e.attempts = attempts[&e.seq];
                e
            })
            .collect();
        let mut in_flight: Vec<checkout::InFlight> = Vec::with_capacity(events.len());
        for e in &events {
            let mut handed = e.clone();
            handed.attempts = runs[&e.seq] - 1;
            let acks = self.transport.send(std::slice::from_ref(&handed)).await;
            in_flight.push(
                async move {
                    acks.await.into_iter().next().unwrap_or_else(|| {
                        Err(PublishError::new(
                            FailureKind::Unavailable,
                            "the destination returned no outcome",
                        ))
                    })
                }
                .boxed(),
            );
        }
        // The claim slots are free again: the checked-out rows hold their keys in the
        // database, so claims (and changes of the lanes' split) need not wait for them.
        drop(slots);
        // One permit per event in flight.
        if let Some(unused) = events_permit.num_permits().checked_sub(events.len()) {
            drop(events_permit.split(unused));
        }
        let shared = self.clone();
        // In the relay's set, not the lane's: a lane aborted at shutdown (stuck in a claim)
        // must not take running tasks with it before they are given back.
        let mut drives = self.drives.lock().expect("drives lock");
        while drives.try_join_next().is_some() {}
        drives.spawn(async move {
            let judge = shared.judge();
            let events_permit = std::sync::Mutex::new(events_permit);
            let notify = |e: &OutboundEvent, ok: bool| {
                drop(events_permit.lock().expect("permit lock").split(1));
                shared.transport.recorded(std::slice::from_ref(e), ok);
                if ok {
                    shared.wake.send_modify(|n| *n = n.wrapping_add(1));
                }
            };
            let driver = checkout::Driver {
                pool: &shared.pool,
                waits: &shared.claim_clock,
                lease,
                keeping: checkout::Keeping {
                    delete: shared.config.delete_on_publish,
                    history: shared.config.history.is_some(),
                },
                judge: &judge,
                enqueued: &enqueued,
                recorded: &notify,
                release: &shared.release,
                abort_running: &|| shared.transport.abort_running(),
            };
            checkout::drive(driver, events, runs, in_flight, renewed_at).await;
        });
        true
    }
}
