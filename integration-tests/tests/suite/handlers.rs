//! The handlers the consumer scenarios route to. What they do is driven by the payload, so
//! each scenario controls failures per event.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postal_consumer::{idempotent, Event, HandlerError, State};
use serde::Deserialize;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

/// The consumer name (dedup scope) of [`apply`].
pub const CONSUMER: &str = "effects";

/// A test payload: `n` is recorded in `effects`; `fail` picks a failure.
#[derive(Debug, Deserialize)]
pub struct Job {
    /// Any number, recorded with the effect.
    pub n: i64,
    /// `permanent`, `retry` (fails `retries` times, then succeeds), `panic`, `swallow` (ignores
    /// a failed statement's error and returns Ok) or `block` (waits until [`release`]d).
    #[serde(default)]
    pub fail: Option<String>,
    /// Failures before a `retry` job succeeds.
    #[serde(default)]
    pub retries: u32,
    /// For [`forward`]: the topic to forward the job to.
    #[serde(default)]
    pub next: Option<String>,
}

/// What a test sees of [`apply`]'s runs: the consumer's state, shared by its handler calls
/// and the test (each test its own).
#[derive(Clone, Default)]
pub struct Probe(Arc<Runs>);

#[derive(Default)]
struct Runs {
    attempts: Mutex<HashMap<Uuid, u32>>,
    entered: Mutex<HashSet<Uuid>>,
    released: Mutex<HashSet<Uuid>>,
}

impl Probe {
    /// Whether a `block` job's handler is running.
    pub fn entered(&self, id: Uuid) -> bool {
        self.0.entered.lock().unwrap().contains(&id)
    }

    /// Lets a `block` job's handler finish.
    pub fn release(&self, id: Uuid) {
        self.0.released.lock().unwrap().insert(id);
    }

    /// How many times the handler ran for `id`.
    pub fn attempts(&self, id: Uuid) -> u32 {
        self.0
            .attempts
            .lock()
            .unwrap()
            .get(&id)
            .copied()
            .unwrap_or(0)
    }
}

/// Writes one `effects` row, then fails as the payload asks.
#[idempotent(consumer = "effects")]
pub async fn apply(
    State(probe): State<Probe>,
    tx: &mut Transaction<'_, Postgres>,
    event: Event<Job>,
) -> Result<(), HandlerError> {
    let id = event.id.as_uuid();
    let attempt = {
        let mut a = probe.0.attempts.lock().unwrap();
        let c = a.entry(id).or_default();
        *c += 1;
        *c
    };
    sqlx::query("INSERT INTO effects (event_id, n, consumer) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(event.payload.n)
        .bind(CONSUMER)
        .execute(&mut **tx)
        .await?;
    match event.payload.fail.as_deref() {
        Some("permanent") => Err(HandlerError::permanent("order rejected by a business rule")),
        Some("retry") if attempt <= event.payload.retries => Err(HandlerError::retryable(format!(
            "flaky dependency (attempt {attempt})"
        ))),
        Some("panic") => panic!("handler bug for event {id}"),
        Some("swallow") => {
            // A handler bug: a failed statement's error is ignored, which leaves the
            // transaction aborted although the handler returns Ok.
            let _ = sqlx::query("SELECT 1 / 0").execute(&mut **tx).await;
            Ok(())
        }
        Some("block") => {
            probe.0.entered.lock().unwrap().insert(id);
            while !probe.0.released.lock().unwrap().contains(&id) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The middle service of a chain: records the job in `effects` and, in the same transaction,
/// enqueues it (as a new event) to the topic named in `next` through the outbox.
#[idempotent(consumer = "middle")]
pub async fn forward(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<Job>,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (event_id, n, consumer) VALUES ($1, $2, 'middle')")
        .bind(event.id.as_uuid())
        .bind(event.payload.n)
        .execute(&mut **tx)
        .await?;
    let next = event
        .payload
        .next
        .as_deref()
        .ok_or_else(|| HandlerError::permanent("no `next` topic"))?;
    let key = event.key.clone().unwrap_or_else(|| "none".into());
    // The output's id is derived from the input's: applying the input again (a replay past
    // the dedup retention) emits the same event, which the next hop deduplicates.
    let out = postal_producer::NewEvent::json(
        next,
        key.as_str(),
        "job",
        &serde_json::json!({ "n": event.payload.n }),
    )
    .map_err(HandlerError::permanent)?
    .with_id(postal_consumer::EventId::derived(event.id, "forward"));
    postal_producer::enqueue_once(tx, out)
        .await
        .map_err(|e| match e {
            // Classified like the handler's own sqlx calls: a lost connection is an outage
            // (waited out, not counted as a failed attempt).
            postal_producer::Error::Database(db) => HandlerError::from(db),
            other => HandlerError::permanent(other),
        })?;
    Ok(())
}

/// [`apply`] for an untyped (clonable) payload: records `n` in `effects`.
#[idempotent(consumer = "effects")]
pub async fn apply_value(
    tx: &mut Transaction<'_, Postgres>,
    event: Event<serde_json::Value>,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (event_id, n, consumer) VALUES ($1, $2, $3)")
        .bind(event.id.as_uuid())
        .bind(event.payload["n"].as_i64().unwrap_or(-1))
        .bind(CONSUMER)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// [`apply`] as a batch handler: writes the batch's `effects` rows in one statement (in the
/// batch's order), then fails as the first event that asks for a failure does (`permanent`,
/// `retry` while its runs are at most `retries`, `panic`, `swallow`). Each call counts a run
/// for every event in it.
#[idempotent(consumer = "effects")]
pub async fn apply_batch(
    State(probe): State<Probe>,
    tx: &mut Transaction<'_, Postgres>,
    events: &[Event<Job>],
) -> Result<(), HandlerError> {
    let runs: Vec<u32> = {
        let mut a = probe.0.attempts.lock().unwrap();
        events
            .iter()
            .map(|e| {
                let c = a.entry(e.id.as_uuid()).or_default();
                *c += 1;
                *c
            })
            .collect()
    };
    let ids: Vec<Uuid> = events.iter().map(|e| e.id.as_uuid()).collect();
    let ns: Vec<i64> = events.iter().map(|e| e.payload.n).collect();
    sqlx::query(
        "INSERT INTO effects (event_id, n, consumer)
         SELECT id, n, $3 FROM unnest($1::uuid[], $2::bigint[]) WITH ORDINALITY AS t(id, n, i)
         ORDER BY i",
    )
    .bind(&ids)
    .bind(&ns)
    .bind(CONSUMER)
    .execute(&mut **tx)
    .await?;
    for (e, run) in events.iter().zip(runs) {
        let id = e.id;
        match e.payload.fail.as_deref() {
            Some("permanent") => {
                return Err(HandlerError::permanent(format!(
                    "event {id} rejected by a business rule"
                )))
            }
            Some("retry") if run <= e.payload.retries => {
                return Err(HandlerError::retryable(format!(
                    "flaky dependency for event {id} (run {run})"
                )))
            }
            Some("panic") => panic!("handler bug for event {id}"),
            Some("swallow") => {
                let _ = sqlx::query("SELECT 1 / 0").execute(&mut **tx).await;
            }
            _ => {}
        }
    }
    Ok(())
}
