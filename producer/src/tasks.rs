//! In-process task handlers: the relay runs a registered async handler per event type instead
//! of publishing the event to a broker (a task outbox: report generation, e-mail sending).
//!
//! The outbox row is the task. It is claimed like any event, so everything the relay does for
//! broker events holds for tasks: one owner per key at a time (two relays never run the same
//! task, and tasks of one key run one after another in outbox order), retries with backoff,
//! parking after `max_attempts` or on a permanent error, retention and metrics. While a handler
//! runs, the relay keeps its claim alive for as long as it renews its partition leases (if its
//! heartbeats fail, it aborts the handler before they run out); if the process dies, the claim
//! rolls back and the task runs again once the key partition's lease has passed to a live
//! relay. A handler can
//! therefore run more than once for one task (after a crash between its side effect and the
//! commit): it gets the event id as its idempotency key.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::Semaphore;
use tokio_util::task::AbortOnDropHandle;

use postal_shared::EventId;

use crate::transport::{FailureKind, OutboundEvent, PublishError, Transport};

/// One task, as its handler sees it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Task {
    /// The event id: use it as the idempotency key of the handler's side effects.
    pub id: EventId,
    /// The outbox topic the task was enqueued on.
    pub topic: String,
    /// The event key (tasks of one key run one at a time, in outbox order).
    pub key: String,
    /// The event type the handler was registered for.
    pub event_type: String,
    /// Payload schema version.
    pub schema_version: i32,
    /// When the event occurred.
    pub occurred_at: DateTime<Utc>,
    /// Payload content type.
    pub content_type: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// User headers (including `traceparent` when captured).
    pub headers: Vec<(String, String)>,
    /// This run's number: 1 on the first run, higher after failed attempts.
    pub attempt: i32,
}

impl Task {
    /// The payload decoded from JSON; a payload that does not decode is a permanent error
    /// (the task is parked with the reason, not retried).
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, TaskError> {
        serde_json::from_slice(&self.payload).map_err(|e| {
            TaskError::permanent(format!(
                "payload is not a valid {}: {e}",
                std::any::type_name::<T>()
            ))
        })
    }
}

/// Why a task handler failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TaskError {
    /// Worth another attempt (a downstream service was unavailable): retried with backoff,
    /// parked after `max_attempts`.
    #[error("{0}")]
    Retryable(String),
    /// Will never succeed as it is (malformed input): parked at once with the reason.
    #[error("{0}")]
    Permanent(String),
}

impl TaskError {
    /// A retryable failure.
    pub fn retryable(reason: impl std::fmt::Display) -> Self {
        TaskError::Retryable(reason.to_string())
    }

    /// A permanent failure.
    pub fn permanent(reason: impl std::fmt::Display) -> Self {
        TaskError::Permanent(reason.to_string())
    }
}

type Handler = Arc<dyn Fn(Task) -> BoxFuture<'static, Result<(), TaskError>> + Send + Sync>;

/// Settings of the task runner.
#[derive(Clone, Debug)]
pub struct TaskConfig {
    /// Handlers running at once across all keys (default 16).
    pub concurrency: usize,
    /// Longest a handler may run; it is then cancelled and the attempt counts as failed
    /// (default 15 min). The relay keeps the claim alive meanwhile, so this may exceed the lease
    /// (as long as the relay's heartbeats renew its partition leases).
    pub timeout: Duration,
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig {
            concurrency: 16,
            timeout: Duration::from_secs(15 * 60),
        }
    }
}

/// Runs outbox events as in-process tasks, one handler per event type.
///
/// It needs to hear from the relay when a batch was recorded ([`Transport::recorded`]): a
/// transport that wraps it must pass that call (and `chains_keys_across_batches`) on. Register
/// it under one destination of a [`crate::Router`] only.
///
/// ```
/// use postal_producer::{Task, TaskError, TaskTransport};
///
/// #[derive(serde::Deserialize)]
/// struct SendEmail { to: String }
///
/// let tasks = TaskTransport::new(Default::default())
///     .on("email.requested", |task: Task| async move {
///         let mail: SendEmail = task.json()?;
///         // Send with `task.id` as the idempotency key, so a re-run after a crash is harmless.
///         let _ = (mail.to, task.id);
///         Ok::<_, TaskError>(())
///     });
/// ```
#[derive(Clone)]
pub struct TaskTransport {
    handlers: HashMap<String, Handler>,
    config: TaskConfig,
    running: Arc<Semaphore>,
    /// Per key, the end of its latest chain of tasks: `true` as soon as all its tasks
    /// succeeded, `false` once the relay recorded the chain's batch if one failed (or the
    /// batch could not be recorded). Batches in flight at once run a key's tasks one after
    /// another, in claim order; after a failure the key's later tasks wait until the failure
    /// is in the database, where it holds them back until its retry ran.
    tails: Arc<std::sync::Mutex<HashMap<String, (u64, Tail)>>>,
    chains: Arc<std::sync::atomic::AtomicU64>,
    /// The chains whose batch the relay has not recorded yet, by the event id of each chain's
    /// first task (several after a task was handed out again before its batch was recorded).
    unrecorded: Arc<std::sync::Mutex<HashMap<EventId, std::collections::VecDeque<Unrecorded>>>>,
}

/// A chain of one key's tasks in a batch, until the relay recorded the batch.
struct Unrecorded {
    key: String,
    chain_no: u64,
    /// Resolves the chain's tail; taken by the chain itself when all its tasks succeeded.
    done: Arc<std::sync::Mutex<Option<tokio::sync::oneshot::Sender<bool>>>>,
}

type Tail = futures::future::Shared<BoxFuture<'static, bool>>;

impl std::fmt::Debug for TaskTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut types: Vec<&String> = self.handlers.keys().collect();
        types.sort();
        f.debug_struct("TaskTransport")
            .field("event_types", &types)
            .field("config", &self.config)
            .finish()
    }
}

impl TaskTransport {
    /// A runner without handlers yet.
    pub fn new(config: TaskConfig) -> Self {
        let running = Arc::new(Semaphore::new(config.concurrency.max(1)));
        TaskTransport {
            handlers: HashMap::new(),
            config,
            running,
            tails: Arc::default(),
            chains: Arc::default(),
            unrecorded: Arc::default(),
        }
    }

    /// Registers the handler of `event_type` (replacing an earlier one).
    pub fn on<F, Fut>(mut self, event_type: impl Into<String>, handler: F) -> Self
    where
        F: Fn(Task) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), TaskError>> + Send + 'static,
    {
        self.handlers.insert(
            event_type.into(),
            Arc::new(move |task| handler(task).boxed()),
        );
        self
    }

    async fn run_one(
        handler: Handler,
        task: Task,
        running: Arc<Semaphore>,
        timeout: Duration,
    ) -> Result<(), PublishError> {
        let _permit = running.acquire_owned().await.expect("never closed");
        let id = task.id;
        let event_type = task.event_type.clone();
        // Spawned, so that a panicking handler fails its task instead of the relay.
        // Aborted with its claim (at the handler's next await, with what it spawned left
        // running): a handler does not run on after the relay gave up its task.
        let run =
            AbortOnDropHandle::new(tokio::spawn(tokio::time::timeout(timeout, handler(task))));
        let started = std::time::Instant::now();
        let outcome = match run.await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(TaskError::Retryable(r)))) => {
                Err(PublishError::new(FailureKind::Transient, r))
            }
            Ok(Ok(Err(TaskError::Permanent(r)))) => {
                Err(PublishError::new(FailureKind::Permanent, r))
            }
            Ok(Err(_elapsed)) => Err(PublishError::new(
                FailureKind::Transient,
                format!("task handler did not finish within {timeout:?}"),
            )),
            Err(join) => Err(PublishError::new(
                FailureKind::Transient,
                format!("task handler panicked: {}", panic_message(join)),
            )),
        };
        metrics::histogram!("postal_task_seconds", "event_type" => event_type.clone())
            .record(started.elapsed().as_secs_f64());
        if let Err(e) = &outcome {
            tracing::debug!(event_id = %id, event_type, reason = %e.reason, "task failed");
        }
        outcome
    }
}

fn panic_message(join: tokio::task::JoinError) -> String {
    match join.try_into_panic() {
        Ok(p) => p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into()),
        Err(e) => e.to_string(),
    }
}

impl Transport for TaskTransport {
    type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

    /// A key's tasks wait for those of earlier batches (see `send`).
    fn chains_keys_across_batches(&self) -> bool {
        true
    }

    /// Ends the batch's chains: a key's tasks in later batches go on if these all succeeded
    /// and were recorded, else they are held back.
    fn recorded(&self, batch: &[OutboundEvent], committed: bool) {
        let mut ended = Vec::new();
        {
            let mut unrecorded = self.unrecorded.lock().expect("unrecorded lock");
            for e in batch {
                if let Some(queue) = unrecorded.get_mut(&e.id) {
                    if let Some(chain) = queue.pop_front() {
                        ended.push(chain);
                    }
                    if queue.is_empty() {
                        unrecorded.remove(&e.id);
                    }
                }
            }
        }
        let _ = committed; // a chain that succeeded went on already, recorded or not
        let mut tails = self.tails.lock().expect("tails lock");
        for chain in ended {
            if tails
                .get(&chain.key)
                .is_some_and(|(n, _)| *n == chain.chain_no)
            {
                tails.remove(&chain.key);
            }
            // Still here: a task of the chain failed, or the chain never ended.
            if let Some(done) = chain.done.lock().expect("chain end").take() {
                let _ = done.send(false);
            }
        }
    }

    /// Starts the batch's tasks: keys run concurrently (up to `concurrency` handlers), the
    /// tasks of one key one after another in outbox order, also across batches in flight at
    /// once. After a failure, the key's later tasks are held back, not run.
    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        let mut by_key: Vec<(String, Vec<usize>)> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (i, e) in batch.iter().enumerate() {
            let slot = *index.entry(e.key.as_str()).or_insert_with(|| {
                by_key.push((e.key.clone(), Vec::new()));
                by_key.len() - 1
            });
            by_key[slot].1.push(i);
        }
        let mut chains = Vec::with_capacity(by_key.len());
        for (key, positions) in by_key {
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<bool>();
            let tail: Tail = done_rx.map(|r| r.unwrap_or(false)).boxed().shared();
            let chain_no = self
                .chains
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let previous = self
                .tails
                .lock()
                .expect("tails lock")
                .insert(key.clone(), (chain_no, tail))
                .map(|(_, t)| t);
            let done = Arc::new(std::sync::Mutex::new(Some(done_tx)));
            self.unrecorded
                .lock()
                .expect("unrecorded lock")
                .entry(batch[positions[0]].id)
                .or_default()
                .push_back(Unrecorded {
                    key: key.clone(),
                    chain_no,
                    done: done.clone(),
                });
            let jobs: Vec<(usize, Option<Handler>, OutboundEvent)> = positions
                .into_iter()
                .map(|i| {
                    let e = batch[i].clone();
                    (i, self.handlers.get(&e.event_type).cloned(), e)
                })
                .collect();
            let running = self.running.clone();
            let timeout = self.config.timeout;
            chains.push(AbortOnDropHandle::new(tokio::spawn(async move {
                let mut out = Vec::with_capacity(jobs.len());
                // Wait until the key's tasks of earlier batches are recorded; if one failed (or
                // its batch could not be recorded), hold back.
                let mut failed = match previous {
                    Some(p) => !p.await,
                    None => false,
                };
                for (i, handler, e) in jobs {
                    let outcome = if failed {
                        Err(PublishError::new(
                            FailureKind::HeldBack,
                            "an earlier task of this key failed",
                        ))
                    } else if let Some(handler) = handler {
                        let task = Task {
                            id: e.id,
                            topic: e.topic,
                            key: e.key,
                            event_type: e.event_type,
                            schema_version: e.schema_version,
                            occurred_at: e.occurred_at,
                            content_type: e.content_type,
                            payload: e.payload,
                            headers: e.headers,
                            attempt: e.attempts + 1,
                        };
                        Self::run_one(handler, task, running.clone(), timeout).await
                    } else {
                        Err(PublishError::new(
                            FailureKind::Permanent,
                            format!(
                                "no task handler is registered for event type {:?}",
                                e.event_type
                            ),
                        ))
                    };
                    failed |= outcome.is_err();
                    out.push((i, outcome));
                }
                if !failed {
                    // The key's later tasks need not wait for the record: these ran.
                    if let Some(done) = done.lock().expect("chain end").take() {
                        let _ = done.send(true);
                    }
                }
                out
            })));
        }
        let n = batch.len();
        async move {
            let mut outcomes: Vec<Result<(), PublishError>> = (0..n)
                .map(|_| {
                    Err(PublishError::new(
                        FailureKind::Transient,
                        "task runner stopped before the task finished",
                    ))
                })
                .collect();
            // A chain that panicked or was aborted leaves its tasks failed (retried later).
            for results in futures::future::join_all(chains)
                .await
                .into_iter()
                .flatten()
            {
                for (i, r) in results {
                    outcomes[i] = r;
                }
            }
            outcomes
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::sample_event;

    fn runner() -> TaskTransport {
        TaskTransport::new(TaskConfig::default()).on("job", |task: Task| async move {
            if task.payload == b"fail" {
                Err(TaskError::retryable("fails"))
            } else {
                Ok(())
            }
        })
    }

    /// Sends `failed` (a batch whose task fails), then `later` (a later task of the same key):
    /// `later` waits until `failed`'s batch is reported with `committed`, and is then held back.
    async fn held_back_until_recorded(
        tasks: &TaskTransport,
        failed: &OutboundEvent,
        later: &OutboundEvent,
        committed: bool,
    ) {
        let outcomes = tasks.send(std::slice::from_ref(failed)).await.await;
        assert_eq!(
            outcomes[0].as_ref().unwrap_err().kind,
            FailureKind::Transient
        );
        let mut waiting = std::pin::pin!(tasks.send(std::slice::from_ref(later)).await);
        assert!(
            tokio::time::timeout(Duration::from_millis(200), &mut waiting)
                .await
                .is_err(),
            "the later task must wait for the failed one's batch"
        );
        tasks.recorded(std::slice::from_ref(failed), committed);
        let outcomes = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("released once the batch is reported");
        assert_eq!(
            outcomes[0].as_ref().unwrap_err().kind,
            FailureKind::HeldBack
        );
    }

    /// Guarantee: after a key's task failed in one batch, its task in a later batch does not
    /// run (nor finish) before the relay recorded the first batch, and is then held back.
    #[tokio::test]
    async fn after_a_failure_the_key_waits_for_the_record_and_is_held_back() {
        let tasks = runner();
        let mut first = sample_event("t", 1);
        first.payload = b"fail".to_vec();
        let second = sample_event("t", 2);
        held_back_until_recorded(&tasks, &first, &second, true).await;
    }

    /// Guarantee: after a key's tasks succeeded, its task in a later batch runs at once, without
    /// waiting for the first batch's record (whose other tasks may still be running).
    #[tokio::test]
    async fn after_a_success_the_key_goes_on_before_the_record() {
        let tasks = runner();
        let first = sample_event("t", 1);
        let second = sample_event("t", 2);
        assert!(tasks.send(std::slice::from_ref(&first)).await.await[0].is_ok());
        let outcomes = tokio::time::timeout(
            Duration::from_secs(5),
            tasks.send(std::slice::from_ref(&second)).await,
        )
        .await
        .expect("no wait for the record");
        assert!(outcomes[0].is_ok());
        // A batch given up without a record releases the key as failed.
        let mut third = sample_event("t", 3);
        third.payload = b"fail".to_vec();
        let fourth = sample_event("t", 4);
        held_back_until_recorded(&tasks, &third, &fourth, false).await;
    }
}
