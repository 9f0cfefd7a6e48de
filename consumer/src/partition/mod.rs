//! One worker per owned partition: records in offset order, one transaction each holding the
//! dedup row, the handler's effects and the next offset.
//!
//! - `own`: taking the partition over (claim, seek to the stored offset), stalls, fencing;
//! - `process`: one record's transaction, its attempts and the handler body;
//! - `dead`: dead letters, written in the transaction that moves the partition past them;
//! - `hold`: held keys (`FinalFailure::HoldKey`): holding a key's records, the byte bound;
//! - `release`: applying a held key's records when released (operator or retry policy);
//! - `stop`: a topic stopped because a partition's log was replaced under the stored offset.

mod dead;
mod hold;
mod own;
mod process;
mod release;
mod stop;

pub(crate) use dead::Dead;
pub(crate) use hold::{Head, Held};
pub(crate) use process::{run_batch_body, run_body, Attempt, BodyFailure, Retry};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdkafka::consumer::Consumer;
use rdkafka::TopicPartitionList;
use sqlx::PgPool;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::config::ConsumerConfig;
use crate::context::Ownership as OwnershipState;
use crate::record::Record;
use crate::route::Router;
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
    /// The partitions' waiting clocks and the consumer's health ([`crate::stall`]).
    pub watch: crate::stall::Watch,
    /// The group's pauses as last read ([`crate::pause`]).
    pub pauses: crate::pause::Pauses,
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

    /// Opens a processing transaction of `topic`, with the session settings of
    /// `lost_connection_timeout`. Its `BEGIN` also takes the group's and the topic's pause locks, shared
    /// ([`postal_shared::pause`]; no extra round trip), so that a pause waits for it and it
    /// sees a pause that committed before.
    pub(crate) async fn begin_for(
        &self,
        topic: &str,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        let statement = format!(
            "{}; {}",
            self.config.begin_statement(),
            postal_shared::pause::consumer_lock_sql(&self.config.group, topic)
        );
        postal_shared::cancel_safe::begin_with(&self.pool, statement).await
    }

    /// The statement that opens a batch transaction of `topic` (throughput mode): as
    /// [`Self::begin_for`]'s, opened with `begin` (`BEGIN READ WRITE`: its session is read-only
    /// outside it, `batch`'s `session`) and, when `sealed`, marked a batch (`postal.batch`: its
    /// dedup rows refuse a commit the runtime did not seal, migration 0040).
    pub(crate) fn batch_begin_statement(&self, begin: &str, topic: &str, sealed: bool) -> String {
        let statement = self.config.begin_statement();
        let rest = statement.strip_prefix("BEGIN").unwrap_or(&statement);
        let mark = if sealed {
            "; SET LOCAL postal.batch = 'open'"
        } else {
            ""
        };
        format!(
            "{begin}{rest}{mark}; {}",
            postal_shared::pause::consumer_lock_sql(&self.config.group, topic)
        )
    }
}

/// What a partition's buffer holds: records and their bytes (see [`Record::weight`]).
#[derive(Default)]
pub(crate) struct Queued {
    records: AtomicUsize,
    bytes: AtomicUsize,
    /// Since when records have waited without a transaction completing ([`crate::stall`]).
    pub waiting: Arc<crate::stall::Waiting>,
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

    /// Whether records wait in the buffer.
    pub(crate) fn any(&self) -> bool {
        self.records.load(Ordering::Acquire) > 0
    }

    /// Full: fetching pauses.
    fn full(&self, s: &Shared) -> bool {
        self.records.load(Ordering::Acquire) >= s.config.partition_buffer
            || self.bytes.load(Ordering::Acquire) >= s.partition_bytes()
    }

    /// Whether adding a record of `weight` bytes could make the buffer [`full`](Self::full):
    /// only the runtime's loop adds, so the counts after adding are at most these.
    fn would_fill(&self, s: &Shared, weight: usize) -> bool {
        self.records.load(Ordering::Acquire) + 1 >= s.config.partition_buffer
            || self.bytes.load(Ordering::Acquire) + weight >= s.partition_bytes()
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
        let weight = record.weight;
        // Kept only if the buffer fills (the partition is then paused by name).
        let tp = self
            .queued
            .would_fill(shared, weight)
            .then(|| (record.topic.clone(), record.partition));
        // Counted before it is sent, so the worker never counts below zero.
        self.queued.add(1, weight);
        self.queued.waiting.arrived();
        shared.stats.buffered(weight as i64);
        if self.tx.send(record).is_err() {
            // The worker stopped (fenced or revoked): the next owner reads the record.
            self.queued.sub(1, weight);
            shared.stats.buffered(-(weight as i64));
            return;
        }
        if let (true, Some((topic, partition))) = (self.queued.full(shared), tp) {
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
    /// The group or the topic is paused: this transaction rolled back, nothing applied.
    Paused,
    /// A hold would take the group past `held_bytes_limit`: rolled back, nothing applied.
    /// The bytes the transaction would have held (it fits once the group holds nothing, or
    /// at most the bound less these).
    OverBound(i64),
}

/// How one ownership of a partition ended.
enum Owned {
    /// Cancelled (revoked, shutting down).
    Ended,
    /// Fenced by another claim while still assigned here; the lowest offset this ownership
    /// received while the stored offset was NULL (nothing committed yet), if any.
    Fenced(Option<i64>),
    /// Held while its topic was paused, and resumed: take it over again from the stored
    /// offset (the same lowest offset as `Fenced`).
    Resumed(Option<i64>),
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
    /// The partition's held keys (`hold`): read at each takeover, changed only by this worker.
    pub held: Mutex<std::collections::HashSet<Vec<u8>>>,
    /// Throughput mode: the most records a transaction of this partition took and committed
    /// since one whose session the server ended (0: none ended yet). Kept from one poll batch
    /// to the next ([`crate::batch`]).
    pub fit: std::sync::atomic::AtomicUsize,
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
                Owned::Resumed(seen) => {
                    floor = match (floor, seen) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    // Dropped while held: read again after the seek to the stored offset.
                    let (mut dropped, mut bytes) = (0, 0);
                    while let Ok(r) = self.rx.try_recv() {
                        dropped += 1;
                        bytes += r.weight;
                        floor = Some(floor.map_or(r.offset, |f| f.min(r.offset)));
                    }
                    self.dequeued(dropped, bytes);
                }
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
}
