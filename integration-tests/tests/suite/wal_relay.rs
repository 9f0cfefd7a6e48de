//! The WAL source of the relay (`RelaySource::Wal`, docs/wal-relay.md): outbox inserts read
//! from a logical replication slot, published in commit order, the slot confirmed only after
//! the broker acknowledged and the rows were marked. Each test creates its own slot and
//! publication (unique names) and drops them, even when it fails ([`Slot`]'s drop).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use postal_integration_tests::kafka::{read_all, Record};
use postal_integration_tests::{services, unique, wait, TestDb};
use postal_producer::{
    enqueue, KafkaTransport, NewEvent, OutboundEvent, PublishError, RelayConfig, RelaySource,
    Transport, WalSource,
};
use sqlx::PgPool;
use tokio::sync::Notify;

use crate::common::{fast_config, kafka_transport, RunningRelay};

/// A slot and publication of the test's own, dropped when the test ends (a slot left behind
/// would keep WAL on the shared server, and `DROP DATABASE` refuses a database with one).
pub(crate) struct Slot {
    pub(crate) source: WalSource,
    admin_url: String,
}

impl Slot {
    pub(crate) async fn create(db: &TestDb) -> Slot {
        let id = uuid::Uuid::now_v7().simple().to_string();
        let (slot, publication) = (format!("postal_t_slot_{id}"), format!("postal_t_pub_{id}"));
        postal_producer::wal::slot::create(&db.pool, &slot, &publication)
            .await
            .expect("create slot and publication");
        Slot {
            source: WalSource::new(db.url.clone(), slot, publication),
            admin_url: db.url.clone(),
        }
    }

    /// The slot `slot` and publication `publication` created by someone else (`postal
    /// migrate --wal-slot`), dropped at the end of the test like one of [`Slot::create`].
    pub(crate) fn adopt(db: &TestDb, slot: &str, publication: &str) -> Slot {
        Slot {
            source: WalSource::new(db.url.clone(), slot, publication),
            admin_url: db.url.clone(),
        }
    }

    pub(crate) fn config(&self) -> RelayConfig {
        fast_config().source(RelaySource::Wal(self.source.clone()))
    }

    /// The slot's `confirmed_flush_lsn`, as a number.
    pub(crate) async fn confirmed(&self, pool: &PgPool) -> u64 {
        let lsn: String = sqlx::query_scalar(
            "SELECT (confirmed_flush_lsn - '0/0')::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&self.source.slot)
        .fetch_one(pool)
        .await
        .expect("slot");
        lsn.parse().expect("lsn as a number")
    }
}

/// A slot of the test's own when `wal` (created before the test's rows, so that the stream
/// holds them), dropped at the end of the test: a test's WAL twin.
pub(crate) async fn slot_if(db: &TestDb, wal: bool) -> Option<Slot> {
    if wal {
        Some(Slot::create(db).await)
    } else {
        None
    }
}

/// The tests' relay configuration: a WAL relay's on `slot`, else a polling relay's.
pub(crate) fn config_for(slot: &Option<Slot>) -> RelayConfig {
    on_slot(slot, fast_config())
}

/// `config` reading from `slot` when there is one (a WAL relay), else unchanged.
pub(crate) fn on_slot(slot: &Option<Slot>, config: RelayConfig) -> RelayConfig {
    match slot {
        Some(s) => config.source(RelaySource::Wal(s.source.clone())),
        None => config,
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let (url, slot, publication) = (
            self.admin_url.clone(),
            self.source.slot.clone(),
            self.source.publication.clone(),
        );
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await?;
                // A stopped relay's session may still be ending: wait until the slot is free
                // (a failed test's relay still runs: its session is ended).
                for i in 0..500 {
                    if i == 250 {
                        sqlx::query(
                            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                             WHERE slot_name = $1 AND active",
                        )
                        .bind(&slot)
                        .execute(&pool)
                        .await?;
                    }
                    let active: Option<bool> = sqlx::query_scalar(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    )
                    .bind(&slot)
                    .fetch_optional(&pool)
                    .await?;
                    if active != Some(true) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                postal_producer::wal::slot::drop(&pool, &slot, &publication).await
            })
        })
        .join()
        .map(|r| {
            if let Err(e) = r {
                eprintln!("could not drop test slot: {e}");
            }
        });
    }
}

/// The WAL insert position, as a number: read in a transaction before its commit, the
/// commit's end LSN (what the relay confirms once it finished the transaction) is above it.
pub(crate) async fn wal_now(conn: &mut sqlx::PgConnection) -> u64 {
    let lsn: String = sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0')::text")
        .fetch_one(conn)
        .await
        .unwrap();
    lsn.parse().unwrap()
}

/// Enqueues one event of `key` per transaction, `n` of them. Returns their ids in order and
/// the WAL position read in the last transaction before it committed: a slot confirmed at or
/// past it has every one of them behind it.
pub(crate) async fn enqueue_each(
    pool: &PgPool,
    topic: &str,
    key: &str,
    n: usize,
) -> (Vec<String>, u64) {
    let mut ids = Vec::new();
    let mut before_last_commit = 0;
    for i in 0..n {
        let mut tx = pool.begin().await.unwrap();
        let id = enqueue(&mut tx, NewEvent::json(topic, key, "e", &i).unwrap())
            .await
            .unwrap();
        before_last_commit = wal_now(&mut tx).await;
        tx.commit().await.unwrap();
        ids.push(id.to_string());
    }
    (ids, before_last_commit)
}

/// Per key, the `ce_postalseq` of its records in the order Kafka holds them.
pub(crate) fn seqs_by_key(records: &[Record]) -> BTreeMap<String, Vec<i64>> {
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in records {
        let seq = r.header("ce_postalseq").unwrap().parse().unwrap();
        by_key.entry(r.key.clone().unwrap()).or_default().push(seq);
    }
    by_key
}

pub(crate) async fn outbox_pending(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE status = 'pending'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Guarantee: events enqueued by concurrent, overlapping transactions (8 writers, each
/// transaction holding events of 2 of 12 keys, left open across the others' commits) reach
/// Kafka through the WAL relay each exactly once, with the polling relay's record form
/// (`ce_id`, `ce_postalseq`, key), per key in commit order (= `seq` order, which `enqueue`'s
/// per-key lock makes the same); every row is marked (deleted) and the slot's confirmed
/// position passes the last commit. Before this source existed there was no WAL relay: the
/// relay ignored the slot and the slot never advanced.
#[tokio::test]
async fn overlapping_transactions_arrive_once_in_commit_order_per_key() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-order");
    let relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), slot.config());

    const WRITERS: usize = 8;
    const TXS: usize = 25;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (pool, topic) = (db.pool.clone(), topic.clone());
        writers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for t in 0..TXS {
                let mut tx = pool.begin().await.unwrap();
                // Keys in ascending order: `enqueue` takes a lock per key until the commit.
                let (a, b) = ((w + t) % 12, (w + 2 * t + 5) % 12);
                for k in [a.min(b), a.max(b)] {
                    let id = enqueue(
                        &mut tx,
                        NewEvent::json(topic.as_str(), format!("key-{k}"), "e", &(w, t)).unwrap(),
                    )
                    .await
                    .unwrap();
                    ids.push(id.to_string());
                    // Other writers' transactions begin and commit meanwhile.
                    tokio::task::yield_now().await;
                }
                tx.commit().await.unwrap();
            }
            ids
        }));
    }
    let mut sent = BTreeSet::new();
    for w in writers {
        sent.extend(w.await.unwrap());
    }
    // One more transaction, after every writer's: the slot confirmed past it has them all.
    let (marker, last_commit) = enqueue_each(&db.pool, &topic, "marker", 1).await;
    sent.extend(marker);
    let records = read_all(&svc.bootstrap, &topic, sent.len(), Duration::from_secs(60)).await;
    wait::until(
        Duration::from_secs(30),
        "the slot confirmed past the last commit",
        || async { slot.confirmed(&db.pool).await >= last_commit },
    )
    .await;
    relay.stop().await;

    let ids: Vec<&str> = records.iter().map(|r| r.header("ce_id").unwrap()).collect();
    assert_eq!(ids.len(), sent.len(), "each event published once");
    assert_eq!(
        ids.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>(),
        sent
    );
    for (key, seqs) in seqs_by_key(&records) {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "key {key} out of order: {seqs:?}"
        );
    }
    assert_eq!(
        crate::common::outbox_count(&db.pool).await,
        0,
        "every published row marked (deleted)"
    );
}

/// A transport that publishes its first batch to Kafka, says so once the broker acknowledged
/// it, and then never reports the outcome: the relay is stuck after the broker's ack, before
/// it marks the rows or confirms the slot.
struct AckedThenStuck {
    inner: KafkaTransport,
    stuck: AtomicBool,
    acked: Arc<Notify>,
}

impl Transport for AckedThenStuck {
    type Acks = BoxFuture<'static, Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        let acks = self.inner.send(batch).await;
        if self.stuck.swap(false, Ordering::SeqCst) {
            let acked = self.acked.clone();
            return async move {
                let outcomes = acks.await;
                assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
                acked.notify_one();
                futures::future::pending().await
            }
            .boxed();
        }
        acks
    }

    fn recorded(&self, batch: &[OutboundEvent], committed: bool) {
        self.inner.recorded(batch, committed);
    }
}

/// Guarantee: a WAL relay killed (its task aborted, its connections closed) after the broker
/// acknowledged a batch but before it marked the rows and confirmed the slot loses nothing: the
/// slot's confirmed position has not moved past the batch, and a new relay reads it again from
/// the slot and publishes it with the rest. The consumer-visible result is every event, per key
/// in commit order by first appearance; the re-published batch appears twice on the wire with
/// the same `ce_id` (consumers drop it, as after a polling relay's crash), and nothing else is
/// duplicated. Without the confirmation rule (confirming at receipt) the batch would be lost
/// to the slot; it would still be pending in the outbox, and no relay would read it again.
#[tokio::test]
async fn a_relay_killed_after_the_ack_before_confirming_loses_nothing() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-kill");
    let (mut first, after_first) = enqueue_each(&db.pool, &topic, "k", 1).await;
    let (more, _) = enqueue_each(&db.pool, &topic, "k", 4).await;
    first.extend(more);

    let acked = Arc::new(Notify::new());
    let transport = AckedThenStuck {
        inner: kafka_transport(&svc.bootstrap),
        stuck: AtomicBool::new(true),
        acked: acked.clone(),
    };
    let pool = db.process_pool().await;
    let doomed = RunningRelay::start(&pool, transport, slot.config()).owning(pool);
    acked.notified().await;
    // The doomed relay's session reports its position to the server at least every second
    // (`WalSource::status_interval`): wait for a report sent after the acknowledgement, so
    // that a relay that confirmed the batch before marking it would have told the server.
    let acked_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    wait::until(
        Duration::from_secs(10),
        "a status report after the ack",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT coalesce(r.reply_time > $1, false) FROM pg_stat_replication r \
             JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $2",
            )
            .bind(acked_at)
            .bind(&slot.source.slot)
            .fetch_optional(&db.pool)
            .await
            .unwrap()
            .unwrap_or(false)
        },
    )
    .await;
    doomed.kill().await;
    // The first transaction's commit ends above `after_first`: a slot confirmed below it has
    // none of the batch behind it.
    assert!(
        slot.confirmed(&db.pool).await < after_first,
        "nothing of the batch confirmed before its rows were marked"
    );
    assert_eq!(
        outbox_pending(&db.pool).await,
        5,
        "the rows are still to publish"
    );

    let (second, last_commit) = enqueue_each(&db.pool, &topic, "k", 5).await;
    let relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), slot.config());
    wait::until(
        Duration::from_secs(60),
        "the outbox drained and the slot confirmed",
        || async {
            outbox_pending(&db.pool).await == 0 && slot.confirmed(&db.pool).await >= last_commit
        },
    )
    .await;
    relay.stop().await;

    let records = read_all(&svc.bootstrap, &topic, 15, Duration::from_secs(30)).await;
    let ids: Vec<String> = records
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    // The doomed relay's batch (the first one to five of the first transactions: whatever
    // the slot had delivered when it read), again from the slot with the rest, then the
    // second events once.
    let doomed_batch = ids.len().saturating_sub(first.len() + second.len());
    assert!((1..=first.len()).contains(&doomed_batch), "{ids:?}");
    let want: Vec<String> = first[..doomed_batch]
        .iter()
        .chain(&first)
        .chain(&second)
        .cloned()
        .collect();
    assert_eq!(
        ids, want,
        "the unconfirmed batch again, then the rest, in commit order"
    );
}

/// Guarantee (handover from polling to WAL, published rows kept): rows a polling relay
/// published (marked `published`) after the slot was created are in the slot's stream, and a
/// WAL relay started afterwards reads them there and does not publish them again: the outbox
/// row, not the WAL, says whether an event is still to publish. It then publishes new events
/// and marks their rows `published`. (The same check covers a WAL relay that marked a batch
/// and died before confirming it.) Without the check (publishing every row the slot names
/// that still exists) every event polling had published reached the consumers twice.
#[tokio::test]
async fn rows_published_by_polling_are_not_published_again_from_the_slot() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-handover");
    let (polled, _) = enqueue_each(&db.pool, &topic, "k", 5).await;
    let keep = |c: RelayConfig| c.delete_on_publish(false);
    let polling = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        keep(fast_config()),
    );
    wait::until(
        Duration::from_secs(30),
        "polling published its rows",
        || async { outbox_pending(&db.pool).await == 0 },
    )
    .await;
    polling.stop().await;

    let relay = RunningRelay::start(
        &db.pool,
        kafka_transport(&svc.bootstrap),
        keep(slot.config()),
    );
    let (walled, last_commit) = enqueue_each(&db.pool, &topic, "k", 3).await;
    wait::until(
        Duration::from_secs(60),
        "the slot confirmed past the new events",
        || async {
            outbox_pending(&db.pool).await == 0 && slot.confirmed(&db.pool).await >= last_commit
        },
    )
    .await;
    relay.stop().await;
    let records = read_all(&svc.bootstrap, &topic, 8, Duration::from_secs(30)).await;
    let ids: Vec<String> = records
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    let want: Vec<String> = polled.into_iter().chain(walled).collect();
    assert_eq!(ids, want, "each event once, in order");
    let published: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE status = 'published'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(published, 8, "every row kept and marked published");
}

/// Guarantee: a WAL relay stopped gracefully gives its slot's lease up, so that a standby
/// streams at once — not after the lease (30 s here) expires — and publishes what was committed
/// after the stop; nothing is lost between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_relay_stopped_gracefully_hands_its_slot_to_a_standby_at_once() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-handover");
    let config = slot.config().lease(Duration::from_secs(30));
    let (mut ids, _) = enqueue_each(&db.pool, &topic, "k", 3).await;
    let first = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), config.clone());
    wait::until(
        Duration::from_secs(30),
        "the first relay published",
        || async { outbox_pending(&db.pool).await == 0 },
    )
    .await;
    let holder = || async {
        sqlx::query_scalar::<_, Option<uuid::Uuid>>(
            "SELECT holder FROM postal.wal_slot_leases WHERE slot_name = $1",
        )
        .bind(&slot.source.slot)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
        .flatten()
    };
    let before = holder()
        .await
        .expect("the first relay holds the slot's lease");
    let standby = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), config);
    first.stop().await;
    let (more, _) = enqueue_each(&db.pool, &topic, "k", 3).await;
    ids.extend(more);
    // Well within the 30 s lease: only a lease given up lets the standby stream by then.
    wait::until(Duration::from_secs(15), "the standby published", || async {
        outbox_pending(&db.pool).await == 0
    })
    .await;
    let after = holder().await.expect("the standby holds the slot's lease");
    assert_ne!(before, after);
    standby.stop().await;
    let records = read_all(&svc.bootstrap, &topic, ids.len(), Duration::from_secs(30)).await;
    let seen: BTreeSet<String> = records
        .iter()
        .filter_map(|r| r.header("ce_id").map(str::to_owned))
        .collect();
    let want: BTreeSet<String> = ids.iter().cloned().collect();
    assert_eq!(seen, want, "every event published");
}

/// Guarantee: a WAL relay stopped gracefully right after it published leaves its slot
/// confirmed past what it published (helper-69's finding: the replication client reports the
/// position at most every status interval and not when it ends, so the slot stayed up to 1 s
/// behind, and the next holder read those transactions again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_relay_stopped_gracefully_leaves_its_slot_confirmed_past_what_it_published() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-stop-confirm");
    let relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), slot.config());
    wait::until(Duration::from_secs(30), "the relay streams", || async {
        sqlx::query_scalar::<_, Option<bool>>(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&slot.source.slot)
        .fetch_one(&db.pool)
        .await
        .unwrap()
            == Some(true)
    })
    .await;
    let (_, commit) = enqueue_each(&db.pool, &topic, "k", 3).await;
    wait::until(Duration::from_secs(30), "the relay published", || async {
        outbox_pending(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    let confirmed = slot.confirmed(&db.pool).await;
    assert!(
        confirmed > commit,
        "the slot is confirmed at {confirmed:X}, not past the published events' last commit (after {commit:X})"
    );
}

/// Guarantee: a WAL relay whose replication URL names a CA file it cannot read stops at start
/// with one line naming the setting and the file, instead of restarting its session for ever.
#[tokio::test]
async fn a_wal_relay_with_an_unreadable_ca_file_stops_at_start_with_one_line() {
    let db = services().await.fresh_db().await;
    let sep = if db.url.contains('?') { '&' } else { '?' };
    let url = format!(
        "{}{sep}sslmode=verify-full&sslrootcert=/nonexistent/postal-ca.pem",
        db.url
    );
    let source = WalSource::new(url, "postal_t_no_slot", "postal_t_no_pub");
    let relay = postal_producer::Relay::new(
        db.pool.clone(),
        kafka_transport(&services().await.bootstrap),
        fast_config().source(RelaySource::Wal(source)),
    )
    .expect("a valid configuration");
    let ended = tokio::time::timeout(
        Duration::from_secs(30),
        relay.run(std::future::pending::<()>()),
    )
    .await
    .expect("the relay stopped at start");
    let error = ended.expect_err("the relay refused the URL").to_string();
    assert!(
        error.contains("sslrootcert /nonexistent/postal-ca.pem") && error.lines().count() == 1,
        "{error}"
    );
}
