//! Network partitions between hosts: PostgreSQL and the Kafka broker on one test host, two
//! relays and two consumer hosts (each running `billing_service` and `invoice_recorder`) on
//! hosts of their own (network namespaces joined by a bridge; see
//! `postal_integration_tests::hosts`), the order service on the server host. While orders flow:
//!
//! 1. a relay host and a consumer host get a slow link (1 Mbit/s token bucket with a deep
//!    queue, so latency grows with the traffic: this kernel has no netem) for 30 s: no lease
//!    or partition changes hands. (At 512 kbit/s the link saturates and drops; with the 6 s
//!    session timeout used here each consumer group then rebalanced once, losing nothing.)
//!    1b. then the same two hosts' database links get 200 ms added each way (a delaying proxy
//!    on each host: real latency, no bandwidth limit) for 30 s: nothing changes hands either.
//! 2. the other relay host is cut off (its link leaves the bridge: silence, no reset) while it
//!    holds key-partition leases and claimed rows; the first relay must take its partitions
//!    over once the leases run out, and when the link comes back the cut-off relay must
//!    neither publish a key's events out of order nor make anything apply twice;
//! 3. the other consumer host is cut off while its consumers hold partitions and transactions;
//!    the group moves on without it (every partition advances again within
//!    `lost_connection_timeout`) and its late commits are fenced.
//!
//! Guarantee proved: every order has exactly one ledger row and one invoice, per-customer order
//! holds in both tables and on both topics (independent reader), nothing is parked or
//! dead-lettered; plus the recovery times and the number of ownership changes while slow.
//!
//! Needs root and iproute2 (it says so and does nothing otherwise), and the binaries
//! `scripts/test.sh` builds. Knobs: `POSTAL_NETSPLIT_ORDERS` (default 15,000),
//! `POSTAL_NETSPLIT_RATE` (orders/s, default 100).

use std::time::{Duration, Instant};

use postal_integration_tests::delay::DelayProxy;
use postal_integration_tests::hosts::TestHosts;
use postal_integration_tests::private::HostStack;
use postal_integration_tests::{create_db, unique};
use sqlx::PgPool;

use crate::common::create_topic;
use crate::procs::{bin_dir, check_wire, env_u64, records_in, scalar, Proc};

/// Key partitions (of 256) by lease owner, and whether every lease is current.
/// The delay phase 1b adds each way on a database link.
const LONG_LINK: Duration = Duration::from_millis(200);

async fn lease_owners(pool: &PgPool) -> (Vec<(String, i64)>, bool) {
    let owners: Vec<(String, i64)> = sqlx::query_as(
        "SELECT coalesce(owner::text, '-'), count(*) FROM postal.relay_partitions
         WHERE lease_until > now() GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let current = owners.iter().map(|(_, n)| n).sum::<i64>() == 256;
    (owners, current)
}

/// Sum of the consumer partitions' fencing epochs: it grows by one per takeover.
async fn epochs(pool: &PgPool) -> i64 {
    scalar(
        pool,
        "SELECT coalesce(sum(epoch), 0)::bigint FROM postal.consumer_offsets",
    )
    .await
    .unwrap_or(0)
}

/// Which relay holds each key partition.
async fn lease_map(pool: &PgPool) -> Vec<(i16, Option<uuid::Uuid>)> {
    sqlx::query_as("SELECT key_partition, owner FROM postal.relay_partitions ORDER BY 1")
        .fetch_all(pool)
        .await
        .unwrap_or_default()
}

/// Waits (up to 120 s) until no consumer partition changed hands for 15 s; how long it took.
async fn settle(pool: &PgPool) -> Option<Duration> {
    let start = Instant::now();
    let mut last = (epochs(pool).await, Instant::now());
    while start.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let e = epochs(pool).await;
        if e != last.0 {
            last = (e, Instant::now());
        }
        if last.1.elapsed() >= Duration::from_secs(15) {
            return Some(start.elapsed());
        }
    }
    None
}

/// Every consumer partition's stored offset, by "group topic[partition]".
async fn positions(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT group_id || ' ' || topic || '[' || partition || ']', coalesce(next_offset, 0)
         FROM postal.consumer_offsets ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default()
}

/// Wall time of one `SELECT 1` through `psql` from `host` to the database (connection set-up
/// included): how slow the host's link is.
fn psql_time(hosts: &TestHosts, host: &str, url: &str) -> Duration {
    let start = Instant::now();
    let out = hosts
        .command(host, "psql")
        .args([url, "-qAtc", "SELECT 1"])
        .output()
        .expect("psql");
    assert!(
        out.status.success(),
        "psql from {host}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    start.elapsed()
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    scalar(pool, &format!("SELECT count(*) FROM {table}"))
        .await
        .unwrap_or(-1)
}

/// Polls `check` every 250 ms until it holds; returns how long that took, or `None` after
/// `within`.
async fn time_until<F, Fut>(within: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < within {
        if check().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

#[test]
fn cut_and_slow_links_between_hosts_lose_and_double_nothing() {
    if let Err(why) = TestHosts::available() {
        eprintln!("netsplit NOT RUN: {why}");
        return;
    }
    let hosts = TestHosts::create(&["srv", "relay1", "relay2", "cons1", "cons2"]);
    let stack = HostStack::start(hosts.netns("srv"), hosts.addr("srv"));
    // The test's own clients (its database pool, its Kafka reader) run on the server host,
    // from a thread of their own: the thread's namespace changes, no other test's.
    std::thread::scope(|s| {
        s.spawn(|| {
            hosts.enter("srv");
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(run(&hosts, &stack));
        });
    });
}

async fn run(hosts: &TestHosts, stack: &HostStack) {
    let orders = env_u64("POSTAL_NETSPLIT_ORDERS", 15_000);
    let rate = env_u64("POSTAL_NETSPLIT_RATE", 100);
    let db = create_db(&stack.database_url()).await;
    // As an operator would: the schema first (a relay refuses to start without it).
    postal_shared::migrate(&db.pool).await.expect("migrate");
    let bootstrap = stack.bootstrap();
    let (orders_topic, invoices_topic) = (unique("split-orders"), unique("split-invoices"));
    create_topic(&bootstrap, &orders_topic, 6).await;
    create_topic(&bootstrap, &invoices_topic, 6).await;

    let dir = bin_dir();
    let logs = dir.join(format!("netsplit-{}", db.name));
    std::fs::create_dir_all(&logs).expect("log dir");
    eprintln!(
        "netsplit: {orders} orders at {rate}/s; server {}, logs in {}",
        hosts.addr("srv"),
        logs.display()
    );
    let common = [
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS", bootstrap.clone()),
        ("ORDERS_TOPIC", orders_topic.clone()),
        ("INVOICES_TOPIC", invoices_topic.clone()),
        ("RUST_LOG", "info,rdkafka=warn".into()),
    ];
    // The chaos suite's failover settings (CONTRIBUTING.md, "Settings the tests change, and why").
    let consumer_env = [(
        "POSTAL_KAFKA",
        "session.timeout.ms=6000,heartbeat.interval.ms=1000".to_string(),
    )];
    let relay_args = [
        "relay",
        "--lease",
        "20s",
        "--kafka",
        "message.timeout.ms=9000",
    ];
    let relay = |name: &str| {
        Proc::new(&dir, &logs, name, "postal", &relay_args)
            .env(&common)
            .on_host(hosts.netns(name))
    };
    let consumer = |host: &str, program: &str, extra: &[(&str, String)]| {
        Proc::new(&dir, &logs, &format!("{program}-{host}"), program, &[])
            .env(&common)
            .env(&consumer_env)
            .env(extra)
            .on_host(hosts.netns(host))
    };
    let batch = [("POSTAL_MAX_BATCH", "50".to_string())];
    // relay2 and cons2 reach the database through a delaying proxy on their own host (no
    // delay until phase 1b); their links are never cut.
    let upstream = format!("{}:5432", hosts.addr("srv"));
    let relay2_db = DelayProxy::start(hosts.netns("relay2"), &upstream);
    let cons2_db = DelayProxy::start(hosts.netns("cons2"), &upstream);
    let via = |proxy: &DelayProxy| {
        let url = format!("postgres://postgres@127.0.0.1:{}/{}", proxy.port, db.name);
        [("DATABASE_URL", url)]
    };
    let (relay2_url, cons2_url) = (via(&relay2_db), via(&cons2_db));
    let mut batch2 = batch.to_vec();
    batch2.extend(cons2_url.iter().cloned());
    let mut procs = vec![
        relay("relay1"),
        relay("relay2").env(&relay2_url),
        consumer("cons1", "billing_service", &[]),
        consumer("cons2", "billing_service", &cons2_url),
        consumer("cons1", "invoice_recorder", &batch),
        consumer("cons2", "invoice_recorder", &batch2),
    ];
    let mut generator = Proc::new(&dir, &logs, "order_service", "order_service", &[])
        .env(&common)
        .env(&[
            ("ORDERS", orders.to_string()),
            ("ORDER_RATE", rate.to_string()),
            ("CUSTOMERS", "200".into()),
        ])
        .on_host(hosts.netns("srv"));
    for p in &mut procs {
        p.start();
    }
    generator.start();
    let started = Instant::now();
    let pool = &db.pool;
    let at = || started.elapsed().as_secs_f64();

    // Both relays hold leases and both hops are applying.
    let warm = time_until(Duration::from_secs(120), || async {
        let (owners, _) = lease_owners(pool).await;
        owners.len() == 2 && count(pool, "invoices").await > 200
    })
    .await;
    assert!(
        warm.is_some(),
        "both relays leasing and invoices flowing within 120 s"
    );

    // 1. Slow links that do not cut: no ownership changes hands.
    // Both groups settled first (their members' joins done): no partition changing hands
    // for 15 s.
    let settled = settle(pool).await;
    eprintln!("  {:>6.1}s groups settled after {settled:?}", at());
    assert!(settled.is_some(), "consumer groups settled");
    let (leases_before, epochs_slow) = (lease_map(pool).await, epochs(pool).await);
    let ledger_slow = count(pool, "ledger").await;
    let psql_url = format!("postgres://postgres@{}:5432/{}", hosts.addr("srv"), db.name);
    let fast_rtt = psql_time(hosts, "relay2", &psql_url);
    hosts.slow("relay2", "1mbit");
    hosts.slow("cons2", "1mbit");
    eprintln!(
        "  {:>6.1}s relay2 and cons2 on 1 Mbit/s links for 30 s",
        at()
    );
    tokio::time::sleep(Duration::from_secs(15)).await;
    let slow_rtt = psql_time(hosts, "relay2", &psql_url);
    tokio::time::sleep(Duration::from_secs(15)).await;
    let leases_moved = lease_map(pool)
        .await
        .iter()
        .zip(&leases_before)
        .filter(|(a, b)| a.1 != b.1)
        .count();
    let takeovers = epochs(pool).await - epochs_slow;
    let applied_slow = count(pool, "ledger").await - ledger_slow;
    hosts.fast("relay2");
    hosts.fast("cons2");
    eprintln!(
        "  {:>6.1}s links fast again: {leases_moved} key partitions and {takeovers} consumer partitions changed hands while slow; {applied_slow} orders billed meanwhile; psql SELECT 1 from relay2 {fast_rtt:?} fast, {slow_rtt:?} slow",
        at()
    );

    // 1b. A long link that does not cut: 200 ms added each way between relay2 (and cons2) and
    // the database, for 30 s. Nothing changes hands.
    let (leases_before, epochs_long) = (lease_map(pool).await, epochs(pool).await);
    let ledger_long = count(pool, "ledger").await;
    let proxied_url = &relay2_url[0].1;
    let near_rtt = psql_time(hosts, "relay2", proxied_url);
    relay2_db.set_delay(LONG_LINK);
    cons2_db.set_delay(LONG_LINK);
    eprintln!(
        "  {:>6.1}s relay2 and cons2 {LONG_LINK:?} each way from the database for 30 s",
        at()
    );
    tokio::time::sleep(Duration::from_secs(15)).await;
    let far_rtt = psql_time(hosts, "relay2", proxied_url);
    tokio::time::sleep(Duration::from_secs(15)).await;
    let leases_moved_long = lease_map(pool)
        .await
        .iter()
        .zip(&leases_before)
        .filter(|(a, b)| a.1 != b.1)
        .count();
    let takeovers_long = epochs(pool).await - epochs_long;
    let applied_long = count(pool, "ledger").await - ledger_long;
    relay2_db.set_delay(Duration::ZERO);
    cons2_db.set_delay(Duration::ZERO);
    eprintln!(
        "  {:>6.1}s database links near again: {leases_moved_long} key partitions and {takeovers_long} consumer partitions changed hands while far; {applied_long} orders billed meanwhile; psql SELECT 1 from relay2 {near_rtt:?} near, {far_rtt:?} far",
        at()
    );

    // 2. Relay host cut off with claims in flight.
    let claimed_before = lease_map(pool).await;
    let in_flight = crate::procs::wait_for_claims_in_flight(pool).await;
    hosts.cut("relay1");
    eprintln!(
        "  {:>6.1}s relay1 cut off ({in_flight} outbox rows claimed somewhere)",
        at()
    );
    let takeover = time_until(Duration::from_secs(90), || async {
        let (owners, current) = lease_owners(pool).await;
        owners.len() == 1 && current
    })
    .await;
    let moved = lease_map(pool)
        .await
        .iter()
        .zip(&claimed_before)
        .filter(|(a, b)| a.1 != b.1)
        .count();
    eprintln!(
        "  {:>6.1}s relay2 holds all 256 key partitions ({moved} moved) after {:?}",
        at(),
        takeover
    );
    assert!(takeover.is_some(), "relay2 took relay1's partitions over");
    // Orders keep flowing through relay2 alone for a while, then the link comes back.
    let invoices_before = count(pool, "invoices").await;
    let flowing = time_until(Duration::from_secs(60), || async {
        count(pool, "invoices").await > invoices_before + 300
    })
    .await;
    assert!(flowing.is_some(), "events flow while relay1 is cut off");
    hosts.heal("relay1");
    let rejoined = time_until(Duration::from_secs(90), || async {
        lease_owners(pool).await.0.len() == 2
    })
    .await;
    eprintln!(
        "  {:>6.1}s relay1's link back; it leases again after {:?}",
        at(),
        rejoined
    );

    // 3. Consumer host cut off while its consumers hold partitions and transactions: catch
    // cons1's services with a transaction open (freeze them, check, cut, thaw), so the cut
    // always leaves a transaction behind on the server.
    let epochs_before = epochs(pool).await;
    let open_from_cons1 = format!(
        "SELECT count(*) FROM pg_stat_activity
         WHERE client_addr = '{}' AND state LIKE 'idle in transaction%'",
        hosts.addr("cons1")
    );
    let cons1 = [2usize, 4];
    let mut caught = false;
    for _ in 0..200 {
        for &i in &cons1 {
            procs[i].signal("STOP");
        }
        if scalar(pool, &open_from_cons1).await.unwrap_or(0) > 0 {
            caught = true;
            break;
        }
        for &i in &cons1 {
            procs[i].signal("CONT");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(caught, "cons1 never had a transaction open");
    hosts.cut("cons1");
    let stuck = scalar(pool, &open_from_cons1).await;
    for &i in &cons1 {
        procs[i].signal("CONT");
    }
    let cut_at = Instant::now();
    eprintln!("  {:>6.1}s cons1 cut off", at());
    // The group moves on: cons2 takes the partitions over (epochs move), and then every
    // partition of both groups advances while cons1 is still cut off — including those whose
    // transactions cons1 left open, holding their offset rows.
    let moved_on = time_until(Duration::from_secs(60), || async {
        epochs(pool).await > epochs_before
    })
    .await;
    let positions_then = positions(pool).await;
    let all_moving = time_until(Duration::from_secs(40), || async {
        let now = positions(pool).await;
        !now.is_empty()
            && now.len() == positions_then.len()
            && now.iter().zip(&positions_then).all(|(a, b)| a.1 > b.1)
    })
    .await;
    let cut_for = cut_at.elapsed();
    let lagging: Vec<String> = positions(pool)
        .await
        .iter()
        .zip(&positions_then)
        .filter(|(a, b)| a.1 <= b.1)
        .map(|(a, _)| a.0.clone())
        .collect();
    eprintln!(
        "  {:>6.1}s cons2 took partitions over after {moved_on:?}; every partition advancing without cons1: {all_moving:?} later (cons1 left {stuck:?} transactions open; not advancing: {lagging:?})",
        at()
    );
    // Keep the cut long enough for any open transaction of cons1 to be noticed.
    if cut_for < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_secs(30) - cut_for).await;
    }
    hosts.heal("cons1");
    eprintln!(
        "  {:>6.1}s cons1's link back after {:.1} s",
        at(),
        cut_at.elapsed().as_secs_f64()
    );
    assert!(
        moved_on.is_some(),
        "the consumer group moved on without cons1"
    );
    assert!(
        all_moving.is_some(),
        "partitions stalled while cons1 was cut off: {lagging:?}"
    );

    // Drain.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        for p in &mut procs {
            p.assert_alive();
        }
        generator.assert_alive_or_finished();
        let o = count(pool, "orders").await;
        let l = count(pool, "ledger").await;
        let i = count(pool, "invoices").await;
        let outbox = count(pool, "postal.outbox").await;
        let want = orders as i64;
        if generator.finished() && o == want && l == want && i == want && outbox == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not drained: orders {o}, ledger {l}, invoices {i}, outbox {outbox}; logs in {}",
            logs.display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drained = at();
    for p in &mut procs {
        p.stop();
    }

    let q = |sql: &'static str| async move { scalar(pool, sql).await.expect(sql) };
    let not_once = q("SELECT count(*) FROM orders o
         WHERE (SELECT count(*) FROM ledger l WHERE l.order_id = o.id) <> 1
            OR (SELECT count(*) FROM invoices i WHERE i.order_id = o.id) <> 1")
    .await;
    let (ledger_rows, invoice_rows) = (count(pool, "ledger").await, count(pool, "invoices").await);
    let out_of_order = q("SELECT count(*) FROM (
             SELECT seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) AS prev FROM ledger
             UNION ALL
             SELECT seq, lag(seq) OVER (PARTITION BY customer ORDER BY id) AS prev FROM invoices) s
         WHERE prev IS NOT NULL AND seq <> prev + 1")
    .await;
    let parked = q("SELECT count(*) FROM postal.outbox WHERE held OR status = 'failed'").await;
    let dead = q("SELECT count(*) FROM postal.dead_letters").await;
    let order_ids: std::collections::BTreeSet<String> =
        sqlx::query_scalar::<_, String>("SELECT id::text FROM orders")
            .fetch_all(pool)
            .await
            .expect("order ids")
            .into_iter()
            .collect();
    let in_orders = records_in(&bootstrap, &orders_topic);
    let in_invoices = records_in(&bootstrap, &invoices_topic);
    let wire_orders = check_wire(&bootstrap, &orders_topic, in_orders, &order_ids).await;
    let wire_invoices = check_wire(&bootstrap, &invoices_topic, in_invoices, &order_ids).await;
    eprintln!("netsplit report:");
    eprintln!("  drained after {drained:.1} s; orders {orders}; ledger {ledger_rows}, invoices {invoice_rows}; not exactly once {not_once}; out of order {out_of_order}; parked {parked}; dead letters {dead}");
    for (name, w) in [("orders", &wire_orders), ("invoices", &wire_invoices)] {
        eprintln!(
            "  wire {name:<8} {} records, {} distinct, {} missing, {} first seen out of order",
            w.records,
            w.distinct,
            w.missing,
            w.out_of_order.len()
        );
        for line in w.out_of_order.iter().take(10) {
            eprintln!("    {line}");
        }
    }
    assert_eq!(
        not_once, 0,
        "orders without exactly one ledger row and invoice"
    );
    assert_eq!((ledger_rows, invoice_rows), (orders as i64, orders as i64));
    assert_eq!(out_of_order, 0, "effects out of per-customer order");
    assert_eq!((parked, dead), (0, 0), "parked or dead-lettered");
    for (name, w) in [("orders", &wire_orders), ("invoices", &wire_invoices)] {
        assert_eq!(w.missing, 0, "{name}: missing on the wire");
        assert!(
            w.out_of_order.is_empty(),
            "{name}: order broken on the wire"
        );
    }
    assert_eq!(leases_moved, 0, "a slow link moved key partitions");
    assert_eq!(takeovers, 0, "a slow link moved consumer partitions");
    assert_eq!(leases_moved_long, 0, "a long link moved key partitions");
    assert_eq!(takeovers_long, 0, "a long link moved consumer partitions");
    assert!(
        far_rtt >= near_rtt + LONG_LINK * 2,
        "the proxy added its delay ({near_rtt:?} near, {far_rtt:?} far)"
    );
    drop((relay2_db, cons2_db));
}
