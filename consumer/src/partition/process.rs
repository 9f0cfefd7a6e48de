//! One record's transaction: the dedup row, the handler's effects and the next offset,
//! with retries, and the handler body run with its panics caught.

use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use sqlx::{Postgres, Transaction};

use crate::config::UnknownTypes;
use crate::dead_letter::Reason;
use crate::handler::{classify_sqlx, Class, HandlerError};
use crate::offsets::{self, Ownership};
use crate::record::{meta, Meta, Record};
use crate::route::{Failure, Route};

use super::dead::Written;
use super::{Step, Worker};

impl Worker {
    pub(crate) async fn process(&self, own: &Ownership, record: &Record) -> Step {
        self.process_after(own, record, 0, "").await
    }

    /// [`Self::process`] of a record whose handler already failed `used` times (the last with
    /// `last`), as counted by throughput mode before it handed the record over: its attempts
    /// go on from there (used up: dead-lettered or held without running, as throughput mode
    /// would have).
    pub(crate) async fn process_after(
        &self,
        own: &Ownership,
        record: &Record,
        used: u32,
        last: &str,
    ) -> Step {
        let consumer = self.shared.config.consumer.as_str();
        let meta = meta(record);
        if self.is_held(record.key.as_deref()) {
            // Its key waits for an earlier event: stored, not applied (nor settled: a record
            // without an envelope is dead-lettered at the release, in its key's order).
            return self.hold(own, record, meta.as_ref().ok(), None).await;
        }
        let meta = match meta {
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
        let mut attempts = used;
        if attempts > 0 && attempts >= self.shared.config.max_attempts {
            let error = match last {
                "" => format!("gave up after {attempts} attempts"),
                last => format!("gave up after {attempts} attempts: {last}"),
            };
            return self
                .failed_for_good(
                    own,
                    record,
                    Some(&meta),
                    Some(route.name()),
                    Reason::RetriesExhausted,
                    &error,
                    attempts as i32,
                )
                .await;
        }
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
                Err(Attempt::Paused) => return Step::Paused,
                Err(Attempt::OverBound(need)) => return Step::OverBound(need),
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
                // A session the server ended for idling is this event's doing (its handler
                // waited inside the transaction): an attempt, as a handler's failure.
                Err(Attempt::Retryable(e)) | Err(Attempt::SessionEnded(e)) => {
                    attempts += 1;
                    if attempts >= self.shared.config.max_attempts {
                        let error = format!("gave up after {attempts} attempts: {e}");
                        return self
                            .failed_for_good(
                                own,
                                record,
                                Some(&meta),
                                Some(route.name()),
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
                        .failed_for_good(
                            own,
                            record,
                            Some(&meta),
                            Some(route.name()),
                            reason,
                            &e,
                            ran as i32,
                        )
                        .await;
                }
            }
        }
    }

    /// One transaction: dedup row, body, next offset. `Ok(true)` applied, `Ok(false)` duplicate.
    pub(super) async fn attempt(
        &self,
        own: &Ownership,
        record: &Record,
        meta: &Meta,
        route: &dyn Route,
    ) -> Result<bool, Attempt> {
        let mut tx = self
            .shared
            .begin_for(&record.topic)
            .await
            .map_err(Attempt::db)?;
        let fresh = crate::dedup::record(&mut tx, route.consumer(), meta.id)
            .await
            .map_err(|e| match e {
                crate::Error::Database(d) => Attempt::db(d),
                other => Attempt::Retryable(other.to_string()),
            })?;
        if fresh {
            run_body(route, &mut tx, record, meta)
                .await
                .map_err(BodyFailure::into_attempt)?;
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
        Attempt::owned(owned)?;
        tx.commit().await.map_err(Attempt::db)?;
        Ok(fresh)
    }

    /// Advances past a record of an unknown type.
    pub(super) async fn skip(&self, own: &Ownership, record: &Record) -> Step {
        let step = match self.write_with_retry(own, record, None).await {
            Written::Stop => Step::Stop,
            Written::Fenced => Step::Fenced,
            Written::Paused => Step::Paused,
            _ => Step::Done,
        };
        if matches!(step, Step::Done) {
            self.shared
                .stats
                .skipped(&self.shared.config.consumer, &record.topic, 1);
        }
        step
    }
}

/// How one attempt failed.
pub(crate) enum Attempt {
    Fenced,
    /// The group or topic is paused: rolled back, nothing applied.
    Paused,
    /// A hold would take the group past `held_bytes_limit`: rolled back, nothing applied
    /// (the bytes it would have held, as [`Step::OverBound`]).
    OverBound(i64),
    Unavailable(String),
    Retryable(String),
    /// The transaction failed by its own doing and its session is gone: the server ended it
    /// for idling (`idle_in_transaction_session_timeout`, or PgBouncer's
    /// `idle_transaction_timeout`: [`crate::idle_end`]), or a handler failed (retryably or for
    /// good, not as an outage) and the rollback found the session closed. Not an outage: an
    /// attempt of the record the transaction held, when it held one (as one at a time counts
    /// the handler's failure); a batch is halved.
    SessionEnded(String),
    Permanent(Reason, String),
}

impl Attempt {
    /// The offset update's answer: `Err` when another consumer took the partition over or
    /// its group or topic is paused (the transaction must roll back).
    pub(crate) fn owned(advance: offsets::Advance) -> Result<(), Attempt> {
        match advance {
            offsets::Advance::Advanced => Ok(()),
            offsets::Advance::Fenced => Err(Attempt::Fenced),
            offsets::Advance::Paused => Err(Attempt::Paused),
        }
    }

    pub(crate) fn db(e: sqlx::Error) -> Self {
        if crate::idle_end::ended_idle(&e) {
            return Attempt::SessionEnded(crate::idle_end::explain(&e.to_string()));
        }
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
#[derive(Clone)]
pub(crate) enum BodyFailure {
    /// Dead-letter it (reason, error).
    Dead(Reason, String),
    /// Retry it later (error, whose failure it is).
    Retry(String, Retry),
}

impl BodyFailure {
    /// The failure's error text.
    pub(crate) fn error(&self) -> &str {
        match self {
            BodyFailure::Retry(error, _) | BodyFailure::Dead(_, error) => error,
        }
    }
}

/// Whose a retryable failure is, which decides whether it counts as an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Retry {
    /// The handler's (retryable): an attempt.
    Handler,
    /// A dependency outage (the handler said unavailable): never an attempt.
    Outage,
    /// The server ended the session for idling in the transaction (`25P03`, seen in the
    /// handler's error): the transaction's own doing, whatever the handler called it.
    IdleEnded,
}

impl BodyFailure {
    /// The attempt's failure, when the body's is the first one seen.
    pub(crate) fn into_attempt(self) -> Attempt {
        match self {
            BodyFailure::Dead(reason, error) => Attempt::Permanent(reason, error),
            BodyFailure::Retry(error, Retry::Handler) => Attempt::Retryable(error),
            BodyFailure::Retry(error, Retry::Outage) => Attempt::Unavailable(error),
            BodyFailure::Retry(error, Retry::IdleEnded) => Attempt::SessionEnded(error),
        }
    }
}

/// Runs a handler body, turning its errors and panics into a [`BodyFailure`].
pub(crate) async fn run_body(
    route: &dyn crate::route::Route,
    tx: &mut Transaction<'_, Postgres>,
    record: &Record,
    meta: &Meta,
) -> Result<(), BodyFailure> {
    let caught = AssertUnwindSafe(route.call(tx, record, meta))
        .catch_unwind()
        .await;
    let (outcome, outage_like) = body_outcome(route, caught);
    own_session_says(tx, outcome, outage_like).await
}

/// Runs a batch handler's body once for `items`, as [`run_body`] does for one record.
pub(crate) async fn run_batch_body(
    route: &dyn crate::route::Route,
    tx: &mut Transaction<'_, Postgres>,
    items: &[(&Record, &Meta)],
) -> Result<(), BodyFailure> {
    let caught = AssertUnwindSafe(route.call_batch(tx, items))
        .catch_unwind()
        .await;
    let (outcome, outage_like) = body_outcome(route, caught);
    own_session_says(tx, outcome, outage_like).await
}

/// A handler's retryable or permanent failure holding a database error that looks like an
/// outage (`outage_like`: a terminated backend, an I/O error, a pool timeout in its `source()`
/// chain) is an outage only if the consumer's own session is gone: then the error was the
/// session's loss (an operator's `pg_terminate_backend`, a restart), never an attempt. With
/// the session alive the error came from elsewhere (the handler's own pool, another database,
/// a file read through `sqlx`): the handler's label stands, so a record failing that way every
/// time is still dead-lettered or held. One statement tells, run only then.
async fn own_session_says(
    tx: &mut Transaction<'_, Postgres>,
    outcome: Result<(), BodyFailure>,
    outage_like: bool,
) -> Result<(), BodyFailure> {
    let Err(f) = outcome else { return Ok(()) };
    if !outage_like {
        return Err(f);
    }
    // In a transaction the handler's error aborted, the statement fails with 25P02: the
    // session is alive. An ordinary ERROR may be an abandoned statement's late answer (a
    // handler that gave up waiting on it): asked once more, the session says what it is.
    let mut answer = probe(tx).await;
    if answer.as_ref().is_err_and(ordinary) {
        answer = probe(tx).await;
    }
    match answer {
        Err(e) if crate::idle_end::ended_idle(&e) => Err(BodyFailure::Retry(
            crate::idle_end::explain_after(f.error(), &e),
            Retry::IdleEnded,
        )),
        Err(e) if postal_shared::database_unavailable(&e) && !ordinary(&e) => {
            Err(BodyFailure::Retry(f.error().to_owned(), Retry::Outage))
        }
        _ => Err(f),
    }
}

/// One statement on the consumer's own transaction, to learn whether its session is alive.
async fn probe(tx: &mut Transaction<'_, Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await.map(|_| ())
}

/// An error the server sent at severity ERROR: about a statement, on a session that goes on
/// (the session's end comes as FATAL, or as an I/O error).
fn ordinary(e: &sqlx::Error) -> bool {
    use sqlx::postgres::{PgDatabaseError, PgSeverity};
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    db.try_downcast_ref::<PgDatabaseError>()
        .is_some_and(|pg| matches!(pg.severity(), PgSeverity::Error))
}

/// The body's outcome, and whether a retryable or permanent failure holds an outage-like
/// database error ([`own_session_says`] decides what it is).
fn body_outcome(
    route: &dyn crate::route::Route,
    caught: Result<Result<(), Failure>, Box<dyn std::any::Any + Send>>,
) -> (Result<(), BodyFailure>, bool) {
    // Handler errors and panic messages may quote the record (a payload's string in a decode
    // error): bounded and escaped before they are logged or stored.
    let bounded = |e: &dyn std::fmt::Display| {
        postal_shared::text::bounded(&e.to_string(), postal_shared::text::MAX_ERROR_BYTES)
            .into_owned()
    };
    let outage_like = |e: &crate::handler::BoxError| crate::idle_end::outage_within(e.as_ref());
    match caught {
        Ok(Ok(())) => (Ok(()), false),
        Ok(Err(Failure::Undecodable(e))) => (
            Err(BodyFailure::Dead(Reason::Undecodable, bounded(&e))),
            false,
        ),
        // The server's word on the session outranks the handler's label: an idle end is an
        // attempt, whatever the handler called the error it returned.
        Ok(Err(Failure::Handler(HandlerError::Permanent(e))))
            if crate::idle_end::ended_idle_within(e.as_ref()) =>
        {
            (Err(retry(bounded(&e), e.as_ref(), Retry::Handler)), false)
        }
        Ok(Err(Failure::Handler(HandlerError::Permanent(e)))) => (
            Err(BodyFailure::Dead(Reason::Permanent, bounded(&e))),
            outage_like(&e),
        ),
        Ok(Err(Failure::Handler(HandlerError::Retryable(e)))) => {
            let f = retry(bounded(&e), e.as_ref(), Retry::Handler);
            let like = matches!(f, BodyFailure::Retry(_, Retry::Handler)) && outage_like(&e);
            (Err(f), like)
        }
        Ok(Err(Failure::Handler(HandlerError::Unavailable(e)))) => {
            (Err(retry(bounded(&e), e.as_ref(), Retry::Outage)), false)
        }
        Err(panic) => {
            let msg = bounded(&panic_message(panic.as_ref()));
            tracing::error!(handler = route.name(), panic = %msg, "handler panicked");
            (
                Err(BodyFailure::Dead(Reason::Panic, format!("panic: {msg}"))),
                false,
            )
        }
    }
}

/// A retryable body failure: `whose`, unless the server ended the session for idling (in `e`'s
/// chain), which says so whatever the handler called it.
fn retry(error: String, e: &(dyn std::error::Error + 'static), whose: Retry) -> BodyFailure {
    if crate::idle_end::ended_idle_within(e) {
        BodyFailure::Retry(crate::idle_end::explain(&error), Retry::IdleEnded)
    } else {
        BodyFailure::Retry(error, whose)
    }
}
