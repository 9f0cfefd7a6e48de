//! Adversarial review of b2830b3 (consumer/src/idle_end.rs, partition/process.rs `Retry`,
//! `Attempt::IdleEnded`, batch.rs `process_batch`): a session the server ended *for idling*
//! (SQLSTATE 25P03, `idle_in_transaction_session_timeout`) is told from an outage by that code,
//! read from the handler's error (its `source()` chain) or from the runtime's next statement;
//! the head alone ended so counts as one of its `max_attempts`, every other lost session is an
//! outage, never an attempt. Attacks on "the partition moves on" and "no innocent event is
//! dead-lettered" where the 25P03 does not reach the runtime as that code:
//!
//! - a handler that turns the database error into text (`HandlerError::retryable(format!(…))`:
//!   the code is gone from the chain) — in throughput mode the rollback of the dead session then
//!   fails with an I/O error, an outage;
//! - a handler that swallows the error of a best-effort statement and returns `Ok` (the
//!   runtime's next statement sees only the closed connection);
//! - a session-mode PgBouncer between the consumer and PostgreSQL: with the DBA's timeout on the
//!   server (does the 25P03 pass through?), and with PgBouncer's own `idle_transaction_timeout`
//!   (its error is `08P01`, not `25P03`);
//! - a handler that blocks the runtime's only worker thread (a synchronous call): another
//!   partition's transaction, whose handler did nothing wrong, sits idle past the timeout.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postal_consumer::{Batch, BatchHandler, BoxFuture, Consumer, Event, Handler, HandlerError};
use postal_integration_tests::pgbouncer::{self, Options, PgBouncer, PoolMode};
use postal_integration_tests::{services, unique};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::batch_fixtures::{job, order};
use crate::common::{
    consumer_config, create_topic, effects, effects_table, produce, RawRecord, RunningConsumer,
};

const CONSUMER: &str = "effects";

/// How the handler treats the database error met after its wait outside the database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Errors {
    /// `?` on the `sqlx::Error` (the code stays in the chain): what b2830b3 reads.
    Chain,
    /// `.map_err(|e| HandlerError::retryable(format!("…: {e}")))?`: the text of the error only
    /// (a common way to add context without `anyhow`).
    Text,
    /// Writes its effect, waits, then runs a best-effort statement whose error it logs and
    /// ignores, and returns `Ok`.
    Swallow,
}

/// Writes `effects (event_id, n)`. An event's payload may ask for `sleep_ms` (a wait outside
/// the database, inside the transaction: an enrichment call) and `block_ms` (the same wait,
/// but synchronous: `std::thread::sleep`, blocking the runtime's worker thread). `errors` says
/// how the error met after the wait is treated.
#[derive(Clone)]
struct Writer {
    errors: Errors,
    calls: Arc<AtomicU32>,
    sizes: Arc<Mutex<Vec<usize>>>,
}

impl Writer {
    fn new(errors: Errors) -> Self {
        Writer {
            errors,
            calls: Arc::default(),
            sizes: Arc::default(),
        }
    }

    async fn write(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        events: &[&Event<serde_json::Value>],
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.sizes.lock().unwrap().push(events.len());
        let sleep: u64 = events
            .iter()
            .map(|e| e.payload["sleep_ms"].as_u64().unwrap_or(0))
            .sum();
        let block: u64 = events
            .iter()
            .map(|e| e.payload["block_ms"].as_u64().unwrap_or(0))
            .sum();
        let ids: Vec<Uuid> = events.iter().map(|e| e.id.as_uuid()).collect();
        let ns: Vec<i64> = events
            .iter()
            .map(|e| e.payload["n"].as_i64().unwrap_or(-1))
            .collect();
        let insert = sqlx::query(
            "INSERT INTO effects (event_id, n, consumer)
             SELECT id, n, $3 FROM unnest($1::uuid[], $2::bigint[]) WITH ORDINALITY AS t(id, n, i)
             ORDER BY i",
        )
        .bind(&ids)
        .bind(&ns)
        .bind(CONSUMER);
        if self.errors == Errors::Swallow {
            insert.execute(&mut **tx).await?;
            if sleep > 0 {
                tokio::time::sleep(Duration::from_millis(sleep)).await;
            }
            // Best effort: an audit row that may fail without failing the event.
            if let Err(e) = sqlx::query("SELECT 1").execute(&mut **tx).await {
                eprintln!("best-effort audit failed (ignored): {e}");
            }
            return Ok(());
        }
        if block > 0 {
            std::thread::sleep(Duration::from_millis(block));
        }
        if sleep > 0 {
            tokio::time::sleep(Duration::from_millis(sleep)).await;
        }
        match self.errors {
            Errors::Text => {
                insert
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| HandlerError::retryable(format!("writing the effect: {e}")))?;
            }
            _ => {
                insert.execute(&mut **tx).await?;
            }
        }
        Ok(())
    }
}

impl BatchHandler for Writer {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "writer"
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        events: Batch<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let all: Vec<&Event<serde_json::Value>> = events.iter().collect();
            self.write(tx, &all).await
        })
    }
}

/// The same writer as a single-event handler.
#[derive(Clone)]
struct WriterOne(Writer);

impl Handler for WriterOne {
    type Payload = serde_json::Value;

    fn consumer(&self) -> &str {
        CONSUMER
    }

    fn name(&self) -> &str {
        "writer_one"
    }

    fn handle<'a, 'c>(
        &'a self,
        tx: &'a mut Transaction<'c, Postgres>,
        event: Event<serde_json::Value>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move { self.0.write(tx, &[&event]).await })
    }
}

/// Which handler form and mode a run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// `max_batch` 1, a single-event handler.
    OneAtATime,
    /// `max_batch` 64, a single-event handler (several records per transaction).
    ThroughputSingle,
    /// `max_batch` 64, a batch handler.
    ThroughputBatch,
}

/// Where the idle timeout is and how the consumer reaches PostgreSQL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// Directly, the DBA's `idle_in_transaction_session_timeout` = 1 s on the database.
    Direct,
    /// Through a session-mode PgBouncer, the DBA's 1 s timeout on the database.
    BouncerDbaTimeout,
    /// Through a session-mode PgBouncer with `idle_transaction_timeout = 1` (PgBouncer's own
    /// limit on a client idle in a transaction), no timeout on the database.
    BouncerOwnTimeout,
}

/// What [`slow_head_run`] saw.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct Seen {
    secs: f64,
    applied: u64,
    retries: u64,
    calls: u32,
    sizes: Vec<usize>,
    dead_letter_errors: Vec<String>,
}

/// 10 events on one partition, the 4th waiting `sleep_ms` outside the database inside its
/// transaction (past the 1 s idle timeout of `path`), its handler treating the error as
/// `errors`; `max_attempts` 3. Runs until all 10 are finished (applied or dead-lettered) or
/// `limit` passes. Checks each event once, in offset order.
async fn slow_head_run(
    form: Form,
    errors: Errors,
    path: Path,
    sleep_ms: u64,
    limit: Duration,
) -> Seen {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    if path != Path::BouncerOwnTimeout {
        sqlx::query(&format!(
            "ALTER DATABASE \"{}\" SET idle_in_transaction_session_timeout = '1s'",
            db.name
        ))
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let bouncer = match path {
        Path::Direct => None,
        _ => {
            let Some(bin) = pgbouncer::binary("idle_end_attack") else {
                panic!("no PgBouncer binary (scripts/stack.sh pooler-up installs it)");
            };
            let mut options = Options::default();
            if path == Path::BouncerOwnTimeout {
                options.settings.push("idle_transaction_timeout = 1".into());
            }
            Some(PgBouncer::start_with(
                &bin,
                &svc.database_url,
                PoolMode::Session,
                20,
                &[],
                options,
            ))
        }
    };
    let pool: PgPool = match &bouncer {
        None => db.pool_of(5).await,
        Some(b) => PgPoolOptions::new()
            .max_connections(5)
            .acquire_timeout(Duration::from_secs(20))
            .connect(&b.url(&db.name))
            .await
            .expect("connect through pgbouncer"),
    };
    if path != Path::BouncerOwnTimeout {
        let timeout: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(timeout, "1s", "the DBA's setting applies");
    }
    let topic = unique("idle_end");
    create_topic(&svc.bootstrap, &topic, 1).await;
    let records: Vec<RawRecord> = (0..10)
        .map(|n| {
            let sleep = if n == 3 { sleep_ms } else { 0 };
            job(Uuid::now_v7(), "k", json!({"n": n, "sleep_ms": sleep}))
        })
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &records).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = if form == Form::OneAtATime { 1 } else { 64 };
    config.max_attempts = 3;
    let writer = Writer::new(errors);
    let builder = Consumer::builder(pool.clone(), config);
    let builder = match form {
        Form::ThroughputBatch => builder.on_batch(&topic, "job", writer.clone()),
        _ => builder.on(&topic, "job", WriterOne(writer.clone())),
    };
    let started = Instant::now();
    let running = RunningConsumer::start(builder.build().expect("consumer"));
    let stats = running.stats.clone();
    let _ = tokio::time::timeout(limit, async {
        loop {
            let s = stats.snapshot();
            if s.applied + s.dead_letters >= 10 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let secs = started.elapsed().as_secs_f64();
    running.stop().await;
    pool.close().await;
    let s = stats.snapshot();
    let (rows, distinct) = effects(&db.pool).await;
    assert_eq!(rows, distinct, "no event applied twice");
    let applied_n = order(&db.pool).await;
    assert!(
        applied_n.windows(2).all(|w| w[0] < w[1]),
        "in offset order: {applied_n:?}"
    );
    let dead_letter_errors: Vec<String> =
        sqlx::query_scalar("SELECT error FROM postal.dead_letters ORDER BY kafka_offset")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    if let Some(b) = &bouncer {
        let log = b.log();
        let tail: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("closing because") || l.contains("WARNING"))
            .take(6)
            .collect();
        eprintln!("pgbouncer log (first closing/warning lines): {tail:#?}");
    }
    let seen = Seen {
        secs,
        applied: s.applied,
        retries: s.retries,
        calls: writer.calls.load(Ordering::SeqCst),
        sizes: writer.sizes.lock().unwrap().clone(),
        dead_letter_errors,
    };
    eprintln!("{form:?} {errors:?} {path:?}: {seen:?}");
    seen
}

/// The partition moved on: the 9 others applied, the slow one dead-lettered once.
fn moved_on(seen: &Seen) {
    assert!(
        seen.applied == 9 && seen.dead_letter_errors.len() == 1,
        "stalled: {seen:?}"
    );
}

const LIMIT: Duration = Duration::from_secs(25);

// --- A handler that keeps only the error's text --------------------------------------------

/// Guarantee attacked: the partition moves on — an event whose own handler waits past the
/// DBA's idle timeout is retried, then dead-lettered after `max_attempts`, and the events after
/// it are applied, in throughput mode as one at a time. Here the handler adds context to the
/// database error the way many do without `anyhow`:
/// `.map_err(|e| HandlerError::retryable(format!("writing the effect: {e}")))?` — a retryable
/// failure, by its own word, but the 25P03 is text now, not in the `source()` chain b2830b3
/// reads. One at a time the retryable failure counts (control below). In throughput mode the
/// optimistic pass `abandon`s the transaction: its ROLLBACK on the connection the server
/// closed fails with an I/O error, which `abandon` makes `Attempt::Unavailable` (an outage,
/// never an attempt), so the head alone is retried for good.
///
/// Measured on b2830b3 (2 shared cores, under a CI rehearsal's load): single-event handler,
/// `max_batch` 64: 3 of 10 applied in 25 s, 0 retries counted, no dead letter, 27 handler
/// calls (the slow event alone again and again: "batch transaction failed; retrying … the
/// session ended while a handler ran: error communicating with database: expected to read 5
/// bytes, got 0 bytes at EOF records=1", each an outage); batch handler: the same, 18 calls
/// of sizes [10, 5, 2, 4, 2, 1, 2, 1, 1, …]. One at a time (the control): 9 applied and the
/// event dead-lettered after 3 attempts in 5.8 s. Nothing lost or applied twice; the
/// partition waits for good. Cause (consumer/src/batch.rs): `abandon` (optimistic pass) and
/// `roll_back` (isolated pass) let the rollback's I/O error on the closed session replace a
/// body failure that is not `Retry::IdleEnded`, making the handler's own retryable failure an
/// outage; one at a time the body's failure is the attempt's.
/// Since then: a body failure that is not an outage, whose session the rollback finds gone, is
/// the transaction's own (`Attempt::SessionEnded`: halves a batch, an attempt of the head alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_single_a_handler_that_keeps_the_idle_errors_text_does_not_stall() {
    let seen = slow_head_run(
        Form::ThroughputSingle,
        Errors::Text,
        Path::Direct,
        1500,
        LIMIT,
    )
    .await;
    moved_on(&seen);
}

/// As above, with a batch handler (`max_batch` 64). Measured on b2830b3: 3 of 10 applied in
/// 25 s, 0 retries, no dead letter, 18 calls of sizes [10, 5, 2, 4, 2, 1, 2, 1, 1, 1, 1, 1, 1,
/// 1, 1, 1, 1, 1].
/// Since then: as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_batch_a_handler_that_keeps_the_idle_errors_text_does_not_stall() {
    let seen = slow_head_run(
        Form::ThroughputBatch,
        Errors::Text,
        Path::Direct,
        1500,
        LIMIT,
    )
    .await;
    moved_on(&seen);
}

/// Control, one at a time: the handler's retryable failure (the text of a 25P03) counts as an
/// attempt; after 3 the event is dead-lettered and the 9 others are applied. (Held on b2830b3:
/// 5.8 s, dead letter "gave up after 3 attempts: writing the effect: … terminating connection
/// due to idle-in-transaction timeout".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_a_handler_that_keeps_the_idle_errors_text_does_not_stall() {
    let seen = slow_head_run(Form::OneAtATime, Errors::Text, Path::Direct, 1500, LIMIT).await;
    moved_on(&seen);
}

// --- A handler that swallows the error and returns Ok ---------------------------------------

/// Guarantee attacked: the partition moves on (as above). Here the handler writes its effect,
/// waits 1.5 s outside the database (past the DBA's 1 s timeout), then runs a best-effort
/// statement whose error it logs and ignores, and returns `Ok`: the 25P03 went to that
/// statement; the runtime's next statement (the offset's, the next record's, the savepoint's
/// release) meets only the closed connection, an I/O error: an outage, never an attempt.
///
/// Measured on b2830b3, one at a time: 3 of 10 applied in 25 s, 0 retries counted, no dead
/// letter, 18 handler calls (the slow event's, each followed by "database or dependency
/// unavailable; retrying (does not count as an attempt) error=error communicating with
/// database: expected to read 5 bytes, got 0 bytes at EOF"); throughput mode the same (single
/// handler 31 calls, batch handler 18). Nothing lost or applied twice; the partition waits for
/// good, in both modes. The handler is at fault (it ignored an error), but the runtime cannot
/// see the 25P03 any more and never gives up: the head is never dead-lettered, and no attempt
/// is counted, so `max_attempts` bounds nothing. Cause: only the first statement after the
/// wait receives the 25P03; the runtime reads the code from its own statement or the handler's
/// error, and an I/O error on a session closed while the transaction was idle is taken for an
/// outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known: one at a time stalls for good (3 of 10 applied in 25 s, 0 retries, 18 calls): the swallowed 25P03 leaves the runtime an I/O error, an outage; throughput mode the same"]
async fn one_at_a_time_a_handler_that_swallows_the_idle_error_does_not_stall() {
    let seen = slow_head_run(Form::OneAtATime, Errors::Swallow, Path::Direct, 1500, LIMIT).await;
    moved_on(&seen);
}

/// As above in throughput mode (single-event handler, `max_batch` 64). Measured on b2830b3: 3
/// of 10 applied in 25 s, 0 retries, 31 calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known: stalls for good (3 of 10 applied in 25 s, 0 retries, 31 calls): the swallowed 25P03 leaves the runtime an I/O error, an outage"]
async fn throughput_single_a_handler_that_swallows_the_idle_error_does_not_stall() {
    let seen = slow_head_run(
        Form::ThroughputSingle,
        Errors::Swallow,
        Path::Direct,
        1500,
        LIMIT,
    )
    .await;
    moved_on(&seen);
}

/// As above with a batch handler. Measured on b2830b3: 3 of 10 applied in 25 s, 0 retries, 18
/// calls of sizes [10, 5, 2, 4, 2, 1, 2, 1, 1, …].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known: stalls for good (3 of 10 applied in 25 s, 0 retries, 18 calls): the swallowed 25P03 leaves the runtime an I/O error, an outage"]
async fn throughput_batch_a_handler_that_swallows_the_idle_error_does_not_stall() {
    let seen = slow_head_run(
        Form::ThroughputBatch,
        Errors::Swallow,
        Path::Direct,
        1500,
        LIMIT,
    )
    .await;
    moved_on(&seen);
}

// --- PgBouncer in session mode ---------------------------------------------------------------

/// Guarantee attacked: the partition moves on (the slow event over the DBA's 1 s timeout,
/// handler propagating the error with `?`), with the consumer behind a session-mode PgBouncer
/// (which the docs say works): does the server's 25P03 reach the consumer through the pooler,
/// or only PgBouncer's "server conn crashed?"? Throughput mode, batch handler.
///
/// Held on b2830b3: PgBouncer 1.18 forwards the server's 25P03 before closing the client
/// ("closing because: server conn crashed?" in its log): 9 applied, the slow event
/// dead-lettered after 3 attempts saying the idle timeout, in 15.3 s (calls of sizes
/// [10, 5, 2, 3, 1, 2, 1, 1, 1, 2, 3, 1]); one at a time (below) in 5.0 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_session_pooler_the_dbas_idle_end_is_still_an_attempt() {
    let seen = slow_head_run(
        Form::ThroughputBatch,
        Errors::Chain,
        Path::BouncerDbaTimeout,
        1500,
        LIMIT,
    )
    .await;
    moved_on(&seen);
}

/// As above, one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_behind_a_session_pooler_the_dbas_idle_end_is_still_an_attempt() {
    let seen = slow_head_run(
        Form::OneAtATime,
        Errors::Chain,
        Path::BouncerDbaTimeout,
        1500,
        LIMIT,
    )
    .await;
    moved_on(&seen);
}

/// Guarantee attacked: the partition moves on, with the idle limit set where many operators
/// set it: in PgBouncer (`idle_transaction_timeout = 1`, session mode), not on the database.
/// The slow event (2.5 s outside the database, handler propagating with `?`) has its client
/// connection closed by PgBouncer with its own error, SQLSTATE `08P01` "idle transaction
/// timeout" — class 08, an outage by `database_unavailable`, never an attempt. Throughput
/// mode, batch handler.
///
/// Measured on b2830b3: 3 of 10 applied in 25 s, 0 retries counted, no dead letter, 11 calls
/// of sizes [10, 5, 2, 4, 2, 1, 2, 1, 1, 1, 1]; one at a time (below) 3 applied, 0 retries,
/// 13 calls, each "database or dependency unavailable; retrying (does not count as an
/// attempt) error=error returned from database: idle transaction timeout" (PgBouncer's log:
/// "closing because: idle transaction timeout", "pooler error: idle transaction timeout").
/// The partition waits for good in both modes, the stall b2830b3 fixed for the DBA's timeout,
/// back when the same limit is set in the pooler. Nothing lost or applied twice.
/// Since then: PgBouncer's `08P01` "idle transaction timeout" is read as an idle end
/// (`consumer/src/idle_end.rs`), as PostgreSQL's 25P03.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_pooler_with_its_own_idle_transaction_timeout_the_slow_event_does_not_stall() {
    let seen = slow_head_run(
        Form::ThroughputBatch,
        Errors::Chain,
        Path::BouncerOwnTimeout,
        2500,
        LIMIT,
    )
    .await;
    moved_on(&seen);
}

/// As above, one at a time. Measured on b2830b3: 3 of 10 applied in 25 s, 0 retries, 13 calls.
/// Since then: as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_at_a_time_behind_a_pooler_with_its_own_idle_transaction_timeout_the_slow_event_does_not_stall(
) {
    let seen = slow_head_run(
        Form::OneAtATime,
        Errors::Chain,
        Path::BouncerOwnTimeout,
        2500,
        LIMIT,
    )
    .await;
    moved_on(&seen);
}

// --- A handler that blocks the runtime -------------------------------------------------------

/// What [`blocked_runtime_run`] saw.
#[derive(Debug)]
#[allow(dead_code)] // read through `Debug`
struct Blocked {
    /// Dead letters of the innocent partition's events (their handler waits for nothing).
    innocent_dead: i64,
    /// Of the blocking partition's events (their own handler idled past the timeout).
    blocker_dead: i64,
    innocent_applied: i64,
    /// The innocent partition's stored offset: every record below it finished.
    innocent_offset: i64,
    errors: Vec<String>,
    retries: u64,
    /// Retries counted against innocent events: all retries less the blocking events' (each
    /// of them is retried `max_attempts` − 1 times before its dead letter).
    innocent_retries: i64,
}

/// Two partitions, the DBA's 1 s timeout, `max_attempts` 3, run on a runtime of one worker
/// thread (the test's). Partition 0 (key `blocker`): 4 events whose handler blocks the thread
/// for 1.2 s (`std::thread::sleep`: a synchronous client, a CPU-bound step) — their own
/// transactions idle past the timeout (dead letters they earned). Partition 1 (key `innocent`):
/// 400 events whose handler waits for nothing. Runs until every event is finished or 60 s.
async fn blocked_runtime_run(form: Form, max_attempts: u32) -> Blocked {
    blocked_runtime_run_with(form, max_attempts, false).await
}

/// [`blocked_runtime_run`]; with `trickle` the 400 innocent events are produced one at a time
/// (one per produce call, a live low-rate stream: each poll batch holds one record, so a
/// throughput-mode transaction holds one too), and 8 blocking events instead of 4.
async fn blocked_runtime_run_with(form: Form, max_attempts: u32, trickle: bool) -> Blocked {
    let svc = services().await;
    let db = svc.fresh_db().await;
    effects_table(&db.pool).await;
    sqlx::query(&format!(
        "ALTER DATABASE \"{}\" SET idle_in_transaction_session_timeout = '1s'",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let pool = db.pool_of(6).await;
    let topic = unique("idle_block");
    create_topic(&svc.bootstrap, &topic, 2).await;
    let innocent: Vec<RawRecord> = (0..400)
        .map(|n| job(Uuid::now_v7(), "innocent", json!({"n": 1000 + n})))
        .collect();
    let blockers: usize = if trickle { 8 } else { 4 };
    let producing = if trickle {
        let (bootstrap, topic) = (svc.bootstrap.clone(), topic.clone());
        Some(tokio::spawn(async move {
            for r in innocent.chunks(1) {
                produce(&bootstrap, &topic, Some(1), r).await;
            }
        }))
    } else {
        produce(&svc.bootstrap, &topic, Some(1), &innocent).await;
        None
    };
    let blocker: Vec<RawRecord> = (0..blockers)
        .map(|n| job(Uuid::now_v7(), "blocker", json!({"n": n, "block_ms": 1200})))
        .collect();
    produce(&svc.bootstrap, &topic, Some(0), &blocker).await;
    let mut config = consumer_config(&svc.bootstrap, &unique("g"), CONSUMER);
    config.max_batch = if form == Form::OneAtATime { 1 } else { 64 };
    config.max_attempts = max_attempts;
    let writer = Writer::new(Errors::Chain);
    let builder = Consumer::builder(pool.clone(), config);
    let builder = match form {
        Form::ThroughputBatch => builder.on_batch(&topic, "job", writer.clone()),
        _ => builder.on(&topic, "job", WriterOne(writer.clone())),
    };
    let running = RunningConsumer::start(builder.build().expect("consumer"));
    let stats = running.stats.clone();
    let _ = tokio::time::timeout(Duration::from_secs(if trickle { 90 } else { 60 }), async {
        loop {
            let s = stats.snapshot();
            if s.applied + s.dead_letters >= 400 + blockers as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    running.stop().await;
    pool.close().await;
    if let Some(p) = producing {
        // What is not produced yet is not counted (none lost is checked against the stored
        // offset).
        p.abort();
        let _ = p.await;
    }
    let s = stats.snapshot();
    let (rows, distinct) = effects(&db.pool).await;
    assert_eq!(rows, distinct, "no event applied twice");
    let dead_of = |key: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM postal.dead_letters WHERE record_key = $1::text::bytea",
            )
            .bind(key)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let errors: Vec<String> = sqlx::query_scalar(
        "SELECT left(error, 200) FROM postal.dead_letters WHERE record_key = 'innocent'::bytea
         ORDER BY kafka_offset",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let innocent_applied: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE n >= 1000")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let innocent_offset: i64 = sqlx::query_scalar(
        "SELECT next_offset FROM postal.consumer_offsets WHERE topic = $1 AND partition = 1",
    )
    .bind(&topic)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let b = Blocked {
        innocent_offset,
        innocent_dead: dead_of("innocent").await,
        blocker_dead: dead_of("blocker").await,
        innocent_applied,
        errors,
        retries: s.retries,
        innocent_retries: s.retries as i64 - blockers as i64 * (i64::from(max_attempts) - 1),
    };
    eprintln!(
        "{form:?}: {b:?}, applied {}, dead letters {}",
        s.applied, s.dead_letters
    );
    b
}

/// Guarantee attacked: no innocent event is dead-lettered — one whose own handler did nothing
/// wrong. b2830b3 counts a 25P03 of the head alone as the head's attempt, on the ground that
/// the idle time was its own handler's. But the session is idle whenever the consumer does not
/// send the next statement, whatever holds it up: here another partition's handler blocks the
/// runtime's only worker thread for 1.2 s, so the innocent partition's open transaction cannot
/// send its next statement either. Throughput mode, batch handler, `max_attempts` 3.
///
/// Held on b2830b3: 400 innocent events applied, 0 dead letters of them, 8 retries in all (the
/// 4 blocking events' 2 each: none counted against an innocent event — its partition's
/// transactions held several records, so a 25P03 halved them). A second run: 0 innocent
/// dead letters, but 9 retries: 1 attempt counted against an innocent event (once the
/// halving had brought its transaction down to one record).
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
#[ignore = "known: 0 innocent dead letters in 2 runs, but 1 attempt counted against an innocent event in the second (9 retries, 8 the blocking events'): another partition's blocking handler held the runtime past the DBA's timeout"]
async fn throughput_another_partitions_blocking_handler_dead_letters_no_innocent_event() {
    let b = blocked_runtime_run(Form::ThroughputBatch, 3).await;
    assert_eq!(
        b.innocent_applied + b.innocent_dead,
        b.innocent_offset,
        "none lost: {b:?}"
    );
    assert_eq!(b.innocent_dead, 0, "innocent dead letters: {b:?}");
    assert_eq!(
        b.innocent_retries, 0,
        "attempts counted against innocent events: {b:?}"
    );
}

/// As above, one at a time, `max_attempts` 3; also no attempt counted against an innocent
/// event. Measured on b2830b3 (two runs): run 1, 400 innocent applied, 0 dead, but 14 retries
/// in all: 6 attempts counted against innocent events (8 are the blocking events'); run 2, an
/// innocent event dead-lettered — "gave up after 3 attempts: the server ended the
/// transaction's session: it sat idle longer than the database's
/// idle_in_transaction_session_timeout (a handler waiting outside the database inside its
/// transaction?)" — its handler waits for nothing (399 applied, 4 more innocent retries). The
/// 25P03 says the session sat idle, not whose the idle time was: here the runtime's, held up
/// by another partition's handler. (One at a time counted a 25P03 as an attempt before
/// b2830b3 too: a handler's `?` made it retryable.)
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
#[ignore = "known: an innocent event dead-lettered in 1 of 2 runs ('gave up after 3 attempts: … idle_in_transaction_session_timeout'), 6 and 4 attempts counted against innocent events: another partition's blocking handler held the runtime past the DBA's timeout"]
async fn one_at_a_time_another_partitions_blocking_handler_dead_letters_no_innocent_event() {
    let b = blocked_runtime_run(Form::OneAtATime, 3).await;
    assert_eq!(
        b.innocent_applied + b.innocent_dead,
        b.innocent_offset,
        "none lost: {b:?}"
    );
    assert_eq!(b.innocent_dead, 0, "innocent dead letters: {b:?}");
    assert_eq!(
        b.innocent_retries, 0,
        "attempts counted against innocent events: {b:?}"
    );
}

/// As above with `max_attempts` 2 (a strict consumer: one retry), where an innocent event's
/// first strike is a retry and its second a dead letter. One at a time. Measured on b2830b3:
/// 400 innocent applied, 0 dead, 3 attempts counted against innocent events (7 retries, 4 the
/// blocking events').
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
#[ignore = "known: 3 attempts counted against innocent events (7 retries, 4 of them the blocking events'), none dead-lettered in that run: another partition's blocking handler held the runtime past the DBA's timeout"]
async fn one_at_a_time_with_two_attempts_another_partitions_blocking_handler_dead_letters_no_innocent_event(
) {
    let b = blocked_runtime_run(Form::OneAtATime, 2).await;
    assert_eq!(
        b.innocent_applied + b.innocent_dead,
        b.innocent_offset,
        "none lost: {b:?}"
    );
    assert_eq!(b.innocent_dead, 0, "innocent dead letters: {b:?}");
    assert_eq!(
        b.innocent_retries, 0,
        "attempts counted against innocent events: {b:?}"
    );
}

/// As above (`max_attempts` 2), throughput mode, single-event handler (`max_batch` 64). Held
/// on b2830b3: 400 innocent applied, 0 dead, 4 retries (all the blocking events'): the innocent
/// partition's transactions held several records (400 queued), so each 25P03 halved them.
/// Broke in a later run (after SessionEnded, under load): 400 applied, 0 dead, but 1 attempt
/// counted against an innocent event (5 retries) — the known class above.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
#[ignore = "known: 1 attempt counted against an innocent event in 1 of 3 runs (400 applied, 0 dead): another partition's blocking handler held the runtime past the DBA's timeout"]
async fn throughput_with_two_attempts_another_partitions_blocking_handler_dead_letters_no_innocent_event(
) {
    let b = blocked_runtime_run(Form::ThroughputSingle, 2).await;
    assert_eq!(
        b.innocent_applied + b.innocent_dead,
        b.innocent_offset,
        "none lost: {b:?}"
    );
    assert_eq!(b.innocent_dead, 0, "innocent dead letters: {b:?}");
    assert_eq!(
        b.innocent_retries, 0,
        "attempts counted against innocent events: {b:?}"
    );
}

/// As above (`max_attempts` 2, throughput mode, single-event handler), the innocent events
/// arriving one at a time (a live, low-rate stream, as most are): each poll batch holds one
/// record, so the innocent partition's transactions hold one and a 25P03 is the head's
/// attempt, as one at a time; 8 blocking events.
///
/// Measured on b2830b3: 3 innocent events dead-lettered ("gave up after 2 attempts: the
/// server ended the transaction's session: it sat idle longer than the database's
/// idle_in_transaction_session_timeout (a handler waiting outside the database inside its
/// transaction?)"), their handler waiting for nothing, beside 119 applied when the 90 s were
/// up (the trickle is slow on a blocked runtime); a second run the same: 3 innocent dead
/// letters, 82 applied, stored offset 85 (none lost); the 8 blocking events dead-lettered as
/// they should be. The server's 25P03 says the session sat idle, not that the event's handler
/// idled: a runtime held up (another partition's synchronous call, CPU starvation, a
/// stop-the-world pause of the process) idles every open transaction at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
#[ignore = "known: throughput mode on a live stream dead-lettered 3 innocent events (gave up after 2 attempts: … idle_in_transaction_session_timeout) when another partition's handler blocked the runtime 1.2 s at a time"]
async fn throughput_live_stream_another_partitions_blocking_handler_dead_letters_no_innocent_event()
{
    let b = blocked_runtime_run_with(Form::ThroughputSingle, 2, true).await;
    assert_eq!(
        b.innocent_applied + b.innocent_dead,
        b.innocent_offset,
        "none lost: {b:?}"
    );
    assert_eq!(b.innocent_dead, 0, "innocent dead letters: {b:?}");
    assert_eq!(
        b.innocent_retries, 0,
        "attempts counted against innocent events: {b:?}"
    );
}
