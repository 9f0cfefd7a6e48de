//! Publishing one batch read from the slot: its rows locked, handed to the transport in
//! commit order, marked. Rows that failed and rows another session holds locked (each with
//! its key's later rows) are carried into the next batch, to try again, while other keys go
//! on.

use std::time::{Duration, Instant};

use sqlx::PgPool;

use super::aside::{max_aside, Aside, Chunk, SLOW_ACK};
use super::{lease, rows, stream, LeaseLost};
use crate::config::RelayConfig;
use crate::relay::{RelayHealth, RelayStats, STALL_AFTER};
use crate::transport::{FailureKind, OutboundEvent, Transport};

/// What a batch left to try again: rows that were busy (locked by another session), with
/// their keys' later rows, in commit order.
#[derive(Debug, Default)]
pub(super) struct Carry {
    pub rows: Vec<i64>,
}

/// Publishes the rows `carried` (left by earlier batches, earlier in commit order) and then
/// those of `batch` (whole transactions from the slot, in commit order) until each is
/// acknowledged and marked, or found no longer to publish, or is left to try again ([`Carry`]),
/// or is in a chunk set `aside` (its acknowledgements slow: [`super::aside`]).
/// The carried rows are sent again only when `due`; until then they, like a row that fails
/// here, a row another session holds locked, or a row of a chunk aside, hold back their keys'
/// later rows, which are carried with them, while the other keys go on: the relay does not
/// confirm the slot past a carried row or a chunk aside. The outcomes of chunks aside are
/// recorded as they come, at the start of each chunk. Past [`STALL_AFTER`] of busy rows the
/// relay's health says it is stalled (`/readyz`). Ends early with [`LeaseLost`] once the
/// slot's lease is no longer this relay's: nothing more is sent, and marks are refused.
#[allow(clippy::too_many_arguments)]
pub(super) async fn publish<T: Transport>(
    pool: &PgPool,
    transport: &T,
    config: &RelayConfig,
    carried: Vec<i64>,
    due: bool,
    batch: &stream::Batch,
    lease: &lease::Held,
    busy: &mut BusyWatch<'_>,
    judge: &crate::outcome::Judge,
    stats: &mut RelayStats,
    aside: &mut Aside<T>,
) -> Result<Carry, LeaseLost> {
    // The commits are in the WAL, but their rows may not be visible yet (`rows::visible`): a
    // row not seen would be taken as published by someone else and skipped, and lost.
    let mut failures = 0u32;
    let started = Instant::now();
    while let Err(e) = rows::visible(pool, &batch.xids).await {
        failures += 1;
        tracing::warn!(error = %e, "WAL relay: could not check that the batch's transactions are visible; retrying");
        tokio::time::sleep(config.backoff.delay(failures).min(Duration::from_secs(10))).await;
    }
    // Rows not to send in this call: carried ones not yet due, and those that fail here.
    let defer: std::collections::HashSet<i64> = if due {
        Default::default()
    } else {
        carried.iter().copied().collect()
    };
    // The rows the stream gave this call, to publish in it, in the order they are done and
    // ranked in it (after the rows aside, which come before all of them): a pending row of a
    // key before one of them that is not one of these, or comes after it here (written back
    // after a failed publish), holds it back (`rows::lock`). A row left pending here stops
    // being one. Busy rows (and their keys' later rows) at the head of `todo` (`waiting` of
    // them): the next chunk takes a batch's worth of rows past them.
    let Order {
        mut todo,
        mut known,
        carried: mut waiting,
    } = Order::of(&aside.seqs(), carried, &batch.seqs);
    // A row of this batch was locked by another session: the rest goes through `rows::lock`
    // (a take would wait for the lock each time).
    let mut saw_busy = false;
    // The next chunk's rows, taken ahead (`rows::take`), with the chunk they were taken for.
    let mut prefetched: Option<Ahead> = None;
    let mut prefetched_at = Instant::now();
    let mut failures = 0u32;
    loop {
        // Chunks aside whose outcomes came are recorded; with as many aside as may be, the
        // oldest is waited for.
        let mut done = aside.take_done();
        if aside.len() >= max_aside(config) && !todo.is_empty() {
            done.extend(aside.oldest().await);
        }
        for mut c in done {
            let outcomes = c.outcomes();
            match finish(
                transport, config, judge, lease, stats, c.locked, &c.events, c.refused, outcomes,
            )
            .await?
            {
                Finished::Marked { written } => {
                    for f in &written {
                        known.remove(&f.seq);
                    }
                }
                // Not marked: its rows are published again, first (they come before every
                // row of their keys here).
                Finished::NotMarked => {
                    waiting += c.seqs.len();
                    todo.splice(0..0, c.seqs);
                }
            }
        }
        if todo.is_empty() {
            break;
        }
        let chunk_len = todo.len().min(config.batch_size + waiting);
        let chunk: Vec<i64> = todo[..chunk_len].to_vec();
        // An unavailable destination pauses the relay (`outcome::Judge`, at most 10 s), as it
        // pauses a polling relay: the rows read meanwhile are not failed one chunk after
        // another.
        let paused = *judge.paused_until.lock().expect("pause lock");
        if let Some(wait) = paused.and_then(|until| until.checked_duration_since(Instant::now())) {
            tokio::time::sleep(wait).await;
        }
        if !lease.may_send() {
            return Err(LeaseLost);
        }
        let t_lock = Instant::now();
        // The rows aside: locked by this relay's own transactions, not to send, and their
        // keys' later rows carried behind them.
        let held_aside = aside.seqs();
        let aside_set: std::collections::HashSet<i64> = held_aside.iter().copied().collect();
        // One statement takes (reads and deletes) the chunk's rows when nothing in it is to
        // be held back; `rows::lock` does the rest, and the chunks after a busy row. The take
        // may have been done while the previous chunk's acknowledgements were awaited.
        let taken = match prefetched.take() {
            // Taken long ago (acknowledgements slow to come): its session may be near the
            // idle timeout set for it, which would end it after the send.
            Some((seqs, taken))
                if seqs == chunk
                    && held_aside.is_empty()
                    && prefetched_at.elapsed() < config.lease / 4 =>
            {
                taken
            }
            // Not the chunk that follows (the last one left rows to try again): undone.
            Some((_, Ok(Some(l)))) => {
                l.undo().await;
                Ok(None)
            }
            _ => Ok(None),
        };
        let taken = match taken {
            Ok(None) if may_take(config, &defer, saw_busy) && held_aside.is_empty() => {
                rows::take(
                    pool,
                    &chunk,
                    &known,
                    &config.group,
                    &config.topics,
                    config.lease / 2,
                )
                .await
            }
            other => other,
        };
        let locked = match taken {
            Ok(Some(l)) => Ok(l),
            Ok(None) if held_aside.is_empty() => {
                rows::lock(
                    pool,
                    &chunk,
                    &known,
                    &defer,
                    &config.group,
                    &config.topics,
                    config.lease / 2,
                )
                .await
            }
            Ok(None) => {
                let mut seqs = held_aside.clone();
                seqs.extend_from_slice(&chunk);
                let mut not_now = defer.clone();
                not_now.extend(aside_set.iter().copied());
                rows::lock(
                    pool,
                    &seqs,
                    &known,
                    &not_now,
                    &config.group,
                    &config.topics,
                    config.lease / 2,
                )
                .await
                .map(|mut l| {
                    // Its own rows aside are not another session's.
                    l.busy.retain(|b| !aside_set.contains(&b.seq));
                    l.again.retain(|s| !aside_set.contains(s));
                    l.left.retain(|s| !aside_set.contains(s));
                    l
                })
            }
            Err(e) => Err(e),
        };
        let mut locked = match locked {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "WAL relay: could not lock the batch's rows; retrying");
                tokio::time::sleep(config.backoff.delay(failures).min(Duration::from_secs(10)))
                    .await;
                continue;
            }
        };
        if !locked.left.is_empty() {
            tracing::info!(rows = locked.left.len(), first = locked.left[0], "WAL relay: rows held back (paused, scheduled, retried, parked, or behind such a row or a pending row the slot's stream does not hold: committed before the slot, or requeued) are left pending for the sweep, which publishes them in order when due");
            for seq in &locked.left {
                known.remove(seq);
            }
        }
        // Rows parked before they are sent: no longer the stream's to publish (a key's later
        // row behind one is left, not taken past it by the next chunk's take).
        let refused = std::mem::take(&mut locked.refused);
        for f in &refused {
            known.remove(&f.seq);
        }
        busy.saw(&locked.busy);
        saw_busy |= !locked.busy.is_empty();
        let again = locked.again.clone();
        let events = locked.events.clone();
        // The lease is checked again after the lock, which may have waited: a batch goes to
        // the transport only with more than half the lease left.
        if !lease.may_send() {
            return Err(LeaseLost);
        }
        let t_send = Instant::now();
        // The next chunk, if this one leaves nothing to try again, is taken while this one's
        // acknowledgements are awaited: the sends stay one after the other, in commit order.
        let rest = &todo[chunk_len..];
        let next_chunk: Option<Vec<i64>> = (again.is_empty()
            && !rest.is_empty()
            && may_take(config, &defer, saw_busy)
            && aside.is_empty())
        .then(|| rest[..rest.len().min(config.batch_size)].to_vec());
        let outcomes = if events.is_empty() {
            Vec::new()
        } else {
            let take_next = async {
                match &next_chunk {
                    Some(c) => Some((
                        c.clone(),
                        rows::take(
                            pool,
                            c,
                            &known,
                            &config.group,
                            &config.topics,
                            config.lease / 2,
                        )
                        .await,
                    )),
                    None => None,
                }
            };
            tracing::trace!(seqs = ?events.iter().map(|e| e.seq).collect::<Vec<_>>(), left = ?locked.left, busy = ?locked.busy.iter().map(|b| b.seq).collect::<Vec<_>>(), taken = locked.is_taken(), "WAL relay: handing a chunk over");
            let mut acks = Box::pin(transport.send(&events).await);
            let (acked, next_taken) =
                tokio::join!(tokio::time::timeout(SLOW_ACK, acks.as_mut()), take_next);
            prefetched_at = Instant::now();
            prefetched = next_taken;
            match acked {
                Ok(outcomes) => outcomes,
                // Slow: set aside, with its transaction, while the other keys go on; its
                // keys' later rows are carried behind it (`held_aside` above).
                Err(_) => {
                    if let Some((_, Ok(Some(l)))) = prefetched.take() {
                        l.undo().await;
                    }
                    tracing::debug!(
                        rows = events.len(),
                        aside = aside.len() + 1,
                        "WAL relay: a chunk's acknowledgements are slow; set aside, other keys go on"
                    );
                    let mut seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
                    seqs.extend(refused.iter().map(|f| f.seq));
                    seqs.sort_by_key(|s| known.get(s).copied().unwrap_or(usize::MAX));
                    aside.push(Chunk::new(seqs, locked, events, refused, acks));
                    (todo, waiting) = past_chunk(&todo, chunk_len, &again);
                    failures = 0;
                    continue;
                }
            }
        };
        let t_mark = Instant::now();
        let finished = finish(
            transport, config, judge, lease, stats, locked, &events, refused, outcomes,
        )
        .await?;
        tracing::debug!(
            rows = chunk.len(),
            visible_us = (t_lock - started).as_micros() as u64,
            lock_us = (t_send - t_lock).as_micros() as u64,
            send_us = (t_mark - t_send).as_micros() as u64,
            mark_us = t_mark.elapsed().as_micros() as u64,
            "WAL relay: chunk timings"
        );
        let written = match finished {
            Finished::Marked { written } => written,
            Finished::NotMarked => {
                failures += 1;
                tokio::time::sleep(config.backoff.delay(failures).min(Duration::from_secs(10)))
                    .await;
                continue;
            }
        };
        // A row written back holds its key's later rows back: the next chunk, taken
        // before this one's outcomes were known, is undone and done again.
        if !written.is_empty() {
            if let Some((_, Ok(Some(l)))) = prefetched.take() {
                l.undo().await;
            }
            // The rows written back are no longer the stream's to publish: a key's later
            // row behind one is left to the sweep, not taken past it.
            for f in &written {
                known.remove(&f.seq);
            }
        }
        // Done with the chunk, except its deferred and busy rows (and their keys' later
        // rows): they stay ahead of the rest, in commit order.
        let rest_empty = todo.len() == chunk_len;
        (todo, waiting) = past_chunk(&todo, chunk_len, &again);
        if rest_empty {
            if let Some((_, Ok(Some(l)))) = prefetched.take() {
                l.undo().await;
            }
            if todo.is_empty() && aside.is_empty() {
                busy.saw(&[]);
            }
            return Ok(Carry { rows: todo });
        }
        failures = 0;
    }
    if let Some((_, Ok(Some(l)))) = prefetched.take() {
        l.undo().await;
    }
    busy.saw(&[]);
    Ok(Carry::default())
}

/// What is left of `todo` once its first `chunk_len` rows were done: the chunk's rows to try
/// again (`again`: busy, deferred, and their keys' later rows) ahead of the rest, in commit
/// order, and how many those are.
fn past_chunk(
    todo: &[i64],
    chunk_len: usize,
    again: &std::collections::HashSet<i64>,
) -> (Vec<i64>, usize) {
    let mut next: Vec<i64> = todo[..chunk_len]
        .iter()
        .copied()
        .filter(|s| again.contains(s))
        .collect();
    let waiting = next.len();
    next.extend_from_slice(&todo[chunk_len..]);
    (next, waiting)
}

/// How a chunk's outcomes were recorded.
enum Finished {
    /// Marked: the rows written back (failed, held back) and parked.
    Marked {
        written: Vec<crate::complete::Failure>,
    },
    /// The mark failed (the database): nothing of the chunk is marked; it is published again.
    NotMarked,
}

/// Records a chunk's `outcomes` (one per event of `events`): judged as polling judges them,
/// marked in the chunk's transaction with the rows `refused` before they were sent, counted
/// and logged. [`LeaseLost`]: the marks were refused.
#[allow(clippy::too_many_arguments)]
async fn finish<T: Transport>(
    transport: &T,
    config: &RelayConfig,
    judge: &crate::outcome::Judge,
    lease: &lease::Held,
    stats: &mut RelayStats,
    locked: rows::Locked,
    events: &[OutboundEvent],
    refused: Vec<crate::complete::Failure>,
    outcomes: Vec<Result<(), crate::transport::PublishError>>,
) -> Result<Finished, LeaseLost> {
    // A failed event is written back as polling writes it back (`outcome::Judge`): held
    // for a retry with backoff (counting an attempt unless the destination was
    // unavailable or waits, e.g. a missing topic), parked once its attempts are used up or
    // when refused for good, and its key's later events of the send released behind it.
    // Held, it holds its key's later rows back (`rows::lock` leaves them), and the sweep
    // (`super::sweep`) publishes them in order once it is due.
    let worst = outcomes.iter().find_map(|o| match o {
        Err(err) if err.kind != FailureKind::HeldBack => Some(err.clone()),
        _ => None,
    });
    let crate::outcome::Verdict {
        published,
        failures: mut written,
    } = judge.verdict(events, outcomes);
    written.extend(refused);
    let marked = locked
        .mark(
            &published,
            &written,
            config.delete_on_publish,
            config.history.is_some(),
            lease,
        )
        .await;
    match marked {
        Ok(false) => {
            transport.recorded(events, false);
            tracing::warn!(
                rows = published.len(),
                "WAL relay: marks refused: the slot's lease moved to another relay"
            );
            Err(LeaseLost)
        }
        Ok(true) => {
            transport.recorded(events, true);
            let parked = written.iter().filter(|f| f.park).count();
            let held_back = written.iter().filter(|f| !f.hold && !f.counts).count();
            let retried = written.len() - parked - held_back;
            stats.published += published.len() as u64;
            stats.parked += parked as u64;
            stats.retried += retried as u64;
            stats.held_back += held_back as u64;
            metrics::counter!("postal_relay_published_total").increment(published.len() as u64);
            metrics::counter!("postal_relay_failed_total").increment(parked as u64);
            metrics::counter!("postal_relay_retried_total").increment(retried as u64);
            metrics::counter!("postal_relay_held_back_total").increment(held_back as u64);
            for p in written.iter().filter(|f| f.park) {
                tracing::warn!(seq = p.seq, reason = ?p.reason, "WAL relay: an event is parked (refused for good, or its attempts used up); its key's later events are left pending behind it");
            }
            if let Some(err) = worst {
                tracing::warn!(reason = %err, rows = retried, "WAL relay: a publish failed; written back for a retry with backoff (the sweep publishes it when due), its key's later events wait for it, other keys go on");
            }
            Ok(Finished::Marked { written })
        }
        Err(e) => {
            transport.recorded(events, false);
            // As polling counts a batch it could not record (alert `PostalBatchRecordFailures`).
            metrics::counter!("postal_relay_record_failures_total").increment(1);
            tracing::warn!(error = %e, "WAL relay: could not mark published rows; publishing the batch again (duplicates carry the same ce_id)");
            Ok(Finished::NotMarked)
        }
    }
}

/// Waits, until `deadline`, for the chunks aside and records them (a graceful stop).
/// `true` when every one was marked.
#[allow(clippy::too_many_arguments)]
pub(super) async fn settle_aside<T: Transport>(
    transport: &T,
    config: &RelayConfig,
    judge: &crate::outcome::Judge,
    lease: &lease::Held,
    stats: &mut RelayStats,
    aside: &mut Aside<T>,
    deadline: tokio::time::Instant,
) -> bool {
    while !aside.is_empty() {
        let Ok(Some(mut c)) = tokio::time::timeout_at(deadline, aside.oldest()).await else {
            return false;
        };
        let outcomes = c.outcomes();
        match finish(
            transport, config, judge, lease, stats, c.locked, &c.events, c.refused, outcomes,
        )
        .await
        {
            Ok(Finished::Marked { .. }) => {}
            _ => return false,
        }
    }
    true
}

/// The rows of one call of [`publish`]: the carried ones, then the batch's, each once.
#[derive(Debug, PartialEq)]
struct Order {
    /// In the order they are done.
    todo: Vec<i64>,
    /// Each row's place in `todo` (after the rows aside, ranked first): the rank
    /// [`rows::take`] and [`rows::lock`] compare, which must be the order the rows are sent
    /// in. The stream gives a row again when a relay
    /// writes it back after a failed publish (inserted again, same `seq`), and a carried row
    /// may be given again that way: the row is done once, at its first place, and ranked
    /// there. (Ranked at its last place while sent at its first, a key's later row passed
    /// the check and went out before the row's earlier ones: seed 4481965649440346300.)
    known: rows::Known,
    /// How many rows of `todo`'s head are carried ones.
    carried: usize,
}

impl Order {
    /// The rows `ahead` (in chunks aside: ranked first, not to do), then `carried`, then
    /// `batch`.
    fn of(ahead: &[i64], carried: Vec<i64>, batch: &[i64]) -> Order {
        let mut known = rows::Known::with_capacity(ahead.len() + carried.len() + batch.len());
        for (rank, &s) in ahead.iter().enumerate() {
            known.insert(s, rank);
        }
        let base = known.len();
        let mut todo = Vec::with_capacity(carried.len() + batch.len());
        let mut add = |s: i64, todo: &mut Vec<i64>| {
            if let std::collections::hash_map::Entry::Vacant(e) = known.entry(s) {
                e.insert(base + todo.len());
                todo.push(s);
            }
        };
        for s in carried {
            add(s, &mut todo);
        }
        let carried = todo.len();
        for &s in batch {
            add(s, &mut todo);
        }
        Order {
            todo,
            known,
            carried,
        }
    }
}

/// A chunk's rows taken ahead ([`rows::take`]), with the chunk they were taken for.
type Ahead = (Vec<i64>, Result<Option<rows::Locked>, sqlx::Error>);

/// Whether a chunk may be taken in one statement ([`rows::take`]): nothing in the batch is
/// deferred, no row of it was found locked by another session, and published rows are
/// deleted.
fn may_take(config: &RelayConfig, defer: &std::collections::HashSet<i64>, saw_busy: bool) -> bool {
    config.delete_on_publish && defer.is_empty() && !saw_busy
}

/// Rows of the batch that another session holds locked, as the relay says so: one warning
/// naming the row and the session when a row is first found busy, and past [`STALL_AFTER`]
/// the relay's health (`/readyz`) not ready, until no row is busy.
pub(super) struct BusyWatch<'a> {
    health: &'a RelayHealth,
    /// The busy rows seen last (by seq), and since when the batch has had busy rows.
    seen: Vec<i64>,
    since: Option<Instant>,
    stalled: bool,
}

impl<'a> BusyWatch<'a> {
    pub(super) fn new(health: &'a RelayHealth) -> Self {
        BusyWatch {
            health,
            seen: Vec::new(),
            since: None,
            stalled: false,
        }
    }

    /// The busy rows of the last lock (none: the batch goes on).
    pub(super) fn saw(&mut self, busy: &[rows::Busy]) {
        let Some(first) = busy.first() else {
            if self.since.take().is_some() {
                tracing::info!("WAL relay: the outbox rows locked by another session are free again; publishing them");
            }
            if std::mem::take(&mut self.stalled) {
                self.health.set(None);
            }
            self.seen.clear();
            return;
        };
        let since = *self.since.get_or_insert_with(Instant::now);
        for b in busy {
            if !self.seen.contains(&b.seq) {
                tracing::warn!(seq = b.seq, topic = %b.topic, key = %b.key, blocking_pid = ?b.pid,
                    "WAL relay: an outbox row is locked by another session; its key's later events wait for it, other keys go on, and the slot is not confirmed past it meanwhile: end that session's transaction if it is stuck");
            }
        }
        self.seen = busy.iter().map(|b| b.seq).collect();
        let waited = since.elapsed();
        if waited >= STALL_AFTER {
            let pid = first
                .pid
                .map_or_else(|| "a session not known".to_owned(), |p| format!("pid {p}"));
            let problem = format!(
                "outbox row seq {} (topic {}, key {}) has been locked by another session ({pid}) for {}s: its key's events wait and the slot (and the WAL it keeps) is not confirmed past it; end that session's transaction (pg_terminate_backend) if it is stuck",
                first.seq,
                first.topic,
                first.key,
                waited.as_secs()
            );
            if !self.stalled {
                tracing::warn!("WAL relay stalled: {problem}");
                self.stalled = true;
            }
            self.health.set(Some(problem));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Order;

    /// Guarantee: a row the stream gives twice (written back after a failed publish, or
    /// carried and given again) is done once, and ranked where it is done, so that the check
    /// of a key's earlier rows compares the order the rows are sent in.
    #[test]
    fn a_row_given_twice_is_done_and_ranked_at_its_first_place() {
        // Carried 22 and 174; the batch gives 161, 22 again (written back), 174 again, 180.
        let o = Order::of(&[], vec![22, 174], &[161, 22, 174, 180]);
        assert_eq!(o.todo, vec![22, 174, 161, 180]);
        assert_eq!(o.carried, 2);
        for (rank, seq) in o.todo.iter().enumerate() {
            assert_eq!(o.known[seq], rank, "seq {seq}");
        }
        let o = Order::of(&[], vec![], &[5, 7, 5]);
        assert_eq!((o.todo, o.carried, o.known[&5]), (vec![5, 7], 0, 0));
    }

    /// Guarantee: the rows of chunks set aside (acknowledgements slow) rank before every row
    /// of the call and are not done again in it, even when the stream gives them again.
    #[test]
    fn rows_aside_rank_first_and_are_not_done_again() {
        let o = Order::of(&[10, 12], vec![22], &[12, 30]);
        assert_eq!(o.todo, vec![22, 30]);
        assert_eq!(o.carried, 1);
        assert_eq!((o.known[&10], o.known[&12]), (0, 1));
        assert_eq!((o.known[&22], o.known[&30]), (2, 3));
    }
}
