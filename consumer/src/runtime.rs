//! The consumer runtime: subscribes, routes records to per-partition workers, commits offsets to
//! Kafka for lag tools, publishes dead letters, and shuts down cleanly.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::producer::FutureProducer;
use sqlx::PgPool;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::batch_handler::{BatchHandler, IntoBatchHandler};
use crate::client::Client;
use crate::config::ConsumerConfig;
use crate::context::{take_commits, Context, Ownership, RebalanceEvent, Tp};
use crate::dead_letter::Publisher;
use crate::handler::{Handler, IntoHandler};
use crate::partition::{Inbox, Shared, Worker};
use crate::route::Router;
use crate::stats::Stats;
use crate::Error;

/// Builds a [`Consumer`]: configuration, the application state `S` its handlers take (see
/// [`State`](crate::State)), and handlers routed by topic and event type.
pub struct ConsumerBuilder<S = ()> {
    pool: PgPool,
    config: ConsumerConfig,
    router: Router,
    errors: Vec<String>,
    state: S,
}

impl<S> ConsumerBuilder<S> {
    /// Gives the handlers routed after this call the application state `state`: a handler
    /// taking `State<T>` gets `T::from_ref(&state)` ([`FromRef`](crate::FromRef); every
    /// `Clone` type is its own part). Handlers already routed keep theirs.
    pub fn state<S2>(self, state: S2) -> ConsumerBuilder<S2> {
        ConsumerBuilder {
            pool: self.pool,
            config: self.config,
            router: self.router,
            errors: self.errors,
            state,
        }
    }

    /// Routes events of `event_type` on `topic` (any schema version without a more specific
    /// route) to `handler`. The topic is subscribed.
    pub fn on<H: IntoHandler<S>>(self, topic: &str, event_type: &str, handler: H) -> Self {
        self.route(topic, event_type, None, handler)
    }

    /// Routes events of `event_type` with exactly `schema_version` on `topic` to `handler`.
    pub fn on_version<H: IntoHandler<S>>(
        self,
        topic: &str,
        event_type: &str,
        schema_version: i32,
        handler: H,
    ) -> Self {
        self.route(topic, event_type, Some(schema_version), handler)
    }

    /// Routes events of `event_type` on `topic` (any schema version without a more specific
    /// route) to the batch handler `handler`: in throughput mode (`max_batch` above 1) it is
    /// called once per transaction with the run of new events routed to it, see
    /// [`BatchHandler`](crate::BatchHandler). The topic is subscribed.
    pub fn on_batch<H: IntoBatchHandler<S>>(
        self,
        topic: &str,
        event_type: &str,
        handler: H,
    ) -> Self {
        self.route_batch(topic, event_type, None, handler)
    }

    /// Routes events of `event_type` with exactly `schema_version` on `topic` to the batch
    /// handler `handler`.
    pub fn on_batch_version<H: IntoBatchHandler<S>>(
        self,
        topic: &str,
        event_type: &str,
        schema_version: i32,
        handler: H,
    ) -> Self {
        self.route_batch(topic, event_type, Some(schema_version), handler)
    }

    fn route<H: IntoHandler<S>>(
        mut self,
        topic: &str,
        event_type: &str,
        version: Option<i32>,
        handler: H,
    ) -> Self {
        let handler = handler.into_handler(&self.state);
        let name = handler.name().to_owned();
        self.check(topic, event_type, handler.consumer(), &name);
        if !self.router.add(topic, event_type, version, handler) {
            self.twice(topic, event_type, version, &name);
        }
        self
    }

    fn route_batch<H: IntoBatchHandler<S>>(
        mut self,
        topic: &str,
        event_type: &str,
        version: Option<i32>,
        handler: H,
    ) -> Self {
        let handler = handler.into_batch_handler(&self.state);
        let name = handler.name().to_owned();
        self.check(topic, event_type, handler.consumer(), &name);
        if !self.router.add_batch(topic, event_type, version, handler) {
            self.twice(topic, event_type, version, &name);
        }
        self
    }

    fn twice(&mut self, topic: &str, event_type: &str, version: Option<i32>, name: &str) {
        self.errors.push(format!(
            "{topic:?} / {event_type:?} (version {version:?}) is routed twice (second: {name})"
        ));
    }

    /// The checks of a route: valid names, one dedup scope.
    fn check(&mut self, topic: &str, event_type: &str, consumer: &str, name: &str) {
        if let Err(e) = postal_shared::Topic::new(topic) {
            self.errors.push(e.to_string());
        }
        if let Err(e) = postal_shared::EventType::new(event_type) {
            self.errors.push(e.to_string());
        }
        // The dedup scope is the handlers' (`#[idempotent(consumer = ...)]`): the first one
        // names this runtime's consumer unless the configuration did; every other must agree.
        if consumer.trim().is_empty() {
            self.errors.push(format!(
                "handler {name} has an empty dedup scope (consumer name): give it one"
            ));
        } else if self.config.consumer.is_empty() {
            self.config.consumer = consumer.to_owned();
        } else if consumer != self.config.consumer {
            self.errors.push(format!(
                "handler {} deduplicates as consumer {:?} but this runtime is consumer {:?} (one runtime is one consumer)",
                name,
                consumer,
                self.config.consumer
            ));
        }
    }

    /// Checks the configuration and routes and creates the Kafka clients (which connect
    /// lazily: an unreachable broker is not an error here).
    pub fn build(self) -> Result<Consumer, Error> {
        self.config.validate()?;
        if let Some(e) = self.errors.into_iter().next() {
            return Err(Error::Config(e));
        }
        if self.router.is_empty() {
            return Err(Error::Config(
                "no handlers: add at least one with `on`".into(),
            ));
        }
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let state = Arc::new(Mutex::new(Ownership::default()));
        let context = Context {
            state: state.clone(),
            events: events_tx,
            group: self.config.group.clone(),
            missing_topics: Default::default(),
        };
        let consumer: StreamConsumer<Context> =
            self.config.client_config().create_with_context(context)?;
        let producer_config = self.config.dlq_producer_config()?;
        let producer: FutureProducer = producer_config.create()?;
        let admin: AdminClient<DefaultClientContext> = producer_config.create()?;
        let owner = format!("{}:{}", std::process::id(), uuid::Uuid::now_v7());
        let permits = Semaphore::new(self.config.max_concurrent_partitions);
        let dlq = Publisher {
            pool: self.pool.clone(),
            producer: Mutex::new(producer),
            producer_config,
            admin,
            consumer: self.config.consumer.clone(),
            topic_partitions: self.config.dlq_partitions,
            topic_replication: self.config.dlq_replication,
            wake: Arc::new(Notify::new()),
            created: Mutex::new(HashSet::new()),
            invalid: Mutex::new(HashSet::new()),
            cooling: Default::default(),
            marked_after: Mutex::new(0),
            backoff: self.config.backoff,
        };
        Ok(Consumer {
            shared: Arc::new(Shared {
                pool: self.pool,
                config: self.config,
                router: self.router,
                consumer: Client::new(consumer, crate::client::CLOSE_THREAD),
                state,
                stats: Arc::new(Stats::default()),
                dlq_wake: dlq.wake.clone(),
                permits,
                owner,
                assigned: Default::default(),
                watch: Default::default(),
                pauses: Default::default(),
            }),
            events: events_rx,
            dlq,
        })
    }
}

/// A consumer runtime. Create it with [`Consumer::builder`], run it with [`Consumer::run`].
pub struct Consumer {
    shared: Arc<Shared>,
    events: mpsc::UnboundedReceiver<RebalanceEvent>,
    dlq: Publisher,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("group", &self.shared.config.group)
            .field("consumer", &self.shared.config.consumer)
            .field("topics", &self.shared.router.topics())
            .finish()
    }
}

struct Partition {
    inbox: Inbox,
    cancel: CancellationToken,
}

impl Consumer {
    /// Starts building a consumer over `pool` with `config`.
    pub fn builder(pool: PgPool, config: ConsumerConfig) -> ConsumerBuilder {
        ConsumerBuilder {
            pool,
            config,
            state: (),
            router: Router::default(),
            errors: Vec::new(),
        }
    }

    /// Live counters (applied, duplicates, dead letters, …).
    pub fn stats(&self) -> Arc<Stats> {
        self.shared.stats.clone()
    }

    /// Fault injection for tests (see [`crate::testing::FetchFault`]).
    #[doc(hidden)]
    #[cfg(any(test, feature = "test-util"))]
    pub fn fetch_fault(&self) -> crate::testing::FetchFault {
        crate::testing::FetchFault(self.shared.consumer.clone())
    }

    /// Fault injection for tests (see [`crate::testing::RebalanceFault`]).
    #[doc(hidden)]
    #[cfg(any(test, feature = "test-util"))]
    pub fn rebalance_fault(&self) -> crate::testing::RebalanceFault {
        crate::testing::RebalanceFault(self.shared.consumer.context().events.clone())
    }

    /// The transaction protocol without Kafka, for the randomized protocol tests (see
    /// [`crate::testing::Protocol`]).
    #[doc(hidden)]
    #[cfg(any(test, feature = "test-util"))]
    pub fn protocol(&self) -> crate::testing::Protocol {
        crate::testing::Protocol(self.shared.clone())
    }

    /// The subscribed topics.
    pub fn topics(&self) -> Vec<String> {
        self.shared.router.topics()
    }

    /// Runs until SIGINT or SIGTERM, then shuts down gracefully.
    pub async fn run_until_signal(self) -> Result<(), Error> {
        self.run(shutdown_signal()).await
    }

    /// Runs until `shutdown` resolves, then: stops fetching, lets each in-flight transaction
    /// finish (abandoning — rolling back — those still running after `shutdown_timeout`),
    /// commits the processed offsets to Kafka and leaves the group while it publishes pending
    /// dead letters (each waited for at most `shutdown_timeout`).
    ///
    /// An unreachable database or broker is waited for (with log lines), not an error; a
    /// database without Postal's schema is, and so is a schema this binary must not run on,
    /// checked at start and every [`postal_shared::SCHEMA_RECHECK`] (the consumer then stops
    /// gracefully and returns that error).
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
        let Consumer {
            shared,
            mut events,
            dlq,
        } = self;
        let config = &shared.config;
        tokio::pin!(shutdown);
        if !postal_shared::wait_for_schema(&shared.pool, &mut shutdown).await? {
            return Ok(());
        }
        let ops = match config.ops_addr {
            Some(addr) => {
                // Ready while the database answers and every owned partition advances
                // (records do not wait on a pooler, a lock or a failing handler: `stall`).
                // The endpoint holds no handle on the runtime (nor so on its Kafka client):
                // a check in flight, or the endpoint itself, must not keep the client from
                // leaving its group when the consumer stops (see the end of `run`).
                let watched = Arc::downgrade(&shared);
                let ready = move || {
                    let checked = watched.upgrade().map(|shared| {
                        (shared.watch.health.problem().is_none(), shared.pool.clone())
                    });
                    async move {
                        match checked {
                            Some((healthy, pool)) => {
                                healthy && sqlx::query("SELECT 1").execute(&pool).await.is_ok()
                            }
                            None => false,
                        }
                    }
                };
                Some(AbortOnDropHandle::new(
                    postal_ops::serve(addr, ready)
                        .await
                        .map_err(|e| Error::Config(e.to_string()))?,
                ))
            }
            None => None,
        };
        let topics = shared.router.topics();
        let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
        shared.consumer.subscribe(&refs)?;
        tracing::info!(group = %config.group, consumer = %config.consumer, topics = ?topics, "consumer started");

        let stop = CancellationToken::new();
        // Aborted when dropped: if this future is dropped (the consumer is killed in-process),
        // nothing keeps publishing dead letters or cleaning up on its behalf.
        let mut dlq = AbortOnDropHandle::new(tokio::spawn(dlq.run(stop.clone())));
        let housekeeping = AbortOnDropHandle::new(tokio::spawn(housekeeping(
            shared.pool.clone(),
            config.group.clone(),
            config.consumer.clone(),
            config.dedup_retention,
            config.dead_letter_retention,
            config.cleanup_interval,
            stop.clone(),
        )));
        let watchdog = {
            let shared = shared.clone();
            let stop = stop.clone();
            AbortOnDropHandle::new(tokio::spawn(async move {
                let size = shared.pool.options().get_max_connections();
                shared
                    .watch
                    .run(
                        shared.config.consumer.clone(),
                        size,
                        &shared.stats,
                        &shared.pauses,
                        stop,
                    )
                    .await
            }))
        };
        let pauses = {
            let shared = shared.clone();
            let stop = stop.clone();
            let topics = topics.clone();
            AbortOnDropHandle::new(tokio::spawn(async move {
                let c = &shared.config;
                shared
                    .pauses
                    .run(&shared.pool, &c.group, &c.consumer, &topics, stop)
                    .await
            }))
        };
        let mut partitions: HashMap<Tp, Partition> = HashMap::new();
        // One turn per partition, held by its worker for the worker's whole life (see `apply`).
        let mut turns: HashMap<Tp, Arc<tokio::sync::Mutex<()>>> = HashMap::new();
        let mut workers = JoinSet::new();
        let mut commit_tick = tokio::time::interval(config.kafka_commit_interval);
        commit_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut errors_logged = 0u64;
        // The upgrade contract again while running: a migration this binary must not run on
        // stops it (gracefully, like a shutdown) with that one line as its error.
        let mut broken = None;
        let schema_pool = shared.pool.clone();
        let schema = postal_shared::watch_schema(&schema_pool, postal_shared::SCHEMA_RECHECK);
        tokio::pin!(schema);
        // A start that gets no partitions for a while says why once (a restarted member waits
        // for the broker to expire the killed one it replaces; without a line it looked hung).
        let waiting_note = tokio::time::sleep(ASSIGNMENT_NOTE_AFTER);
        tokio::pin!(waiting_note);
        let mut assigned_once = false;
        {
            let mut stream = shared.consumer.stream();
            loop {
                tokio::select! {
                    biased;
                    _ = &mut shutdown => break,
                    e = &mut schema => {
                        broken = Some(e);
                        break;
                    }
                    Some(ev) = events.recv() => {
                        assigned_once |= matches!(ev, RebalanceEvent::Assigned(_));
                        apply(&shared, ev, &mut partitions, &mut turns, &mut workers, &stop);
                    }
                    _ = &mut waiting_note, if !assigned_once => {
                        assigned_once = true;
                        let session = config.kafka.get("session.timeout.ms").map_or("45000 (librdkafka's default)", String::as_str);
                        tracing::info!(
                            group = %config.group,
                            "no partitions assigned after {}: the group is rebalancing; a member that stopped without leaving it (killed) keeps its partitions until the broker expires it after session.timeout.ms = {session}",
                            humantime::format_duration(ASSIGNMENT_NOTE_AFTER)
                        );
                    }
                    _ = commit_tick.tick() => commit(&shared, CommitMode::Async),
                    Some(_) = workers.join_next(), if !workers.is_empty() => {}
                    msg = stream.next() => match msg {
                        Some(Ok(m)) => {
                            route_record(&shared, &m, &mut events, &mut partitions, &mut turns, &mut workers, &stop);
                            drop(m);
                            // The records librdkafka holds ready are taken at once (up to a
                            // burst), not one per turn of this loop: with many records per
                            // second the loop's other branches cost more than a record. A
                            // rebalance waiting ends the burst (the loop applies it first).
                            for _ in 1..PUMP_BURST {
                                if !events.is_empty() {
                                    break;
                                }
                                match stream.next().now_or_never() {
                                    Some(Some(Ok(m))) => route_record(&shared, &m, &mut events, &mut partitions, &mut turns, &mut workers, &stop),
                                    Some(Some(Err(e))) => {
                                        consumer_error(&e, &mut errors_logged);
                                        break;
                                    }
                                    _ => break,
                                }
                            }
                        }
                        Some(Err(e)) => consumer_error(&e, &mut errors_logged),
                        None => break,
                    },
                }
            }
        }
        tracing::info!("consumer shutting down: finishing in-flight transactions");
        stop.cancel();
        for (_, p) in partitions.drain() {
            p.cancel.cancel();
        }
        let drained = tokio::time::timeout(config.shutdown_timeout, async {
            while workers.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                "shutdown timeout reached: abandoning (rolling back) in-flight transactions"
            );
            workers.abort_all();
            while workers.join_next().await.is_some() {}
        }
        // The offsets processed last go to Kafka too (the database holds them already), and
        // the consumer leaves its group, on a thread of its own (see `client`), while pending
        // dead letters are published (that does not use the consumer). The synchronous commit
        // waits for the group coordinator without a limit of its own (up to the session
        // timeout with the broker down), and a close can hang inside librdkafka: the thread is
        // waited for at most `shutdown_timeout`; the broker expires a member that did not
        // leave after its session timeout. The thread closes the client once it holds its
        // last handle: a cancelled worker's blocking call (a seek, a watermark read) may still
        // hold one for a few seconds. Closed anywhere else, on the detached thread of the last
        // handle to go, the close would race the process's exit, and a member that did not
        // leave keeps the group "live" for `postal consumer reset` until the broker expires it
        // (seen: refused for 45 s after a clean exit). Only if another handle outlives
        // `shutdown_timeout` (a test's fault injector) does the close happen where that one
        // goes.
        let final_commits = take_commits(&mut shared.state.lock().expect("ownership state"));
        let shutdown_timeout = config.shutdown_timeout;
        let consumer = shared.consumer.clone();
        drop(shared);
        let (closed_tx, closed) = tokio::sync::oneshot::channel::<()>();
        let spawned = std::thread::Builder::new()
            .name(crate::client::CLOSE_THREAD.into())
            .spawn(move || {
                if final_commits.count() > 0 {
                    if let Err(e) = consumer.commit(&final_commits, CommitMode::Sync) {
                        tracing::debug!(error = %e, "kafka offset commit failed (the database holds the offsets)");
                    }
                }
                consumer.unsubscribe();
                match consumer.into_last_within(shutdown_timeout) {
                    // Dropping it closes it: the member leaves the group, here.
                    Ok(client) => drop(client),
                    Err(_still_shared) => tracing::warn!(
                        "another handle on the Kafka client outlived the shutdown timeout; the client leaves the group when that one goes, or the broker expires this member after its session timeout"
                    ),
                }
                let _ = closed_tx.send(());
            });
        housekeeping.abort();
        watchdog.abort();
        pauses.abort();
        if tokio::time::timeout(shutdown_timeout, &mut dlq)
            .await
            .is_err()
        {
            // Left to finish the batch it is publishing (it stops after that, `stop` being
            // cancelled): aborting it between the sends and their commit would publish that
            // batch again at the next start.
            drop(dlq.detach());
            tracing::warn!(
                "dead-letter publishing did not finish; the next start publishes the rest"
            );
        }
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start the thread that leaves the consumer group; the broker expires this member after its session timeout");
        } else if tokio::time::timeout(shutdown_timeout, closed)
            .await
            .is_err()
        {
            tracing::warn!(
                "leaving the consumer group did not finish in time; the broker expires this member after its session timeout"
            );
        }
        if let Some(ops) = ops {
            ops.abort();
        }
        tracing::info!("consumer stopped");
        match broken {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

/// Most records the runtime's loop takes from librdkafka in one turn.
const PUMP_BURST: usize = 256;
/// How long a start waits for its first partitions before saying why it may wait longer.
const ASSIGNMENT_NOTE_AFTER: Duration = Duration::from_secs(10);

/// Hands a fetched record to its partition's worker.
fn route_record(
    shared: &Arc<Shared>,
    m: &rdkafka::message::BorrowedMessage<'_>,
    events: &mut mpsc::UnboundedReceiver<RebalanceEvent>,
    partitions: &mut HashMap<Tp, Partition>,
    turns: &mut HashMap<Tp, Arc<tokio::sync::Mutex<()>>>,
    workers: &mut JoinSet<()>,
    stop: &CancellationToken,
) {
    let record = crate::record::Record::from_message(m, shared.config.max_headers);
    tracing::trace!(topic = %record.topic, partition = record.partition, offset = record.offset, "record received");
    let mut inbox = partitions.get(&(record.topic.clone(), record.partition));
    if inbox.is_none() {
        // The assignment callback may have run inside this poll.
        while let Ok(ev) = events.try_recv() {
            apply(shared, ev, partitions, turns, workers, stop);
        }
        inbox = partitions.get(&(record.topic.clone(), record.partition));
    }
    match inbox {
        Some(p) => p.inbox.push(shared, record),
        None => {
            tracing::debug!(topic = %record.topic, partition = record.partition, "record of a partition not owned here; left for its owner")
        }
    }
}

/// Logs a consumer error (a missing topic at DEBUG: the client context says so once, at INFO,
/// and the topic is assigned once it exists; others at powers of two).
fn consumer_error(e: &rdkafka::error::KafkaError, errors_logged: &mut u64) {
    if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition) {
        tracing::debug!(error = %e, "consumer error of a missing topic");
        return;
    }
    *errors_logged += 1;
    if errors_logged.is_power_of_two() {
        tracing::warn!(error = %e, occurrences = *errors_logged, "kafka consumer error; the client keeps retrying");
    }
}

/// Applies a rebalance: cancels the workers of revoked partitions and starts one for each
/// assigned partition. A new worker waits for its partition's turn, which the previous worker
/// of the same partition holds until it has returned: otherwise a cancelled predecessor still
/// taking the partition over in the database could do so after its successor, fencing the
/// successor and leaving the partition with no worker (seen after quick successive
/// rebalances).
fn apply(
    shared: &Arc<Shared>,
    ev: RebalanceEvent,
    partitions: &mut HashMap<Tp, Partition>,
    turns: &mut HashMap<Tp, Arc<tokio::sync::Mutex<()>>>,
    workers: &mut JoinSet<()>,
    stop: &CancellationToken,
) {
    match ev {
        RebalanceEvent::Revoked(tps) => {
            for tp in tps {
                if let Some(p) = partitions.remove(&tp) {
                    p.cancel.cancel();
                }
                shared
                    .watch
                    .partitions
                    .lock()
                    .expect("watched partitions")
                    .remove(&tp);
            }
        }
        RebalanceEvent::Assigned(tps) => {
            for tp in tps {
                if let Some(old) = partitions.remove(&tp) {
                    old.cancel.cancel();
                }
                let cancel = stop.child_token();
                shared
                    .state
                    .lock()
                    .expect("ownership state")
                    .owned
                    .insert(tp.clone(), cancel.clone());
                let (tx, rx) = mpsc::unbounded_channel();
                let queued = Arc::new(crate::partition::Queued::default());
                shared
                    .watch
                    .partitions
                    .lock()
                    .expect("watched partitions")
                    .insert(tp.clone(), queued.waiting.clone());
                let paused = Arc::new(Mutex::new(false));
                let _ = shared.consumer.resume(&crate::partition::tpl(&tp.0, tp.1));
                workers.spawn(
                    Worker {
                        shared: shared.clone(),
                        topic: tp.0.clone(),
                        partition: tp.1,
                        rx,
                        queued: queued.clone(),
                        paused: paused.clone(),
                        cancel: cancel.clone(),
                        turn: turns.entry(tp.clone()).or_default().clone(),
                        held: Default::default(),
                        fit: Default::default(),
                    }
                    .run(),
                );
                partitions.insert(
                    tp,
                    Partition {
                        inbox: Inbox { tx, queued, paused },
                        cancel,
                    },
                );
            }
        }
    }
    shared
        .assigned
        .store(partitions.len(), std::sync::atomic::Ordering::Relaxed);
}

/// Deletes expired dedup rows every `interval` (one instance at a time) and reports the age of
/// the oldest dedup row left (`postal_consumer_dedup_oldest_seconds`), at start and after every
/// round (also when retention is off: the gauge then shows how far back dedup reaches). Also
/// records where the group stands every 10 minutes (`retention::mark_offsets`), kept for the
/// dedup retention (30 days without one) plus a day.
async fn housekeeping(
    pool: PgPool,
    group: String,
    consumer: String,
    retention: Option<Duration>,
    dead_letter_retention: Option<Duration>,
    interval: Duration,
    stop: CancellationToken,
) {
    let keep =
        retention.unwrap_or(Duration::from_secs(30 * 24 * 3600)) + Duration::from_secs(24 * 3600);
    let mut declared = false;
    loop {
        if !declared {
            // What `postal cleanup --dedup-retention` must respect.
            match crate::retention::declare_retention(&pool, &consumer, retention).await {
                Ok(()) => declared = true,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot record the consumer's dedup retention")
                }
            }
        }
        if let Err(e) = crate::retention::mark_offsets(&pool, &group, keep).await {
            tracing::debug!(error = %e, "cannot record the group's offsets");
        }
        match crate::retention::oldest_dedup_age(&pool, &consumer).await {
            Ok(age) => crate::retention::report_oldest_dedup_age(&consumer, age),
            Err(e) => tracing::debug!(error = %e, "cannot read the oldest dedup row's age"),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.cancelled() => return,
        }
        if let Some(keep) = dead_letter_retention {
            match crate::retention::cleanup_dead_letters_of(&pool, &consumer, keep, 5000).await {
                Ok(Some(n)) if n > 0 => {
                    tracing::info!(
                        deleted = n,
                        consumer,
                        "deleted expired dead letters (published to their dead-letter topic)"
                    )
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "dead-letter retention failed; retrying next round")
                }
            }
        }
        let Some(retention) = retention else { continue };
        match crate::retention::cleanup_processed(&pool, &consumer, retention, 5000).await {
            Ok(Some(n)) if n > 0 => {
                tracing::info!(deleted = n, consumer, "deleted expired dedup rows")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "dedup retention failed; retrying next round"),
        }
    }
}

/// Commits the offsets processed since the last commit to Kafka (for lag tools).
fn commit(shared: &Shared, mode: CommitMode) {
    let tpl = take_commits(&mut shared.state.lock().expect("ownership state"));
    if tpl.count() == 0 {
        return;
    }
    if let Err(e) = shared.consumer.commit(&tpl, mode) {
        tracing::debug!(error = %e, "kafka offset commit failed (the database holds the offsets)");
    }
}

/// Resolves on SIGINT or (on Unix) SIGTERM: [`postal_shared::stop_signal`], listened for
/// from the first poll. Create the signal with `stop_signal()` before connecting instead, to
/// also stop cleanly while start-up still waits for the database.
pub async fn shutdown_signal() {
    match postal_shared::stop_signal() {
        Ok(signal) => signal.await,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::future::BoxFuture;
    use sqlx::{Postgres, Transaction};

    use super::*;
    use crate::event::Event;
    use crate::handler::HandlerError;

    /// A hand-written handler whose names are chosen at run time.
    struct Scoped {
        consumer: String,
        name: String,
    }

    impl Handler for Scoped {
        type Payload = serde_json::Value;
        fn consumer(&self) -> &str {
            &self.consumer
        }
        fn name(&self) -> &str {
            &self.name
        }
        fn handle<'a, 'c>(
            &'a self,
            _tx: &'a mut Transaction<'c, Postgres>,
            _event: Event<serde_json::Value>,
        ) -> BoxFuture<'a, Result<(), HandlerError>> {
            Box::pin(async { Ok(()) })
        }
    }

    fn scoped(consumer: &str, name: &str) -> Scoped {
        Scoped {
            consumer: consumer.into(),
            name: name.into(),
        }
    }

    fn builder() -> ConsumerBuilder {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://postal@127.0.0.1:1/none")
            .expect("lazy pool");
        Consumer::builder(pool, ConsumerConfig::new("127.0.0.1:1", "g"))
    }

    /// Guarantee: the dedup scope is stated once, by the handlers — the runtime takes the
    /// first handler's, and refuses to build with a handler of another scope (its events would
    /// be deduplicated apart from the others').
    #[tokio::test]
    async fn the_handlers_name_the_consumer_once() {
        let consumer = builder()
            .on("orders", "created", scoped("billing", "created"))
            .on("orders", "paid", scoped("billing", "paid"))
            .build()
            .expect("one scope");
        assert_eq!(consumer.shared.config.consumer, "billing");
        let err = builder()
            .on("orders", "created", scoped("billing", "created"))
            .on("orders", "paid", scoped("shipping", "paid"))
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("handler paid deduplicates as consumer \"shipping\" but this runtime is consumer \"billing\""),
            "{err}"
        );
    }
}
