//! The WAL relay loses and reorders nothing under hostile writes and faults: writers with large transactions, rolled-back
//! savepoints and rows deleted in their own transaction, while the relay is killed and started
//! again and again. Checked from Kafka and the outbox: nothing committed lost, nothing rolled
//! back or deleted published, per key first publication in `seq` order, duplicates only of the
//! same `ce_id`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use postal_integration_tests::kafka::read_all;
use postal_integration_tests::{services, unique, wait};
use postal_producer::{enqueue, NewEvent};
use rand::{Rng, SeedableRng};
use sqlx::PgPool;

use crate::common::{kafka_transport, RunningRelay};
use crate::wal_relay::{enqueue_each, outbox_pending, Slot};

const KEYS: usize = 6;

/// One writer: transactions of one to three events, large ones (40 events, more than the
/// relay's batch size of 16, so a transaction spans several lock/publish chunks), ones whose
/// middle event is enqueued in a savepoint rolled back, and ones whose event row is deleted
/// before the commit. Returns the ids that must be published and those that must not.
async fn writer(
    pool: PgPool,
    topic: String,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> (Vec<String>, Vec<String>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut kept, mut gone) = (Vec::new(), Vec::new());
    let ev =
        |k: usize, i: usize| NewEvent::json(topic.as_str(), format!("key-{k}"), "e", &i).unwrap();
    let mut i = 0;
    while !stop.load(Ordering::SeqCst) {
        let mut tx = pool.begin().await.unwrap();
        match rng.random_range(0..10) {
            0 => {
                // Large: keys ascending (each `enqueue` holds its key's lock until the commit).
                let k0 = rng.random_range(0..KEYS);
                for k in k0..KEYS {
                    for _ in 0..40 / (KEYS - k0) + 1 {
                        i += 1;
                        kept.push(enqueue(&mut tx, ev(k, i)).await.unwrap().to_string());
                    }
                }
            }
            1 | 2 => {
                // A savepoint rolled back between two kept events.
                i += 1;
                kept.push(enqueue(&mut tx, ev(0, i)).await.unwrap().to_string());
                sqlx::query("SAVEPOINT s").execute(&mut *tx).await.unwrap();
                i += 1;
                gone.push(enqueue(&mut tx, ev(1, i)).await.unwrap().to_string());
                sqlx::query("ROLLBACK TO SAVEPOINT s")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                i += 1;
                kept.push(enqueue(&mut tx, ev(2, i)).await.unwrap().to_string());
            }
            3 => {
                // Inserted and deleted in the same transaction.
                i += 1;
                let id = enqueue(&mut tx, ev(3, i)).await.unwrap();
                sqlx::query("DELETE FROM postal.outbox WHERE event_id = $1")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                gone.push(id.to_string());
                i += 1;
                kept.push(enqueue(&mut tx, ev(4, i)).await.unwrap().to_string());
            }
            _ => {
                let a = rng.random_range(0..KEYS);
                let b = rng.random_range(a..KEYS);
                for k in [a, b] {
                    i += 1;
                    kept.push(enqueue(&mut tx, ev(k, i)).await.unwrap().to_string());
                }
            }
        }
        tx.commit().await.unwrap();
        tokio::task::yield_now().await;
    }
    (kept, gone)
}

/// Kills the WAL relay (task aborted, its pool closed) `kills` times at random moments under
/// steady writes, then lets one relay drain; returns (lost, unexpected, duplicated ce_ids,
/// per-key order violations) with the details printed.
async fn restart_storm(keep_published: bool, kills: usize, seed: u64) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-review");
    let config = || {
        let c = slot.config().batch_size(16);
        if keep_published {
            c.delete_on_publish(false)
        } else {
            c
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..3)
        .map(|w| {
            tokio::spawn(writer(
                db.pool.clone(),
                topic.clone(),
                seed * 10 + w,
                stop.clone(),
            ))
        })
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..kills {
        let pool = db.process_pool().await;
        let relay =
            RunningRelay::start(&pool, kafka_transport(&svc.bootstrap), config()).owning(pool);
        // The fault schedule (not a synchronization): how long this relay lives.
        tokio::time::sleep(Duration::from_millis(rng.random_range(20..600))).await;
        relay.kill().await;
    }
    stop.store(true, Ordering::SeqCst);
    let (mut kept, mut gone) = (Vec::new(), Vec::new());
    for w in writers {
        let (k, g) = w.await.unwrap();
        kept.extend(k);
        gone.extend(g);
    }
    let (marker, last_commit) = enqueue_each(&db.pool, &topic, "marker", 1).await;
    kept.extend(marker);
    let relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), config());
    wait::until(
        Duration::from_secs(120),
        "the outbox drained and the slot confirmed past the last commit",
        || async {
            outbox_pending(&db.pool).await == 0 && slot.confirmed(&db.pool).await >= last_commit
        },
    )
    .await;
    relay.stop().await;

    let records = read_all(&svc.bootstrap, &topic, kept.len(), Duration::from_secs(60)).await;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut first_seqs: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &records {
        let id = r.header("ce_id").unwrap().to_owned();
        let n = seen.entry(id).or_default();
        *n += 1;
        if *n == 1 {
            first_seqs
                .entry(r.key.clone().unwrap())
                .or_default()
                .push(r.header("ce_postalseq").unwrap().parse().unwrap());
        }
    }
    let kept_set: BTreeSet<&String> = kept.iter().collect();
    let lost: Vec<&&String> = kept_set
        .iter()
        .filter(|id| !seen.contains_key(**id))
        .collect();
    let unexpected: Vec<&String> = gone.iter().filter(|id| seen.contains_key(*id)).collect();
    let dups = seen.values().filter(|&&n| n > 1).count();
    let disorder: Vec<&String> = first_seqs
        .iter()
        .filter(|(_, s)| !s.windows(2).all(|w| w[0] < w[1]))
        .map(|(k, _)| k)
        .collect();
    eprintln!(
        "wal_faults storm (keep_published={keep_published}, seed {seed}): {} kept, {} rolled back/deleted, {} records, {} ce_ids duplicated, {} lost, {} unexpected, keys out of order {:?}",
        kept.len(),
        gone.len(),
        records.len(),
        dups,
        lost.len(),
        unexpected.len(),
        disorder
    );
    assert!(
        lost.is_empty(),
        "lost {} events: {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    assert!(
        unexpected.is_empty(),
        "published rolled-back or deleted events: {unexpected:?}"
    );
    assert!(disorder.is_empty(), "keys out of order: {disorder:?}");
    if keep_published {
        let published: i64 =
            sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE status = 'published'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(
            published as usize,
            kept.len(),
            "every kept row marked published"
        );
    } else {
        assert_eq!(
            crate::common::outbox_count(&db.pool).await,
            0,
            "every row deleted"
        );
    }
}

/// Guarantee: a WAL relay killed 12 times at random moments while three writers commit small
/// and large transactions (larger than the batch size), transactions with an event rolled back
/// in a savepoint, and transactions that delete their own event row, loses no committed event,
/// publishes none of the rolled-back or deleted ones, and keeps each key's first publications
/// in `seq` order; duplicates (after a kill between the ack and the marks) carry the same
/// `ce_id`. Rows deleted on publish.
#[tokio::test]
async fn a_relay_killed_again_and_again_under_writes_loses_and_reorders_nothing() {
    restart_storm(false, 12, 50).await;
}

/// [`a_relay_killed_again_and_again_under_writes_loses_and_reorders_nothing`] with published
/// rows kept (`delete_on_publish = false`): every committed row ends `published`.
#[tokio::test]
async fn the_same_storm_with_published_rows_kept() {
    restart_storm(true, 12, 51).await;
}

/// A Kafka transport that refuses every event of type `poison` for good (as Kafka refuses a
/// record larger than the topic allows: [`FailureKind::Permanent`]) and, as the transport
/// contract asks, holds back the later events of its key in the same batch.
struct Refuses(postal_producer::KafkaTransport);

impl postal_producer::Transport for Refuses {
    type Acks = futures::future::BoxFuture<'static, Vec<Result<(), postal_producer::PublishError>>>;

    async fn send(&self, batch: &[postal_producer::OutboundEvent]) -> Self::Acks {
        use futures::FutureExt;
        use postal_producer::{FailureKind, PublishError};
        let mut refused = BTreeSet::new();
        let mut verdicts = Vec::with_capacity(batch.len());
        let mut forward = Vec::new();
        for e in batch {
            let key = (e.topic.clone(), e.key.clone());
            if e.event_type == "poison" {
                refused.insert(key);
                verdicts.push(Some(PublishError::new(FailureKind::Permanent, "too large")));
            } else if refused.contains(&key) {
                verdicts.push(Some(PublishError::new(FailureKind::HeldBack, "held back")));
            } else {
                verdicts.push(None);
                forward.push(e.clone());
            }
        }
        let acks = self.0.send(&forward).await;
        async move {
            let mut acks = acks.await.into_iter();
            verdicts
                .into_iter()
                .map(|v| match v {
                    Some(e) => Err(e),
                    None => acks.next().expect("an ack per forwarded event"),
                })
                .collect()
        }
        .boxed()
    }

    fn recorded(&self, batch: &[postal_producer::OutboundEvent], committed: bool) {
        self.0.recorded(batch, committed);
    }
}

/// Guarantee: an event the broker refuses for good (a permanent failure: too large) is parked
/// (`status = 'failed'`, visible to `postal failed`), as polling parks it, and holds back its
/// key's later events (left pending, as the WAL relay leaves rows behind a held row), while
/// other keys' later events are published and the slot moves on. Before: the WAL relay
/// retried the refused event forever and never read past its batch, so no event of any key
/// committed after it was published (and the slot kept all WAL from there on).
#[tokio::test]
async fn an_event_refused_for_good_is_parked_and_other_keys_flow() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-poison");
    let relay = RunningRelay::start(
        &db.pool,
        Refuses(kafka_transport(&svc.bootstrap)),
        slot.config(),
    );
    let mut tx = db.pool.begin().await.unwrap();
    enqueue(
        &mut tx,
        NewEvent::json(topic.as_str(), "a", "poison", &0).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let (_, _) = enqueue_each(&db.pool, &topic, "a", 1).await;
    let (others, last_commit) = enqueue_each(&db.pool, &topic, "b", 3).await;
    wait::until(
        Duration::from_secs(30),
        "the other key's events published and the slot past them",
        || async {
            let pending_b: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM postal.outbox WHERE event_key = 'b' AND status = 'pending'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            pending_b == 0 && slot.confirmed(&db.pool).await >= last_commit
        },
    )
    .await;
    relay.stop().await;
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT event_type, status FROM postal.outbox WHERE event_key = 'a' ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![
            ("poison".to_owned(), "failed".to_owned()),
            ("e".to_owned(), "pending".to_owned())
        ],
        "the refused event parked, its key's later event left behind it"
    );
    let records = read_all(&svc.bootstrap, &topic, 3, Duration::from_secs(30)).await;
    let ids: Vec<String> = records
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    assert_eq!(
        ids, others,
        "only the other key's events, once each, in order"
    );
}

/// Guarantee: a key's event committed before the slot existed (so not in its stream) and
/// still pending is published by the WAL relay (its sweep), and before the key's later events
/// read from the slot: per key nothing is published before an earlier event. The stream leaves
/// the later one pending behind it, and the sweep publishes both in order. Before migration
/// 0042 the later event was published at once, before the earlier one (an operator who
/// switched to WAL without draining with polling first got the key reordered): fails without
/// the relay's check of the key's oldest pending row (`producer/src/wal/rows.rs`,
/// `older_column`). Before the sweep, both stayed pending for good.
#[tokio::test]
async fn a_key_pending_from_before_the_slot_holds_its_later_events_back() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("wal-preslot");
    // Made up front: with nothing published, no produce would make it.
    crate::common::create_topic(&svc.bootstrap, &topic, 1).await;
    let (before, _) = enqueue_each(&db.pool, &topic, "k", 1).await;
    let slot = Slot::create(&db).await;
    let relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), slot.config());
    let (after, last_commit) = enqueue_each(&db.pool, &topic, "k", 1).await;
    wait::until(
        Duration::from_secs(30),
        "the slot confirmed past the later event and both rows published",
        || async {
            slot.confirmed(&db.pool).await >= last_commit
                && crate::common::outbox_count(&db.pool).await == 0
        },
    )
    .await;
    relay.stop().await;
    let records = read_all(&svc.bootstrap, &topic, 2, Duration::from_secs(10)).await;
    let ids: Vec<String> = records
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    let mut expected = before.clone();
    expected.extend(after);
    assert_eq!(
        ids, expected,
        "the key's events once each, the one from before the slot first"
    );
}

/// Guarantee: a key's earlier row that two other sessions hold `FOR SHARE` at once (a
/// multixact lock, whose holders `pg_locks` does not name by the row's `xmax`) holds the key's
/// later row back from the WAL relay — the later row is not published before it — while another
/// key goes on; once the sessions end, both go out, in order (the WAL twin of
/// `row_locks_by_hand::a_shared_lock_of_two_sessions_holds_the_key`).
#[tokio::test]
async fn a_row_share_locked_by_two_sessions_holds_its_key_back_from_the_stream() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-multixact");
    let (first, _) = enqueue_each(&db.pool, &topic, "k", 1).await;
    let first_seq: i64 = sqlx::query_scalar("SELECT max(seq) FROM postal.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // Two sessions share-lock the key's first row (a multixact), before the later rows exist.
    let mut holders = Vec::new();
    for _ in 0..2 {
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM postal.outbox WHERE seq = $1 FOR SHARE")
            .bind(first_seq)
            .execute(&mut *tx)
            .await
            .unwrap();
        holders.push(tx);
    }
    let (later, _) = enqueue_each(&db.pool, &topic, "k", 2).await;
    let (other, _) = enqueue_each(&db.pool, &topic, "other", 3).await;
    let relay = RunningRelay::start(&db.pool, kafka_transport(&svc.bootstrap), slot.config());
    wait::until(
        Duration::from_secs(30),
        "the other key published",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM postal.outbox WHERE event_key = 'other' AND status = 'pending'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
    let kept: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM postal.outbox WHERE event_key = 'k' ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        kept.len(),
        3,
        "the key's rows are all still pending behind the share-locked one: {kept:?}"
    );
    for tx in holders {
        tx.rollback().await.unwrap();
    }
    wait::until(Duration::from_secs(30), "everything published", || async {
        outbox_pending(&db.pool).await == 0
    })
    .await;
    relay.stop().await;
    let want = first.len() + later.len() + other.len();
    let records = read_all(&svc.bootstrap, &topic, want, Duration::from_secs(30)).await;
    let mut order: Vec<String> = Vec::new();
    for r in records.iter().filter(|r| r.key.as_deref() == Some("k")) {
        let id = r.header("ce_id").unwrap().to_owned();
        if !order.contains(&id) {
            order.push(id);
        }
    }
    let expected: Vec<String> = first.iter().chain(&later).cloned().collect();
    assert_eq!(order, expected, "the key's events first published in order");
}
