//! Support for the code `#[idempotent]` generates. Not a public API, except [`apply`].

pub use futures::future::BoxFuture;
pub use sqlx;

use sqlx::{Connection, Postgres, Transaction};

use crate::batch_handler::{Batch, BatchHandler};
use crate::event::Event;
use crate::handler::{Handler, HandlerError, Outcome};

/// Runs `handler` inside a transaction you own, as `#[idempotent]`'s generated `call` does:
/// records the dedup row with `ON CONFLICT DO NOTHING` under a savepoint; if it already existed,
/// skips the body and returns [`Outcome::Duplicate`], otherwise runs the body and returns
/// [`Outcome::Applied`]. On error the savepoint is rolled back (dedup row and effects together)
/// and your transaction stays usable. You commit.
pub async fn apply<'c, H: Handler>(
    handler: &H,
    tx: &mut Transaction<'c, Postgres>,
    event: Event<H::Payload>,
) -> Result<Outcome, HandlerError> {
    standalone(handler, tx, event).await
}

/// The standalone call: dedup row and body under a savepoint of the caller's transaction.
pub async fn standalone<'c, H: Handler>(
    handler: &H,
    tx: &mut Transaction<'c, Postgres>,
    event: Event<H::Payload>,
) -> Result<Outcome, HandlerError> {
    let mut savepoint = (**tx).begin().await?;
    if !crate::dedup::record(&mut savepoint, handler.consumer(), event.id).await? {
        savepoint.rollback().await?;
        return Ok(Outcome::Duplicate);
    }
    match handler.handle(&mut savepoint, event).await {
        Ok(()) => {
            savepoint.commit().await?;
            Ok(Outcome::Applied)
        }
        Err(e) => {
            // Undo the dedup row and the effects; the caller's transaction stays usable.
            savepoint.rollback().await?;
            Err(e)
        }
    }
}

/// Runs a [`BatchHandler`] inside a transaction you own, as `#[idempotent]`'s generated `call`
/// of a batch handler does: records the events' dedup rows (one multi-row insert) under a
/// savepoint and runs the body once with the events whose rows were new (the first of any
/// repeated id), in the order given. Returns one [`Outcome`] per event given: `Applied` for
/// those the body got, `Duplicate` for the others (the body does not run when there are none).
/// On error the savepoint is rolled back (dedup rows and effects together) and your
/// transaction stays usable. You commit.
pub async fn apply_batch<'c, H: BatchHandler>(
    handler: &H,
    tx: &mut Transaction<'c, Postgres>,
    events: Vec<Event<H::Payload>>,
) -> Result<Vec<Outcome>, HandlerError> {
    standalone_batch(handler, tx, events).await
}

/// The standalone call of a batch handler: dedup rows and body under a savepoint.
pub async fn standalone_batch<'c, H: BatchHandler>(
    handler: &H,
    tx: &mut Transaction<'c, Postgres>,
    events: Vec<Event<H::Payload>>,
) -> Result<Vec<Outcome>, HandlerError> {
    let mut savepoint = (**tx).begin().await?;
    let ids: Vec<_> = events.iter().map(|e| e.id).collect();
    let fresh: std::collections::HashSet<_> =
        crate::dedup::record_many(&mut savepoint, handler.consumer(), &ids)
            .await?
            .into_iter()
            .collect();
    let (outcomes, new) = first_fresh(events, &fresh);
    if new.is_empty() {
        savepoint.rollback().await?;
        return Ok(outcomes);
    }
    match handler.handle_batch(&mut savepoint, Batch::new(new)).await {
        Ok(()) => {
            savepoint.commit().await?;
            Ok(outcomes)
        }
        Err(e) => {
            savepoint.rollback().await?;
            Err(e)
        }
    }
}

/// The events whose id is in `fresh`, each id's first only, in order; and every event's
/// outcome.
pub(crate) fn first_fresh<T>(
    events: Vec<Event<T>>,
    fresh: &std::collections::HashSet<postal_shared::EventId>,
) -> (Vec<Outcome>, Vec<Event<T>>) {
    let mut taken = std::collections::HashSet::new();
    let mut outcomes = Vec::with_capacity(events.len());
    let mut new = Vec::new();
    for e in events {
        if fresh.contains(&e.id) && taken.insert(e.id) {
            outcomes.push(Outcome::Applied);
            new.push(e);
        } else {
            outcomes.push(Outcome::Duplicate);
        }
    }
    (outcomes, new)
}

/// A batch handler generated from an `async fn` that takes a `State<T>`: its body, given the
/// state.
pub trait StatefulBatchHandler: Send + Sync + 'static {
    /// The state part it takes.
    type State: Clone + Send + Sync + 'static;
    /// The payload type it decodes.
    type Payload: crate::event::Payload;
    /// The dedup scope.
    const CONSUMER: &'static str;
    /// The handler's name.
    const NAME: &'static str;
    /// Runs the body.
    fn handle_batch<'a, 'c>(
        state: &'a Self::State,
        tx: &'a mut Transaction<'c, Postgres>,
        events: Batch<Self::Payload>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

/// A stateful batch handler bound to its state.
pub struct WithBatchState<H: StatefulBatchHandler> {
    state: H::State,
}

impl<H: StatefulBatchHandler> WithBatchState<H> {
    /// Binds the handler to `state`.
    pub fn new(state: H::State) -> Self {
        WithBatchState { state }
    }
}

impl<H: StatefulBatchHandler> BatchHandler for WithBatchState<H> {
    type Payload = H::Payload;

    fn consumer(&self) -> &str {
        H::CONSUMER
    }

    fn name(&self) -> &str {
        H::NAME
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        events: Batch<Self::Payload>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        H::handle_batch(&self.state, tx, events)
    }
}

/// A handler generated from an `async fn` that takes a `State<T>`: its body, given the state.
pub trait StatefulHandler: Send + Sync + 'static {
    /// The state part it takes.
    type State: Clone + Send + Sync + 'static;
    /// The payload type it decodes.
    type Payload: crate::event::Payload;
    /// The dedup scope.
    const CONSUMER: &'static str;
    /// The handler's name.
    const NAME: &'static str;
    /// Runs the body.
    fn handle<'a, 'c>(
        state: &'a Self::State,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<Self::Payload>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

/// A stateful handler bound to its state.
pub struct WithState<H: StatefulHandler> {
    state: H::State,
}

impl<H: StatefulHandler> WithState<H> {
    /// Binds the handler to `state`.
    pub fn new(state: H::State) -> Self {
        WithState { state }
    }
}

impl<H: StatefulHandler> Handler for WithState<H> {
    type Payload = H::Payload;

    fn consumer(&self) -> &str {
        H::CONSUMER
    }

    fn name(&self) -> &str {
        H::NAME
    }

    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<Self::Payload>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        H::handle(&self.state, tx, event)
    }
}
