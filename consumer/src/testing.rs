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
