//! Attacks on the WAL relay's chunks set aside while their acknowledgements are slow (commit
//! 45a4512, `producer/src/wal/aside.rs`): a slow chunk whose keys have later rows in later
//! stream batches, a failure inside a chunk aside, a chunk aside whose transaction's session
//! ends (its idle timeout, half the lease, passes while the acknowledgements are slow), the
//! replication session ending with a chunk aside, a graceful stop with a chunk aside,
//! keep-published and history modes, a row of another key locked by a foreign session.
//!
//! The transport ([`Gate`]) logs every event at handover, with the outcome it will give, in
//! the order it was handed over (the order a broker would hold the records in). From the log:
//! no event lost (each acknowledged at least once), and per key the first acknowledged
//! publications in enqueue order.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use postal_integration_tests::{services, unique, wait, TestDb};
use postal_producer::{
    enqueue, FailureKind, NewEvent, OutboundEvent, PublishError, RelayConfig, Transport,
};
use sqlx::PgPool;

use crate::common::{outbox_count, RunningRelay};
use crate::wal_relay::Slot;

/// A transport whose behaviour each event's type chooses:
/// - `stuck`: the first send of it is acknowledged (Ok) only once the test releases it;
/// - `stuckfail`: the first send of it waits for the release, then fails (transient);
/// - `flaky`: the first send of it fails at once (transient);
/// - anything else: acknowledged after 5 ms.
///
/// As a transport must, nothing of a key after its failed event in a batch goes out (held
/// back). Every batch handed over and every batch recorded (`Transport::recorded`) is counted
/// by its first event's id.
#[derive(Clone)]
struct Gate(Arc<Inner>);

struct Inner {
    /// At handover, in order: (key, event id, acknowledged Ok).
    log: Mutex<Vec<(String, String, bool)>>,
    stuck_once: Mutex<HashSet<String>>,
    flaky_once: Mutex<HashSet<String>>,
    /// First event id of each batch handed over / recorded, with multiplicity.
    handed: Mutex<HashMap<String, usize>>,
    recorded: Mutex<HashMap<String, usize>>,
    /// Stuck batches handed over so far.
    stuck_sent: AtomicUsize,
    release: tokio::sync::Semaphore,
}

impl Gate {
    fn new() -> Self {
        Gate(Arc::new(Inner {
            log: Default::default(),
            stuck_once: Default::default(),
            flaky_once: Default::default(),
            handed: Default::default(),
            recorded: Default::default(),
            stuck_sent: AtomicUsize::new(0),
            release: tokio::sync::Semaphore::new(0),
        }))
    }

    /// Lets every stuck batch (now and later) go.
    fn release(&self) {
        self.0.release.add_permits(1 << 20);
    }

    fn stuck_sent(&self) -> usize {
        self.0.stuck_sent.load(Ordering::SeqCst)
    }

    /// Events acknowledged so far (with duplicates).
    fn acked(&self) -> usize {
        self.0.log.lock().unwrap().iter().filter(|e| e.2).count()
    }

    fn acked_ids(&self) -> HashSet<String> {
        self.0
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.2)
            .map(|e| e.1.clone())
            .collect()
    }

    /// Batches handed over that the relay never recorded (nor gave up by `recorded`).
    fn unrecorded(&self) -> Vec<(String, usize, usize)> {
        let handed = self.0.handed.lock().unwrap().clone();
        let recorded = self.0.recorded.lock().unwrap().clone();
        let mut out: Vec<_> = handed
            .into_iter()
            .filter_map(|(id, n)| {
                let r = recorded.get(&id).copied().unwrap_or(0);
                (r < n).then_some((id, n, r))
            })
            .collect();
        out.sort();
        out
    }

    /// Per key, events lost (never acknowledged) and first publications out of enqueue order.
    fn verdict(&self, expected: &BTreeMap<String, Vec<String>>) -> (Vec<String>, Vec<String>) {
        let log = self.0.log.lock().unwrap().clone();
        let mut first: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut seen = HashSet::new();
        for (k, id, ok) in &log {
            if *ok && seen.insert(id.clone()) {
                first.entry(k.clone()).or_default().push(id.clone());
            }
        }
        let mut lost = Vec::new();
        let mut reordered = Vec::new();
        for (k, ids) in expected {
            for id in ids {
                if !seen.contains(id) {
                    lost.push(format!("{k}/{id}"));
                }
            }
            let pos: HashMap<&String, usize> =
                ids.iter().enumerate().map(|(i, s)| (s, i)).collect();
            let got: Vec<usize> = first
                .get(k)
                .map(|v| v.iter().filter_map(|s| pos.get(s).copied()).collect())
                .unwrap_or_default();
            if got.windows(2).any(|w| w[0] > w[1]) {
                reordered.push(format!("{k}: first publications by enqueue index {got:?}"));
            }
        }
        (lost, reordered)
    }
}

impl Transport for Gate {
    type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        if let Some(e) = batch.first() {
            *self
                .0
                .handed
                .lock()
                .unwrap()
                .entry(e.id.to_string())
                .or_insert(0) += 1;
        }
        let mut out = Vec::with_capacity(batch.len());
        let mut failed: HashSet<&str> = HashSet::new();
        let mut stuck = false;
        for e in batch {
            let id = e.id.to_string();
            let outcome = if failed.contains(e.key.as_str()) {
                Err(PublishError::new(FailureKind::HeldBack, "held back"))
            } else {
                match e.event_type.as_str() {
                    "stuck" if self.0.stuck_once.lock().unwrap().insert(id.clone()) => {
                        stuck = true;
                        Ok(())
                    }
                    "stuckfail" if self.0.stuck_once.lock().unwrap().insert(id.clone()) => {
                        stuck = true;
                        Err(PublishError::new(
                            FailureKind::Transient,
                            "slow, then failed",
                        ))
                    }
                    "flaky" if self.0.flaky_once.lock().unwrap().insert(id.clone()) => {
                        Err(PublishError::new(FailureKind::Transient, "flaky"))
                    }
                    _ => Ok(()),
                }
            };
            if outcome.is_err() {
                failed.insert(e.key.as_str());
            }
            self.0
                .log
                .lock()
                .unwrap()
                .push((e.key.clone(), id, outcome.is_ok()));
            out.push(outcome);
        }
        if stuck {
            self.0.stuck_sent.fetch_add(1, Ordering::SeqCst);
        }
        let inner = self.0.clone();
        async move {
            if stuck {
                let _permit = inner.release.acquire().await.unwrap();
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            out
        }
        .boxed()
    }

    fn recorded(&self, batch: &[OutboundEvent], _committed: bool) {
        if let Some(e) = batch.first() {
            *self
                .0
                .recorded
                .lock()
                .unwrap()
                .entry(e.id.to_string())
                .or_insert(0) += 1;
        }
    }
}

/// Enqueues, one transaction each, `(key, type)` in order; per key the event ids in order.
async fn enqueue_each(
    pool: &PgPool,
    topic: &str,
    events: &[(String, &str)],
    into: &mut BTreeMap<String, Vec<String>>,
) {
    for (i, (key, ty)) in events.iter().enumerate() {
        let mut tx = pool.begin().await.unwrap();
        let id = enqueue(
            &mut tx,
            NewEvent::json(topic, key.as_str(), *ty, &i).unwrap(),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        into.entry(key.clone()).or_default().push(id.to_string());
    }
}

/// `rounds` rounds over `keys` keys; `special(round, key)` names a type other than `ok`.
fn plan(
    keys: usize,
    rounds: usize,
    special: impl Fn(usize, usize) -> Option<&'static str>,
) -> Vec<(String, &'static str)> {
    let mut v = Vec::new();
    for r in 0..rounds {
        for k in 0..keys {
            v.push((format!("k{k}"), special(r, k).unwrap_or("ok")));
        }
    }
    v
}

fn wal_config(slot: &Slot, batch: usize, in_flight: usize) -> RelayConfig {
    slot.config()
        .batch_size(batch)
        .max_in_flight_batches(in_flight)
        .lanes(1)
        .max_attempts(100)
}

/// Waits until the stuck batch was handed over and, after it, at least `more` other events
/// were acknowledged (the chunk is aside, other keys go on).
async fn wait_aside(gate: &Gate, more: usize) {
    wait::until(
        Duration::from_secs(30),
        "a stuck chunk handed over",
        || async { gate.stuck_sent() > 0 },
    )
    .await;
    let at = gate.acked();
    wait::until(
        Duration::from_secs(30),
        "other keys going on beside the chunk aside",
        || async { gate.acked() >= at + more },
    )
    .await;
}

async fn drained(db: &TestDb, within: Duration) {
    wait::until(within, "the outbox drained", || async {
        outbox_count(&db.pool).await == 0
    })
    .await;
}

fn assert_clean(gate: &Gate, expected: &BTreeMap<String, Vec<String>>, what: &str) {
    let (lost, reordered) = gate.verdict(expected);
    assert!(
        lost.is_empty() && reordered.is_empty(),
        "{what}: lost {lost:?}; out of order {reordered:?}"
    );
}

/// Guarantee: a chunk aside (acknowledgements held) whose key has later rows in later stream
/// batches (one transaction per event), and a transient failure of another key while it is
/// aside: no event is lost, each key's first publications come in enqueue order, and the other
/// keys go on while the chunk is aside.
#[tokio::test]
async fn a_slow_chunk_with_later_rows_in_later_batches_keeps_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("aside-later");
    let mut expected = BTreeMap::new();
    let events = plan(6, 12, |r, k| match (r, k) {
        (1, 0) => Some("stuck"),
        (3, 1) => Some("flaky"),
        _ => None,
    });
    enqueue_each(&db.pool, &topic, &events[..12], &mut expected).await;
    let gate = Gate::new();
    let relay = RunningRelay::start(&db.pool, gate.clone(), wal_config(&slot, 3, 4));
    // Later rows of the stuck key (and others) in later stream batches.
    enqueue_each(&db.pool, &topic, &events[12..], &mut expected).await;
    wait_aside(&gate, 10).await;
    gate.release();
    drained(&db, Duration::from_secs(60)).await;
    relay.stop().await;
    assert_clean(&gate, &expected, "slow chunk, later rows");
}

/// Guarantee: a chunk aside whose held event then fails (transient) leaves its key's later
/// rows (carried behind it, in later stream batches) behind the retry: nothing lost, per key
/// first publications in enqueue order.
#[tokio::test]
async fn a_failure_inside_a_chunk_aside_holds_its_keys_later_rows() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("aside-fail");
    let mut expected = BTreeMap::new();
    let events = plan(5, 4, |r, k| match (r, k) {
        (0, 2) => Some("stuckfail"),
        (2, 3) => Some("stuckfail"),
        _ => None,
    });
    enqueue_each(&db.pool, &topic, &events[..8], &mut expected).await;
    let gate = Gate::new();
    let relay = RunningRelay::start(&db.pool, gate.clone(), wal_config(&slot, 2, 4));
    enqueue_each(&db.pool, &topic, &events[8..], &mut expected).await;
    // The second slow-then-failed row may share a chunk with the first one's keys (then it
    // waits behind it): only the first is waited for.
    wait_aside(&gate, 3).await;
    gate.release();
    drained(&db, Duration::from_secs(60)).await;
    relay.stop().await;
    assert_clean(&gate, &expected, "failure inside a chunk aside");
}

/// Guarantee: a chunk aside whose transaction's session ends while its acknowledgements are
/// slow (its `idle_in_transaction_session_timeout`, half the 3 s lease, passes) cannot be
/// marked; its rows are published again, ahead of their keys' later rows: nothing lost, per key
/// first publications in enqueue order, and the outbox drains.
#[tokio::test]
async fn a_chunk_aside_whose_session_timed_out_is_published_again_in_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("aside-idle");
    let mut expected = BTreeMap::new();
    let events = plan(4, 10, |r, k| match (r, k) {
        (0, 0) => Some("stuck"),
        _ => None,
    });
    enqueue_each(&db.pool, &topic, &events[..4], &mut expected).await;
    let gate = Gate::new();
    let relay = RunningRelay::start(&db.pool, gate.clone(), wal_config(&slot, 2, 3));
    enqueue_each(&db.pool, &topic, &events[4..], &mut expected).await;
    wait_aside(&gate, 5).await;
    let stuck_id = expected["k0"][0].clone();
    // The chunk's session ends by its idle timeout: its row is pending and unlocked again.
    wait::until(
        Duration::from_secs(30),
        "the chunk aside's session ended (its row unlocked)",
        || async {
            let mut tx = db.pool.begin().await.unwrap();
            let free: Option<i64> = sqlx::query_scalar(
                "SELECT seq FROM postal.outbox WHERE event_id::text = $1 AND status = 'pending' \
                 FOR UPDATE SKIP LOCKED",
            )
            .bind(&stuck_id)
            .fetch_optional(&mut *tx)
            .await
            .unwrap();
            tx.rollback().await.unwrap();
            free.is_some()
        },
    )
    .await;
    gate.release();
    drained(&db, Duration::from_secs(60)).await;
    relay.stop().await;
    assert_clean(&gate, &expected, "chunk aside, session timed out");
}

/// Guarantee: the replication session ending (its walsender terminated) while a chunk is
/// aside gives the chunk up: nothing lost, per key first publications in enqueue order, and —
/// as `Transport::recorded` promises a transport (the Kafka transport's key fence releases a
/// batch's keys only then) — every batch handed over is recorded or given up through
/// `recorded`.
#[tokio::test]
async fn the_replication_session_ending_with_a_chunk_aside_records_or_gives_it_up() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("aside-walsender");
    let mut expected = BTreeMap::new();
    let events = plan(4, 8, |r, k| match (r, k) {
        (0, 1) => Some("stuck"),
        _ => None,
    });
    enqueue_each(&db.pool, &topic, &events[..8], &mut expected).await;
    let gate = Gate::new();
    let relay = RunningRelay::start(&db.pool, gate.clone(), wal_config(&slot, 2, 4));
    wait_aside(&gate, 3).await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots \
         WHERE slot_name = $1 AND active_pid IS NOT NULL",
    )
    .bind(&slot.source.slot)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "the relay's walsender");
    enqueue_each(&db.pool, &topic, &events[8..], &mut expected).await;
    drained(&db, Duration::from_secs(60)).await;
    gate.release();
    relay.stop().await;
    assert_clean(&gate, &expected, "walsender ended with a chunk aside");
    let unrecorded = gate.unrecorded();
    assert!(
        unrecorded.is_empty(),
        "batches handed over and never recorded nor given up (first id, sent, recorded): {unrecorded:?}"
    );
}

/// Guarantee: a graceful stop with a chunk aside whose acknowledgements do not come within
/// the shutdown timeout gives it up unconfirmed; a new relay publishes it and everything
/// after it: nothing lost, per key first publications in enqueue order.
#[tokio::test]
async fn a_graceful_stop_with_a_chunk_aside_loses_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("aside-stop");
    let mut expected = BTreeMap::new();
    let events = plan(4, 8, |r, k| match (r, k) {
        (0, 0) => Some("stuck"),
        _ => None,
    });
    enqueue_each(&db.pool, &topic, &events, &mut expected).await;
    let gate = Gate::new();
    let cfg = wal_config(&slot, 2, 4).shutdown_timeout(Duration::from_secs(1));
    let relay = RunningRelay::start(&db.pool, gate.clone(), cfg.clone());
    wait_aside(&gate, 3).await;
    relay.stop().await;
    gate.release();
    let relay = RunningRelay::start(&db.pool, gate.clone(), cfg);
    drained(&db, Duration::from_secs(60)).await;
    relay.stop().await;
    assert_clean(&gate, &expected, "graceful stop with a chunk aside");
}

/// Guarantee: with keep-published (`delete_on_publish = false`) and, separately, history mode,
/// a chunk aside and a failure beside it: nothing lost, per key first publications in enqueue
/// order, every row marked published (kept) or archived (history).
#[tokio::test]
async fn keep_published_and_history_with_a_chunk_aside() {
    for history in [false, true] {
        let svc = services().await;
        let db = svc.fresh_db().await;
        let slot = Slot::create(&db).await;
        let topic = unique("aside-keep");
        let mut expected = BTreeMap::new();
        let events = plan(5, 8, |r, k| match (r, k) {
            (1, 0) => Some("stuck"),
            (2, 2) => Some("flaky"),
            _ => None,
        });
        enqueue_each(&db.pool, &topic, &events[..10], &mut expected).await;
        let gate = Gate::new();
        let cfg = if history {
            wal_config(&slot, 3, 4).history(Some(Duration::from_secs(3 * 86_400)))
        } else {
            wal_config(&slot, 3, 4).delete_on_publish(false)
        };
        let relay = RunningRelay::start(&db.pool, gate.clone(), cfg);
        enqueue_each(&db.pool, &topic, &events[10..], &mut expected).await;
        wait_aside(&gate, 6).await;
        gate.release();
        wait::until(Duration::from_secs(60), "every row done", || async {
            let pending: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM postal.outbox WHERE status <> 'published'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            pending == 0
        })
        .await;
        relay.stop().await;
        assert_clean(
            &gate,
            &expected,
            if history { "history" } else { "keep-published" },
        );
        if history {
            let archived: i64 =
                sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM postal.outbox_history")
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            assert_eq!(archived, events.len() as i64, "every event archived once");
        }
    }
}

/// Guarantee: with one or two batches in flight (`max_in_flight_batches` 1 and 2) and chunks
/// of one row, a stuck chunk, a slow-then-failed one and a flaky row, each with its key's later
/// rows: nothing lost, per key first publications in order.
#[tokio::test]
async fn one_or_two_in_flight_and_chunks_of_one_with_a_chunk_aside() {
    for in_flight in [1, 2] {
        let svc = services().await;
        let db = svc.fresh_db().await;
        let slot = Slot::create(&db).await;
        let topic = unique("aside-one");
        let mut expected = BTreeMap::new();
        let events = plan(3, 8, |r, k| match (r, k) {
            (0, 1) => Some("stuck"),
            (2, 2) => Some("stuckfail"),
            (3, 0) => Some("flaky"),
            _ => None,
        });
        enqueue_each(&db.pool, &topic, &events[..6], &mut expected).await;
        let gate = Gate::new();
        let relay = RunningRelay::start(&db.pool, gate.clone(), wal_config(&slot, 1, in_flight));
        enqueue_each(&db.pool, &topic, &events[6..], &mut expected).await;
        wait::until(Duration::from_secs(30), "a stuck chunk", || async {
            gate.stuck_sent() > 0
        })
        .await;
        gate.release();
        drained(&db, Duration::from_secs(60)).await;
        relay.stop().await;
        assert_clean(
            &gate,
            &expected,
            &format!("{in_flight} in flight, chunks of one"),
        );
    }
}

/// Guarantee: a chunk aside plus a row of another key locked by a foreign session (busy,
/// carried with its key's later rows) plus the sweep beside them: once the lock and the
/// acknowledgements come, nothing lost, per key first publications in enqueue order.
#[tokio::test]
async fn a_chunk_aside_beside_a_row_locked_by_a_foreign_session() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("aside-busy");
    let mut expected = BTreeMap::new();
    let events = plan(4, 8, |r, k| match (r, k) {
        (0, 0) => Some("stuck"),
        _ => None,
    });
    // The foreign session locks k1's second row before the relay starts.
    enqueue_each(&db.pool, &topic, &events[..8], &mut expected).await;
    let locked_id = expected["k1"][1].clone();
    let mut foreign = db.pool.begin().await.unwrap();
    sqlx::query("SELECT seq FROM postal.outbox WHERE event_id::text = $1 FOR UPDATE")
        .bind(&locked_id)
        .fetch_one(&mut *foreign)
        .await
        .unwrap();
    let gate = Gate::new();
    let relay = RunningRelay::start(&db.pool, gate.clone(), wal_config(&slot, 2, 4));
    enqueue_each(&db.pool, &topic, &events[8..], &mut expected).await;
    wait_aside(&gate, 6).await;
    foreign.rollback().await.unwrap();
    gate.release();
    drained(&db, Duration::from_secs(60)).await;
    relay.stop().await;
    assert_clean(&gate, &expected, "chunk aside beside a busy row");
}

/// Guarantee: the slot's lease lost (taken by another holder) while a chunk is aside, then
/// given back (expired): the relay takes it again and publishes the chunk's rows and their
/// keys' later rows: nothing lost, per key first publications in enqueue order. Then, as
/// `Transport::recorded` promises, every batch handed over was recorded or given up.
#[tokio::test]
async fn the_lease_lost_with_a_chunk_aside_then_regained_keeps_order() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("aside-lease");
    let mut expected = BTreeMap::new();
    let events = plan(4, 8, |r, k| match (r, k) {
        (0, 2) => Some("stuck"),
        _ => None,
    });
    enqueue_each(&db.pool, &topic, &events[..8], &mut expected).await;
    let gate = Gate::new();
    let relay = RunningRelay::start(&db.pool, gate.clone(), wal_config(&slot, 2, 4));
    wait_aside(&gate, 3).await;
    let taken = sqlx::query(
        "UPDATE postal.wal_slot_leases
         SET holder = gen_random_uuid(), token = token + 1, lease_until = now() + interval '1 hour'
         WHERE slot_name = $1",
    )
    .bind(&slot.source.slot)
    .execute(&db.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(taken, 1, "the relay held the slot's lease");
    enqueue_each(&db.pool, &topic, &events[8..], &mut expected).await;
    // The relay lets go of its walsender once it knows it lost the lease.
    wait::until(Duration::from_secs(30), "the walsender ended", || async {
        let active: bool =
            sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&slot.source.slot)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        !active
    })
    .await;
    sqlx::query(
        "UPDATE postal.wal_slot_leases SET lease_until = now() - interval '1 second' \
         WHERE slot_name = $1",
    )
    .bind(&slot.source.slot)
    .execute(&db.pool)
    .await
    .unwrap();
    drained(&db, Duration::from_secs(60)).await;
    gate.release();
    relay.stop().await;
    assert_clean(&gate, &expected, "lease lost with a chunk aside");
    let unrecorded = gate.unrecorded();
    assert!(
        unrecorded.is_empty(),
        "batches handed over and never recorded nor given up (first id, sent, recorded): {unrecorded:?}"
    );
}

/// Guarantee (liveness, what the set-aside is for): one chunk whose acknowledgements are slow
/// does not stop the other keys, even when its key is hot (many later rows behind it in later
/// stream batches: more than `carry_max`, 4 × batch_size, of them).
#[tokio::test]
async fn a_hot_key_behind_a_chunk_aside_does_not_stop_the_other_keys() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("aside-hot");
    let mut expected = BTreeMap::new();
    // k0 is hot: its first row is stuck, then two of its rows for each row of another key.
    let mut events = vec![("k0".to_owned(), "stuck")];
    for r in 0..15 {
        events.push(("k0".to_owned(), "ok"));
        events.push(("k0".to_owned(), "ok"));
        events.push((format!("k{}", 1 + r % 3), "ok"));
    }
    enqueue_each(&db.pool, &topic, &events, &mut expected).await;
    let gate = Gate::new();
    let relay = RunningRelay::start(&db.pool, gate.clone(), wal_config(&slot, 2, 4));
    let others: Vec<String> = expected
        .iter()
        .filter(|(k, _)| k.as_str() != "k0")
        .flat_map(|(_, ids)| ids.clone())
        .collect();
    wait::until(Duration::from_secs(30), "a stuck chunk", || async {
        gate.stuck_sent() > 0
    })
    .await;
    let went_on = {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let acked = gate.acked_ids();
            if others.iter().all(|id| acked.contains(id)) {
                break true;
            }
            if std::time::Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let acked_others = {
        let acked = gate.acked_ids();
        others.iter().filter(|id| acked.contains(*id)).count()
    };
    gate.release();
    drained(&db, Duration::from_secs(60)).await;
    relay.stop().await;
    assert_clean(&gate, &expected, "hot key behind a chunk aside");
    assert!(
        went_on,
        "while the hot key's chunk was aside for 20 s, only {acked_others} of the other keys' {} events were published",
        others.len()
    );
}
