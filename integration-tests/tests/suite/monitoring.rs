//! What an operator's monitoring sees: each test makes the condition an alert of
//! `deploy/prometheus-alerts.yml` is about, on a running `postal relay` (or consumer process),
//! and watches the metric the alert reads change on its `/metrics`.

use std::path::Path;
use std::time::{Duration, Instant};

use postal_integration_tests::{services, unique};

use crate::procs::{bin_dir, http_get, Proc};

/// The value of a metric (`name` with its labels, as exposed) on `/metrics`, if it is there.
fn metric(port: u16, name: &str) -> Option<f64> {
    let text = http_get(port, "/metrics")?;
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Waits until `check` holds for the metric's value; panics after `within`.
async fn until_metric(
    relay: &mut Proc,
    port: u16,
    name: &str,
    within: Duration,
    check: impl Fn(f64) -> bool,
) {
    let deadline = Instant::now() + within;
    loop {
        if metric(port, name).is_some_and(&check) {
            return;
        }
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "{name} did not reach the expected value within {within:?} (last: {:?})",
            metric(port, name)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A `postal relay` process with metrics on a free port, and that port.
fn relay(
    dir: &Path,
    logs: &Path,
    database_url: &str,
    bootstrap: &str,
    args: &[&str],
) -> (Proc, u16) {
    let port = postal_integration_tests::free_port();
    let mut all = vec!["relay"];
    all.extend_from_slice(args);
    let relay = Proc::new(dir, logs, "relay", "postal", &all).env(&[
        ("DATABASE_URL", database_url.to_owned()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.to_owned()),
        ("POSTAL_METRICS_ADDR", format!("127.0.0.1:{port}")),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ]);
    (relay, port)
}

/// Guarantee (alerts `PostalHistoryMaintenanceFailing`, `PostalRelayChecksFailing`): a relay
/// in history mode whose housekeeping cannot do its work — a long transaction holds the history
/// (a row of today waits in its default partition) and locks the outbox exclusively — reports
/// `postal_relay_history_maintenance_ok 0` and counts the failed checks by kind, logs them,
/// keeps running, and reports 1 once the next maintenance succeeds. (Before, the history
/// failure was only a WARN line, the backlog check waited behind the lock with every gauge at
/// its last value, and neither had a metric.)
#[tokio::test]
async fn failing_housekeeping_shows_on_metrics_until_it_succeeds() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    sqlx::query(
        "INSERT INTO postal.outbox_history (seq, event_id, topic, event_key, event_type,
             schema_version, occurred_at, content_type, payload, headers, attempts,
             created_at, published_at)
         VALUES (0, gen_random_uuid(), 't', 'k', 'e', 1, now(), 'application/json', '',
                 '{}', 0, now(), now())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM postal.outbox_history")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("LOCK TABLE postal.outbox IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (mut relay, port) = relay(
        &dir,
        &logs,
        &db.url,
        &svc.bootstrap,
        &[
            "--history",
            "3d",
            "--lease",
            "20s",
            "--kafka",
            "message.timeout.ms=9000",
        ],
    );
    relay.start();
    let within = Duration::from_secs(60);
    until_metric(
        &mut relay,
        port,
        "postal_relay_history_maintenance_ok",
        within,
        |v| v == 0.0,
    )
    .await;
    until_metric(
        &mut relay,
        port,
        "postal_relay_check_failures_total{check=\"backlog\"}",
        within,
        |v| v >= 1.0,
    )
    .await;
    assert!(relay.logged("history maintenance step failed"));
    assert!(relay.logged("relay housekeeping failed"));
    holder.rollback().await.unwrap();
    // The next maintenance (every 15 s) succeeds.
    until_metric(
        &mut relay,
        port,
        "postal_relay_history_maintenance_ok",
        within,
        |v| v == 1.0,
    )
    .await;
    let in_default: i64 = sqlx::query_scalar("SELECT count(*) FROM postal.outbox_history_default")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(in_default, 0, "today's row moved into today's partition");
    relay.stop();
}

/// Guarantee (alerts `PostalPartitionsUnowned`, `PostalRelayAbsent`): a relay reports the key
/// partitions it owns (256, the whole group, alone); when the database goes away it reports 0
/// once its leases ran out — it owns nothing then, whatever it held — and 256 again once it
/// renews them. (Before, the gauge kept its last value, 256, for as long as the outage lasted.)
#[tokio::test]
async fn partitions_owned_drop_to_zero_once_the_leases_lapse() {
    let svc = services().await;
    let mut pg = postal_integration_tests::private::PrivatePostgres::start().await;
    let db = postal_integration_tests::create_db(&pg.url()).await;
    postal_shared::migrate(&db.pool).await.unwrap();
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (mut relay, port) = relay(
        &dir,
        &logs,
        &db.url,
        &svc.bootstrap,
        &["--lease", "8s", "--kafka", "message.timeout.ms=3000"],
    );
    relay.start();
    let owned = "postal_relay_partitions_owned{group=\"default\"}";
    let within = Duration::from_secs(60);
    until_metric(&mut relay, port, owned, within, |v| v == 256.0).await;
    pg.crash();
    until_metric(&mut relay, port, owned, within, |v| v == 0.0).await;
    pg.restart().await;
    until_metric(&mut relay, port, owned, within, |v| v == 256.0).await;
    relay.stop();
}

/// Guarantee (alert `PostalBatchRecordFailures`): when the broker acknowledged a batch but its
/// commit fails (here a deferred trigger refuses it), the relay counts it
/// (`postal_relay_record_failures_total`), publishes the events again, and once commits go
/// through again the outbox drains. (Before, only a log line said so.)
#[tokio::test]
async fn failed_batch_commits_are_counted() {
    failed_batch_commits_are_counted_with(false).await;
}

/// Guarantee: the same with a WAL relay (`--read-from wal`): a chunk whose mark cannot commit
/// is counted, published again, and the outbox drains once commits go through. (Before, a WAL
/// relay did not count it: the alert never fired.)
#[tokio::test]
async fn failed_batch_commits_are_counted_wal() {
    failed_batch_commits_are_counted_with(true).await;
}

async fn failed_batch_commits_are_counted_with(wal: bool) {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let slot = crate::wal_relay::slot_if(&db, wal).await;
    let topic = postal_integration_tests::unique("record-failures");
    sqlx::query(
        "CREATE FUNCTION postal.refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'commit refused by the test'; END $$",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE CONSTRAINT TRIGGER refuse_commit AFTER DELETE ON postal.outbox
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION postal.refuse_commit()",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    {
        let mut tx = db.pool.begin().await.unwrap();
        let e = postal_producer::NewEvent::json(topic.as_str(), "k", "e", &1).unwrap();
        postal_producer::enqueue(&mut tx, e).await.unwrap();
        tx.commit().await.unwrap();
    }
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let mut args = vec!["--lease", "20s", "--kafka", "message.timeout.ms=9000"];
    if let Some(s) = &slot {
        args.extend([
            "--read-from",
            "wal",
            "--wal-slot",
            s.source.slot.as_str(),
            "--wal-publication",
            s.source.publication.as_str(),
        ]);
    }
    let (mut relay, port) = relay(&dir, &logs, &db.url, &svc.bootstrap, &args);
    relay.start();
    let within = Duration::from_secs(60);
    until_metric(
        &mut relay,
        port,
        "postal_relay_record_failures_total",
        within,
        |v| v >= 1.0,
    )
    .await;
    sqlx::query("DROP TRIGGER refuse_commit ON postal.outbox")
        .execute(&db.pool)
        .await
        .unwrap();
    postal_integration_tests::wait::until(within, "outbox drained", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop();
}

/// An admin client on `bootstrap`.
fn kafka_admin(
    bootstrap: &str,
) -> rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client")
}

/// Creates `topic` (one partition, one replica) with the topic settings `config`.
async fn create_topic_with(bootstrap: &str, topic: &str, config: &[(&str, &str)]) {
    use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
    let mut new = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    for (k, v) in config {
        new = new.set(k, v);
    }
    for r in kafka_admin(bootstrap)
        .create_topics([&new], &AdminOptions::new())
        .await
        .expect("create topic")
    {
        r.expect("topic created");
    }
}

/// Sets the topic settings of `topic` to `config` (the others back to the broker's defaults).
async fn alter_topic(bootstrap: &str, topic: &str, config: &[(&str, &str)]) {
    use rdkafka::admin::{AdminOptions, AlterConfig, ResourceSpecifier};
    let mut alter = AlterConfig::new(ResourceSpecifier::Topic(topic));
    for (k, v) in config {
        alter = alter.set(k, v);
    }
    for r in kafka_admin(bootstrap)
        .alter_configs([&alter], &AdminOptions::new())
        .await
        .expect("alter topic")
    {
        r.expect("topic altered");
    }
}

/// Guarantee (alert `PostalBatchesGivenUp`): a relay whose claim's keep-alive fails while the
/// batch is still in flight (here its producer lingers 8 s before it sends, `linger.ms`, and
/// the test ends the claim's database session with `pg_terminate_backend` meanwhile) gives the
/// batch up, counts it (`postal_relay_batches_given_up_total`), keeps running, and publishes the
/// events with a later claim.
#[tokio::test]
async fn batches_given_up_mid_flight_are_counted() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let topic = postal_integration_tests::unique("given-up");
    {
        let mut tx = db.pool.begin().await.unwrap();
        let e = postal_producer::NewEvent::json(topic.as_str(), "k", "e", &1).unwrap();
        postal_producer::enqueue(&mut tx, e).await.unwrap();
        tx.commit().await.unwrap();
    }
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (mut relay, port) = relay(
        &dir,
        &logs,
        &db.url,
        &svc.bootstrap,
        &[
            "--lease",
            "20s",
            "--kafka",
            "message.timeout.ms=9000",
            "--kafka",
            "linger.ms=8000",
        ],
    );
    relay.start();
    let within = Duration::from_secs(60);
    // The batch is in flight: its claim's transaction stays open, unacknowledged (the keep-alive
    // comes every 5 s).
    let claims = "SELECT pid FROM pg_stat_activity
                  WHERE datname = current_database() AND pid <> pg_backend_pid()
                    AND state LIKE 'idle in transaction%' AND xact_start < now() - interval '1 s'";
    let deadline = Instant::now() + within;
    let claim: Vec<i32> = loop {
        let pids: Vec<i32> = sqlx::query_scalar(claims)
            .fetch_all(&db.pool)
            .await
            .unwrap();
        if !pids.is_empty() {
            break pids;
        }
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "no batch in flight within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for pid in claim {
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    until_metric(
        &mut relay,
        port,
        "postal_relay_batches_given_up_total",
        within,
        |v| v >= 1.0,
    )
    .await;
    assert!(relay.logged("giving up a batch still in flight"));
    postal_integration_tests::wait::until(within, "outbox drained", || async {
        crate::common::outbox_count(&db.pool).await == 0
    })
    .await;
    relay.stop();
}

/// A physical replication slot that a standby's connection holds: its hot-standby feedback
/// sets the slot's `xmin`, as a standby with `hot_standby_feedback = on` does. Dropped (its
/// connection ended first) when the guard is dropped, also when the test fails: slots are the
/// server's, not the test database's.
struct HeldSlot {
    name: String,
    admin_url: String,
    conn: Option<tokio::net::TcpStream>,
}

impl HeldSlot {
    /// Creates slot `name` on the server of `admin_url` and sends feedback with the xmin of a
    /// transaction that has just ended.
    async fn hold(admin_url: &str, name: &str) -> HeldSlot {
        use sqlx::postgres::PgConnectOptions;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut slot = HeldSlot {
            name: name.to_owned(),
            admin_url: admin_url.to_owned(),
            conn: None,
        };
        let opts: PgConnectOptions = admin_url.parse().expect("valid DATABASE_URL");
        let admin = sqlx::PgPool::connect_with(opts.clone()).await.unwrap();
        sqlx::query("SELECT pg_create_physical_replication_slot($1, true)")
            .bind(name)
            .execute(&admin)
            .await
            .unwrap();
        let xid: i64 = sqlx::query_scalar("SELECT txid_current()")
            .fetch_one(&admin)
            .await
            .unwrap();
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
            .fetch_one(&admin)
            .await
            .unwrap();
        admin.close().await;
        // The replication protocol (trust authentication, as the test servers have).
        let mut s = tokio::net::TcpStream::connect((opts.get_host(), opts.get_port()))
            .await
            .expect("connect for replication");
        let mut params = Vec::new();
        for p in ["user", opts.get_username(), "replication", "true", ""] {
            params.extend_from_slice(p.as_bytes());
            params.push(0);
        }
        let mut startup = ((params.len() + 8) as i32).to_be_bytes().to_vec();
        startup.extend_from_slice(&196_608i32.to_be_bytes());
        startup.extend_from_slice(&params);
        s.write_all(&startup).await.unwrap();
        async fn until(s: &mut tokio::net::TcpStream, wanted: u8) {
            loop {
                let kind = s.read_u8().await.expect("replication connection");
                let len = s.read_i32().await.unwrap() as usize;
                let mut body = vec![0; len - 4];
                s.read_exact(&mut body).await.unwrap();
                match kind {
                    b'E' => panic!("replication: {}", String::from_utf8_lossy(&body)),
                    b'R' => assert_eq!(body[..4], [0, 0, 0, 0], "needs trust authentication"),
                    k if k == wanted => return,
                    _ => {}
                }
            }
        }
        until(&mut s, b'Z').await;
        let start = format!("START_REPLICATION SLOT {name} PHYSICAL {lsn}\0");
        let mut query = vec![b'Q'];
        query.extend_from_slice(&((start.len() + 4) as i32).to_be_bytes());
        query.extend_from_slice(start.as_bytes());
        s.write_all(&query).await.unwrap();
        until(&mut s, b'W').await;
        // Hot standby feedback: send time, xmin and its epoch, no catalog xmin.
        let mut feedback = vec![b'h'];
        feedback.extend_from_slice(&0i64.to_be_bytes());
        feedback.extend_from_slice(&(xid as u32).to_be_bytes());
        feedback.extend_from_slice(&((xid >> 32) as u32).to_be_bytes());
        feedback.extend_from_slice(&[0; 8]);
        let mut copy = vec![b'd'];
        copy.extend_from_slice(&((feedback.len() + 4) as i32).to_be_bytes());
        copy.extend_from_slice(&feedback);
        s.write_all(&copy).await.unwrap();
        slot.conn = Some(s);
        slot
    }

    /// Ends the standby's connection and drops the slot.
    fn drop_slot(&mut self) {
        drop(self.conn.take());
        let (url, name) = (self.admin_url.clone(), self.name.clone());
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let admin = sqlx::PgPool::connect(&url)
                    .await
                    .map_err(|e| e.to_string())?;
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    // Its walsender may still be on its way out.
                    sqlx::query(
                        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                         WHERE slot_name = $1 AND active_pid IS NOT NULL",
                    )
                    .bind(&name)
                    .execute(&admin)
                    .await
                    .map_err(|e| e.to_string())?;
                    let r = sqlx::query(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                         WHERE slot_name = $1",
                    )
                    .bind(&name)
                    .execute(&admin)
                    .await;
                    match r {
                        Ok(_) => return Ok(()),
                        Err(e) if Instant::now() > deadline => return Err(e.to_string()),
                        Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop replication slot {}: {dropped:?}", self.name);
        }
        self.admin_url.clear();
    }
}

impl Drop for HeldSlot {
    fn drop(&mut self) {
        if !self.admin_url.is_empty() {
            self.drop_slot();
        }
    }
}

/// Guarantee (alert `PostalReplicationSlotHoldsHorizon`): a physical replication slot whose
/// standby sent hot-standby feedback holds the server's visibility horizon (the slot's
/// `xmin`); the relay reports how many transactions back
/// (`postal_relay_replication_slot_xmin_age` above 0), and 0 again once the slot is dropped.
#[tokio::test]
async fn a_replication_slot_holding_the_horizon_shows_its_age() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (mut relay, port) = relay(
        &dir,
        &logs,
        &db.url,
        &svc.bootstrap,
        // Housekeeping every 2 s (every lease, at most 15 s).
        &["--lease", "2s", "--kafka", "message.timeout.ms=900"],
    );
    relay.start();
    let age = "postal_relay_replication_slot_xmin_age";
    let within = Duration::from_secs(60);
    until_metric(&mut relay, port, age, within, |v| v == 0.0).await;
    let name = format!("postal_test_{}", uuid::Uuid::now_v7().simple());
    let mut slot = HeldSlot::hold(&svc.database_url, &name).await;
    // Transactions go on: the slot holds the horizon further and further back.
    let deadline = Instant::now() + within;
    loop {
        sqlx::query("SELECT txid_current()")
            .execute(&db.pool)
            .await
            .unwrap();
        if metric(port, age).is_some_and(|v| v >= 5.0) {
            break;
        }
        relay.assert_alive();
        assert!(
            Instant::now() < deadline,
            "{age} did not rise within {within:?} (last: {:?})",
            metric(port, age)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    slot.drop_slot();
    until_metric(&mut relay, port, age, within, |v| v == 0.0).await;
    relay.stop();
}

/// Guarantee (alert `PostalDeadLettersUnpublished`): a consumer whose dead letter cannot be
/// published to its `.dlq` topic (here the topic takes no record: `max.message.bytes=1`)
/// keeps it in `postal.dead_letters` and reports it
/// (`postal_consumer_dead_letters_unpublished` above 0), and 0 once the topic takes it and the
/// dead letter is published.
#[tokio::test]
async fn dead_letters_that_cannot_be_published_show_on_metrics() {
    use crate::common::{create_topic, produce, RawRecord};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let orders = postal_integration_tests::unique("orders-unpublished");
    let dlq = format!("{orders}.dlq");
    create_topic(&svc.bootstrap, &orders, 1).await;
    create_topic_with(&svc.bootstrap, &dlq, &[("max.message.bytes", "1")]).await;
    let mut garbage = RawRecord::event(
        uuid::Uuid::now_v7(),
        "k",
        "order.created",
        serde_json::json!({}),
    );
    garbage.payload = b"\x00 not json".to_vec();
    produce(&svc.bootstrap, &orders, None, &[garbage]).await;
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let port = postal_integration_tests::free_port();
    let mut billing = Proc::new(&dir, &logs, "billing", "billing_service", &[]).env(&[
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("ORDERS_TOPIC", orders.clone()),
        (
            "INVOICES_TOPIC",
            postal_integration_tests::unique("invoices"),
        ),
        (
            "POSTAL_CONSUMER_GROUP",
            postal_integration_tests::unique("billing"),
        ),
        ("POSTAL_METRICS_ADDR", format!("127.0.0.1:{port}")),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ]);
    billing.start();
    let unpublished = "postal_consumer_dead_letters_unpublished{consumer=\"billing\"}";
    let within = Duration::from_secs(60);
    until_metric(&mut billing, port, unpublished, within, |v| v >= 1.0).await;
    // Alert `PostalDeadLetters`: the dead letter counts as an event with outcome dead_letter.
    let dead_lettered: f64 = http_get(port, "/metrics")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.starts_with("postal_consumer_events_total{") && l.contains("outcome=\"dead_letter\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        dead_lettered >= 1.0,
        "postal_consumer_events_total{{outcome=\"dead_letter\"}} is {dead_lettered}"
    );
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters WHERE published_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(waiting, 1, "the dead letter is kept");
    alter_topic(&svc.bootstrap, &dlq, &[("max.message.bytes", "1048588")]).await;
    until_metric(&mut billing, port, unpublished, within, |v| v == 0.0).await;
    let published =
        postal_integration_tests::kafka::read_all(&svc.bootstrap, &dlq, 1, within).await;
    assert_eq!(published.len(), 1);
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postal.dead_letters WHERE published_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(waiting, 0);
    billing.stop();
}

/// Guarantee (alerts `PostalEventsParked`, `PostalPublishErrorRate`, `PostalOutboxBacklogHigh`,
/// `PostalSlowProcessing`, `PostalRelayStuck`, `PostalHorizonStalled`): on a running relay, a
/// parked event (a stored row carrying one of Postal's envelope headers) shows as
/// `postal_relay_parked` 1 and counts in `postal_relay_failed_total`; an event that cannot go
/// out (its topic missing, creation off) shows as `postal_relay_backlog` 1 with a growing
/// `postal_relay_oldest_pending_seconds` while `postal_relay_published_total` stays at 0; a
/// transaction left open shows as `postal_relay_oldest_transaction_seconds`.
#[tokio::test]
async fn parked_stuck_and_long_transactions_show_on_relay_metrics() {
    let svc = services().await;
    let db = svc.fresh_db().await;
    let (exists, missing) = (unique("mon-parked"), unique("mon-missing"));
    crate::common::create_topic(&svc.bootstrap, &exists, 1).await;
    for (topic, headers) in [(&exists, r#"{"ce_id": "forged"}"#), (&missing, "{}")] {
        sqlx::query(
            "INSERT INTO postal.outbox (event_id, topic, event_key, event_type, payload, headers)
             VALUES ($1, $2, 'k', 'e', '\\x00', $3::jsonb)",
        )
        .bind(uuid::Uuid::now_v7())
        .bind(topic)
        .bind(headers)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // A transaction left open (it holds an xid).
    let mut open = db.pool.begin().await.unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *open)
        .await
        .unwrap();
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let (mut relay, port) = relay(
        &dir,
        &logs,
        &db.url,
        &svc.bootstrap,
        &[
            "--lease",
            "8s",
            "--kafka",
            "message.timeout.ms=3000",
            "--no-create-topics",
        ],
    );
    relay.start();
    let within = Duration::from_secs(60);
    until_metric(&mut relay, port, "postal_relay_parked", within, |v| {
        v == 1.0
    })
    .await;
    until_metric(&mut relay, port, "postal_relay_failed_total", within, |v| {
        v >= 1.0
    })
    .await;
    until_metric(&mut relay, port, "postal_relay_backlog", within, |v| {
        v == 1.0
    })
    .await;
    until_metric(
        &mut relay,
        port,
        "postal_relay_oldest_pending_seconds",
        within,
        |v| v >= 2.0,
    )
    .await;
    until_metric(
        &mut relay,
        port,
        "postal_relay_oldest_transaction_seconds",
        within,
        |v| v >= 2.0,
    )
    .await;
    assert!(
        metric(port, "postal_relay_published_total").unwrap_or(0.0) == 0.0,
        "nothing was published"
    );
    open.rollback().await.unwrap();
    until_metric(
        &mut relay,
        port,
        "postal_relay_oldest_transaction_seconds",
        within,
        |v| v < 2.0,
    )
    .await;
    relay.stop();
}

/// The values of the metric lines of `/metrics` whose name is `name` and whose labels contain
/// every one of `labels` (each as exposed, `topic="orders"`).
fn metric_values(port: u16, name: &str, labels: &[&str]) -> Vec<f64> {
    let text = http_get(port, "/metrics").unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix('{')?;
            let (set, value) = rest.rsplit_once("} ")?;
            labels
                .iter()
                .all(|want| set.split(',').any(|have| have == *want))
                .then(|| value.trim().parse().ok())?
        })
        .collect()
}

/// Guarantee (alerts `PostalConsumerLagHigh`, `PostalConsumerSlow`): while a consumer's
/// transactions wait (here a session holds its ledger table locked for at least 1.5 s), the
/// records behind them show as `postal_consumer_lag` on its topic, and the waiting transaction
/// shows in `postal_consumer_transaction_seconds` above the 1 s bucket the slow-consumer alert
/// reads; once the lock goes, every event is applied once and the lag falls to 0. (Before, no
/// test watched either metric on a running consumer.)
#[tokio::test]
async fn consumer_lag_and_slow_transactions_show_on_metrics() {
    use crate::common::{create_topic, produce, RawRecord};
    let svc = services().await;
    let db = svc.fresh_db().await;
    let orders = unique("orders-lag");
    create_topic(&svc.bootstrap, &orders, 1).await;
    let order = |n: i64| {
        RawRecord::event(
            uuid::Uuid::now_v7(),
            "c1",
            "order.created",
            serde_json::json!({"order_id": n, "customer": "c1", "seq": n}),
        )
    };
    let dir = bin_dir();
    let logs = dir.join(format!("monitoring-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    let port = postal_integration_tests::free_port();
    let group = unique("billing-lag");
    let mut billing = Proc::new(&dir, &logs, "billing", "billing_service", &[]).env(&[
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", svc.bootstrap.clone()),
        ("ORDERS_TOPIC", orders.clone()),
        ("INVOICES_TOPIC", unique("invoices")),
        ("POSTAL_CONSUMER_GROUP", group.clone()),
        // Statistics (the lag gauge's source) every second instead of every 15 s.
        ("POSTAL_KAFKA", "statistics.interval.ms=1000".into()),
        ("POSTAL_METRICS_ADDR", format!("127.0.0.1:{port}")),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ]);
    billing.start();
    let ledger_rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ledger")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
    };
    // The consumer runs and owns the partition once the first order is booked.
    produce(&svc.bootstrap, &orders, None, &[order(0)]).await;
    let within = Duration::from_secs(60);
    let deadline = Instant::now() + within;
    while ledger_rows().await < 1 {
        billing.assert_alive();
        assert!(Instant::now() < deadline, "the first order was not booked");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE ledger IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let behind: Vec<RawRecord> = (1..=20).map(order).collect();
    produce(&svc.bootstrap, &orders, None, &behind).await;
    let topic_label = format!("topic=\"{orders}\"");
    let lag = || {
        metric_values(port, "postal_consumer_lag", &[&topic_label])
            .iter()
            .sum::<f64>()
    };
    let deadline = Instant::now() + within;
    while lag() < 20.0 {
        billing.assert_alive();
        assert!(
            Instant::now() < deadline,
            "postal_consumer_lag did not show the 20 waiting records (last: {})",
            lag()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The condition the slow-consumer alert is about: the consumer's transaction waits for the
    // lock (seen in pg_stat_activity), and goes on waiting for 1.5 s.
    let deadline = Instant::now() + within;
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        billing.assert_alive();
        assert!(
            Instant::now() < deadline,
            "the consumer never waited for the lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    lock.rollback().await.unwrap();
    let deadline = Instant::now() + within;
    while ledger_rows().await < 21 || lag() > 0.0 {
        billing.assert_alive();
        assert!(
            Instant::now() < deadline,
            "not drained: {} ledger rows, lag {}",
            ledger_rows().await,
            lag()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(ledger_rows().await, 21, "each order booked once");
    let bucket = |le: &str| -> f64 {
        let le = format!("le=\"{le}\"");
        metric_values(
            port,
            "postal_consumer_transaction_seconds_bucket",
            &["consumer=\"billing\"", &topic_label, &le],
        )
        .iter()
        .sum()
    };
    let (under_1s, all) = (bucket("1"), bucket("+Inf"));
    assert!(all >= 2.0, "transactions counted: {all}");
    assert!(
        all - under_1s >= 1.0,
        "no transaction above 1 s in postal_consumer_transaction_seconds ({under_1s} of {all} under 1 s)"
    );
    billing.stop();
}
