//! The relay's protocol under random interleavings, against real PostgreSQL, without a broker:
//! up to three relay instances (each on a pool of its own, reaching PostgreSQL through a proxy
//! of its own that can freeze its traffic) are started, stopped, killed and frozen at random
//! moments while events are enqueued for a few keys on one or two topics and an in-test
//! destination acknowledges, fails, holds back or withholds their publishes. A final healthy
//! relay then drains the outbox and the destination's log is checked for loss and per-key
//! order.
//!
//! The events come as applications write them, concurrently:
//! - the driver enqueues a few events now and then (a burst at times) in short transactions
//!   of its own;
//! - several writer tasks ([`writer`]) run transactions that overlap on the same keys, each
//!   of random length: they do other work before and after enqueueing (an insert into a
//!   business table, a `pg_sleep` of random length — so a transaction that began first often
//!   enqueues last), enqueue with `enqueue_batch` (several keys in one call) and with the SQL
//!   function `postal.enqueue`, in one or several statements, sometimes inside a savepoint
//!   they roll back, and sometimes roll the whole transaction back (or are rolled back by a
//!   deadlock between their key locks). Rolled-back events must never be published.
//!
//! The relays' statements are delayed at random on their way to PostgreSQL (a
//! [`pg_proxy::PgProxy`] with a seeded [`pg_proxy::Jitter`] behind every relay's freezable
//! proxy: a database in another zone, a pooler's queue, a starved CPU), and now and then
//! another session holds `postal.relay_partitions` in `ACCESS EXCLUSIVE` mode for a few
//! hundred milliseconds (a migration, `VACUUM FULL`, `pg_repack`), so that a claim that began
//! waits right after its `BEGIN` while writers commit.
//!
//! The destination ([`Destination`]) behaves like one ordered log per topic and key, as
//! Kafka's partitions do: an event it accepts lands in the log when it is handed over (its
//! acknowledgement may come much later, or never, if the relay stops waiting); within a batch,
//! once an event of a key fails or is held back on a topic, the key's later events on that
//! topic in that batch are held back. Across batches it keeps nothing: a later batch's event
//! of a key is accepted even while an earlier one of the key failed in a batch still in flight
//! — keeping the key's order then is the relay's own job (its key chain), which this test
//! checks. A key's order is checked per topic and key; an event counts as waiting (not lost)
//! while a parked event of its key with a lower sequence number exists on either topic.
//!
//! Two tests run these cases with faults (the events published, or run as tasks); a third
//! ([`random_overlapping_writers_with_held_up_claims_keep_order`]) runs them calm — one relay
//! throughout, no failures, the driver only enqueueing and locking `postal.relay_partitions`
//! — so that the writers' interleavings meet held-up claims as often as possible.
//!
//! `POSTAL_RELAY_RANDOM_CASES` sets how many random cases run (default 8 in each test, 4 in the two mixed WAL/polling ones; about
//! 5–15 s each),
//! `POSTAL_RELAY_RANDOM_SEED` the first case's seed (default random). A failure prints the
//! case's seed: `POSTAL_RELAY_RANDOM_SEED=<seed> POSTAL_RELAY_RANDOM_CASES=1` runs that case
//! again. The seed fixes the case's parameters, its schedule of actions, each writer's
//! transactions and the distribution of the statement delays; the timing of the relays' and
//! writers' tasks against it is not reproducible, so a rare interleaving may need a few runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use postal_integration_tests::{fresh_postgres_db, TestDb};
use postal_producer::{
    enqueue_batch, FailureKind, NewEvent, OutboundEvent, PublishError, RelayConfig, RelaySource,
    Task, TaskConfig, TaskError, TaskTransport, Transport, WalSource,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions as _, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use uuid::Uuid;

use crate::common::pg_proxy::{self, PgProxy};
use crate::common::RunningRelay;

const TOPICS: [&str; 2] = ["relay-random", "relay-random-b"];
const LEASE: Duration = Duration::from_secs(2);

/// The scope of a key's order: (topic, key).
type Scope = (String, String);

// --- The destination -----------------------------------------------------------------------

/// One event landed in the destination's log.
#[derive(Clone, Debug)]
struct Landing {
    id: Uuid,
    topic: String,
    key: String,
    seq: i64,
    /// The relay instance (numbered per case) that handed it over.
    relay: usize,
    /// Milliseconds since the case started.
    at_ms: u128,
    /// The run number (tasks: [`postal_producer::Task::attempt`]; 0 for publishes).
    run: i32,
}

/// How often the destination fails (changed by the case's actions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Faults {
    None = 0,
    Light = 1,
    Heavy = 2,
}

/// What every relay instance of a case publishes to: the log (the "topic") and the source of
/// outcomes.
struct World {
    log: Mutex<Vec<Landing>>,
    /// Tasks: the highest run number that started, per task — the fence a task's downstream
    /// keeps with [`postal_producer::Task::attempt`] — and the runs it refused: older than one
    /// that started (`stale`) or the same number again (`repeated`, which the run numbers'
    /// promise to strictly increase rules out).
    fence: Mutex<HashMap<Uuid, i32>>,
    stale: std::sync::atomic::AtomicUsize,
    repeated: std::sync::atomic::AtomicUsize,
    rng: Mutex<StdRng>,
    faults: AtomicU8,
    started: Instant,
}

impl World {
    fn faults(&self) -> Faults {
        match self.faults.load(Ordering::Relaxed) {
            0 => Faults::None,
            1 => Faults::Light,
            _ => Faults::Heavy,
        }
    }
}

/// One relay instance's transport to the shared destination.
struct Destination {
    world: Arc<World>,
    relay: usize,
    /// While `true`, nothing is handed over and no acknowledgement is returned (a frozen
    /// process, a stalled broker connection).
    frozen: watch::Receiver<bool>,
    /// Tasks mode: the real task runner, whose handler lands the task when it starts.
    tasks: Option<TaskTransport>,
}

/// The task runner of relay `relay`: a run lands when its handler starts (unless the fence
/// refuses it), then takes a random time and ends with a random outcome.
fn task_runner(world: Arc<World>, relay: usize) -> TaskTransport {
    TaskTransport::new(TaskConfig::default().concurrency(4)).on("e", move |task: Task| {
        let world = world.clone();
        async move {
            let id = task.id.as_uuid();
            let faults = world.faults();
            let (outcome, delay) = {
                let mut rng = world.rng.lock().unwrap();
                let outcome = match draw(&mut rng, faults) {
                    Err(e) if e.kind == FailureKind::Permanent => {
                        Err(TaskError::permanent(e.reason))
                    }
                    Err(e) => Err(TaskError::retryable(e.reason)),
                    Ok(()) => Ok(()),
                };
                let max_delay = if faults == Faults::Heavy { 600 } else { 150 };
                (
                    outcome,
                    Duration::from_millis(rng.random_range(0..=max_delay)),
                )
            };
            {
                let mut fence = world.fence.lock().unwrap();
                let seen = fence.entry(id).or_insert(0);
                if task.attempt <= *seen {
                    let counter = if task.attempt == *seen {
                        &world.repeated
                    } else {
                        &world.stale
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    return Err(TaskError::retryable("refused by the fence"));
                }
                *seen = task.attempt;
                world.log.lock().unwrap().push(Landing {
                    id,
                    topic: task.topic.clone(),
                    key: task.key.clone(),
                    seq: 0,
                    relay,
                    at_ms: world.started.elapsed().as_millis(),
                    run: task.attempt,
                });
            }
            tokio::time::sleep(delay).await;
            outcome
        }
    })
}

fn draw(rng: &mut StdRng, faults: Faults) -> Result<(), PublishError> {
    let (transient, unavailable, held, permanent) = match faults {
        Faults::None => return Ok(()),
        Faults::Light => (0.04, 0.03, 0.025, 0.005),
        Faults::Heavy => (0.15, 0.10, 0.10, 0.02),
    };
    let x: f64 = rng.random();
    let kind = if x < permanent {
        FailureKind::Permanent
    } else if x < permanent + transient {
        FailureKind::Transient
    } else if x < permanent + transient + unavailable {
        FailureKind::Unavailable
    } else if x < permanent + transient + unavailable + held {
        FailureKind::HeldBack
    } else {
        return Ok(());
    };
    Err(PublishError::new(kind, format!("injected {kind:?}")))
}

impl Transport for Destination {
    type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

    fn checks_out(&self) -> Option<usize> {
        self.tasks.as_ref().and_then(Transport::checks_out)
    }

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        // A frozen process hands nothing over until it thaws.
        let mut frozen = self.frozen.clone();
        let _ = frozen.wait_for(|f| !*f).await;
        if let Some(tasks) = &self.tasks {
            let acks = tasks.send(batch).await;
            return Box::pin(async move {
                let outcomes = acks.await;
                let _ = frozen.wait_for(|f| !*f).await;
                outcomes
            });
        }
        let faults = self.world.faults();
        let (outcomes, delay) = {
            let mut rng = self.world.rng.lock().unwrap();
            let whole_batch_down = faults == Faults::Heavy && rng.random_bool(0.1);
            let mut blocked: HashSet<(&str, &str)> = HashSet::new();
            let mut outcomes = Vec::with_capacity(batch.len());
            let mut log = self.world.log.lock().unwrap();
            for e in batch {
                let outcome = if blocked.contains(&(e.topic.as_str(), e.key.as_str())) {
                    Err(PublishError::new(
                        FailureKind::HeldBack,
                        "an earlier event of this key failed",
                    ))
                } else if whole_batch_down {
                    Err(PublishError::new(
                        FailureKind::Unavailable,
                        "injected outage",
                    ))
                } else {
                    draw(&mut rng, faults)
                };
                match &outcome {
                    Ok(()) => log.push(Landing {
                        id: e.id.as_uuid(),
                        topic: e.topic.clone(),
                        key: e.key.clone(),
                        seq: e.seq,
                        relay: self.relay,
                        at_ms: self.world.started.elapsed().as_millis(),
                        run: 0,
                    }),
                    Err(_) => {
                        blocked.insert((e.topic.as_str(), e.key.as_str()));
                    }
                }
                outcomes.push(outcome);
            }
            let max_delay = match faults {
                Faults::Heavy => 600,
                _ => 150,
            };
            (
                outcomes,
                Duration::from_millis(rng.random_range(0..=max_delay)),
            )
        };
        let mut frozen = self.frozen.clone();
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            let _ = frozen.wait_for(|f| !*f).await;
            outcomes
        })
    }
}

// --- A freezable path to PostgreSQL --------------------------------------------------------

/// A TCP proxy in front of PostgreSQL (through the case's [`PgProxy`], which delays
/// statements) for one relay instance: `frozen` stops its traffic in both directions (the
/// server sees idle connections, the relay sees no answers), dropping it closes every
/// connection (a dead process's sockets).
struct Proxy {
    port: u16,
    tasks: Arc<Mutex<tokio::task::JoinSet<()>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: (String, u16), frozen: watch::Receiver<bool>) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let tasks = Arc::new(Mutex::new(tokio::task::JoinSet::new()));
        let conns = tasks.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let (f1, f2) = (frozen.clone(), frozen.clone());
                conns.lock().unwrap().spawn(async move {
                    let Ok(server) = TcpStream::connect((upstream.0.as_str(), upstream.1)).await
                    else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, f1), pipe(sr, cw, f2));
                });
            }
        });
        Proxy {
            port,
            tasks,
            accept,
        }
    }

    /// Closes every connection through the proxy and stops accepting new ones.
    fn cut(&self) {
        self.accept.abort();
        self.tasks.lock().unwrap().abort_all();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

// --- Relay instances -----------------------------------------------------------------------

/// One relay "process": the relay, its pool, its proxy and its freeze switches.
struct Instance {
    n: usize,
    relay: RunningRelay,
    pool: PgPool,
    proxy: Proxy,
    /// Freezes its database traffic.
    db_frozen: Arc<watch::Sender<bool>>,
    /// Freezes its destination (hand-overs and acknowledgements).
    dest_frozen: Arc<watch::Sender<bool>>,
}

/// Case parameters drawn from the seed.
#[derive(Clone, Debug)]
struct Params {
    /// Run the events as tasks (the relay checks them out) instead of publishing them.
    tasks: bool,
    keys: usize,
    /// How many of [`TOPICS`] the events go to (the same keys on each).
    topics: usize,
    /// Concurrent writer tasks besides the driver.
    writers: usize,
    /// The longest a writer works before its first enqueue (ms).
    writer_pause_ms: u64,
    /// The chance that a writer's transaction rolls back.
    rollback: f64,
    /// Random delays of the relays' statements: (chance per statement, longest delay in ms;
    /// chance of a longer one, its longest in ms).
    jitter: Option<(f64, u64, f64, u64)>,
    batch_size: usize,
    max_in_flight_batches: usize,
    lanes: usize,
    max_attempts: i32,
    actions_for: Duration,
    /// The relays read the outbox from this slot (WAL relays, each running its sweep while it
    /// holds the slot's lease) instead of polling.
    wal: Option<WalSource>,
    /// With `wal`: odd-numbered relay instances poll instead (a rolling hand-over between the
    /// modes, in either direction, while batches are in flight), and an operator requeues the
    /// parked events now and then (`postal requeue`, racing the relays).
    mixed: bool,
    /// Published rows are kept (`delete_on_publish` off): marked `published` instead of
    /// deleted, so claims lock and mark rows instead of deleting and writing them back.
    keep: bool,
}

fn relay_config(p: &Params, n: usize) -> RelayConfig {
    let config = RelayConfig::default();
    let wal = if p.mixed && n % 2 == 1 {
        None
    } else {
        p.wal.as_ref()
    };
    let config = match wal {
        Some(w) => config.source(RelaySource::Wal(w.clone())),
        None => config,
    };
    let mut config = config;
    config.delete_on_publish = !p.keep;
    config
        .batch_size(p.batch_size)
        .max_in_flight_batches(p.max_in_flight_batches)
        .lanes(p.lanes)
        .lease(LEASE)
        .poll_interval(Duration::from_millis(100))
        .max_attempts(p.max_attempts)
        .backoff(postal_producer::Backoff {
            base: Duration::from_millis(20),
            max: Duration::from_millis(300),
        })
        .shutdown_timeout(Duration::from_secs(1))
}

/// Starts relay instance `n`, reaching PostgreSQL through a freezable proxy of its own in
/// front of the case's statement-delaying `pg`.
async fn start_instance(
    db: &TestDb,
    pg: &PgProxy,
    world: &Arc<World>,
    params: &Params,
    n: usize,
) -> Result<Instance, String> {
    let opts = PgConnectOptions::from_str(&db.url).map_err(|e| e.to_string())?;
    let upstream = ("127.0.0.1".to_owned(), pg.port);
    let (db_tx, db_rx) = watch::channel(false);
    let (dest_tx, dest_rx) = watch::channel(false);
    let proxy = Proxy::start(upstream, db_rx).await;
    let size = (params.max_in_flight_batches + params.lanes + 5) as u32;
    // No TLS: the statement-delaying proxy reads the protocol's messages.
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(
            opts.host("127.0.0.1")
                .port(proxy.port)
                .ssl_mode(PgSslMode::Disable),
        )
        .await
        .map_err(|e| format!("relay {n}: connect through its proxy: {e}"))?;
    let dest = Destination {
        world: world.clone(),
        relay: n,
        frozen: dest_rx,
        tasks: params.tasks.then(|| task_runner(world.clone(), n)),
    };
    let relay = RunningRelay::start(&pool, dest, relay_config(params, n));
    Ok(Instance {
        n,
        relay,
        pool,
        proxy,
        db_frozen: Arc::new(db_tx),
        dest_frozen: Arc::new(dest_tx),
    })
}

impl Instance {
    /// As `kill -9`: the relay's task is gone at once, then its sockets close (the server rolls
    /// back what they left open).
    async fn kill(self) {
        self.relay.kill().await;
        self.proxy.cut();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.pool.close()).await;
    }

    /// Graceful shutdown (the caller runs it in a task of its own: a frozen instance finishes
    /// only once it thaws).
    async fn stop(self) {
        self.relay.stop().await;
        self.pool.close().await;
        self.proxy.cut();
    }
}

/// Sets `switch` for `d`, then clears it, in a task of its own.
fn freeze_for(switch: &Arc<watch::Sender<bool>>, d: Duration) {
    switch.send_replace(true);
    let switch = switch.clone();
    tokio::spawn(async move {
        tokio::time::sleep(d).await;
        switch.send_replace(false);
    });
}

// --- Writers ---------------------------------------------------------------------------------

/// What the writers (and the driver) committed and rolled back.
#[derive(Default)]
struct Ledger {
    /// Committed events: id → (topic, key, sequence number, when its transaction began).
    committed: HashMap<Uuid, (String, String, i64, i64)>,
    /// Events enqueued in a transaction or savepoint that rolled back.
    rolled_back: HashSet<Uuid>,
    /// Writer transactions committed, rolled back on purpose, rolled back by a deadlock;
    /// savepoints rolled back.
    commits: usize,
    rollbacks: usize,
    deadlocks: usize,
    savepoints: usize,
}

impl Ledger {
    /// Pairs of a key's consecutive committed events whose later one (by sequence number) was
    /// written by a transaction that began before the earlier one's: what overlapping writers
    /// bring, counted to show that the case had them.
    fn overtaken(&self) -> usize {
        let mut rows: Vec<&(String, String, i64, i64)> = self.committed.values().collect();
        rows.sort_by_key(|r| r.2);
        let mut last: HashMap<(&str, &str), i64> = HashMap::new();
        let mut n = 0;
        for (t, k, _, began) in rows {
            if let Some(before) = last.insert((t.as_str(), k.as_str()), *began) {
                if *began < before {
                    n += 1;
                }
            }
        }
        n
    }

    fn roll_back(&mut self, events: &[Planned]) {
        self.rolled_back.extend(events.iter().map(|e| e.id));
    }

    /// Per scope, the committed events' ids in sequence order.
    fn by_scope(&self) -> BTreeMap<Scope, Vec<Uuid>> {
        let mut rows: Vec<(&String, &String, i64, Uuid)> = self
            .committed
            .iter()
            .map(|(id, (t, k, seq, _))| (t, k, *seq, *id))
            .collect();
        rows.sort_by_key(|r| r.2);
        let mut out: BTreeMap<Scope, Vec<Uuid>> = BTreeMap::new();
        for (t, k, _, id) in rows {
            out.entry((t.clone(), k.clone())).or_default().push(id);
        }
        out
    }
}

/// One event to enqueue: topic, key and its id (known before it is written, so that a
/// rolled-back one is known too).
struct Planned {
    topic: String,
    key: String,
    id: Uuid,
}

fn plan(rng: &mut StdRng, topics: &[&str], keys: &[String], n: usize) -> Vec<Planned> {
    (0..n)
        .map(|_| Planned {
            topic: topics[rng.random_range(0..topics.len())].to_owned(),
            key: keys[rng.random_range(0..keys.len())].clone(),
            id: Uuid::now_v7(),
        })
        .collect()
}

/// Enqueues `events` on `conn` in one call of `enqueue_batch` (`sql` false) or one call of
/// the SQL function `postal.enqueue` per event (`sql` true).
async fn write_events(
    conn: &mut sqlx::PgConnection,
    events: &[Planned],
    sql: bool,
) -> Result<(), String> {
    if sql {
        for e in events {
            sqlx::query("SELECT postal.enqueue($1, $2, 'e', '0'::jsonb, '{}'::jsonb, 1, $3)")
                .bind(&e.topic)
                .bind(&e.key)
                .bind(e.id)
                .execute(&mut *conn)
                .await
                .map_err(|e| e.to_string())?;
        }
        return Ok(());
    }
    let batch = events
        .iter()
        .map(|e| {
            NewEvent::json(e.topic.as_str(), e.key.as_str(), "e", &0)
                .map(|n| n.with_id(postal_shared::EventId::from_uuid(e.id).unwrap()))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    enqueue_batch(conn, batch)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The sequence numbers the transaction on `conn` gave `events` (its own rows are visible to
/// it before it commits), with the transaction's start (µs since the epoch).
async fn seqs_of(
    conn: &mut sqlx::PgConnection,
    events: &[Planned],
) -> Result<HashMap<Uuid, (i64, i64)>, String> {
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    let rows: Vec<(Uuid, i64, i64)> = sqlx::query_as(
        "SELECT event_id, seq, (extract(epoch FROM transaction_timestamp()) * 1e6)::int8
           FROM postal.outbox WHERE event_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| e.to_string())?;
    if rows.len() != ids.len() {
        return Err(format!(
            "a writer's transaction sees {} of the {} events it enqueued",
            rows.len(),
            ids.len()
        ));
    }
    Ok(rows
        .into_iter()
        .map(|(id, seq, t)| (id, (seq, t)))
        .collect())
}

/// Other work inside a writer's transaction: a row in the business table, a `pg_sleep` of up
/// to `max_ms`, or both, or nothing.
async fn other_work(
    conn: &mut sqlx::PgConnection,
    rng: &mut StdRng,
    w: usize,
    max_ms: u64,
) -> Result<(), sqlx::Error> {
    if rng.random_bool(0.5) {
        sqlx::query("INSERT INTO business (writer, note) VALUES ($1, 'order placed')")
            .bind(w as i32)
            .execute(&mut *conn)
            .await?;
    }
    if max_ms > 0 && rng.random_bool(0.7) {
        let ms = rng.random_range(0..=max_ms);
        sqlx::query("SELECT pg_sleep($1)")
            .bind(ms as f64 / 1000.0)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

fn deadlocked(e: &str) -> bool {
    e.contains("deadlock detected")
}

/// One writer's transaction. Returns whether it committed; the ledger records its events as
/// committed (with their sequence numbers) or rolled back.
async fn writer_transaction(
    pool: &PgPool,
    rng: &mut StdRng,
    w: usize,
    p: &Params,
    keys: &[String],
    ledger: &Mutex<Ledger>,
) -> Result<(), String> {
    let topics = &TOPICS[..p.topics];
    // The transaction's shape: work before its first enqueue (none, up to the case's pause,
    // now and then three times that: a transaction that began first then enqueues after
    // others that began later committed), one enqueue statement or a few (their key locks
    // taken in no particular order: deadlocks happen), work after its last one (often none,
    // so that it commits right after enqueueing).
    let before = match rng.random_range(0..10) {
        0..=3 => 0,
        4..=7 => p.writer_pause_ms,
        _ => p.writer_pause_ms * 3,
    };
    let statements = if rng.random_bool(0.85) {
        1
    } else {
        rng.random_range(2..=3)
    };
    let after = if rng.random_bool(0.6) { 0 } else { 80 };
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let mut written: Vec<Planned> = Vec::new();
    let mut undone: Vec<Planned> = Vec::new();
    let result: Result<(), String> = async {
        if before > 0 {
            other_work(&mut tx, rng, w, before)
                .await
                .map_err(|e| e.to_string())?;
        }
        for i in 0..statements {
            if i > 0 && rng.random_bool(0.3) {
                other_work(&mut tx, rng, w, 30)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            // `postal.enqueue` as services in other languages call it (one key a call, mostly
            // one call a transaction), or `enqueue_batch` with several keys in one statement.
            let sql = rng.random_bool(0.4);
            let n = if sql && rng.random_bool(0.8) {
                1
            } else {
                rng.random_range(1..=4)
            };
            let events = plan(rng, topics, keys, n);
            if rng.random_bool(0.1) {
                // In a savepoint that is rolled back: these never happened.
                let mut sp = sqlx::Connection::begin(&mut *tx)
                    .await
                    .map_err(|e| e.to_string())?;
                let r = write_events(&mut sp, &events, sql).await;
                undone.extend(events);
                r?;
                sp.rollback().await.map_err(|e| e.to_string())?;
                ledger.lock().unwrap().savepoints += 1;
            } else {
                let r = write_events(&mut tx, &events, sql).await;
                written.extend(events);
                r?;
            }
        }
        if after > 0 {
            other_work(&mut tx, rng, w, after)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        drop(tx);
        if !deadlocked(&e) {
            return Err(format!("writer {w}: {e}"));
        }
        let mut l = ledger.lock().unwrap();
        l.deadlocks += 1;
        l.roll_back(&written);
        l.roll_back(&undone);
        return Ok(());
    }
    let seqs = seqs_of(&mut tx, &written).await?;
    if rng.random_bool(p.rollback) {
        tx.rollback().await.map_err(|e| e.to_string())?;
        let mut l = ledger.lock().unwrap();
        l.rollbacks += 1;
        l.roll_back(&written);
        l.roll_back(&undone);
        return Ok(());
    }
    tx.commit()
        .await
        .map_err(|e| format!("writer {w}: commit: {e}"))?;
    let mut l = ledger.lock().unwrap();
    l.commits += 1;
    l.roll_back(&undone);
    for e in written {
        let (seq, began) = seqs[&e.id];
        l.committed.insert(e.id, (e.topic, e.key, seq, began));
    }
    Ok(())
}

/// A writer: overlapping transactions of random length until `until`, each started right
/// after the one before (a random pause now and then: load, not synchronization).
async fn writer(
    pool: PgPool,
    seed: u64,
    w: usize,
    p: Params,
    keys: Vec<String>,
    until: Instant,
    ledger: Arc<Mutex<Ledger>>,
) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed ^ (0x3717_e000 + w as u64));
    while Instant::now() < until {
        writer_transaction(&pool, &mut rng, w, &p, &keys, &ledger).await?;
        if rng.random_bool(0.3) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..=40))).await;
        }
    }
    Ok(())
}

/// Another session holds `postal.relay_partitions` in `ACCESS EXCLUSIVE` mode for `ms`
/// (a migration, `VACUUM FULL`, `pg_repack` of it): a claim that began meanwhile waits right
/// after its `BEGIN`, on its first statement. Gives up if it cannot get the lock within
/// 3 s (a frozen relay's claim keeps its share lock until PostgreSQL ends it).
async fn hold_partitions_lock(pool: PgPool, ms: u64) -> Result<(), String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    sqlx::query("SET LOCAL lock_timeout = '3s'")
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    match sqlx::query("LOCK TABLE postal.relay_partitions IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await
    {
        Ok(_) => {}
        Err(e) if e.to_string().contains("lock timeout") => return Ok(()),
        Err(e) => return Err(format!("lock postal.relay_partitions: {e}")),
    }
    sqlx::query("SELECT pg_sleep($1)")
        .bind(ms as f64 / 1000.0)
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    tx.commit().await.map_err(|e| e.to_string())
}

// --- One case ------------------------------------------------------------------------------

struct Log {
    started: Instant,
    lines: Vec<String>,
}

impl Log {
    fn note(&mut self, what: String) {
        let ms = self.started.elapsed().as_millis();
        self.lines.push(format!("{ms:>6} ms  {what}"));
    }
}

/// What a case's driver does besides enqueueing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Schedule {
    /// Relays started, stopped, killed and frozen, destinations failing and stalling, and
    /// `postal.relay_partitions` locked now and then.
    Faults,
    /// One relay runs the whole case, its destination never fails: the driver only enqueues
    /// and locks `postal.relay_partitions` (often), while the writers write.
    Calm,
}

/// What a test's random cases run.
#[derive(Clone, Copy)]
struct Variant {
    /// The events run as tasks by the task runner.
    tasks: bool,
    schedule: Schedule,
    /// WAL relays (with `mixed`: polling relays beside them, and operator requeues).
    wal: bool,
    mixed: bool,
    /// Published rows kept (`delete_on_publish` off).
    keep: bool,
}

impl Variant {
    const POLLING: Variant = Variant {
        tasks: false,
        schedule: Schedule::Faults,
        wal: false,
        mixed: false,
        keep: false,
    };
}

/// Runs `POSTAL_RELAY_RANDOM_CASES` (default `default_cases`) cases of `variant` from the seed
/// `POSTAL_RELAY_RANDOM_SEED` (default random); a broken case panics with `broken`, its seed
/// and the command (`relay_random::{filter}`) that runs it again.
async fn run_cases(default_cases: u64, label: &str, broken: &str, filter: &str, variant: Variant) {
    let cases: u64 = std::env::var("POSTAL_RELAY_RANDOM_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_cases);
    let first: u64 = std::env::var("POSTAL_RELAY_RANDOM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    for seed in first..first.wrapping_add(cases) {
        let t = Instant::now();
        match run_case(seed, variant).await {
            Ok(summary) => eprintln!(
                "relay_random {label}seed {seed}: ok in {:.1} s: {summary}",
                t.elapsed().as_secs_f64()
            ),
            Err(e) => panic!(
                "{broken} (seed {seed}): {e}\n  reproduce: POSTAL_RELAY_RANDOM_SEED={seed} POSTAL_RELAY_RANDOM_CASES=1 cargo test -p postal-integration-tests --test suite -- relay_random::{filter} --nocapture"
            ),
        }
    }
}

async fn run_case(seed: u64, variant: Variant) -> Result<String, String> {
    let Variant {
        tasks,
        schedule,
        wal,
        mixed,
        keep,
    } = variant;
    let mut rng = StdRng::seed_from_u64(seed);
    let calm = schedule == Schedule::Calm;
    let mut params = Params {
        tasks,
        keys: rng.random_range(2..=4),
        // Small batches stress the key chain; large ones (as deployed) take a whole backlog —
        // the rows written while the relay's claims were held up — in one claim.
        batch_size: if !calm && rng.random_bool(0.5) {
            rng.random_range(1..=6)
        } else {
            rng.random_range(20..=200)
        },
        max_in_flight_batches: rng.random_range(1..=4),
        lanes: rng.random_range(1..=if calm { 2 } else { 4 }),
        max_attempts: rng.random_range(2..=5),
        actions_for: Duration::from_millis(rng.random_range(2500..=4500)),
        topics: if rng.random_bool(0.3) { 2 } else { 1 },
        writers: rng.random_range(4..=8),
        writer_pause_ms: rng.random_range(20..=300),
        rollback: rng.random_range(0.05..=0.25),
        jitter: rng.random_bool(0.8).then(|| {
            (
                rng.random_range(0.3..=1.0),
                rng.random_range(2..=50),
                rng.random_range(0.02..=0.1),
                rng.random_range(100..=500),
            )
        }),
        wal: None,
        mixed,
        keep,
    };
    let db = fresh_postgres_db().await;
    // Declared after `db`: dropped (the slot and publication with it) before the database.
    let slot = if wal {
        Some(crate::wal_relay::Slot::create(&db).await)
    } else {
        None
    };
    params.wal = slot.as_ref().map(|s| s.source.clone());
    sqlx::query("CREATE TABLE business (id bigserial PRIMARY KEY, writer int, note text)")
        .execute(&db.pool)
        .await
        .map_err(|e| e.to_string())?;
    // Every relay's statements pass through `pg`, which delays them at random.
    let pg = pg_proxy::proxy_for(&db).await;
    if let Some((chance, max_ms, spikes, spike_ms)) = params.jitter {
        *pg.ctl.jitter.lock().unwrap() =
            Some(pg_proxy::Jitter::new(seed ^ 0x717e, chance, max_ms).spikes(spikes, spike_ms));
    }
    let started = Instant::now();
    let world = Arc::new(World {
        log: Mutex::new(Vec::new()),
        fence: Mutex::new(HashMap::new()),
        stale: Default::default(),
        repeated: Default::default(),
        rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0x5eed)),
        faults: AtomicU8::new(Faults::None as u8),
        started,
    });
    // Most cases start with a failing destination.
    let faults = if calm {
        Faults::None
    } else {
        random_faults(&mut rng)
    };
    world.faults.store(faults as u8, Ordering::Relaxed);
    let mut log = Log {
        started,
        lines: Vec::new(),
    };
    log.note(format!("{params:?}, faults {faults:?}"));
    let keys: Vec<String> = (0..params.keys).map(|k| format!("k{k}")).collect();
    let topics = &TOPICS[..params.topics];
    // What was enqueued, committed or rolled back, with sequence numbers.
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    // The writers' and the driver's pool; waits on key locks past a second are expected (no
    // slow-statement warnings).
    let writers_pool = PgPoolOptions::new()
        .max_connections(params.writers as u32 + 1)
        .acquire_timeout(Duration::from_secs(20))
        .connect_with(
            PgConnectOptions::from_str(&db.url)
                .map_err(|e| e.to_string())?
                .disable_statement_logging(),
        )
        .await
        .map_err(|e| format!("writers' pool: {e}"))?;
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..params.writers {
        writers.spawn(writer(
            writers_pool.clone(),
            seed,
            w,
            params.clone(),
            keys.clone(),
            started + params.actions_for,
            ledger.clone(),
        ));
    }
    let mut lockers = tokio::task::JoinSet::new();
    let mut slots: Vec<Option<Instance>> = (0..3).map(|_| None).collect();
    let mut next_instance = 0usize;
    if calm {
        slots[0] = Some(start_instance(&db, &pg, &world, &params, 0).await?);
        next_instance = 1;
        log.note("start relay 0 (for the whole case)".into());
    }
    let mut stopping = Vec::new();

    while started.elapsed() < params.actions_for {
        let action = match schedule {
            Schedule::Faults => rng.random_range(0..100u32),
            // Enqueue, or lock.
            Schedule::Calm => [0, 25][rng.random_bool(0.5) as usize],
        };
        let slot = rng.random_range(0..slots.len());
        match action {
            // Enqueue a few events (a burst now and then), in one short transaction (besides
            // the writers' concurrent ones).
            0..=24 => {
                let n = if rng.random_bool(0.15) {
                    rng.random_range(6..=20)
                } else {
                    rng.random_range(1..=4)
                };
                let events = plan(&mut rng, topics, &keys, n);
                let mut tx = writers_pool.begin().await.map_err(|e| e.to_string())?;
                let written = match write_events(&mut tx, &events, false).await {
                    Ok(()) => seqs_of(&mut tx, &events).await,
                    Err(e) => Err(e),
                };
                match written {
                    Ok(seqs) => {
                        tx.commit().await.map_err(|e| e.to_string())?;
                        let mut l = ledger.lock().unwrap();
                        for e in events {
                            let (seq, began) = seqs[&e.id];
                            l.committed.insert(e.id, (e.topic, e.key, seq, began));
                        }
                        log.note(format!("enqueue {n}"));
                    }
                    // Its key locks against a writer's (taken in another order).
                    Err(e) if deadlocked(&e) => {
                        drop(tx);
                        ledger.lock().unwrap().roll_back(&events);
                        log.note(format!("enqueue {n}: deadlock, rolled back"));
                    }
                    Err(e) => return Err(format!("enqueue: {e}")),
                }
            }
            // Something holds the claim's first table for a moment, while a relay runs (the
            // relays' heartbeats wait too: kept well within the lease).
            25..=37 => {
                let ms = rng.random_range(300..=900);
                if slots.iter().any(Option::is_some) {
                    log.note(format!("lock postal.relay_partitions for {ms} ms"));
                    lockers.spawn(hold_partitions_lock(db.pool.clone(), ms));
                }
            }
            38..=52 => {
                if slots[slot].is_none() {
                    let n = next_instance;
                    next_instance += 1;
                    slots[slot] = Some(start_instance(&db, &pg, &world, &params, n).await?);
                    log.note(format!("start relay {n}"));
                }
            }
            53..=60 => {
                if let Some(i) = slots[slot].take() {
                    log.note(format!("stop relay {} (graceful)", i.n));
                    stopping.push(tokio::spawn(i.stop()));
                }
            }
            61..=68 => {
                if let Some(i) = slots[slot].take() {
                    log.note(format!("kill relay {}", i.n));
                    i.kill().await;
                }
            }
            // Freeze the whole "process": its database traffic and its destination; often
            // for longer than the lease, so that its partitions move meanwhile.
            69..=78 => {
                if let Some(i) = &slots[slot] {
                    let d = Duration::from_millis(rng.random_range(300..=4000));
                    log.note(format!("freeze relay {} for {d:?}", i.n));
                    freeze_for(&i.db_frozen, d);
                    freeze_for(&i.dest_frozen, d);
                }
            }
            // Only the destination stalls (acknowledgements withheld, hand-overs blocked).
            79..=85 => {
                if let Some(i) = &slots[slot] {
                    let d = Duration::from_millis(rng.random_range(200..=3000));
                    log.note(format!("stall destination of relay {} for {d:?}", i.n));
                    freeze_for(&i.dest_frozen, d);
                }
            }
            // Only its database traffic stalls.
            86..=89 => {
                if let Some(i) = &slots[slot] {
                    let d = Duration::from_millis(rng.random_range(200..=3000));
                    log.note(format!("stall database of relay {} for {d:?}", i.n));
                    freeze_for(&i.db_frozen, d);
                }
            }
            // An operator requeues every parked event (`postal requeue`), racing the relays.
            90..=94 if params.mixed => {
                let parked: Vec<i64> = sqlx::query_scalar(
                    "SELECT seq FROM postal.outbox WHERE status = 'failed' ORDER BY seq",
                )
                .fetch_all(&writers_pool)
                .await
                .map_err(|e| e.to_string())?;
                let n = postal_admin::parked::requeue_seqs(
                    &writers_pool,
                    &postal_admin::audit::Operator::cli("test"),
                    &serde_json::json!({"seqs": parked}),
                    &parked,
                    |_| {},
                )
                .await
                .map_err(|e| format!("requeue: {e}"))?;
                log.note(format!("requeue {n} parked events {parked:?}"));
            }
            _ => {
                let f = random_faults(&mut rng);
                world.faults.store(f as u8, Ordering::Relaxed);
                log.note(format!("faults {f:?}"));
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..=250))).await;
    }

    // The writers finish the transactions they are in.
    for (what, set) in [("writer", &mut writers), ("lock holder", &mut lockers)] {
        while let Some(r) = tokio::time::timeout(Duration::from_secs(60), set.join_next())
            .await
            .map_err(|_| format!("a {what} hung\n{}", dump(&log)))?
        {
            r.map_err(|e| format!("a {what} panicked: {e}"))?
                .map_err(|e| format!("{e}\n{}", dump(&log)))?;
        }
    }
    writers_pool.close().await;
    let writers_summary = {
        let l = ledger.lock().unwrap();
        format!(
            "writers: {} commits, {} rollbacks, {} deadlocks, {} savepoints rolled back, {} overtaking pairs",
            l.commits,
            l.rollbacks,
            l.deadlocks,
            l.savepoints,
            l.overtaken()
        )
    };
    log.note(writers_summary.clone());
    // Wind down: the destination heals, the remaining instances thaw and stop or die.
    world.faults.store(Faults::None as u8, Ordering::Relaxed);
    for i in slots.iter_mut().filter_map(Option::take) {
        i.db_frozen.send_replace(false);
        i.dest_frozen.send_replace(false);
        if rng.random_bool(0.5) {
            log.note(format!("final: kill relay {}", i.n));
            i.kill().await;
        } else {
            log.note(format!("final: stop relay {}", i.n));
            stopping.push(tokio::spawn(i.stop()));
        }
    }
    for s in stopping {
        match tokio::time::timeout(Duration::from_secs(60), s).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("a graceful stop failed: {e}\n{}", dump(&log))),
            Err(_) => return Err(format!("a graceful stop hung\n{}", dump(&log))),
        }
    }
    // Drain with one healthy instance, its statements no longer delayed (the drain only
    // prepares the checks; delayed, a backlog drained in small batches took a minute).
    *pg.ctl.jitter.lock().unwrap() = None;
    let n = next_instance;
    let last = start_instance(&db, &pg, &world, &params, n).await?;
    log.note(format!("final: drain with relay {n}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last_change = (i64::MAX, Instant::now());
    loop {
        let left = stuck_or_waiting(&db.pool).await;
        if left == 0 {
            break;
        }
        if left != last_change.0 {
            last_change = (left, Instant::now());
        } else if last_change.1.elapsed() > Duration::from_secs(5) {
            // No progress for a while: fail at once if what is left only waits behind a
            // parked event of its key on another topic (a key's scope is its topic and key).
            let held = held_by_another_topic(&db.pool).await;
            if held.len() as i64 == left {
                return Err(format!(
                    "SCOPE: {left} events wait behind a parked event of their key on another topic (topic, key, seq): {held:?}\n{}",
                    dump(&log)
                ));
            }
        }
        if Instant::now() > deadline {
            let left = stuck_or_waiting(&db.pool).await;
            return Err(format!(
                "{left} events still publishable 60 s into the drain\n{}",
                dump(&log)
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    last.stop().await;
    log.note("final: drained and stopped".into());
    let left = stuck_or_waiting(&db.pool).await;
    if left > 0 {
        return Err(format!(
            "{left} events publishable after the drain\n{}",
            dump(&log)
        ));
    }
    let landed = world.log.lock().unwrap().clone();
    let (enqueued, rolled_back) = {
        let l = ledger.lock().unwrap();
        (l.by_scope(), l.rolled_back.clone())
    };
    let summary = check(&db.pool, &enqueued, &rolled_back, &landed)
        .await
        .map_err(|e| format!("{e}\n{}", dump(&log)))?;
    let summary = format!("{summary}; {writers_summary}");
    if !tasks {
        return Ok(summary);
    }
    let repeated = world.repeated.load(Ordering::Relaxed);
    if repeated > 0 {
        return Err(format!(
            "RUN NUMBER: {repeated} runs started with a run number their task had started with before\n{}",
            dump(&log)
        ));
    }
    check_task_order(&enqueued, &landed).map_err(|e| format!("{e}\n{}", dump(&log)))?;
    Ok(format!(
        "{summary}, {} stale runs refused by the fence",
        world.stale.load(Ordering::Relaxed)
    ))
}

/// Tasks: per key (topic and key), every run that started (and passed the fence) is of the
/// key's task that started last or a later one: a task never starts again once a later task
/// of its key has started (no "1, 2, 1").
fn check_task_order(
    enqueued: &BTreeMap<Scope, Vec<Uuid>>,
    landed: &[Landing],
) -> Result<(), String> {
    for ((topic, key), ids) in enqueued {
        let index: HashMap<Uuid, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        let mut highest = 0usize;
        let mut seen = Vec::new();
        for l in landed.iter().filter(|l| &l.key == key && &l.topic == topic) {
            let idx = index[&l.id];
            seen.push(format!(
                "#{idx}(run {} relay {} @{}ms)",
                l.run, l.relay, l.at_ms
            ));
            if idx < highest {
                return Err(format!(
                    "TASK ORDER: key {key} on {topic}: task #{idx} started again after task #{highest}\n  starts of {key}: {}",
                    seen.join(" ")
                ));
            }
            highest = idx;
        }
    }
    Ok(())
}

fn random_faults(rng: &mut StdRng) -> Faults {
    match rng.random_range(0..3) {
        0 => Faults::None,
        1 => Faults::Light,
        _ => Faults::Heavy,
    }
}

fn dump(log: &Log) -> String {
    let mut s = String::from("  actions:\n");
    for l in &log.lines {
        let _ = writeln!(s, "    {l}");
    }
    s
}

/// Pending events not waiting behind a parked event of their key (topic and key): the drain
/// is not done.
async fn stuck_or_waiting(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM postal.outbox o WHERE o.status = 'pending'
           AND NOT EXISTS (SELECT 1 FROM postal.outbox b WHERE b.event_key = o.event_key
                           AND b.topic = o.topic AND b.status = 'failed' AND b.seq < o.seq)",
    )
    .fetch_one(pool)
    .await
    .expect("outbox count")
}

/// Pending events that [`stuck_or_waiting`] counts and that have a parked event of their key
/// with a lower sequence number on another topic: (topic, key, sequence number).
async fn held_by_another_topic(pool: &PgPool) -> Vec<(String, String, i64)> {
    sqlx::query_as(
        "SELECT o.topic, o.event_key, o.seq FROM postal.outbox o WHERE o.status = 'pending'
           AND NOT EXISTS (SELECT 1 FROM postal.outbox b WHERE b.event_key = o.event_key
                           AND b.topic = o.topic AND b.status = 'failed' AND b.seq < o.seq)
           AND EXISTS (SELECT 1 FROM postal.outbox b WHERE b.event_key = o.event_key
                       AND b.topic <> o.topic AND b.status = 'failed' AND b.seq < o.seq)
         ORDER BY o.seq",
    )
    .fetch_all(pool)
    .await
    .expect("outbox rows")
}

/// The invariants. Returns a one-line summary when they hold.
async fn check(
    pool: &PgPool,
    enqueued: &BTreeMap<Scope, Vec<Uuid>>,
    rolled_back: &HashSet<Uuid>,
    landed: &[Landing],
) -> Result<String, String> {
    let rows: Vec<(Uuid, String, i64, String)> =
        sqlx::query_as("SELECT event_id, event_key, seq, status FROM postal.outbox")
            .fetch_all(pool)
            .await
            .map_err(|e| e.to_string())?;
    let parked: HashSet<Uuid> = rows
        .iter()
        .filter(|r| r.3 == "failed")
        .map(|r| r.0)
        .collect();
    let pending: HashSet<Uuid> = rows
        .iter()
        .filter(|r| r.3 == "pending")
        .map(|r| r.0)
        .collect();
    if let Some(r) = rows
        .iter()
        .find(|r| r.3 != "failed" && r.3 != "pending" && r.3 != "published")
    {
        return Err(format!("unexpected outbox row {r:?}"));
    }
    let known: HashSet<Uuid> = enqueued.values().flatten().copied().collect();
    let mut first: HashMap<Uuid, usize> = HashMap::new();
    for (i, l) in landed.iter().enumerate() {
        if rolled_back.contains(&l.id) {
            return Err(format!(
                "ROLLED BACK: landed an event whose transaction (or savepoint) rolled back: {l:?}"
            ));
        }
        if !known.contains(&l.id) {
            return Err(format!("landed an event never enqueued: {l:?}"));
        }
        first.entry(l.id).or_insert(i);
    }
    let duplicates = landed.len() - first.len();
    let mut waiting = 0usize;
    for ((topic, key), ids) in enqueued {
        // (1) No loss: landed, parked, or pending behind a parked event of its key.
        let mut parked_before = false;
        for (idx, id) in ids.iter().enumerate() {
            if parked.contains(id) {
                parked_before = true;
                continue;
            }
            if first.contains_key(id) {
                continue;
            }
            if pending.contains(id) && parked_before {
                waiting += 1;
                continue;
            }
            return Err(format!(
                "LOSS: key {key} on {topic} event #{idx} {id} was never published and is {} (pending: {}, parked before it: {parked_before})",
                if pending.contains(id) { "still pending" } else { "gone from the outbox" },
                pending.contains(id),
            ));
        }
        // (2) Order: ignoring parked events, the key's first landings are a prefix of its
        // enqueue order, in that order; whatever follows that prefix never landed and waits.
        let expected: Vec<(usize, Uuid)> = ids
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, id)| !parked.contains(id))
            .collect();
        let mut got: Vec<(usize, Uuid)> = expected
            .iter()
            .copied()
            .filter(|(_, id)| first.contains_key(id))
            .collect();
        got.sort_by_key(|(_, id)| first[id]);
        for (pos, (idx, id)) in got.iter().enumerate() {
            let (want_idx, want) = expected[pos];
            if *id != want {
                let shown: Vec<String> = landed
                    .iter()
                    .filter(|l| &l.key == key && &l.topic == topic)
                    .map(|l| {
                        let idx = ids.iter().position(|i| *i == l.id).unwrap_or(usize::MAX);
                        format!("#{idx}(seq {} relay {} @{}ms)", l.seq, l.relay, l.at_ms)
                    })
                    .collect();
                let parked_idx: Vec<usize> = ids
                    .iter()
                    .enumerate()
                    .filter(|(_, i)| parked.contains(i))
                    .map(|(n, _)| n)
                    .collect();
                return Err(format!(
                    "ORDER: key {key} on {topic}: first publication #{pos} is event #{idx}, expected #{want_idx} ({})\n  landings of {key}: {}\n  parked: {parked_idx:?}",
                    if first.contains_key(&want) { "published later" } else { "never published" },
                    shown.join(" ")
                ));
            }
        }
    }
    Ok(format!(
        "{} enqueued, {} rolled back, {} published ({} duplicate landings), {} parked, {} waiting behind parked",
        known.len(),
        rolled_back.len(),
        first.len(),
        duplicates,
        parked.len(),
        waiting
    ))
}

/// Guarantee: under random interleavings of concurrent writers (overlapping transactions of
/// random length on the same keys, other work before and after enqueueing, `enqueue_batch`
/// and `postal.enqueue`, savepoints and transactions rolled back, deadlocks), relay starts,
/// graceful stops, kills, frozen relays (database traffic and destination, often for longer
/// than the lease, so that their partitions move to other relays while their batches are in
/// flight), relay statements delayed at random, `postal.relay_partitions` locked for a moment
/// by another session, stalled destinations and random per-event outcomes (acknowledged,
/// transient, unavailable, permanent, held back, acknowledgements delayed), nothing is lost —
/// every committed event is published at least once, or parked, or waits behind a parked
/// event of its key — no rolled-back event is ever published, and each key's (topic and key)
/// events are first published in sequence order, parked ones aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_relay_interleavings_keep_order_and_lose_nothing() {
    run_cases(
        8,
        "",
        "relay protocol invariant broken",
        "random",
        Variant::POLLING,
    )
    .await;
}

/// Guarantee: the same random interleavings (concurrent writers, delayed relay statements,
/// locks on `postal.relay_partitions` included) with the events run as tasks by the real task
/// runner (the relay checks them out; handlers take random times and fail at random,
/// retryably or for good): nothing is lost, no rolled-back task ever runs, each key's tasks
/// first start in sequence order, a
/// task never starts again once a later task of its key started, and run numbers strictly
/// increase per task — the fence a downstream keeps with them refuses every stale run (a
/// relay frozen past its run lease) and never sees a run number twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_task_interleavings_keep_order_and_lose_nothing() {
    run_cases(
        8,
        "tasks ",
        "task protocol invariant broken",
        "random_task",
        Variant {
            tasks: true,
            ..Variant::POLLING
        },
    )
    .await;
}

/// Guarantee: with one relay running throughout and a destination that never fails, while
/// several writers run overlapping transactions on a few keys (a transaction that began first
/// often enqueuing last), the relay's statements are delayed at random and another session
/// often holds `postal.relay_partitions` locked for a few hundred milliseconds (so that claims
/// wait right after their `BEGIN` while writers commit), each key's (topic and key) events are
/// first published in sequence order, nothing is lost and no rolled-back event is published.
/// The interleavings of concurrent writers, not faults, are what this case is about: on the
/// code before issue 45's fix (26a357e) it broke a key's order in about one case in four.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_overlapping_writers_with_held_up_claims_keep_order() {
    run_cases(
        8,
        "calm ",
        "relay order broken under concurrent writers",
        "random_overlapping",
        Variant {
            schedule: Schedule::Calm,
            ..Variant::POLLING
        },
    )
    .await;
}

/// Guarantee: the same random interleavings with WAL relays (each reads the outbox from one
/// logical replication slot while it holds the slot's lease, and runs its sweep, a polling
/// relay for what the stream leaves pending): concurrent writers, relays started, stopped,
/// killed and frozen (their database traffic: the lease moves to another relay while the
/// frozen one's batches are in flight; the replication session itself connects directly),
/// relay statements delayed at random, `postal.relay_partitions` locked for a moment (the
/// sweep's claims wait), and random per-event outcomes (failed events are written back for a
/// retry, parked after their attempts, and retried by the sweep): nothing is lost, no
/// rolled-back event is published, and each key's events are first published in sequence
/// order, parked ones aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_wal_relay_interleavings_keep_order_and_lose_nothing() {
    run_cases(
        8,
        "wal ",
        "WAL relay invariant broken",
        "random_wal",
        Variant {
            wal: true,
            ..Variant::POLLING
        },
    )
    .await;
}

/// Guarantee: the WAL variant's guarantees (nothing lost, no rolled-back event published, each
/// key's events first published in sequence order, parked ones aside) hold also when polling
/// relays run beside the WAL relays on the same outbox — a rolling hand-over between the modes,
/// in either direction, with batches in flight on both sides (odd-numbered instances poll,
/// even-numbered ones read the slot and run their sweep) — and while an operator requeues the
/// parked events (`postal requeue`) under the running relays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_mixed_wal_and_polling_relays_keep_order_and_lose_nothing() {
    run_cases(
        4,
        "mixed ",
        "mixed WAL/polling invariant broken",
        "random_mixed",
        Variant {
            wal: true,
            mixed: true,
            ..Variant::POLLING
        },
    )
    .await;
}

/// Guarantee: the WAL variant's guarantees hold with published rows kept (`delete_on_publish`
/// off: the stream and the sweep lock rows and mark them `published`, failed rows are updated in
/// place rather than written back), WAL relays and polling relays running side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_mixed_relays_keeping_published_rows_keep_order_and_lose_nothing() {
    run_cases(
        4,
        "mixed keep ",
        "mixed WAL/polling (kept rows) invariant broken",
        "random_mixed_relays_keeping",
        Variant {
            wal: true,
            mixed: true,
            keep: true,
            ..Variant::POLLING
        },
    )
    .await;
}
