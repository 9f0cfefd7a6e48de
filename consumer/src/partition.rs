//! One worker per owned partition: records in offset order, one transaction each holding the
//! dedup row, the handler's effects and the next offset.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use rdkafka::consumer::Consumer;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::config::{ConsumerConfig, UnknownTypes};
use crate::context::Ownership as OwnershipState;
use crate::dead_letter::{self, DeadLetter, Reason};
use crate::handler::{classify_sqlx, Class, HandlerError};
use crate::offsets::{self, Ownership};
use crate::record::{meta, Meta, Record};
use crate::route::{Failure, Route, Router};
use crate::stats::Stats;

/// What every worker of a runtime shares.
pub(crate) struct Shared {
    pub pool: PgPool,
    pub config: ConsumerConfig,
    pub router: Router,
    pub consumer: Client,
    pub state: Arc<Mutex<OwnershipState>>,
    pub stats: Arc<Stats>,
    pub dlq_wake: Arc<Notify>,
    pub permits: Semaphore,
    pub owner: String,
    /// Partitions assigned now (their buffers share the memory budget).
    pub assigned: AtomicUsize,
}

impl Shared {
    /// Bytes one partition's buffer may hold before its fetching pauses: its share of the
    /// memory budget, at most `partition_buffer_bytes`.
    fn partition_bytes(&self) -> usize {
        let c = &self.config;
        match c.memory_budget {
            None => c.partition_buffer_bytes,
            // At least 1 MiB (a fetch's worth, librdkafka's `max.partition.fetch.bytes`): a
            // smaller share would pause and resume the partition on every record.
            Some(b) => (b / 2 / self.assigned.load(Ordering::Relaxed).max(1)).clamp(
                MIN_PARTITION_SHARE,
                c.partition_buffer_bytes.max(MIN_PARTITION_SHARE),
            ),
        }
    }

    /// Opens a processing transaction, with the session settings of `lost_connection_timeout`.
    pub(crate) async fn begin(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        postal_shared::cancel_safe::begin_with(&self.pool, self.config.begin_statement()).await
    }
}

/// What a partition's buffer holds: records and their bytes (see [`Record::weight`]).
#[derive(Default)]
pub(crate) struct Queued {
    records: AtomicUsize,
    bytes: AtomicUsize,
}

impl Queued {
    fn add(&self, records: usize, bytes: usize) {
        self.records.fetch_add(records, Ordering::AcqRel);
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    fn sub(&self, records: usize, bytes: usize) {
        self.records.fetch_sub(records, Ordering::AcqRel);
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Full: fetching pauses.
    fn full(&self, s: &Shared) -> bool {
        self.records.load(Ordering::Acquire) >= s.config.partition_buffer
            || self.bytes.load(Ordering::Acquire) >= s.partition_bytes()
    }

    /// Down to half on both counts: fetching resumes.
    fn drained(&self, s: &Shared) -> bool {
        self.records.load(Ordering::Acquire) <= s.config.partition_buffer / 2
            && self.bytes.load(Ordering::Acquire) <= s.partition_bytes() / 2
    }
}

/// The least share of the memory budget a partition's buffer gets.
const MIN_PARTITION_SHARE: usize = 1024 * 1024;

/// The runtime's side of a worker.
pub(crate) struct Inbox {
    pub tx: mpsc::UnboundedSender<Record>,
    pub queued: Arc<Queued>,
    pub paused: Arc<Mutex<bool>>,
}

impl Inbox {
    /// Queues a record; pauses fetching from the partition when its buffer is full (by
    /// records or by bytes).
    pub fn push(&self, shared: &Shared, record: Record) {
        let (topic, partition, weight) = (record.topic.clone(), record.partition, record.weight);
        // Counted before it is sent, so the worker never counts below zero.
        self.queued.add(1, weight);
        shared.stats.buffered(weight as i64);
        if self.tx.send(record).is_err() {
            // The worker stopped (fenced or revoked): the next owner reads the record.
            self.queued.sub(1, weight);
            shared.stats.buffered(-(weight as i64));
            return;
        }
        if self.queued.full(shared) {
            // Decided under the lock on a fresh count: the worker resumes under the same lock
            // after draining, so a partition is never left paused with an empty buffer.
            let mut paused = self.paused.lock().expect("pause flag");
            if !*paused && self.queued.full(shared) {
                if let Err(e) = shared.consumer.pause(&tpl(&topic, partition)) {
                    tracing::warn!(error = %e, topic, partition, "pausing the partition failed; its buffer keeps growing");
                } else {
                    *paused = true;
                }
            }
        }
    }
}

pub(crate) fn tpl(topic: &str, partition: i32) -> TopicPartitionList {
    let mut t = TopicPartitionList::new();
    t.add_partition(topic, partition);
    t
}

/// How processing one record ended.
pub(crate) enum Step {
    /// The partition moved past the record.
    Done,
    /// Stop the worker (revoked or shutting down); the record is left for the next owner.
    Stop,
    /// Another owner's claim bumped the partition's epoch: this transaction rolled back.
    Fenced,
}

/// How one ownership of a partition ended.
enum Owned {
    /// Cancelled (revoked, shutting down).
    Ended,
    /// Fenced by another claim while still assigned here; the lowest offset this ownership
    /// received while the stored offset was NULL (nothing committed yet), if any.
    Fenced(Option<i64>),
}

pub(crate) struct Worker {
    pub shared: Arc<Shared>,
    pub topic: String,
    pub partition: i32,
    pub rx: mpsc::UnboundedReceiver<Record>,
    pub queued: Arc<Queued>,
    pub paused: Arc<Mutex<bool>>,
    pub cancel: CancellationToken,
    /// The partition's turn: held from before the takeover until the worker returns.
    pub turn: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for Worker {
    /// Records left in the buffer (revoked, shutting down) leave the buffered-bytes count.
    fn drop(&mut self) {
        self.rx.close();
        let (mut n, mut bytes) = (0, 0);
        while let Ok(r) = self.rx.try_recv() {
            n += 1;
            bytes += r.weight;
        }
        if n > 0 {
            self.queued.sub(n, bytes);
            self.shared.stats.buffered(-(bytes as i64));
        }
    }
}

impl Worker {
    pub async fn run(mut self) {
        let _turn = tokio::select! {
            biased;
            _ = self.cancel.cancelled() => return,
            t = self.turn.clone().lock_owned() => t,
        };
        let mut fenced = 0u32;
        // With no stored offset, where the records this worker dropped begin.
        let mut floor: Option<i64> = None;
        loop {
            match self.own(floor).await {
                Owned::Ended => return,
                Owned::Fenced(seen) => {
                    floor = match (floor, seen) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    // Still assigned here (a revocation cancels the worker), yet another
                    // owner's claim bumped the epoch: typically a revoked worker elsewhere
                    // whose delayed claim landed after this one. Take the partition back
                    // rather than leave it without a worker until the next rebalance; if the
                    // other owner is live (a rebalance in progress), the two alternate, each
                    // fencing the other, until Kafka revokes one — never both committing.
                    tracing::info!(topic = %self.topic, partition = self.partition, "fenced while still assigned here; taking the partition over again");
                    if !self.wait(fenced).await {
                        return;
                    }
                    fenced = fenced.saturating_add(1);
                    // What was fetched for the lost ownership is read again after the seek.
                    // With no stored offset the seek goes to `floor`, so it must cover what
                    // arrived during the wait too (else those records are gone for good).
                    let (mut dropped, mut bytes) = (0, 0);
                    while let Ok(r) = self.rx.try_recv() {
                        dropped += 1;
                        bytes += r.weight;
                        floor = Some(floor.map_or(r.offset, |f| f.min(r.offset)));
                    }
                    self.dequeued(dropped, bytes);
                }
            }
        }
    }

    /// One ownership of the partition: claims it in the database (bumping its epoch), seeks
    /// to the stored offset and processes records until cancelled or fenced.
    async fn own(&mut self, floor: Option<i64>) -> Owned {
        let Some(own) = self.claim().await else {
            return Owned::Ended;
        };
        // Nothing committed yet: records from `floor` on were dropped by an earlier, fenced
        // ownership of this worker and must be read again.
        let mut next = own.next_offset.or(floor);
        let mut lowest: Option<i64> = None;
        // Until the first record is processed: whether the seek to the stored offset was
        // verified (see below), and while a second seek is awaited, the first offset seen
        // above the stored one.
        let mut verified = false;
        let mut landing: Option<i64> = None;
        let mut landing_since = std::time::Instant::now();
        let mut first = true;
        if let Some(n) = next {
            // Asynchronous seek (timeout 0): records below `n` that were fetched before it
            // takes effect are skipped below; records above it are checked (`verified`).
            if let Err(e) = self.shared.consumer.seek(
                &self.topic,
                self.partition,
                Offset::Offset(n),
                Duration::ZERO,
            ) {
                tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, stored = n, "seek to the stored offset failed; skipping older records instead");
            }
        }
        tracing::debug!(topic = %self.topic, partition = self.partition, epoch = own.epoch, next_offset = ?next, "partition taken over");
        let max_batch = self.shared.config.max_batch;
        // The (stored offset, high watermark) of the last stall recovery (see `check_stall`).
        let mut last_stall = None;
        loop {
            let head = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Owned::Ended,
                r = self.rx.recv() => match r { Some(r) => r, None => return Owned::Ended },
                _ = tokio::time::sleep(self.shared.config.stall_check) => {
                    // Idle: another claim (a `postal consumer reset` moving the stored offset,
                    // a late claim from elsewhere) shows only at the next commit, and none
                    // comes without records: look at the epoch now.
                    if self.epoch_moved(own.epoch).await {
                        return Owned::Fenced(lowest);
                    }
                    match (landing, next) {
                        // The second seek has not shown yet (lost?): issue it again.
                        (Some(seen), Some(n)) => {
                            landing_since = std::time::Instant::now();
                            match self.seek_stored(n, seen).await {
                                Some(bound) => landing = Some(bound),
                                None => return Owned::Ended,
                            }
                        }
                        _ => self.check_stall(next, &mut last_stall).await,
                    }
                    continue;
                }
            };
            let mut records = vec![head];
            while records.len() < max_batch {
                match self.rx.try_recv() {
                    Ok(r) => records.push(r),
                    Err(_) => break,
                }
            }
            self.dequeued(records.len(), records.iter().map(|r| r.weight).sum());
            if own.next_offset.is_none() {
                let o = records[0].offset;
                lowest = Some(lowest.map_or(o, |l: i64| l.min(o)));
            }
            if let Some(seen) = landing {
                // After the second seek the fetch restarts at the stored offset: records from
                // before it (all above `seen`, and queued ahead of any fetched after it) are
                // dropped until one at or below `seen` shows that the seek took effect.
                match records.iter().position(|r| r.offset <= seen) {
                    None => {
                        // Still the old position after a while on a busy partition: the seek
                        // was lost; issue it again (the idle tick never fires here).
                        if let (Some(n), true) = (
                            next,
                            landing_since.elapsed() >= self.shared.config.stall_check,
                        ) {
                            landing_since = std::time::Instant::now();
                            match self.seek_stored(n, seen).await {
                                Some(bound) => landing = Some(bound),
                                None => return Owned::Ended,
                            }
                        }
                        continue;
                    }
                    Some(p) => {
                        records.drain(..p);
                        landing = None;
                    }
                }
            }
            if let (true, Some(n)) = (first, next) {
                if records[0].offset > n && !verified {
                    // The fetch started above the stored offset: fetched before the seek took
                    // effect (a reassignment in this process, or Kafka's group offset ahead of
                    // the stored one after `postal consumer reset`), or there really is nothing
                    // in between. Processing it could skip records: seek again and drop what
                    // comes until the seek shows.
                    verified = true;
                    landing_since = std::time::Instant::now();
                    match self.seek_stored(n, records[0].offset).await {
                        Some(bound) => landing = Some(bound),
                        None => return Owned::Ended,
                    }
                    continue;
                }
                if records[0].offset > n {
                    tracing::warn!(topic = %self.topic, partition = self.partition, stored = n, first = records[0].offset,
                        "the broker delivered the partition from a later offset than the stored one, also after a second seek: records in between were not seen (compaction, retention, transaction markers, or a broker fault)");
                }
            }
            first = false;
            // Offsets strictly increase from the stored one: a record below it, or at or below
            // one already taken (the two seeks of a takeover can both deliver a run from the
            // stored offset), is dropped.
            let mut floor_offset = next.unwrap_or(i64::MIN);
            records.retain(|r| {
                let below = r.offset < floor_offset;
                if !below {
                    floor_offset = r.offset + 1;
                }
                if below {
                    tracing::trace!(topic = %self.topic, partition = self.partition, offset = r.offset, "below the stored offset; skipped");
                    self.shared
                        .stats
                        .replays_skipped(&self.shared.config.consumer, &self.topic, 1);
                }
                !below
            });
            let Some(last) = records.last().map(|r| r.offset) else {
                continue;
            };
            let permit = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Owned::Ended,
                p = self.shared.permits.acquire() => match p { Ok(p) => p, Err(_) => return Owned::Ended },
            };
            let step = if records.len() == 1 {
                self.process(&own, &records[0]).await
            } else {
                self.process_batch(&own, records).await
            };
            drop(permit);
            match step {
                Step::Done => {
                    next = Some(last + 1);
                    if !self.cancel.is_cancelled() {
                        self.shared
                            .state
                            .lock()
                            .expect("ownership state")
                            .pending_commits
                            .insert((self.topic.clone(), self.partition), last + 1);
                    }
                }
                Step::Stop => return Owned::Ended,
                Step::Fenced if self.cancel.is_cancelled() => return Owned::Ended,
                Step::Fenced => return Owned::Fenced(lowest),
            }
        }
    }

    /// Seeks to the stored offset `n` after records arrived from `seen` (above `n`), waiting
    /// for librdkafka to take the seek (retried a few times if it fails). Returns the landing
    /// bound: the seek has taken effect once a record at or below it arrives. `None` if
    /// cancelled meanwhile.
    ///
    /// If retention (or delete-records) moved the partition's log start past `n`, the records
    /// in between are gone: the seek goes to the log start instead, and when that is above
    /// `seen` the bound is the log start (every record from `n` to `seen` is gone, so a record
    /// of the earlier fetch at or below it is as good a start as the seek's).
    async fn seek_stored(&mut self, n: i64, seen: i64) -> Option<i64> {
        // A partition paused meanwhile (its buffer was full) would never deliver the record
        // that shows the seek took effect.
        self.resume_fetching();
        let low = {
            let consumer = self.shared.consumer.clone();
            let (topic, partition) = (self.topic.clone(), self.partition);
            tokio::task::spawn_blocking(move || {
                consumer.fetch_watermarks(&topic, partition, Duration::from_secs(5))
            })
            .await
            .ok()
            .and_then(Result::ok)
            .map(|(low, _)| low)
        };
        let target = match low {
            Some(low) if low > n => {
                tracing::warn!(topic = %self.topic, partition = self.partition, stored = n, log_start = low,
                    "records from the stored offset to the partition's log start were removed (retention or delete-records) before this group processed them; resuming from the log start");
                low
            }
            _ => n,
        };
        tracing::info!(topic = %self.topic, partition = self.partition, stored = n, target, first = seen,
            "records arrived from above the stored offset; seeking to the stored offset again");
        let mut failures = 0u32;
        loop {
            let consumer = self.shared.consumer.clone();
            let (topic, partition) = (self.topic.clone(), self.partition);
            let r = tokio::task::spawn_blocking(move || {
                consumer.seek(
                    &topic,
                    partition,
                    Offset::Offset(target),
                    Duration::from_secs(10),
                )
            })
            .await;
            match r {
                Ok(Ok(())) => break,
                Ok(Err(e)) if failures < 5 => {
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, stored = n, "seek to the stored offset failed; retrying");
                }
                Ok(Err(e)) => {
                    // Records above the stored offset are still dropped until one at or below
                    // `seen` comes; the stall check seeks again meanwhile.
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, stored = n, "seek to the stored offset keeps failing; trying again after the stall check");
                    break;
                }
                Err(_) => return None,
            }
            if !self.wait(failures).await {
                return None;
            }
            failures += 1;
        }
        (!self.cancel.is_cancelled()).then_some(seen.max(target))
    }

    /// Nothing arrived for `stall_check`: if the broker has records at or beyond the stored
    /// offset `next`, the fetch position was lost (seen with a Kafka-protocol broker after a
    /// consumer restart);
    /// resume the partition and seek to `next` again. Seeking to the stored offset never skips
    /// a record: anything below it is dropped on arrival, as after any seek. Done once per
    /// (stored offset, high watermark): offsets that hold no deliverable record (transaction
    /// markers of transactional producers) keep the high watermark ahead of the stored offset
    /// without any stall, and must not warn every `stall_check`.
    async fn check_stall(&self, next: Option<i64>, last: &mut Option<(i64, i64)>) {
        let Some(n) = next else {
            return;
        };
        let consumer = self.shared.consumer.clone();
        let (topic, partition) = (self.topic.clone(), self.partition);
        let high = tokio::task::spawn_blocking(move || {
            consumer.fetch_watermarks(&topic, partition, Duration::from_secs(5))
        })
        .await;
        let Ok(Ok((_, high))) = high else {
            return;
        };
        if high <= n || self.cancel.is_cancelled() || *last == Some((n, high)) {
            return;
        }
        *last = Some((n, high));
        tracing::warn!(topic = %self.topic, partition = self.partition, stored = n, high_watermark = high,
            idle_ms = self.shared.config.stall_check.as_millis() as u64,
            "no records from an owned partition although the broker has more; seeking to the stored offset again");
        self.shared
            .stats
            .stalls_recovered(&self.shared.config.consumer, &self.topic, 1);
        self.resume_fetching();
        if let Err(e) = self.shared.consumer.seek(
            &self.topic,
            self.partition,
            Offset::Offset(n),
            Duration::ZERO,
        ) {
            tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "seek to the stored offset failed");
        }
    }

    /// Resumes fetching from the partition (it may have been paused when its buffer filled).
    fn resume_fetching(&self) {
        let mut paused = self.paused.lock().expect("pause flag");
        if self
            .shared
            .consumer
            .resume(&tpl(&self.topic, self.partition))
            .is_ok()
        {
            *paused = false;
        }
    }

    /// Whether the partition's epoch in the database moved past `epoch` (another claim).
    /// A database error counts as "no": the next commit finds out.
    async fn epoch_moved(&self, epoch: i64) -> bool {
        let current: Result<Option<i64>, sqlx::Error> = sqlx::query_scalar(
            "SELECT epoch FROM postal.consumer_offsets
             WHERE group_id = $1 AND topic = $2 AND partition = $3",
        )
        .bind(&self.shared.config.group)
        .bind(&self.topic)
        .bind(self.partition)
        .fetch_optional(&self.shared.pool)
        .await;
        let moved = matches!(current, Ok(Some(e)) if e != epoch);
        if moved {
            self.shared
                .stats
                .fenced(&self.shared.config.consumer, &self.topic, 1);
        }
        moved
    }

    fn dequeued(&self, n: usize, bytes: usize) {
        self.queued.sub(n, bytes);
        self.shared.stats.buffered(-(bytes as i64));
        if self.queued.drained(&self.shared) {
            let mut paused = self.paused.lock().expect("pause flag");
            if *paused && self.queued.drained(&self.shared) {
                match self
                    .shared
                    .consumer
                    .resume(&tpl(&self.topic, self.partition))
                {
                    Ok(()) => *paused = false,
                    Err(e) => {
                        tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "resuming the partition failed")
                    }
                }
            }
        }
    }

    /// Takes the partition over in the database; waits (with backoff) while it is unreachable.
    async fn claim(&self) -> Option<Ownership> {
        let mut failures = 0u32;
        loop {
            let r = offsets::claim(
                &self.shared.pool,
                &self.shared.config.group,
                &self.topic,
                self.partition,
                &self.shared.owner,
            )
            .await;
            match r {
                Ok(o) => return Some(o),
                Err(e) => {
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot read the stored offset; retrying");
                    if !self.wait(failures).await {
                        return None;
                    }
                    failures = failures.saturating_add(1);
                }
            }
        }
    }

    /// Sleeps for the backoff of `attempt`; `false` if cancelled meanwhile.
    pub(crate) async fn wait(&self, attempt: u32) -> bool {
        let d = self.shared.config.backoff.delay(attempt);
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = self.cancel.cancelled() => false,
        }
    }

    pub(crate) async fn process(&self, own: &Ownership, record: &Record) -> Step {
        let consumer = self.shared.config.consumer.as_str();
        let meta = match meta(record) {
            Ok(m) => m,
            Err((reason, error)) => {
                return self.dead_letter(own, record, None, reason, &error, 0).await
            }
        };
        let Some(route) = self
            .shared
            .router
            .find(&record.topic, &meta.event_type, meta.schema_version)
            .cloned()
        else {
            return match self.shared.config.unknown_types {
                UnknownTypes::Skip => self.skip(own, record).await,
                _ => {
                    let error = format!(
                        "no handler for event type {} (schema version {}) on topic {}",
                        postal_shared::text::quoted(&meta.event_type),
                        meta.schema_version,
                        postal_shared::text::quoted(&record.topic)
                    );
                    self.dead_letter(own, record, Some(&meta), Reason::UnknownType, &error, 0)
                        .await
                }
            };
        };
        let mut attempts = 0u32;
        let mut outages = 0u32;
        loop {
            if self.cancel.is_cancelled() {
                return Step::Stop;
            }
            let span = tracing::info_span!("postal.handle", handler = route.name(), event_id = %meta.id, topic = %record.topic, partition = record.partition, offset = record.offset);
            crate::trace::continue_trace(&span, &record.headers);
            let started = std::time::Instant::now();
            let result = tracing::Instrument::instrument(
                self.attempt(own, record, &meta, route.as_ref()),
                span,
            )
            .await;
            metrics::histogram!("postal_consumer_transaction_seconds", "consumer" => consumer.to_owned(), "topic" => record.topic.clone())
                .record(started.elapsed().as_secs_f64());
            match result {
                Ok(applied) => {
                    if applied {
                        self.shared.stats.applied(consumer, &record.topic, 1);
                    } else {
                        self.shared.stats.duplicates(consumer, &record.topic, 1);
                    }
                    return Step::Done;
                }
                Err(Attempt::Fenced) => {
                    self.shared.stats.fenced(consumer, &record.topic, 1);
                    tracing::info!(topic = %record.topic, partition = record.partition, "another consumer took the partition over; rolled back");
                    return Step::Fenced;
                }
                Err(Attempt::Unavailable(e)) => {
                    tracing::warn!(error = %e, event_id = %meta.id, "database or dependency unavailable; retrying (does not count as an attempt)");
                    if !self.wait(outages).await {
                        return Step::Stop;
                    }
                    outages = outages.saturating_add(1);
                }
                Err(Attempt::Retryable(e)) => {
                    attempts += 1;
                    if attempts >= self.shared.config.max_attempts {
                        let error = format!("gave up after {attempts} attempts: {e}");
                        return self
                            .dead_letter(
                                own,
                                record,
                                Some(&meta),
                                Reason::RetriesExhausted,
                                &error,
                                attempts as i32,
                            )
                            .await;
                    }
                    self.shared.stats.retries(consumer, &record.topic, 1);
                    tracing::warn!(error = %e, event_id = %meta.id, attempt = attempts, "handler failed; retrying");
                    if !self.wait(attempts - 1).await {
                        return Step::Stop;
                    }
                }
                Err(Attempt::Permanent(reason, e)) => {
                    let ran = if reason == Reason::Undecodable {
                        attempts
                    } else {
                        attempts + 1
                    };
                    return self
                        .dead_letter(own, record, Some(&meta), reason, &e, ran as i32)
                        .await;
                }
            }
        }
    }

    /// One transaction: dedup row, body, next offset. `Ok(true)` applied, `Ok(false)` duplicate.
    async fn attempt(
        &self,
        own: &Ownership,
        record: &Record,
        meta: &Meta,
        route: &dyn Route,
    ) -> Result<bool, Attempt> {
        let mut tx = self.shared.begin().await.map_err(Attempt::db)?;
        let fresh = crate::dedup::record(&mut tx, route.consumer(), meta.id)
            .await
            .map_err(|e| match e {
                crate::Error::Database(d) => Attempt::db(d),
                other => Attempt::Retryable(other.to_string()),
            })?;
        if fresh {
            run_body(route, &mut tx, record, meta)
                .await
                .map_err(|f| match f {
                    BodyFailure::Dead(reason, error) => Attempt::Permanent(reason, error),
                    BodyFailure::Retry(error, false) => Attempt::Retryable(error),
                    BodyFailure::Retry(error, true) => Attempt::Unavailable(error),
                })?;
        }
        let owned = offsets::advance(
            &mut tx,
            &self.shared.config.group,
            &record.topic,
            record.partition,
            own.epoch,
            record.offset + 1,
        )
        .await
        .map_err(Attempt::db)?;
        if !owned {
            return Err(Attempt::Fenced);
        }
        tx.commit().await.map_err(Attempt::db)?;
        Ok(fresh)
    }

    /// Advances past a record of an unknown type.
    async fn skip(&self, own: &Ownership, record: &Record) -> Step {
        let step = match self.write_with_retry(own, record, None).await {
            Written::Stop => Step::Stop,
            Written::Fenced => Step::Fenced,
            _ => Step::Done,
        };
        if matches!(step, Step::Done) {
            self.shared
                .stats
                .skipped(&self.shared.config.consumer, &record.topic, 1);
        }
        step
    }

    /// Records a dead letter in the transaction that advances the offset past it.
    async fn dead_letter(
        &self,
        own: &Ownership,
        record: &Record,
        meta: Option<&Meta>,
        reason: Reason,
        error: &str,
        attempts: i32,
    ) -> Step {
        let dead = Dead {
            meta,
            reason,
            error,
            attempts,
        };
        match self.write_with_retry(own, record, Some(dead)).await {
            Written::DeadLetter => {
                self.shared
                    .stats
                    .dead_letters(&self.shared.config.consumer, &record.topic, 1);
                self.shared.dlq_wake.notify_one();
                Step::Done
            }
            Written::Duplicate => {
                self.shared
                    .stats
                    .duplicates(&self.shared.config.consumer, &record.topic, 1);
                Step::Done
            }
            Written::Offset => Step::Done,
            Written::Stop => Step::Stop,
            Written::Fenced => Step::Fenced,
        }
    }

    /// Records the dead letter (if any) and the offset advance in one transaction, retrying
    /// database failures until it commits, the worker is cancelled, or the partition is fenced.
    ///
    /// A dead letter with an event id also gets the event's dedup row, in the same
    /// transaction: a copy of the event at a later offset is then a duplicate, never applied
    /// after the events that followed it (replaying a dead letter, `postal dead-letters
    /// replay`, removes that row on purpose). If the row is there already, another copy of
    /// the event was applied meanwhile: the record is a duplicate, not a dead letter.
    async fn write_with_retry(
        &self,
        own: &Ownership,
        record: &Record,
        dead: Option<Dead<'_>>,
    ) -> Written {
        let mut failures = 0u32;
        loop {
            let result: Result<(bool, Written), sqlx::Error> = async {
                let mut tx = self.shared.begin().await?;
                let mut written = Written::Offset;
                if let Some(d) = dead {
                    let fresh = match d.meta {
                        Some(m) => {
                            crate::dedup::record_many(
                                &mut tx,
                                &self.shared.config.consumer,
                                &[m.id],
                            )
                            .await?
                            .len()
                                == 1
                        }
                        None => true,
                    };
                    if fresh {
                        self.record_dead(&mut tx, record, d).await?;
                        written = Written::DeadLetter;
                    } else {
                        written = Written::Duplicate;
                    }
                }
                let owned = offsets::advance(
                    &mut tx,
                    &self.shared.config.group,
                    &record.topic,
                    record.partition,
                    own.epoch,
                    record.offset + 1,
                )
                .await?;
                if owned {
                    tx.commit().await?;
                }
                Ok((owned, written))
            }
            .await;
            match result {
                Ok((true, written)) => return written,
                Ok((false, _)) => {
                    self.shared
                        .stats
                        .fenced(&self.shared.config.consumer, &record.topic, 1);
                    return Written::Fenced;
                }
                Err(e) => {
                    tracing::warn!(error = %e, topic = %record.topic, partition = record.partition, offset = record.offset, "cannot record the outcome; retrying");
                    if !self.wait(failures).await {
                        return Written::Stop;
                    }
                    failures = failures.saturating_add(1);
                }
            }
        }
    }
}

/// What [`Worker::write_with_retry`] committed.
enum Written {
    /// The offset advance only.
    Offset,
    /// The dead letter (with its event's dedup row) and the offset advance.
    DeadLetter,
    /// The offset advance: the event was applied from another copy meanwhile.
    Duplicate,
    /// Nothing: cancelled.
    Stop,
    /// Nothing: another owner's claim bumped the epoch.
    Fenced,
}

/// What a dead letter says about its record.
#[derive(Clone, Copy)]
pub(crate) struct Dead<'a> {
    pub meta: Option<&'a Meta>,
    pub reason: Reason,
    pub error: &'a str,
    pub attempts: i32,
}

impl Worker {
    /// Inserts the dead letter of `record` in the caller's transaction (which also moves the
    /// partition past it) and logs it.
    pub(crate) async fn record_dead(
        &self,
        conn: &mut sqlx::PgConnection,
        record: &Record,
        d: Dead<'_>,
    ) -> Result<(), sqlx::Error> {
        let config = &self.shared.config;
        let dlq_topic = format!("{}{}", record.topic, config.dlq_suffix);
        dead_letter::record(
            conn,
            DeadLetter {
                consumer: &config.consumer,
                group: &config.group,
                record,
                event_id: d.meta.map(|m| m.id.as_uuid()),
                event_type: d.meta.map(|m| m.event_type.as_str()),
                reason: d.reason,
                error: d.error,
                attempts: d.attempts,
                dlq_topic: &dlq_topic,
            },
        )
        .await?;
        tracing::error!(
            topic = %record.topic, partition = record.partition, offset = record.offset,
            event_id = ?d.meta.map(|m| m.id), reason = d.reason.as_str(),
            error = %postal_shared::text::bounded(d.error, postal_shared::text::MAX_ERROR_BYTES),
            "dead-lettered; the partition moves on"
        );
        Ok(())
    }
}

/// How one attempt failed.
pub(crate) enum Attempt {
    Fenced,
    Unavailable(String),
    Retryable(String),
    Permanent(Reason, String),
}

impl Attempt {
    pub(crate) fn db(e: sqlx::Error) -> Self {
        match classify_sqlx(&e) {
            Class::Unavailable => Attempt::Unavailable(e.to_string()),
            _ => Attempt::Retryable(e.to_string()),
        }
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "handler panicked".into())
}

/// How a handler body failed.
pub(crate) enum BodyFailure {
    /// Dead-letter it (reason, error).
    Dead(Reason, String),
    /// Retry it later (error, outage?).
    Retry(String, bool),
}

/// Runs a handler body, turning its errors and panics into a [`BodyFailure`].
pub(crate) async fn run_body(
    route: &dyn crate::route::Route,
    tx: &mut Transaction<'_, Postgres>,
    record: &Record,
    meta: &Meta,
) -> Result<(), BodyFailure> {
    // Handler errors and panic messages may quote the record (a payload's string in a decode
    // error): bounded and escaped before they are logged or stored.
    let bounded = |e: &dyn std::fmt::Display| {
        postal_shared::text::bounded(&e.to_string(), postal_shared::text::MAX_ERROR_BYTES)
            .into_owned()
    };
    match AssertUnwindSafe(route.call(tx, record, meta))
        .catch_unwind()
        .await
    {
        Ok(Ok(())) => Ok(()),
        Ok(Err(Failure::Undecodable(e))) => {
            Err(BodyFailure::Dead(Reason::Undecodable, bounded(&e)))
        }
        Ok(Err(Failure::Handler(HandlerError::Permanent(e)))) => {
            Err(BodyFailure::Dead(Reason::Permanent, bounded(&e)))
        }
        Ok(Err(Failure::Handler(HandlerError::Retryable(e)))) => {
            Err(BodyFailure::Retry(bounded(&e), false))
        }
        Ok(Err(Failure::Handler(HandlerError::Unavailable(e)))) => {
            Err(BodyFailure::Retry(bounded(&e), true))
        }
        Err(panic) => {
            let msg = bounded(&panic_message(panic.as_ref()));
            tracing::error!(handler = route.name(), panic = %msg, "handler panicked");
            Err(BodyFailure::Dead(Reason::Panic, format!("panic: {msg}")))
        }
    }
}
