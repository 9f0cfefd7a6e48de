//! Handing a claimed batch to the transport: behind the earlier batches of its keys (the key
//! chain), unless its send deadline passed, and then left in flight ([`InFlight`]).

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, RwLockReadGuard};

use super::held::{merge_held, unheld};
use super::in_flight::{InFlight, Timing};
use super::notice::RecordedNotice;
use super::Shared;
use crate::claim;
use crate::key_chain;
use crate::transport::{OutboundEvent, Transport};

/// A claimed batch with what its lane holds for it, as the claim left them.
pub(super) struct Claimed<'a> {
    pub(super) own: OwnedSemaphorePermit,
    pub(super) permit: OwnedSemaphorePermit,
    pub(super) gate: RwLockReadGuard<'a, ()>,
    pub(super) claim_started: Instant,
    pub(super) claim: claim::Claim,
    pub(super) batch: Vec<OutboundEvent>,
    /// Claimed without a backlog, holding every slot of the relay.
    pub(super) light: bool,
}

/// What became of a claimed batch.
pub(super) enum HandOver {
    /// Handed over and in flight.
    InFlight,
    /// Given back unsent: its send deadline had passed.
    GivenBack,
    /// Given up at shutdown (its claim rolls back): the lane stops.
    Abandoned,
}

impl<T: Transport> Shared<T> {
    /// Hands a claimed batch to the transport and leaves it in flight among `completions`.
    pub(super) async fn hand_over(
        self: &Arc<Self>,
        completions: &mut tokio::task::JoinSet<()>,
        claimed: Claimed<'_>,
    ) -> HandOver {
        // Bound in the order the lane took them, so that they are dropped in the reverse one.
        let Claimed {
            own,
            mut permit,
            gate,
            claim_started,
            claim,
            batch,
            light,
        } = claimed;
        let started = Instant::now();
        let claim_time = started - claim_started;
        let waited_ms = waited_ms(&batch, claim_started);
        // Transports that do not chain keys themselves: this batch waits for the outcome
        // of earlier batches in flight with a key of its own, and holds back the events
        // of keys that failed there (see `key_chain`).
        let mut chain = (!self.chained).then(|| self.key_chain.register(&batch));
        let Some(held) = self.wait_for_earlier(chain.as_ref(), &batch).await else {
            drop(claim);
            self.leave_chain(&mut chain);
            return HandOver::Abandoned;
        };
        if claim.send_deadline_passed() {
            // The fence's last step (see `claim::Claim::send_deadline_passed`): this relay
            // stalled (a frozen process, a starved runtime, a claim that waited on a
            // lock) until its leases as read at claim time may have run out.
            tracing::warn!(events = batch.len(), claim_ms = claim_time.as_secs_f64() * 1e3, "a claimed batch reached its send deadline before it was handed over (the relay stalled?); giving it back unsent");
            let _ = tokio::time::timeout(self.config.lease / 4, claim.release()).await;
            self.leave_chain(&mut chain);
            drop(gate);
            drop(permit);
            drop(own);
            return HandOver::GivenBack;
        }
        // The events to hand over: all, unless the chain holds some back.
        let sent = unheld(&batch, &held);
        tracing::trace!(relay = %self.id, seqs = ?sent.iter().map(|e| e.seq).collect::<Vec<_>>(), "handing a claimed batch over");
        let Some(handed) = self.send(&sent, &batch).await else {
            drop(claim);
            self.leave_chain(&mut chain);
            // What the transport may have started of it ends without a record.
            self.transport.recorded(&sent, false);
            return HandOver::Abandoned;
        };
        let acks = merge_held(handed, held);
        drop(gate);
        let send_time = started.elapsed();
        if light {
            // Handed over in order: other lanes may claim again (keep one slot).
            let all = self.config.max_in_flight_batches as u32;
            drop(permit.split(all as usize - 1));
        }
        let judge = self.judge();
        while completions.try_join_next().is_some() {}
        let keep_alive_every = self.config.lease / 4;
        let notice = RecordedNotice::new(self.clone(), batch, sent, chain);
        completions.spawn(
            InFlight {
                notice,
                claim,
                acks,
                judge,
                permit,
                own,
                keep_alive_every,
                timing: Timing {
                    started,
                    waited_ms,
                    claim_time,
                    send_time,
                },
            }
            .settle(),
        );
        HandOver::InFlight
    }

    /// Waits for the earlier batches in flight with a key of this one (`chain`, when it has
    /// any); returns, per event, whether the chain holds it back (empty when it waited for
    /// none), or `None` when shutdown gave the batch up meanwhile.
    async fn wait_for_earlier(
        &self,
        chain: Option<&key_chain::Entry>,
        batch: &[OutboundEvent],
    ) -> Option<Vec<bool>> {
        let mut held: Vec<bool> = Vec::new();
        if let Some(entry) = chain.filter(|e| e.has_deps()) {
            held = tokio::select! {
                h = entry.wait() => h,
                _ = self.abandon.cancelled() => {
                    tracing::warn!(events = batch.len(), "shutdown timeout reached while a batch waited for an earlier one of its keys; giving it up (its claim rolls back)");
                    return None;
                }
            };
        }
        Some(held)
    }

    /// Hands `sent` (of the claimed `batch`) to the transport: its acknowledgements (`None`
    /// inside when there is nothing to send), or `None` when shutdown gave the batch up while
    /// it was still being handed over.
    async fn send(
        &self,
        sent: &[OutboundEvent],
        batch: &[OutboundEvent],
    ) -> Option<Option<T::Acks>> {
        let handed = tokio::select! {
            acks = self.transport.send(sent), if !sent.is_empty() => Some(acks),
            _ = std::future::ready(()), if sent.is_empty() => None,
            _ = self.abandon.cancelled() => {
                tracing::warn!(events = batch.len(), "shutdown timeout reached while a batch was still being handed to the destination; giving it up (its claim rolls back, its events are published again later)");
                return None;
            }
        };
        Some(handed)
    }

    /// Takes the batch out of the key chain, if it is in it.
    fn leave_chain(&self, chain: &mut Option<key_chain::Entry>) {
        if let Some(entry) = chain.take() {
            self.key_chain.remove(&entry);
        }
    }
}

/// How long the oldest event of the batch had existed when the claim started (from its
/// `occurred_at`, normally the enqueueing transaction's start); measured only for `trace`.
fn waited_ms(batch: &[OutboundEvent], claim_started: Instant) -> f64 {
    if tracing::enabled!(tracing::Level::TRACE) {
        let oldest = batch.iter().map(|e| e.occurred_at).min();
        oldest.map_or(0.0, |t| {
            (chrono::Utc::now() - t).num_microseconds().unwrap_or(0) as f64 / 1e3
                - claim_started.elapsed().as_secs_f64() * 1e3
        })
    } else {
        0.0
    }
}
