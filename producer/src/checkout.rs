//! Checking rows out to a transport whose work may take long (the task runner).
//!
//! A claim holds its transaction open until its batch is recorded, which suits a broker that
//! acknowledges within seconds, not a task handler that runs for minutes: an open transaction
//! holds back vacuum for the whole database, and a batch recorded as one cannot record its
//! quick tasks before its slow one. For a transport that [`crate::Transport::checks_out`], the
//! claim instead checks out the first claimed row of each key and commits at once:
//!
//! - the row's `runs` goes up by one — its **run number**, which survives restarts and is never
//!   reset, tells a handler that an earlier run started (and may have done part of its work),
//!   and fences stale outcomes: every change the relay later makes to the row requires the run
//!   number it checked out;
//! - it is marked `running` until its outcome is recorded: a check-out that finds the mark
//!   still set counts the cut-off run (the relay died or lost the run lease) as a failed
//!   attempt, and parks a row whose attempts that uses up instead of running it again (a task
//!   that kills its process does not run forever). Runs given back without an outcome — not
//!   handed over in time, or aborted by a graceful stop — count nothing;
//! - its `available_at` becomes the end of its **run lease** (the relay's lease, counted from
//!   the claim's start by the database's clock), and `held` is set, so the row holds back its
//!   key's later rows, whichever relay owns the key's partition, until its outcome is recorded;
//! - the claim's other rows of the same key are left as they were.
//!
//! The check-out commits before the relay claims again, or rolls back: were it left open, a
//! next claim would skip its locked rows and take the key's later rows.
//!
//! While the event is in flight the relay renews its run lease every quarter of the lease. If
//! it cannot (database unreachable, or the row was checked out again by someone else), it
//! abandons the event — a task handler is aborted at its next await — before the lease it last
//! renewed has a quarter left by its own clock. If the process dies or freezes, the row comes
//! due when its run lease ends and runs again with the next run number; the frozen run's
//! outcome, should it ever arrive, is refused. Each outcome is recorded in a statement of its
//! own as soon as it is known (outcomes ready together share one), so a key's next task is
//! claimable right after its predecessor's outcome is in the database, never before.

use std::collections::HashMap;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use sqlx::PgPool;

use crate::complete::Failure;
use crate::transport::{OutboundEvent, PublishError};

/// The run number of each checked-out row, by sequence number.
pub(crate) type Runs = HashMap<i64, i32>;

/// The claimed rows to check out: the first row of each key (topic and key) in the batch (by
/// position).
pub(crate) fn heads(batch: &[OutboundEvent]) -> Vec<usize> {
    let mut seen = std::collections::HashSet::new();
    (0..batch.len())
        .filter(|&i| seen.insert(batch[i].order_key()))
        .collect()
}

/// Renews the run lease of the checked-out rows `runs` (sequence number, run number): they
/// come due `lease` from now (the database's clock). Returns the rows renewed; a row missing
/// from the answer is no longer this run's (recorded, or checked out again by another relay).
pub(crate) async fn renew(
    pool: &PgPool,
    runs: &[(i64, i32)],
    lease: Duration,
) -> Result<Vec<i64>, sqlx::Error> {
    let (seqs, nums): (Vec<i64>, Vec<i32>) = runs.iter().copied().unzip();
    sqlx::query_scalar(
        "UPDATE postal.outbox o SET available_at = now() + $3 * interval '1 millisecond'
         FROM unnest($1::int8[], $2::int4[]) AS r(seq, run)
         WHERE o.seq = r.seq AND o.runs = r.run AND o.running AND o.status = 'pending'
         RETURNING o.seq",
    )
    .bind(&seqs)
    .bind(&nums)
    .bind(lease.as_millis() as i64)
    .fetch_all(pool)
    .await
}

/// Gives checked-out rows back without an outcome, counting nothing, still holding their
/// keys; they run next with the next run number. `now`: their handlers never started (the
/// check-out committed too late to hand them over), so they are due at once; else (a graceful
/// stop aborted them) they stay due at the end of their run leases, so that work an aborted
/// handler left running (`spawn_blocking`, a spawned task) ends before another run of the task
/// may start. Only rows still this run's are changed.
pub(crate) async fn release(
    pool: &PgPool,
    runs: &[(i64, i32)],
    now: bool,
) -> Result<u64, sqlx::Error> {
    let (seqs, nums): (Vec<i64>, Vec<i32>) = runs.iter().copied().unzip();
    Ok(sqlx::query(
        "UPDATE postal.outbox o
         SET running = false, available_at = CASE WHEN $3 THEN now() ELSE o.available_at END
         FROM unnest($1::int8[], $2::int4[]) AS r(seq, run)
         WHERE o.seq = r.seq AND o.runs = r.run AND o.running AND o.status = 'pending'",
    )
    .bind(&seqs)
    .bind(&nums)
    .bind(now)
    .execute(pool)
    .await?
    .rows_affected())
}

/// How the outbox keeps published rows (from the relay's configuration).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Keeping {
    /// Delete published rows (else mark them published).
    pub(crate) delete: bool,
    /// Also write deleted published rows into `postal.outbox_history`.
    pub(crate) history: bool,
}

/// Records the outcomes of checked-out rows in one statement: acknowledged rows are deleted
/// (and archived in history mode) or marked published, failed ones rescheduled or parked as
/// the [`Failure`]s say (computed by [`crate::outcome::Judge::verdict`]), each only if it is
/// still this run's (`runs`, `running`). Returns the sequence numbers recorded; the others
/// were no longer this run's.
pub(crate) async fn settle(
    pool: &PgPool,
    keeping: Keeping,
    runs: &Runs,
    published: &[i64],
    failures: &[Failure],
) -> Result<Vec<i64>, sqlx::Error> {
    let run_of = |seq: &i64| runs.get(seq).copied().unwrap_or(-1);
    let done_runs: Vec<i32> = published.iter().map(run_of).collect();
    let seqs: Vec<i64> = failures.iter().map(|f| f.seq).collect();
    let fail_runs: Vec<i32> = seqs.iter().map(run_of).collect();
    let incs: Vec<i32> = failures.iter().map(|f| i32::from(f.counts)).collect();
    let delays: Vec<i64> = failures
        .iter()
        .map(|f| f.retry_in.as_millis() as i64)
        .collect();
    let parks: Vec<bool> = failures.iter().map(|f| f.park).collect();
    let reasons: Vec<Option<&str>> = failures.iter().map(|f| f.reason.as_deref()).collect();
    let holds: Vec<bool> = failures.iter().map(|f| f.hold).collect();
    let done = if keeping.delete {
        "DELETE FROM postal.outbox o USING unnest($1::int8[], $2::int4[]) AS p(seq, run)
         WHERE o.seq = p.seq AND o.runs = p.run AND o.running AND o.status = 'pending'
         RETURNING o.*"
    } else {
        "UPDATE postal.outbox o
         SET status = 'published', published_at = statement_timestamp(), held = false,
             running = false
         FROM unnest($1::int8[], $2::int4[]) AS p(seq, run)
         WHERE o.seq = p.seq AND o.runs = p.run AND o.running AND o.status = 'pending'
         RETURNING o.*"
    };
    let sql = format!(
        r#"
        WITH done AS ({done}),
        archived AS (
            INSERT INTO postal.outbox_history (seq, event_id, topic, event_key, event_type,
                                               schema_version, occurred_at, content_type,
                                               payload, headers, attempts, created_at,
                                               published_at)
            SELECT seq, event_id, topic, event_key, event_type, schema_version, occurred_at,
                   content_type, payload, headers, attempts, created_at,
                   statement_timestamp()
            FROM done WHERE $10
        ), failed AS (
            UPDATE postal.outbox o
            SET attempts = least(o.attempts::int8 + u.inc, 2147483647)::int4,
                running = false,
                status = CASE WHEN u.park THEN 'failed' ELSE 'pending' END,
                available_at = now() + u.delay_ms * interval '1 millisecond',
                held = u.hold,
                last_error = coalesce(u.reason, o.last_error)
            FROM unnest($3::int8[], $4::int4[], $5::int4[], $6::int8[], $7::bool[],
                        $8::text[], $9::bool[])
                 AS u(seq, run, inc, delay_ms, park, reason, hold)
            WHERE o.seq = u.seq AND o.runs = u.run AND o.running AND o.status = 'pending'
            RETURNING o.seq
        )
        SELECT seq FROM done UNION ALL SELECT seq FROM failed
        "#
    );
    sqlx::query_scalar(&sql)
        .bind(published)
        .bind(&done_runs)
        .bind(&seqs)
        .bind(&fail_runs)
        .bind(&incs)
        .bind(&delays)
        .bind(&parks)
        .bind(&reasons)
        .bind(&holds)
        .bind(keeping.history && keeping.delete)
        .fetch_all(pool)
        .await
}

/// One checked-out event in flight: its outcome, abortable (dropping it aborts a task handler).
pub(crate) type InFlight = futures::future::BoxFuture<'static, Result<(), PublishError>>;

/// What [`drive`] needs from the relay.
pub(crate) struct Driver<'a> {
    pub(crate) pool: &'a PgPool,
    /// The relay's stall watchdog's clock: recording outcomes holds the permits the next
    /// claims need.
    pub(crate) waits: &'a crate::relay::ClaimClock,
    pub(crate) lease: Duration,
    pub(crate) keeping: Keeping,
    pub(crate) judge: &'a crate::outcome::Judge,
    /// When the events were enqueued (for the end-to-end lag the relay tallies).
    pub(crate) enqueued: &'a crate::activity::Enqueued,
    /// Called with each event whose outcome was recorded (`true`) or given up (`false`).
    pub(crate) recorded: &'a (dyn Fn(&OutboundEvent, bool) + Send + Sync),
    /// Cancelled when the relay stops waiting (shutdown): `abort_running` is called, and the
    /// events still in flight are recorded as their work ends — an aborted task comes back
    /// "held back" and is given back without an attempt, due at the end of its run lease
    /// ([`release`]) — for at most [`STOP_GRACE`]; what is still running then is left to its
    /// run lease.
    pub(crate) release: &'a tokio_util::sync::CancellationToken,
    /// [`crate::Transport::abort_running`] of the relay's transport.
    pub(crate) abort_running: &'a (dyn Fn() + Send + Sync),
}

/// How long a stopping relay waits for aborted work to end and be recorded.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(4);

/// Awaits the checked-out `events` (with the attempts before their runs, their run numbers
/// `runs`, their outcomes `in_flight` in the same order), renewing
/// their run leases and recording each outcome as soon as it is known. `renewed_at` is when
/// the run leases were last set, by this process's clock (before the claim began): the
/// events are abandoned once a quarter of the lease is left since the last renewal.
pub(crate) async fn drive(
    d: Driver<'_>,
    events: Vec<OutboundEvent>,
    runs: Runs,
    in_flight: Vec<InFlight>,
    renewed_at: tokio::time::Instant,
) {
    let mut aborts: HashMap<usize, futures::future::AbortHandle> = HashMap::new();
    let mut pending = FuturesUnordered::new();
    for (i, f) in in_flight.into_iter().enumerate() {
        let (f, handle) = futures::future::abortable(f);
        aborts.insert(i, handle);
        pending.push(f.map(move |r| (i, r)));
    }
    let usable = d.lease - d.lease / 4;
    let mut deadline = renewed_at + usable;
    let every = d.lease / 4;
    let mut tick = tokio::time::interval_at(renewed_at + every, every);
    let mut stopping_until: Option<tokio::time::Instant> = None;
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !aborts.is_empty() {
        tokio::select! {
            biased;
            Some((i, outcome)) = pending.next() => {
                let mut ready = vec![(i, outcome)];
                while let Some(Some(next)) = pending.next().now_or_never() {
                    ready.push(next);
                }
                let mut batch = Vec::new();
                let mut outcomes = Vec::new();
                let mut given_back = Vec::new();
                for (i, outcome) in ready {
                    aborts.remove(&i);
                    match outcome {
                        // Aborted: its run lease was lost, and it was reported then.
                        Err(_) => {}
                        // Stopped by the relay's stop (which another drive may have
                        // started before this one noticed it): given back counting nothing.
                        Ok(Err(e))
                            if d.release.is_cancelled()
                                && e.kind == crate::transport::FailureKind::HeldBack =>
                        {
                            given_back.push(i);
                        }
                        Ok(outcome) => {
                            batch.push(events[i].clone());
                            outcomes.push(outcome);
                        }
                    }
                }
                if !batch.is_empty() {
                    record(&d, &runs, &batch, outcomes, deadline).await;
                }
                if !given_back.is_empty() {
                    let back: Vec<(i64, i32)> = given_back
                        .iter()
                        .map(|&i| (events[i].seq, runs[&events[i].seq]))
                        .collect();
                    let released = tokio::time::timeout_at(
                        stopping_until.unwrap_or(deadline),
                        release(d.pool, &back, false),
                    )
                    .await;
                    tracing::info!(events = back.len(), released = ?released.ok().and_then(Result::ok), "stopping: gave back tasks whose handlers were aborted (not counted; they run again when their run leases end)");
                    for &i in &given_back {
                        (d.recorded)(&events[i], false);
                    }
                }
            }
            _ = d.release.cancelled(), if stopping_until.is_none() => {
                (d.abort_running)();
                stopping_until = Some(tokio::time::Instant::now() + STOP_GRACE);
                tracing::info!(events = aborts.len(), "stopping: aborting the handlers still running; their events are given back once they have ended");
            }
            _ = tokio::time::sleep_until(stopping_until.unwrap_or(deadline)), if stopping_until.is_some() => {
                tracing::warn!(events = aborts.len(), "stopping: handlers still running after the grace; their events run again when their run leases end");
                for (i, h) in aborts.drain() {
                    h.abort();
                    (d.recorded)(&events[i], false);
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                tracing::warn!(events = aborts.len(), "could not renew the run leases of events in flight in time (database unreachable?); abandoning them: they run again when their leases end");
                for (i, h) in aborts.drain() {
                    h.abort();
                    (d.recorded)(&events[i], false);
                }
            }
            _ = tick.tick() => {
                let started = tokio::time::Instant::now();
                let live: Vec<(i64, i32)> =
                    aborts.keys().map(|&i| (events[i].seq, runs[&events[i].seq])).collect();
                match tokio::time::timeout_at(deadline, renew(d.pool, &live, d.lease)).await {
                    Ok(Ok(kept)) => {
                        deadline = started + usable;
                        let kept: std::collections::HashSet<i64> = kept.into_iter().collect();
                        let lost: Vec<usize> = aborts
                            .keys()
                            .copied()
                            .filter(|&i| !kept.contains(&events[i].seq))
                            .collect();
                        for i in lost {
                            if let Some(h) = aborts.remove(&i) {
                                h.abort();
                            }
                            let e = &events[i];
                            tracing::warn!(event_id = %e.id, key = %postal_shared::text::field(&e.key), run = runs[&e.seq], "an event in flight was checked out again or changed meanwhile (its run lease had ended?); abandoning this run");
                            (d.recorded)(e, false);
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, events = aborts.len(), "could not renew the run leases of events in flight; retrying");
                    }
                    Err(_) => {}
                }
            }
        }
    }
}

/// Records the outcomes of `batch`, retrying while the database does not answer, until
/// `deadline` (the run leases end soon after; the events then run again).
async fn record(
    d: &Driver<'_>,
    runs: &Runs,
    batch: &[OutboundEvent],
    outcomes: Vec<Result<(), PublishError>>,
    deadline: tokio::time::Instant,
) {
    let verdict = d.judge.verdict(batch, outcomes);
    let _waiting = d
        .waits
        .start("recording the outcomes of checked-out events");
    let mut wait = Duration::from_millis(100);
    loop {
        let result = tokio::time::timeout_at(
            deadline,
            settle(
                d.pool,
                d.keeping,
                runs,
                &verdict.published,
                &verdict.failures,
            ),
        )
        .await;
        match result {
            Ok(Ok(recorded)) => {
                let recorded: std::collections::HashSet<i64> = recorded.into_iter().collect();
                for e in batch {
                    let ok = recorded.contains(&e.seq);
                    if !ok {
                        tracing::warn!(event_id = %e.id, key = %postal_shared::text::field(&e.key), run = runs[&e.seq], "the outcome of an event was not recorded: it was checked out again meanwhile (its run lease had ended?)");
                    }
                    (d.recorded)(e, ok);
                }
                let published: Vec<i64> = verdict
                    .published
                    .iter()
                    .copied()
                    .filter(|s| recorded.contains(s))
                    .collect();
                let failures: Vec<Failure> = verdict
                    .failures
                    .iter()
                    .filter(|f| recorded.contains(&f.seq))
                    .cloned()
                    .collect();
                d.judge.count(batch, d.enqueued, &published, &failures);
                return;
            }
            Ok(Err(e)) if tokio::time::Instant::now() + wait < deadline => {
                tracing::warn!(error = %e, events = batch.len(), retry_in_ms = wait.as_millis() as u64, "could not record the outcomes of checked-out events; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            _ => {
                tracing::warn!(events = batch.len(), "could not record the outcomes of checked-out events before their run leases end; they run again then");
                for e in batch {
                    (d.recorded)(e, false);
                }
                return;
            }
        }
    }
}
