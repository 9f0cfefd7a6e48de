//! The WAL relay's one-statement take and its read-ahead (`producer/src/wal/rows.rs` `take`,
//! `wal/publish.rs`): a chunk's rows are read and deleted in one statement in the transaction
//! that commits once they are acknowledged (undone to a savepoint when some are not), and the
//! next chunk of the same batch is taken while a chunk's acknowledgements are awaited. A chunk
//! that fails or parks a row must not let its key's later rows, already taken ahead, go out
//! past it.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postal_integration_tests::{services, unique, wait};
use postal_producer::{
    enqueue_batch, FailureKind, NewEvent, OutboundEvent, PublishError, Transport,
};

use crate::common::RunningRelay;
use crate::wal_relay::Slot;

/// Acknowledges every event, except: events of type `poison` are refused for good
/// (`Permanent`, as Kafka refuses a record too large), and events of type `flaky` fail
/// (`Unavailable`) on their first `fail_first` sends. As the transport contract asks, a key's
/// events after its failed one in a send are held back. Records the acknowledged event ids in
/// order.
#[derive(Default)]
struct Recorder {
    acked: Mutex<Vec<(String, String)>>,
    flaky_failures: AtomicUsize,
    fail_first: usize,
}

struct Recording(Arc<Recorder>);

impl Transport for Recording {
    type Acks = futures::future::Ready<Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        let mut failed_keys = BTreeSet::new();
        let mut out = Vec::with_capacity(batch.len());
        for e in batch {
            if failed_keys.contains(&e.key) {
                out.push(Err(PublishError::new(
                    FailureKind::HeldBack,
                    "behind its key's failed event",
                )));
            } else if e.event_type == "poison" {
                failed_keys.insert(e.key.clone());
                out.push(Err(PublishError::new(FailureKind::Permanent, "too large")));
            } else if e.event_type == "flaky"
                && self.0.flaky_failures.load(Ordering::SeqCst) < self.0.fail_first
            {
                self.0.flaky_failures.fetch_add(1, Ordering::SeqCst);
                failed_keys.insert(e.key.clone());
                out.push(Err(PublishError::new(
                    FailureKind::Unavailable,
                    "broker not available",
                )));
            } else {
                self.0
                    .acked
                    .lock()
                    .unwrap()
                    .push((e.key.clone(), e.id.to_string()));
                out.push(Ok(()));
            }
        }
        futures::future::ready(out)
    }
}

/// One transaction of 16 events in 4-row chunks (batch size 4): key `a`'s event at 1 is of
/// type `special`, its later events at 5, 9 and 13 fall in the chunks read ahead; keys `o0`,
/// `o1`, `o2` fill the rest. Returns the ids in commit order with their keys.
async fn one_transaction(pool: &sqlx::PgPool, topic: &str, special: &str) -> Vec<(String, String)> {
    let mut events = Vec::new();
    let mut keys = Vec::new();
    for i in 0..16 {
        let (key, ty) = if i % 4 == 1 {
            ("a".to_owned(), if i == 1 { special } else { "later" })
        } else {
            (format!("o{}", i % 3), "other")
        };
        events.push(NewEvent::json(topic, key.as_str(), ty, &i).unwrap());
        keys.push(key);
    }
    let mut tx = pool.begin().await.unwrap();
    let ids = enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    keys.into_iter()
        .zip(ids.iter().map(|id| id.to_string()))
        .collect()
}

fn of_key(list: &[(String, String)], key: &str) -> Vec<String> {
    list.iter()
        .filter(|(k, _)| k == key)
        .map(|(_, id)| id.clone())
        .collect()
}

/// Guarantee: an event refused for good in one chunk is parked and holds back its key's later
/// events although the chunks after it were taken (read and deleted, uncommitted) before its
/// refusal was known: they are undone and left pending behind it, while the other keys' 12
/// events are published once each, per key in commit order. Checked that it can fail: without
/// the undo after a parked row (`wal/publish.rs`), one of key `a`'s later events was published
/// past its parked event (2 left pending of 3).
#[tokio::test]
async fn a_parked_event_holds_back_its_keys_rows_taken_ahead() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-ahead-park");
    let recorder = Arc::new(Recorder::default());
    let relay = RunningRelay::start(
        &db.pool,
        Recording(recorder.clone()),
        slot.config().batch_size(4),
    );
    let written = one_transaction(&db.pool, &topic, "poison").await;
    wait::until(
        Duration::from_secs(30),
        "the other keys' events published",
        || async {
            let left: i64 =
                sqlx::query_scalar("SELECT count(*) FROM postal.outbox WHERE event_key <> 'a'")
                    .fetch_one(&db.pool)
                    .await
                    .unwrap();
            left == 0
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
            ("later".to_owned(), "pending".to_owned()),
            ("later".to_owned(), "pending".to_owned()),
            ("later".to_owned(), "pending".to_owned()),
        ],
        "the refused event parked, its key's later events left pending behind it"
    );
    let acked = recorder.acked.lock().unwrap().clone();
    assert!(
        of_key(&acked, "a").is_empty(),
        "key a's later events went out past its parked event: {acked:?}"
    );
    for k in ["o0", "o1", "o2"] {
        assert_eq!(
            of_key(&acked, k),
            of_key(&written, k),
            "key {k}: once each, in commit order"
        );
    }
}

/// Guarantee: an event that fails (the broker unavailable, twice) in one chunk holds back its
/// key's later events taken ahead in the next chunks: they are undone, carried behind it and
/// published after it once it goes through; in the end all 16 events are published once each,
/// per key in commit order, and nothing is left pending. Checked that it can fail: with both
/// the undo after a failed row and the check that a chunk taken ahead is the chunk that follows
/// removed, the events never all went out (30 s); either one alone keeps it passing.
#[tokio::test]
async fn a_failed_event_holds_back_its_keys_rows_taken_ahead() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = Slot::create(&db).await;
    let topic = unique("wal-ahead-fail");
    let recorder = Arc::new(Recorder {
        fail_first: 2,
        ..Recorder::default()
    });
    let relay = RunningRelay::start(
        &db.pool,
        Recording(recorder.clone()),
        slot.config().batch_size(4),
    );
    let written = one_transaction(&db.pool, &topic, "flaky").await;
    wait::until(Duration::from_secs(30), "every event published", || async {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        left == 0
    })
    .await;
    relay.stop().await;
    assert_eq!(
        recorder.flaky_failures.load(Ordering::SeqCst),
        2,
        "the flaky event failed twice before it went through"
    );
    let acked = recorder.acked.lock().unwrap().clone();
    assert_eq!(acked.len(), 16, "each event once: {acked:?}");
    for k in ["a", "o0", "o1", "o2"] {
        assert_eq!(
            of_key(&acked, k),
            of_key(&written, k),
            "key {k}: once each, in commit order"
        );
    }
}
