//! In-process task handlers: the relay runs a registered async handler per event type instead
//! of publishing the event to a broker (a task outbox: report generation, e-mail sending).
//!
//! The outbox row is the task. The relay checks it out ([`crate::Transport::checks_out`]):
//! the claim commits at once, marking the row with its run number and a run lease that the
//! relay renews while the handler runs, so no transaction stays open however long a handler
//! takes. What that gives a task:
//!
//! - **One run at a time, in key order.** A key's next task is claimable only once the outcome
//!   of the one before is recorded (success, retry scheduled, or parked); tasks of different
//!   keys run concurrently, up to [`TaskConfig::concurrency`].
//! - **A run number that survives restarts** ([`Task::attempt`]): it goes up by one at every
//!   run, whichever relay runs it, also after a crash, and is never reset. A handler that sees
//!   `attempt > 1` knows an earlier run started and may have done part of its work. A run cut
//!   off without an outcome counts as a failed attempt: a task whose runs keep killing their
//!   process is parked once its `max_attempts` are used up.
//! - **Fencing.** If the relay cannot renew the run lease (database unreachable, the process
//!   was frozen), it aborts the handler, at its next await, before a quarter of the lease is
//!   left; the task then runs again, with the next run number, once the lease has ended. A
//!   stale run's outcome is never recorded. A handler whose side effects must never come from
//!   a stale run passes `attempt` on as a fencing token (a downstream that keeps the highest
//!   number it saw per task id refuses the older).
//! - Retries with backoff, parking after `max_attempts` or on a permanent error, retention and
//!   metrics, as for any event.
//!
//! A handler can therefore run more than once for one task (after a crash between its side
//! effect and the record): it gets the event id as its idempotency key.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use postal_shared::{EventId, FromRef, State};

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
    /// This run's number: 1 on the first run; one more at every later run, also when the one
    /// before was cut off by a crash or a lost run lease (it then may have done part of its
    /// work), and never reset (not by `postal failed requeue` either). Strictly increasing
    /// across the runs of a task: a fencing token.
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

/// What [`TaskTransport::on`] registers: an async function or closure taking the [`Task`], or
/// taking the runner's state first (`State<T>`, with `T` the whole state or a part of it by
/// [`FromRef`]). `M` only tells the two shapes apart.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a task handler for a runner with state `{S}`",
    note = "a task handler is an async fn (or closure) of `(Task)` or `(State<T>, Task)` returning `Result<(), TaskError>`, with `T: FromRef<{S}>`"
)]
pub trait TaskHandler<M, S>: Send + Sync + 'static {
    /// The handler, bound to `state`.
    #[doc(hidden)]
    fn bind(self, state: &S) -> Handler;
}

impl<F, Fut, S> TaskHandler<(Task,), S> for F
where
    F: Fn(Task) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), TaskError>> + Send + 'static,
{
    fn bind(self, _state: &S) -> Handler {
        Arc::new(move |task| self(task).boxed())
    }
}

impl<F, Fut, S, T> TaskHandler<(State<T>, Task), S> for F
where
    F: Fn(State<T>, Task) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), TaskError>> + Send + 'static,
    T: FromRef<S> + Clone + Send + Sync + 'static,
{
    fn bind(self, state: &S) -> Handler {
        let part = T::from_ref(state);
        Arc::new(move |task| self(State(part.clone()), task).boxed())
    }
}

/// Settings of the task runner.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TaskConfig {
    /// Handlers running at once across all keys (default 16).
    pub concurrency: usize,
    /// Longest a handler may run; it is then cancelled and the attempt counts as failed
    /// (default 15 min). The relay renews the task's run lease meanwhile, so this may exceed
    /// the lease.
    pub timeout: Duration,
}

postal_shared::setters!(TaskConfig {
    concurrency: usize,
    timeout: Duration,
});

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
/// The relay checks its rows out ([`Transport::checks_out`]; a transport that wraps it must
/// pass that on) and hands it one task at a time. Run it in a relay group of its own
/// ([`crate::TopicFilter`]): a [`crate::Router`] with a task destination makes the relay check
/// out the rows of every destination.
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
pub struct TaskTransport<S = ()> {
    /// What handlers registered from here on take their `State<T>` from.
    state: Arc<S>,
    handlers: HashMap<String, Handler>,
    config: TaskConfig,
    running: Arc<Semaphore>,
    /// Cancelled by [`Transport::abort_running`] (then replaced by a fresh one): the handlers
    /// running or waiting at that moment stop.
    stop: Arc<std::sync::Mutex<CancellationToken>>,
}

/// A clone shares the handlers and the concurrency limit, not the stop: a relay stopping
/// aborts the handlers it started, never those of another relay given a clone.
impl<S> Clone for TaskTransport<S> {
    fn clone(&self) -> Self {
        TaskTransport {
            state: self.state.clone(),
            handlers: self.handlers.clone(),
            config: self.config.clone(),
            running: self.running.clone(),
            stop: Arc::default(),
        }
    }
}

impl<S> std::fmt::Debug for TaskTransport<S> {
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
            state: Arc::new(()),
            handlers: HashMap::new(),
            config,
            running,
            stop: Arc::default(),
        }
    }
}

impl<S> TaskTransport<S> {
    /// Gives the handlers registered after this call the application state `state`: a
    /// handler taking `State<T>` gets `T::from_ref(&state)` (every `Clone` type is its own
    /// part), as consumer handlers do. Handlers already registered keep theirs.
    ///
    /// ```
    /// use postal_producer::{State, Task, TaskConfig, TaskError, TaskTransport};
    ///
    /// #[derive(Clone)]
    /// struct Mailer { sender: String }
    ///
    /// async fn send_email(State(mailer): State<Mailer>, task: Task) -> Result<(), TaskError> {
    ///     let _ = (mailer.sender, task.id); // `task.id`: the idempotency key
    ///     Ok(())
    /// }
    ///
    /// let tasks = TaskTransport::new(TaskConfig::default())
    ///     .state(Mailer { sender: "noreply@example.com".into() })
    ///     .on("email.requested", send_email);
    /// ```
    pub fn state<S2>(self, state: S2) -> TaskTransport<S2> {
        TaskTransport {
            state: Arc::new(state),
            handlers: self.handlers,
            config: self.config,
            running: self.running,
            stop: self.stop,
        }
    }

    /// Registers the handler of `event_type` (replacing an earlier one): an async function
    /// or closure of `(Task)`, or of `(State<T>, Task)` (see [`state`](Self::state)).
    pub fn on<M, H: TaskHandler<M, S>>(
        mut self,
        event_type: impl Into<String>,
        handler: H,
    ) -> Self {
        let bound = handler.bind(&self.state);
        self.handlers.insert(event_type.into(), bound);
        self
    }

    async fn run_one(
        handler: Handler,
        task: Task,
        running: Arc<Semaphore>,
        timeout: Duration,
        stop: CancellationToken,
    ) -> Result<(), PublishError> {
        let stopped = || {
            Err(PublishError::new(
                FailureKind::HeldBack,
                "the relay stopped before the task finished (not counted as an attempt)",
            ))
        };
        let _permit = tokio::select! {
            p = running.acquire_owned() => p.expect("never closed"),
            _ = stop.cancelled() => return stopped(),
        };
        let id = task.id;
        let event_type = task.event_type.clone();
        // Spawned, so that a panicking handler fails its task instead of the relay.
        // Aborted with its run (at the handler's next await, with what it spawned left
        // running): a handler does not run on after the relay gave up its task.
        let mut run =
            AbortOnDropHandle::new(tokio::spawn(tokio::time::timeout(timeout, handler(task))));
        let started = std::time::Instant::now();
        let joined = tokio::select! {
            // An outcome that is there is kept, even when the stop came at the same time.
            biased;
            j = &mut run => j,
            _ = stop.cancelled() => {
                // Stopping: abort the handler, and report only once it has really ended
                // (blocking code runs on until its next `.await`), so that its task is not
                // handed out again while it still runs.
                run.abort();
                let _ = (&mut run).await;
                return stopped();
            }
        };
        let outcome = match joined {
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

impl<S: Send + Sync + 'static> Transport for TaskTransport<S> {
    type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

    /// Handlers may run for minutes: the relay must not hold a claim open meanwhile, and
    /// checks out no more tasks than can run at once (`concurrency`), so that a task's run
    /// number goes up only when it is about to start.
    fn checks_out(&self) -> Option<usize> {
        Some(self.config.concurrency.max(1))
    }

    /// Aborts every handler of this runner (not of its clones) running or waiting for its
    /// turn: each task's outcome becomes "held back" (given back, no attempt used) once its
    /// handler's future has ended. (Work the handler spawned, `spawn_blocking` included, may
    /// run on: the relay gives such tasks back due only at the end of their run leases.)
    fn abort_running(&self) {
        let mut stop = self.stop.lock().expect("stop lock");
        stop.cancel();
        *stop = CancellationToken::new();
    }

    /// Starts the batch's tasks (the relay hands over one at a time): keys run concurrently
    /// (up to `concurrency` handlers), the tasks of one key one after another; after a
    /// failure, the key's later tasks in the batch are held back, not run.
    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        let mut by_key: Vec<Vec<usize>> = Vec::new();
        let mut index: HashMap<(&str, &str), usize> = HashMap::new();
        for (i, e) in batch.iter().enumerate() {
            let slot = *index.entry(e.order_key()).or_insert_with(|| {
                by_key.push(Vec::new());
                by_key.len() - 1
            });
            by_key[slot].push(i);
        }
        let mut chains = Vec::with_capacity(by_key.len());
        for positions in by_key {
            let jobs: Vec<(usize, Option<Handler>, OutboundEvent)> = positions
                .into_iter()
                .map(|i| {
                    let e = batch[i].clone();
                    (i, self.handlers.get(&e.event_type).cloned(), e)
                })
                .collect();
            let running = self.running.clone();
            let stop = self.stop.lock().expect("stop lock").clone();
            let timeout = self.config.timeout;
            chains.push(AbortOnDropHandle::new(tokio::spawn(async move {
                let mut out = Vec::with_capacity(jobs.len());
                let mut failed = false;
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
                            attempt: e.attempts.saturating_add(1),
                        };
                        Self::run_one(handler, task, running.clone(), timeout, stop.clone()).await
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

    /// Guarantee: within one batch, a key's tasks run in order and stop at the first failure
    /// (the later ones are held back, not run), while another key's task still runs.
    #[tokio::test]
    async fn a_failed_task_holds_back_its_keys_later_tasks_in_the_batch() {
        let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = ran.clone();
        let tasks = TaskTransport::new(TaskConfig::default()).on("job", move |task: Task| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push(task.payload.clone());
                if task.payload == b"fail" {
                    Err(TaskError::retryable("fails"))
                } else {
                    Ok(())
                }
            }
        });
        let mut first = sample_event("t", 1);
        first.payload = b"fail".to_vec();
        let second = sample_event("t", 2);
        let mut other = sample_event("t", 3);
        other.key = "other".into();
        let outcomes = tasks.send(&[first, second, other]).await.await;
        assert_eq!(
            outcomes[0].as_ref().unwrap_err().kind,
            FailureKind::Transient
        );
        assert_eq!(
            outcomes[1].as_ref().unwrap_err().kind,
            FailureKind::HeldBack
        );
        assert!(outcomes[2].is_ok());
        assert_eq!(ran.lock().unwrap().len(), 2, "the held-back task never ran");
    }

    /// Guarantee: the handler sees the run number (one more than the attempts before) and a
    /// panicking handler fails its task instead of the relay.
    #[tokio::test]
    async fn the_run_number_reaches_the_handler_and_a_panic_is_a_failure() {
        let tasks = TaskTransport::new(TaskConfig::default()).on("job", |task: Task| async move {
            if task.attempt == 3 {
                panic!("boom");
            }
            Ok(())
        });
        let mut e = sample_event("t", 1);
        e.attempts = 2;
        let outcomes = tasks.send(std::slice::from_ref(&e)).await.await;
        let err = outcomes[0].as_ref().unwrap_err();
        assert_eq!(err.kind, FailureKind::Transient);
        assert!(err.reason.contains("boom"), "{}", err.reason);
    }
}
