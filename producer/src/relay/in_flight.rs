//! A batch in flight: its claim kept alive while the transport works on it, given up (the
//! fence) when the leases are not renewed in time, and its outcomes recorded once known.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::OwnedSemaphorePermit;

use super::notice::RecordedNotice;
use super::Shared;
use crate::claim;
use crate::outcome;
use crate::transport::{OutboundEvent, PublishError, Transport};
use crate::Error;

/// Why a batch in flight was given up (logged).
#[derive(Debug)]
enum GiveUp {
    /// By the relay's clock: no heartbeat renewed the leases in time.
    NotRenewed,
    /// The claim's keep-alive did not return before the give-up point.
    KeepAliveLate,
    /// The database answered the keep-alive: the claim's leases are lost or nearly over.
    LeaseShort,
    /// The keep-alive failed: the claim's transaction is gone or aborted.
    KeepAliveFailed(sqlx::Error),
}

impl std::fmt::Display for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GiveUp::NotRenewed => f.write_str(
                "no heartbeat renewed the partition leases in time (heartbeats failing?)",
            ),
            GiveUp::KeepAliveLate => {
                f.write_str("the claim's keep-alive did not return before the give-up point")
            }
            GiveUp::LeaseShort => f.write_str(
                "the database reports the claim's partition leases lost or about to run out",
            ),
            GiveUp::KeepAliveFailed(e) => write!(f, "could not keep the claim alive: {e}"),
        }
    }
}

/// A batch handed to the transport, until its outcomes are recorded or it is given up.
pub(super) struct InFlight<T: Transport> {
    pub(super) notice: RecordedNotice<T>,
    pub(super) claim: claim::Claim,
    /// Its outcomes from the transport, per event of the claimed batch.
    pub(super) acks: BoxFuture<'static, Vec<Result<(), PublishError>>>,
    pub(super) judge: outcome::Judge,
    /// The lane's claim slots: the relay's, and its own.
    pub(super) permit: OwnedSemaphorePermit,
    pub(super) own: OwnedSemaphorePermit,
    pub(super) keep_alive_every: Duration,
    pub(super) timing: Timing,
}

/// When a batch was handed over, and how long the steps before took (logged at `trace`).
pub(super) struct Timing {
    /// When the hand-over started.
    pub(super) started: Instant,
    /// How long the oldest event of the batch had existed when the claim started.
    pub(super) waited_ms: f64,
    pub(super) claim_time: Duration,
    pub(super) send_time: Duration,
}

impl<T: Transport> InFlight<T> {
    /// Waits for the batch's outcomes and records them, or gives the batch up; frees its
    /// slots after either.
    pub(super) async fn settle(self) {
        let InFlight {
            notice,
            mut claim,
            acks,
            judge,
            permit,
            own,
            keep_alive_every,
            timing,
        } = self;
        // While the transport works on the batch (a slow broker, a long task handler),
        // the claim is kept alive for as long as the relay's partition leases hold.
        let mut acks = Box::pin(acks);
        let outcomes = keep_alive(&notice.shared, &mut claim, &mut acks, keep_alive_every).await;
        match outcomes {
            Ok(outcomes) => record_outcomes(notice, claim, outcomes, &judge, timing).await,
            Err(reason) => give_up(notice, claim, acks, reason, &judge).await,
        }
        drop(permit);
        drop(own);
    }
}

/// Keeps the claim alive until the transport's outcomes are in, or until it must be given up.
async fn keep_alive<T: Transport>(
    shared: &Shared<T>,
    claim: &mut claim::Claim,
    mut acks: impl std::future::Future<Output = Vec<Result<(), PublishError>>> + Unpin,
    keep_alive_every: Duration,
) -> Result<Vec<Result<(), PublishError>>, GiveUp> {
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + keep_alive_every,
        keep_alive_every,
    );
    loop {
        let give_up_at = shared.give_up_at();
        tokio::select! {
            biased;
            outcomes = &mut acks => break Ok(outcomes),
            // Heartbeats renew the leases long before this, unless they fail.
            _ = tokio::time::sleep_until(give_up_at) => {
                if shared.give_up_at() <= tokio::time::Instant::now() {
                    break Err(GiveUp::NotRenewed);
                }
            }
            _ = tick.tick() => {
                match tokio::time::timeout_at(give_up_at, claim.keep_alive()).await {
                    Ok(Ok(true)) => {}
                    Ok(Ok(false)) => break Err(GiveUp::LeaseShort),
                    // The claim's transaction is gone (or aborted): its rows are
                    // free for any claim already.
                    Ok(Err(e)) => break Err(GiveUp::KeepAliveFailed(e)),
                    // Its transaction's state is unknown now: give the batch up.
                    Err(_) => break Err(GiveUp::KeepAliveLate),
                }
            }
        }
    }
}

/// Gives up a batch still in flight.
async fn give_up<T: Transport>(
    mut notice: RecordedNotice<T>,
    claim: claim::Claim,
    acks: impl std::future::Future,
    reason: GiveUp,
    judge: &outcome::Judge,
) {
    // The fence: the work on this batch stops (a task handler is aborted
    // at its next await, Kafka acknowledgements are no longer awaited)
    // before another relay may take its keys over, and its claim rolls
    // back (or PostgreSQL ends it: its idle limit never reaches past the
    // leases), so its events are handed out again in order.
    drop(acks);
    notice.resolve_failed();
    metrics::counter!("postal_relay_batches_given_up_total").increment(1);
    tracing::warn!(
        events = notice.batch.len(),
        %reason,
        "giving up a batch still in flight (its events are handed out again)"
    );
    // Its slot is freed only once the rollback is through, so that this
    // relay does not give its partitions away before. If the database
    // does not answer, the wait ends after a quarter of the lease, about
    // when the leases end; PostgreSQL ends the claim by its idle limit,
    // which the keep-alives kept within the leases.
    let waiting = notice
        .shared
        .claim_clock
        .start("the rollback of a batch given up");
    let _ = tokio::time::timeout(judge.config.lease / 4, claim.release()).await;
    drop(waiting);
    notice.recorded(false).await;
}

/// Records the batch's outcomes and tells the transport.
async fn record_outcomes<T: Transport>(
    mut notice: RecordedNotice<T>,
    claim: claim::Claim,
    outcomes: Vec<Result<(), PublishError>>,
    judge: &outcome::Judge,
    timing: Timing,
) {
    let Timing {
        started,
        waited_ms,
        claim_time,
        send_time,
    } = timing;
    notice.resolve(&outcomes);
    let acked = started.elapsed();
    metrics::histogram!("postal_relay_batch_seconds").record(acked.as_secs_f64());
    let n = notice.batch.len();
    // The commit holds the batch's slot: behind a pooler that stopped answering, lanes wait
    // for slots with no claim under way, and this wait is what the stall watchdog sees.
    let waiting = notice
        .shared
        .claim_clock
        .start("the commit recording a published batch");
    let committed = judge.record(claim, &notice.batch, outcomes).await;
    drop(waiting);
    notice.recorded(committed).await;
    tracing::trace!(
        events = n,
        waited_ms,
        claim_ms = claim_time.as_secs_f64() * 1e3,
        send_ms = send_time.as_secs_f64() * 1e3,
        ack_ms = acked.as_secs_f64() * 1e3,
        total_ms = started.elapsed().as_secs_f64() * 1e3,
        "batch recorded"
    );
}

impl outcome::Judge {
    /// Records the batch's outcomes on its claim; `false` when that failed (the claim rolled
    /// back).
    async fn record(
        &self,
        mut claim: claim::Claim,
        batch: &[OutboundEvent],
        outcomes: Vec<Result<(), PublishError>>,
    ) -> bool {
        let outcome::Verdict {
            published,
            failures,
        } = self.verdict(batch, outcomes);
        // Record the outcome on the claim's transaction. If that fails (database gone), the
        // transaction rolls back and the rows are republished later: duplicates, never loss.
        let enqueued = claim.take_enqueued();
        match claim.complete(batch, &published, &failures).await {
            Ok(()) => {}
            Err(e @ Error::LeaseLost { .. }) => {
                tracing::warn!(error = %e, events = batch.len(), "a published batch was not recorded: its key partitions moved to another relay meanwhile; its events will be published again");
                return false;
            }
            Err(e) => {
                metrics::counter!("postal_relay_record_failures_total").increment(1);
                tracing::warn!(error = %e, events = batch.len(), "could not record a published batch; its events will be published again");
                return false;
            }
        }
        self.count(batch, &enqueued, &published, &failures);
        true
    }
}
