//! A batch handler's run: one call for a run of records, split on failure until the culprit
//! is alone.

use sqlx::{Connection, Postgres, Transaction};
use tracing::Instrument;

use super::ended;
use super::failure::{after_gone, release, roll_back};
use crate::dead_letter::Reason;
use crate::partition::{run_batch_body, Attempt, BodyFailure, Retry, Worker};
use crate::record::{Meta, Record};
use crate::route::Route;

/// What a batch handler's run did (indices into the queue).
#[derive(Default)]
pub(super) struct Run {
    /// Applied (committed with the transaction).
    pub(super) applied: Vec<usize>,
    /// Culprits to dead-letter: (index, reason, error).
    pub(super) dead: Vec<(usize, Reason, String)>,
    /// The record the run stopped at, retryably: (index, error, whose failure).
    pub(super) stopped: Option<(usize, String, Retry)>,
    /// The culprit whose key is held ([`crate::FinalFailure::HoldKey`]); the run stopped at
    /// it: (index, reason, error).
    pub(super) held: Option<(usize, Reason, String)>,
    /// The call whose body ended the transaction ([`ended`]): its items; the run stopped there.
    /// Whether its `COMMIT` was refused (the seal, [`ended`]).
    pub(super) ended: Option<(Vec<usize>, bool)>,
    /// A call set the seal off before the commit (`unseal` of [`super::Committed`]): the
    /// run stopped there, and nothing of the transaction is to commit.
    pub(super) unseal: bool,
}

impl Worker {
    /// Runs a batch handler over the records `items` (indices into `queue`, in order).
    ///
    /// Without `isolate` the body runs once in `tx`; its failure is returned as `Ok(Err)` and
    /// aborts the transaction (the caller runs the batch again with `isolate`). With `isolate`
    /// each call runs under a savepoint: a failed call is rolled back and its records are
    /// split in halves, run in order, until the failing record is alone — it is the culprit:
    /// a permanent failure (or panic, or a payload that does not decode) makes it a dead letter
    /// (returned in `dead`, for the caller to write) and the records after it go on; a retryable
    /// failure stops the run there. A dependency outage stops the run at the failed call's
    /// first record without splitting (it names no culprit). Nothing a failed call wrote
    /// survives its savepoint, so no record's effects are kept twice.
    #[allow(clippy::too_many_arguments)] // the batch transaction's state, passed through
    pub(super) async fn batch_run(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        route: &dyn Route,
        queue: &[Record],
        metas: &[Result<Meta, crate::record::Rejection>],
        items: &[usize],
        isolate: bool,
        refusals: i64,
        xid: Option<&str>,
    ) -> Result<Result<Run, BodyFailure>, Attempt> {
        let pair = |k: usize| {
            let m = metas[k].as_ref().expect("batch items have their meta");
            (&queue[k], m)
        };
        let first = &queue[items[0]];
        let span = tracing::info_span!("postal.handle_batch", handler = route.name(), events = items.len(), topic = %first.topic, partition = first.partition, offset = first.offset);
        let mut run = Run::default();
        if !isolate {
            let all: Vec<(&Record, &Meta)> = items.iter().map(|&k| pair(k)).collect();
            let r = run_batch_body(route, tx, &all).instrument(span).await;
            if ended::body_ended(tx, xid)
                .await
                .map_err(|e| after_gone(&r, e))?
            {
                run.ended = Some((items.to_vec(), ended::refused(&r)));
                return Ok(Ok(run));
            }
            return Ok(r.map(|()| {
                run.applied = items.to_vec();
                run
            }));
        }
        // Ranges of `items` still to run, the next on top: processed in partition order.
        let mut todo = vec![(0, items.len())];
        while let Some((lo, hi)) = todo.pop() {
            let part: Vec<(&Record, &Meta)> = items[lo..hi].iter().map(|&k| pair(k)).collect();
            let mut sp = (**tx).begin().await.map_err(Attempt::db)?;
            let r = run_batch_body(route, &mut sp, &part)
                .instrument(span.clone())
                .await;
            if ended::body_ended(&mut sp, xid)
                .await
                .map_err(|e| after_gone(&r, e))?
            {
                drop(sp);
                run.ended = Some((items[lo..hi].to_vec(), ended::refused(&r)));
                break;
            }
            let refused = ended::refused(&r);
            let r = match r {
                Ok(()) => release(sp).await?,
                Err(f) => Err(roll_back(sp, f).await?),
            };
            if refused || ended::set_off_early(tx, refusals, &r).await? {
                ended::warn_early(&first.topic, first.partition, Some(route.name()));
                run.unseal = true;
                break;
            }
            match r {
                Ok(()) => run.applied.extend_from_slice(&items[lo..hi]),
                Err(BodyFailure::Retry(error, Retry::Outage)) => {
                    run.stopped = Some((items[lo], error, Retry::Outage));
                    break;
                }
                Err(_) if hi - lo > 1 => {
                    let mid = lo + (hi - lo) / 2;
                    todo.push((mid, hi));
                    todo.push((lo, mid));
                }
                Err(BodyFailure::Dead(reason, error))
                    if self.holds(
                        &queue[items[lo]],
                        metas[items[lo]].as_ref().ok(),
                        Some(route.name()),
                    ) =>
                {
                    // Its key is held from here: the records after it wait (not run).
                    run.held = Some((items[lo], reason, error));
                    break;
                }
                Err(BodyFailure::Dead(reason, error)) => run.dead.push((items[lo], reason, error)),
                Err(BodyFailure::Retry(error, whose)) => {
                    run.stopped = Some((items[lo], error, whose));
                    break;
                }
            }
        }
        Ok(Ok(run))
    }
}
