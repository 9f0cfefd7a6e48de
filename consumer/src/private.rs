//! Support for the code `#[idempotent]` generates. Not a public API.

pub use futures::future::BoxFuture;
pub use sqlx;

use sqlx::{Connection, Postgres, Transaction};

use crate::event::Event;
use crate::handler::{Handler, HandlerError, Outcome};

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
