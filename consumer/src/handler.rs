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

/// An error that `?` turns into a [`HandlerError`] inside a handler, classified as
/// [`Permanent`](HandlerError::Permanent), [`Retryable`](HandlerError::Retryable) or
/// [`Unavailable`](HandlerError::Unavailable).
///
/// Postal implements it for the errors a handler meets most:
///
/// | error | class |
/// |---|---|
/// | `sqlx::Error` | connection-level failures (I/O, TLS, pool timeouts, SQLSTATE class 08, server shutdown) `Unavailable`; data exceptions and integrity violations (classes 22 and 23) `Permanent`; everything else (serialization failures, deadlocks, lock timeouts, …) `Retryable` |
/// | `serde_json::Error` | a payload that does not decode (syntax, data, end of input) `Permanent`; an I/O error while reading `Retryable` |
/// | `std::io::Error` | `Retryable` |
/// | `anyhow::Error`, [`BoxError`] | by the first error of their chain ([`source`](std::error::Error::source)) that is one of these (a wrapped `HandlerError` keeps its class); otherwise `Retryable` |
/// | [`postal_consumer::Error`](crate::Error), [`postal_shared::Error`] | a database error as `sqlx::Error`; an invalid value `Permanent`; otherwise `Retryable` |
/// | `postal_producer::Error` | a database error as `sqlx::Error`; an event that cannot be written (invalid, too large, a reserved header, a duplicate id) `Permanent`; otherwise `Retryable` |
///
/// An error Postal cannot classify is `Retryable`: retried with backoff, then dead-lettered
/// after `max_attempts`, so a transient failure is not dead-lettered at once. Say what an error
/// is where you know better: `.map_err(HandlerError::permanent)?`. Implement this trait for an
/// error type of your own to use `?` on it.
#[diagnostic::on_unimplemented(
    message = "`?` cannot turn `{Self}` into a `HandlerError`: Postal does not know whether it is permanent or retryable",
    label = "say whether `{Self}` is permanent or retryable: `.map_err(HandlerError::permanent)?` or `.map_err(HandlerError::retryable)?`",
    note = "say which: `.map_err(HandlerError::permanent)?` (dead-lettered at once) or `.map_err(HandlerError::retryable)?` (retried with backoff, then dead-lettered); or implement `IntoHandlerError` for your own error type"
)]
pub trait IntoHandlerError {
    /// The classified failure.
    fn into_handler_error(self) -> HandlerError;
}

impl<E: IntoHandlerError> From<E> for HandlerError {
    fn from(e: E) -> Self {
        e.into_handler_error()
    }
}

impl HandlerError {
    fn of_class(class: Class, e: impl Into<BoxError>) -> Self {
        match class {
            Class::Unavailable => HandlerError::Unavailable(e.into()),
            Class::Permanent => HandlerError::Permanent(e.into()),
            Class::Retryable => HandlerError::Retryable(e.into()),
        }
    }
}

impl IntoHandlerError for sqlx::Error {
    fn into_handler_error(self) -> HandlerError {
        HandlerError::of_class(classify_sqlx(&self), self)
    }
}

impl IntoHandlerError for serde_json::Error {
    fn into_handler_error(self) -> HandlerError {
        HandlerError::of_class(classify_json(&self), self)
    }
}

impl IntoHandlerError for std::io::Error {
    fn into_handler_error(self) -> HandlerError {
        HandlerError::Retryable(Box::new(self))
    }
}

impl IntoHandlerError for BoxError {
    fn into_handler_error(self) -> HandlerError {
        match self.downcast::<HandlerError>() {
            Ok(handler_error) => *handler_error,
            Err(e) => {
                let class = classify_chain(std::iter::successors(
                    Some(&*e as &(dyn std::error::Error + 'static)),
                    |e| e.source(),
                ));
                HandlerError::of_class(class, e)
            }
        }
    }
}

impl IntoHandlerError for anyhow::Error {
    fn into_handler_error(self) -> HandlerError {
        match self.downcast::<HandlerError>() {
            Ok(handler_error) => handler_error,
            Err(e) => HandlerError::of_class(classify_chain(e.chain()), e),
        }
    }
}

impl IntoHandlerError for crate::Error {
    fn into_handler_error(self) -> HandlerError {
        match self {
            crate::Error::Database(db) => db.into(),
            crate::Error::Schema(shared) => shared.into(),
            other => HandlerError::Retryable(Box::new(other)),
        }
    }
}

impl IntoHandlerError for postal_shared::Error {
    fn into_handler_error(self) -> HandlerError {
        let class = classify_shared(&self);
        match self {
            postal_shared::Error::Database(db) => db.into(),
            other => HandlerError::of_class(class, other),
        }
    }
}

impl IntoHandlerError for postal_producer::Error {
    fn into_handler_error(self) -> HandlerError {
        let class = classify_producer(&self);
        match self {
            postal_producer::Error::Database(db) => db.into(),
            other => HandlerError::of_class(class, other),
        }
    }
}

fn classify_json(e: &serde_json::Error) -> Class {
    if e.is_io() {
        Class::Retryable
    } else {
        Class::Permanent
    }
}

fn classify_shared(e: &postal_shared::Error) -> Class {
    match e {
        postal_shared::Error::Database(db) => classify_sqlx(db),
        postal_shared::Error::Invalid { .. } => Class::Permanent,
        _ => Class::Retryable,
    }
}

fn classify_producer(e: &postal_producer::Error) -> Class {
    use postal_producer::Error as P;
    match e {
        P::Database(db) => classify_sqlx(db),
        P::Invalid(shared) => classify_shared(shared),
        P::Serialize(_)
        | P::PayloadTooLarge { .. }
        | P::ReservedHeader(_)
        | P::DuplicateEventId => Class::Permanent,
        _ => Class::Retryable,
    }
}

/// The class of the first error in `chain` that Postal knows; `Retryable` when none is.
fn classify_chain<'a>(chain: impl Iterator<Item = &'a (dyn std::error::Error + 'static)>) -> Class {
    for e in chain {
        if let Some(e) = e.downcast_ref::<HandlerError>() {
            return match e {
                HandlerError::Unavailable(_) => Class::Unavailable,
                HandlerError::Permanent(_) => Class::Permanent,
                HandlerError::Retryable(_) => Class::Retryable,
            };
        }
        if let Some(e) = e.downcast_ref::<sqlx::Error>() {
            return classify_sqlx(e);
        }
        if let Some(e) = e.downcast_ref::<serde_json::Error>() {
            return classify_json(e);
        }
        if e.is::<std::io::Error>() {
            return Class::Retryable;
        }
        if let Some(e) = e.downcast_ref::<postal_shared::Error>() {
            return classify_shared(e);
        }
        if let Some(e) = e.downcast_ref::<postal_producer::Error>() {
            return classify_producer(e);
        }
    }
    Class::Retryable
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

#[cfg(test)]
mod tests {
    use super::*;

    fn class(e: HandlerError) -> &'static str {
        match e {
            HandlerError::Permanent(_) => "permanent",
            HandlerError::Retryable(_) => "retryable",
            HandlerError::Unavailable(_) => "unavailable",
        }
    }

    fn bad_json() -> serde_json::Error {
        serde_json::from_slice::<u32>(b"{").unwrap_err()
    }

    /// Guarantee: `?` on the common errors of a handler classifies them: a payload that does
    /// not decode is permanent, I/O retryable, a pool timeout an outage, and anyhow and boxed
    /// errors take the class of what they wrap (a wrapped `HandlerError` keeps its own).
    #[test]
    fn common_errors_are_classified() {
        assert_eq!(class(bad_json().into()), "permanent");
        assert_eq!(class(std::io::Error::other("disk").into()), "retryable");
        assert_eq!(class(sqlx::Error::PoolTimedOut.into()), "unavailable");
        assert_eq!(class(sqlx::Error::RowNotFound.into()), "retryable");

        let wrapped = anyhow::Error::from(bad_json()).context("decoding the invoice");
        assert_eq!(class(wrapped.into()), "permanent");
        let outage = anyhow::Error::from(sqlx::Error::PoolTimedOut).context("loading the customer");
        assert_eq!(class(outage.into()), "unavailable");
        let kept = anyhow::Error::from(HandlerError::permanent("over the limit"));
        assert_eq!(class(kept.into()), "permanent");
        assert_eq!(class(anyhow::anyhow!("something").into()), "retryable");

        let boxed: BoxError = Box::new(bad_json());
        assert_eq!(class(boxed.into()), "permanent");
        let boxed: BoxError = "plain message".into();
        assert_eq!(class(boxed.into()), "retryable");
        let boxed: BoxError = Box::new(HandlerError::unavailable("dependency down"));
        assert_eq!(class(boxed.into()), "unavailable");

        let invalid = postal_shared::Topic::new("").unwrap_err();
        assert_eq!(class(invalid.into()), "permanent");
    }

    /// Guarantee: a wrapped `HandlerError` comes back as itself, its message unchanged.
    #[test]
    fn a_wrapped_handler_error_is_returned_as_it_was() {
        let e = HandlerError::from(anyhow::Error::from(HandlerError::permanent(
            "over the limit",
        )));
        assert_eq!(e.to_string(), "permanent: over the limit");
    }

    /// Guarantee: a chain's `enqueue` errors classify as the handler's own: a database error as
    /// sqlx's, an event that cannot be written as permanent.
    #[test]
    fn producer_errors_are_classified() {
        let too_large = postal_producer::Error::PayloadTooLarge { size: 2, max: 1 };
        assert_eq!(class(too_large.into()), "permanent");
        let db = postal_producer::Error::Database(sqlx::Error::PoolTimedOut);
        assert_eq!(class(db.into()), "unavailable");
        let boxed: BoxError = Box::new(postal_producer::Error::DuplicateEventId);
        assert_eq!(class(boxed.into()), "permanent");
    }
}
