//! Helpers for testing handlers against a real database, without a broker.
//!
//! ```no_run
//! use postal_consumer::testing::{assert_applied_once, deliver};
//! use postal_consumer::{idempotent, Event, EventId, HandlerError, Outcome};
//! # use sqlx::{Postgres, Transaction};
//! # #[derive(Clone, serde::Deserialize)] struct OrderCreated { order_id: i64 }
//! # #[idempotent(consumer = "billing")]
//! # async fn on_order(tx: &mut Transaction<'_, Postgres>, event: Event<OrderCreated>) -> Result<(), HandlerError> { Ok(()) }
//!
//! # async fn test(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! postal_shared::migrate(&pool).await?; // Postal's tables next to yours
//! let event = Event::new(EventId::new(), "order.created", OrderCreated { order_id: 7 });
//!
//! // Delivered twice, applied once: the second delivery finds the dedup row.
//! assert_applied_once(&pool, &on_order, event.clone()).await?;
//!
//! // Or step by step, as the runtime would (own transaction, dedup row, body, commit):
//! let again = deliver(&pool, &on_order, event).await?;
//! assert_eq!(again, Outcome::Duplicate);
//! # Ok(()) }
//! ```

use sqlx::PgPool;

use crate::event::Event;
use crate::handler::{Handler, HandlerError, Outcome};

/// Delivers `event` to `handler` as the runtime does, in a transaction of its own: dedup row,
/// body (only for a new id), commit. On error the transaction rolls back and the error is
/// returned.
pub async fn deliver<H: Handler>(
    pool: &PgPool,
    handler: &H,
    event: Event<H::Payload>,
) -> Result<Outcome, HandlerError> {
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    let fresh = crate::dedup::record(&mut tx, handler.consumer(), event.id).await?;
    if !fresh {
        return Ok(Outcome::Duplicate);
    }
    handler.handle(&mut tx, event).await?;
    tx.commit().await?;
    Ok(Outcome::Applied)
}

/// Why [`assert_applied_once`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppliedOnceError {
    /// The handler failed.
    #[error("the handler failed: {0}")]
    Handler(#[from] HandlerError),
    /// A delivery had an unexpected outcome.
    #[error("delivery {delivery} was {actual:?}, expected {expected:?}")]
    Unexpected {
        /// 1 or 2.
        delivery: u8,
        /// What it was.
        actual: Outcome,
        /// What it should have been.
        expected: Outcome,
    },
}

/// Delivers `event` twice and checks that the first delivery applied it and the second was
/// recognised as a duplicate (the body did not run again).
pub async fn assert_applied_once<H: Handler>(
    pool: &PgPool,
    handler: &H,
    event: Event<H::Payload>,
) -> Result<(), AppliedOnceError>
where
    H::Payload: Clone,
{
    for (delivery, expected) in [(1u8, Outcome::Applied), (2u8, Outcome::Duplicate)] {
        let actual = deliver(pool, handler, event.clone()).await?;
        if actual != expected {
            return Err(AppliedOnceError::Unexpected {
                delivery,
                actual,
                expected,
            });
        }
    }
    Ok(())
}

/// Fault injection for the runtime's own tests: stops fetching from a partition behind the
/// runtime's back, as a broker fault that loses a consumer's fetch position would.
#[doc(hidden)]
pub struct FetchFault(pub(crate) crate::client::Client);

impl FetchFault {
    /// Pauses fetching from `topic`/`partition` without telling the runtime.
    pub fn stop_fetching(&self, topic: &str, partition: i32) -> Result<(), crate::Error> {
        use rdkafka::consumer::Consumer as _;
        self.0.pause(&crate::partition::tpl(topic, partition))?;
        Ok(())
    }
}

/// Fault injection for the runtime's own tests: tells the runtime that a partition was revoked
/// and assigned again, as quick successive rebalances do, without librdkafka's involvement.
#[doc(hidden)]
pub struct RebalanceFault(
    pub(crate) tokio::sync::mpsc::UnboundedSender<crate::context::RebalanceEvent>,
);

impl RebalanceFault {
    /// Sends `times` pairs of (revoked, assigned) for `topic`/`partition`, back to back.
    pub fn reassign(&self, topic: &str, partition: i32, times: usize) {
        use crate::context::RebalanceEvent;
        for _ in 0..times {
            let tp = vec![(topic.to_owned(), partition)];
            let _ = self.0.send(RebalanceEvent::Revoked(tp.clone()));
            let _ = self.0.send(RebalanceEvent::Assigned(tp));
        }
    }
}

/// The runtime's transaction protocol driven directly, without Kafka: a test claims a
/// partition (bumping its epoch, as an assigned worker does) and hands records to the same
/// code a worker runs — one record per transaction, or a batch in throughput mode — in any
/// order, with duplicates, stale owners and replays. For the randomized protocol tests; not a
/// public API.
#[doc(hidden)]
pub struct Protocol(pub(crate) std::sync::Arc<crate::partition::Shared>);

/// A record as the broker would deliver it (see [`Protocol`]).
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct TestRecord {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key.
    pub key: Option<Vec<u8>>,
    /// Value.
    pub payload: Option<Vec<u8>>,
    /// Headers.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

/// How [`Protocol::deliver`] ended.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivered {
    /// Every record was finished and the offset moved past the last one.
    Done,
    /// The owner's epoch is stale: nothing was committed.
    Fenced,
    /// Cancelled (the harness never cancels: not expected).
    Stopped,
}

impl Protocol {
    /// Takes the partition over as an assigned worker does: bumps the epoch, returns the
    /// ownership (its epoch and the stored next offset).
    pub async fn claim(
        &self,
        topic: &str,
        partition: i32,
    ) -> Result<crate::offsets::Ownership, sqlx::Error> {
        crate::offsets::claim(
            &self.0.pool,
            &self.0.config.group,
            topic,
            partition,
            &self.0.owner,
        )
        .await
    }

    /// Processes `records` (of one partition, in offset order) under `own` exactly as a worker
    /// does: one record per transaction when there is one, throughput mode otherwise.
    pub async fn deliver(
        &self,
        own: &crate::offsets::Ownership,
        records: Vec<TestRecord>,
    ) -> Delivered {
        use crate::partition::{Step, Worker};
        let Some(first) = records.first() else {
            return Delivered::Done;
        };
        let (_tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let worker = Worker {
            shared: self.0.clone(),
            topic: first.topic.clone(),
            partition: first.partition,
            rx,
            queued: Default::default(),
            paused: Default::default(),
            cancel: Default::default(),
            turn: Default::default(),
        };
        let records: Vec<crate::record::Record> = records
            .into_iter()
            .map(|r| {
                let headers = crate::event::Headers::new(r.headers);
                crate::record::Record {
                    weight: crate::record::weight(r.key.as_deref(), r.payload.as_deref(), &headers),
                    topic: r.topic,
                    partition: r.partition,
                    offset: r.offset,
                    key: r.key,
                    payload: r.payload,
                    headers,
                    timestamp: None,
                    unreadable_header: None,
                    too_many_headers: None,
                }
            })
            .collect();
        let step = if records.len() == 1 {
            worker.process(own, &records[0]).await
        } else {
            worker.process_batch(own, records).await
        };
        match step {
            Step::Done => Delivered::Done,
            Step::Fenced => Delivered::Fenced,
            Step::Stop => Delivered::Stopped,
        }
    }
}
