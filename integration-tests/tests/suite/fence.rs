//! The fence between a claim and the next owner of its key partitions (issue 27, item 2): a
//! claim whose backend outlives its relay's lease — active, so never ended as idle — must
//! neither be overtaken by the next owner nor be completed after its partitions moved.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use postal_integration_tests::{services, unique, wait};
use postal_producer::testing::{claim, lease};
use postal_producer::{OutboundEvent, PublishError, TopicFilter, Transport};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use uuid::Uuid;

use crate::common::{fast_config, RunningRelay};

/// The tests' lease (the shortest a relay accepts is 2 s).
const LEASE: Duration = Duration::from_secs(3);

/// A transport that acknowledges everything and records what it was handed, in order: the
/// order a broker would have published it in.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<i64>>>);

impl Recorder {
    fn seqs(&self) -> Vec<i64> {
        self.0.lock().unwrap().clone()
    }
}

impl Transport for Recorder {
    type Acks = futures::future::Ready<Vec<Result<(), PublishError>>>;

    async fn send(&self, batch: &[OutboundEvent]) -> Self::Acks {
        self.0.lock().unwrap().extend(batch.iter().map(|e| e.seq));
        futures::future::ready(vec![Ok(()); batch.len()])
    }
}

/// Writes `n` events of key `key` with `payload_bytes`-byte payloads; returns their
/// sequence numbers in order.
async fn seed_key(pool: &PgPool, topic: &str, key: &str, n: i32, payload_bytes: i32) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload)
         SELECT gen_random_uuid(), $1, $2, 'e', convert_to(repeat('x', $4), 'UTF8')
         FROM generate_series(1, $3)
         RETURNING seq",
    )
    .bind(topic)
    .bind(key)
    .bind(n)
    .bind(payload_bytes)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The recorded sequence numbers must be exactly `expected`, in that order.
fn assert_published_in_order(recorded: &[i64], expected: &[i64]) {
    let first_wrong = recorded.iter().zip(expected).position(|(r, e)| r != e);
    assert!(
        first_wrong.is_none() && recorded.len() == expected.len(),
        "the key's events were published out of order or not all: {} recorded, {} expected, \
         first difference at position {:?} (recorded {:?}, expected {:?})",
        recorded.len(),
        expected.len(),
        first_wrong,
        first_wrong.map(|i| recorded[i]),
        first_wrong.map(|i| expected[i]),
    );
}

/// Heartbeats as a fresh relay `id` until it holds every partition.
async fn lone_relay(pool: &PgPool, id: Uuid) {
    let held = lease::heartbeat(pool, lease::DEFAULT_GROUP, id, "", LEASE, &[], true)
        .await
        .unwrap();
    assert_eq!(held.held.len(), 256, "a lone relay holds every partition");
}

/// The owner of `key`'s partition.
async fn owner_of_key(pool: &PgPool, key: &str) -> Option<Uuid> {
    sqlx::query_scalar(
        "SELECT owner FROM postal.relay_partitions
         WHERE relay_group = 'default' AND key_partition = (hashtext($1) & 255)",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The backend of the session named `app` that waits on `wait` (an event such as
/// `ClientWrite`, or a type such as `Lock`).
async fn backend_waiting(pool: &PgPool, app: &str, wait: &str) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity
         WHERE application_name = $1 AND state = 'active'
           AND (wait_event_type = $2 OR wait_event = $2)",
    )
    .bind(app)
    .bind(wait)
    .fetch_optional(pool)
    .await
    .unwrap()
}

async fn backend_alive(pool: &PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
        .bind(pid)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Guarantee: a claim whose client stops reading while its backend writes the claimed rows
/// (a frozen or partitioned relay; the backend stays *active*, blocked on the socket, past the
/// relay's lease) keeps the next owner off its key: relay B publishes no event of the key
/// while those rows are claimed, and in the end the key's events reach the destination once
/// each, in sequence order, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_claim_keeps_the_next_owner_off_its_key() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("fence-frozen");
    // 2,000 events of 6 kB (12 MB of claim result, far more than the sockets buffer), then
    // the key's last event.
    let mut expected = seed_key(&db.pool, &topic, "K", 2000, 6000).await;
    expected.extend(seed_key(&db.pool, &topic, "K", 1, 10).await);
    let last = *expected.last().unwrap();

    // Relay A claims through a proxy that stops passing the server's bytes on after the first
    // 64 kB of the claim's result: A's backend blocks writing, as with a frozen client.
    let a = Uuid::now_v7();
    lone_relay(&db.pool, a).await;
    let proxy = proxy::Proxy::start(&db).await;
    let a_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(proxy.options(&db).application_name("fence-a"))
        .await
        .unwrap();
    let published = Recorder::default();
    proxy.freeze_after(64 * 1024);
    let a_published = published.clone();
    let a_task = tokio::spawn(async move {
        // What a relay's lane does with a claim (see `Relay::run`), without its own checks:
        // whatever comes back is published and recorded.
        let claimed = claim::claim(
            &a_pool,
            a,
            &claim::all_partitions(),
            2000,
            LEASE,
            true,
            &TopicFilter::All,
        )
        .await;
        let outcome = match claimed {
            Ok(Some(mut c)) => {
                let batch = c.take_events();
                let acks = a_published.send(&batch).await.await;
                assert!(acks.iter().all(Result::is_ok));
                let seqs: Vec<i64> = batch.iter().map(|e| e.seq).collect();
                format!("{:?}", c.complete(&batch, &seqs, &[]).await)
            }
            other => format!("{other:?}"),
        };
        a_pool.close().await;
        outcome
    });
    // (A backend also waits on `ClientWrite` for moments while its client reads.)
    wait::until(
        Duration::from_secs(20),
        "A's backend blocked writing its claim",
        || async {
            proxy.frozen()
                && backend_waiting(&db.pool, "fence-a", "ClientWrite")
                    .await
                    .is_some()
        },
    )
    .await;
    // Blocked: still the same backend.
    let a_backend = backend_waiting(&db.pool, "fence-a", "ClientWrite")
        .await
        .expect("A's backend blocked");

    // Relay B starts; A's lease runs out (A heartbeats no more). B publishes the key only
    // once A's rows are back, all of them before the key's last event.
    let b = RunningRelay::start(&db.pool, published.clone(), fast_config().lease(LEASE));
    wait::until(
        Duration::from_secs(30),
        "B to publish the key's last event",
        || async { published.seqs().contains(&last) },
    )
    .await;
    assert_published_in_order(&published.seqs(), &expected);
    assert!(
        !backend_alive(&db.pool, a_backend).await,
        "A's claim is gone (its backend ended) before B published the key"
    );

    // A wakes up: it publishes nothing more, and records nothing.
    proxy.thaw();
    let a_outcome = tokio::time::timeout(Duration::from_secs(20), a_task)
        .await
        .expect("A's claim returns once its connection flows again")
        .unwrap();
    wait::until(Duration::from_secs(20), "the outbox drained", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    b.stop().await;
    assert_published_in_order(&published.seqs(), &expected);
    eprintln!("relay A's claim ended with: {a_outcome}");
}

/// Guarantee (real process, kill -9): a claim whose backend waits on a relation lock (a
/// migration's `LOCK TABLE … IN SHARE MODE`, as `CREATE INDEX` takes) outlives its relay
/// process, killed with -9, past that relay's lease; no other relay takes the claim's key
/// partition over while that backend still holds the claim, and once the lock is gone the
/// key's events are published once each, in sequence order, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waiting_on_a_lock_keeps_its_keys_after_its_relay_is_killed() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("fence-lock");
    let mut expected = seed_key(&db.pool, &topic, "K", 2000, 100).await;
    expected.extend(seed_key(&db.pool, &topic, "K", 1, 10).await);

    // The "migration": holds a lock that the claim's DELETE waits for.
    let mut migration = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE postal.outbox IN SHARE MODE")
        .execute(&mut *migration)
        .await
        .unwrap();

    // Relay A: a process of its own, a real relay; its claim waits on the lock.
    let mut a = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "fence::relay_a_process",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_URL, &db.url)
        // The relay's host name in `postal.relay_instances`: how the test finds its id.
        .env("HOSTNAME", "fence-a")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn relay A");
    wait::until(
        Duration::from_secs(30),
        "A's claim waiting on the table lock",
        || async {
            backend_waiting(&db.pool, "fence-child", "Lock")
                .await
                .is_some()
        },
    )
    .await;
    // Blocked: still the same backend.
    let a_backend = backend_waiting(&db.pool, "fence-child", "Lock")
        .await
        .unwrap();
    let a_relay: Uuid =
        sqlx::query_scalar("SELECT relay_id FROM postal.relay_instances WHERE host = 'fence-a'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(owner_of_key(&db.pool, "K").await, Some(a_relay));
    a.kill().expect("kill -9 relay A");
    a.wait().unwrap();
    assert!(
        backend_alive(&db.pool, a_backend).await,
        "A's backend keeps waiting after A died"
    );

    // Relay B: takes the key's partition over only once A's claim is gone.
    let published = Recorder::default();
    let b = RunningRelay::start(&db.pool, published.clone(), fast_config().lease(LEASE));
    wait::until(
        Duration::from_secs(30),
        "B to own the key's partition",
        || async {
            owner_of_key(&db.pool, "K")
                .await
                .is_some_and(|o| o != a_relay)
        },
    )
    .await;
    // A backend's entry may outlast its locks by moments while it exits; one that still
    // waits on the lock stays.
    wait::until(
        Duration::from_secs(1),
        "A's backend to be gone once B owns the key's partition",
        || async { !backend_alive(&db.pool, a_backend).await },
    )
    .await;

    migration.commit().await.unwrap();
    wait::until(Duration::from_secs(30), "the outbox drained", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    b.stop().await;
    assert_published_in_order(&published.seqs(), &expected);
}

/// Guarantee: a claim is not completed once its key partitions belong to another relay, even
/// when the takeover bypassed the claim's partition locks (a relay of an earlier version
/// during a rolling upgrade, an operator's `UPDATE`): completion rolls back, and every
/// claimed row is pending again, unchanged.
#[tokio::test]
async fn completing_a_claim_whose_partitions_moved_is_refused() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = unique("fence-complete");
    let seqs = seed_key(&db.pool, &topic, "K", 10, 10).await;
    let a = Uuid::now_v7();
    lone_relay(&db.pool, a).await;
    let mut claimed = claim::claim(
        &db.pool,
        a,
        &claim::all_partitions(),
        100,
        LEASE,
        true,
        &TopicFilter::All,
    )
    .await
    .unwrap()
    .expect("rows to claim");
    let batch = claimed.take_events();
    assert_eq!(batch.len(), 10);
    // Relay B takes every partition without the fence.
    sqlx::query(
        "UPDATE postal.relay_partitions SET owner = $1, lease_until = now() + interval '1 minute'",
    )
    .bind(Uuid::now_v7())
    .execute(&db.pool)
    .await
    .unwrap();
    let completed = claimed.complete(&batch, &seqs, &[]).await;
    assert!(
        completed.is_err(),
        "completion after the partitions moved must be refused, got {completed:?}"
    );
    let pending: Vec<i64> = sqlx::query_scalar(
        "SELECT seq FROM postal.outbox WHERE status = 'pending' AND attempts = 0 ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(pending, seqs, "every claimed row is pending again");
}

/// The database of the relay process that [`relay_a_process`] runs.
const CHILD_URL: &str = "POSTAL_FENCE_CHILD_URL";

/// Not a test: relay A's process for
/// [`a_claim_waiting_on_a_lock_keeps_its_keys_after_its_relay_is_killed`] (the test binary
/// runs itself with this filter). Runs a relay with the tests' lease until it is killed.
#[tokio::test]
#[ignore = "relay process of a fence test"]
async fn relay_a_process() {
    let Ok(url) = std::env::var(CHILD_URL) else {
        return;
    };
    let opts: PgConnectOptions = url.parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(opts.application_name("fence-child"))
        .await
        .unwrap();
    let config = fast_config().lease(LEASE).lanes(1);
    let relay = postal_producer::Relay::new(pool, Recorder::default(), config).unwrap();
    let _ = relay.run(std::future::pending::<()>()).await;
}

/// A TCP proxy in front of the test's PostgreSQL that can stop passing the server's bytes on.
mod proxy {
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::Arc;

    use postal_integration_tests::TestDb;
    use sqlx::postgres::PgConnectOptions;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpSocket};

    pub struct Proxy {
        port: u16,
        /// Server bytes still passed on before freezing; negative: no limit.
        budget: Arc<AtomicI64>,
        frozen: tokio::sync::watch::Sender<bool>,
        accept: tokio::task::JoinHandle<()>,
    }

    impl Proxy {
        pub async fn start(db: &TestDb) -> Proxy {
            let upstream: PgConnectOptions = db.url.parse().unwrap();
            let addr = format!("{}:{}", upstream.get_host(), upstream.get_port());
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let budget = Arc::new(AtomicI64::new(-1));
            let (frozen, _) = tokio::sync::watch::channel(false);
            let (b, f) = (budget.clone(), frozen.clone());
            let accept = tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let target = tokio::net::lookup_host(addr.as_str())
                        .await
                        .unwrap()
                        .next()
                        .unwrap();
                    let socket = if target.is_ipv4() {
                        TcpSocket::new_v4()
                    } else {
                        TcpSocket::new_v6()
                    }
                    .unwrap();
                    // A small, fixed receive buffer (no autotuning): once the proxy stops
                    // reading, the server's writes block after a few megabytes at most.
                    socket.set_recv_buffer_size(64 * 1024).unwrap();
                    let server = socket.connect(target).await.unwrap();
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    });
                    let (budget, frozen) = (b.clone(), f.clone());
                    tokio::spawn(async move {
                        let mut rx = frozen.subscribe();
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            if rx.wait_for(|f| !*f).await.is_err() {
                                return;
                            }
                            let n = match sr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if cw.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                            let left = budget.load(Ordering::SeqCst);
                            if left >= 0 {
                                let left = left - n as i64;
                                budget.store(left.max(0), Ordering::SeqCst);
                                if left <= 0 {
                                    frozen.send_replace(true);
                                }
                            }
                        }
                    });
                }
            });
            Proxy {
                port,
                budget,
                frozen,
                accept,
            }
        }

        /// Connection options for the test's database through the proxy.
        pub fn options(&self, db: &TestDb) -> PgConnectOptions {
            db.url
                .parse::<PgConnectOptions>()
                .unwrap()
                .host("127.0.0.1")
                .port(self.port)
        }

        /// Stops passing the server's bytes on once `bytes` more have passed.
        pub fn freeze_after(&self, bytes: i64) {
            self.budget.store(bytes, Ordering::SeqCst);
        }

        pub fn frozen(&self) -> bool {
            *self.frozen.borrow()
        }

        /// Passes everything on again.
        pub fn thaw(&self) {
            self.budget.store(-1, Ordering::SeqCst);
            self.frozen.send_replace(false);
        }
    }

    impl Drop for Proxy {
        fn drop(&mut self) {
            self.accept.abort();
        }
    }
}
