//! Support for the code `#[idempotent]` generates. Not a public API, except [`apply`].

pub use futures::future::BoxFuture;
pub use sqlx;

use sqlx::{Connection, Postgres, Transaction};

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
