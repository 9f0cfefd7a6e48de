//! Broker faults on a replicated cluster: the real binaries (`postal relay`, `order_service`,
//! `billing_service`, `invoice_recorder`) run against a private PostgreSQL and a private
//! 3-node Apache Kafka cluster (every node broker and controller, topics replicated 3 times,
//! `min.insync.replicas=2`) while the test kill -9s brokers under load.
//!
//! Guarantee proved: through a partition leader's death, one broker down for a while, two of
//! three down (no in-sync quorum, no controller quorum) and the controller quorum's leader's
//! death, every order committed has exactly one ledger row and one invoice record, per-customer
//! order holds in the effects and on the wire (read back by an independent client), nothing is
//! parked or dead-lettered (an outage is never a reason to give up on an event), and the flow
//! resumes by itself after each fault.
//!
//! `..._short` (12,000 orders at 60/s) runs in `scripts/test.sh`'s fault step, after the suite; the full
//! run (20,000 orders) is ignored by default: `cargo test -p postal-integration-tests --test
//! suite -- --ignored --nocapture cluster::` after `cargo build -p postal-cli -p postal-demo`
//! (the services are the demo's, `demo/src/bin/`). `POSTAL_CLUSTER_ORDERS` (default 20,000) and `POSTAL_CLUSTER_RATE`
//! (orders/s, default 150) tune it. `..._read_from_the_wal` (ignored too) is the short run with
//! the relay reading the WAL.

use std::time::{Duration, Instant};

use postal_integration_tests::private::{PrivateCluster, PrivatePostgres};
use postal_integration_tests::{create_db, unique};
use sqlx::PgPool;

use crate::procs::{bin_dir, check_wire, env_u64, records_in, scalar, wal_flags, Proc};

/// The processes of one run, so that the test can keep checking they are alive.
struct Services {
    /// Orders the generator writes in all.
    orders: i64,
    relay: Proc,
    billing: Proc,
    invoices: Proc,
    generator: Proc,
}

impl Services {
    fn assert_alive(&mut self) {
        self.relay.assert_alive();
        self.billing.assert_alive();
        self.invoices.assert_alive();
        self.generator.assert_alive_or_finished();
    }
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    scalar(pool, &format!("SELECT count(*) FROM {table}"))
        .await
        .unwrap_or(0)
}

/// Waits until the ledger and the invoices both hold at least `more` rows more than `from`
/// (the flow goes on), checking the services meanwhile; returns how long that took.
async fn flows(
    pool: &PgPool,
    svc: &mut Services,
    from: (i64, i64),
    more: i64,
    within: Duration,
    what: &str,
) -> Duration {
    let t = Instant::now();
    // Never more than the orders there will be (a slow run can reach the last fault late).
    let total = svc.orders;
    loop {
        svc.assert_alive();
        let (l, i) = (count(pool, "ledger").await, count(pool, "invoices").await);
        if l >= (from.0 + more).min(total) && i >= (from.1 + more).min(total) {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < within,
            "{what}: the flow did not go on within {within:?} (ledger {l}, invoices {i}, from {from:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn progress(pool: &PgPool) -> (i64, i64) {
    (count(pool, "ledger").await, count(pool, "invoices").await)
}

/// Waits until `n` orders are committed.
async fn orders_reach(pool: &PgPool, svc: &mut Services, n: i64) {
    let t = Instant::now();
    while count(pool, "orders").await < n {
        svc.assert_alive();
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "orders stalled below {n}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The node leading partition 0 of `topic` now.
fn leader_of(bootstrap: &str, topic: &str) -> Option<u8> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .ok()?;
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .ok()?;
    let t = md.topics().iter().find(|t| t.name() == topic)?;
    let p = t.partitions().iter().find(|p| p.id() == 0)?;
    u8::try_from(p.leader()).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "three broker JVMs, minutes long: run with --ignored (see the module's documentation)"]
async fn broker_faults_on_a_three_node_cluster_lose_nothing() {
    broker_faults(
        env_u64("POSTAL_CLUSTER_ORDERS", 20_000),
        env_u64("POSTAL_CLUSTER_RATE", 150),
        false,
    )
    .await;
}

/// The same four faults with 12,000 orders at 60/s (so that orders still flow through the
/// last fault): the version CI runs (on its own, after the suite).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_faults_on_a_three_node_cluster_lose_nothing_short() {
    broker_faults(12_000, 60, false).await;
}

/// The short run's faults with the relay reading the WAL (`postal relay --read-from wal`, one
/// slot for both hops' outbox rows): the same guarantees. Ignored by default (three broker
/// JVMs, about five minutes; CI's fault step runs the polling one): `cargo test -p
/// postal-integration-tests --test suite -- --ignored --nocapture cluster::broker_faults_on_a_three_node_cluster_lose_nothing_read_from_the_wal`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "three broker JVMs, minutes long: run with --ignored (see the module's documentation)"]
async fn broker_faults_on_a_three_node_cluster_lose_nothing_read_from_the_wal() {
    broker_faults(
        env_u64("POSTAL_CLUSTER_ORDERS", 12_000),
        env_u64("POSTAL_CLUSTER_RATE", 60),
        true,
    )
    .await;
}

async fn broker_faults(orders: u64, rate: u64, wal: bool) {
    // Orders the flow must make while one node is down.
    let one_down = (orders as i64 / 10).min(2_000);
    let pg = PrivatePostgres::start().await;
    let mut cluster = PrivateCluster::start().await;
    let db = create_db(&pg.url()).await;
    // As an operator would: the schema first (a relay refuses to start without it).
    postal_shared::migrate(&db.pool).await.expect("migrate");
    let bootstrap = cluster.bootstrap();
    let (orders_topic, invoices_topic) = (unique("cluster-orders"), unique("cluster-invoices"));
    for t in [&orders_topic, &invoices_topic] {
        crate::common::create_topic_replicated(&bootstrap, t, 6, 3).await;
    }
    let dir = bin_dir();
    let logs = dir.join(format!("cluster-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    eprintln!(
        "cluster: {orders} orders at {rate}/s through a 3-node cluster, relay {}, logs in {}",
        if wal { "reading the WAL" } else { "polling" },
        logs.display()
    );
    let slot = unique("cluster_slot").replace('-', "_");
    let mut relay_args = vec!["relay", "--topic-replication", "3"];
    if wal {
        relay_args.extend(wal_flags(&db.pool, &slot).await);
    }
    let common = [
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.clone()),
        ("ORDERS_TOPIC", orders_topic.clone()),
        ("INVOICES_TOPIC", invoices_topic.clone()),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ];
    // Postal's defaults (idempotent producer, acks=all); consumers with a 6 s session timeout.
    let consumer_env = [(
        "POSTAL_KAFKA",
        "session.timeout.ms=6000,heartbeat.interval.ms=1000".to_string(),
    )];
    let mut svc = Services {
        orders: orders as i64,
        relay: Proc::new(&dir, &logs, "relay", "postal", &relay_args).env(&common),
        billing: Proc::new(&dir, &logs, "billing", "billing_service", &[])
            .env(&common)
            .env(&consumer_env),
        invoices: Proc::new(&dir, &logs, "invoices", "invoice_recorder", &[])
            .env(&common)
            .env(&consumer_env)
            .env(&[("POSTAL_MAX_BATCH", "50".into())]),
        generator: Proc::new(&dir, &logs, "order_service", "order_service", &[])
            .env(&common)
            .env(&[
                ("ORDERS", orders.to_string()),
                ("ORDER_RATE", rate.to_string()),
                ("CUSTOMERS", "200".into()),
            ]),
    };
    svc.relay.start();
    svc.billing.start();
    svc.invoices.start();
    svc.generator.start();
    let started = Instant::now();
    let pool = &db.pool;
    let at = |t: Instant| t.duration_since(started).as_secs_f64();
    let mut report = Vec::new();
    let o = orders as i64;

    // 1. The leader of the orders topic's partition 0 dies mid-stream, and comes back.
    orders_reach(pool, &mut svc, o / 8).await;
    let leader = leader_of(&bootstrap, &orders_topic).expect("a leader");
    let before = progress(pool).await;
    let t = Instant::now();
    cluster.kill(leader);
    eprintln!(
        "  {:>6.1}s kill -9 node {leader}, leader of the orders topic's partition 0",
        at(t)
    );
    let took = flows(
        pool,
        &mut svc,
        before,
        500,
        Duration::from_secs(120),
        "leader killed",
    )
    .await;
    report.push(format!("partition leader (node {leader}) killed: 500 more orders through both hops {:.1} s after the kill", took.as_secs_f64()));
    cluster.restart(leader).await;
    eprintln!("  {:>6.1}s node {leader} back", at(Instant::now()));

    // 2. One node down for a while: the flow goes on with two of three.
    orders_reach(pool, &mut svc, o * 3 / 8).await;
    let down = if leader == 3 { 2 } else { 3 };
    let before = progress(pool).await;
    cluster.kill(down);
    eprintln!(
        "  {:>6.1}s kill -9 node {down}; it stays down",
        at(Instant::now())
    );
    let took = flows(
        pool,
        &mut svc,
        before,
        one_down,
        Duration::from_secs(180),
        "one node down",
    )
    .await;
    report.push(format!(
        "one node (node {down}) down: {one_down} more orders through both hops in {:.1} s",
        took.as_secs_f64()
    ));

    // 3. A second node down: no in-sync quorum and no controller quorum. Relays and consumers
    // wait (not enough replicas is an outage, never a reason to park); nothing is parked or
    // dead-lettered; both nodes come back and the flow resumes.
    let second = (1..=3u8)
        .find(|&n| n != down && cluster.running().contains(&n))
        .expect("a node");
    cluster.kill(second);
    let t = Instant::now();
    eprintln!("  {:>6.1}s kill -9 node {second}: two of three down", at(t));
    while t.elapsed() < Duration::from_secs(20) {
        svc.assert_alive();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let parked = scalar(
        pool,
        "SELECT count(*) FROM postal.outbox WHERE status = 'failed'",
    )
    .await;
    let dead = scalar(pool, "SELECT count(*) FROM postal.dead_letters").await;
    let pending = scalar(pool, "SELECT count(*) FROM postal.outbox").await;
    eprintln!("  {:>6.1}s after 20 s with two down: outbox {pending:?}, parked {parked:?}, dead letters {dead:?}", at(Instant::now()));
    assert_eq!(parked, Some(0), "an outage parked events");
    assert_eq!(dead, Some(0), "an outage dead-lettered events");
    let before = progress(pool).await;
    let back = Instant::now();
    cluster.restart(second).await;
    cluster.restart(down).await;
    eprintln!(
        "  {:>6.1}s nodes {second} and {down} back",
        at(Instant::now())
    );
    flows(
        pool,
        &mut svc,
        before,
        500,
        Duration::from_secs(180),
        "two nodes back",
    )
    .await;
    report.push(format!("two of three down for 20 s (outbox {} rows waiting, 0 parked, 0 dead letters): 500 more orders through both hops {:.1} s after the restarts began", pending.unwrap_or(0), back.elapsed().as_secs_f64()));

    // 4. The controller quorum's leader dies.
    orders_reach(pool, &mut svc, o * 3 / 4).await;
    let quorum_leader = cluster.quorum_leader().expect("a quorum leader");
    let before = progress(pool).await;
    cluster.kill(quorum_leader);
    eprintln!(
        "  {:>6.1}s kill -9 node {quorum_leader}, leader of the controller quorum",
        at(Instant::now())
    );
    let took = flows(
        pool,
        &mut svc,
        before,
        500,
        Duration::from_secs(120),
        "quorum leader killed",
    )
    .await;
    report.push(format!("controller quorum leader (node {quorum_leader}) killed: 500 more orders through both hops {:.1} s after the kill", took.as_secs_f64()));
    cluster.restart(quorum_leader).await;

    // Drain.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        svc.assert_alive();
        let (l, i) = progress(pool).await;
        let outbox = count(pool, "postal.outbox").await;
        if svc.generator.finished() && l == o && i == o && outbox == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not drained: ledger {l}, invoices {i}, outbox {outbox}; logs in {}",
            logs.display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let total = at(Instant::now());
    svc.billing.stop();
    svc.invoices.stop();
    svc.relay.stop();

    let q = |sql: &'static str| async move { scalar(pool, sql).await.expect(sql) };
    let not_once = q("SELECT count(*) FROM orders o
         WHERE (SELECT count(*) FROM ledger l WHERE l.order_id = o.id) <> 1
            OR (SELECT count(*) FROM invoices i WHERE i.order_id = o.id) <> 1")
    .await;
    let out_of_order = q("SELECT count(*) FROM (
             SELECT seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) AS prev FROM ledger
             UNION ALL
             SELECT seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) AS prev FROM invoices) s
         WHERE prev IS NOT NULL AND seq <> prev + 1")
    .await;
    let parked = q("SELECT count(*) FROM postal.outbox WHERE status = 'failed'").await;
    let dead = q("SELECT count(*) FROM postal.dead_letters").await;
    let order_ids: std::collections::BTreeSet<String> =
        sqlx::query_scalar::<_, String>("SELECT id::text FROM orders")
            .fetch_all(pool)
            .await
            .expect("order ids")
            .into_iter()
            .collect();
    let (b, ot, it) = (
        bootstrap.clone(),
        orders_topic.clone(),
        invoices_topic.clone(),
    );
    let (in_orders, in_invoices) =
        tokio::task::spawn_blocking(move || (records_in(&b, &ot), records_in(&b, &it)))
            .await
            .expect("watermarks");
    let wire_orders = check_wire(&bootstrap, &orders_topic, in_orders, &order_ids).await;
    let wire_invoices = check_wire(&bootstrap, &invoices_topic, in_invoices, &order_ids).await;

    eprintln!("cluster report:");
    eprintln!("  orders {orders}, drained after {total:.1} s");
    for line in &report {
        eprintln!("  {line}");
    }
    for (name, w) in [("orders", &wire_orders), ("invoices", &wire_invoices)] {
        eprintln!(
            "  read back ({name}): {} records, {} distinct orders, {} missing, {} first seen out of order",
            w.records, w.distinct, w.missing, w.out_of_order.len()
        );
    }
    eprintln!("  effects: orders not applied exactly once {not_once}, out of order {out_of_order}, parked {parked}, dead letters {dead}");
    assert_eq!(
        not_once, 0,
        "orders without exactly one ledger row and one invoice"
    );
    assert_eq!(out_of_order, 0, "effects applied out of per-customer order");
    assert_eq!((parked, dead), (0, 0), "parked or dead-lettered");
    for (name, w) in [("orders", &wire_orders), ("invoices", &wire_invoices)] {
        assert_eq!(w.missing, 0, "{name}: orders missing on the wire");
        assert!(
            w.out_of_order.is_empty(),
            "{name}: per-customer order broken on the wire: {:?}",
            &w.out_of_order[..w.out_of_order.len().min(5)]
        );
    }
}
