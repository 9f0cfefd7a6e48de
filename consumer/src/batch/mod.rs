//! Throughput mode: several records of a partition in one transaction.
//!
//! The batch's dedup rows are written in one statement (`INSERT … ON CONFLICT DO NOTHING
//! RETURNING`: the new ones are the plan), the bodies run, the offset advances once: no
//! statement of the runtime's between two bodies. A body cannot end the transaction under the
//! others unnoticed ([`ended`]: its `COMMIT` is refused, and the session is read-only outside
//! the batch's transaction, [`session`]). The first pass runs the bodies without savepoints;
//! if any of them fails, the transaction is rolled back and the batch runs again with a
//! savepoint around each body, so the failure is isolated: a permanent failure becomes a dead
//! letter in the same transaction and the rest commit; a retryable failure commits the records
//! before it and retries it (with backoff) at the head of the next transaction, so the
//! partition's order holds.

mod ended;
mod failure;
mod run;
mod session;

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;

use postal_shared::EventId;
use sqlx::Connection;
use tracing::Instrument;

use crate::config::UnknownTypes;
use crate::dead_letter::Reason;
use crate::offsets::{self, Ownership};
use crate::partition::{run_body, Attempt, BodyFailure, Dead, Head, Held, Retry, Step, Worker};
use crate::record::{meta, Meta, Record};
use crate::route::Route;
use failure::{abandon, after_gone, release, roll_back};
use run::Run;

/// What one batch transaction committed.
#[derive(Default)]
struct Committed {
    /// Records finished (applied, duplicate, skipped or dead-lettered), from the head.
    done: usize,
    applied: u64,
    duplicates: u64,
    skipped: u64,
    dead: u64,
    /// Keys this transaction made held (their records from here on are held too).
    held_keys: Vec<Vec<u8>>,
    /// Bytes this transaction holds (`hold_or_bound`).
    held_bytes: i64,
    /// The record after the finished ones failed retryably: (error, whose failure).
    stopped: Option<(String, Retry)>,
    /// A body rolled the transaction back under the runtime: nothing committed
    /// ([`ended`]).
    rolled_back: Option<ended::RolledBack>,
    /// The seal refused before the commit in a transaction still the batch's (`SET
    /// CONSTRAINTS ALL IMMEDIATE` in a body, [`ended::Sealed::RefusedEarly`]): nothing
    /// committed; the records run one per transaction, unsealed, from here in this call.
    unseal: bool,
}

impl Worker {
    pub(crate) async fn process_batch(&self, own: &Ownership, records: Vec<Record>) -> Step {
        let consumer = self.shared.config.consumer.clone();
        let mut queue: VecDeque<Record> = records.into();
        let mut head_attempts = 0u32;
        // The head's last counted failure: said on its dead letter (or hold) when its attempts
        // are used up, as one at a time.
        let mut head_error = String::new();
        let mut outages = 0u32;
        let mut isolate = false;
        // How many of the queue's records the next transaction takes. A transaction that fails
        // with no body to blame (its COMMIT: a deferred constraint; its session ended by the
        // server for idling: `idle_in_transaction_session_timeout`, 25P03) is tried again with
        // half as many, down to the head alone, whose failures then count as its attempts (and
        // end in a dead letter or a hold, as with one record per transaction). Doubled again
        // after each commit, up to `fit`: what fitted since the idle timeout last ended a
        // session (an outage leaves it), kept from one poll batch to the next and grown by a
        // sixteenth per commit (a batch whose handlers' outside work adds up past the idle timeout would
        // otherwise be too large again every other transaction, each time running twice before
        // it is ended: measured 3 to 4 times slower than one record per transaction,
        // `batch_split_attack::`).
        let fit = |limit: usize| match self.fit.load(Ordering::Relaxed) {
            0 => limit,
            fit => limit.min(fit),
        };
        let mut limit = fit(queue.len());
        while !queue.is_empty() {
            if self.cancel.is_cancelled() {
                return Step::Stop;
            }
            let exhausted = head_attempts >= self.shared.config.max_attempts;
            let started = std::time::Instant::now();
            let take = limit.clamp(1, queue.len());
            let result = self
                .batch_attempt(
                    own,
                    &queue.make_contiguous()[..take],
                    isolate,
                    exhausted.then_some(head_error.as_str()),
                    // Past `max_attempts` the count only paces the retries of the transaction
                    // that records the head's end (`head_failed`): what it records is the
                    // attempts its handler had, as one at a time.
                    head_attempts.min(self.shared.config.max_attempts),
                )
                .await;
            metrics::histogram!("postal_consumer_transaction_seconds", "consumer" => consumer.clone(), "topic" => self.topic.clone())
                .record(started.elapsed().as_secs_f64());
            match result {
                Ok(Committed {
                    rolled_back: Some(rb),
                    ..
                }) => {
                    // A body rolled the transaction back ([`ended`]): the records before it
                    // alone next, then its record(s) alone at the head, where each such end is
                    // an attempt.
                    if rb.before > 0 {
                        limit = rb.before;
                    } else if !rb.alone {
                        limit = 1;
                    } else {
                        head_error.clone_from(&rb.error);
                        if !self.head_failed(&mut head_attempts, &rb.error).await {
                            return Step::Stop;
                        }
                    }
                }
                Ok(c) => {
                    let topic = &self.topic;
                    let stats = &self.shared.stats;
                    stats.applied(&consumer, topic, c.applied);
                    stats.duplicates(&consumer, topic, c.duplicates);
                    stats.skipped(&consumer, topic, c.skipped);
                    stats.dead_letters(&consumer, topic, c.dead);
                    if c.dead > 0 {
                        self.shared.dlq_wake.notify_one();
                    }
                    if c.done > 0 {
                        // The partition advanced: the stall watchdog's clock starts again
                        // (a poll batch of many transactions is no stall while they commit).
                        self.queued.waiting.advanced();
                        head_attempts = 0;
                        head_error.clear();
                        outages = 0;
                        let _ = self
                            .fit
                            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |f| {
                                (f > 0).then(|| f + (f / 16).max(1))
                            });
                        limit = fit(limit.saturating_mul(2));
                    }
                    queue.drain(..c.done);
                    if c.unseal {
                        // A body set the seal off before the commit ([`ended::warn_early`]):
                        // the rest of this call runs one record per transaction, exactly as
                        // with `max_batch` 1 (its retries, its handling of a body that ends
                        // its transaction).
                        return self
                            .one_at_a_time(
                                own,
                                queue,
                                head_attempts.min(self.shared.config.max_attempts),
                                &head_error,
                            )
                            .await;
                    }
                    match c.stopped {
                        None => isolate = false,
                        Some((e, Retry::Outage)) => {
                            tracing::warn!(error = %e, "dependency unavailable; retrying (does not count as an attempt)");
                            if !self.wait(outages).await {
                                return Step::Stop;
                            }
                            outages = outages.saturating_add(1);
                        }
                        Some((e, Retry::Handler | Retry::IdleEnded)) => {
                            head_attempts += 1;
                            head_error.clone_from(&e);
                            if head_attempts < self.shared.config.max_attempts {
                                self.shared.stats.retries(&consumer, &self.topic, 1);
                                tracing::warn!(error = %e, attempt = head_attempts, "handler failed; retrying");
                                if !self.wait(head_attempts - 1).await {
                                    return Step::Stop;
                                }
                            }
                        }
                    }
                }
                Err(Attempt::Paused) => return Step::Paused,
                Err(Attempt::OverBound(need)) => return Step::OverBound(need),
                Err(Attempt::Fenced) => {
                    self.shared.stats.fenced(&consumer, &self.topic, 1);
                    tracing::info!(topic = %self.topic, partition = self.partition, "another consumer took the partition over; rolled back");
                    return Step::Fenced;
                }
                Err(Attempt::Permanent(..)) | Err(Attempt::Retryable(_)) if !isolate => {
                    // A body failed in the optimistic pass: run again with savepoints.
                    isolate = true;
                }
                Err(Attempt::SessionEnded(e)) if take > 1 => {
                    // The server ended the session for idling: the handlers' time outside the
                    // database added up past the DBA's timeout. Fewer records, and what fits is
                    // kept (a throughput matter only).
                    limit = take / 2;
                    self.fit.store(limit, Ordering::Relaxed);
                    tracing::warn!(error = %e, records = take, "batch transaction ended by the server for idling; trying the first {limit} records alone");
                }
                Err(Attempt::SessionEnded(e)) => {
                    // The head alone sat idle past the timeout: its attempt, as one at a time
                    // (after `max_attempts` it is dead-lettered or held, and the partition
                    // moves on).
                    head_error.clone_from(&e);
                    if !self.head_failed(&mut head_attempts, &e).await {
                        return Step::Stop;
                    }
                }
                Err(Attempt::Unavailable(e)) => {
                    // An outage, or a session the server ended mid-transaction for another
                    // reason (a restart, a terminated backend): waited out, never counted as an
                    // attempt, as one at a time. (Counting a lost session of the head alone,
                    // when the database answered afterwards or when the transaction outlasted
                    // the DBA's `idle_in_transaction_session_timeout`, dead-lettered innocent
                    // events on outages: `batch_fit_attack::`, `batch_rule_attack::`; the
                    // server's own word, 25P03, is what tells an idle end from an outage.)
                    // Fewer records next time all the same.
                    limit = (take / 2).max(1);
                    tracing::warn!(error = %e, records = take, "batch transaction failed; retrying");
                    if !self.wait(outages).await {
                        return Step::Stop;
                    }
                    outages = outages.saturating_add(1);
                }
                Err(Attempt::Retryable(e)) | Err(Attempt::Permanent(_, e)) if take > 1 => {
                    // Failed with savepoints around every body and none to blame (at COMMIT):
                    // split until the failing record is alone.
                    limit = take / 2;
                    tracing::warn!(error = %e, records = take, "batch transaction failed with no handler to blame; trying the first {limit} records alone");
                }
                Err(Attempt::Retryable(e)) | Err(Attempt::Permanent(_, e)) => {
                    head_error.clone_from(&e);
                    if !self.head_failed(&mut head_attempts, &e).await {
                        return Step::Stop;
                    }
                }
            }
        }
        Step::Done
    }

    /// The records of `queue`, one per transaction, as with `max_batch` 1
    /// ([`Worker::process`]): after a body set the seal off before the commit. The head's
    /// attempts so far (`head_attempts`, the last failing with `head_error`) go on counting.
    async fn one_at_a_time(
        &self,
        own: &Ownership,
        queue: VecDeque<Record>,
        head_attempts: u32,
        head_error: &str,
    ) -> Step {
        for (i, record) in queue.iter().enumerate() {
            let step = if i == 0 {
                self.process_after(own, record, head_attempts, head_error)
                    .await
            } else {
                self.process(own, record).await
            };
            match step {
                // Each record's transaction is the partition advancing, as one at a time.
                Step::Done => self.queued.waiting.advanced(),
                other => return other,
            }
        }
        Step::Done
    }

    /// The head alone failed with no handler to blame (at COMMIT): one of
    /// its attempts, as with one record per transaction; once they are used up it is
    /// dead-lettered (or held) without running its handler. A transaction that cannot even do
    /// that (a read-only database) is retried with backoff too, saying so. False: stopped.
    async fn head_failed(&self, head_attempts: &mut u32, e: &str) -> bool {
        let consumer = &self.shared.config.consumer;
        *head_attempts += 1;
        if *head_attempts < self.shared.config.max_attempts {
            self.shared.stats.retries(consumer, &self.topic, 1);
            tracing::warn!(error = %e, attempt = *head_attempts, "transaction failed; retrying");
        } else if *head_attempts > self.shared.config.max_attempts {
            tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot record the outcome; retrying");
        }
        if *head_attempts == self.shared.config.max_attempts {
            // The next transaction dead-letters (or holds) the head: at once.
            return true;
        }
        self.wait(*head_attempts - 1).await
    }

    /// One transaction over `queue`. Without `isolate`, any body failure aborts the whole
    /// transaction (`Err`), and the caller retries with `isolate`. `head_exhausted`: the head
    /// used up its attempts (their last error), and is dead-lettered or held without running.
    async fn batch_attempt(
        &self,
        own: &Ownership,
        queue: &[Record],
        isolate: bool,
        head_exhausted: Option<&str>,
        head_attempts: u32,
    ) -> Result<Committed, Attempt> {
        let mut session = session::Session::open(&self.shared.pool)
            .await
            .map_err(Attempt::db)?;
        let begin = session.begin();
        let refusals = session.refusals;
        let r = self
            .attempt_in(
                session.conn(),
                begin,
                refusals,
                own,
                queue,
                isolate,
                head_exhausted,
                head_attempts,
            )
            .await;
        session.close().await;
        r
    }

    /// [`Self::batch_attempt`] on `conn` (a [`session::Session`]'s).
    #[allow(clippy::too_many_arguments)] // the session's and the attempt's state, passed through
    async fn attempt_in(
        &self,
        conn: &mut sqlx::PgConnection,
        begin: &str,
        refusals: i64,
        own: &Ownership,
        queue: &[Record],
        isolate: bool,
        head_exhausted: Option<&str>,
        head_attempts: u32,
    ) -> Result<Committed, Attempt> {
        let config = &self.shared.config;
        let mut tx = conn
            .begin_with(self.shared.batch_begin_statement(begin, &self.topic, true))
            .await
            .map_err(Attempt::db)?;
        let metas: Vec<_> = queue.iter().map(meta).collect();
        let ids: Vec<EventId> = metas
            .iter()
            .filter_map(|m| m.as_ref().ok().map(|m| m.id))
            .collect();
        // The events' dedup rows, all in one statement (those that were new: the plan), and
        // the transaction's id. A body cannot commit them early: the seal ([`ended`]).
        let (new, xid) = crate::dedup::record_batch(&mut tx, &config.consumer, &ids)
            .await
            .map_err(Attempt::db)?;
        let planned: HashSet<EventId> = new.into_iter().collect();
        // The rows this transaction wrote.
        let fresh = planned.clone();
        // Whether a body ran (without a savepoint) since the transaction was last checked
        // ([`ended`]): a runtime write checks first.
        let mut unchecked = false;
        let body_at = |k: usize, ids: Vec<EventId>, alone: bool, handler: &str, refused: bool| {
            ended::EndedAt {
                before: k,
                ids,
                alone,
                handler: handler.to_string(),
                xid: String::new(),
                next_offset: None,
                refused,
            }
        };
        // The ids whose first record in this batch was handled: later copies are duplicates.
        let mut claimed: HashSet<EventId> = HashSet::new();
        // The ids whose dedup row stays: applied, or dead-lettered (a later copy of a dead
        // letter must never be applied; replaying one is an operator's action). Every other
        // row inserted above is deleted before the commit, in one place (`settle_dedup`): no
        // path can leave an applied event without its row or keep the row of one not applied.
        let mut finished: HashSet<EventId> = HashSet::new();
        let mut c = Committed::default();
        // The partition's held keys, with those this transaction holds (`c.held_keys`).
        let mut held = self.held_keys();
        let mut i = 0;
        while i < queue.len() {
            let record = &queue[i];
            let held_key = record.key.as_ref().is_some_and(|k| held.contains(k));
            if held_key || metas[i].is_err() {
                // A runtime write follows: first, did a body before end the transaction?
                still_ours(&mut tx, &mut unchecked, xid.as_deref()).await?;
            }
            if held_key {
                // Its key waits for an earlier event: taken out of the batch and stored (also
                // without an envelope: dead-lettered at the release, in its key's order).
                self.hold_or_bound(&mut tx, &mut c, record, metas[i].as_ref().ok(), None)
                    .await?;
                c.done += 1;
                i += 1;
                continue;
            }
            let m = match &metas[i] {
                Ok(m) => m,
                Err((reason, error)) => {
                    self.dead_in(&mut tx, record, None, *reason, error, 0)
                        .await?;
                    c.dead += 1;
                    c.done += 1;
                    i += 1;
                    continue;
                }
            };
            if !planned.contains(&m.id) || claimed.contains(&m.id) {
                c.duplicates += 1;
                c.done += 1;
                i += 1;
                continue;
            }
            let route = self
                .shared
                .router
                .find(&record.topic, &m.event_type, m.schema_version)
                .cloned();
            if route.is_none() && config.unknown_types == UnknownTypes::Skip {
                // Skipped, as one at a time (no dedup row): a later copy of the id as a
                // routed type is still applied, not counted a duplicate of this one.
                c.skipped += 1;
                c.done += 1;
                i += 1;
                continue;
            }
            claimed.insert(m.id);
            let Some(route) = route else {
                still_ours(&mut tx, &mut unchecked, xid.as_deref()).await?;
                let error = format!(
                    "no handler for event type {} (schema version {}) on topic {}",
                    postal_shared::text::quoted(&m.event_type),
                    m.schema_version,
                    postal_shared::text::quoted(&record.topic)
                );
                self.dead_in(&mut tx, record, Some(m), Reason::UnknownType, &error, 0)
                    .await?;
                finished.insert(m.id);
                c.dead += 1;
                c.done += 1;
                i += 1;
                continue;
            };
            let gave_up = head_exhausted.filter(|_| i == 0).map(|last| match last {
                "" => format!("gave up after {head_attempts} attempts"),
                last => format!("gave up after {head_attempts} attempts: {last}"),
            });
            if gave_up.is_some() {
                still_ours(&mut tx, &mut unchecked, xid.as_deref()).await?;
            }
            if let Some(error) = gave_up
                .as_ref()
                .filter(|_| self.holds(record, Some(m), Some(route.name())))
            {
                let head = Head {
                    reason: Reason::RetriesExhausted,
                    error,
                    attempts: head_attempts as i32,
                };
                self.hold_or_bound(&mut tx, &mut c, record, Some(m), Some(head))
                    .await?;
                let key = record.key.clone().expect("held records have a key");
                held.insert(key.clone());
                c.held_keys.push(key);
                c.done += 1;
                i += 1;
                continue;
            }
            if let Some(error) = gave_up {
                self.dead_in(
                    &mut tx,
                    record,
                    Some(m),
                    Reason::RetriesExhausted,
                    &error,
                    head_attempts as i32,
                )
                .await?;
                finished.insert(m.id);
                c.dead += 1;
                c.done += 1;
                i += 1;
                continue;
            }
            if route.batched() {
                // The run of records from here that this batch handler applies: new events
                // routed to it, and copies of events already taken (duplicates: no effects);
                // anything else ends it.
                let mut candidates = Vec::new();
                let mut end = i + 1;
                while end < queue.len() {
                    let Ok(mj) = &metas[end] else { break };
                    if queue[end].key.as_ref().is_some_and(|k| held.contains(k)) {
                        break;
                    }
                    if planned.contains(&mj.id) && !claimed.contains(&mj.id) {
                        let same = self
                            .shared
                            .router
                            .find(&queue[end].topic, &mj.event_type, mj.schema_version)
                            .is_some_and(|r| same_route(r, &route));
                        if !same {
                            break;
                        }
                        claimed.insert(mj.id);
                        candidates.push(end);
                    }
                    end += 1;
                }
                let mut items = vec![i];
                items.extend(candidates);
                // The run's body is checked after it: the bodies before it, before.
                still_ours(&mut tx, &mut unchecked, xid.as_deref()).await?;
                let run = self
                    .batch_run(
                        &mut tx,
                        route.as_ref(),
                        queue,
                        &metas,
                        &items,
                        isolate,
                        refusals,
                        xid.as_deref(),
                    )
                    .await?;
                if let Ok(Run {
                    ended: Some((part, refused)),
                    applied,
                    ..
                }) = &run
                {
                    let ids = applied
                        .iter()
                        .chain(part)
                        .filter_map(|&k| metas[k].as_ref().ok().map(|m| m.id))
                        .collect();
                    let at = body_at(part[0], ids, part.len() == 1, route.name(), *refused);
                    // The run's records from its first on run again (not only from the
                    // call's: a culprit of an earlier call is not dead-lettered yet).
                    let at = self.ended_here(at, &xid, queue, c.done);
                    drop(tx);
                    return self
                        .settle_ended(conn, begin, own, &fresh, finished, c, at)
                        .await;
                }
                let run = match run {
                    Ok(run) => run,
                    Err(f) => return Err(abandon(tx, f).await),
                };
                if run.unseal {
                    return Ok(refused_early());
                }
                // Where the run's records stop being finished (a retryable failure, or a
                // culprit whose key is held: it is finished, held).
                let upto = match (&run.stopped, &run.held) {
                    (Some(s), _) => s.0,
                    (None, Some(h)) => h.0 + 1,
                    (None, None) => end,
                };
                for &k in &run.applied {
                    if let Ok(mk) = &metas[k] {
                        finished.insert(mk.id);
                    }
                }
                c.applied += run.applied.len() as u64;
                for (k, reason, error) in &run.dead {
                    let mk = metas[*k].as_ref().ok();
                    let ran = if *reason == Reason::Undecodable {
                        0
                    } else {
                        head_attempts + 1
                    };
                    self.dead_in(&mut tx, &queue[*k], mk, *reason, error, ran as i32)
                        .await?;
                    if let Some(mk) = mk {
                        finished.insert(mk.id);
                    }
                    c.dead += 1;
                }
                let mut taken = run.applied.len() + run.dead.len();
                if let Some((k, reason, error)) = &run.held {
                    let mk = metas[*k].as_ref().expect("batch items have their meta");
                    let head = Head {
                        reason: *reason,
                        error,
                        attempts: if *reason == Reason::Undecodable {
                            0
                        } else {
                            head_attempts as i32 + 1
                        },
                    };
                    self.hold_or_bound(&mut tx, &mut c, &queue[*k], Some(mk), Some(head))
                        .await?;
                    let key = queue[*k].key.clone().expect("held records have a key");
                    held.insert(key.clone());
                    c.held_keys.push(key);
                    taken += 1;
                }
                c.duplicates += ((i..upto).count() - taken) as u64;
                c.done += upto - i;
                if let Some((_, error, whose)) = run.stopped {
                    c.stopped = Some((error, whose));
                    break;
                }
                if run.held.is_some() {
                    // The run's records after the culprit have not run: the next
                    // transaction takes them, with the key held.
                    break;
                }
                i = end;
                continue;
            }
            let span = tracing::info_span!("postal.handle", handler = route.name(), event_id = %m.id, topic = %record.topic, partition = record.partition, offset = record.offset);
            crate::trace::continue_trace(&span, &record.headers);
            let outcome = if isolate {
                let mut sp = (*tx).begin().await.map_err(Attempt::db)?;
                let r = run_body(route.as_ref(), &mut sp, record, m)
                    .instrument(span)
                    .await;
                if ended::body_ended(&mut sp, xid.as_deref())
                    .await
                    .map_err(|e| after_gone(&r, e))?
                {
                    drop(sp);
                    let at = body_at(i, vec![m.id], true, route.name(), ended::refused(&r));
                    let at = self.ended_here(at, &xid, queue, c.done);
                    drop(tx);
                    return self
                        .settle_ended(conn, begin, own, &fresh, finished, c, at)
                        .await;
                }
                let refused = ended::refused(&r);
                let r = match r {
                    Ok(()) => release(sp).await?,
                    Err(f) => Err(roll_back(sp, f).await?),
                };
                if refused || ended::set_off_early(&mut tx, refusals, &r).await? {
                    // The seal fired before the commit, in a transaction still the batch's.
                    ended::warn_early(&self.topic, self.partition, Some(route.name()));
                    return Ok(refused_early());
                }
                r
            } else {
                // Checked before the next runtime write (or the commit).
                unchecked = true;
                run_body(route.as_ref(), &mut tx, record, m)
                    .instrument(span)
                    .await
            };
            i += 1;
            match outcome {
                Ok(()) => {
                    finished.insert(m.id);
                    c.applied += 1;
                    c.done += 1;
                }
                Err(f) if !isolate => return Err(abandon(tx, f).await),
                Err(BodyFailure::Dead(reason, error))
                    if self.holds(record, Some(m), Some(route.name())) =>
                {
                    let head = Head {
                        reason,
                        error: &error,
                        attempts: if reason == Reason::Undecodable {
                            0
                        } else {
                            head_attempts as i32 + 1
                        },
                    };
                    self.hold_or_bound(&mut tx, &mut c, record, Some(m), Some(head))
                        .await?;
                    let key = record.key.clone().expect("held records have a key");
                    held.insert(key.clone());
                    c.held_keys.push(key);
                    c.done += 1;
                }
                Err(BodyFailure::Dead(reason, error)) => {
                    let ran = if reason == Reason::Undecodable {
                        0
                    } else {
                        head_attempts + 1
                    };
                    self.dead_in(&mut tx, record, Some(m), reason, &error, ran as i32)
                        .await?;
                    finished.insert(m.id);
                    c.dead += 1;
                    c.done += 1;
                }
                Err(BodyFailure::Retry(error, whose)) => {
                    c.stopped = Some((error, whose));
                    break;
                }
            }
        }
        // Sealed for the commit below, and checked: a body since the last check may have ended
        // the transaction.
        match ended::sealed_or_ended(&mut tx, xid.as_deref(), refusals)
            .await
            .map_err(Attempt::db)?
        {
            ended::Sealed::Ours => {}
            ended::Sealed::Ended => {
                return Err(if unchecked {
                    ended_unnamed()
                } else {
                    not_by_a_body()
                });
            }
            ended::Sealed::RefusedEarly => {
                ended::warn_early(&self.topic, self.partition, None);
                return Ok(refused_early());
            }
        }
        settle_dedup(&mut tx, &config.consumer, &fresh, &finished).await?;
        if c.done > 0 {
            self.advance(&mut tx, own, queue[c.done - 1].offset + 1)
                .await??;
        }
        tx.commit().await.map_err(Attempt::db)?;
        self.now_held(c.held_keys.iter().cloned());
        Ok(c)
    }

    /// `at` completed with where the batch stands: its transaction's id, and the offset after
    /// the `done` records before the body (what a body's `COMMIT` kept).
    fn ended_here(
        &self,
        mut at: ended::EndedAt,
        xid: &Option<String>,
        queue: &[Record],
        done: usize,
    ) -> ended::EndedAt {
        at.xid = xid.clone().unwrap_or_default();
        at.next_offset = done.checked_sub(1).map(|p| queue[p].offset + 1);
        at
    }

    /// Moves the partition's stored offset to `next` in `tx`; `Ok(Err(_))`: another consumer
    /// took the partition over, or its group or topic is paused (the update did nothing).
    async fn advance(
        &self,
        tx: &mut sqlx::PgConnection,
        own: &Ownership,
        next: i64,
    ) -> Result<Result<(), Attempt>, Attempt> {
        let config = &self.shared.config;
        let owned = offsets::advance(
            tx,
            &config.group,
            &self.topic,
            self.partition,
            own.epoch,
            next,
        )
        .await
        .map_err(Attempt::db)?;
        Ok(Attempt::owned(owned))
    }

    /// Holds `record` in the batch's transaction (`c.held_bytes`: what it holds so far);
    /// `Err(OverBound)` (the whole transaction rolls back) past the group's bound.
    async fn hold_or_bound(
        &self,
        tx: &mut sqlx::PgConnection,
        c: &mut Committed,
        record: &Record,
        meta: Option<&Meta>,
        head: Option<Head<'_>>,
    ) -> Result<(), Attempt> {
        match self
            .hold_in(tx, record, meta, head, c.held_bytes)
            .await
            .map_err(Attempt::db)?
        {
            Held::Stored => {
                c.held_bytes += record.weight as i64;
                Ok(())
            }
            // Counted when it was first held: not in what this transaction holds.
            Held::Again => Ok(()),
            Held::OverBound(bytes) => Err(Attempt::OverBound(c.held_bytes + bytes)),
        }
    }

    async fn dead_in(
        &self,
        tx: &mut sqlx::PgConnection,
        record: &Record,
        meta: Option<&Meta>,
        reason: Reason,
        error: &str,
        attempts: i32,
    ) -> Result<(), Attempt> {
        let dead = Dead {
            meta,
            reason,
            error,
            attempts,
        };
        self.record_dead(tx, record, dead)
            .await
            .map_err(Attempt::db)
    }
}

/// The seal refused before the commit in a transaction still the batch's: nothing of it is
/// committed (the caller drops it), and the records run one per transaction from here.
fn refused_early() -> Committed {
    Committed {
        unseal: true,
        ..Committed::default()
    }
}

/// Before a runtime write in the batch's transaction: if a body ran (without a savepoint) since
/// the last check, did one of them end the transaction? Then the batch runs again with a
/// savepoint around each body, which names the body ([`ended_unnamed`]).
async fn still_ours(
    tx: &mut sqlx::PgConnection,
    unchecked: &mut bool,
    xid: Option<&str>,
) -> Result<(), Attempt> {
    if std::mem::take(unchecked) && ended::body_ended(tx, xid).await.map_err(Attempt::db)? {
        return Err(ended_unnamed());
    }
    Ok(())
}

/// A body run without a savepoint ended the batch's transaction (nothing of it was kept:
/// [`ended`]); which one is found by running the batch again with a savepoint around each.
fn ended_unnamed() -> Attempt {
    Attempt::Retryable(
        "a handler ended the batch's transaction (a COMMIT or ROLLBACK in its SQL); running the batch again with a savepoint around each handler".into(),
    )
}

/// The batch's transaction ended where no body ran since it was last checked: never expected
/// (only a body's SQL ends it); the attempt fails and the batch runs again.
fn not_by_a_body() -> Attempt {
    Attempt::Retryable("the batch's transaction ended with no handler body to blame".into())
}

/// Whether two routes are the same handler.
fn same_route(a: &std::sync::Arc<dyn Route>, b: &std::sync::Arc<dyn Route>) -> bool {
    std::ptr::addr_eq(std::sync::Arc::as_ptr(a), std::sync::Arc::as_ptr(b))
}

/// Deletes the dedup rows this transaction inserted (`fresh`) for events it did not finish
/// (`finished`: applied or dead-lettered): records after a retryable stop, skipped unknown
/// types. The only place a batch deletes dedup rows.
async fn settle_dedup(
    tx: &mut sqlx::PgConnection,
    consumer: &str,
    fresh: &HashSet<EventId>,
    finished: &HashSet<EventId>,
) -> Result<(), Attempt> {
    let unfinished: Vec<EventId> = fresh.difference(finished).copied().collect();
    crate::dedup::forget_many(tx, consumer, &unfinished)
        .await
        .map_err(Attempt::db)
}
