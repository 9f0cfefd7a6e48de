//! Pooler churn (issue 51's "done when"): a `postal relay` process and a consumer process
//! (`billing_service`) behind a session-mode PgBouncer of the test's own, writers enqueuing
//! inside their transactions through a transaction-mode PgBouncer of the test's own, while the
//! consumed topic is deleted and re-created and both poolers are killed with SIGKILL and
//! started again on their ports.
//!
//! Knobs (environment): `POSTAL_CHURN_CYCLES` (topic delete/re-create cycles, default 3; each
//! cycle also restarts each pooler once), `POSTAL_CHURN_WRITERS` (default 4),
//! `POSTAL_CHURN_KEYS` (customers, default 24), `POSTAL_CHURN_PACE_MS` (pause between a
//! writer's events, default 60).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postal_integration_tests::wait::until;
use postal_integration_tests::{free_port, pgbouncer, services, unique};
use postal_producer::{enqueue_once, EventId, NewEvent};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

use crate::procs::{bin_dir, env_u64, http_get, Proc};

/// A PgBouncer of the test's own that can be killed with SIGKILL and started again on the same
/// port (the suite's `pgbouncer::PgBouncer` picks a new port per start).
struct Bouncer {
    bin: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    restarts: u32,
}

fn postgres_user() -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&"postgres")).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

impl Bouncer {
    fn start(bin: &std::path::Path, database_url: &str, mode: &str, pool_size: u32) -> Bouncer {
        let target: sqlx::postgres::PgConnectOptions = database_url.parse().unwrap();
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("postal-churn-{}", unique("pgb")));
        std::fs::create_dir_all(&dir).unwrap();
        // The keepalive settings docs/operations.md#poolers recommends.
        let config = format!(
            "[databases]\n* = host={host} port={pg_port}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {dir}/userlist.txt\npool_mode = {mode}\n\
             default_pool_size = {pool_size}\nmax_client_conn = 1000\n\
             ignore_startup_parameters = extra_float_digits\nlogfile = {dir}/pgbouncer.log\n\
             admin_users = postgres\ntcp_keepidle = 15\ntcp_keepintvl = 5\ntcp_keepcnt = 3\n\
             tcp_user_timeout = 30000\n",
            host = target.get_host(),
            pg_port = target.get_port(),
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), config).unwrap();
        std::fs::write(dir.join("userlist.txt"), "\"postgres\" \"\"\n").unwrap();
        let mut b = Bouncer {
            bin: bin.to_owned(),
            port,
            dir,
            child: None,
            restarts: 0,
        };
        b.spawn();
        b
    }

    fn spawn(&mut self) {
        let mut command = Command::new(&self.bin);
        command.arg(self.dir.join("pgbouncer.ini"));
        if nix::unistd::getuid().is_root() {
            let (uid, gid) = postgres_user().expect("a postgres user to run PgBouncer as");
            for entry in [
                self.dir.clone(),
                self.dir.join("pgbouncer.ini"),
                self.dir.join("userlist.txt"),
                self.dir.join("pgbouncer.log"),
            ] {
                std::os::unix::fs::chown(&entry, Some(uid), Some(gid)).ok();
            }
            use std::os::unix::process::CommandExt as _;
            command.uid(uid).gid(gid);
        }
        let mut child = command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start pgbouncer");
        let deadline = Instant::now() + Duration::from_secs(20);
        // (The port of a SIGKILLed PgBouncer is free at once: it listened, it had no
        // TIME_WAIT of its own on the listening socket.)
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("pgbouncer exited ({status}): {}", self.log_tail());
            }
            assert!(Instant::now() < deadline, "pgbouncer did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.child = Some(child);
    }

    fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// `kill -SIG` (STOP/CONT: a pooler that hangs with its connections open).
    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} pgbouncer");
    }

    fn restart(&mut self) {
        self.spawn();
        self.restarts += 1;
    }

    fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().ok();
            c.wait().ok();
        }
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// The sum of the metric lines named `name` whose labels contain every one of `labels`.
fn metric_sum(port: u16, name: &str, labels: &[&str]) -> Option<f64> {
    let text = http_get(port, "/metrics")?;
    Some(
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let rest = l.strip_prefix(name)?;
                let (set, value) = match rest.strip_prefix('{') {
                    Some(r) => r.rsplit_once("} ")?,
                    None => ("", rest.strip_prefix(' ')?),
                };
                labels
                    .iter()
                    .all(|want| set.split(',').any(|have| have == *want))
                    .then(|| value.trim().parse::<f64>().ok())?
            })
            .sum(),
    )
}

fn not_ready(port: u16) -> bool {
    http_get(port, "/readyz")
        .unwrap_or_default()
        .lines()
        .next()
        .is_some_and(|l| l.contains(" 503"))
}

fn logged(path: &std::path::Path, text: &str) -> bool {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .contains(text)
}

fn count_logged(path: &std::path::Path, text: &str) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(text))
        .count()
}

/// One order a writer committed: (customer, seq, event id).
type Written = (String, i32, uuid::Uuid);

/// What the writers share with the test.
#[derive(Default)]
struct Writers {
    stop: AtomicBool,
    paused: AtomicBool,
    /// Writers that have seen `paused` and hold no transaction.
    parked: AtomicUsize,
    written: Mutex<Vec<Written>>,
    errors: AtomicU64,
    /// Commits that failed (outcome unknown): retried with the same event id.
    ambiguous: AtomicU64,
}

/// Writer `w`: the customers `c{k}` with `k % writers == w`, round robin, each order with the
/// customer's next `seq`, enqueued with `enqueue_once` inside its own transaction through the
/// transaction pooler, retried with the same event id until a commit succeeds.
async fn writer(
    w: usize,
    writers: usize,
    keys: usize,
    pace: Duration,
    url: String,
    topic: String,
    sh: Arc<Writers>,
) {
    let base = EventId::new();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(&url)
        .unwrap();
    let mine: Vec<usize> = (0..keys).filter(|k| k % writers == w).collect();
    let mut seq: HashMap<usize, i32> = HashMap::new();
    let mut n: i64 = 0;
    let mut was_parked = false;
    'orders: loop {
        if sh.stop.load(Ordering::SeqCst) {
            break;
        }
        if sh.paused.load(Ordering::SeqCst) {
            if !was_parked {
                sh.parked.fetch_add(1, Ordering::SeqCst);
                was_parked = true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        if was_parked {
            sh.parked.fetch_sub(1, Ordering::SeqCst);
            was_parked = false;
        }
        let k = mine[(n as usize) % mine.len()];
        let s = seq.entry(k).or_insert(0);
        *s += 1;
        let customer = format!("c{k}");
        let order_id = (w as i64) * 10_000_000 + n;
        let id = EventId::derived(base, &format!("order-{order_id}"));
        n += 1;
        loop {
            let event = NewEvent::json(
                topic.as_str(),
                customer.as_str(),
                "order.created",
                &serde_json::json!({"order_id": order_id, "customer": customer, "seq": *s}),
            )
            .unwrap()
            .with_id(id);
            let attempt = async {
                let mut tx = pool.begin().await.map_err(|e| (false, e.to_string()))?;
                enqueue_once(&mut tx, event)
                    .await
                    .map_err(|e| (false, e.to_string()))?;
                tx.commit().await.map_err(|e| (true, e.to_string()))
            };
            match attempt.await {
                Ok(()) => {
                    sh.written
                        .lock()
                        .unwrap()
                        .push((customer.clone(), *s, id.as_uuid()));
                    break;
                }
                Err((at_commit, e)) => {
                    sh.errors.fetch_add(1, Ordering::Relaxed);
                    if at_commit {
                        sh.ambiguous.fetch_add(1, Ordering::Relaxed);
                    }
                    if sh.errors.load(Ordering::Relaxed) % 50 == 1 {
                        eprintln!("[churn] writer {w}: {e}; again");
                    }
                    if sh.stop.load(Ordering::SeqCst) && sh.errors.load(Ordering::Relaxed) > 100_000
                    {
                        break 'orders;
                    }
                    // Back-off while the pooler is down (not synchronization).
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        tokio::time::sleep(pace).await;
    }
    pool.close().await;
}

async fn delete_topic(bootstrap: &str, topic: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    for r in admin
        .delete_topics(&[topic], &AdminOptions::new())
        .await
        .expect("delete topic")
    {
        r.expect("topic deleted");
    }
}

/// Creates `topic` (3 partitions) unless it exists; retried while the broker is still deleting
/// it. Returns whether this call created it (the relay may have been first).
async fn create_topic_racing(bootstrap: &str, topic: &str) -> bool {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::types::RDKafkaErrorCode;
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let res = admin
            .create_topics(
                [&NewTopic::new(topic, 3, TopicReplication::Fixed(1))],
                &AdminOptions::new(),
            )
            .await
            .expect("create topic");
        match res.into_iter().next().unwrap() {
            Ok(_) => return true,
            Err((_, RDKafkaErrorCode::TopicAlreadyExists))
                if !crate::missing_topic::topic_exists(bootstrap, topic) => {}
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => return false,
            Err(e) => assert!(Instant::now() < deadline, "cannot create {topic}: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The lines of `postal status` (connected directly) that say STALLED or STOPPED, or that it
/// says neither.
async fn status_says(database_url: &str) -> String {
    let url = database_url.to_owned();
    tokio::task::spawn_blocking(move || {
        let out = Command::new(bin_dir().join("postal"))
            .arg("status")
            .env("DATABASE_URL", &url)
            .env_remove("KAFKA_BOOTSTRAP_SERVERS")
            .output()
            .expect("postal status runs");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("STALLED") || l.contains("STOPPED") || l.contains("heartbeat"))
            .collect();
        if lines.is_empty() {
            format!("neither STALLED nor STOPPED: {text}")
        } else {
            lines.join(" | ")
        }
    })
    .await
    .unwrap()
}

/// What the stall monitor saw.
#[derive(Default, Debug)]
struct Stalls {
    /// Episodes of > 60 s without progress while work was pending, with what showed them.
    episodes: Vec<String>,
    /// Episodes nothing showed (the failure).
    silent: Vec<String>,
    longest_consumer: Duration,
    longest_relay: Duration,
}

/// Guarantee: behind a session-mode PgBouncer (relay and consumer) and a transaction-mode one
/// (the writers' `enqueue_once`, inside their transactions), with the consumed topic deleted
/// and re-created under the running relay and consumer (`POSTAL_CHURN_CYCLES`, default 3;
/// every other time the test re-creates it itself, racing the relay) and each pooler killed
/// with SIGKILL and started again once per cycle (the session pooler once more while the
/// consumer has the topic stopped; in cycle 1 the session pooler stays down 70 s, in cycle 2
/// it is frozen with SIGSTOP for 70 s instead, its connections open):
///
/// - every order a writer committed is applied by the consumer exactly once (one ledger row
///   per event id; writers retry an ambiguous commit under the same id), each customer's orders
///   in `seq` order, nothing parked in the outbox;
/// - each re-creation under the running consumer STOPs the topic (the ERROR line and
///   `postal_consumer_partitions_stopped`), nothing of the new log is skipped as "below the
///   stored offset", and the documented way on (stop the consumer, `postal consumer reset
///   --to earliest --execute` through the session pooler, start it) applies the new log;
/// - no silent stall: whenever the consumer applied nothing for over 60 s while orders were
///   pending, or the relay published nothing for over 60 s with rows due, a signal showed it
///   (consumer: the stop gauge/line, `postal_consumer_stalled_seconds`, `/readyz` 503, "consumer
///   stalled"; relay: `/readyz` 503, `postal_relay_claim_waiting_seconds`, "relay stalled", the
///   topic's "does not exist"/"was deleted" line).
///
/// Records a deleted topic held are the deletion's (an operator purge), not Postal's to keep:
/// so before each deletion the writers pause and the test waits until every committed order is
/// applied; the writers resume right after the delete request (writing while it is deleted and
/// re-created). The relay refusing the transaction pooler with one line is checked first.
/// The reset runs right after the consumer's clean exit and must succeed at once (a stopped
/// consumer has left its group: `clean_exit::`; before that fix the broker listed it as a live
/// member for 45 s, the session timeout, after 2 of 7 clean exits here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak (several minutes, 70 s pooler outages): run with `-- --ignored pooler_churn::` and POSTAL_REQUIRE_PGBOUNCER=1"]
async fn relay_and_consumer_survive_topic_recreation_and_pooler_restarts() {
    let Some(bin) = pgbouncer::binary("pooler_churn::relay_and_consumer_survive") else {
        return;
    };
    let cycles = env_u64("POSTAL_CHURN_CYCLES", 3) as usize;
    let n_writers = env_u64("POSTAL_CHURN_WRITERS", 4) as usize;
    let keys = env_u64("POSTAL_CHURN_KEYS", 24) as usize;
    let pace = Duration::from_millis(env_u64("POSTAL_CHURN_PACE_MS", 60));
    let svc = services().await;
    let db = svc.fresh_db().await;
    let t0 = Instant::now();
    let stamp = move || format!("{:>6.1}s", t0.elapsed().as_secs_f64());

    // Relay (12 connections) + billing + the CLI's reset, with room.
    let mut session = Bouncer::start(&bin, &svc.database_url, "session", 40);
    let mut txn = Bouncer::start(&bin, &svc.database_url, "transaction", 3);
    let orders = unique("churn-orders");
    let invoices = unique("churn-invoices");
    let group = unique("churn-billing");
    create_topic_racing(&svc.bootstrap, &orders).await;

    let logs = bin_dir().join(format!("churn-{}", db.name));
    std::fs::create_dir_all(&logs).unwrap();

    // Designed: the relay refuses the transaction pooler at start with one line.
    {
        let mut refused = Proc::new(&bin_dir(), &logs, "refused", "postal", &["relay"]).env(&[
            ("DATABASE_URL", txn.url(&db.name)),
            ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ]);
        refused.start();
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = refused.exited() {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "postal relay through a transaction pooler did not stop"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(!status.success());
        let log = std::fs::read_to_string(&refused.log).unwrap();
        assert_eq!(
            log.lines()
                .filter(|l| l.contains("transaction pooler"))
                .count(),
            1,
            "one line: {log}"
        );
    }

    let mut relay = Proc::new(
        &bin_dir(),
        &logs,
        "relay",
        "postal",
        &["relay", "--topic-partitions", "3"],
    )
    .env(&[
        ("DATABASE_URL", session.url(&db.name)),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ])
    .with_metrics();
    let mut billing = Proc::new(&bin_dir(), &logs, "billing", "billing_service", &[])
        .env(&[
            ("DATABASE_URL", session.url(&db.name)),
            ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
            ("ORDERS_TOPIC", orders.clone()),
            ("INVOICES_TOPIC", invoices.clone()),
            ("POSTAL_CONSUMER_GROUP", group.clone()),
            ("POSTAL_KAFKA", "fetch.wait.max.ms=50".into()),
            ("RUST_LOG", "info,rdkafka=warn".into()),
        ])
        .with_metrics();
    relay.start();
    billing.start();
    let relay_port = relay.metrics_port().unwrap();
    let billing_port = billing.metrics_port().unwrap();

    // The writers, through the transaction pooler.
    let sh = Arc::new(Writers::default());
    let handles: Vec<_> = (0..n_writers)
        .map(|w| {
            let (url, topic, sh) = (txn.url(&db.name), orders.clone(), sh.clone());
            tokio::spawn(writer(w, n_writers, keys, pace, url, topic, sh))
        })
        .collect();

    // The stall monitor (direct connection to PostgreSQL, not through a pooler).
    let operator_window = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let stalls = Arc::new(Mutex::new(Stalls::default()));
    let monitor = {
        let (pool, sh, stalls, done, op) = (
            db.pool.clone(),
            sh.clone(),
            stalls.clone(),
            done.clone(),
            operator_window.clone(),
        );
        let (relay_log, billing_log, orders) =
            (relay.log.clone(), billing.log.clone(), orders.clone());
        let db_url = db.url.clone();
        tokio::spawn(async move {
            let mut applied_last = -1i64;
            let mut consumer_since = Instant::now();
            let mut published_last = -1.0f64;
            let mut relay_since = Instant::now();
            let (mut consumer_reported, mut relay_reported) = (false, false);
            while !done.load(Ordering::SeqCst) {
                let applied: i64 =
                    sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM ledger")
                        .fetch_one(&pool)
                        .await
                        .unwrap_or(applied_last);
                let written = sh.written.lock().unwrap().len() as i64;
                let due: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM postal.outbox WHERE status = 'pending' AND available_at <= now()",
                )
                .fetch_one(&pool)
                .await
                .unwrap_or(0);
                let published = metric_sum(relay_port, "postal_relay_published_total", &[])
                    .unwrap_or(published_last);
                let now = Instant::now();
                if applied != applied_last || applied >= written || op.load(Ordering::SeqCst) {
                    applied_last = applied;
                    consumer_since = now;
                    consumer_reported = false;
                }
                if published != published_last || due == 0 {
                    published_last = published;
                    relay_since = now;
                    relay_reported = false;
                }
                let topic_label = format!("topic=\"{orders}\"");
                let c_idle = now - consumer_since;
                let r_idle = now - relay_since;
                {
                    let mut s = stalls.lock().unwrap();
                    s.longest_consumer = s.longest_consumer.max(c_idle);
                    s.longest_relay = s.longest_relay.max(r_idle);
                }
                if c_idle > Duration::from_secs(60) && !consumer_reported {
                    consumer_reported = true;
                    let stopped = metric_sum(
                        billing_port,
                        "postal_consumer_partitions_stopped",
                        &[&topic_label],
                    )
                    .unwrap_or(0.0);
                    let stalled = metric_sum(billing_port, "postal_consumer_stalled_seconds", &[])
                        .unwrap_or(0.0);
                    let nr = not_ready(billing_port);
                    let line = logged(&billing_log, "consumer stalled");
                    let what = format!(
                        "consumer applied nothing for {:.0}s with {} pending: stopped gauge {stopped}, stalled_seconds {stalled}, readyz 503 {nr}, 'consumer stalled' logged {line}",
                        c_idle.as_secs_f64(),
                        written - applied
                    );
                    eprintln!("[churn] {what}");
                    let what = format!("{what}; postal status: {}", status_says(&db_url).await);
                    let mut s = stalls.lock().unwrap();
                    if stopped > 0.0 || stalled > 0.0 || nr || line {
                        s.episodes.push(what);
                    } else {
                        s.silent.push(what);
                    }
                }
                if r_idle > Duration::from_secs(60) && !relay_reported {
                    relay_reported = true;
                    let waiting = metric_sum(relay_port, "postal_relay_claim_waiting_seconds", &[])
                        .unwrap_or(0.0);
                    let nr = not_ready(relay_port);
                    let line = logged(&relay_log, "relay stalled")
                        || logged(&relay_log, "does not exist")
                        || logged(&relay_log, "was deleted");
                    let what = format!(
                        "relay published nothing for {:.0}s with {due} due: claim_waiting {waiting}, readyz 503 {nr}, stall/topic line logged {line}",
                        r_idle.as_secs_f64()
                    );
                    eprintln!("[churn] {what}");
                    let what = format!("{what}; postal status: {}", status_says(&db_url).await);
                    let mut s = stalls.lock().unwrap();
                    if waiting > 0.0 || nr || line {
                        s.episodes.push(what);
                    } else {
                        s.silent.push(what);
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };

    let applied = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT event_id) FROM ledger")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
    };
    let written = |sh: &Writers| sh.written.lock().unwrap().len() as i64;
    let topic_label = format!("topic=\"{orders}\"");
    let mut problems: Vec<String> = Vec::new();
    let mut recoveries: Vec<String> = Vec::new();

    // Progress after a fault: more applied than `before` (and the writers' count moving).
    macro_rules! await_progress {
        ($what:expr, $within:expr) => {{
            let before = applied(db.pool.clone()).await;
            let w_before = written(&sh);
            let started = Instant::now();
            let deadline = started + $within;
            loop {
                relay.assert_alive();
                billing.assert_alive();
                if applied(db.pool.clone()).await > before && written(&sh) > w_before {
                    break;
                }
                if Instant::now() > deadline {
                    problems.push(format!("{}: no progress within {:?}", $what, $within));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let took = started.elapsed();
            eprintln!(
                "[churn] {} {}: progress again after {:.1}s",
                stamp(),
                $what,
                took.as_secs_f64()
            );
            recoveries.push(format!("{}: {:.1}s", $what, took.as_secs_f64()));
        }};
    }
    macro_rules! await_drained {
        ($what:expr) => {{
            let want = written(&sh);
            let started = Instant::now();
            loop {
                relay.assert_alive();
                billing.assert_alive();
                if applied(db.pool.clone()).await >= want {
                    break;
                }
                if started.elapsed() > Duration::from_secs(240) {
                    problems.push(format!(
                        "{}: not drained within 240 s ({} of {want} applied)",
                        $what,
                        applied(db.pool.clone()).await
                    ));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            eprintln!(
                "[churn] {} {}: {want} applied after {:.1}s",
                stamp(),
                $what,
                started.elapsed().as_secs_f64()
            );
        }};
    }

    await_progress!("start", Duration::from_secs(120));
    let mut skipped_before_reset = Vec::new();
    let mut reset_refusals: Vec<String> = Vec::new();
    for cycle in 0..cycles {
        // Steady flow, then the session pooler (relay, consumer) killed and restarted.
        // Cycle 1: down for 70 s (longer than the 60 s a stall may go unsignalled); cycle 2:
        // frozen (SIGSTOP) for 70 s with every connection open; others: down for 4 s.
        tokio::time::sleep(Duration::from_secs(8)).await;
        if cycle == 2 {
            session.signal("STOP");
            eprintln!(
                "[churn] {} cycle {cycle}: session pooler frozen (SIGSTOP)",
                stamp()
            );
            tokio::time::sleep(Duration::from_secs(70)).await; // the fault's length
            session.signal("CONT");
        } else {
            session.kill9();
            eprintln!("[churn] {} cycle {cycle}: session pooler killed", stamp());
            let outage = if cycle == 1 { 70 } else { 4 };
            tokio::time::sleep(Duration::from_secs(outage)).await; // the fault's length
            session.restart();
        }
        await_progress!(
            format!("cycle {cycle}: session pooler restart"),
            Duration::from_secs(120)
        );
        // The writers' transaction pooler.
        tokio::time::sleep(Duration::from_secs(5)).await;
        txn.kill9();
        eprintln!(
            "[churn] {} cycle {cycle}: transaction pooler killed",
            stamp()
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
        txn.restart();
        await_progress!(
            format!("cycle {cycle}: transaction pooler restart"),
            Duration::from_secs(120)
        );
        tokio::time::sleep(Duration::from_secs(5)).await;

        // Drain, then delete the topic while the writers go on.
        sh.paused.store(true, Ordering::SeqCst);
        until(Duration::from_secs(30), "the writers parked", || async {
            sh.parked.load(Ordering::SeqCst) == n_writers
        })
        .await;
        await_drained!(format!("cycle {cycle}: before the deletion"));
        let skipped0 = metric_sum(
            billing_port,
            "postal_consumer_skipped_total",
            &["reason=\"below_stored_offset\""],
        )
        .unwrap_or(0.0);
        delete_topic(&svc.bootstrap, &orders).await;
        sh.paused.store(false, Ordering::SeqCst);
        eprintln!(
            "[churn] {} cycle {cycle}: topic deleted, writers resumed",
            stamp()
        );
        if cycle % 2 == 1 {
            let mine = create_topic_racing(&svc.bootstrap, &orders).await;
            eprintln!(
                "[churn] {} cycle {cycle}: re-created by {}",
                stamp(),
                if mine { "the test" } else { "the relay" }
            );
        }
        // The consumer stops the topic (or, the failure, goes on past new records).
        let started = Instant::now();
        let stop_line = "stored offset above the partition's high watermark";
        let lines_before = count_logged(&billing.log, stop_line);
        let mut stopped = false;
        while started.elapsed() < Duration::from_secs(180) {
            relay.assert_alive();
            billing.assert_alive();
            if metric_sum(
                billing_port,
                "postal_consumer_partitions_stopped",
                &[&topic_label],
            )
            .unwrap_or(0.0)
                > 0.0
                && count_logged(&billing.log, stop_line) > lines_before
            {
                stopped = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let skipped1 = metric_sum(
            billing_port,
            "postal_consumer_skipped_total",
            &["reason=\"below_stored_offset\""],
        )
        .unwrap_or(0.0);
        skipped_before_reset.push(skipped1 - skipped0);
        eprintln!(
            "[churn] {} cycle {cycle}: stopped={stopped} after {:.1}s; below_stored_offset skips meanwhile {}",
            stamp(),
            started.elapsed().as_secs_f64(),
            skipped1 - skipped0
        );
        if !stopped {
            problems.push(format!(
                "cycle {cycle}: the re-created topic was not stopped within 180 s"
            ));
        }
        if skipped1 > skipped0 {
            problems.push(format!(
                "cycle {cycle}: {} records of the re-created topic skipped as below the stored offset",
                skipped1 - skipped0
            ));
        }
        if cycle == 0 && stopped {
            // The stop outlives a session pooler restart (it is in postal.consumer_stops).
            session.kill9();
            tokio::time::sleep(Duration::from_secs(4)).await;
            session.restart();
            until(
                Duration::from_secs(120),
                "the relay publishing again after the restart",
                || {
                    let before =
                        metric_sum(relay_port, "postal_relay_published_total", &[]).unwrap_or(0.0);
                    async move {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        metric_sum(relay_port, "postal_relay_published_total", &[]).unwrap_or(0.0)
                            > before
                    }
                },
            )
            .await;
            let still = metric_sum(
                billing_port,
                "postal_consumer_partitions_stopped",
                &[&topic_label],
            )
            .unwrap_or(0.0);
            eprintln!("[churn] {} cycle {cycle}: session pooler restarted while stopped; stopped gauge {still}", stamp());
            if still <= 0.0 {
                problems.push("the stop was lost with a session pooler restart".into());
            }
        }
        // The documented way on, through the session pooler.
        operator_window.store(true, Ordering::SeqCst);
        billing.stop();
        // Right after the clean exit: the consumer has left its group.
        let reset_started = Instant::now();
        let mut refusals = 0;
        loop {
            let out = Command::new(bin_dir().join("postal"))
                .args([
                    "consumer",
                    "reset",
                    "--group",
                    &group,
                    "--topic",
                    &orders,
                    "--to",
                    "earliest",
                    "--execute",
                ])
                .env("DATABASE_URL", session.url(&db.name))
                .env("KAFKA_BOOTSTRAP_SERVERS", &svc.bootstrap)
                .env("POSTAL_LOG", "warn")
                .output()
                .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
            if out.status.success() {
                eprintln!("[churn] {} cycle {cycle}: reset: {stdout}", stamp());
                break;
            }
            // Measured (how long it would have taken), then failed below.
            if stderr.contains("live member") && reset_started.elapsed() < Duration::from_secs(120)
            {
                refusals += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            problems.push(format!(
                "cycle {cycle}: postal consumer reset failed: {stderr}"
            ));
            break;
        }
        if refusals > 0 {
            let what = format!(
                "cycle {cycle}: reset refused {refusals} times ('live member') for {:.1}s after the consumer had exited",
                reset_started.elapsed().as_secs_f64()
            );
            eprintln!("[churn] {} {what}", stamp());
            problems.push(what.clone());
            reset_refusals.push(what);
        }
        billing.start();
        operator_window.store(false, Ordering::SeqCst);
        await_progress!(
            format!("cycle {cycle}: after the reset"),
            Duration::from_secs(120)
        );
    }
    tokio::time::sleep(Duration::from_secs(8)).await;
    sh.stop.store(true, Ordering::SeqCst);
    for h in handles {
        h.await.unwrap();
    }
    await_drained!("the end");
    done.store(true, Ordering::SeqCst);
    monitor.await.unwrap();

    // Checks.
    let written_all = sh.written.lock().unwrap().clone();
    let rows: Vec<(i64, String, i32, uuid::Uuid)> =
        sqlx::query_as("SELECT id, customer, seq, event_id FROM ledger ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let mut per_id: HashMap<uuid::Uuid, usize> = HashMap::new();
    for r in &rows {
        *per_id.entry(r.3).or_default() += 1;
    }
    let missing = written_all
        .iter()
        .filter(|w| !per_id.contains_key(&w.2))
        .count();
    let duplicates: usize = per_id.values().map(|n| n - 1).sum();
    let mut last: BTreeMap<&str, i32> = BTreeMap::new();
    let mut out_of_order = Vec::new();
    for (_, customer, seq, _) in &rows {
        let prev = last.entry(customer.as_str()).or_insert(0);
        if *seq <= *prev {
            out_of_order.push(format!("{customer}: {seq} after {prev}"));
        }
        *prev = (*prev).max(*seq);
    }
    let (parked, pending): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'failed'), count(*) FILTER (WHERE status = 'pending') FROM postal.outbox",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    billing.stop();
    relay.stop();
    let stalls = stalls.lock().unwrap();
    let report = format!(
        "cycles {cycles}, session pooler restarts {}, transaction pooler restarts {}, orders written {}, ledger rows {}, \
         missing {missing}, duplicate effects {duplicates}, out of order {} {:?}, parked {parked}, pending {pending}, \
         writer errors {} (ambiguous commits {}), skips below stored offset per cycle {skipped_before_reset:?}, \
         recoveries {recoveries:?}, longest no-progress: consumer {:.0}s relay {:.0}s, stall episodes {:?}, silent {:?}, \
         relay 'relay stalled' lines {}, billing 'consumer stalled' lines {}, stop ERROR lines {}, reset refusals {reset_refusals:?}, problems {problems:?}",
        session.restarts,
        txn.restarts,
        written_all.len(),
        rows.len(),
        out_of_order.len(),
        &out_of_order[..out_of_order.len().min(5)],
        sh.errors.load(Ordering::Relaxed),
        sh.ambiguous.load(Ordering::Relaxed),
        stalls.longest_consumer.as_secs_f64(),
        stalls.longest_relay.as_secs_f64(),
        stalls.episodes,
        stalls.silent,
        count_logged(&relay.log, "relay stalled"),
        count_logged(&billing.log, "consumer stalled"),
        count_logged(&billing.log, "stored offset above the partition's high watermark"),
    );
    eprintln!("[churn] {report}");
    assert!(
        missing == 0
            && duplicates == 0
            && out_of_order.is_empty()
            && parked == 0
            && stalls.silent.is_empty()
            && problems.is_empty(),
        "{report}"
    );
    std::fs::remove_dir_all(&logs).ok();
}
