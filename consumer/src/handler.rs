//! The handler contract: what a handler returns and how the runtime calls it.

use futures::future::BoxFuture;
use sqlx::{Postgres, Transaction};

use crate::event::{Event, Payload};

/// A boxed error source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a handler failed. Every failure rolls back the handler's effects together with the
/// dedup row; what happens next depends on the variant.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Worth retrying (a lock timeout, a serialization failure, a flaky dependency): retried
    /// with exponential backoff and full jitter; dead-lettered after `max_attempts`.
    #[error("retryable: {0}")]
    Retryable(BoxError),
    /// Will fail again however often it is retried (a business rule violation, a payload the
    /// handler cannot use): dead-lettered at once.
    #[error("permanent: {0}")]
    Permanent(BoxError),
    /// The database (or another dependency) is unreachable: retried with backoff for as long
    /// as it takes, never using up an attempt.
    #[error("unavailable: {0}")]
    Unavailable(BoxError),
}

impl HandlerError {
    /// A retryable failure.
    pub fn retryable(e: impl Into<BoxError>) -> Self {
        HandlerError::Retryable(e.into())
    }

    /// A permanent failure.
    pub fn permanent(e: impl Into<BoxError>) -> Self {
        HandlerError::Permanent(e.into())
    }

    /// A dependency outage.
    pub fn unavailable(e: impl Into<BoxError>) -> Self {
        HandlerError::Unavailable(e.into())
    }
}

/// Database errors are classified so handlers can use `?` on sqlx calls:
/// connection-level failures (I/O, TLS, pool timeouts, SQLSTATE class 08, server shutdown) are
/// [`HandlerError::Unavailable`]; data exceptions and integrity violations (classes 22 and 23)
/// are [`HandlerError::Permanent`]; everything else (serialization failures, deadlocks, lock
/// timeouts, …) is [`HandlerError::Retryable`].
impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        match classify_sqlx(&e) {
            Class::Unavailable => HandlerError::Unavailable(Box::new(e)),
            Class::Permanent => HandlerError::Permanent(Box::new(e)),
            Class::Retryable => HandlerError::Retryable(Box::new(e)),
        }
    }
}

impl From<crate::Error> for HandlerError {
    fn from(e: crate::Error) -> Self {
        match e {
            crate::Error::Database(db) => db.into(),
            other => HandlerError::Retryable(Box::new(other)),
        }
    }
}

pub(crate) enum Class {
    Unavailable,
    Permanent,
    Retryable,
}

pub(crate) fn classify_sqlx(e: &sqlx::Error) -> Class {
    if postal_shared::database_unavailable(e) {
        return Class::Unavailable;
    }
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            if code.starts_with("22") || code.starts_with("23") {
                Class::Permanent
            } else {
                Class::Retryable
            }
        }
        _ => Class::Retryable,
    }
}

/// What a standalone handler call did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// First delivery: the dedup row was written and the body ran.
    Applied,
    /// The dedup row already existed: the body did not run.
    Duplicate,
}

/// A handler the runtime can route events to. `#[idempotent]` implements it (through
/// [`IntoHandler`] when the handler takes a [`State`]); implement it by hand for a handler the
/// macro cannot express, such as a struct holding its dependencies in fields. Such a struct gets
/// the standalone call the macro generates from [`apply`](crate::apply).
///
/// `handle` runs the body only: the runtime (or the standalone call) records the dedup row and
/// the offset around it in the same transaction.
///
/// ```
/// use postal_consumer::{BoxFuture, Event, Handler, HandlerError};
/// use sqlx::{Postgres, Transaction};
///
/// /// Copies each event's payload into a table chosen at start-up.
/// struct Archive { table: String }
///
/// impl Handler for Archive {
///     type Payload = serde_json::Value;
///     fn consumer(&self) -> &str { "archive" }
///     fn name(&self) -> &str { "archive" }
///     fn handle<'a, 'c>(
///         &'a self,
///         tx: &'a mut Transaction<'c, Postgres>,
///         event: Event<serde_json::Value>,
///     ) -> BoxFuture<'a, Result<(), HandlerError>> {
///         Box::pin(async move {
///             let sql = format!("INSERT INTO {} (event_id, body) VALUES ($1, $2)", self.table);
///             sqlx::query(&sql).bind(event.id.as_uuid()).bind(&event.payload).execute(&mut **tx).await?;
///             Ok(())
///         })
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// The payload type the handler decodes.
    type Payload: Payload;

    /// The dedup scope (`consumer = "..."`): the consumer's name in
    /// `postal.processed_events`. Every handler of one [`Consumer`](crate::Consumer) names the
    /// same one.
    fn consumer(&self) -> &str;

    /// The handler's name, for logs and metrics.
    fn name(&self) -> &str;

    /// Runs the body in `tx`.
    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<Self::Payload>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

pub use postal_shared::{FromRef, State};

/// What [`ConsumerBuilder::on`](crate::ConsumerBuilder::on) routes to: a [`Handler`], or a
/// handler that takes a [`State`] (generated by `#[idempotent]`), bound to the consumer's state
/// `S` when it is routed.
///
/// ```no_run
/// use postal_consumer::{idempotent, Consumer, ConsumerConfig, Event, FromRef, HandlerError, State};
/// use sqlx::{Postgres, Transaction};
///
/// #[derive(Clone)]
/// struct App { invoices: Invoices, region: String }
///
/// #[derive(Clone)]
/// struct Invoices { topic: String }
///
/// impl FromRef<App> for Invoices {
///     fn from_ref(app: &App) -> Self { app.invoices.clone() }
/// }
///
/// #[idempotent(consumer = "billing")]
/// async fn on_order(
///     State(invoices): State<Invoices>, // a part of the state
///     tx: &mut Transaction<'_, Postgres>,
///     event: Event<serde_json::Value>,
/// ) -> Result<(), HandlerError> {
///     let _ = (&invoices.topic, tx, event);
///     Ok(())
/// }
///
/// # fn build(pool: sqlx::PgPool) -> Result<(), postal_consumer::Error> {
/// let app = App { invoices: Invoices { topic: "invoices".into() }, region: "eu".into() };
/// let consumer = Consumer::builder(pool, ConsumerConfig::new("127.0.0.1:9092", "billing"))
///     .state(app)
///     .on("orders", "order.created", on_order)
///     .build()?;
/// # Ok(()) }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a handler for a consumer with state `{S}`",
    note = "a handler is an `#[idempotent]` async fn or a type implementing `Handler`; one that takes `State<T>` needs `T: FromRef<{S}>`"
)]
pub trait IntoHandler<S>: Sized {
    /// The handler it becomes.
    type Handler: Handler;

    /// Binds it to `state`.
    fn into_handler(self, state: &S) -> Self::Handler;
}

impl<H: Handler, S> IntoHandler<S> for H {
    type Handler = H;

    fn into_handler(self, _state: &S) -> H {
        self
    }
}
