//! Helpers for testing handlers against a real database, without a broker.
//!
//! ```no_run
//! use postal_consumer::testing::{assert_applied_once, deliver, TestDatabase};
//! use postal_consumer::{idempotent, Event, EventId, HandlerError, Outcome};
//! # use sqlx::{Postgres, Transaction};
//! # #[derive(Clone, serde::Deserialize)] struct OrderCreated { order_id: i64 }
//! # #[idempotent(consumer = "billing")]
//! # async fn on_order(tx: &mut Transaction<'_, Postgres>, event: Event<OrderCreated>) -> Result<(), HandlerError> { Ok(()) }
//!
//! # async fn test() -> Result<(), Box<dyn std::error::Error>> {
//! // A database of this test's own on the server of DATABASE_URL, with Postal's tables.
//! let db = TestDatabase::create().await?;
//! let pool = &db.pool;
//! let event = Event::new(EventId::new(), "order.created", OrderCreated { order_id: 7 });
//!
//! // Delivered twice, applied once: the second delivery finds the dedup row.
//! assert_applied_once(&pool, &on_order, event.clone()).await?;
//!
//! // Or step by step, as the runtime would (own transaction, dedup row, body, commit):
//! let again = deliver(&pool, &on_order, event).await?;
//! assert_eq!(again, Outcome::Duplicate);
//! db.remove().await?;
//! # Ok(()) }
//! ```

use sqlx::PgPool;

/// The consumer's stored offsets, for tests that play another owner of a partition.
#[doc(hidden)]
pub mod offsets {
    pub use crate::offsets::{claim, stored, Ownership};
}

/// A database of one test's own, created on the server of `DATABASE_URL`, with Postal's schema
/// migrated: tests running at the same time never see each other's rows.
/// [`remove`](Self::remove) drops it; one a failed test leaves behind is named
/// `postal_test_<uuid>`.
#[derive(Debug)]
#[non_exhaustive]
pub struct TestDatabase {
    /// A pool on the new database.
    pub pool: PgPool,
    /// Its connection URL.
    pub url: String,
    /// Its name.
    pub name: String,
    admin_url: String,
}

impl TestDatabase {
    /// Creates one on the server of the `DATABASE_URL` environment variable.
    pub async fn create() -> Result<Self, crate::Error> {
        let url = std::env::var("DATABASE_URL").map_err(|_| {
            crate::Error::Config(
                "DATABASE_URL is not set: point it at a PostgreSQL server where this user may create databases".into(),
            )
        })?;
        Self::create_at(&url).await
    }

    /// Creates one on the server of `url` (whose user may create databases).
    pub async fn create_at(url: &str) -> Result<Self, crate::Error> {
        use std::str::FromStr;
        let admin = sqlx::postgres::PgConnectOptions::from_str(url)?;
        let name = format!("postal_test_{}", uuid::Uuid::now_v7().simple());
        let admin_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(admin.clone())
            .await?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin_pool)
            .await?;
        admin_pool.close().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect_with(admin.clone().database(&name))
            .await?;
        postal_shared::migrate(&pool).await?;
        use sqlx::ConnectOptions;
        Ok(TestDatabase {
            pool,
            url: admin.database(&name).to_url_lossy().to_string(),
            name,
            admin_url: url.to_owned(),
        })
    }

    /// Closes the pool and drops the database.
    pub async fn remove(self) -> Result<(), crate::Error> {
        self.pool.close().await;
        let admin = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.admin_url)
            .await?;
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&admin)
        .await?;
        admin.close().await;
        Ok(())
    }
}

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

/// Delivers `events` to the batch handler `handler` as the runtime does with one partition
/// batch, in a transaction of its own: the dedup rows (one multi-row insert), the body once with
/// the events whose rows were new (the first of a repeated id), commit. Returns one
/// [`Outcome`] per event given. On error the transaction rolls back and the error is returned
/// (the runtime would then look for the failing event; see [`BatchHandler`]).
///
/// ```no_run
/// # use postal_consumer::{idempotent, Batch, Event, EventId, HandlerError, Outcome};
/// # use postal_consumer::testing::deliver_batch;
/// # use sqlx::{Postgres, Transaction};
/// # #[idempotent(consumer = "billing")]
/// # async fn on_orders(tx: &mut Transaction<'_, Postgres>, events: Batch<serde_json::Value>) -> Result<(), HandlerError> { Ok(()) }
/// # async fn test(pool: sqlx::PgPool) -> Result<(), HandlerError> {
/// let a = Event::new(EventId::new(), "order.created", serde_json::json!({"order_id": 1}));
/// let b = Event::new(EventId::new(), "order.created", serde_json::json!({"order_id": 2}));
/// let outcomes = deliver_batch(&pool, &on_orders, vec![a.clone(), b, a]).await?;
/// assert_eq!(outcomes, [Outcome::Applied, Outcome::Applied, Outcome::Duplicate]);
/// # Ok(()) }
/// ```
///
/// [`BatchHandler`]: crate::BatchHandler
pub async fn deliver_batch<H: crate::BatchHandler>(
    pool: &PgPool,
    handler: &H,
    events: Vec<Event<H::Payload>>,
) -> Result<Vec<Outcome>, HandlerError> {
    let mut tx = postal_shared::cancel_safe::begin(pool).await?;
    let ids: Vec<_> = events.iter().map(|e| e.id).collect();
    let fresh: std::collections::HashSet<_> =
        crate::dedup::record_many(&mut tx, handler.consumer(), &ids)
            .await?
            .into_iter()
            .collect();
    let (outcomes, new) = crate::private::first_fresh(events, &fresh);
    if !new.is_empty() {
        handler
            .handle_batch(&mut tx, crate::Batch::new(new))
            .await?;
    }
    tx.commit().await?;
    Ok(outcomes)
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
    /// The group or the topic is paused (`postal.pauses`): nothing was committed.
    Paused,
    /// A hold would take the group past `held_bytes_limit`: nothing was committed.
    OverBound,
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

    /// Applies the releases operators asked for (and the retry policy's due retries) of the
    /// held keys of `topic`'s `partition` under `own`, exactly as the partition's worker does
    /// between batches.
    pub async fn apply_releases(
        &self,
        own: &crate::offsets::Ownership,
        topic: &str,
        partition: i32,
    ) -> Delivered {
        let worker = self.worker(topic, partition);
        worker.load_held().await;
        // Look after look (each settles a bounded number of held records), until none is due.
        loop {
            match worker.apply_releases(own).await {
                (crate::partition::Step::Done, true) => continue,
                (step, _) => return Self::delivered(step),
            }
        }
    }

    fn worker(&self, topic: &str, partition: i32) -> crate::partition::Worker {
        let (_tx, rx) = tokio::sync::mpsc::unbounded_channel();
        crate::partition::Worker {
            shared: self.0.clone(),
            topic: topic.to_owned(),
            partition,
            rx,
            queued: Default::default(),
            paused: Default::default(),
            cancel: Default::default(),
            turn: Default::default(),
            held: Default::default(),
            fit: Default::default(),
        }
    }

    fn delivered(step: crate::partition::Step) -> Delivered {
        use crate::partition::Step;
        match step {
            Step::Done => Delivered::Done,
            Step::Fenced => Delivered::Fenced,
            Step::Stop => Delivered::Stopped,
            Step::Paused => Delivered::Paused,
            Step::OverBound(_) => Delivered::OverBound,
        }
    }

    /// Processes `records` (of one partition, in offset order) under `own` exactly as a worker
    /// does: one record per transaction when there is one, throughput mode otherwise.
    pub async fn deliver(
        &self,
        own: &crate::offsets::Ownership,
        records: Vec<TestRecord>,
    ) -> Delivered {
        let Some(first) = records.first() else {
            return Delivered::Done;
        };
        let worker = self.worker(&first.topic, first.partition);
        // As a takeover does: the partition's held keys.
        worker.load_held().await;
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
        Self::delivered(step)
    }
}
