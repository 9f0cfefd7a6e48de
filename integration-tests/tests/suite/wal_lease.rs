//! One WAL relay per slot (docs/wal-relay.md "One reader per slot"): the slot's lease
//! (`postal.wal_slot_leases`), a standby's takeover, and the fence on a holder that lost it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt;
use postal_integration_tests::kafka::{read_all, Record};
use postal_integration_tests::{services, unique, wait, TestDb};
use postal_producer::{enqueue, KafkaTransport, NewEvent, OutboundEvent, PublishError, Transport};
use sqlx::PgPool;
use tokio::sync::Notify;

use crate::common::{kafka_transport, RunningRelay};
use crate::procs::{bin_dir, Proc};
use crate::wal_relay::{enqueue_each, outbox_pending, Slot};

/// A transport that publishes to Kafka and, once the broker acknowledged its first batch,
/// says so and holds the outcome until told to go on: the relay is between the ack and its
/// marks.
struct HeldAfterAck {
    inner: KafkaTransport,
    first: AtomicBool,
    acked: Arc<Notify>,
    go: Arc<Notify>,
}

impl Transport for HeldAfterAck {
    type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        let acks = self.inner.send(batch).await;
        if self.first.swap(false, Ordering::SeqCst) {
            let (acked, go) = (self.acked.clone(), self.go.clone());
            return async move {
                let outcomes = acks.await;
                acked.notify_one();
                go.notified().await;
                outcomes
            }
            .boxed();
        }
        acks
    }

    fn recorded(&self, batch: &[OutboundEvent], committed: bool) {
        self.inner.recorded(batch, committed);
    }
}

/// Guarantee: a WAL relay whose slot lease was taken by another relay (its token raised, as a
/// standby's takeover does) while a batch of it was between the broker's ack and its marks
/// marks nothing: the marking transaction checks the token before it commits and rolls back,
/// the rows stay pending for the new holder, the slot is not confirmed past them, and the
/// relay stops streaming. Before the lease, the relay marked (deleted) the rows whatever
/// another relay had done meanwhile.
#[tokio::test]
async fn a_relay_that_lost_the_slot_lease_marks_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-lease-fence");
    let (_, before_last_commit) = enqueue_each(&db.pool, &topic, "k", 5).await;
    let (acked, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let transport = HeldAfterAck {
        inner: kafka_transport(&svc.bootstrap),
        first: AtomicBool::new(true),
        acked: acked.clone(),
        go: go.clone(),
    };
    let relay = RunningRelay::start(&db.pool, transport, slot.config());
    acked.notified().await;
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
    go.notify_one();
    // The relay stops streaming once it knows it lost the lease.
    wait::until(
        Duration::from_secs(30),
        "the relay to stop streaming",
        || async {
            let active: Option<bool> =
                sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                    .bind(&slot.source.slot)
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            active == Some(false)
        },
    )
    .await;
    let stats = relay.stop().await;
    assert_eq!(stats.published, 0, "no row counted as published");
    assert_eq!(
        outbox_pending(&db.pool).await,
        5,
        "the rows are still pending for the new holder"
    );
    assert!(
        slot.confirmed(&db.pool).await < before_last_commit,
        "the slot was not confirmed past the batch"
    );
}

/// Enqueues events of keys `k0`..`k3` in turn, one per transaction, until `stop`; returns
/// their ids.
pub(crate) async fn write_until(pool: PgPool, topic: String, stop: Arc<AtomicBool>) -> Vec<String> {
    let mut ids = Vec::new();
    let mut i = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let mut tx = pool.begin().await.unwrap();
        let id = enqueue(
            &mut tx,
            NewEvent::json(topic.as_str(), format!("k{}", i % 4), "e", &i).unwrap(),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        ids.push(id.to_string());
        i += 1;
        // A steady flow, not a flood: the test's point is the handover, not throughput.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    ids
}

/// Every id in `want` is in `records`, and per key the first copies of the ids come in
/// `ce_postalseq` order. Returns the number of duplicate records.
fn check_delivery(records: &[Record], want: &[String]) -> usize {
    let mut seen = BTreeSet::new();
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    let mut duplicates = 0;
    for r in records {
        let id = r.header("ce_id").unwrap().to_owned();
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let seq: i64 = r.header("ce_postalseq").unwrap().parse().unwrap();
        let key = r.key.clone().unwrap();
        if let Some(prev) = last.insert(key.clone(), seq) {
            assert!(
                prev < seq,
                "key {key}: seq {seq} first seen after {prev} (partition {} offset {})",
                r.partition,
                r.offset
            );
        }
    }
    let missing: Vec<&String> = want.iter().filter(|id| !seen.contains(*id)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} events never published: {:?}",
        missing.len(),
        want.len(),
        &missing[..missing.len().min(5)]
    );
    duplicates
}

pub(crate) const LEASE_SECS: u64 = 4;

/// A WAL relay process (`postal relay --read-from wal`) on the test's slot, with a 4 s lease
/// and a delivery timeout under half of it; its log in a folder named after `test` and the
/// database. Not started.
pub(crate) fn wal_relay_proc(
    db: &TestDb,
    slot: &Slot,
    bootstrap: &str,
    test: &str,
    name: &str,
) -> Proc {
    let dir = bin_dir();
    let logs = dir.join(format!("{test}-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let lease = format!("{LEASE_SECS}s");
    let args = [
        "relay",
        "--read-from",
        "wal",
        "--wal-slot",
        &slot.source.slot,
        "--wal-publication",
        &slot.source.publication,
        "--lease",
        &lease,
        "--kafka",
        "message.timeout.ms=1500",
    ];
    let env = [
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.to_owned()),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ];
    // A killed relay stays down (the standby is the one to take over).
    Proc::new(&dir, &logs, name, "postal", &args)
        .env(&env)
        .restart_after(Duration::from_secs(3600), Duration::ZERO)
}

/// Two WAL relay processes on the slot ([`wal_relay_proc`]). The first is the holder once
/// it logged so, the second stands by.
async fn two_relays(db: &TestDb, slot: &Slot, test: &str) -> (Proc, Proc) {
    let bootstrap = services().await.bootstrap.clone();
    let mut a = wal_relay_proc(db, slot, &bootstrap, test, "relay-a");
    let mut b = wal_relay_proc(db, slot, &bootstrap, test, "relay-b");
    a.start();
    a.await_log("WAL relay: holding the", Duration::from_secs(30))
        .await;
    b.start();
    b.await_log("WAL relay: standing by", Duration::from_secs(30))
        .await;
    (a, b)
}

/// The outbox's last `seq` taken.
async fn last_seq(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('postal.outbox', 'seq')), 0)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until the 50 rows enqueued after the ones already enqueued now are published (gone
/// from the outbox), with everything before them.
pub(crate) async fn await_progress(pool: &PgPool, what: &str) {
    let start = last_seq(pool).await;
    wait::until(Duration::from_secs(60), what, || async {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE seq <= $1 + 50")
                .bind(start)
                .fetch_one(pool)
                .await
                .unwrap();
        left == 0 && last_seq(pool).await > start + 50
    })
    .await;
}

/// Stops the writer, waits for the outbox to drain, reads the topic and checks delivery.
pub(crate) async fn finish(
    db: &TestDb,
    bootstrap: &str,
    topic: &str,
    stop: Arc<AtomicBool>,
    writer: tokio::task::JoinHandle<Vec<String>>,
) -> (usize, usize) {
    stop.store(true, Ordering::SeqCst);
    let ids = writer.await.unwrap();
    wait::until(Duration::from_secs(60), "the outbox drained", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    let records = read_all(bootstrap, topic, ids.len(), Duration::from_secs(60)).await;
    let duplicates = check_delivery(&records, &ids);
    (ids.len(), duplicates)
}

/// Guarantee: when the WAL relay holding the slot is killed (kill -9) while events flow, the
/// standby takes the slot over and publishes within the lease plus 5 s, and every event is
/// published, per key in commit order by first copy. Before the lease there was no standby:
/// a second relay failed to start streaming (slot active) and retried with backoff, with
/// nothing bounding when it took over nor keeping two relays from reading in turn.
#[tokio::test]
async fn a_standby_takes_the_slot_over_from_a_killed_relay() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-lease-kill");
    let (mut a, mut b) = two_relays(&db, &slot, "wal-lease-kill").await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(write_until(db.pool.clone(), topic.clone(), stop.clone()));
    await_progress(&db.pool, "the holder publishing").await;
    a.kill();
    let killed = Instant::now();
    await_progress(&db.pool, "the standby publishing").await;
    let took = killed.elapsed();
    assert!(b.logged("WAL relay: holding the"), "the standby took over");
    let (written, duplicates) = finish(&db, &svc.bootstrap, &topic, stop, writer).await;
    b.stop();
    eprintln!("kill -9: takeover after {took:?}; {written} events, {duplicates} duplicates");
    assert!(
        took < Duration::from_secs(LEASE_SECS + 5),
        "publishing resumed within the lease and a few seconds: {took:?}"
    );
    drop(a);
}

/// Guarantee: when the WAL relay holding the slot is frozen (SIGSTOP) while events flow, the
/// standby takes the slot over once the lease expired (ending the frozen relay's walsender)
/// and publishes within the lease plus 5 s, and after SIGCONT the old holder learns it lost the lease and stands by instead of
/// streaming, marking or confirming; every event is published, per key in commit order by
/// first copy. Before the lease a frozen holder kept the slot active until
/// `wal_sender_timeout` (60 s by default) and nothing took over; without the standby ending
/// the old walsender, publishing did not resume within 60 s.
#[tokio::test]
async fn a_standby_takes_the_slot_over_from_a_frozen_relay() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-lease-stop");
    let (mut a, mut b) = two_relays(&db, &slot, "wal-lease-stop").await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(write_until(db.pool.clone(), topic.clone(), stop.clone()));
    await_progress(&db.pool, "the holder publishing").await;
    a.signal("STOP");
    let frozen = Instant::now();
    await_progress(&db.pool, "the standby publishing").await;
    let took = frozen.elapsed();
    assert!(b.logged("WAL relay: holding the"), "the standby took over");
    a.signal("CONT");
    a.await_log("lost the slot", Duration::from_secs(30)).await;
    // The old holder stands by again: the lease is the standby's.
    let token: i64 =
        sqlx::query_scalar("SELECT token FROM postal.wal_slot_leases WHERE slot_name = $1")
            .bind(&slot.source.slot)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        token, 2,
        "taken twice: by the first relay, then by the standby"
    );
    await_progress(&db.pool, "the standby still publishing").await;
    let (written, duplicates) = finish(&db, &svc.bootstrap, &topic, stop, writer).await;
    let token: i64 =
        sqlx::query_scalar("SELECT token FROM postal.wal_slot_leases WHERE slot_name = $1")
            .bind(&slot.source.slot)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(token, 2, "the old holder did not take the slot back");
    b.stop();
    a.stop();
    eprintln!("SIGSTOP: takeover after {took:?}; {written} events, {duplicates} duplicates");
    assert!(
        took < Duration::from_secs(LEASE_SECS + 5),
        "publishing resumed within the lease and a few seconds: {took:?}"
    );
}
